"""The LB<->worker protocol's frames: messages to bytes and back.

Frames
------

Every frame is a 9-byte header and a payload::

     0               4        5               9
    +----------------+--------+----------------+------------------+
    | request number |  type  |     length     | payload ...      |
    |   u32, BE      |   u8   |    u32, BE     | (length bytes)   |
    +----------------+--------+----------------+------------------+

Request number 0 is the connection itself (hello, auth, résumé, ping,
pong, goaway, keys); any other number names one request, chosen by the
LB, increasing, never reused on a connection.

Payloads: body chunks travel as raw bytes; credit as a u32; everything
structured (hello, auth, résumé, environ, status and headers, goaway) as
JSON.  Never marshal or pickle: a worker port must not be a way to run
code.  Structured payloads are capped at ``max_message`` bytes (the
résumé at ``max_resume``), body chunks at ``max_body``; a frame over its
cap is refused from its header, before its payload is buffered.

Whole frames: most requests have no body and most responses fit one
frame, so when both Hellos offer the feature ``whole``, a request
without a body is one frame (``WHOLE_REQUEST``: the environ, then the
request ends) and a response sent entire is one frame (``WHOLE_RESPONSE``:
a u32 length, the status and headers, then the body; then it ends), not
three.  The receiver sees one ``Request`` or ``Response`` message with
``end`` set (and the response's ``body``).  A peer that does not offer
it (an older version) gets and sends the separate frames, so mixed
versions still talk.

Ready response heads: when the LB's Hello offers the feature ``ready``,
a worker sends a response's start as one ``READY_RESPONSE`` frame whose
head is ready for the client: the status line and header lines in
HTTP/1.1's bytes, checked by the worker against response splitting (it
is authenticated), with what the LB needs in a fixed prefix (flags: the
response ends here; the Content-Length the head says, -1 for none; the
application's seconds, -1 for unknown; the head's length), then the
head, then the first body bytes.  The LB adds only its own lines
(Connection, the body's framing) and writes head and body to the client
in one send: no JSON of headers decoded, re-checked and encoded again
per response.  The message is a ``Response`` whose ``head`` and
``length`` are set and whose ``headers`` are empty; ``head_fields``
parses the fields back for a reader that wants them.  An LB that does
not offer it (an older version) gets JSON heads.

Head requests: when a worker's Hello offers the feature ``head``, the
LB sends a request's start as one ``HEAD_REQUEST`` frame: the request
head as the LB's front checked it, with the client connection's facts
and the request's class (lb/relay.py says how), not a JSON environ; the
worker builds the same variables from it.  The message is a ``Request``
(with ``end`` set when the frame says the request has no body).  A
worker that does not offer it (an older version) gets JSON environs.

Keys: when both Hellos offer the feature ``keys``, an LB sends a worker,
now and then, the keys it sent it since (``Keys``: JSON, class -> the
keys' 64-bit hashes in the LB's book), and the worker sends the same to
each of its other LBs that offered it.  A peer that does not offer it
(an older version) gets none, and an LB that does not hear every
worker's keys routes as several LBs always did.

``encode`` turns a message into bytes; a ``Decoder`` turns bytes into
messages, checking each frame's type and size from its header.  What
may be sent when is ``wire/protocol.py``'s business.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Any, Dict, Final, List, Optional, Tuple, Union

import orjson
from mypy_extensions import mypyc_attr

from zc_lb.errors import (LocalProtocolError, MessageTooLarge, RemoteProtocolError,
                     ResponseHeadTooLarge)
from zc_lb.lb.relay import decode_head_request

VERSION: Final = 1
WINDOW: Final = 256 * 1024  # body bytes each side may send a request ahead, at the start
WIDE_WINDOW: Final = 1024 * 1024  # a large body's, granted as Credit (``protocol.widen``)
MAX_BODY: Final = 256 * 1024
MAX_MESSAGE: Final = 256 * 1024
MAX_RESUME: Final = 64 * 1024 * 1024
MAX_RNO: Final = 2**32 - 1
COMPACT_AT: Final = 64 * 1024  # decoded bytes kept at the buffer's head at most
COPY_ONCE_AT: Final = 4096  # payloads from this size are copied out through a memoryview
STREAM_AT: Final = 64 * 1024  # a Body frame this large is handed on in pieces as it comes

HEADER: Final = struct.Struct("!IBI")
HEADER_SIZE: Final = HEADER.size
CREDIT_PAYLOAD: Final = struct.Struct("!I")
HEAD_LENGTH: Final = struct.Struct("!I")  # of the status and headers in a WHOLE_RESPONSE

WHOLE: Final = "whole"  # the Hello feature: whole requests and responses in one frame
TIMING: Final = "timing"  # the Hello feature: a response head says the app's seconds
READY: Final = "ready"  # the Hello feature: response heads ready for the client
HEAD: Final = "head"  # the Hello feature: requests as their checked heads (lb/relay.py)
KEYS: Final = "keys"  # the Hello feature: Keys frames, relayed between the LBs
CACHE: Final = "cache"  # the Hello feature: a ready head says if the app's cache hit
FEATURES: Final = (WHOLE, TIMING)  # what either side takes beyond version 1
LB_FEATURES: Final = FEATURES + (READY, KEYS, CACHE)  # an LB takes ready heads, keys, cache
WORKER_FEATURES: Final = FEATURES + (HEAD, KEYS)  # what a worker takes: head requests, keys
MAX_KEY_HASH: Final = (1 << 64) - 1  # a key's hash in an LB's book is 64 bits
WHOLE_REQUEST: Final = 16  # Request and End
WHOLE_RESPONSE: Final = 17  # Response, Body and End
READY_RESPONSE: Final = 18  # Response with a ready head, perhaps Body, perhaps End
HEAD_REQUEST: Final = 19  # Request as its checked head, perhaps End (lb/relay.py)
READY_PREFIX: Final = struct.Struct("!BqdI")  # flags, Content-Length, elapsed, head length
READY_START: Final = struct.Struct("!IBIBqdI")  # HEADER and READY_PREFIX, packed at once
MAX_ELAPSED: Final = 1e9  # seconds: a response time past it is malformed
READY_END: Final = 1  # the flag: the response ends with this frame
# With ``cache``: the application said its cache had what the request
# needed (HIT) or had to load it (MISS); neither, it said nothing.
READY_HIT: Final = 2
READY_MISS: Final = 4
READY_FLAGS: Final = READY_END | READY_HIT | READY_MISS


# -- messages -----------------------------------------------------------

# Messages are values: never change one.  They are not frozen dataclasses
# only because a frozen one costs four times as much to build (1.6 us
# against 0.4 here), and a request builds three.  Compiled (mypyc), this
# module's functions run natively and its messages stay Python classes
# (``native_class=False``): a compiled dataclass cannot hold their class
# constant ``TYPE``, and ``slots=True`` would make it a slot.


@mypyc_attr(native_class=False)
@dataclass
class Hello:
    """First message on a connection, from each side."""

    version: int
    role: str
    nonce: str
    auth: bool = False
    app_version: Optional[str] = None  # a worker's application version, if it knows it
    features: Tuple[str, ...] = ()  # what the sender can receive beyond version 1
    TYPE = 1


@mypyc_attr(native_class=False)
@dataclass
class Auth:
    """HMAC proof of the shared secret."""

    digest: str
    TYPE = 2


@mypyc_attr(native_class=False)
@dataclass
class Resume:
    """A worker's résumé: request class -> requests per second."""

    skills: Dict[str, float]
    TYPE = 3


