"""HTTP/1.1 requests from bytes, and response heads to bytes; no I/O.

Theory of operation
-------------------

``RequestReader`` takes the bytes a client sends (``receive_data``) and
hands out ``Request`` objects in order (``next_request``).  The grammar
and the framing are llhttp's (Node's C parser, through httptools), run
strict; the rules that span fields are ours, from front/httpparse.py
(``check_head``), applied to what llhttp parsed.  A head that comes
whole in one read and has the commonest shape (``_simple``: printable
ASCII, a common method, plain field names, no body or one of a plain
Content-Length) is split by hand instead, since llhttp's callbacks cost
a call a field, and its body is counted off the reads as they come,
since llhttp's copied it; what it accepts is a subset of llhttp's
grammar, and anything else goes to llhttp.  A
request is handed out as soon as its head is complete; its body arrives
in ``Request.body`` as more bytes are fed, and ``Request.complete`` says
when it has all come.  Pipelined requests queue up behind the one being
served; the reader is fed only when the server needs more (a head, or
body bytes the application asks for), so at most one read past the
current request is ever buffered.

A head the rules refuse becomes a ``Request`` whose ``refusal`` is the
``BadRequest`` to answer (400, 431, 501 or 505), after which the reader
is ``broken``: a client that broke the grammar once cannot be trusted to
frame the next request.  A broken body (a bad chunk) sets ``error`` on
its request and breaks the reader too.  Whether a request ends its
connection is its head's ``close`` alone (httpparse's): llhttp, strict,
reads Proxy-Connection as Connection and would refuse what follows.

``response_head`` turns a WSGI status and header list into the bytes of
a response head, refusing what would let a worker split a response.

Weak spots, admitted: llhttp knows methods by name (the IANA registry's),
so an unknown method token is refused with 400 where HTTP would allow it;
llhttp accepts more than one space between the parts of the request line.
Chunked trailers are parsed by llhttp and dropped: none reaches the
worker.  A trailer section is held to a head's limits (``MAX_FIELDS``
fields, ``MAX_FIELD_LINE`` bytes a field line, ``MAX_HEAD`` in all),
counted as it comes since llhttp keeps a field until its end: past
them, the body is refused with 431.
"""

from __future__ import annotations

import collections
import re
import time
from email.utils import formatdate
from typing import Any, Deque, Dict, Final, Iterable, List, Optional, Tuple
from urllib.parse import unquote_to_bytes

import httptools

from zc_lb.errors import BadRequest, BadResponseHead, ClientError, ClientGone, RequestTooLarge
from zc_lb.wire.handshake import HELLO_START
from zc_lb.front.httpparse import (HOP_BY_HOP, MAX_FIELD_LINE, MAX_FIELDS, MAX_HEAD, TARGET,
                        RequestHead, check_head, check_trailer, matches)

REQUEST_LINE_EXTRA: Final = len(b"  HTTP/1.1\r\n")  # what a request line adds to method and target
MAX_TARGET: Final = 8190  # a request line over 8 KiB is 414, as nginx and pywsgi have it
MAX_ENVIRON_KEYS: Final = 4096  # header names whose environ key is remembered
# A head of the commonest shape is read without llhttp (``_simple``):
SIMPLE_METHODS: Final = frozenset(("GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH"))
SIMPLE_VERSIONS: Final = frozenset(("HTTP/1.1", "HTTP/1.0"))
MAX_SIMPLE: Final = 8190  # bytes: within every limit on a head, its target and its field lines


class Request:
    """One request: its checked head (or why it is refused) and its body
    as it arrives."""

    __slots__ = ("head", "refusal", "body", "body_size", "complete", "error",
                 "expect_continue", "started")

    def __init__(self, head: Optional[RequestHead], refusal: Optional[ClientError] = None,
                 started: float = 0.0) -> None:
        self.head = head
        self.refusal = refusal
        self.body: Deque[bytes] = collections.deque()
        self.body_size = 0  # bytes in ``body``
        self.complete = False  # the whole body has been received
        self.error: Optional[ClientError] = None  # the body was malformed, or cut short
        self.expect_continue = False
        self.started = started  # when its first byte came (time.time(), if asked)

    def __repr__(self) -> str:
        if self.head is None:
            return "<Request refused %s>" % self.refusal
        return "<Request %s %s%s>" % (self.head.method, self.head.path,
                                      " complete" if self.complete else "")


