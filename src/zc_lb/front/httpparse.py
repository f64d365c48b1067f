"""The rules across a request head's fields; no I/O.

Theory of operation
-------------------

front/h1.py parses a request with llhttp, whose grammar is strict (token
methods and field names, no control bytes, ``HTTP/DIGIT.DIGIT``, CRLF
line ends); ``check_head`` then applies the rules that span fields to
what it parsed and returns a ``RequestHead`` whose target is always
origin-form (or ``*``), whose Host is the one the request means, and
whose framing is unambiguous.  Anything else raises ``BadRequest`` with
the status to answer, after which the connection is closed: a peer that
broke the grammar once cannot be trusted to frame the next request.

Decisions (docs/reference/http.rst says the same to operators):

- line endings: CRLF (llhttp refuses a bare LF, which RFC 9112 2.2
  would allow);
- request-target: origin-form; absolute-form (http or https) is rewritten
  to path + query, and its authority replaces the Host field (RFC 9112
  3.2.2); asterisk-form only with OPTIONS; authority-form only with
  CONNECT, which is refused with 501 like every upgrade (we proxy no
  tunnels); a fragment is cut off (right after an absolute-form's host,
  with no path, it is 400, as llhttp has it); only printable ASCII is
  accepted, and ``%`` in the path must start a valid escape (the query, passed through
  untouched, may hold a lone ``%``);
- versions: HTTP/1.0 and HTTP/1.1; HTTP/1.2-1.9 are served as 1.1 (RFC
  9110 2.5); other majors get 505;
- one Host field, required in HTTP/1.1, and it must be a valid uri-host
  [":" port];
- Content-Length: 1*DIGIT in one field (llhttp refuses a list or a
  repeat, even of identical values); never with
  Transfer-Encoding; Transfer-Encoding is ``chunked`` alone (another
  coding before it: 501; not last, or twice: 400), and never in HTTP/1.0;
- ``Connection`` cannot make Host, Content-Length or Transfer-Encoding
  hop-by-hop: those tokens are dropped from it;
- size: at most ``MAX_FIELDS`` field lines of ``MAX_FIELD_LINE`` bytes,
  and ``MAX_HEAD`` bytes in all, else 431 (front/h1.py counts them as llhttp
  hands them over).  ``MAX_HEAD`` is chosen so
  that the environ built from the largest head still fits one Request
  frame (frames.MAX_MESSAGE), since the LB forwards it in one.

- a singleton field (``SINGLETONS``: Content-Type, Authorization,
  Range...) sent twice with different values is 400; the same value
  twice is kept once (RFC 9110 5.3);
- chunked trailers are parsed by llhttp and dropped by front/h1.py (none
  reaches the worker), but one that may not be a trailer
  (``NOT_IN_TRAILERS``: Host, framing, authentication, request
  modifiers, content format; RFC 9110 6.5.1) makes the request 400; a
  trailer section has a head's size limits (431).
"""

from __future__ import annotations

import re
from typing import Dict, Final, List, Optional, Tuple

from zc_lb.errors import BadRequest

MAX_FIELDS: Final = 100
MAX_FIELD_LINE: Final = 8190
MAX_HEAD: Final = 64 * 1024  # twice this (JSON escapes) fits frames.MAX_MESSAGE

TOKEN: Final = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z")
TARGET: Final = re.compile(rb"[\x21-\x7e]+\Z")
BAD_PERCENT: Final = re.compile(r"%(?![0-9A-Fa-f]{2})")
ABSOLUTE: Final = re.compile(rb"([A-Za-z][A-Za-z0-9+.\-]*)://([^/?#]*)(.*)\Z", re.S)
HOST: Final = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9\-._~!$&'()*+,;=%]*)(:[0-9]*)?\Z")
DIGITS: Final = re.compile(r"[0-9]+\Z")
HUGE: Final = 10**18  # a longer Content-Length is only ever too large (413)
PROTECTED: Final = frozenset(("host", "content-length", "transfer-encoding"))
# Fields with one value (RFC 9110 5.3): sent twice with different values,
# the request is refused (the worker would read one, a cache another).
SINGLETONS: Final = frozenset((
    "content-type", "content-location", "content-range", "authorization",
    "proxy-authorization", "if-modified-since", "if-unmodified-since", "if-range",
    "max-forwards", "range", "referer", "user-agent", "from", "date"))
