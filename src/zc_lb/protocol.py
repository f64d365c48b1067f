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

Flow control: each direction of each request starts with ``WINDOW`` bytes
of credit.  A sender may send body bytes only within its credit; the
receiver grants more with ``Credit(n)`` as it *consumes* (not receives)
data.  So one slow client cannot stall the other requests on a
connection, nor grow the LB's memory past a window per request.

``Stream`` tracks one request's state as a table (state -> message type ->
next state).  A message that is illegal in the current state raises at
once: LocalProtocolError for what we send, RemoteProtocolError for what we
receive.

Weak spot, admitted: messages for a request that one side has just
cancelled may still be in flight from the other; the connection layer
ignores those for request numbers it has seen end, rather than calling
them errors.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import struct
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple, Type, Union

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
CREDIT = struct.Struct("!I")


# -- messages -----------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    """First message on a connection, from each side."""

    version: int
    role: str
    nonce: str
    auth: bool = False
    TYPE = 1


@dataclass(frozen=True)
class Auth:
    """HMAC proof of the shared secret."""

    digest: str
    TYPE = 2


@dataclass(frozen=True)
class Resume:
    """A worker's résumé: request class -> requests per second."""

    skills: Dict[str, float]
    TYPE = 3


@dataclass(frozen=True)
class Ping:
    """Keepalive; answered by Pong."""

    TYPE = 4


@dataclass(frozen=True)
class Pong:
    """Answer to Ping."""

    TYPE = 5


@dataclass(frozen=True)
class GoAway:
    """The sender is draining: send it no new requests."""

    reason: str = ""
    TYPE = 6


@dataclass(frozen=True)
class Request:
    """Start of a request: its CGI/WSGI environ, strings only."""

    rno: int
    environ: Dict[str, str]
    TYPE = 10


@dataclass(frozen=True)
class Body:
    """A chunk of request or response body."""

    rno: int
    data: bytes = field(repr=False)
    TYPE = 11


@dataclass(frozen=True)
class End:
    """End of the sender's direction of a request."""

    rno: int
    TYPE = 12


@dataclass(frozen=True)
class Response:
    """Start of a response: status line and headers."""

    rno: int
    status: str
    headers: List[Tuple[str, str]]
    TYPE = 13


@dataclass(frozen=True)
class Cancel:
    """Abandon a request, both directions."""

    rno: int
    TYPE = 14


@dataclass(frozen=True)
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


class NeedData:
    """Sentinel type: the decoder needs more bytes."""

    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA = NeedData()


# -- encoding -----------------------------------------------------------


