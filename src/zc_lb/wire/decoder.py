"""Bytes to messages: a ``Decoder`` of what one peer sends.

Bytes go in with ``receive_data``; ``next_message`` hands out messages
until it answers NEED_DATA.  Most payloads are copied out of one buffer
once; a Body frame of STREAM_AT bytes or more is handed on in pieces as
it comes, and ``wants`` sizes the reads for it, so that a large body is
not gathered first.

Rules: a frame is judged from its 9-byte header, before its payload is
buffered: its type must be one ``allow`` admits now (the protocol's
phase and role say which), its size within that type's limit, and its
request number 0 exactly for the connection's own types.  An LB's
decoder (``resume_limit`` given) hands a résumé on as it came, a
``ResumeFrame``, for the LB to decode when it takes it
(``wire/intake.py``); one over ``resume_limit`` is skipped as its bytes
come, never buffered, and handed on without them.  Every payload
is checked strictly (JSON by RFC 8259, strings where strings are due, a
ready head's framing), and whatever a hostile payload provokes becomes a
RemoteProtocolError naming the request whose frame broke it; after one
the decoder stays broken, and the connection must be dropped.
"""

from __future__ import annotations

from typing import Any, Dict, Final, List, NoReturn, Optional, Tuple, Union

import orjson

from zc_lb.errors import RemoteProtocolError
from zc_lb.lb.relay import decode_head_request
from zc_lb.wire.frames import (
    CONNECTION_TYPES,
    CREDIT_PAYLOAD,
    FRAME_NAMES,
    HEAD_REQUEST,
    HEADER,
    HEADER_SIZE,
    MAX_BODY,
    MAX_ELAPSED,
    MAX_MESSAGE,
    MAX_RESUME,
    READY_END,
    READY_FLAGS,
    READY_HIT,
    READY_MISS,
    READY_PREFIX,
    READY_RESPONSE,
    RETIRED,
    WHOLE_REQUEST,
    Auth,
    Body,
    Cancel,
    Credit,
    End,
    GoAway,
    Hello,
    Keys,
    Message,
    Ping,
    Pong,
    Request,
    Response,
    Resume,
    checked_keys,
    is_number,
)

COMPACT_AT: Final = 64 * 1024  # decoded bytes kept at the buffer's head at most
COPY_ONCE_AT: Final = 4096  # payloads from this size are copied out through a memoryview
STREAM_AT: Final = 64 * 1024  # a Body frame this large is handed on in pieces as it comes


class NeedData:
    """Sentinel type: the decoder needs more bytes."""

    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA: Final = NeedData()


class ResumeFrame:
    """A résumé frame of ``size`` bytes as an LB's decoder hands it on:
    its payload in the ``parts`` its reads brought (``payload`` joins
    them, for ``decode_resume``), or None when it was over the
    decoder's ``resume_limit`` and is skipped unread; ``left``: its
    bytes still to come."""

    __slots__ = ("parts", "size", "left")

    def __init__(self, parts: Optional[List[bytes]], size: int, left: int = 0) -> None:
        self.parts = parts
        self.size = size
        self.left = left

    @property
    def skipped(self) -> bool:
        return self.parts is None

    def payload(self) -> bytes:
        parts = self.parts or []
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def take(self, data: Union[bytes, memoryview]) -> Union[bytes, memoryview]:
        """Take the frame's bytes from the start of ``data``; the rest."""
        n = min(self.left, len(data))
        if self.parts is not None:
            piece = data[:n]
            self.parts.append(piece if type(piece) is bytes else bytes(piece))
        self.left -= n
        return data[n:]

    def __repr__(self) -> str:
        return "<ResumeFrame %d bytes%s>" % (self.size, ", skipped" if self.skipped else "")


def _load_json(payload: Union[bytes, memoryview], what: str) -> Any:
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
    instance = obj.get("instance")  # (absent from a release before it)
    if not (isinstance(version, int) and not isinstance(version, bool)
            and isinstance(role, str) and isinstance(nonce, str)
            and isinstance(auth, bool) and (app_version is None or isinstance(app_version, str))
            and isinstance(features, list) and all(isinstance(f, str) for f in features)
            and (instance is None or isinstance(instance, str) and 0 < len(instance) <= 64)):
        raise RemoteProtocolError("malformed hello %r" % (obj,))
    return Hello(version, role, nonce, auth, app_version, tuple(features), instance)


