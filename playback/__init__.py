"""Replay real access logs against a live deployment, and compare balancers.

Modules: ``logparse`` (log lines -> entries), ``pacing`` (log time ->
send time), ``httpclient`` (keep-alive client on gevent sockets),
``replay`` (the engine and the ``replay.py`` command), ``report``
(recording and reports), ``cacheapp`` (a working-set model WSGI app),
``locustfile`` (the replay under Locust).
"""