class RequestReader:
    """Requests from the bytes of one client connection (see the module
    docstring).  ``clock``, if given, stamps each request's first byte."""

    def __init__(self, clock=None) -> None:
        self._parser = httptools.HttpRequestParser(self)
        # (lenient_keep_alive: the head's ``close`` says, see the module's docstring)
        self._parser.set_dangerous_leniencies(lenient_version=True, lenient_keep_alive=True)
        self._ready: List[Request] = []  # (a list: an empty deque takes 600 bytes)
        self._current: Optional[Request] = None  # the request whose body is coming
        self._clock = clock
        self._in_head = False
        self._head_bytes = 0  # fed while a head was open (bounds an unfinished one)
        self._url = b""
        self._fields: List[Tuple[bytes, bytes]] = []
        self._head_size = 0
        self._started = 0.0
        self._refusal: Optional[ClientError] = None
        self._counting = 0  # bytes to come of a body read without llhttp
        # A chunk's size line has come and none of its data: the trailer
        # section follows if it was the last chunk.  ``_trailer_bytes``:
        # what was fed since (bounds a trailer field that never ends).
        self._after_chunk_header = False
        self._trailer_bytes = 0
        self._trailer_fields = 0
        self._trailer_size = 0  # bytes of the trailer field lines parsed
        self.broken = False

    # -- what the server calls ------------------------------------------

    def receive_data(self, data: bytes) -> None:
        """Feed bytes from the client (b"" at its end of file)."""
        if self.broken:
            return
        if not data:
            self._end_of_file()
            return
        start = 0  # (what is read of ``data`` by hand, not by llhttp)
        while True:
            if self._counting:  # a body of a known length (see ``_simple``)
                start = self._count(data, start)
            elif self._in_head or self._current is not None:
                break
            else:
                end = data.find(b"\r\n\r\n", start, start + MAX_SIMPLE) + 4
                if end < 4 or not self._simple(data, start, end):
                    break
                start = end  # (most requests: see ``_simple``)
            if start == len(data):
                return
        if start:
            data = data[start:]
        if self._in_head:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD + MAX_FIELD_LINE:
                self._refuse(BadRequest("request head too large", 431))
                return
        elif self._after_chunk_header:
            self._trailer_bytes += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._refusal is None:  # check_head refuses every upgrade first
                self._refuse(BadRequest("protocol upgrades are not supported", 501))
        except httptools.HttpParserError as exc:
            self._parse_error(exc, data)
        else:
            # (None of it was a chunk's data: a trailer section's, past the limit.)
            if self._after_chunk_header and self._trailer_bytes > MAX_HEAD + MAX_FIELD_LINE:
                self._body_error(BadRequest("chunked trailer section too large", 431))

    def next_request(self) -> Optional[Request]:
        """The next request whose head is complete, or None (feed more)."""
        return self._ready.pop(0) if self._ready else None

    def _simple(self, data: bytes, start: int, end: int) -> bool:
        """Take the head from ``start`` to ``end`` in ``data`` as a request
        without llhttp if it has the commonest shape: printable ASCII, a
        method of ``SIMPLE_METHODS``, HTTP/1.1 or 1.0, field names of
        letters, digits and hyphens, values without tabs, and no body or
        a body of one plain Content-Length (digits only).  Its fields
        then go through ``check_head`` as llhttp's do.  Each of these is
        a grammar llhttp accepts, so the request is what llhttp would
        have made of it (tests/test_h1.py checks the corpus both ways),
        at less than half the cost of its callbacks: one call a field.
        Its body is then counted off the bytes as they come (``_count``)
        instead of going through llhttp, which copied every piece of it.
        Anything else, a request ``check_head`` refuses included, is
        left to llhttp (False), for its refusal."""
        parsed = _simple_head(data[start:end].decode("latin-1"))
        if parsed is None:
            return False
        method, target, version, fields = parsed
        try:
            head = check_head(method, target.encode("ascii"), version, fields)
        except BadRequest:
            return False
        if head.chunked:
            return False
        if head.fields is fields and head.path == target:  # (check_head changed nothing)
            head.raw = data[start:end - 2]
        request = Request(head, None, self._clock() if self._clock is not None else 0.0)
        self._ready.append(request)
        length = head.content_length
        if not length:
            request.complete = True
        else:
            request.expect_continue = _expects_continue(head)
            self._current, self._counting = request, length
        return True

    def _count(self, data: bytes, start: int) -> int:
        """Take what ``data`` has from ``start`` of the body being counted
        into its request; where the body's bytes end in ``data``."""
        current = self._current
        assert current is not None
        remaining = self._counting
        if start == 0 and len(data) <= remaining:
            piece = data  # (the commonest: a read within the body, kept as it came)
        else:
            piece = data[start:start + remaining]
        current.body.append(piece)
        current.body_size += len(piece)
        self._counting = remaining - len(piece)
        if not self._counting:
            current.complete = True
            self._current = None
        return start + len(piece)

    @property
    def in_head(self) -> bool:
        """Part of a request head has come, and not all of it."""
        return self._in_head

    def _end_of_file(self) -> None:
        current = self._current
        if current is not None and not current.complete:
            current.error = ClientGone("client closed the connection in the body")
        self.broken = True

    def _parse_error(self, exc: Exception, data: bytes) -> None:
        if self._refusal is not None:
            self._refuse(self._refusal)
            return
        if data.startswith(HELLO_START):  # (no client: an LB's link to a worker)
            self._refuse(BadRequest("a zc-lb LB's Hello, not HTTP: an LB has this HTTP "
                                    "port as a worker's address"))
            return
        reason = str(exc) or type(exc).__name__
        current = self._current
        if not self._in_head and current is not None and not current.complete:
            cause = exc.__context__  # (what a callback raised, for a trailer's field)
            self._body_error(cause if isinstance(cause, ClientError)
                             else BadRequest("malformed request body: %s" % reason))
            return
        if "Content-Length overflow" in reason:
            self._refuse(RequestTooLarge("Content-Length too large"))
            return
        status = 505 if "HTTP version" in reason else 400
        self._refuse(BadRequest("malformed request: %s" % reason, status))

    def _body_error(self, error: ClientError) -> None:
        """The body being read is malformed: its request's ``error``."""
        current = self._current
        if current is not None:
            current.error = error
        self.broken = True

    def _refuse(self, refusal: ClientError) -> None:
        self._ready.append(Request(None, refusal, self._started))
        self.broken = True

    # -- llhttp's callbacks (httptools calls them from feed_data) --------

    def on_message_begin(self) -> None:
        self._in_head = True
        self._head_bytes = 0
        self._url = b""
        self._fields = []
        self._head_size = 0
        self._refusal = None
        self._trailer_fields = self._trailer_size = 0
        self._started = self._clock() if self._clock is not None else 0.0

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > MAX_TARGET:
            self._refusal = BadRequest("request target over %d bytes" % MAX_TARGET, 414)
            raise self._refusal

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._in_head:  # a chunked trailer: checked, counted, dropped
            check_trailer(name.decode("latin-1"))  # (BadRequest: the body is malformed)
            line = len(name) + len(value) + 2
            self._trailer_fields += 1
            self._trailer_size += line + 2
            if (line > MAX_FIELD_LINE or self._trailer_size > MAX_HEAD
                    or self._trailer_fields > MAX_FIELDS):
                raise BadRequest("chunked trailer section too large", 431)
            return
        fields = self._fields
        line = len(name) + len(value) + 2
        self._head_size += line + 2
        if line > MAX_FIELD_LINE or self._head_size > MAX_HEAD:
            self._refusal = BadRequest("request head too large", 431)
            raise self._refusal
        if len(fields) >= MAX_FIELDS:
            self._refusal = BadRequest("more than %d header fields" % MAX_FIELDS, 431)
            raise self._refusal
        if value and value[-1] in (0x20, 0x09):
            value = value.rstrip(b" \t")  # llhttp keeps trailing whitespace
        fields.append((name, value))

    def on_headers_complete(self) -> None:
        self._in_head = False
        parser = self._parser
        method = parser.get_method().decode("ascii")
        version = parser.get_http_version()
        size = len(method) + len(self._url) + REQUEST_LINE_EXTRA + self._head_size + 2
        try:
            if size > MAX_HEAD:
                raise BadRequest("request head too large", 431)
            head = check_head(method, _target(self._url), _version(version),
                              [(n.decode("latin-1"), v.decode("latin-1"))
                               for n, v in self._fields])
        except BadRequest as exc:
            self._refusal = exc
            raise
        request = Request(head, None, self._started)
        if head.content_length is None and not head.chunked:
            request.complete = True  # no body
        else:
            request.expect_continue = _expects_continue(head)
        self._current = request
        self._ready.append(request)
        self._fields, self._url = [], b""  # (an idle client keeps none of its last head)

    def on_chunk_header(self) -> None:
        self._after_chunk_header = True
        self._trailer_bytes = 0

    def on_body(self, data: bytes) -> None:
        self._after_chunk_header = False
        current = self._current
        if current is not None:
            current.body.append(data)
            current.body_size += len(data)

    def on_message_complete(self) -> None:
        self._after_chunk_header = False
        current = self._current
        if current is not None:
            current.complete = True
            self._current = None