def _json(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")


def _frame(rno: int, mtype: int, payload: bytes) -> bytes:
    return HEADER.pack(rno, mtype, len(payload)) + payload


def encode(message: Message) -> bytes:
    """The bytes of one message, header included."""
    try:
        return _encode(message)
    except (struct.error, ValueError, TypeError) as exc:
        raise LocalProtocolError("cannot encode %r: %s" % (message, exc))


def _encode(message: Message) -> bytes:
    if isinstance(message, Body):
        return _frame(message.rno, Body.TYPE, message.data)
    if isinstance(message, (End, Cancel)):
        return HEADER.pack(message.rno, message.TYPE, 0)
    if isinstance(message, Credit):
        return _frame(message.rno, Credit.TYPE, CREDIT.pack(message.n))
    if isinstance(message, Request):
        payload = _json(message.environ)
        if len(payload) > MAX_MESSAGE:  # the worker would drop the connection
            raise MessageTooLarge("request head of %d bytes, over the frame limit of %d"
                                  % (len(payload), MAX_MESSAGE))
        return _frame(message.rno, Request.TYPE, payload)
    if isinstance(message, Response):
        payload = _json([message.status, [list(h) for h in message.headers]])
        return _frame(message.rno, Response.TYPE, payload)
    if isinstance(message, (Ping, Pong)):
        return HEADER.pack(0, message.TYPE, 0)
    if isinstance(message, Resume):
        return _frame(0, Resume.TYPE, _json(message.skills))
    if isinstance(message, Hello):
        payload = _json({"version": message.version, "role": message.role,
                         "nonce": message.nonce, "auth": message.auth})
        return _frame(0, Hello.TYPE, payload)
    if isinstance(message, Auth):
        return _frame(0, Auth.TYPE, _json({"digest": message.digest}))
    if isinstance(message, GoAway):
        return _frame(0, GoAway.TYPE, _json({"reason": message.reason}))
    raise LocalProtocolError("cannot encode %r" % (message,))


def body_header(rno: int, length: int) -> bytes:
    """The header of a Body frame, for sending a large chunk without copying."""
    return HEADER.pack(rno, Body.TYPE, length)


# -- decoding -----------------------------------------------------------


def _reject_constant(name: str) -> object:
    raise ValueError("%s is not allowed" % name)


def _load_json(payload: bytes, what: str) -> object:
    try:
        return json.loads(payload.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise RemoteProtocolError("bad %s payload: %s" % (what, str(exc)[:200]))


def _string_dict(obj: object, what: str) -> Dict[str, str]:
    if not isinstance(obj, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in obj.items()
    ):
        raise RemoteProtocolError("%s must be an object of strings" % what)
    return obj


def _decode_hello(rno: int, payload: bytes) -> Hello:
    obj = _load_json(payload, "hello")
    if not isinstance(obj, dict):
        raise RemoteProtocolError("hello must be an object")
    version, role, nonce = obj.get("version"), obj.get("role"), obj.get("nonce")
    auth = obj.get("auth", False)
    if not (isinstance(version, int) and not isinstance(version, bool)
            and isinstance(role, str) and isinstance(nonce, str)
            and isinstance(auth, bool)):
        raise RemoteProtocolError("malformed hello %r" % (obj,))
    return Hello(version, role, nonce, auth)


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


def _decode_response(rno: int, payload: bytes) -> Response:
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
    return Response(rno, obj[0], headers)


def _decode_credit(rno: int, payload: bytes) -> Credit:
    if len(payload) != CREDIT.size:
        raise RemoteProtocolError("credit payload must be 4 bytes")
    (n,) = CREDIT.unpack(payload)
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
        self._limits = {mtype: max_message for mtype in _DECODERS}
        self._limits[Body.TYPE] = max_body
        self._limits[Resume.TYPE] = max_resume

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
            return _DECODERS[mtype](rno, payload)
        except RemoteProtocolError:
            raise
        except Exception as exc:  # whatever a hostile payload provokes
            raise RemoteProtocolError("bad payload in frame type %d: %r" % (mtype, exc))

    def _compact(self) -> None:
        if self._pos:
            del self._buffer[:self._pos]
            self._pos = 0


# -- handshake ----------------------------------------------------------


def new_hello(role: str, secret: Optional[bytes]) -> Hello:
    """Our Hello, with a fresh nonce."""
    return Hello(VERSION, role, os.urandom(16).hex(), secret is not None)


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


# -- per-request state --------------------------------------------------

IDLE, OPEN, DONE, CANCELLED = "IDLE", "OPEN", "DONE", "CANCELLED"

# state -> message type -> next state, for one direction of a request.
REQUEST_DIRECTION: Dict[str, Dict[type, str]] = {
    IDLE: {Request: OPEN},
    OPEN: {Body: OPEN, End: DONE},
    DONE: {},
}
RESPONSE_DIRECTION: Dict[str, Dict[type, str]] = {
    IDLE: {Response: OPEN},
    OPEN: {Body: OPEN, End: DONE},
    DONE: {},
}


class Stream:
    """The state of one request on a connection, as seen by one side.

    ``role`` is "lb" (sends the request, receives the response) or
    "worker" (the other way round).
    """

    __slots__ = ("rno", "role", "sending", "receiving", "_send_table", "_receive_table")

    def __init__(self, rno: int, role: str) -> None:
        self.rno = rno
        self.role = role
        self.sending = IDLE
        self.receiving = IDLE
        if role == "lb":
            self._send_table, self._receive_table = REQUEST_DIRECTION, RESPONSE_DIRECTION
        else:
            self._send_table, self._receive_table = RESPONSE_DIRECTION, REQUEST_DIRECTION

    @property
    def finished(self) -> bool:
        """Both directions ended (or the request was cancelled)."""
        return self.sending in (DONE, CANCELLED) and self.receiving in (DONE, CANCELLED)

    @property
    def cancelled(self) -> bool:
        return self.sending == CANCELLED

    def send(self, message: Message) -> None:
        """Record that we send ``message``; raise LocalProtocolError if illegal."""
        self.sending = self._step(self.sending, self._send_table, message, LocalProtocolError)

    def receive(self, message: Message) -> None:
        """Record that we received ``message``; raise RemoteProtocolError if illegal."""
        self.receiving = self._step(
            self.receiving, self._receive_table, message, RemoteProtocolError)

    def _step(self, state: str, table: Dict[str, Dict[type, str]], message: Message,
              error: Type[Exception]) -> str:
        if isinstance(message, Cancel):
            self.sending = self.receiving = CANCELLED
            return CANCELLED
        if isinstance(message, Credit) or state == CANCELLED:
            return state
        next_state = table[state].get(type(message))
        if next_state is None:
            raise error("request %d: %s not allowed in state %s"
                        % (self.rno, type(message).__name__, state))
        return next_state

    def __repr__(self) -> str:
        return "<Stream %d %s sending=%s receiving=%s>" % (
            self.rno, self.role, self.sending, self.receiving)
