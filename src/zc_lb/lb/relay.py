"""The LB as a relay: a request goes to its worker as the front checked
its head, not as an environ; the worker builds the environ.

Theory of operation
-------------------

The front server (front/client.py) parses and checks a request head once
(front/h1.py, front/httpparse.py).  For the LB, it builds no PEP 3333 environ of the
head: it hands over a ``Relay``, which holds the checked head and what
only the LB knows of the client's connection.  The LB routes with it
(the classifier reads it as a mapping of the request's variables,
``get`` answering the Host and the path from the head itself) and
sends the worker one ``HEAD_REQUEST`` frame (wire/frames.py) that holds:

- a fixed prefix: flags (the request ends here: it has no body), the
  lengths of the next two parts;
- the connection's facts: the variables that are the same for every
  request of one client connection (the client's address and port, the
  server's name and port, the scheme...), as a JSON object made once per
  client connection (``Facts``; their bytes go with each request, the
  work of making them does not);
- the request's class, in UTF-8;
- the head: the request line and the header fields, in HTTP/1.1's
  bytes, each line ending in CRLF, with the forwarding headers
  (front/forwarding.py) applied.  Where the checks changed nothing, these are
  the head's bytes as they came (``RequestHead.raw``), the forwarding
  lines after them, unless forwarding replaced fields the client sent or
  the client's ``Connection`` names a forwarding header; otherwise the
  lines are made again from the checked fields, less those about one
  hop.  The worker leaves out the fields about one hop (RFC 9110 7.6.1,
  and those ``Connection`` names) as the front left them out of the
  environ, by their environ keys.

The worker (``decode_head_request``) builds the variables from them with
the front's own function (``h1.request_variables``), keeping the facts
it decoded by their bytes, as a connection sends the same ones with
every request: a connection's variables cost it a copy of a small dict.
(That dict also holds, empty, the keys the worker is to set, ``ROOM``,
so that the copy is not made larger key by key.)
What the worker gets is exactly what the JSON environ of a ``Request``
frame holds (tests/test_relay.py checks a corpus both ways), which the
LB sends when it runs as a plain WSGI application.

Where the LB still wants the whole environ (an access log, an error's
log line), ``complete`` puts the variables into it, computed once.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any, Dict, Final, Iterator, List, Optional, Set, Tuple

import orjson

from zc_lb.errors import RemoteProtocolError, RequestTooLarge
from zc_lb.front.forwarding import Forwarding
from zc_lb.front.forwarding import FIELDS as FORWARDING_FIELDS
from zc_lb.front.h1 import (HOP_BY_HOP_KEYS, environ_key, field_variables, line_variables, path_info,
                 request_variables)
from zc_lb.front.httpparse import RequestHead
from zc_lb.environ import REQUEST_CLASS, WORKER

HEAD_PREFIX: Final = struct.Struct("!BHH")  # flags, facts' length, class's length
HEAD_END: Final = 1  # the flag: the request has no body (it ends with this frame)
MAX_FACTS: Final = 1024  # connections' facts a worker keeps decoded
# The environ keys of the forwarding fields: a Connection that names one
# keeps the head's bytes from going as they came (``_split``).
FORWARDING_KEYS: Final = frozenset("HTTP_" + name.upper().replace("-", "_")
                                   for name in FORWARDING_FIELDS)


def connection_variables(base: Dict[str, str],
                         remote: Optional[Tuple[str, str]]) -> Dict[str, str]:
    """The variables common to a client connection's requests: the
    server's ``base`` ones and the client's ``remote`` address and port."""
    variables = dict(base)
    if remote is not None:
        variables["REMOTE_ADDR"], variables["REMOTE_PORT"] = remote
    return variables


class Facts:
    """A client connection's facts: its variables common to all its
    requests, encoded once (``encoded``), and the start of the last
    payload made with them (a connection's requests mostly share their
    class)."""

    def __init__(self, variables: Dict[str, str]) -> None:
        self.encoded = orjson.dumps(variables)
        self._class: Optional[str] = None
        self._end = False
        self._start = b""

    def start(self, rclass: str, end: bool) -> bytes:
        """A payload's prefix, these facts and the class."""
        if rclass != self._class or end != self._end:
            encoded = rclass.encode("utf-8")
            self._start = b"".join((HEAD_PREFIX.pack(HEAD_END if end else 0, len(self.encoded),
                                                     len(encoded)), self.encoded, encoded))
            self._class, self._end = rclass, end
        return self._start