def _simple_head(text: str) -> Optional[Tuple[str, str, str, List[Tuple[str, str]]]]:
    """The method, target, version and fields of the request head
    ``text`` if it has ``RequestReader._simple``'s shape: printable ASCII,
    a method of ``SIMPLE_METHODS``, a version of ``SIMPLE_VERSIONS``, and
    fields each with a name of letters, digits and hyphens and a value
    without tabs, at most one of them a Content-Length of digits; else
    None."""
    if not text.isascii():
        return None
    lines = text.split("\r\n")  # (the head's lines, then "" and "")
    if len(lines) > MAX_FIELDS + 3:
        return None
    parts = lines[0].split(" ")
    if (len(parts) != 3 or parts[0] not in SIMPLE_METHODS or parts[2] not in SIMPLE_VERSIONS
            or not parts[1].isprintable()):
        return None
    fields: List[Tuple[str, str]] = []
    lengths = 0
    for i in range(1, len(lines) - 2):
        name, colon, value = lines[i].partition(":")
        if not colon or not name.replace("-", "").isalnum() or not value.isprintable():
            return None
        value = value.strip(" ")
        if len(name) == 14 and name.lower() == "content-length":
            if not value.isdigit() or len(value) > 18 or lengths:
                return None  # (llhttp's, for its grammar and its overflow)
            lengths += 1
        fields.append((name, value))
    return parts[0], parts[1], parts[2], fields


