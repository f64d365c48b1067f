"""The LB<->worker protocol, sans I/O: bytes in, messages out, and back.

Frames
------

Every frame is a 9-byte header and a payload::

     0               4        5               9
    +----------------+--------+----------------+------------------+
    | request number |  type  |     length     | payload ...      |
    |   u32, BE      |   u8   |    u32, BE     | (length bytes)   |
    +----------------+--------+----------------+------------------+

Request number 0 is the connection itself (hello, auth, résumé, ping,
pong, goaway); any other number names one request, chosen by the LB,
increasing, never reused on a connection.

Payloads: body chunks travel as raw bytes; credit as a u32; everything
structured (hello, auth, résumé, environ, status and headers, goaway) as
JSON.  Never marshal or pickle: a worker port must not be a way to run
code.  Structured payloads are capped at ``max_message`` bytes (the
résumé at ``max_resume``), body chunks at ``max_body``; a frame over its
cap is refused from its header, before its payload is buffered.

Connection start: each side sends ``Hello`` at once (protocol version, its
role, a random nonce, whether it holds a shared secret).  With a secret,
each then sends ``Auth``: HMAC-SHA256(secret, peer's nonce + own role), so
both sides prove the secret without sending it, and a reply cannot be
replayed to another connection.

A request's life: the LB sends ``Request(environ)``, ``Body*``, ``End``;
the worker answers ``Response(status, headers)``, ``Body*``, ``End``.
Either side may send ``Cancel`` at any time; it ends both directions.

Whole frames: most requests have no body and most responses fit one
frame, so when both Hellos offer the feature ``whole``, a request
without a body is one frame (``WHOLE_REQUEST``: the environ, then the
request ends) and a response sent entire is one frame (``WHOLE_RESPONSE``:
a u32 length, the status and headers, then the body; then it ends), not
three.  The receiver sees one ``Request`` or ``Response`` message with
``end`` set (and the response's ``body``).  A peer that does not offer
it (an older version) gets and sends the separate frames, so mixed
versions still talk.

Flow control: each direction of each request starts with ``WINDOW`` bytes
of credit.  A sender may send body bytes only within its credit; the
receiver grants more with ``Credit(n)`` as it *consumes* (not receives)
data.  So one slow client cannot stall the other requests on a
connection, nor grow the LB's memory past a window per request.

``Connection`` is the protocol itself, for one side, with no I/O (as
h11 is for HTTP): phases with frame limits (a kilobyte before the peer
is authenticated), the roles (a worker never accepts a résumé), request
numbers, each request's ``Stream`` (a state table per direction, cancel
and credit included), credit windows, and events that say who ended a
request.  ``connection.py`` only pumps bytes between it and a socket;
the tests drive two of them against each other in memory.

Messages for a request that one side has just cancelled may still be in
flight from the other: a ``Connection`` drops frames for request numbers
that have ended, and calls frames for numbers never used errors.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import math
import os
import struct
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple, Type, Union

import orjson

from .errors import (AuthenticationError, LocalProtocolError, MessageTooLarge,
                     RemoteProtocolError)

VERSION = 1
WINDOW = 256 * 1024
MAX_BODY = 256 * 1024
MAX_MESSAGE = 256 * 1024
MAX_RESUME = 64 * 1024 * 1024
MAX_RNO = 2**32 - 1
COMPACT_AT = 64 * 1024  # decoded bytes kept at the buffer's head at most

HEADER = struct.Struct("!IBI")
HEADER_SIZE = HEADER.size
CREDIT_PAYLOAD = struct.Struct("!I")
HEAD_LENGTH = struct.Struct("!I")  # of the status and headers in a WHOLE_RESPONSE

WHOLE = "whole"  # the Hello feature: whole requests and responses in one frame
FEATURES = (WHOLE,)
WHOLE_REQUEST = 16  # Request and End
WHOLE_RESPONSE = 17  # Response, Body and End


# -- messages -----------------------------------------------------------

# Messages are values: never change one.  They are not frozen dataclasses
# only because a frozen one costs four times as much to build (1.6 us
# against 0.4 here), and a request builds three.


@dataclass(slots=True)
class Hello:
    """First message on a connection, from each side."""

    version: int
    role: str
    nonce: str
    auth: bool = False
    app_version: Optional[str] = None  # a worker's application version, if it knows it
    features: Tuple[str, ...] = ()  # what the sender can receive beyond version 1
    TYPE = 1


@dataclass(slots=True)
class Auth:
    """HMAC proof of the shared secret."""

    digest: str
    TYPE = 2


@dataclass(slots=True)
class Resume:
    """A worker's résumé: request class -> requests per second."""

    skills: Dict[str, float]
    TYPE = 3


@dataclass(slots=True)
class Ping:
    """Keepalive; answered by Pong."""

    TYPE = 4


@dataclass(slots=True)
class Pong:
    """Answer to Ping."""

    TYPE = 5


@dataclass(slots=True)
class GoAway:
    """The sender is draining: send it no new requests."""

    reason: str = ""
    TYPE = 6