def _decode_auth(rno: int, payload: bytes) -> Auth:
    obj = _load_json(payload, "auth")
    if not isinstance(obj, dict) or not isinstance(obj.get("digest"), str):
        raise RemoteProtocolError("malformed auth")
    return Auth(obj["digest"])


def decode_resume(payload: bytes) -> Resume:
    """A résumé's payload, checked (RemoteProtocolError)."""
    return _decode_resume(0, payload)


def _decode_resume(rno: int, payload: bytes) -> Resume:
    obj = _load_json(payload, "resume")
    if not isinstance(obj, dict):
        raise RemoteProtocolError("résumé must be an object")
    if set(map(type, obj.values())) <= {float}:
        return Resume(obj)  # (what workers send: a check in C, no copy)
    skills = {}
    for rclass, score in obj.items():
        if not is_number(score):
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


def _decode_keys(rno: int, payload: bytes) -> Keys:
    return Keys(checked_keys(_load_json(payload, "keys"), RemoteProtocolError))


def _json_environ(payload: bytes) -> Dict[str, str]:
    """A request's environ as JSON: an object of strings, without
    ``wsgi.input``, which the worker makes (worker/wsgi.py takes an
    environ that holds it for a head request's, which holds every
    variable: one that lacked REQUEST_METHOD failed the worker's code)."""
    environ = _string_dict(_load_json(payload, "request"), "environ")
    if "wsgi.input" in environ:
        raise RemoteProtocolError("environ holds wsgi.input, which is the worker's to make")
    return environ


def _decode_request(rno: int, payload: bytes) -> Request:
    return Request(rno, _json_environ(payload))


def _decode_whole_request(rno: int, payload: bytes) -> Request:
    return Request(rno, _json_environ(payload), True)


def _decode_head_request(rno: int, payload: bytes) -> Request:
    environ, end = decode_head_request(payload)
    return Request(rno, environ, end)


def _decode_ready_response(max_message: int, max_body: int, rno: int,
                           payload: bytes) -> Response:
    """A READY_RESPONSE: its prefix and head are checked for framing
    only (the worker checked the fields): a status line of three digits,
    lines that end in CRLF, and no empty line, which would end the head
    early and let the rest pass as a body or a second response.  Flags
    past READY_FLAGS are refused, and so are HIT and MISS together."""
    size = READY_PREFIX.size
    if len(payload) < size:
        raise RemoteProtocolError("ready response of %d bytes, without its prefix" % len(payload))
    # (Typed, so that compiled code compares them natively.)
    prefix: Tuple[int, int, float, int] = READY_PREFIX.unpack_from(payload)
    flags, length, elapsed, head_size = prefix
    start = size + head_size
    if start > len(payload) or head_size > max_message or len(payload) - start > max_body:
        raise RemoteProtocolError("ready response with a %d-byte head in %d bytes, over the "
                                  "frame or the limits of %d and %d"
                                  % (head_size, len(payload), max_message, max_body))
    head = payload[size:start]
    status = ready_status(head)
    if (status is None or length < -1 or flags & ~READY_FLAGS
            or flags & (READY_HIT | READY_MISS) == READY_HIT | READY_MISS
            or not (elapsed == -1.0 or 0.0 <= elapsed < MAX_ELAPSED)):
        raise RemoteProtocolError("malformed ready response head %r" % head[:200])
    return Response(rno, status, head, payload[start:], flags & READY_END != 0,
                    None if elapsed == -1.0 else elapsed, None if length == -1 else length,
                    None if not flags & (READY_HIT | READY_MISS) else flags & READY_HIT != 0)


def ready_status(head: bytes) -> Optional[str]:
    """The status of a ready head whose framing is right, else None.  Its
    framing (the worker checked its fields): an HTTP/1.1 status line of
    three digits, the first 2 to 9 (a 1xx is interim: the client would
    take the next response for this one's), then lines that each end in
    CRLF, with no bare CR or LF and no empty line, which would end the
    head early.  (In string
    operations, which mypyc compiles, at half a regular expression's
    cost; tests/test_protocol.py checks it against one.)"""
    text = head.decode("latin-1")
    lines = text.count("\r\n")
    if (len(text) < 14 or not text.startswith("HTTP/1.1 ") or not text.endswith("\r\n")
            or text.count("\r") != lines or text.count("\n") != lines
            or text.find("\r\n\r\n") >= 0):
        return None
    for i in range(9, 12):
        if not 48 <= ord(text[i]) <= 57:  # (ASCII digits; compiled, ints compare natively)
            return None
    if text[9] < "2":
        return None  # (a 1xx, or 0xx)
    return text[9:text.find("\r\n")]