@mypyc_attr(native_class=False)
@dataclass
class Ping:
    """Keepalive; answered by Pong."""

    TYPE = 4


@mypyc_attr(native_class=False)
@dataclass
class Pong:
    """Answer to Ping."""

    TYPE = 5


@mypyc_attr(native_class=False)
@dataclass
class GoAway:
    """The sender is draining: send it no new requests."""

    reason: str = ""
    TYPE = 6


@mypyc_attr(native_class=False)
@dataclass
class Keys:
    """Keys an LB sent the worker, class -> the keys' hashes in its book:
    from an LB, which the worker relays to its other LBs as they are, so
    that every LB knows where every key's data is (``routing/affinity.py``,
    "Several LBs")."""

    keys: Dict[str, List[int]]
    TYPE = 7


@mypyc_attr(native_class=False)
@dataclass
class Request:
    """Start of a request: its CGI/WSGI environ, strings only; with
    ``end``, the whole request (it has no body)."""

    rno: int
    environ: Dict[str, str]
    end: bool = False
    TYPE = 10


@mypyc_attr(native_class=False)
@dataclass
class Body:
    """A chunk of request or response body."""

    rno: int
    data: bytes = field(repr=False)
    TYPE = 11


@mypyc_attr(native_class=False)
@dataclass
class End:
    """End of the sender's direction of a request."""

    rno: int
    TYPE = 12