@dataclass(slots=True)
class Request:
    """Start of a request: its CGI/WSGI environ, strings only; with
    ``end``, the whole request (it has no body)."""

    rno: int
    environ: Dict[str, str]
    end: bool = False
    TYPE = 10


@dataclass(slots=True)
class Body:
    """A chunk of request or response body."""

    rno: int
    data: bytes = field(repr=False)
    TYPE = 11


@dataclass(slots=True)
class End:
    """End of the sender's direction of a request."""

    rno: int
    TYPE = 12


@dataclass(slots=True)
class Response:
    """Start of a response: status line and headers, perhaps the first
    body bytes; with ``end``, the whole response."""

    rno: int
    status: str
    headers: List[Tuple[str, str]]
    body: bytes = field(default=b"", repr=False)
    end: bool = False
    TYPE = 13


@dataclass(slots=True)
class Cancel:
    """Abandon a request, both directions."""

    rno: int
    TYPE = 14


@dataclass(slots=True)
class Credit:
    """Permission to send ``n`` more body bytes on request ``rno``."""

    rno: int
    n: int
    TYPE = 15


ConnectionMessage = Union[Hello, Auth, Resume, Ping, Pong, GoAway]
RequestMessage = Union[Request, Body, End, Response, Cancel, Credit]
Message = Union[ConnectionMessage, RequestMessage]

CONNECTION_TYPES: Dict[int, type] = {
    cls.TYPE: cls for cls in (Hello, Auth, Resume, Ping, Pong, GoAway)
}
REQUEST_TYPES: Dict[int, type] = {
    cls.TYPE: cls for cls in (Request, Body, End, Response, Cancel, Credit)
}
FRAME_NAMES: Dict[int, str] = {mtype: cls.__name__
                               for mtype, cls in {**CONNECTION_TYPES, **REQUEST_TYPES}.items()}
FRAME_NAMES.update({WHOLE_REQUEST: "whole Request", WHOLE_RESPONSE: "whole Response"})


class NeedData:
    """Sentinel type: the decoder needs more bytes."""

    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA = NeedData()


# -- encoding -----------------------------------------------------------


def _json(obj: object) -> bytes:
    # orjson: RFC 8259 JSON in UTF-8, 15-30 times faster than the json
    # module for an environ.  It writes a non-finite float as null: the
    # one message with floats, the résumé, is checked before.
    return orjson.dumps(obj)


def _frame(rno: int, mtype: int, payload: bytes) -> bytes:
    return HEADER.pack(rno, mtype, len(payload)) + payload


def encode(message: Message, whole: bool = False) -> bytes:
    """The bytes of one message, header included: a Request or Response
    with ``end`` as one whole frame if ``whole`` (the peer offered it),
    else as the separate frames."""
    try:
        return _encode(message, whole)
    except (struct.error, ValueError, TypeError) as exc:
        raise LocalProtocolError("cannot encode %r: %s" % (message, exc))


def _encode(message: Message, whole: bool) -> bytes:
    if isinstance(message, Body):
        return _frame(message.rno, Body.TYPE, message.data)
    if isinstance(message, (End, Cancel)):
        return HEADER.pack(message.rno, message.TYPE, 0)
    if isinstance(message, Credit):
        return _frame(message.rno, Credit.TYPE, CREDIT_PAYLOAD.pack(message.n))
    if isinstance(message, Request):
        payload = _json(message.environ)
        if len(payload) > MAX_MESSAGE:  # the worker would drop the connection
            raise MessageTooLarge("request head of %d bytes, over the frame limit of %d"
                                  % (len(payload), MAX_MESSAGE))
        if not message.end:
            return _frame(message.rno, Request.TYPE, payload)
        if whole:
            return _frame(message.rno, WHOLE_REQUEST, payload)
        return _frame(message.rno, Request.TYPE, payload) + HEADER.pack(message.rno, End.TYPE, 0)
    if isinstance(message, Response):
        return _response_frames(message.rno, _response_payload(message.status, message.headers),
                                message.body, message.end, whole)
    if isinstance(message, (Ping, Pong)):
        return HEADER.pack(0, message.TYPE, 0)
    if isinstance(message, Resume):
        if not all(math.isfinite(score) for score in message.skills.values()):
            raise LocalProtocolError("résumé with a score that is not finite")
        return _frame(0, Resume.TYPE, _json(message.skills))
    if isinstance(message, Hello):
        hello = {"version": message.version, "role": message.role,
                 "nonce": message.nonce, "auth": message.auth}
        if message.app_version is not None:
            hello["app_version"] = message.app_version
        if message.features:
            hello["features"] = list(message.features)
        payload = _json(hello)
        return _frame(0, Hello.TYPE, payload)
    if isinstance(message, Auth):
        return _frame(0, Auth.TYPE, _json({"digest": message.digest}))
    if isinstance(message, GoAway):
        return _frame(0, GoAway.TYPE, _json({"reason": message.reason}))
    raise LocalProtocolError("cannot encode %r" % (message,))


