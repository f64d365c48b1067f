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

Payloads: body chunks travel as raw bytes; credit as a u32; a response
head as HTTP/1.1's bytes; everything structured (hello, auth, résumé,
environ, goaway, keys) as JSON.  Never marshal or pickle: a worker port must not be a way to run
code.  Structured payloads are capped at ``max_message`` bytes (the
résumé at ``max_resume``), body chunks at ``max_body``; a frame over its
cap is refused from its header, before its payload is buffered.  An LB
drops a résumé over RESUME_LIMIT (skipped as it comes, never buffered)
and keeps the connection (``wire/intake.py``).

Features: each side's Hello lists the features it sends and takes
(``LB_FEATURES``, ``WORKER_FEATURES``), and a peer must list every one
of its role's (``wire/handshake.py``): what follows is part of every
connection.

Whole requests (``whole``): most requests have no body, and such a
request is one frame (``WHOLE_REQUEST``: the environ, then the request
ends), not a Request and an End.  The receiver sees one ``Request``
with ``end`` set.

Ready response heads (an LB's ``ready``, ``timing``, ``cache`` and
``whole``): a worker sends a response's start as one ``READY_RESPONSE``
frame whose head is ready for the client: the status line and header
lines in HTTP/1.1's bytes, checked by the worker against response
splitting (it is authenticated), with what the LB needs in a fixed
prefix (flags: the response ends here, the application's cache hit
or missed; the Content-Length the head says, -1 for none; the
application's seconds, -1 for unknown; the head's length), then the
head, then the first body bytes, the whole response when it fits.  The
LB adds only its own lines (Connection, the body's framing) and writes
head and body to the client in one send: no JSON of headers decoded,
re-checked and encoded again per response.  The message is a
``Response`` whose ``head`` and ``length`` are set; ``head_fields``
parses the fields back for a reader that wants them.  A frame with a
response head as JSON (``RETIRED``), which no peer that passes the
handshake sends, is refused.

Head requests (a worker's ``head``): the LB sends a request's start as
one ``HEAD_REQUEST`` frame: the request head as the LB's front checked
it, with the client connection's facts and the request's class
(lb/relay.py says how), not a JSON environ; the worker builds the same
variables from it.  The message is a ``Request`` (with ``end`` set when
the frame says the request has no body).  An LB run as a plain WSGI
application, which has no such head, sends the environ as JSON.

Keys (``keys``): an LB sends a worker, now and then, the keys it sent
it since (``Keys``: JSON, class -> the keys' 64-bit hashes in the LB's
book), and the worker sends the same to each of its other LBs.

The messages and the frames' constants are here, with the checks of a
field that hold both ways (``is_number``, ``good_elapsed``,
``checked_keys``); ``wire/encoder.py`` turns a message into bytes and
``wire/decoder.py`` bytes into messages.  What may be sent when is
``wire/protocol.py``'s business.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, Dict, Final, List, Optional, Tuple, Union

from mypy_extensions import mypyc_attr

VERSION: Final = 1
MAX_BODY: Final = 256 * 1024
MAX_MESSAGE: Final = 256 * 1024
MAX_RESUME: Final = 64 * 1024 * 1024  # a bigger résumé frame breaks the protocol
# What an LB takes of a worker's résumés (``wire/intake.py``), far above
# a real site's (a few thousand classes, some hundreds of KB): one of
# more bytes or classes is dropped, the connection kept (a worker of a
# release before these bounds may send up to MAX_RESUME), and one that
# comes sooner than RESUME_RATE bytes a second after the last taken
# allows waits (the newest).  Each costs the LB's event loop its decoding,
# 3-30 ms a MiB, and a worker sending them back to back stopped it for good.
RESUME_LIMIT: Final = 4 * 1024 * 1024
RESUME_CLASSES: Final = 100_000
RESUME_RATE: Final = 1024 * 1024  # bytes a second
MAX_RNO: Final = 2**32 - 1

HEADER: Final = struct.Struct("!IBI")
HEADER_SIZE: Final = HEADER.size
CREDIT_PAYLOAD: Final = struct.Struct("!I")

WHOLE: Final = "whole"  # the Hello feature: a whole request or response in one frame
TIMING: Final = "timing"  # the Hello feature: a response head says the app's seconds
READY: Final = "ready"  # the Hello feature: response heads ready for the client
HEAD: Final = "head"  # the Hello feature: requests as their checked heads (lb/relay.py)
KEYS: Final = "keys"  # the Hello feature: Keys frames, relayed between the LBs
CACHE: Final = "cache"  # the Hello feature: a ready head says if the app's cache hit
FEATURES: Final = (WHOLE, TIMING)  # what either side's Hello lists first
LB_FEATURES: Final = FEATURES + (READY, KEYS, CACHE)  # an LB's Hello: a worker requires them
WORKER_FEATURES: Final = FEATURES + (HEAD, KEYS)  # a worker's Hello: an LB requires them
MAX_KEY_HASH: Final = (1 << 64) - 1  # a key's hash in an LB's book is 64 bits
WHOLE_REQUEST: Final = 16  # Request and End
READY_RESPONSE: Final = 18  # Response (a ready head), perhaps Body, perhaps End
JSON_RESPONSE: Final = 13  # refused: a response head as JSON
WHOLE_RESPONSE: Final = 17  # refused: a JSON head, body and end in one frame
# Frame types that no peer past the handshake sends (it offers ready
# heads): refused, saying what they were.
RETIRED: Final[Dict[int, str]] = {
    JSON_RESPONSE: "a response head as JSON",
    WHOLE_RESPONSE: "a whole response with its head as JSON",
}
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
    features: Tuple[str, ...] = ()  # what the sender offers: all its role's (handshake.py)
    # A worker's own id, alike on all its connections: an LB that reaches
    # one worker by two addresses pools it once (None: an LB's, or a release before).
    instance: Optional[str] = None
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
    """Start of a response: its status, its head ready for the client
    (the status line and header lines, each ending in CRLF), perhaps
    the first body bytes; with ``end``, the whole response."""

    rno: int
    status: str
    head: bytes = field(repr=False)
    body: bytes = field(default=b"", repr=False)
    end: bool = False
    elapsed: Optional[float] = None  # the application's seconds, if the worker said
    length: Optional[int] = None  # the Content-Length the head says, if any
    cache: Optional[bool] = None  # the app's cache hit (True) or missed, if it said
    TYPE = 18  # READY_RESPONSE


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
FRAME_NAMES.update({WHOLE_REQUEST: "whole Request", HEAD_REQUEST: "head Request"})


# -- checks of a field, either way --------------------------------------


def checked_keys(keys: object, error: Any) -> Dict[str, List[int]]:
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


def is_number(value: object) -> bool:
    """An int or a float, not a bool: what a score or a time may be."""
    return isinstance(value, (int, float)) and type(value) is not bool


def good_elapsed(value: object) -> bool:
    """A response time the peer takes: in [0, ``MAX_ELAPSED``) seconds."""
    return (isinstance(value, (int, float)) and type(value) is not bool
            and 0.0 <= value < MAX_ELAPSED)