@mypyc_attr(native_class=False)
@dataclass
class Response:
    """Start of a response: status line and headers, perhaps the first
    body bytes; with ``end``, the whole response."""

    rno: int
    status: str
    headers: List[Tuple[str, str]]
    body: bytes = field(default=b"", repr=False)
    end: bool = False
    elapsed: Optional[float] = None  # the application's seconds, if the worker said
    head: Optional[bytes] = field(default=None, repr=False)  # ready for the client
    length: Optional[int] = None  # with ``head``: the Content-Length it says, if any
    cache: Optional[bool] = None  # the app's cache hit (True) or missed, if it said
    TYPE = 13


@mypyc_attr(native_class=False)
@dataclass
class Cancel:
    """Abandon a request, both directions."""

    rno: int
    TYPE = 14


@mypyc_attr(native_class=False)
@dataclass
class Credit:
    """Permission to send ``n`` more body bytes on request ``rno``."""

    rno: int
    n: int
    TYPE = 15


ConnectionMessage = Union[Hello, Auth, Resume, Ping, Pong, GoAway, Keys]
RequestMessage = Union[Request, Body, End, Response, Cancel, Credit]
Message = Union[ConnectionMessage, RequestMessage]

CONNECTION_TYPES: Final[Dict[int, type]] = {
    cls.TYPE: cls for cls in (Hello, Auth, Resume, Ping, Pong, GoAway, Keys)
}
REQUEST_TYPES: Final[Dict[int, type]] = {
    cls.TYPE: cls for cls in (Request, Body, End, Response, Cancel, Credit)
}
FRAME_NAMES: Final[Dict[int, str]] = {
    mtype: cls.__name__ for mtype, cls in {**CONNECTION_TYPES, **REQUEST_TYPES}.items()}
FRAME_NAMES.update({WHOLE_REQUEST: "whole Request", WHOLE_RESPONSE: "whole Response",
                    READY_RESPONSE: "ready Response", HEAD_REQUEST: "head Request"})


class NeedData:
    """Sentinel type: the decoder needs more bytes."""

    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA: Final = NeedData()


# -- encoding -----------------------------------------------------------


def _json(obj: object) -> bytes:
    # orjson: RFC 8259 JSON in UTF-8, 15-30 times faster than the json
    # module for an environ.  It writes a non-finite float as null: the
    # one message with floats, the résumé, is checked before.
    return orjson.dumps(obj)


def _frame(rno: int, mtype: int, payload: bytes) -> bytes:
    return HEADER.pack(rno, mtype, len(payload)) + payload


def encode(message: Any, whole: bool = False) -> bytes:
    """The bytes of one message, header included: a Request or Response
    with ``end`` as one whole frame if ``whole`` (the peer offered it),
    else as the separate frames."""
    try:
        return _encode(message, whole)
    except (struct.error, ValueError, TypeError) as exc:
        raise LocalProtocolError("cannot encode %r: %s" % (message, exc))