class Relay:
    """One request as the LB relays it: its checked ``head``, its
    connection's ``facts``, made of the server's ``base`` variables and
    the client's ``remote`` address and port, and what forwarding needs
    (the peer's address, and whether it is a trusted proxy).  A
    read-only mapping of the request's variables for a classifier
    (``get``, ``[]``, ``in``, iteration)."""

    def __init__(self, head: RequestHead, facts: Facts, base: Dict[str, str],
                 remote: Optional[Tuple[str, str]], forwarding: Optional[Forwarding],
                 peer: Optional[str], trusted: bool) -> None:
        self.head = head
        self.facts = facts
        self.base = base
        self.remote = remote
        self.forwarding = forwarding
        self.peer = peer
        self.trusted = trusted
        self._kept: Optional[List[Tuple[str, str]]] = None  # (``_split``)
        self._extra: List[Tuple[str, str]] = NO_FIELDS  # (the forwarding fields)
        self._hop: Optional[List[Tuple[str, str]]] = None  # (the fields about one hop)
        self._as_it_came = True  # the head's bytes (and ``_extra``) say what the worker gets
        self._variables: Optional[Dict[str, str]] = None  # (``variables``)
        self._all: Optional[Dict[str, str]] = None  # (``all_variables``)
        self.completed = False

    # -- what the worker gets -----------------------------------------

    def fields(self) -> List[Tuple[str, str]]:
        """The header fields a worker gets: the head's, less those about
        one hop, with the forwarding headers set."""
        kept = self._split()
        return kept + self._extra if self._extra else kept

    def _split(self) -> List[Tuple[str, str]]:
        """The head's fields kept (``head.fields`` itself if all are),
        and, in ``_hop`` and ``_extra``, those about one hop and those
        forwarding adds.  Worked out once.  Whether a field is about one
        hop goes by its environ key, as the front's environ went."""
        kept = self._kept
        if kept is not None:
            return kept
        kept = fields = self.head.fields
        for name, value in fields:
            if environ_key(name) in HOP_BY_HOP_KEYS:  # (Connection: keep-alive, most often)
                kept, self._hop, named = _without_hop(fields)
                # The worker leaves out the fields about one hop itself
                # (request_variables), but it would leave out a forwarding
                # header the client's Connection named too.
                self._as_it_came = FORWARDING_KEYS.isdisjoint(named)
                break
        forwarding = self.forwarding
        if forwarding is not None and forwarding:
            forwarded, self._extra = forwarding.fields(kept, self.peer, self.trusted,
                                                       self.base.get("wsgi.url_scheme", "http"))
            if forwarded is not kept:  # (the client's own forwarding fields replaced)
                self._as_it_came = False
            kept = forwarded
        self._kept = kept
        return kept

    def payload(self, rclass: str, end: bool) -> bytes:
        """A HEAD_REQUEST frame's payload (see the module docstring): the
        head's bytes as they came (``RequestHead.raw``), the fields about
        one hop among them (the worker leaves them out as the front did),
        where the forwarding fields added after them are all that
        changes; else its lines made again."""
        head = self.head
        kept = self._split()
        raw = head.raw
        parts: List[str] = []
        if raw is None or not self._as_it_came:
            parts += (head.method, " ", head.path, " ", head.version, "\r\n")
            for name, value in kept:
                parts += (name, ": ", value, "\r\n")
        for name, value in self._extra:
            parts += (name, ": ", value, "\r\n")
        text = "".join(parts).encode("latin-1")
        if raw is not None and self._as_it_came:
            text = raw + text
        return self.facts.start(rclass, end) + text

    def variables(self) -> Dict[str, str]:
        """What a worker gets of the request: its CGI variables (less the
        class), as a JSON ``Request`` frame holds them (the front hands
        them to an application that takes no Relay, ``environ.FORWARD``).
        Made once; the caller may add the class to it."""
        variables = self._variables
        if variables is None:
            head = self.head
            variables = self._variables = connection_variables(self.base, self.remote)
            request_variables(variables, RequestHead(head.method, head.path, head.version,
                                                     self.fields()))
        return variables

    def all_variables(self) -> Dict[str, str]:
        """The LB's view: ``variables`` and the fields about one hop,
        theirs where both have a name (as the front's environ had it: a
        field the client named in Connection is its own, not the one
        forwarding set)."""
        variables = self._all
        if variables is None:
            variables = self._all = dict(self.variables())
            variables.pop(REQUEST_CLASS, None)
            self._split()  # (which finds the fields about one hop)
            hop: Dict[str, str] = {}
            for name, value in self._hop or ():
                key = environ_key(name)
                if key is None:
                    continue
                if key in hop and key[:5] == "HTTP_":
                    hop[key] += "," + value
                else:
                    hop[key] = value
            variables.update(hop)
        return variables

    def complete(self, environ: Dict[str, Any]) -> None:
        """Put the request's variables into ``environ`` (the LB's: its
        objects and its ``zc_lb.*`` notes are kept), once."""
        if not self.completed:
            self.completed = True
            for key, value in self.all_variables().items():
                if key not in environ:
                    environ[key] = value

    def has_body(self, limit: Optional[int]) -> bool:
        """Whether a body follows the head; RequestTooLarge if its
        Content-Length is over ``limit``."""
        head = self.head
        if head.chunked:
            return True
        length = head.content_length
        if length is None:
            return False
        if limit is not None and length > limit:
            raise RequestTooLarge("Content-Length %d is over the limit of %d" % (length, limit))
        return length > 0

    # -- the classifier's mapping -------------------------------------

    def get(self, key: str, default: Any = None) -> Any:
        """A variable of the request: the Host, the request line's and the
        connection's straight from the head and the facts (what the
        default classifier and key read, and ``re:`` classifiers most
        often), the rest from ``all_variables``."""
        head = self.head
        if key == "HTTP_HOST":
            for name, value in head.fields:
                if len(name) == 4 and name.lower() == "host":
                    return value  # (check_head leaves one at most)
            return default
        if key == "PATH_INFO":
            return path_info(head.path)
        if key == "QUERY_STRING":
            return head.path.partition("?")[2]
        if key == "REQUEST_METHOD":
            return head.method
        if key == "RAW_URI":
            return head.path
        if key == "SERVER_PROTOCOL":
            return head.version
        if key in self.base:  # (SERVER_NAME...: no field has such a key)
            return self.base[key]
        return self.all_variables().get(key, default)

    def __getitem__(self, key: str) -> Any:
        value = self.get(key, _MISSING)
        if value is _MISSING:
            raise KeyError(key)
        return value

    def __contains__(self, key: object) -> bool:
        return key in self.all_variables()

    def __iter__(self) -> Iterator[str]:
        return iter(self.all_variables())

    def __len__(self) -> int:
        return len(self.all_variables())

    def keys(self) -> Any:
        return self.all_variables().keys()

    def items(self) -> Any:
        return self.all_variables().items()

    def values(self) -> Any:
        return self.all_variables().values()

    def __repr__(self) -> str:
        return "<Relay %s %s>" % (self.head.method, self.head.path)