def head_fields(head: bytes) -> List[Tuple[str, str]]:
    """The header fields of a ready head, as WSGI's list of pairs."""
    fields = []
    for line in head.decode("latin-1").split("\r\n")[1:-1]:
        name, _, value = line.partition(":")
        fields.append((name, value.strip()))
    return fields


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
    Keys.TYPE: _decode_keys,
    Request.TYPE: _decode_request,
    Body.TYPE: lambda rno, payload: Body(rno, payload),
    End.TYPE: _decode_empty(End),
    Cancel.TYPE: _decode_empty(Cancel),
    Credit.TYPE: _decode_credit,
    WHOLE_REQUEST: _decode_whole_request,
    HEAD_REQUEST: _decode_head_request,
    READY_RESPONSE: None,  # (``Decoder._decode``: with the decoder's limits)
}


class Decoder:
    """Turns received bytes into messages.

    Feed bytes with ``receive_data``; call ``next_message`` until it
    returns NEED_DATA.  A protocol violation raises RemoteProtocolError,
    and the decoder stays broken: the connection must be dropped.
    """

    def __init__(self, max_body: int = MAX_BODY, max_message: int = MAX_MESSAGE,
                 max_resume: int = MAX_RESUME, resume_limit: Optional[int] = None) -> None:
        self._buffer = bytearray()
        self._resume_limit = resume_limit  # (an LB's: résumés as ResumeFrames)
        self._resume: Optional[ResumeFrame] = None  # one whose bytes still come
        self._pos = 0
        self._pieces: List[Union[Body, ResumeFrame]] = []  # of a large Body frame, to hand on
        self._body_left = 0  # bytes still to come of that frame
        self._body_rno = 0
        self._header_next = 0  # (see ``wants``)
        self._error: Optional[RemoteProtocolError] = None
        self._rno = 0  # the request number of the frame being decoded
        self._max_message, self._max_body = max_message, max_body
        limits = {mtype: max_message for mtype in _DECODERS}
        limits[Body.TYPE] = max_body
        limits[Resume.TYPE] = max_resume
        limits[READY_RESPONSE] = READY_PREFIX.size + max_message + max_body
        self.allow(limits)

    def allow(self, limits: Dict[int, int], why: str = "") -> None:
        """Accept only these frame types from now on, each up to its
        payload limit; any other type is refused from its header, ``why``
        saying why it is not allowed."""
        self.limits = limits
        self._why = why

    def receive_data(self, data: Union[bytes, memoryview]) -> None:
        """Add bytes received from the peer."""
        self._header_next = 0
        resume = self._resume
        if resume is not None:  # the rest of an LB's résumé: kept (or dropped) as it comes
            data = resume.take(data)
            if not resume.left:
                self._resume = None
                if not resume.skipped:
                    self._pieces.append(resume)
            if not data:
                return
        left = self._body_left
        if left:  # the rest of a large Body frame: handed on as it comes
            piece = data if len(data) <= left else data[:left]
            self._pieces.append(Body(self._body_rno, piece if type(piece) is bytes
                                     else bytes(piece)))
            self._body_left = left - len(piece)
            if not self._body_left and len(piece) == len(data):
                self._header_next = HEADER_SIZE
                return
            data = data[len(piece):]
        self._buffer += data

    def wants(self) -> int:
        """How many bytes the next read should take, 0 for as many as
        come.  A Body frame of STREAM_AT bytes or more is handed on in
        pieces as its payload comes, not gathered first: while the rest
        of one is to come this is its size, for a read of it alone whose
        bytes (``recv``'s) become the next piece as they are; right after
        one, a header's, since the next frame is often another.  (Read
        into a buffer, a body was copied three times and more on its way
        through the buffer to the application.)"""
        resume = self._resume
        if resume is not None and not resume.skipped:
            return resume.left
        return self._body_left or self._header_next

    @property
    def buffered(self) -> int:
        """Bytes received and not yet decoded."""
        return len(self._buffer) - self._pos

    def next_message(self) -> Union[Message, ResumeFrame, NeedData]:
        """The next complete message, or NEED_DATA."""
        if self._error is not None:
            raise self._error
        if self._pieces:
            return self._pieces.pop(0)
        try:
            return self._next()
        except RemoteProtocolError as exc:
            exc.rno = exc.rno or self._rno  # the request whose frame broke it
            self._error = exc
            raise

    def _next(self) -> Union[Message, ResumeFrame, NeedData]:
        buf, pos = self._buffer, self._pos
        if len(buf) - pos < HEADER_SIZE:
            self._compact()
            return NEED_DATA
        # (Typed, so that compiled code compares them natively.)
        header: Tuple[int, int, int] = HEADER.unpack_from(buf, pos)
        rno, mtype, length = header
        self._rno = rno
        limit = self.limits.get(mtype)
        if limit is None or length > limit or (rno == 0) != (mtype in CONNECTION_TYPES):
            self._refuse(rno, mtype, length, limit)
        end = pos + HEADER_SIZE + length
        if mtype == Resume.TYPE and self._resume_limit is not None:
            return self._take_resume(pos, end, length, self._resume_limit)
        if len(buf) < end:
            if mtype == Body.TYPE and length >= STREAM_AT:
                return self._stream(rno, pos + HEADER_SIZE, length)
            if pos > COMPACT_AT:
                self._compact()
            return NEED_DATA
        if length < COPY_ONCE_AT:
            payload = bytes(buf[pos + HEADER_SIZE:end])
        else:  # (a slice of the bytearray, then bytes of it, copied a body twice)
            with memoryview(buf) as view:
                payload = bytes(view[pos + HEADER_SIZE:end])
        self._pos = end
        try:
            return self._decode(rno, mtype, payload)
        except RemoteProtocolError:
            raise
        except Exception as exc:  # whatever a hostile payload provokes
            raise RemoteProtocolError("bad payload in frame type %d: %r" % (mtype, exc))

    def _refuse(self, rno: int, mtype: int, length: int, limit: Optional[int]) -> NoReturn:
        """Raise for a frame whose header ``_next`` refuses: a type not
        allowed now (or unknown), a payload over its limit, or a request
        number that does not fit the type."""
        if limit is None:
            if mtype in _DECODERS:
                raise RemoteProtocolError("%s frame not allowed%s" % (
                    FRAME_NAMES[mtype], self._why))
            if mtype in RETIRED:
                raise RemoteProtocolError(
                    "frame type %d, %s, is not taken: a worker sends a response head ready "
                    "for the client (READY_RESPONSE)" % (mtype, RETIRED[mtype]))
            raise RemoteProtocolError("unknown frame type %d" % mtype)
        if length > limit:
            raise RemoteProtocolError(
                "frame of type %d is %d bytes, over the limit of %d" % (mtype, length, limit))
        raise RemoteProtocolError("frame type %d with request number %d" % (mtype, rno))

    def _decode(self, rno: int, mtype: int, payload: bytes) -> Message:
        """The message of a whole frame whose header passed."""
        # (The commonest two first: compiled, each a native call.)
        if mtype == READY_RESPONSE:
            return _decode_ready_response(self._max_message, self._max_body, rno, payload)
        if mtype == HEAD_REQUEST:
            return _decode_head_request(rno, payload)
        if mtype == WHOLE_REQUEST:
            return _decode_whole_request(rno, payload)
        return _DECODERS[mtype](rno, payload)

    def _take_resume(self, pos: int, end: int, length: int,
                     limit: int) -> Union[ResumeFrame, NeedData]:
        """An LB's résumé frame, once it has come, the rest of it read by
        itself as a large body's is; one over ``limit`` at once from its
        header, its bytes dropped, here and as they come."""
        buf = self._buffer
        skipped = length > limit
        here = min(len(buf), end)
        parts: Optional[List[bytes]] = None
        if not skipped:
            with memoryview(buf) as view:
                parts = [bytes(view[pos + HEADER_SIZE:here])]
        frame = ResumeFrame(parts, length, end - here)
        self._pos = here
        if frame.left:
            self._compact()
            self._resume = frame
            if not skipped:
                return NEED_DATA
        return frame

    def _stream(self, rno: int, start: int, length: int) -> Union[Message, NeedData]:
        """Hand on the start of a large Body frame (what of it is here) and
        take the rest as it comes (``receive_data``)."""
        buf = self._buffer
        with memoryview(buf) as view:
            piece = bytes(view[start:])
        self._body_rno, self._body_left = rno, length - len(piece)
        self._pos = len(buf)
        self._compact()
        return Body(rno, piece) if piece else NEED_DATA

    def _compact(self) -> None:
        if self._pos:
            del self._buffer[:self._pos]
            self._pos = 0