def _encode(message: Any, whole: bool) -> bytes:
    if isinstance(message, Body):
        return _frame(message.rno, Body.TYPE, message.data)
    if isinstance(message, (End, Cancel)):
        return HEADER.pack(message.rno, message.TYPE, 0)
    if isinstance(message, Credit):
        return _frame(message.rno, Credit.TYPE, CREDIT_PAYLOAD.pack(message.n))
    if isinstance(message, Request):
        return request_frames(message.rno, message.environ, message.end, whole)
    if isinstance(message, Response):
        return _response_frames(message.rno, _response_payload(message.status, message.headers,
                                                               message.elapsed),
                                message.body, message.end, whole)
    if isinstance(message, (Ping, Pong)):
        return HEADER.pack(0, message.TYPE, 0)
    if isinstance(message, Resume):
        scores: List[Any] = list(message.skills.values())
        for score in scores:  # (what the LB would refuse)
            if not _is_number(score) or not math.isfinite(score):
                raise LocalProtocolError("résumé with a score that is not finite: %r"
                                         % (score,))
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
    if isinstance(message, Keys):
        return _frame(0, Keys.TYPE, _json(_checked_keys(message.keys, LocalProtocolError)))
    raise LocalProtocolError("cannot encode %r" % (message,))


def _checked_keys(keys: object, error: Any) -> Dict[str, List[int]]:
    """``keys`` if it is class -> list of key hashes (ints in [0, 2**64)),
    else raise ``error``."""
    if type(keys) is not dict:
        raise error("keys must be an object of lists of key hashes")
    for rclass, hashes in keys.items():
        if type(rclass) is not str or type(hashes) is not list:
            raise error("keys of class %r must be a list of key hashes" % (rclass,))
        for value in hashes:
            if type(value) is not int or not 0 <= value <= MAX_KEY_HASH:
                raise error("key hash %r of class %r is not in [0, 2**64)"
                            % (value, rclass))
    return keys


def request_frames(rno: int, environ: Dict[str, str], end: bool, whole: bool) -> bytes:
    """A Request's frames: one whole frame when it ``end``s and the peer
    takes them (``whole``), else Request, then End if it ``end``s."""
    payload = _json(environ)
    if len(payload) > MAX_MESSAGE:  # the worker would drop the connection
        raise MessageTooLarge("request head of %d bytes, over the frame limit of %d"
                              % (len(payload), MAX_MESSAGE))
    if not end:
        return _frame(rno, Request.TYPE, payload)
    if whole:
        return _frame(rno, WHOLE_REQUEST, payload)
    return _frame(rno, Request.TYPE, payload) + HEADER.pack(rno, End.TYPE, 0)


def head_request_frame(rno: int, payload: bytes) -> bytes:
    """A HEAD_REQUEST frame of ``payload`` (``relay.Relay.payload``)."""
    if len(payload) > MAX_MESSAGE:  # the worker would drop the connection
        raise MessageTooLarge("request head of %d bytes, over the frame limit of %d"
                              % (len(payload), MAX_MESSAGE))
    return HEADER.pack(rno, HEAD_REQUEST, len(payload)) + payload


def _response_payload(status: Any, headers: List[Any],
                      elapsed: Any = None) -> bytes:
    # orjson writes tuples as arrays: no list(h) copy per header.  Names
    # and values must be strings, as the peer checks.
    for header in headers:
        if len(header) != 2 or type(header[0]) is not str or type(header[1]) is not str:
            raise LocalProtocolError("response header %r is not a pair of strings" % (header,))
    if elapsed is None:
        head = _json([status, headers])
    else:
        _check_elapsed(elapsed)
        head = _json([status, headers, round(elapsed, 6)])
    if len(head) > MAX_MESSAGE:  # the LB would drop the whole connection
        raise ResponseHeadTooLarge("response head of %d bytes, over the frame limit of %d"
                                   % (len(head), MAX_MESSAGE))
    return head


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


def _is_number(value: object) -> bool:
    """An int or a float, not a bool: what a score or a time may be."""
    return isinstance(value, (int, float)) and type(value) is not bool