def _expects_continue(head: RequestHead) -> bool:
    """The client waits to be asked for the body (HTTP/1.1 only)."""
    if head.version != "HTTP/1.1":
        return False
    expects = False
    for name, value in head.fields:
        if len(name) == 6 and name.lower() == "expect":
            expects = value.lower() == "100-continue"
    return expects


def _target(url: bytes) -> bytes:
    """httpparse's grammar for the target: printable ASCII only."""
    if not TARGET.match(url):
        raise BadRequest("invalid request-target %r" % url[:100])
    return url


def _version(version: str) -> str:
    if version[:2] != "1.":
        raise BadRequest("HTTP version %s not supported" % version, 505)
    return "HTTP/1.0" if version == "1.0" else "HTTP/1.1"


# -- the environ ------------------------------------------------------------

# The environ keys of the fields about one hop (RFC 9110 7.6.1).
HOP_BY_HOP_KEYS: Final = frozenset(
    "HTTP_" + name.upper().replace("-", "_") for name in HOP_BY_HOP) | {"HTTP_PROXY_CONNECTION"}
_ENVIRON_KEYS: Final[Dict[str, Optional[str]]] = {
    "content-type": "CONTENT_TYPE", "content-length": "CONTENT_LENGTH"}


def environ_key(name: str) -> Optional[str]:
    """The environ key of a header field name; None for a name with an
    underscore, which would alias a name with a hyphen (the headers
    WSGI servers drop, as pywsgi and nginx do)."""
    key = _ENVIRON_KEYS.get(name)
    if key is None and name not in _ENVIRON_KEYS:
        lowered = name.lower()
        key = _ENVIRON_KEYS.get(lowered)
        if key is None and lowered not in _ENVIRON_KEYS:
            key = None if "_" in name else "HTTP_" + name.upper().replace("-", "_")
        if len(_ENVIRON_KEYS) < MAX_ENVIRON_KEYS:
            _ENVIRON_KEYS[name] = key
    return key


