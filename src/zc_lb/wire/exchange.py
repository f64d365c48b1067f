"""One request in flight on a connection, under gevent: an ``Exchange``.

Each request in flight is an ``Exchange``: an inbox of received
messages and a wakeup.  The greenlet that owns a request sends on it and
receives from it; the reader only appends to inboxes and wakes waiters,
so a slow consumer of one request never blocks the reader or other
requests.

Rules: a wake is a hint, sent from the hub's next turn (the reader never
switches to a waiter itself): a waiter tests its condition again.  Body
bytes go out within credit, waiting for more.  A request cancelled
raises ``PeerCancelled`` or, cancelled here, the error given to
``cancel`` (``ClientGone`` when the LB's client left); one whose
connection ended, that connection's error.  An Exchange sees its
connection as a ``Link``, the little it needs of it, declared here:
``connection.Connection``, which makes the exchanges, is one.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Deque, List, Optional, Tuple, Type, Union

import gevent  # type: ignore[import-untyped]
from gevent.hub import Waiter, get_hub  # type: ignore[import-untyped]
from mypy_extensions import trait

from zc_lb.errors import CancelledHere, PeerCancelled, RequestCancelled, ZcLbError
from zc_lb.sockets import wait
from zc_lb.wire import frames, protocol
from zc_lb.wire.keepalive import KEEPALIVE_INTERVAL
from zc_lb.wire.frames import Body, Credit
from zc_lb.wire.writer import FileRegion

BIG_CHUNK = 16 * 1024  # body chunks from this size go out without a copy into their frame


@trait
class Link:
    """What an Exchange needs of its connection (``connection.Connection``):
    the protocol's state, whether and why the connection ended, and its
    writes, which raise once it has."""

    protocol: protocol.Connection  # (it holds the requests in flight: streams)
    peer: str
    closed: bool
    error: Optional[ZcLbError]  # why it ended
    closed_error: Type[ZcLbError]  # raised for writes after we closed it
    idle: Any  # a gevent Event, set while no request is in flight
    sendfile: bool  # whether a file's bytes may go out with sendfile(2) (not over TLS)

    def write(self, data: bytes) -> None:
        """Queue bytes to send."""
        raise NotImplementedError

    def write_chunk(self, header: bytes, chunk: Any) -> None:
        """Queue a Body frame's header and its large chunk as they are."""
        raise NotImplementedError

    def write_region(self, header: bytes, region: FileRegion) -> None:
        """Queue a Body frame's header and its chunk from a file."""
        raise NotImplementedError