def _good_elapsed(value: object) -> bool:
    """A response time the peer takes: in [0, ``MAX_ELAPSED``) seconds."""
    return (isinstance(value, (int, float)) and type(value) is not bool
            and 0.0 <= value < MAX_ELAPSED)


def _check_elapsed(elapsed: object) -> None:
    """Refuse a response time the peer would refuse, dropping the whole
    connection (NaN included)."""
    if not _good_elapsed(elapsed):
        raise LocalProtocolError("response time %r is not in [0, %g) seconds"
                                 % (elapsed, MAX_ELAPSED))


def ready_frame(rno: int, head: bytes, length: Optional[int], elapsed: Any,
                body: bytes, end: bool, cache: Optional[bool] = None) -> bytes:
    """A READY_RESPONSE frame: ``head`` (status line and header lines,
    each ending in CRLF, checked by the caller) and the first ``body``
    bytes, ending the response if ``end``; ``cache``, whether the app's
    cache hit, for a peer that offered ``cache``."""
    if elapsed is None:
        elapsed = -1.0
    else:
        _check_elapsed(elapsed)
    flags = READY_END if end else 0
    if cache is not None:
        flags |= READY_HIT if cache else READY_MISS
    return b"".join((READY_START.pack(
        rno, READY_RESPONSE, READY_PREFIX.size + len(head) + len(body),
        flags, -1 if length is None else length, elapsed, len(head)),
        head, body))


def head_fields(head: bytes) -> List[Tuple[str, str]]:
    """The header fields of a ready head, as WSGI's list of pairs."""
    fields = []
    for line in head.decode("latin-1").split("\r\n")[1:-1]:
        name, _, value = line.partition(":")
        fields.append((name, value.strip()))
    return fields


def body_header(rno: int, length: int) -> bytes:
    """The header of a Body frame, for sending a large chunk without copying."""
    return HEADER.pack(rno, Body.TYPE, length)


# -- decoding -----------------------------------------------------------


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
    if set(map(type, obj.values())) <= {float}:
        return Resume(obj)  # (what workers send: a check in C, no copy)
    skills = {}
    for rclass, score in obj.items():
        if not _is_number(score):
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
    return Keys(_checked_keys(_load_json(payload, "keys"), RemoteProtocolError))


def _decode_request(rno: int, payload: bytes) -> Request:
    return Request(rno, _string_dict(_load_json(payload, "request"), "environ"))


def _response_head(payload) -> Tuple[str, List[Tuple[str, str]], Optional[float]]:
    """Status, headers and, from a worker that offers ``timing``, the
    application's seconds: ``[status, headers]`` or ``[status, headers,
    elapsed]``."""
    obj = _load_json(payload, "response")
    if not (isinstance(obj, list) and len(obj) in (2, 3) and isinstance(obj[0], str)
            and isinstance(obj[1], list)):
        raise RemoteProtocolError("malformed response start")
    elapsed = None
    if len(obj) == 3:
        elapsed = obj[2]
        if not _good_elapsed(elapsed):
            raise RemoteProtocolError("malformed response time %r" % (elapsed,))
        elapsed = float(elapsed)
    headers = []
    for header in obj[1]:
        if not (isinstance(header, list) and len(header) == 2
                and isinstance(header[0], str) and isinstance(header[1], str)):
            raise RemoteProtocolError("malformed response header %r" % (header,))
        headers.append((header[0], header[1]))
    return obj[0], headers, elapsed


def _decode_response(rno: int, payload: bytes) -> Response:
    status, headers, elapsed = _response_head(payload)
    return Response(rno, status, headers, elapsed=elapsed)


def _decode_whole_request(rno: int, payload: bytes) -> Request:
    return Request(rno, _string_dict(_load_json(payload, "request"), "environ"), True)


def _decode_head_request(rno: int, payload: bytes) -> Request:
    environ, end = decode_head_request(payload)
    return Request(rno, environ, end)


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
    status, headers, elapsed = _response_head(memoryview(payload)[HEAD_LENGTH.size:start])
    return Response(rno, status, headers, payload[start:], True, elapsed)


