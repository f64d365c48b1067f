"""One request on a connection, as one side sees it: each direction's
state, moved by a table, and its credit.

A request's life: the LB sends ``Request(environ)``, ``Body*``, ``End``;
the worker answers ``Response(status, headers)``, ``Body*``, ``End``
(each a single whole frame where it can be: see ``wire/frames.py``).  Either
side may send ``Cancel`` at any time; it ends both directions.

Flow control: each direction of each request starts with ``WINDOW`` bytes
of credit.  A sender may send body bytes only within its credit; the
receiver grants more with ``Credit(n)`` as it *consumes* (not receives)
data.  So one slow client cannot stall the other requests on a
connection, nor grow the LB's memory past a window per request.

Rules: a direction moves only as ``DIRECTION`` says, and body bytes
only within credit; anything else raises at once, naming who is at
fault: LocalProtocolError for what we send (``send``, ``send_body``,
``check_response``), RemoteProtocolError for what the peer sent
(``receive``).  No I/O: ``protocol.Connection`` keeps a ``Stream`` per
request in flight and forgets it once ``finished``.
"""

from __future__ import annotations

from typing import Dict, Final, Type

from zc_lb.errors import LocalProtocolError, RemoteProtocolError
from zc_lb.wire.frames import MAX_BODY, Body, Cancel, Credit, End, RequestMessage, Response

WINDOW: Final = 256 * 1024  # body bytes each side may send a request ahead, at the start
WIDE_WINDOW: Final = 1024 * 1024  # a large body's, granted as Credit (``protocol.widen``)

IDLE: Final = "IDLE"
OPEN: Final = "OPEN"
DONE: Final = "DONE"
CANCELLED: Final = "CANCELLED"
START: Final = "start"
BODY: Final = "body"
END: Final = "end"
CANCEL: Final = "cancel"
CREDIT: Final = "credit"

# One direction of a request: state -> what happens -> next state.  START
# is the Request one way and the Response the other; CREDIT is credit for
# this direction's body, which travels the other way; CANCEL, from either
# side, ends both directions.
DIRECTION: Final[Dict[str, Dict[str, str]]] = {
    IDLE: {START: OPEN, CREDIT: IDLE, CANCEL: CANCELLED},
    OPEN: {BODY: OPEN, END: DONE, CREDIT: OPEN, CANCEL: CANCELLED},
    DONE: {CREDIT: DONE, CANCEL: CANCELLED},
    CANCELLED: {},
}
ENDED: Final = (DONE, CANCELLED)


class Stream:
    """One request on a connection as one side sees it: the state of each
    direction, the credit windows, and its owner: what the I/O layer keeps
    for it (``exchange.Exchange``), which ends with it."""

    __slots__ = ("rno", "sending", "receiving", "credit", "window", "unacked", "owner")

    def __init__(self, rno: int, window: int = WINDOW) -> None:
        self.rno = rno
        self.sending = IDLE
        self.receiving = IDLE
        self.credit = window  # body bytes we may still send
        self.window = window  # body bytes the peer may still send us
        self.unacked = 0  # bytes consumed here, not yet granted back
        self.owner: object = None

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

    def cancel(self) -> None:
        """Either side cancelled: both directions end."""
        self.sending = self.receiving = CANCELLED

    # -- what we send -------------------------------------------------

    def send(self, message: RequestMessage) -> bool:
        """We send ``message`` (a Body, Credit, Cancel or End) on this
        request; whether the request is now finished."""
        mtype = type(message)
        if mtype is Body:
            self.send_body(len(message.data))  # type: ignore[union-attr]
        elif mtype is Credit:
            self.step("receiving", CREDIT, LocalProtocolError)
            self.window += message.n  # type: ignore[union-attr]
        elif mtype is Cancel:
            self.cancel()
        else:  # End
            self.step("sending", END, LocalProtocolError)
        return self.finished

    def send_body(self, size: int) -> None:
        """We send ``size`` body bytes."""
        if size > self.credit:
            raise LocalProtocolError("request %d: %d body bytes past our credit of %d"
                                     % (self.rno, size, self.credit))
        self.step("sending", BODY, LocalProtocolError)
        self.credit -= size

    def check_response(self, size: int) -> None:
        """Whether a worker may start its response here, with ``size`` body
        bytes: not started yet, and the body within our credit."""
        if self.sending != IDLE:
            raise LocalProtocolError("request %d: start not allowed while sending is %s"
                                     % (self.rno, self.sending))
        if size > self.credit or size > MAX_BODY:
            raise LocalProtocolError("request %d: %d body bytes past our credit of %d"
                                     % (self.rno, size, self.credit))

    def send_response(self, size: int, end: bool) -> bool:
        """A worker's response started (``check_response``), with ``size``
        body bytes, and ended if ``end``; whether the request is now
        finished."""
        self.credit -= size
        self.sending = DONE if end else OPEN
        return self.finished

    # -- what the peer sent -------------------------------------------

    def receive(self, message: RequestMessage) -> bool:
        """The peer sent ``message`` (a Response, Body, Credit, Cancel or
        End) on this request; whether the request is now finished."""
        mtype = type(message)
        if mtype is Response:  # (to an LB only: see ``handshake.open_limits``)
            if self.receiving != IDLE:
                self.step("receiving", START, RemoteProtocolError)  # (raises)
            self._take(len(message.body))  # type: ignore[union-attr]
            self.receiving = DONE if message.end else OPEN  # type: ignore[union-attr]
        elif mtype is Body:
            self._take(len(message.data))  # type: ignore[union-attr]
            self.step("receiving", BODY, RemoteProtocolError)
        elif mtype is Credit:
            self.step("sending", CREDIT, RemoteProtocolError)
            self.credit += message.n  # type: ignore[union-attr]
        elif mtype is Cancel:
            self.cancel()
        elif mtype is End:
            self.step("receiving", END, RemoteProtocolError)
        else:  # a Request on one open already (the limits let no other type here)
            self.step("receiving", START, RemoteProtocolError)  # (raises)
        return self.finished

    def _take(self, size: int) -> None:
        """The peer sent ``size`` body bytes, within the credit we gave it."""
        if size > self.window:
            raise RemoteProtocolError("request %d: %d body bytes past the credit of %d"
                                      % (self.rno, size, self.window))
        self.window -= size

    def __repr__(self) -> str:
        return "<Stream %d sending=%s receiving=%s credit=%d window=%d>" % (
            self.rno, self.sending, self.receiving, self.credit, self.window)