def path_info(target: str) -> str:
    """PATH_INFO of an origin-form target: its path, percent-decoded."""
    path = target.partition("?")[0]
    return unquote_to_bytes(path).decode("latin-1") if "%" in path else path


def request_variables(forward: dict, head: RequestHead) -> Optional[Dict[str, str]]:
    """Put the CGI variables of ``head`` into ``forward``, the header
    fields about one hop (RFC 9110 7.6.1, and those ``Connection`` names)
    excepted: what a worker may see.  Those are returned, if there are
    any, for the LB's own environ.  Repeated fields are joined with commas
    (RFC 9110 5.3)."""
    line_variables(forward, head.method, head.path, head.version)
    return field_variables(forward, [(environ_key(name), value) for name, value in head.fields])


def line_variables(forward: dict, method: str, target: str, version: str) -> None:
    """The request line's part of ``request_variables``."""
    path, _, query = target.partition("?")
    forward["REQUEST_METHOD"] = method
    forward["PATH_INFO"] = unquote_to_bytes(path).decode("latin-1") if "%" in path else path
    forward["QUERY_STRING"] = query
    forward["RAW_URI"] = target
    forward["SERVER_PROTOCOL"] = version


def field_variables(forward: dict, fields: List[Tuple[Optional[str], str]]
                    ) -> Optional[Dict[str, str]]:
    """The header fields' part of ``request_variables``, each field given
    by its environ key (``environ_key``; None: left out) and its value."""
    hop: Optional[Dict[str, str]] = None
    for key, value in fields:
        if key is None:
            continue
        into = forward
        if key in HOP_BY_HOP_KEYS:
            if hop is None:
                hop = {}
            into = hop
        if key in into and key[:5] == "HTTP_":
            into[key] += "," + value
        else:
            into[key] = value
    if hop is not None and "HTTP_CONNECTION" in hop:
        for token in hop["HTTP_CONNECTION"].split(","):
            key = environ_key(token.strip(" \t"))
            if key is not None and key in forward:
                hop[key] = forward.pop(key)
    return hop


# -- responses --------------------------------------------------------------

# Statuses whose responses never have a body (RFC 9110 6.4.1), and the
# reason phrases of those the front and the LB answer themselves.
BODILESS_STATUS: Final = frozenset(("204", "304")) | {"1%02d" % n for n in range(100)}
REASONS: Final = {400: "Bad Request", 408: "Request Timeout", 413: "Request Entity Too Large",
                  414: "URI Too Long", 431: "Request Header Fields Too Large",
                  500: "Internal Server Error", 501: "Not Implemented", 502: "Bad Gateway",
                  503: "Service Unavailable", 504: "Gateway Timeout",
                  505: "HTTP Version Not Supported"}
# A final status: 2xx to 5xx.  A 1xx is interim (RFC 9110 15.2): a client
# would wait on for the final one, and take the next response for it.
# Past 599 a status is invalid (RFC 9110 15): a client takes it as a 5xx,
# which the LB would count a success, in none of its classes.
STATUS: Final = re.compile(r"[2-5][0-9][0-9] [^\x00-\x08\x0a-\x1f\x7f]*\Z")
FIELD_NAME: Final = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z")
FIELD_VALUE_BAD: Final = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def start_again(exc_info, started: bool, status_set: bool) -> None:
    """PEP 3333's rule for ``start_response`` called again: with
    ``exc_info``, the application's error is raised again if the head is
    out (``started``), else the new status and headers replace the old;
    without it, a second call (``status_set``) is the application's bug."""
    if exc_info:
        try:
            if started:
                raise exc_info[1].with_traceback(exc_info[2])
        finally:
            exc_info = None  # (no cycle through the traceback)
    elif status_set:
        raise AssertionError("start_response called twice without exc_info")


