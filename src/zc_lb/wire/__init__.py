"""The LB<->worker protocol: multiplexed requests over long-lived links.

Without I/O: ``frames`` says what the bytes are (the messages),
``encoder`` and ``decoder`` turn messages into bytes and back,
``handshake`` opens a link, ``stream`` is one request on it,
``protocol`` is the state of one link (bytes in, events out) and
``keepalive`` judges whether its peer lives.  Under gevent:
``connection`` pumps a socket into the protocol, ``writer`` sends what
it queues, and ``exchange`` is one request in flight for the greenlet
that owns it.
"""
