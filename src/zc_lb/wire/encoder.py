"""Messages to bytes: the frames of ``wire/frames.py`` as a sender makes them.

``encode`` makes any message's frames; the hot path's frames have their
own functions (``request_frames``, ``head_request_frame``,
``ready_response``, ``ready_frame``), and ``body_header`` a large Body
chunk's header alone, for its bytes to go out as they are, not copied
into one frame with it.

Rules: what the peer would refuse is refused here, before a byte is
sent, as our own code's fault (LocalProtocolError): a score that is not
finite, a response time out of range, a key hash past 64 bits; a
response head HTTP forbids is the application's (BadResponseHead).  A
request head or response head over MAX_MESSAGE would make the peer drop
the whole connection: it raises MessageTooLarge (a request) or
ResponseHeadTooLarge (a response), which cost that request alone.
Structured payloads are JSON (orjson); never marshal or pickle.
"""

from __future__ import annotations

import math
import struct
from typing import Any, Dict, List, Optional, Tuple

import orjson

from zc_lb.errors import (BadResponseHead, LocalProtocolError, MessageTooLarge,
                          ResponseHeadTooLarge)
from zc_lb.front.h1 import ready_head
from zc_lb.wire.frames import (
    CREDIT_PAYLOAD,
    HEAD_REQUEST,
    HEADER,
    MAX_ELAPSED,
    MAX_MESSAGE,
    READY_END,
    READY_HIT,
    READY_MISS,
    READY_PREFIX,
    READY_RESPONSE,
    READY_START,
    WHOLE_REQUEST,
    Auth,
    Body,
    Cancel,
    Credit,
    End,
    GoAway,
    Hello,
    Keys,
    Ping,
    Pong,
    Request,
    Response,
    Resume,
    checked_keys,
    good_elapsed,
    is_number,
)


def _json(obj: object) -> bytes:
    # orjson: RFC 8259 JSON in UTF-8, 15-30 times faster than the json
    # module for an environ.  It writes a non-finite float as null: the
    # one message with floats, the résumé, is checked before.
    return orjson.dumps(obj)


def _frame(rno: int, mtype: int, payload: bytes) -> bytes:
    return HEADER.pack(rno, mtype, len(payload)) + payload


def encode(message: Any) -> bytes:
    """The bytes of one message, header included: a Request with ``end``
    as one whole frame, a Response (its head made) as a ready one."""
    try:
        return _encode(message)
    except (struct.error, ValueError, TypeError) as exc:
        raise LocalProtocolError("cannot encode %r: %s" % (message, exc))


def _encode(message: Any) -> bytes:
    if isinstance(message, Body):
        return _frame(message.rno, Body.TYPE, message.data)
    if isinstance(message, (End, Cancel)):
        return HEADER.pack(message.rno, message.TYPE, 0)
    if isinstance(message, Credit):
        return _frame(message.rno, Credit.TYPE, CREDIT_PAYLOAD.pack(message.n))
    if isinstance(message, Request):
        return request_frames(message.rno, message.environ, message.end)
    if isinstance(message, Response):
        return ready_frame(message.rno, message.head, message.length, message.elapsed,
                           message.body, message.end, message.cache)
    if isinstance(message, (Ping, Pong)):
        return HEADER.pack(0, message.TYPE, 0)
    if isinstance(message, Resume):
        scores: List[Any] = list(message.skills.values())
        for score in scores:  # (what the LB would refuse)
            if not is_number(score) or not math.isfinite(score):
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
        if message.instance is not None:
            hello["instance"] = message.instance
        payload = _json(hello)
        return _frame(0, Hello.TYPE, payload)
    if isinstance(message, Auth):
        return _frame(0, Auth.TYPE, _json({"digest": message.digest}))
    if isinstance(message, GoAway):
        return _frame(0, GoAway.TYPE, _json({"reason": message.reason}))
    if isinstance(message, Keys):
        return _frame(0, Keys.TYPE, _json(checked_keys(message.keys, LocalProtocolError)))
    raise LocalProtocolError("cannot encode %r" % (message,))


def request_frames(rno: int, environ: Dict[str, str], end: bool) -> bytes:
    """A Request's frame: a WHOLE_REQUEST when it ``end``s (it has no
    body), else a Request, its body and End to follow."""
    payload = _json(environ)
    if len(payload) > MAX_MESSAGE:  # the worker would drop the connection
        raise MessageTooLarge("request head of %d bytes, over the frame limit of %d"
                              % (len(payload), MAX_MESSAGE))
    return _frame(rno, WHOLE_REQUEST if end else Request.TYPE, payload)


def head_request_frame(rno: int, payload: bytes) -> bytes:
    """A HEAD_REQUEST frame of ``payload`` (``relay.Relay.payload``)."""
    if len(payload) > MAX_MESSAGE:  # the worker would drop the connection
        raise MessageTooLarge("request head of %d bytes, over the frame limit of %d"
                              % (len(payload), MAX_MESSAGE))
    return HEADER.pack(rno, HEAD_REQUEST, len(payload)) + payload


def _check_elapsed(elapsed: object) -> None:
    """Refuse a response time the peer would refuse, dropping the whole
    connection (NaN included)."""
    if not good_elapsed(elapsed):
        raise LocalProtocolError("response time %r is not in [0, %g) seconds"
                                 % (elapsed, MAX_ELAPSED))


def ready_frame(rno: int, head: bytes, length: Optional[int], elapsed: Any,
                body: bytes, end: bool, cache: Optional[bool] = None) -> bytes:
    """A READY_RESPONSE frame: ``head`` (status line and header lines,
    each ending in CRLF, checked by the caller) and the first ``body``
    bytes, ending the response if ``end``; ``cache``, whether the app's
    cache hit, if it said."""
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


def ready_response(rno: int, status: str, headers: List[Tuple[str, str]], body: bytes,
                   end: bool, elapsed: Optional[float], cache: Optional[bool] = None) -> bytes:
    """A READY_RESPONSE frame (``wire/frames.py``): the head made and
    checked here, so that the LB need not."""
    try:
        head, length = ready_head(status, headers)
    except (BadResponseHead, ValueError, TypeError) as exc:  # (or a malformed list)
        raise BadResponseHead("response head refused: %s" % exc)
    if len(head) > MAX_MESSAGE:  # the LB would drop the whole connection
        raise ResponseHeadTooLarge("response head of %d bytes, over the frame limit of %d"
                                   % (len(head), MAX_MESSAGE))
    return ready_frame(rno, head, length, elapsed, body, end, cache)


def body_header(rno: int, length: int) -> bytes:
    """The header of a Body frame, for sending a large chunk without copying."""
    return HEADER.pack(rno, Body.TYPE, length)
