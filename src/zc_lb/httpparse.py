"""The request head, read and checked against RFC 9110/9112; no I/O.

Theory of operation
-------------------

The front server (http.py) reads a request line and field lines and hands
them here.  ``parse_request_line`` and ``read_fields`` apply the grammar
(token methods and field names, no control bytes anywhere, one SP between
the parts of the request line, ``HTTP/DIGIT.DIGIT``); ``check_head`` then
applies the rules that span fields and returns a ``RequestHead`` whose
target is always origin-form (or ``*``), whose Host is the one the
request means, and whose framing is unambiguous.  Anything else raises
``BadRequest`` with the status to answer, after which the connection is
closed: a peer that broke the grammar once cannot be trusted to frame the
next request.

Decisions (README.rst, "The HTTP front", says the same to operators):

- line endings: CRLF, or a bare LF (RFC 9112 2.2 allows it); a CR
  anywhere else is refused;
- request-target: origin-form; absolute-form (http or https) is rewritten
  to path + query, and its authority replaces the Host field (RFC 9112
  3.2.2); asterisk-form only with OPTIONS; authority-form only with
  CONNECT, which is refused with 501 like every upgrade (we proxy no
  tunnels); a fragment is cut off; only printable ASCII is accepted, and
  ``%`` in the path must start a valid escape (the query, passed through
  untouched, may hold a lone ``%``);
- versions: HTTP/1.0 and HTTP/1.1; HTTP/1.2-1.9 are served as 1.1 (RFC
  9110 2.5); other majors get 505;
- one Host field, required in HTTP/1.1, and it must be a valid uri-host
  [":" port];
- Content-Length: 1*DIGIT, or a list of identical values; never with
  Transfer-Encoding; Transfer-Encoding is ``chunked`` alone (another
  coding before it: 501; not last, or twice: 400), and never in HTTP/1.0;
- ``Connection`` cannot make Host, Content-Length or Transfer-Encoding
  hop-by-hop: those tokens are dropped from it;
- size: at most ``MAX_FIELDS`` field lines of ``MAX_FIELD_LINE`` bytes,
  and ``MAX_HEAD`` bytes in all, else 431.  ``MAX_HEAD`` is chosen so
  that the environ built from the largest head still fits one Request
  frame (protocol.MAX_MESSAGE), since the LB forwards it in one.

Weak spot, admitted: chunked trailers are read and discarded by pywsgi's
body reader, never parsed here; since no trailer reaches the worker, a
forbidden one (Content-Length, Host...) can do no harm.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

from .errors import BadRequest

MAX_FIELDS = 100
MAX_FIELD_LINE = 8190
MAX_HEAD = 64 * 1024  # twice this (JSON escapes) fits protocol.MAX_MESSAGE

TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z")
REQUEST_LINE = re.compile(rb"([^ ]*) ([^ ]*) ([^ \r\n]*)\r?\n\Z")
VERSION = re.compile(rb"HTTP/([0-9])\.([0-9])\Z")
TARGET = re.compile(rb"[\x21-\x7e]+\Z")
BAD_PERCENT = re.compile(rb"%(?![0-9A-Fa-f]{2})")
FIELD_VALUE_BAD = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
ABSOLUTE = re.compile(rb"([A-Za-z][A-Za-z0-9+.\-]*)://([^/?#]*)(.*)\Z", re.S)
HOST = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9\-._~!$&'()*+,;=%]*)(:[0-9]*)?\Z")
DIGITS = re.compile(r"[0-9]+\Z")
HUGE = 10**18  # a longer Content-Length is only ever too large (413)
PROTECTED = frozenset(("host", "content-length", "transfer-encoding"))
UPGRADES = frozenset(("CONNECT",))
# Headers about one hop, never forwarded (RFC 9110 7.6.1).
HOP_BY_HOP = frozenset((
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
    "te", "trailer", "trailers", "transfer-encoding", "upgrade",
))


@dataclass
class RequestHead:
    """A checked request head: what the WSGI environ is built from."""

    method: str
    path: str  # origin-form path and query, or "*"
    version: str  # "HTTP/1.0" or "HTTP/1.1"
    fields: List[Tuple[str, str]]
    content_length: Optional[int] = None
    chunked: bool = False
    close: bool = False


def parse_request_line(line: bytes) -> Tuple[str, bytes, str]:
    """(method, raw target, version) of a request line, CRLF included."""
    match = REQUEST_LINE.match(line)
    if match is None:
        raise BadRequest("malformed request line %r" % line[:100])
    method, target, version = match.groups()
    if not TOKEN.match(method):
        raise BadRequest("invalid method %r" % method[:40])
    if not TARGET.match(target):
        raise BadRequest("invalid request-target %r" % target[:100])
    return method.decode("ascii"), target, _version(version)


def _version(text: bytes) -> str:
    match = VERSION.match(text)
    if match is None:
        raise BadRequest("invalid HTTP version %r" % text[:20])
    major, minor = match.groups()
    if major != b"1":
        raise BadRequest("HTTP version %r not supported" % text.decode(), 505)
    return "HTTP/1.0" if minor == b"0" else "HTTP/1.1"


def read_fields(readline: Callable[[int], bytes], budget: int) -> List[Tuple[str, str]]:
    """Field lines up to the empty line, from ``readline(limit)``; at most
    ``budget`` bytes in all."""
    fields: List[Tuple[str, str]] = []
    while True:
        line = readline(min(MAX_FIELD_LINE + 2, budget + 1))
        budget -= len(line)
        if budget < 0 or (len(line) > MAX_FIELD_LINE and not line.endswith(b"\n")):
            raise BadRequest("request head too large", 431)
        if line in (b"\r\n", b"\n"):
            return fields
        if not line.endswith(b"\n"):
            raise ConnectionAbortedError("connection closed in the request head")
        if len(fields) >= MAX_FIELDS:
            raise BadRequest("more than %d header fields" % MAX_FIELDS, 431)
        fields.append(_field(line))


def _field(line: bytes) -> Tuple[str, str]:
    name, sep, value = line.partition(b":")
    if not sep or not TOKEN.match(name):
        raise BadRequest("invalid header line %r" % line[:80])
    value = value[:-2] if value.endswith(b"\r\n") else value[:-1]
    value = value.strip(b" \t")
    if FIELD_VALUE_BAD.search(value):
        raise BadRequest("control character in header %r" % name.decode("ascii"))
    return name.decode("ascii"), value.decode("latin-1")


def check_head(method: str, target: bytes, version: str,
               fields: List[Tuple[str, str]]) -> RequestHead:
    """The request head these parts make, or BadRequest."""
    if method in UPGRADES:
        raise BadRequest("%s is not supported" % method, 501)
    path, authority = _target(method, target)
    head = RequestHead(method, path, version, list(fields))
    _check_host(head, authority)
    _check_connection(head)
    _check_framing(head)
    return head


def _target(method: str, target: bytes) -> Tuple[str, Optional[str]]:
    """(origin-form path and query, authority of an absolute-form or None)."""
    authority = None
    if target == b"*":
        if method != "OPTIONS":
            raise BadRequest("asterisk-form target with %s" % method)
        return "*", None
    if not target.startswith(b"/"):
        match = ABSOLUTE.match(target)
        if match is None:
            raise BadRequest("invalid request-target %r" % target[:100])
        scheme, host, target = match.groups()
        if scheme.lower() not in (b"http", b"https") or not host or b"@" in host:
            raise BadRequest("invalid absolute-form target")
        authority = host.decode("ascii")
        target = target if target.startswith(b"/") else b"/" + target
    target = target.split(b"#", 1)[0]
    if BAD_PERCENT.search(target.split(b"?", 1)[0]):
        raise BadRequest("invalid percent-encoding in %r" % target[:100])
    return target.decode("ascii"), authority


def _named(head: RequestHead, name: str) -> List[str]:
    return [value for key, value in head.fields if key.lower() == name]


def _replace(head: RequestHead, name: str, values: List[str]) -> None:
    """Put ``values`` in place of the fields called ``name``."""
    kept = [(k, v) for k, v in head.fields if k.lower() != name]
    head.fields = kept + [(name.title(), value) for value in values]


def _check_host(head: RequestHead, authority: Optional[str]) -> None:
    hosts = _named(head, "host")
    if len(hosts) > 1:
        raise BadRequest("%d Host header fields" % len(hosts))
    if not hosts and head.version == "HTTP/1.1":
        raise BadRequest("no Host header field in an HTTP/1.1 request")
    if authority is not None:
        hosts = [authority]  # RFC 9112 3.2.2: the target's authority wins
        _replace(head, "host", hosts)
    if hosts and not HOST.match(hosts[0]):
        raise BadRequest("invalid Host %r" % hosts[0][:100])


def _tokens(values: List[str]) -> List[str]:
    """The elements of a comma-separated list, lower-cased, empties dropped."""
    return [t.strip(" \t").lower() for v in values for t in v.split(",") if t.strip(" \t")]


def _check_connection(head: RequestHead) -> None:
    tokens = _tokens(_named(head, "connection"))
    if "upgrade" in tokens or _named(head, "upgrade"):
        raise BadRequest("protocol upgrades are not supported", 501)
    kept = [t for t in tokens if t not in PROTECTED]
    if len(kept) != len(tokens):
        _replace(head, "connection", [", ".join(kept)] if kept else [])
    if head.version == "HTTP/1.1":
        head.close = "close" in kept
    else:
        head.close = "keep-alive" not in kept


def _check_framing(head: RequestHead) -> None:
    lengths = _named(head, "content-length")
    codings = _named(head, "transfer-encoding")
    if codings:
        if head.version == "HTTP/1.0":
            raise BadRequest("Transfer-Encoding in an HTTP/1.0 request")
        if lengths:
            raise BadRequest("both Content-Length and Transfer-Encoding")
        _check_codings(_tokens(codings))
        head.chunked = True
        _replace(head, "transfer-encoding", ["chunked"])
    elif lengths:
        values = {element.strip(" \t") for value in lengths for element in value.split(",")}
        if not all(DIGITS.match(v) for v in values):
            raise BadRequest("invalid Content-Length %r" % ", ".join(lengths)[:100])
        numbers = {v.lstrip("0") or "0" for v in values}
        if len(numbers) != 1:
            raise BadRequest("different Content-Lengths %r" % ", ".join(lengths)[:100])
        number = numbers.pop()
        head.content_length = int(number) if len(number) < 19 else HUGE
        _replace(head, "content-length", [str(head.content_length)])


def _check_codings(codings: List[str]) -> None:
    if not codings or codings[-1] != "chunked" or codings.count("chunked") > 1:
        raise BadRequest("Transfer-Encoding %r does not end in one chunked"
                         % ", ".join(codings)[:100])
    if not all(TOKEN.match(c.encode("latin-1")) for c in codings):
        raise BadRequest("invalid transfer coding in %r" % ", ".join(codings)[:100])
    if len(codings) > 1:
        raise BadRequest("unsupported transfer coding %r" % codings[0], 501)