def _response_payload(status: str, headers: List[Tuple[str, str]]) -> bytes:
    # orjson writes tuples as arrays: no list(h) copy per header.  Names
    # and values must be strings, as the peer checks.
    for header in headers:
        if len(header) != 2 or type(header[0]) is not str or type(header[1]) is not str:
            raise LocalProtocolError("response header %r is not a pair of strings" % (header,))
    return _json([status, headers])


def _response_frames(rno: int, head: bytes, body: bytes, end: bool, whole: bool) -> bytes:
    if type(body) is not bytes:
        raise LocalProtocolError("response body must be bytes, not %s" % type(body).__name__)
    pack = HEADER.pack
    if end and whole:
        return b"".join((pack(rno, WHOLE_RESPONSE, HEAD_LENGTH.size + len(head) + len(body)),
                         HEAD_LENGTH.pack(len(head)), head, body))
    parts = [pack(rno, Response.TYPE, len(head)), head]
    if body:
        parts += (pack(rno, Body.TYPE, len(body)), body)
    if end:
        parts.append(pack(rno, End.TYPE, 0))
    return b"".join(parts)


def body_header(rno: int, length: int) -> bytes:
    """The header of a Body frame, for sending a large chunk without copying."""
    return HEADER.pack(rno, Body.TYPE, length)


# -- decoding -----------------------------------------------------------


def _load_json(payload: bytes, what: str) -> object:
    """Strict JSON (orjson: RFC 8259, valid UTF-8, no NaN or Infinity,
    integers within 64 bits, nesting within 1024 levels)."""
    try:
        return orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise RemoteProtocolError("bad %s payload: %s" % (what, str(exc)[:200]))


def _string_dict(obj: object, what: str) -> Dict[str, str]:
    # A JSON object's keys are strings by construction: only the values
    # need checking, and a plain loop beats all() over a generator.
    if type(obj) is not dict:
        raise RemoteProtocolError("%s must be an object of strings" % what)
    for value in obj.values():
        if type(value) is not str:
            raise RemoteProtocolError("%s must be an object of strings" % what)
    return obj


def _decode_hello(rno: int, payload: bytes) -> Hello:
    obj = _load_json(payload, "hello")
    if not isinstance(obj, dict):
        raise RemoteProtocolError("hello must be an object")
    version, role, nonce = obj.get("version"), obj.get("role"), obj.get("nonce")
    auth = obj.get("auth", False)
    app_version = obj.get("app_version")
    features = obj.get("features", [])
    if not (isinstance(version, int) and not isinstance(version, bool)
            and isinstance(role, str) and isinstance(nonce, str)
            and isinstance(auth, bool) and (app_version is None or isinstance(app_version, str))
            and isinstance(features, list) and all(isinstance(f, str) for f in features)):
        raise RemoteProtocolError("malformed hello %r" % (obj,))
    return Hello(version, role, nonce, auth, app_version, tuple(features))


def _decode_auth(rno: int, payload: bytes) -> Auth:
    obj = _load_json(payload, "auth")
    if not isinstance(obj, dict) or not isinstance(obj.get("digest"), str):
        raise RemoteProtocolError("malformed auth")
    return Auth(obj["digest"])


def _decode_resume(rno: int, payload: bytes) -> Resume:
    obj = _load_json(payload, "resume")
    if not isinstance(obj, dict):
        raise RemoteProtocolError("résumé must be an object")
    skills = {}
    for rclass, score in obj.items():
        if isinstance(score, bool) or not isinstance(score, (int, float)):
            raise RemoteProtocolError("résumé score for %r is not a number" % rclass)
        try:
            skills[rclass] = float(score)
        except OverflowError:
            raise RemoteProtocolError("résumé score for %r is out of range" % rclass)
    return Resume(skills)


def _decode_goaway(rno: int, payload: bytes) -> GoAway:
    obj = _load_json(payload, "goaway")
    if not isinstance(obj, dict) or not isinstance(obj.get("reason", ""), str):
        raise RemoteProtocolError("malformed goaway")
    return GoAway(obj.get("reason", ""))


def _decode_request(rno: int, payload: bytes) -> Request:
    return Request(rno, _string_dict(_load_json(payload, "request"), "environ"))


def _response_head(payload) -> Tuple[str, List[Tuple[str, str]]]:
    obj = _load_json(payload, "response")
    if not (isinstance(obj, list) and len(obj) == 2 and isinstance(obj[0], str)
            and isinstance(obj[1], list)):
        raise RemoteProtocolError("malformed response start")
    headers = []
    for header in obj[1]:
        if not (isinstance(header, list) and len(header) == 2
                and isinstance(header[0], str) and isinstance(header[1], str)):
            raise RemoteProtocolError("malformed response header %r" % (header,))
        headers.append((header[0], header[1]))
    return obj[0], headers


def _decode_response(rno: int, payload: bytes) -> Response:
    return Response(rno, *_response_head(payload))


