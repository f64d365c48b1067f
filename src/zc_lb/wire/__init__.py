"""The LB<->worker protocol: multiplexed requests over long-lived links.

``frames`` says what the bytes are (the messages), ``encoder`` and
``decoder`` turn messages into bytes and back, ``handshake`` opens a
link, ``stream`` is one request on it, ``protocol`` is the state of one
link without I/O (bytes in, events out), and ``connection`` pumps a
socket into it under gevent.
"""