_MISSING: Final = object()
NO_FIELDS: Final[List[Tuple[str, str]]] = []  # (never changed)
Mapping.register(Relay)


def _without_hop(fields: List[Tuple[str, str]]
                 ) -> Tuple[List[Tuple[str, str]], List[Tuple[str, str]], Set[Optional[str]]]:
    """``fields`` split: those a worker gets, and those about one hop
    (RFC 9110 7.6.1, and those ``Connection`` names), by their environ
    keys (h1.request_variables's rule); and the keys Connection names."""
    kept: List[Tuple[str, str]] = []
    hop: List[Tuple[str, str]] = []
    named: Set[Optional[str]] = set()
    for field in fields:
        key = environ_key(field[0])
        if key in HOP_BY_HOP_KEYS:
            hop.append(field)
            if key == "HTTP_CONNECTION":
                named.update(environ_key(token.strip(" \t")) for token in field[1].split(","))
        else:
            kept.append(field)
    named.discard(None)
    if named:
        hop += [field for field in kept if environ_key(field[0]) in named]
        kept = [field for field in kept if environ_key(field[0]) not in named]
    return kept, hop, named


# -- the worker's side --------------------------------------------------

_FACTS: Final[Dict[bytes, Dict[str, Any]]] = {}  # connections' facts, decoded (``_decode_facts``)
# The variables PEP 3333 requires that a connection's facts hold (an LB's
# always do): what a worker takes for those an odd one left out.
REQUIRED: Final = {"SCRIPT_NAME": "", "SERVER_NAME": "localhost", "SERVER_PORT": "80",
                   "wsgi.url_scheme": "http"}