def _decode_whole_request(rno: int, payload: bytes) -> Request:
    return Request(rno, _string_dict(_load_json(payload, "request"), "environ"), True)


def _decode_whole_response(max_message: int, max_body: int, rno: int,
                           payload: bytes) -> Response:
    if len(payload) < HEAD_LENGTH.size:
        raise RemoteProtocolError("whole response of %d bytes, without its head's length"
                                  % len(payload))
    (length,) = HEAD_LENGTH.unpack_from(payload)
    start = HEAD_LENGTH.size + length
    if start > len(payload):
        raise RemoteProtocolError("whole response's head of %d bytes overruns its frame" % length)
    if length > max_message or len(payload) - start > max_body:
        raise RemoteProtocolError("whole response with a %d-byte head and a %d-byte body, "
                                  "over the limits of %d and %d"
                                  % (length, len(payload) - start, max_message, max_body))
    status, headers = _response_head(memoryview(payload)[HEAD_LENGTH.size:start])
    return Response(rno, status, headers, payload[start:], True)


def _decode_credit(rno: int, payload: bytes) -> Credit:
    if len(payload) != CREDIT_PAYLOAD.size:
        raise RemoteProtocolError("credit payload must be 4 bytes")
    (n,) = CREDIT_PAYLOAD.unpack(payload)
    return Credit(rno, n)


def _decode_empty(cls: type):
    def decode(rno: int, payload: bytes) -> Message:
        if payload:
            raise RemoteProtocolError("%s frame must be empty" % cls.__name__)
        return cls(rno) if rno else cls()
    return decode


_DECODERS = {
    Hello.TYPE: _decode_hello,
    Auth.TYPE: _decode_auth,
    Resume.TYPE: _decode_resume,
    Ping.TYPE: _decode_empty(Ping),
    Pong.TYPE: _decode_empty(Pong),
    GoAway.TYPE: _decode_goaway,
    Request.TYPE: _decode_request,
    Body.TYPE: lambda rno, payload: Body(rno, payload),
    End.TYPE: _decode_empty(End),
    Response.TYPE: _decode_response,
    Cancel.TYPE: _decode_empty(Cancel),
    Credit.TYPE: _decode_credit,
    WHOLE_REQUEST: _decode_whole_request,
    WHOLE_RESPONSE: None,  # per decoder, with its limits
}


class Decoder:
    """Turns received bytes into messages.

    Feed bytes with ``receive_data``; call ``next_message`` until it
    returns NEED_DATA.  A protocol violation raises RemoteProtocolError,
    and the decoder stays broken: the connection must be dropped.
    """

    def __init__(self, max_body: int = MAX_BODY, max_message: int = MAX_MESSAGE,
                 max_resume: int = MAX_RESUME) -> None:
        self._buffer = bytearray()
        self._pos = 0
        self._error: Optional[RemoteProtocolError] = None
        self._decoders = dict(_DECODERS)
        self._decoders[WHOLE_RESPONSE] = functools.partial(_decode_whole_response,
                                                           max_message, max_body)
        limits = {mtype: max_message for mtype in _DECODERS}
        limits[Body.TYPE] = max_body
        limits[Resume.TYPE] = max_resume
        limits[WHOLE_RESPONSE] = HEAD_LENGTH.size + max_message + max_body
        self.allow(limits)

    def allow(self, limits: Dict[int, int], why: str = "") -> None:
        """Accept only these frame types from now on, each up to its
        payload limit; any other type is refused from its header, ``why``
        saying why it is not allowed."""
        self._limits = limits
        self._why = why

    def receive_data(self, data: bytes) -> None:
        """Add bytes received from the peer."""
        self._buffer += data

    @property
    def buffered(self) -> int:
        """Bytes received and not yet decoded."""
        return len(self._buffer) - self._pos

    def next_message(self) -> Union[Message, NeedData]:
        """The next complete message, or NEED_DATA."""
        if self._error is not None:
            raise self._error
        try:
            return self._next()
        except RemoteProtocolError as exc:
            self._error = exc
            raise

    def _next(self) -> Union[Message, NeedData]:
        buf, pos = self._buffer, self._pos
        if len(buf) - pos < HEADER_SIZE:
            self._compact()
            return NEED_DATA
        rno, mtype, length = HEADER.unpack_from(buf, pos)
        limit = self._limits.get(mtype)
        if limit is None:
            if mtype in _DECODERS:
                raise RemoteProtocolError("%s frame not allowed%s" % (
                    FRAME_NAMES[mtype], self._why))
            raise RemoteProtocolError("unknown frame type %d" % mtype)
        if length > limit:
            raise RemoteProtocolError(
                "frame of type %d is %d bytes, over the limit of %d" % (mtype, length, limit))
        if (rno == 0) != (mtype in CONNECTION_TYPES):
            raise RemoteProtocolError("frame type %d with request number %d" % (mtype, rno))
        end = pos + HEADER_SIZE + length
        if len(buf) < end:
            if pos > COMPACT_AT:
                self._compact()
            return NEED_DATA
        payload = bytes(buf[pos + HEADER_SIZE:end])
        self._pos = end
        try:
            return self._decoders[mtype](rno, payload)
        except RemoteProtocolError:
            raise
        except Exception as exc:  # whatever a hostile payload provokes
            raise RemoteProtocolError("bad payload in frame type %d: %r" % (mtype, exc))

    def _compact(self) -> None:
        if self._pos:
            del self._buffer[:self._pos]
            self._pos = 0


