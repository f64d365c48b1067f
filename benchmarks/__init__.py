"""The yardsticks, run from a checkout, not shipped with zc-lb: ``make
bench`` (bench.py: zc-lb against HAProxy and a bare proxy of its design,
floor.py, side by side in one run) and ``make soak`` (soak.py: hours of
traffic, memory watched)."""
