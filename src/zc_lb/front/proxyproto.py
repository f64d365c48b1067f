"""The PROXY protocol (HAProxy's, versions 1 and 2): who the client is,
behind a TCP proxy or load balancer that does not speak HTTP.

With ``--proxy-protocol``, every connection to the front must begin with
a PROXY header, which the proxy in front (HAProxy's ``send-proxy``, an
AWS Network Load Balancer, ...) writes before the client's bytes: then
the client's address, not the proxy's, is ``REMOTE_ADDR`` and goes into
``X-Forwarded-For``.  A connection without a valid header is closed: the
address of a client that could skip the header would be whatever it
claimed.  Version 1 is a text line (``PROXY TCP4 192.0.2.1 198.51.100.1
56324 443\\r\\n``, at most 107 bytes), version 2 a binary block after a
12-byte signature.  ``UNKNOWN`` (v1) and ``LOCAL`` (v2, the proxy's own
health checks) keep the connection's own address.

The parsing is pure: ``header_length`` says how many bytes of what has
come make the header (so that the front reads exactly those, and not the
first bytes of a TLS handshake after them), and ``parse`` reads them.
"""

from __future__ import annotations

import ipaddress
import struct
from typing import Optional, Tuple

from zc_lb.errors import BadRequest

V1_PREFIX = b"PROXY "
V1_MAX = 107  # bytes of a version 1 line, CRLF included
V2_SIGNATURE = b"\r\n\r\n\x00\r\nQUIT\n"
V2_FIXED = 16  # the signature, version and command, family, length
V2_MAX = V2_FIXED + 65535
# The family and protocol bytes the specification defines: UNSPEC; TCP and
# UDP over IPv4, IPv6 and UNIX sockets
V2_FAMILIES = frozenset((0x00, 0x11, 0x12, 0x21, 0x22, 0x31, 0x32))
Address = Optional[Tuple[str, int]]  # None: the connection's own


def header_length(data: bytes) -> Optional[int]:
    """The header's length in bytes, if ``data`` (its start) shows it; None
    if more must come; BadRequest if it cannot be a PROXY header."""
    if data[:len(V2_SIGNATURE)] == V2_SIGNATURE[:len(data)]:
        if len(data) < V2_FIXED:
            return None
        return V2_FIXED + struct.unpack_from("!H", data, 14)[0]
    if data[:len(V1_PREFIX)] != V1_PREFIX[:len(data)]:
        raise BadRequest("no PROXY protocol header")
    end = data.find(b"\r\n", 0, V1_MAX)
    if end >= 0:
        return end + 2
    if len(data) >= V1_MAX:
        raise BadRequest("PROXY protocol line longer than %d bytes" % V1_MAX)
    return None


def parse(header: bytes) -> Address:
    """The client's (address, port) in a whole header; None for UNKNOWN
    or LOCAL; BadRequest if it is malformed."""
    if header.startswith(V2_SIGNATURE):
        return _parse_v2(header)
    return _parse_v1(header)


def _parse_v1(header: bytes) -> Address:
    parts = header[len(V1_PREFIX):-2].split(b" ")
    if parts[:1] == [b"UNKNOWN"]:
        return None
    if len(parts) != 5 or parts[0] not in (b"TCP4", b"TCP6"):
        raise BadRequest("malformed PROXY protocol line %r" % header[:V1_MAX])
    if b"%" in parts[1] or b"%" in parts[2]:  # (an IPv6 zone: any text, newlines too)
        raise BadRequest("malformed PROXY protocol line %r" % header[:V1_MAX])
    try:
        source = ipaddress.ip_address(parts[1].decode("ascii"))
        ipaddress.ip_address(parts[2].decode("ascii"))
        port = int(parts[3])
        int(parts[4])
    except (ValueError, UnicodeDecodeError):
        raise BadRequest("malformed PROXY protocol line %r" % header[:V1_MAX])
    if source.version != (4 if parts[0] == b"TCP4" else 6) or not 0 <= port <= 65535:
        raise BadRequest("malformed PROXY protocol line %r" % header[:V1_MAX])
    return str(source), port


def _parse_v2(header: bytes) -> Address:
    version_command, family = header[12], header[13]
    if version_command >> 4 != 2 or version_command & 0x0F not in (0, 1):
        raise BadRequest("unsupported PROXY protocol v2 version or command")
    if version_command & 0x0F == 0:  # LOCAL: the proxy speaking for itself
        return None
    body = header[V2_FIXED:]
    if family not in V2_FAMILIES:  # (the others "must be rejected as invalid")
        raise BadRequest("PROXY protocol v2 family and protocol 0x%02x undefined" % family)
    if family >> 4 == 1 and len(body) >= 12:  # AF_INET: src, dst, sport, dport
        return str(ipaddress.IPv4Address(body[:4])), struct.unpack_from("!H", body, 8)[0]
    if family >> 4 == 2 and len(body) >= 36:  # AF_INET6
        return str(ipaddress.IPv6Address(body[:16])), struct.unpack_from("!H", body, 32)[0]
    if family >> 4 in (0, 3):  # AF_UNSPEC, AF_UNIX: no address to give
        return None
    raise BadRequest("malformed PROXY protocol v2 addresses")