# -- handshake ----------------------------------------------------------


def new_hello(role: str, secret: Optional[bytes], app_version: Optional[str] = None,
              features: Tuple[str, ...] = FEATURES) -> Hello:
    """Our Hello, with a fresh nonce."""
    return Hello(VERSION, role, os.urandom(16).hex(), secret is not None, app_version,
                 features)


def auth_digest(secret: bytes, nonce: str, role: str) -> str:
    """HMAC-SHA256 of the peer's nonce and the prover's role."""
    return hmac.new(secret, (nonce + ":" + role).encode(), hashlib.sha256).hexdigest()


def check_hello(ours: Hello, theirs: Hello) -> None:
    """Raise unless the peer's Hello fits ours (version, role, secret)."""
    if theirs.version != VERSION:
        raise RemoteProtocolError(
            "peer speaks protocol version %d, we speak %d" % (theirs.version, VERSION))
    if theirs.role == ours.role or theirs.role not in ("lb", "worker"):
        raise RemoteProtocolError("peer has role %r, we are %r" % (theirs.role, ours.role))
    if theirs.auth != ours.auth:
        raise AuthenticationError(
            "shared secret configured on %s only" % ("the peer" if theirs.auth else "our side"))


def check_auth(secret: bytes, ours: Hello, theirs: Hello, auth: Auth) -> None:
    """Raise AuthenticationError unless ``auth`` proves the secret."""
    expected = auth_digest(secret, ours.nonce, theirs.role)
    if not auth.digest.isascii() or not hmac.compare_digest(expected, auth.digest):
        raise AuthenticationError("peer failed the shared-secret challenge")


# -- one request's state ------------------------------------------------

IDLE, OPEN, DONE, CANCELLED = "IDLE", "OPEN", "DONE", "CANCELLED"
START, BODY, END, CANCEL, CREDIT = "start", "body", "end", "cancel", "credit"

# One direction of a request: state -> what happens -> next state.  START
# is the Request one way and the Response the other; CREDIT is credit for
# this direction's body, which travels the other way; CANCEL, from either
# side, ends both directions.
DIRECTION: Dict[str, Dict[str, str]] = {
    IDLE: {START: OPEN, CREDIT: IDLE, CANCEL: CANCELLED},
    OPEN: {BODY: OPEN, END: DONE, CREDIT: OPEN, CANCEL: CANCELLED},
    DONE: {CREDIT: DONE, CANCEL: CANCELLED},
    CANCELLED: {},
}
REQUEST_KINDS: Dict[type, str] = {Request: START, Body: BODY, End: END}
RESPONSE_KINDS: Dict[type, str] = {Response: START, Body: BODY, End: END}
ENDED = (DONE, CANCELLED)


class Stream:
    """One request on a connection as one side sees it: the state of each
    direction, and the credit windows."""

    __slots__ = ("rno", "sending", "receiving", "credit", "window", "unacked")

    def __init__(self, rno: int, window: int = WINDOW) -> None:
        self.rno = rno
        self.sending = IDLE
        self.receiving = IDLE
        self.credit = window  # body bytes we may still send
        self.window = window  # body bytes the peer may still send us
        self.unacked = 0  # bytes consumed here, not yet granted back

    @property
    def finished(self) -> bool:
        """Both directions ended (or the request was cancelled)."""
        return self.sending in ENDED and self.receiving in ENDED

    def step(self, direction: str, what: str, error: Type[Exception]) -> None:
        """Move ``direction`` ("sending" or "receiving") on ``what``;
        ``error`` (Local or RemoteProtocolError) if the table forbids it."""
        state = getattr(self, direction)
        next_state = DIRECTION[state].get(what)
        if next_state is None:
            raise error("request %d: %s not allowed while %s is %s"
                        % (self.rno, what, direction, state))
        setattr(self, direction, next_state)

    def __repr__(self) -> str:
        return "<Stream %d sending=%s receiving=%s credit=%d window=%d>" % (
            self.rno, self.sending, self.receiving, self.credit, self.window)


# -- the connection -----------------------------------------------------

HANDSHAKE, AUTHENTICATING, OPEN_PHASE, CLOSING, CLOSED = (
    "handshake", "authenticating", "open", "closing", "closed")
HANDSHAKE_LIMIT = 1024  # payload bytes of a Hello or Auth: nothing more before it


@dataclass(frozen=True)
class Ready:
    """The handshake is done (the peer proved the secret, if there is one)."""

    peer: Hello