def _decode_ready_response(max_message: int, max_body: int, rno: int,
                           payload: bytes, allowed: int = READY_END) -> Response:
    """A READY_RESPONSE: its prefix and head are checked for framing
    only (the worker checked the fields): a status line of three digits,
    lines that end in CRLF, and no empty line, which would end the head
    early and let the rest pass as a body or a second response.  Flags
    past ``allowed`` (what we offered) are refused, and so are HIT and
    MISS together."""
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
    if (status is None or length < -1 or flags & ~allowed
            or flags & (READY_HIT | READY_MISS) == READY_HIT | READY_MISS
            or not (elapsed == -1.0 or 0.0 <= elapsed < MAX_ELAPSED)):
        raise RemoteProtocolError("malformed ready response head %r" % head[:200])
    return Response(rno, status, [], payload[start:], flags & READY_END != 0,
                    None if elapsed == -1.0 else elapsed, head, None if length == -1 else length,
                    None if not flags & (READY_HIT | READY_MISS) else flags & READY_HIT != 0)


def ready_status(head: bytes) -> Optional[str]:
    """The status of a ready head whose framing is right, else None.  Its
    framing (the worker checked its fields): an HTTP/1.1 status line of
    three digits, then lines that each end in CRLF, with no bare CR or LF
    and no empty line, which would end the head early.  (In string
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
    return text[9:text.find("\r\n")]


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
    Response.TYPE: _decode_response,
    Cancel.TYPE: _decode_empty(Cancel),
    Credit.TYPE: _decode_credit,
    WHOLE_REQUEST: _decode_whole_request,
    HEAD_REQUEST: _decode_head_request,
    WHOLE_RESPONSE: None,  # (``Decoder._next``: with the decoder's limits)
    READY_RESPONSE: None,  # (the same)
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
        self._pieces: List[Body] = []  # of a large Body frame, to hand on
        self._body_left = 0  # bytes still to come of that frame
        self._body_rno = 0
        self._header_next = 0  # (see ``wants``)
        self._error: Optional[RemoteProtocolError] = None
        self._rno = 0  # the request number of the frame being decoded
        self._max_message, self._max_body = max_message, max_body
        self.ready_flags = READY_END  # a READY_RESPONSE's flags taken (READY_FLAGS: ``cache``)
        limits = {mtype: max_message for mtype in _DECODERS}
        limits[Body.TYPE] = max_body
        limits[Resume.TYPE] = max_resume
        limits[WHOLE_RESPONSE] = HEAD_LENGTH.size + max_message + max_body
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
        return self._body_left or self._header_next

    @property
    def buffered(self) -> int:
        """Bytes received and not yet decoded."""
        return len(self._buffer) - self._pos

    def next_message(self) -> Union[Message, NeedData]:
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

    def _next(self) -> Union[Message, NeedData]:
        buf, pos = self._buffer, self._pos
        if len(buf) - pos < HEADER_SIZE:
            self._compact()
            return NEED_DATA
        # (Typed, so that compiled code compares them natively.)
        header: Tuple[int, int, int] = HEADER.unpack_from(buf, pos)
        rno, mtype, length = header
        self._rno = rno
        limit = self.limits.get(mtype)
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
            # (The commonest two first: compiled, each a native call.)
            if mtype == READY_RESPONSE:
                return _decode_ready_response(self._max_message, self._max_body, rno, payload,
                                              self.ready_flags)
            if mtype == HEAD_REQUEST:
                return _decode_head_request(rno, payload)
            if mtype == WHOLE_REQUEST:
                return _decode_whole_request(rno, payload)
            if mtype == WHOLE_RESPONSE:
                return _decode_whole_response(self._max_message, self._max_body, rno, payload)
            return _DECODERS[mtype](rno, payload)
        except RemoteProtocolError:
            raise
        except Exception as exc:  # whatever a hostile payload provokes
            raise RemoteProtocolError("bad payload in frame type %d: %r" % (mtype, exc))

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
