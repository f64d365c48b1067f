"""What an LB shows of itself: ``document`` (the status document, JSON
or a table), ``page`` (the same as HTML) and ``metrics`` (Prometheus)."""