@dataclass(frozen=True)
class StreamEnded:
    """A request ended before it completed: ``by`` "peer" (it sent Cancel)
    or "connection" (the connection closed under it), and why."""

    rno: int
    by: str
    reason: str


@dataclass(frozen=True)
class Closed:
    """The peer closed the connection (end of file)."""

    reason: str = "peer closed the connection"


Event = Union[Message, Ready, StreamEnded, Closed]


class Connection:
    """One side of an LB<->worker connection, sans I/O, as h11 is for HTTP.

    Bytes from the peer go in with ``receive_data`` (``b""`` at end of
    file); ``next_event`` turns them into events until it returns
    NEED_DATA: ``Ready`` when the handshake is done, then the peer's
    messages (``Request``, ``Response``, ``Body``, ``End``, ``Credit``,
    ``Resume``, ``GoAway``), ``StreamEnded`` when the peer cancels a
    request, ``Closed`` at end of file.  What we send goes through
    ``send(message)``, which returns the bytes to write; bytes the
    connection answers on its own (our Hello, Auth, Pong) wait in
    ``data_to_send()``.

    Phases: *handshake* (only a Hello of at most HANDSHAKE_LIMIT bytes is
    accepted), *authenticating* (with a secret: only an Auth as small),
    *open*, *closing* (either side said GoAway: requests in flight go on,
    an LB starts no new one), *closed*.  So an unauthenticated peer can
    make us buffer a kilobyte, not a résumé's 64 MiB.  Frame types are
    checked against the phase and the role from the frame header, before
    the payload is buffered: a worker never accepts a résumé or a
    response, an LB never a request.

    Request numbers: the LB numbers its requests 1, 2, ... (``start_request``);
    a worker refuses a number that does not increase.  A frame for a
    number that has ended here (a cancel crossing the peer's last frames)
    is dropped; one for a number never used is an error.

    Credit: each direction of each request may carry ``window`` body
    bytes before the receiver grants more; ``send`` refuses a Body past
    our credit, a Body past the peer's is a RemoteProtocolError, and
    ``consumed`` says when to grant (a quarter of the window at a time).

    Errors: RemoteProtocolError (or AuthenticationError) for what the peer
    did, after which the connection is dead and every call raises it
    again; LocalProtocolError for what our own code tried.
    """

    def __init__(self, role: str, secret: Optional[bytes] = None, *,
                 max_body: int = MAX_BODY, max_message: int = MAX_MESSAGE,
                 max_resume: int = MAX_RESUME, window: int = WINDOW,
                 app_version: Optional[str] = None,
                 features: Tuple[str, ...] = FEATURES) -> None:
        if role not in ("lb", "worker"):
            raise LocalProtocolError("role must be 'lb' or 'worker', not %r" % (role,))
        self.role = role
        self.secret = secret
        self.window = window
        self.phase = HANDSHAKE
        self.our_hello = new_hello(role, secret, app_version, features)
        self.peer_hello: Optional[Hello] = None
        self.whole = False  # send whole frames: the peer offered them
        self.streams: Dict[int, Stream] = {}
        self.last_rno = 0
        self.we_go_away = False
        self.peer_goes_away = False
        self._error: Optional[RemoteProtocolError] = None
        self._eof = False
        self._out: List[bytes] = [encode(self.our_hello)]
        self._decoder = Decoder(max_body, max_message, max_resume)
        open_limits = dict(self._decoder._limits)
        refused = {Hello.TYPE, Auth.TYPE}  # once is enough
        if role == "worker":
            refused |= {Resume.TYPE, Response.TYPE, WHOLE_RESPONSE}
        else:
            refused |= {Request.TYPE, WHOLE_REQUEST}
        if WHOLE not in features:  # a peer must not send what we did not offer
            refused |= {WHOLE_REQUEST, WHOLE_RESPONSE}
        for mtype in refused:
            del open_limits[mtype]
        self._open_limits = open_limits
        self._decoder.allow({Hello.TYPE: HANDSHAKE_LIMIT}, " before the handshake")
        if role == "lb":
            self._send_kinds, self._receive_kinds = REQUEST_KINDS, RESPONSE_KINDS
        else:
            self._send_kinds, self._receive_kinds = RESPONSE_KINDS, REQUEST_KINDS

    def __repr__(self) -> str:
        return "<protocol.Connection %s %s streams=%d>" % (self.role, self.phase, len(self.streams))

    # -- receiving ----------------------------------------------------

    def receive_data(self, data: bytes) -> None:
        """Bytes from the peer; ``b""`` when it closed its side."""
        if data:
            self._decoder.receive_data(data)
        else:
            self._eof = True

    def next_event(self) -> Union[Event, NeedData]:
        """The next event, or NEED_DATA; raises RemoteProtocolError (the
        same one on every later call) when the peer broke the protocol."""
        if self._error is not None:
            raise self._error
        try:
            while True:
                message = self._decoder.next_message()
                if message is NEED_DATA:
                    if self._eof and self.phase != CLOSED:
                        self.close()
                        return Closed()
                    return NEED_DATA
                event = self._receive(message)  # type: ignore[arg-type]
                if event is not None:
                    return event
        except RemoteProtocolError as exc:
            self._error = exc
            self.phase = CLOSED
            raise

    def _receive(self, message: Message) -> Optional[Event]:
        phase = self.phase
        if phase == HANDSHAKE:
            return self._hello(message)  # type: ignore[arg-type]
        if phase == AUTHENTICATING:
            check_auth(self.secret, self.our_hello, self.peer_hello, message)  # type: ignore
            return self._open()
        if phase == CLOSED:
            return None
        rno = getattr(message, "rno", 0)
        if not rno:
            return self._connection_message(message)
        stream = self.streams.get(rno)
        if stream is None:
            return self._unknown_stream(message)
        mtype = type(message)
        if mtype is Body:
            size = len(message.data)  # type: ignore[union-attr]
            if size > stream.window:
                raise RemoteProtocolError("request %d: %d body bytes past the credit of %d"
                                          % (rno, size, stream.window))
            stream.window -= size
            stream.step("receiving", BODY, RemoteProtocolError)
        elif mtype is Credit:
            stream.step("sending", CREDIT, RemoteProtocolError)
            stream.credit += message.n  # type: ignore[union-attr]
        elif mtype is Cancel:
            stream.sending = stream.receiving = CANCELLED
            del self.streams[rno]
            return StreamEnded(rno, "peer", "cancelled")
        else:
            what = self._receive_kinds.get(mtype)
            if what is None:
                raise RemoteProtocolError("request %d: unexpected %s" % (rno, mtype.__name__))
            stream.step("receiving", what, RemoteProtocolError)
            if mtype is Response:
                size = len(message.body)  # type: ignore[union-attr]
                if size:
                    if size > stream.window:
                        raise RemoteProtocolError("request %d: %d body bytes past the credit "
                                                  "of %d" % (rno, size, stream.window))
                    stream.window -= size
                if message.end:  # type: ignore[union-attr]
                    stream.receiving = DONE
            if stream.sending in ENDED and stream.receiving in ENDED:
                del self.streams[rno]
        return message

    def _hello(self, theirs: Hello) -> Optional[Event]:
        check_hello(self.our_hello, theirs)
        self.peer_hello = theirs
        self.whole = WHOLE in theirs.features
        if self.secret is None:
            return self._open()
        self._out.append(encode(Auth(auth_digest(self.secret, theirs.nonce, self.role))))
        self.phase = AUTHENTICATING
        self._decoder.allow({Auth.TYPE: HANDSHAKE_LIMIT}, " before authentication")
        return None

    def _open(self) -> Ready:
        self.phase = OPEN_PHASE
        self._decoder.allow(self._open_limits, " to a%s %s" % (
            "n" if self.role == "lb" else "", "LB" if self.role == "lb" else "worker"))
        assert self.peer_hello is not None
        return Ready(self.peer_hello)

    def _connection_message(self, message: Message) -> Optional[Event]:
        mtype = type(message)
        if mtype is Ping:
            self._out.append(encode(Pong()))
            return None
        if mtype is Pong:
            return None
        if mtype is GoAway:
            self.peer_goes_away = True
            self.phase = CLOSING
        return message  # Resume (to an LB only: see the limits), GoAway

    def _unknown_stream(self, message: Message) -> Optional[Event]:
        rno = message.rno  # type: ignore[union-attr]
        if type(message) is Request:  # to a worker only: see the limits
            if rno <= self.last_rno:
                raise RemoteProtocolError("request number %d after %d" % (rno, self.last_rno))
            self.last_rno = rno
            stream = self.streams[rno] = Stream(rno, self.window)
            stream.receiving = DONE if message.end else OPEN  # type: ignore[union-attr]
            return message
        if rno > self.last_rno:
            raise RemoteProtocolError("%s for request %d, never started"
                                      % (type(message).__name__, rno))
        return None  # a request that ended here: its late frames are harmless

    # -- sending ------------------------------------------------------

    def data_to_send(self) -> bytes:
        """Bytes the connection wrote on its own (Hello, Auth, Pong)."""
        out = self._out
        if not out:
            return b""
        data = b"".join(out)
        out.clear()
        return data

    def start_request(self, environ: Dict[str, str], end: bool = False) -> Tuple[int, bytes]:
        """LB side: a new request's number and its bytes (the whole request
        when ``end``: it has no body).  MessageTooLarge changes nothing."""
        rno = self.last_rno + 1
        return rno, self.send(Request(rno, environ, end))

    def send(self, message: Message) -> bytes:
        """The bytes of ``message``, after checking that we may send it."""
        if self.phase not in (OPEN_PHASE, CLOSING):
            raise LocalProtocolError("cannot send %s while %s" % (type(message).__name__, self.phase))
        data = encode(message, self.whole)  # first: a message too large changes nothing
        rno = getattr(message, "rno", 0)
        mtype = type(message)
        if not rno:
            if mtype is GoAway:
                self.we_go_away = True
                self.phase = CLOSING
            elif mtype not in (Ping, Pong) and not (mtype is Resume and self.role == "worker"):
                raise LocalProtocolError("a%s %s cannot send %s" % (
                    "n" if self.role == "lb" else "", self.role, mtype.__name__))
            return data
        stream = self.streams.get(rno)
        if stream is None:
            if mtype is not Request or self.role != "lb":
                raise LocalProtocolError("%s for request %d, which is not open here"
                                         % (mtype.__name__, rno))
            if rno != self.last_rno + 1 or rno > MAX_RNO:
                raise LocalProtocolError("request number %d after %d" % (rno, self.last_rno))
            if self.peer_goes_away:
                raise LocalProtocolError("the worker is going away: no new requests")
            self.last_rno = rno
            stream = self.streams[rno] = Stream(rno, self.window)
        if mtype is Body:
            size = len(message.data)  # type: ignore[union-attr]
            if size > stream.credit:
                raise LocalProtocolError("request %d: %d body bytes past our credit of %d"
                                         % (rno, size, stream.credit))
            stream.step("sending", BODY, LocalProtocolError)
            stream.credit -= size
        elif mtype is Credit:
            stream.step("receiving", CREDIT, LocalProtocolError)
            stream.window += message.n  # type: ignore[union-attr]
        elif mtype is Cancel:
            stream.sending = stream.receiving = CANCELLED
            del self.streams[rno]
        else:
            what = self._send_kinds.get(mtype)
            if what is None:
                raise LocalProtocolError("a%s %s cannot send %s" % (
                    "n" if self.role == "lb" else "", self.role, mtype.__name__))
            if what is START:  # a Request or Response: perhaps body bytes, perhaps the end
                size = len(getattr(message, "body", b""))
                if size > stream.credit or size > MAX_BODY:
                    raise LocalProtocolError("request %d: %d body bytes past our credit of %d"
                                             % (rno, size, stream.credit))
                stream.step("sending", what, LocalProtocolError)
                stream.credit -= size
                if message.end:  # type: ignore[union-attr]
                    stream.sending = DONE
            else:
                stream.step("sending", what, LocalProtocolError)
            if stream.sending in ENDED and stream.receiving in ENDED:
                del self.streams[rno]
        return data

    def respond(self, rno: int, status: str, headers: List[Tuple[str, str]],
                body: bytes = b"", end: bool = False) -> bytes:
        """Worker side: the bytes of Response(status, headers, body, end),
        one whole frame when it ends and the peer takes them; the checks
        of ``send``, made before anything changes (the whole response is
        refused or sent)."""
        if self.phase not in (OPEN_PHASE, CLOSING):
            raise LocalProtocolError("cannot send Response while %s" % self.phase)
        stream = self.streams.get(rno)
        if stream is None or self.role != "worker":
            raise LocalProtocolError("Response for request %d, which is not open here" % rno)
        if stream.sending != IDLE:
            raise LocalProtocolError("request %d: start not allowed while sending is %s"
                                     % (rno, stream.sending))
        if type(body) is not bytes:
            try:
                body = bytes(body)
            except TypeError as exc:
                raise LocalProtocolError("cannot send body %r: %s" % (type(body), exc))
        size = len(body)
        if size > stream.credit or size > MAX_BODY:
            raise LocalProtocolError("request %d: %d body bytes past our credit of %d"
                                     % (rno, size, stream.credit))
        try:
            payload = _response_payload(status, headers)
        except (ValueError, TypeError) as exc:
            raise LocalProtocolError("cannot encode the response to %d: %s" % (rno, exc))
        data = _response_frames(rno, payload, body, end, self.whole)
        stream.credit -= size
        if end:
            stream.sending = DONE
            if stream.receiving in ENDED:
                del self.streams[rno]
        else:
            stream.sending = OPEN
        return data

    def cancel(self, rno: int) -> bytes:
        """Cancel request ``rno``: the bytes to send, or nothing when it
        has already ended here (idempotent)."""
        if rno not in self.streams or self.phase == CLOSED:
            return b""
        return self.send(Cancel(rno))

    def consumed(self, rno: int, n: int) -> bytes:
        """We are done with ``n`` received body bytes of ``rno``: the Credit
        to send when a quarter of the window has been consumed, else b""."""
        stream = self.streams.get(rno)
        if stream is None or stream.receiving in ENDED:
            return b""
        stream.unacked += n
        if stream.unacked < self.window // 4:
            return b""
        n, stream.unacked = stream.unacked, 0
        return self.send(Credit(rno, n))

    def credit(self, rno: int) -> int:
        """Body bytes we may send on ``rno`` now (0 once it has ended)."""
        stream = self.streams.get(rno)
        return stream.credit if stream is not None else 0

    def close(self) -> List[int]:
        """The connection is over: the requests that were still open."""
        self.phase = CLOSED
        open_requests = list(self.streams)
        self.streams.clear()
        return open_requests
