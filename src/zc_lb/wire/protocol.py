"""The LB<->worker protocol, sans I/O: bytes in, events out, and back.

Its frames and messages are in ``wire/frames.py``, made into bytes by
``wire/encoder.py`` and back by ``wire/decoder.py``, whose names are
imported from there.  How a connection starts is ``wire/handshake.py``'s;
a request's life and its flow control are ``wire/stream.py``'s.

``Connection`` is the protocol itself, for one side, with no I/O (as
h11 is for HTTP): phases with frame limits (a kilobyte before the peer
is authenticated), the roles (a worker never accepts a résumé), request
numbers, each request's ``Stream`` (a state table per direction, cancel
and credit included), credit windows, and events that say who ended a
request.  ``wire/connection.py`` only pumps bytes between it and a socket;
the tests drive two of them against each other in memory.

Messages for a request that one side has just cancelled may still be in
flight from the other: a ``Connection`` drops frames for request numbers
that have ended, and calls frames for numbers never used errors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Final, List, Optional, Tuple, Union

from mypy_extensions import mypyc_attr

from zc_lb.errors import LocalProtocolError, RemoteProtocolError
from zc_lb.wire.decoder import Decoder, NEED_DATA, NeedData, ResumeFrame
from zc_lb.wire.encoder import (body_header, encode, head_request_frame, ready_response,
                                request_frames)
from zc_lb.wire.frames import (Auth, Cancel, Credit, GoAway, Keys, Hello, MAX_BODY, MAX_MESSAGE,
                               MAX_RESUME, MAX_RNO, Message, Ping, Pong, Request, Response,
                               Resume)
from zc_lb.wire.handshake import (HANDSHAKE_LIMIT, auth_digest, check_auth, check_hello,
                                  new_hello, open_limits)
from zc_lb.wire.intake import ResumeIntake, ResumeRefused
from zc_lb.wire.stream import DONE, ENDED, OPEN, WIDE_WINDOW, WINDOW, Stream

# -- the connection -----------------------------------------------------

HANDSHAKE: Final = "handshake"
AUTHENTICATING: Final = "authenticating"
OPEN_PHASE: Final = "open"
CLOSING: Final = "closing"
CLOSED: Final = "closed"
# An LB past this request number drains the connection for a new one
# while numbers are left for the requests it still starts meanwhile.
RECYCLE_RNO: Final = MAX_RNO - 100000


@mypyc_attr(native_class=False)
@dataclass(frozen=True)
class Ready:
    """The handshake is done (the peer proved the secret, if there is one)."""

    peer: Hello


@mypyc_attr(native_class=False)
@dataclass(frozen=True)
class StreamEnded:
    """A request ended before it completed: ``by`` "peer" (it sent Cancel)
    or "connection" (the connection closed under it), and why."""

    rno: int
    by: str
    reason: str


@mypyc_attr(native_class=False)
@dataclass(frozen=True)
class Closed:
    """The peer closed the connection (end of file)."""

    reason: str = "peer closed the connection"


Event = Union[Message, Ready, StreamEnded, Closed, ResumeRefused]


class Connection:
    """One side of an LB<->worker connection, sans I/O, as h11 is for HTTP.

    Bytes from the peer go in with ``receive_data`` (``b""`` at end of
    file); ``next_event`` turns them into events until it returns
    NEED_DATA: ``Ready`` when the handshake is done, then the peer's
    messages (``Request``, ``Response``, ``Body``, ``End``, ``Credit``,
    ``Resume``, ``GoAway``), ``StreamEnded`` when the peer cancels a
    request, ``Closed`` at end of file, ``ResumeRefused`` when an LB's
    ``intake`` (``wire/intake.py``) refuses a résumé, whose newest it
    may hold a while, bounding them in size and rate.  What we send goes through
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

    Features: our Hello offers our role's (``handshake.role_features``),
    and the peer's must offer every one of its role's, each part of what
    the two then send; ``features`` makes our Hello offer others, for a
    test to be a peer of an older release.

    Request numbers: the LB numbers its requests 1, 2, ... (``start_request``);
    a worker refuses a number that does not increase.  A frame for a
    number that has ended here (a cancel crossing the peer's last frames)
    is dropped; one for a number never used is an error.  Past
    RECYCLE_RNO the connection is ``draining``, as after a GoAway: an LB
    opens a new one before the numbers run out.

    Requests in flight are ``streams``, each with the ``owner`` the I/O
    layer gave it; ``event_owner`` is the owner of the request of the
    event ``next_event`` returned last, even when that event ended it.

    Credit: each direction of each request may carry ``window`` body
    bytes before the receiver grants more; ``send`` refuses a Body past
    our credit, a Body past the peer's is a RemoteProtocolError, and
    ``consumed`` says when to grant (a quarter of the window at a time).

    Errors: RemoteProtocolError (or AuthenticationError) for what the peer
    did, after which the connection is dead and every call raises it
    again; LocalProtocolError for what our own code tried.  After either
    end (``Closed``, or an error) the requests that were open stay in
    ``streams`` until ``close()`` hands them over.
    """

    def __init__(self, role: str, secret: Optional[bytes] = None, *,
                 max_body: int = MAX_BODY, max_message: int = MAX_MESSAGE,
                 max_resume: int = MAX_RESUME, window: int = WINDOW,
                 app_version: Optional[str] = None,
                 features: Optional[Tuple[str, ...]] = None,
                 instance: Optional[str] = None,
                 intake: Optional[ResumeIntake] = None) -> None:
        if role not in ("lb", "worker"):
            raise LocalProtocolError("role must be 'lb' or 'worker', not %r" % (role,))
        self.role = role
        self.secret = secret
        self.window = window
        self.phase = HANDSHAKE
        self.our_hello = new_hello(role, secret, app_version, features, instance)
        self.peer_hello: Optional[Hello] = None
        self.refused_hello: Optional[Hello] = None  # a Hello check_hello refused
        self.streams: Dict[int, Stream] = {}
        self.last_rno = 0
        self.pings = 0  # Pings received, all told
        self.event_owner: object = None
        self.we_go_away = False
        self.peer_goes_away = False
        self._recycling = False  # ``running_out`` has said so
        self._error: Optional[RemoteProtocolError] = None
        self._eof = False
        self._out: List[bytes] = [encode(self.our_hello)]
        # An LB's bounds of the worker's résumés (a worker takes none)
        self.intake = (intake or ResumeIntake()) if role == "lb" else None
        self._decoder = Decoder(max_body, max_message, max_resume,
                                None if self.intake is None else self.intake.limit)
        self._open_limits = open_limits(role, self._decoder.limits)
        self._decoder.allow({Hello.TYPE: HANDSHAKE_LIMIT}, " before the handshake")

    def __repr__(self) -> str:
        return "<protocol.Connection %s %s streams=%d>" % (self.role, self.phase, len(self.streams))

    # -- receiving ----------------------------------------------------

    @property
    def draining(self) -> bool:
        """No new requests should start here: either side said GoAway, or
        the request numbers are running out."""
        return self.we_go_away or self.peer_goes_away or self.last_rno >= RECYCLE_RNO

    def running_out(self) -> bool:
        """True once, when an LB's request numbers first run low (past
        RECYCLE_RNO) with no GoAway said: time to open a new connection."""
        if (self.last_rno < RECYCLE_RNO or self._recycling
                or self.we_go_away or self.peer_goes_away):
            return False
        self._recycling = True
        return True

    def receive_data(self, data: Union[bytes, memoryview]) -> None:
        """Bytes from the peer; ``b""`` when it closed its side."""
        if data:
            self._decoder.receive_data(data)
        else:
            self._eof = True

    def wants(self) -> int:
        """How many bytes the next read should take, 0 for as many as come
        (see ``decoder.Decoder.wants``)."""
        return self._decoder.wants()

    def next_event(self) -> Union[Event, NeedData]:
        """The next event, or NEED_DATA; raises RemoteProtocolError (the
        same one on every later call) when the peer broke the protocol."""
        if self._error is not None:
            raise self._error
        try:
            intake = self.intake
            if intake is not None and intake.held is not None and self.phase != CLOSED:
                taken = intake.due()
                if taken is not None:
                    return taken
            while True:
                message = self._decoder.next_message()
                if message is NEED_DATA:
                    if self._eof and self.phase != CLOSED:
                        self.phase = CLOSED  # (its requests stay, for ``close`` to hand over)
                        return Closed()
                    return NEED_DATA
                try:
                    if isinstance(message, ResumeFrame):  # (an LB's, open: see the limits)
                        event = self._resume_frame(message)
                    else:
                        event = self._receive(message)  # type: ignore[arg-type]
                except RemoteProtocolError as exc:
                    exc.rno = getattr(message, "rno", 0)  # the request it broke
                    raise
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
            self.event_owner = None
            return self._connection_message(message)
        stream = self.streams.get(rno)
        if stream is None:
            self.event_owner = None
            return self._unknown_stream(message)
        self.event_owner = stream.owner
        if stream.receive(message):  # type: ignore[arg-type]
            del self.streams[rno]
            if type(message) is Cancel:
                return StreamEnded(rno, "peer", "cancelled")
        return message

    def _hello(self, theirs: Hello) -> Optional[Event]:
        try:
            check_hello(self.our_hello, theirs)
        except RemoteProtocolError:
            self.refused_hello = theirs  # (``handshake.refusal``: we may tell it why)
            raise
        self.peer_hello = theirs
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
            self.pings += 1  # (the connection bounds them: keepalive.MAX_PINGS)
            self._out.append(encode(Pong()))
            return None
        if mtype is Pong:
            return None
        if mtype is GoAway:
            self.peer_goes_away = True
            self.phase = CLOSING
        return message  # Resume (to an LB only: see the limits), GoAway, Keys

    def _resume_frame(self, frame: ResumeFrame) -> Optional[Event]:
        """A résumé as an LB's decoder hands it on: for the intake."""
        if self.phase == CLOSED or self.intake is None:
            return None
        self.event_owner = None
        return self.intake.offer(frame)

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

    def start_request(self, environ: Optional[Dict[str, str]], end: bool = False,
                      head: Optional[bytes] = None) -> Tuple[int, bytes]:
        """LB side: a new request's number and its bytes (the whole request
        when ``end``: it has no body): the payload of a HEAD_REQUEST frame
        (``relay.Relay.payload``, which says ``end`` too), or else its
        ``environ``.  MessageTooLarge changes nothing."""
        if self.phase not in (OPEN_PHASE, CLOSING):
            raise LocalProtocolError("cannot send Request while %s" % self.phase)
        if self.role != "lb":
            raise LocalProtocolError("a worker cannot send Request")
        if self.peer_goes_away:
            raise LocalProtocolError("the worker is going away: no new requests")
        rno = self.last_rno + 1
        if rno > MAX_RNO:
            raise LocalProtocolError("request number %d after %d" % (rno, self.last_rno))
        if head is not None:
            data = head_request_frame(rno, head)
        elif environ is None:
            raise LocalProtocolError("a request needs an environ or a head")
        else:
            try:
                data = request_frames(rno, environ, end)
            except (ValueError, TypeError) as exc:  # (orjson: keys or values not strings)
                raise LocalProtocolError("cannot encode the request environ: %s" % exc)
        self.last_rno = rno
        stream = self.streams[rno] = Stream(rno, self.window)
        stream.sending = DONE if end else OPEN
        return rno, data

    def send(self, message: Message) -> bytes:
        """The bytes of ``message``, after checking that we may send it.
        A request starts with ``start_request``; a response with
        ``respond`` (from its status and headers), or here (its head made)."""
        if self.phase not in (OPEN_PHASE, CLOSING):
            raise LocalProtocolError("cannot send %s while %s" % (type(message).__name__, self.phase))
        if isinstance(message, Request):
            if message.rno != self.last_rno + 1:
                raise LocalProtocolError("request number %d after %d"
                                         % (message.rno, self.last_rno))
            return self.start_request(message.environ, message.end)[1]
        if isinstance(message, Response):
            started = self._response_stream(message.rno, len(message.body))
            data = encode(message)
            self._response_sent(started, len(message.body), message.end)
            return data
        data = encode(message)  # first: a message too large changes nothing
        rno = getattr(message, "rno", 0)
        if not rno:
            self._connection_message_sent(type(message))
            return data
        stream = self.streams.get(rno)
        if stream is None:
            raise LocalProtocolError("%s for request %d, which is not open here"
                                     % (type(message).__name__, rno))
        if stream.send(message):  # type: ignore[arg-type]
            del self.streams[rno]
        return data

    def _connection_message_sent(self, mtype: type) -> None:
        """What sending a message of ``mtype`` on the connection itself
        (request number 0) checks and changes."""
        if mtype is GoAway:
            self.we_go_away = True
            self.phase = CLOSING
        elif mtype not in (Ping, Pong, Keys) and not (
                mtype is Resume and self.role == "worker"):
            raise LocalProtocolError("a%s %s cannot send %s" % (
                "n" if self.role == "lb" else "", self.role, mtype.__name__))

    def body_header(self, rno: int, size: int) -> bytes:
        """The header of a Body frame of ``size`` bytes, after the checks
        of ``send``: its sender sends the bytes after it as they are,
        not copied into one frame with it."""
        if self.phase not in (OPEN_PHASE, CLOSING):
            raise LocalProtocolError("cannot send Body while %s" % self.phase)
        stream = self.streams.get(rno)
        if stream is None:
            raise LocalProtocolError("Body for request %d, which is not open here" % rno)
        if size > MAX_BODY:
            raise LocalProtocolError("a Body of %d bytes is over %d" % (size, MAX_BODY))
        stream.send_body(size)
        return body_header(rno, size)

    def respond(self, rno: int, status: str, headers: List[Tuple[str, str]],
                body: bytes = b"", end: bool = False,
                elapsed: Optional[float] = None, cache: Optional[bool] = None) -> bytes:
        """Worker side: the bytes of a response's start, its head ready
        for the client, with the first ``body`` bytes, ending it if
        ``end``, with the application's ``elapsed`` seconds and whether
        its ``cache`` hit (if it said); the checks of ``send``, made
        before anything changes (the whole response is refused or sent)."""
        if self.phase not in (OPEN_PHASE, CLOSING):
            raise LocalProtocolError("cannot send Response while %s" % self.phase)
        if type(body) is not bytes:
            try:
                body = bytes(body)
            except TypeError as exc:
                raise LocalProtocolError("cannot send body %r: %s" % (type(body), exc))
        stream = self._response_stream(rno, len(body))
        data = ready_response(rno, status, headers, body, end, elapsed, cache)
        self._response_sent(stream, len(body), end)
        return data

    def _response_stream(self, rno: int, size: int) -> Stream:
        """The stream a worker may start its response to ``rno`` on, with
        ``size`` body bytes: it is open here, the response not yet
        started, and the body within our credit."""
        stream = self.streams.get(rno)
        if stream is None or self.role != "worker":
            raise LocalProtocolError("Response for request %d, which is not open here" % rno)
        stream.check_response(size)
        return stream

    def _response_sent(self, stream: Stream, size: int, end: bool) -> None:
        if stream.send_response(size, end):
            del self.streams[stream.rno]

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

    def widen(self, rno: int) -> bytes:
        """The Credit that lets the peer send ``WIDE_WINDOW`` body bytes of
        ``rno`` ahead (``WINDOW`` at the start): for a large body, so it
        streams instead of waiting a round trip each window.  A Credit,
        which every version takes; b"" if the request is not receiving."""
        stream = self.streams.get(rno)
        if stream is None or stream.receiving in ENDED or stream.window >= WIDE_WINDOW:
            return b""
        return self.send(Credit(rno, WIDE_WINDOW - stream.window))

    def credit(self, rno: int) -> int:
        """Body bytes we may send on ``rno`` now (0 once it has ended)."""
        stream = self.streams.get(rno)
        return stream.credit if stream is not None else 0

    def close(self) -> List[Stream]:
        """The connection is over: the requests that were still open."""
        self.phase = CLOSED
        open_requests = list(self.streams.values())
        self.streams.clear()
        return open_requests