class Exchange:
    """One request in flight on a connection: the greenlet that owns it
    sends and receives through it; the connection's reader fills its
    inbox and wakes it."""

    __slots__ = ("connection", "rno", "inbox", "error", "_waiter", "on_cancel", "_widened",
                 "__weakref__")

    def __init__(self, connection: Link, rno: int) -> None:
        self.connection = connection
        self.rno = rno
        self.inbox: Deque[frames.Message] = collections.deque()
        self.error: Optional[ZcLbError] = None  # why it ended early, raised to waiters
        # Who waits: None, a Waiter, or a list of them; woken from the
        # hub (an Event per request cost several microseconds more).
        self._waiter: Union[None, Waiter, List[Waiter]] = None
        self.on_cancel: Optional[Callable[[], None]] = None  # the peer cancelled
        self._widened = False  # (``widen`` grants once)

    @property
    def credit(self) -> int:
        """Body bytes we may send now."""
        return self.connection.protocol.credit(self.rno)

    @property
    def cancelled(self) -> bool:
        """Cancelled, by the peer or by us."""
        return isinstance(self.error, RequestCancelled)

    # -- sending ------------------------------------------------------

    def send(self, *messages: frames.Message) -> None:
        """Send messages in one write; raise if the request is over."""
        if self.error is not None:
            raise self.error
        connection = self.connection
        proto = connection.protocol
        send = proto.send
        connection.write(b"".join([send(message) for message in messages]))
        if not proto.streams:  # (this one ended with both its directions, and was the last)
            connection.idle.set()

    def respond(self, status: str, headers: List[Tuple[str, str]], body: bytes = b"",
                end: bool = False, elapsed: Optional[float] = None,
                cache: Optional[bool] = None) -> None:
        """Worker side: the response head, ``body`` (within credit) and End
        if ``end``, in one write: a small response is one frame batch;
        ``elapsed``, the application's seconds so far, and ``cache``,
        whether its cache hit, for an LB that takes them."""
        if self.error is not None:
            raise self.error
        connection = self.connection
        proto = connection.protocol
        connection.write(proto.respond(self.rno, status, headers, body, end, elapsed, cache))
        if end and not proto.streams:
            connection.idle.set()

    def send_body(self, data: bytes, stop_on_response: bool = False) -> bool:
        """Send body bytes within credit, waiting for more as needed.

        With ``stop_on_response`` (LB side, uploading), returns False as
        soon as a response has arrived, so an early answer (413, say)
        is not stuck behind a body the worker will never read.
        """
        view = memoryview(data)
        credit = self.connection.protocol.credit
        while view:
            while credit(self.rno) <= 0:
                if stop_on_response and self.inbox:
                    return False
                self._wait()
            if stop_on_response and self.inbox:
                return False
            n = min(len(view), credit(self.rno), frames.MAX_BODY)
            if n < BIG_CHUNK:
                self.send(Body(self.rno, bytes(view[:n])))
            else:  # header and chunk as they are, not copied into one frame
                self._send_chunk(view[:n] if type(data) is bytes else bytes(view[:n]))
            view = view[n:]
        return True

    def _send_chunk(self, chunk) -> None:
        if self.error is not None:
            raise self.error
        connection = self.connection
        connection.write_chunk(connection.protocol.body_header(self.rno, len(chunk)), chunk)

    def send_file(self, fd: int, offset: int, count: int) -> bool:
        """Worker side: ``count`` bytes of the open file ``fd`` from
        ``offset`` as body, with sendfile(2) (``Link.sendfile``
        says whether the connection can), in frames queued as credit
        allows; returns once they went (the file stays the caller's).
        False if the file ended first (zeros went in its place: the
        caller cancels the response)."""
        connection = self.connection
        credit = connection.protocol.credit
        regions: List[FileRegion] = []
        try:
            while count > 0:
                while credit(self.rno) <= 0:
                    self._wait()
                if self.error is not None:
                    raise self.error
                n = min(count, credit(self.rno), frames.MAX_BODY)
                region = FileRegion(fd, offset, n)
                connection.write_region(connection.protocol.body_header(self.rno, n), region)
                regions.append(region)
                offset, count = offset + n, count - n
        finally:
            for region in regions:  # (all of them: the file may be closed after)
                while not region.sent.wait(KEEPALIVE_INTERVAL) and not connection.closed:
                    pass
        if connection.closed:
            raise connection.error or connection.closed_error(connection.peer)
        return not any(region.short for region in regions)

    def cancel(self, error: Optional[ZcLbError] = None) -> None:
        """Abandon the request, telling the peer; idempotent.  ``error``
        says why (a RequestCancelled subclass): waiters get it raised."""
        connection = self.connection
        proto = connection.protocol
        if connection.closed or self.rno not in proto.streams:
            return  # ended already
        if self.error is None:
            self.error = error or CancelledHere("request %d cancelled" % self.rno)
        data = proto.cancel(self.rno)
        if not proto.streams:
            connection.idle.set()
        self._wake()
        try:
            connection.write(data)
        except ZcLbError:
            pass

    # -- receiving ----------------------------------------------------

    def receive(self, timeout: Optional[float] = None) -> frames.Message:
        """The next Response, Body or End from the peer; raises the
        connection's error or RequestCancelled when there is none to come.
        """
        inbox = self.inbox
        while not inbox:
            if self.error is not None:
                raise self.error
            if timeout is not None or self._waiter is not None:
                self._wait(timeout)
                continue
            # (Most waits: the owner's alone, without a timeout; ``_wait``
            # without its call.)
            waiter = self._waiter = Waiter(get_hub())
            try:
                waiter.get()
            finally:
                if self._waiter is waiter:
                    self._waiter = None
        return inbox.popleft()

    def consumed(self, n: int) -> None:
        """We are done with ``n`` received body bytes: grant them back."""
        connection = self.connection
        if self.error is None and not connection.closed:
            data = connection.protocol.consumed(self.rno, n)
            if data:
                connection.write(data)

    def widen(self) -> None:
        """A body is coming to us and its reader keeps up: let the peer send
        WIDE_WINDOW bytes of it ahead, not the WINDOW both sides start
        from, so that it is not sent a window at a time, waiting for each
        Credit.  Once a request: later calls do nothing."""
        connection = self.connection
        if not self._widened and self.error is None and not connection.closed:
            self._widened = True
            data = connection.protocol.widen(self.rno)
            if data:
                connection.write(data)

    def _wait(self, timeout: Optional[float] = None) -> None:
        """Sleep until ``_wake`` (or ``timeout`` seconds).  Callers test
        their condition first and again after: a wake is a hint."""
        if self.error is not None:
            raise self.error
        hub = get_hub()
        waiter = Waiter(hub)
        # Usually the owner alone waits; an upload's greenlet may wait
        # for credit at the same time as the owner for the response.
        other = self._waiter
        self._waiter = waiter if other is None else (
            other + [waiter] if type(other) is list else [other, waiter])
        try:
            if timeout is None:
                waiter.get()  # (most waits: ``wait`` without its call)
            else:
                wait(waiter, timeout, gevent.Timeout, timeout)
        finally:
            waiting = self._waiter
            if waiting is waiter:
                self._waiter = None
            elif type(waiting) is list and waiter in waiting:
                waiting.remove(waiter)

    def _wake(self) -> None:
        """Wake whoever waits, once: from the hub's next turn, as the
        reader greenlet may not switch to a waiter itself."""
        waiting = self._waiter
        if waiting is not None:
            self._waiter = None
            run_callback = get_hub().loop.run_callback
            if isinstance(waiting, list):
                for waiter in waiting:
                    run_callback(waiter.switch, None)
            else:
                run_callback(waiting.switch, None)

    # -- driven by the connection's reader ----------------------------

    def received(self, event: frames.Message) -> None:
        if type(event) is not Credit:
            self.inbox.append(event)
        waiting = self._waiter
        if waiting is not None and not isinstance(waiting, list):  # (``_wake``, inlined)
            self._waiter = None
            get_hub().loop.run_callback(waiting.switch, None)
        elif waiting is not None:
            self._wake()

    def cancelled_by_peer(self) -> None:
        if self.error is None:
            self.error = PeerCancelled("request %d cancelled by %s"
                                       % (self.rno, self.connection.peer))
        self._wake()
        if self.on_cancel is not None:
            self.on_cancel()

    def fail(self, error: ZcLbError) -> None:
        """End the exchange here with ``error`` (waiters get it raised)."""
        if self.error is None:
            self.error = error
        self._wake()

    def lost(self, error: ZcLbError) -> None:
        """Its connection ended with ``error``: ``fail``, and, as a peer's
        Cancel does, ``on_cancel`` (a worker's application is stopped, not
        left to run for an answer nobody can take)."""
        self.fail(error)
        if self.on_cancel is not None:
            self.on_cancel()

    def __repr__(self) -> str:
        return "<Exchange %d on %s credit=%d%s>" % (
            self.rno, self.connection.peer, self.credit,
            " %s" % self.error if self.error else "")