CHECKED: Final = frozenset(("host", "connection", "upgrade", "content-length",
                            "transfer-encoding")) | SINGLETONS
# Fields a chunked trailer may not hold (RFC 9110 6.5.1): framing, routing,
# authentication, request modifiers, content format.
NOT_IN_TRAILERS: Final = frozenset((
    "host", "content-length", "transfer-encoding", "content-type", "content-encoding",
    "content-range", "trailer", "te", "expect", "connection", "upgrade", "authorization",
    "proxy-authorization", "cookie", "range", "if-match", "if-none-match",
    "if-modified-since", "if-unmodified-since", "if-range", "max-forwards", "cache-control"))
UPGRADES: Final = frozenset(("CONNECT",))
# Headers about one hop, never forwarded (RFC 9110 7.6.1).
HOP_BY_HOP: Final = frozenset((
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
    "te", "trailer", "trailers", "transfer-encoding", "upgrade",
))


class RequestHead:
    """A checked request head: what the WSGI environ is built from.  (A
    plain class: compiled, a dataclass's generated __init__ is Python,
    0.9 us a request; this one is 0.37 called from Python, less from h1.)"""

    __slots__ = ("method", "path", "version", "fields", "content_length", "chunked", "close",
                 "raw")

    def __init__(self, method: str, path: str, version: str,
                 fields: List[Tuple[str, str]]) -> None:
        self.method = method
        self.path = path  # origin-form path and query, or "*"
        self.version = version  # "HTTP/1.0" or "HTTP/1.1"
        self.fields = fields
        self.content_length: Optional[int] = None
        self.chunked = False
        self.close = False
        # The head's bytes as they came, less the empty line, where they
        # say exactly what the fields do (front/h1.py's ``_simple``): lb/relay.py
        # sends them on as they are.
        self.raw: Optional[bytes] = None

    def __repr__(self) -> str:
        return "<RequestHead %s %s %s %r>" % (self.method, self.path, self.version, self.fields)


def check_head(method: str, target: bytes, version: str,
               fields: List[Tuple[str, str]]) -> RequestHead:
    """The request head these parts make, or BadRequest."""
    if method in UPGRADES:
        raise BadRequest("%s is not supported" % method, 501)
    path, authority = _target(method, target)
    named: Dict[str, List[str]] = {}  # the fields the rules read, in one pass
    repeated = False
    for name, value in fields:
        lowered = name.lower()
        if lowered in CHECKED:
            values = named.get(lowered)
            if values is None:
                named[lowered] = [value]
            else:
                values.append(value)
                repeated = True
    head = RequestHead(method, path, version, fields)
    _check_host(head, authority, named.get("host", []))
    _check_connection(head, named.get("connection"), "upgrade" in named)
    lengths, codings = named.get("content-length"), named.get("transfer-encoding")
    if lengths or codings:
        _check_framing(head, lengths or [], codings or [])
    if repeated:
        _check_singletons(head, named)
    return head


def _check_singletons(head: RequestHead, named: Dict[str, List[str]]) -> None:
    """A singleton field twice: the same value is kept once, another is 400."""
    for name in SINGLETONS.intersection(named):
        values = named[name]
        if len(values) > 1:
            if len(set(values)) > 1:
                raise BadRequest("%s sent %d times with different values"
                                 % (name.title(), len(values)))
            _replace(head, name, values[:1])