def check_response(status: object, headers: Iterable[Any]) -> None:
    """Refuse a status or header that could split or smuggle a response
    (or is not a str: an application's, so of any type), a 1xx status,
    which is no final one, and one past 599, which HTTP does not define."""
    if type(status) is not str or not matches(STATUS, status, _VALID_STATUS):
        raise BadResponseHead("invalid status %r" % (status,))
    for name, value in headers:
        if type(name) is not str or type(value) is not str:
            raise BadResponseHead("header %r: %r is not a pair of str" % (name, value))
        if (not matches(FIELD_NAME, name, _VALID_NAMES)
                # (printable text has no control character: the search is for the rest)
                or (not value.isprintable() and FIELD_VALUE_BAD.search(value))):
            raise BadResponseHead("invalid header %r: %r" % (name, value))


# The statuses and the field names found valid (``matches``): apart, as a
# status is no field name.
_VALID_STATUS: Final[Dict[str, bool]] = {}
_VALID_NAMES: Final[Dict[str, bool]] = {}


def response_head(status: str, headers: List[Tuple[str, str]],
                  extra: bytes = b"") -> bytes:
    """The bytes of a response head: status line, ``headers`` (checked by
    ``check_response``), then ``extra`` (header lines ending in CRLF) and
    the empty line."""
    lines = ["HTTP/1.1 ", status, "\r\n"]
    for name, value in headers:
        lines += (name, ": ", value, "\r\n")
    return "".join(lines).encode("latin-1") + extra + b"\r\n"


def ready_head(status: str, headers: List[Tuple[str, str]]) -> Tuple[bytes, Optional[int]]:
    """A worker's response head ready for the client, and the
    Content-Length it says (None: none): the status line and header
    lines, each ending in CRLF, without the empty line (the LB adds its
    own lines first).  Checked as ``check_response`` checks; hop-by-hop
    fields are left out (they are the LB's and the client's business), a
    Content-Length too where the status has no body (and once said, the
    same again: another is refused), and a Date is added
    if the application gave none.  BadResponseHead for a head HTTP forbids,
    an invalid Content-Length included."""
    check_response(status, headers)
    bodiless = status[:3] in BODILESS_STATUS
    lines = ["HTTP/1.1 ", status, "\r\n"]
    length = None
    dated = False
    for name, value in headers:
        lowered = name.lower()
        if lowered == "content-length":
            if bodiless:
                continue
            repeated = length is not None
            length = _content_length(value, length)
            if repeated:  # (the same length again, else refused: said once)
                continue
        elif lowered in HOP_BY_HOP:
            continue
        elif lowered == "date":
            dated = True
        lines += (name, ": ", value, "\r\n")
    try:
        head = "".join(lines).encode("latin-1")
    except UnicodeEncodeError as exc:
        raise BadResponseHead("a status or header that is not latin-1: %s" % exc)
    return (head if dated else head + date_line()), length


def _content_length(value: str, before: Optional[int]) -> int:
    # (at most 18 digits: the worker protocol's frame carries a signed 64-bit length)
    length = int(value) if value.isdigit() and value.isascii() and len(value) <= 18 else -1
    if length < 0 or (before is not None and length != before):
        raise BadResponseHead("invalid Content-Length %r" % value)
    return length


_date_cache: Final[List[Any]] = [0, b""]


def date_line() -> bytes:
    """The Date header line, made once a second."""
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache[0] = now
        _date_cache[1] = b"Date: %s\r\n" % formatdate(now, usegmt=True).encode("ascii")
    return _date_cache[1]  # type: ignore[return-value]
