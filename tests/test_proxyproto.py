"""proxyproto.py: PROXY protocol v1 and v2 headers; the front server's
read of one, in process."""

import socket
import struct

import pytest

from zc_lb.errors import BadRequest
from zc_lb.front.proxyproto import V2_SIGNATURE, header_length, parse

V1 = b"PROXY TCP4 203.0.113.7 198.51.100.1 56324 443\r\n"


def v2(command=1, family=0x11, body=None):
    if body is None:
        body = (socket.inet_aton("203.0.113.7") + socket.inet_aton("198.51.100.1")
                + struct.pack("!HH", 56324, 443))
    return V2_SIGNATURE + bytes([0x20 | command, family]) + struct.pack("!H", len(body)) + body


def test_v1_length_shows_at_its_crlf_and_not_before():
    for end in range(1, len(V1)):
        assert header_length(V1[:end]) is None
    assert header_length(V1 + b"GET / HTTP/1.1\r\n") == len(V1)
    assert parse(V1) == ("203.0.113.7", 56324)
    assert parse(b"PROXY TCP6 2001:db8::1 2001:db8::2 1 2\r\n") == ("2001:db8::1", 1)
    assert parse(b"PROXY UNKNOWN\r\n") is None
    assert parse(b"PROXY UNKNOWN ignored stuff\r\n") is None


def test_v2_length_comes_from_its_fixed_part():
    header = v2()
    for end in range(1, 16):
        assert header_length(header[:end]) is None
    assert header_length(header[:16]) == len(header) == 28
    assert parse(header) == ("203.0.113.7", 56324)
    six = socket.inet_pton(socket.AF_INET6, "2001:db8::7")
    assert parse(v2(family=0x21, body=six + six + struct.pack("!HH", 7, 8))) == (
        "2001:db8::7", 7)
    assert parse(v2(command=0)) is None  # LOCAL: the proxy's own health check
    assert parse(v2(family=0x00, body=b"")) is None  # UNSPEC


@pytest.mark.parametrize("data", [
    b"GET / HTTP/1.1\r\n", b"\x16\x03\x01", b"PROXY TCP4 1.2.3.4 5.6.7.8 1\r\n",
    b"PROXY TCP4 1.2.3.4 5.6.7.8 x 2\r\n", b"PROXY TCP4 ::1 ::1 1 2\r\n",
    b"PROXY TCP5 1.2.3.4 5.6.7.8 1 2\r\n", b"PROXY TCP4 1.2.3.4 5.6.7.8 70000 2\r\n",
    b"PROXY " + b"x" * 200,
    # an IPv6 zone may be any text: a newline, a comma, an escape sequence
    # went into REMOTE_ADDR, X-Forwarded-For and the access log
    b"PROXY TCP6 fe80::1%\nX ::1 1 2\r\n", b"PROXY TCP6 fe80::1%,6.6.6.6 ::1 1 2\r\n",
    b"PROXY TCP6 ::1 fe80::1%\x1b[2J 1 2\r\n",
])
def test_what_is_not_a_header_is_refused(data):
    with pytest.raises(BadRequest):
        length = header_length(data)
        assert length is not None
        parse(data[:length])


def test_bad_v2_headers_are_refused():
    with pytest.raises(BadRequest):
        parse(V2_SIGNATURE + bytes([0x31, 0x11]) + b"\x00\x00")  # version 3
    with pytest.raises(BadRequest):
        parse(v2(body=b"\x01\x02"))  # AF_INET, 2 bytes of addresses
    for family in (0x10, 0x13, 0x1F, 0x01, 0x30, 0x33):  # undefined: to be refused
        with pytest.raises(BadRequest):
            parse(v2(family=family))


def test_a_proxy_header_trickling_in_or_never_sent_is_cut_or_makes_room():
    # (each read had the timeout, not the header; and a connection in its
    # header could not be evicted to make room past --max-connections)
    import gevent
    import gevent.socket
    from test_tls import trickled_until_closed
    from zc_lb.front.server import FrontServer

    def app(environ, start_response):
        body = environ["REMOTE_ADDR"].encode()
        start_response("200 OK", [("Content-Length", str(len(body)))])
        return [body]

    front = FrontServer(("127.0.0.1", 0), app, header_timeout=1.0, proxy_protocol=True,
                        max_connections=1)
    front.start()
    try:
        closed = trickled_until_closed(front.address, V1)
        assert closed is not None and closed < 2.0, closed
        silent = gevent.socket.create_connection(front.address)
        gevent.sleep(0.7)  # past EVICT_AFTER
        newcomer = gevent.socket.create_connection(front.address, timeout=5)
        newcomer.sendall(V1 + b"GET / HTTP/1.1\r\nHost: a\r\n\r\n")
        assert newcomer.recv(65536).endswith(b"\r\n\r\n203.0.113.7")
        assert silent.recv(1) == b""
    finally:
        front.stop(timeout=0.5)