def check_trailer(name: str) -> None:
    """BadRequest if a chunked trailer may not hold the field ``name``."""
    if name.lower() in NOT_IN_TRAILERS:
        raise BadRequest("%s in a chunked trailer" % name)


def _target(method: str, target: bytes) -> Tuple[str, Optional[str]]:
    """(origin-form path and query, authority of an absolute-form or None)."""
    authority = None
    if target[:1] != b"/":
        if target == b"*":
            if method != "OPTIONS":
                raise BadRequest("asterisk-form target with %s" % method)
            return "*", None
        match = ABSOLUTE.match(target)
        if match is None:
            raise BadRequest("invalid request-target %r" % target[:100])
        scheme, host, target = match.groups()
        if scheme.lower() not in (b"http", b"https") or not host or b"@" in host:
            raise BadRequest("invalid absolute-form target")
        if target[:1] == b"#":  # (llhttp refuses a fragment right after the host)
            raise BadRequest("fragment after the host of an absolute-form target")
        authority = host.decode("ascii")
        target = target if target.startswith(b"/") else b"/" + target
    # As text from here: ``b"#" in target`` cost half a microsecond, as
    # bytes.__contains__ first tries its argument as an integer.
    path = target.decode("ascii")
    if "#" in path:
        path = path.split("#", 1)[0]
    if "%" in path and BAD_PERCENT.search(path.split("?", 1)[0]):
        raise BadRequest("invalid percent-encoding in %r" % target[:100])
    return path, authority


def _replace(head: RequestHead, name: str, values: List[str]) -> None:
    """Put ``values`` in place of the fields called ``name``."""
    kept = [(k, v) for k, v in head.fields if k.lower() != name]
    head.fields = kept + [(name.title(), value) for value in values]


def _check_host(head: RequestHead, authority: Optional[str], hosts: List[str]) -> None:
    if len(hosts) > 1:
        raise BadRequest("%d Host header fields" % len(hosts))
    if not hosts and head.version == "HTTP/1.1":
        raise BadRequest("no Host header field in an HTTP/1.1 request")
    if authority is not None:
        hosts = [authority]  # RFC 9112 3.2.2: the target's authority wins
        _replace(head, "host", hosts)
    if hosts and not matches(HOST, hosts[0], _VALID_HOSTS):
        raise BadRequest("invalid Host %r" % hosts[0][:100])


MAX_VALID: Final = 1024  # texts a memory of valid ones keeps (``matches``)
_VALID_HOSTS: Final[Dict[str, bool]] = {}  # a site has a few


def matches(pattern: "re.Pattern[str]", text: str, valid: Dict[str, bool]) -> bool:
    """Whether ``pattern`` matches ``text``: found in ``valid``, the texts
    that matched before (a site's hosts, an application's statuses and
    field names are few, and a match cost 0.4-0.7 us a request), or
    matched and then remembered there (at most MAX_VALID; full, the
    memory starts over)."""
    if text in valid:
        return True
    if not pattern.match(text):
        return False
    if len(valid) >= MAX_VALID:
        valid.clear()
    valid[text] = True
    return True


def _tokens(values: List[str]) -> List[str]:
    """The elements of a comma-separated list, lower-cased, empties dropped."""
    return [t.strip(" \t").lower() for v in values for t in v.split(",") if t.strip(" \t")]


def _check_connection(head: RequestHead, values: Optional[List[str]], upgrade: bool) -> None:
    tokens = _tokens(values) if values else []
    if upgrade or "upgrade" in tokens:
        raise BadRequest("protocol upgrades are not supported", 501)
    kept = [t for t in tokens if t not in PROTECTED]
    if len(kept) != len(tokens):
        _replace(head, "connection", [", ".join(kept)] if kept else [])
    if head.version == "HTTP/1.1":
        head.close = "close" in kept
    else:
        head.close = "keep-alive" not in kept


def _check_framing(head: RequestHead, lengths: List[str], codings: List[str]) -> None:
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