# Keys every request's environ gets, from the head (request_variables and
# the class) and from the worker (worker/wsgi.py's ``make_environ``).  Decoded
# facts hold them, each to be replaced, so that a request's copy of them
# has room for all it gets: it is not made larger, key by key.
ROOM: Final = ("REQUEST_METHOD", "PATH_INFO", "QUERY_STRING", "RAW_URI", "SERVER_PROTOCOL",
               REQUEST_CLASS, "wsgi.version", "wsgi.multithread", "wsgi.multiprocess",
               "wsgi.run_once", "wsgi.input_terminated", WORKER, "wsgi.input",
               "wsgi.errors")


def decode_head_request(payload: bytes) -> Tuple[Dict[str, Any], bool]:
    """A HEAD_REQUEST frame's variables (the class as
    ``zc_lb.request_class``), and whether the request ends with it.
    The variables hold every one PEP 3333 requires, and the keys of
    ``ROOM`` the worker is to set (see there).  RemoteProtocolError for a
    payload that is not one."""
    size = HEAD_PREFIX.size
    if len(payload) < size:
        raise RemoteProtocolError("head request of %d bytes, shorter than its prefix"
                                  % len(payload))
    prefix: Tuple[int, int, int] = HEAD_PREFIX.unpack_from(payload)
    flags, facts_length, class_length = prefix
    start = size + facts_length + class_length
    if flags & ~HEAD_END or start > len(payload):
        raise RemoteProtocolError("malformed head request prefix %r" % payload[:size])
    facts = payload[size:size + facts_length]
    variables = _FACTS.get(facts)
    if variables is None:
        variables = _decode_facts(facts)
    environ = variables.copy()
    try:
        rclass = payload[size + facts_length:start].decode("utf-8")
        text = payload[start:].decode("latin-1")
    except UnicodeDecodeError as exc:
        raise RemoteProtocolError("head request class is not UTF-8: %s" % exc)
    lines = text.split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or lines[-1] or len(lines) < 2:
        raise RemoteProtocolError("malformed head request %r" % text[:200])
    line_variables(environ, parts[0], parts[1], parts[2])
    field_variables(environ, [_keyed(lines[i]) for i in range(1, len(lines) - 1)])
    environ[REQUEST_CLASS] = rclass
    return environ, (flags & HEAD_END) != 0


_LINES: Final[Dict[str, Tuple[Optional[str], str]]] = {}  # field lines, by their text
MAX_LINES: Final = 4096  # field lines a worker keeps keyed (``_keyed``)
MAX_LINE: Final = 512  # characters of the longest kept


def _keyed(line: str) -> Tuple[Optional[str], str]:
    """A head request's field line as its environ key (None: left out)
    and its value.  A client sends most of its fields with each request
    (User-Agent, Accept...): the short lines are kept, and each comes to
    one lookup instead of a partition, a strip and the key's lookup."""
    field = _LINES.get(line)
    if field is None:
        name, colon, value = line.partition(":")
        if not colon or not name:
            raise RemoteProtocolError("malformed head request field %r" % line[:200])
        field = (environ_key(name), value.strip(" \t"))
        if len(line) <= MAX_LINE:
            if len(_LINES) >= MAX_LINES:
                _LINES.clear()
            _LINES[line] = field
    return field


def _decode_facts(facts: bytes) -> Dict[str, Any]:
    """A connection's facts as every request of it starts: with the
    variables PEP 3333 requires, and room (``ROOM``)."""
    try:
        decoded = orjson.loads(facts)
    except orjson.JSONDecodeError as exc:
        raise RemoteProtocolError("bad head request facts: %s" % str(exc)[:200])
    if type(decoded) is not dict or not all(type(v) is str for v in decoded.values()):
        raise RemoteProtocolError("head request facts must be an object of strings")
    variables: Dict[str, Any] = dict.fromkeys(ROOM, "")
    variables.update(REQUIRED)
    variables.update(decoded)
    if len(_FACTS) >= MAX_FACTS:
        _FACTS.clear()
    _FACTS[facts] = variables
    return variables
