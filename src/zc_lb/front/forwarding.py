"""Forwarding headers: what the application learns of the client.

Behind a proxy, an application sees the proxy's address, not the
client's.  The de facto headers tell it (nginx, HAProxy and Werkzeug's
ProxyFix read them the same way):

``X-Forwarded-For``
    the client's address is appended to whatever list came in, so the
    last value is always the address the LB saw; an application that
    trusts one proxy (ProxyFix's ``x_for=1``) reads that one, and a
    client's forged value before it is harmless.
``X-Forwarded-Proto``, ``X-Forwarded-Host``
    the scheme the client used and the Host it sent, overwriting what
    the client said, unless it is a trusted proxy (``trusted``: an LB
    behind another proxy keeps what that proxy set).
``X-Request-ID``
    a random id when the request has none, for the access log and the
    application's own logs to share.

Which of them the LB sets is ``headers`` (``--forwarded``).  The work is
a pass over the head's fields per request; whether the peer is trusted
is worked out once per connection.
"""

from __future__ import annotations

import ipaddress
import os
from typing import Dict, Final, Iterable, List, Optional, Tuple, Union

from zc_lb.errors import ConfigurationError

HEADERS: Final = ("for", "proto", "host", "request-id")
Network = Union[ipaddress.IPv4Network, ipaddress.IPv6Network]


def parse_headers(text: str) -> frozenset:
    """``for,proto,host,request-id`` (any of them), or ``none``."""
    names = {name.strip().lower() for name in text.split(",") if name.strip()}
    if names == {"none"}:
        return frozenset()
    unknown = names - set(HEADERS)
    if unknown:
        raise ConfigurationError("--forwarded: unknown %s (known: %s, or none)"
                                 % (", ".join(sorted(unknown)), ",".join(HEADERS)))
    return frozenset(names)


def parse_networks(texts: Iterable[str]) -> List[Network]:
    """Addresses or CIDR networks (``10.0.0.0/8``, ``::1``)."""
    networks = []
    for text in texts:
        for part in text.split(","):
            if part.strip():
                try:
                    networks.append(ipaddress.ip_network(part.strip(), strict=False))
                except ValueError as exc:
                    raise ConfigurationError("--trusted-proxies %r: %s" % (part.strip(), exc))
    return networks


class Forwarding:
    """Sets the forwarding headers in the variables a worker gets."""

    def __init__(self, headers: Iterable[str] = HEADERS,
                 trusted: Iterable[Network] = ()) -> None:
        names = frozenset(headers)
        self.set_for = "for" in names
        self.set_proto = "proto" in names
        self.set_host = "host" in names
        self.set_request_id = "request-id" in names
        self.trusted = list(trusted)

    def __bool__(self) -> bool:
        return self.set_for or self.set_proto or self.set_host or self.set_request_id

    def trusts(self, address: Optional[str]) -> bool:
        """Whether the peer at ``address`` is a trusted proxy."""
        if not self.trusted or not address:
            return False
        try:
            ip = ipaddress.ip_address(address.split("%", 1)[0])
        except ValueError:
            return False
        return any(ip in network for network in self.trusted)

    def fields(self, fields: List[Tuple[str, str]], client: Optional[str], trusted: bool,
               scheme: str) -> Tuple[List[Tuple[str, str]], List[Tuple[str, str]]]:
        """The headers set for a request from ``client`` (the peer's
        address; ``trusted``: a trusted proxy) over ``scheme``, with the
        head's ``fields``: those kept (``fields`` itself when none is
        replaced, as for most requests) and those added
        (tests/test_relay.py states the rules over the variables too)."""
        found: Optional[Dict[str, List[str]]] = None  # the forwarding fields sent, by name
        for name, value in fields:
            if name[:2] in ("X-", "x-") and name.lower() in FIELDS:
                if found is None:
                    found = {}
                found.setdefault(name.lower(), []).append(value)
        sent: Dict[str, List[str]] = NOTHING_SENT if found is None else found
        kept: List[str] = []  # (the names of those sent that are kept as they are)
        extra: List[Tuple[str, str]] = []
        if self.set_for and client:
            previous = ",".join(sent["x-forwarded-for"]) if "x-forwarded-for" in sent else ""
            extra.append(("X-Forwarded-For", "%s, %s" % (previous, client) if previous
                          else client))
        else:
            kept.append("x-forwarded-for")
        if self.set_proto and not (trusted and "x-forwarded-proto" in sent):
            extra.append(("X-Forwarded-Proto", scheme))
        else:
            kept.append("x-forwarded-proto")
        if self.set_host and not (trusted and "x-forwarded-host" in sent):
            for name, value in fields:
                if len(name) == 4 and name.lower() == "host":  # (check_head leaves one)
                    extra.append(("X-Forwarded-Host", value))
        else:
            kept.append("x-forwarded-host")
        if self.set_request_id and not (
                "x-request-id" in sent and ",".join(sent["x-request-id"])):
            extra.append(("X-Request-ID", _RANDOM.request_id()))
        else:
            kept.append("x-request-id")
        if found is not None and not all(name in kept for name in found):
            fields = [(n, v) for n, v in fields if n.lower() not in found or n.lower() in kept]
        return fields, extra


# The forwarding fields, as ``fields`` finds them among a head's.
FIELDS: Final = frozenset(("x-forwarded-for", "x-forwarded-proto", "x-forwarded-host",
                           "x-request-id"))
NOTHING_SENT: Final[Dict[str, List[str]]] = {}  # (never changed)
RANDOM_BATCH: Final = 4096  # bytes drawn from the OS at once: 256 request ids


class _Randomness:
    """Random bytes from the OS, drawn ``RANDOM_BATCH`` at a time: a
    system call per 256 request ids rather than one each.  A forked
    child forgets what its parent drew, so that no two processes hand
    out the same ids."""

    def __init__(self) -> None:
        self.drawn = b""
        self.used = 0

    def request_id(self) -> str:
        """128 random bits, as 32 hex digits."""
        start = self.used
        if start + 16 > len(self.drawn):
            self.drawn, start = os.urandom(RANDOM_BATCH), 0
        self.used = start + 16
        return self.drawn[start:start + 16].hex()

    def forget(self) -> None:
        self.drawn, self.used = b"", 0


_RANDOM: Final = _Randomness()
os.register_at_fork(after_in_child=_RANDOM.forget)
