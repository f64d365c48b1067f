"""The front: clients' HTTP/1.1 connections, up to the LB.

``server`` accepts them (TLS, the PROXY protocol, limits), ``client`` is
one client connection (its requests read, checked and handed to the LB,
its responses written), ``transport`` its socket's reads, writes and
parking, ``body`` a request's body as the application reads it, ``h1`` and ``httpparse`` read and check request
heads and write response heads without I/O, ``forwarding`` says what the
application learns of the client, ``proxyproto`` reads HAProxy's PROXY
header, ``accesslog`` writes the access log, ``pages`` holds the pages
the front and the LB answer with themselves, and ``forwarder`` declares
how the front calls the LB.
"""
