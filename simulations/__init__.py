"""Discrete-event simulations of zc-lb's routing, on virtual time.

The simulator drives the real :class:`zc_lb.routing.pool.Pool` (and
``ClasslessPool``) and a few classic policies over the same workload, and
reports cache misses, latency, throughput, working-set overlap and load
imbalance.  See ``simulations/README.rst``.
"""
