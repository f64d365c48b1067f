"""zc-lb: a résumé-based load balancer for WSGI applications."""

__version__ = "0.1.0"
