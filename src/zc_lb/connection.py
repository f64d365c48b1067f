"""gevent glue: one multiplexed LB<->worker connection and its requests.

A ``Connection`` owns a connected socket.  ``handshake()`` exchanges
Hello (and Auth, with a shared secret) in the calling greenlet; ``start()``
spawns a reader greenlet, which decodes frames and dispatches them, and a
keepalive greenlet, which pings the peer and declares it lost when nothing
has arrived for ``keepalive_timeout`` seconds.

Each request in flight is an ``Exchange``: its protocol state (a
``protocol.Stream``), an inbox of received messages, and credit in both
directions.  The greenlet that owns a request sends on it and receives
from it; the reader only appends to inboxes and wakes waiters, so a slow
consumer of one request never blocks the reader or other requests.

Writes from many greenlets are coalesced: they queue bytes, and a writer
greenlet sends everything queued in a loop turn with one ``sendall``, so
requests that arrive together share a system call.  Body bytes are
bounded by credit, so the queue is bounded by a window per request.

When the connection breaks, every exchange's waiters are woken with the
error: ``ConnectionLost`` (WorkerLost on the LB) when it broke from
outside, ``ConnectionClosed`` (WorkerClosed) when we closed it.
"""

from __future__ import annotations

import collections
import logging
import socket
import time
from typing import Callable, Deque, Dict, List, Optional

import gevent
import gevent.event

from . import protocol
from .errors import (
    ConnectionClosed,
    ConnectionLost,
    MessageTooLarge,
    RemoteProtocolError,
    RequestCancelled,
    WorkerClosed,
    WorkerLost,
    ZcLbError,
)
from .protocol import (
    WINDOW,
    Body,
    Cancel,
    Credit,
    End,
    GoAway,
    Ping,
    Pong,
    Request,
    Resume,
)

log = logging.getLogger(__name__)

KEEPALIVE_INTERVAL = 1.0
SUSPECT_AFTER = 2  # keepalive intervals of silence before a peer is suspected
KEEPALIVE_TIMEOUT = 5.0
HANDSHAKE_TIMEOUT = 10.0
RECYCLE_RNO = protocol.MAX_RNO - 100000
RECV_SIZE = 256 * 1024


def send_all(sock, data) -> None:
    """``sendall`` without gevent's per-call ``getsockopt(SO_SNDBUF)``,
    which profiling showed to be a sixth of the LB's time."""
    sent = sock.send(data)
    if sent < len(data):
        view = memoryview(data)[sent:]
        while view:
            view = view[sock.send(view):]


def set_nodelay(sock: socket.socket) -> None:
    """TCP_NODELAY: small frames must not wait 40 ms for a delayed ACK."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        pass  # not TCP (a unix socket in a test)


class Handler:
    """What a connection tells its owner; subclass and override."""

    def handle_request(self, connection: "Connection", exchange: "Exchange") -> None:
        """A new request arrived (worker side)."""
        raise RemoteProtocolError("unexpected request")

    def handle_resume(self, connection: "Connection", skills: Dict[str, float]) -> None:
        """The peer sent its résumé (LB side)."""

    def handle_goaway(self, connection: "Connection", reason: str) -> None:
        """The peer is draining."""

    def handle_silent(self, connection: "Connection", seconds: float) -> None:
        """The peer has said nothing for a while: it may be stuck."""

    def handle_heard(self, connection: "Connection") -> None:
        """The peer speaks again after handle_silent."""

    def connection_lost(self, connection: "Connection", error: ZcLbError) -> None:
        """The connection ended, from outside or by our own close()."""


class Exchange:
    """One request in flight on a connection."""

    __slots__ = ("connection", "rno", "state", "inbox", "credit", "window",
                 "unacked", "error", "_wakeup", "on_cancel", "client_left", "__weakref__")

    def __init__(self, connection: "Connection", rno: int) -> None:
        self.connection = connection
        self.rno = rno
        self.state = protocol.Stream(rno, connection.role)
        self.inbox: Deque[protocol.Message] = collections.deque()
        self.credit = WINDOW  # body bytes we may still send
        self.window = WINDOW  # body bytes the peer may still send us
        self.unacked = 0  # bytes consumed, not yet granted back
        self.error: Optional[ZcLbError] = None
        self._wakeup = gevent.event.Event()
        self.on_cancel: Optional[Callable[[], None]] = None
        self.client_left = False  # the LB's client hung up (lb.py)

    # -- sending ------------------------------------------------------

    def send(self, *messages: protocol.Message) -> None:
        """Send messages in one write; raise if the request is over."""
        if self.error is not None:
            raise self.error
        state = self.state
        for message in messages:
            state.send(message)
        self.connection.write(b"".join(map(protocol.encode, messages)))
        self._maybe_forget()

    def send_body(self, data: bytes, stop_on_response: bool = False) -> bool:
        """Send body bytes within credit, waiting for more as needed.

        With ``stop_on_response`` (LB side, uploading), returns False as
        soon as a response has arrived, so an early answer (413, say)
        is not stuck behind a body the worker will never read.
        """
        view = memoryview(data)
        while view:
            while self.credit <= 0:
                if stop_on_response and self.inbox:
                    return False
                self._wait()
            if stop_on_response and self.inbox:
                return False
            n = min(len(view), self.credit, protocol.MAX_BODY)
            self.credit -= n
            self.send(Body(self.rno, bytes(view[:n])))
            view = view[n:]
        return True

    def cancel(self) -> None:
        """Abandon the request, telling the peer; idempotent."""
        if self.state.cancelled or self.state.finished or self.connection.closed:
            self._forget()
            return
        self.state.send(Cancel(self.rno))
        self.error = RequestCancelled("request %d cancelled" % self.rno)
        self._forget()
        try:
            self.connection.write(protocol.encode(Cancel(self.rno)))
        except ZcLbError:
            pass

    # -- receiving ----------------------------------------------------

    def receive(self, timeout: Optional[float] = None) -> protocol.Message:
        """The next Response, Body or End from the peer; raises the
        connection's error or RequestCancelled when there is none to come.
        """
        inbox = self.inbox
        while not inbox:
            if self.error is not None:
                raise self.error
            self._wait(timeout)
        return inbox.popleft()

    def consumed(self, n: int) -> None:
        """We are done with ``n`` received body bytes: grant them back."""
        self.unacked += n
        if self.unacked >= WINDOW // 4 and not self.state.finished and self.error is None:
            n, self.unacked = self.unacked, 0
            self.window += n
            self.connection.write(protocol.encode(Credit(self.rno, n)))

    # -- driven by the connection's reader ----------------------------

    def _wait(self, timeout: Optional[float] = None) -> None:
        if self.error is not None:
            raise self.error
        self._wakeup.clear()
        if not self._wakeup.wait(timeout):
            raise gevent.Timeout(timeout)

    def _received(self, message: protocol.Message) -> None:
        if isinstance(message, Credit):
            self.credit += message.n
        elif isinstance(message, Cancel):
            self.state.receive(message)
            self.error = RequestCancelled("request %d cancelled by peer" % self.rno)
            self._forget()
            if self.on_cancel is not None:
                self.on_cancel()
        else:
            self.state.receive(message)
            if isinstance(message, Body):
                size = len(message.data)
                if size > self.window:
                    raise RemoteProtocolError(
                        "request %d: %d body bytes sent past the credit of %d"
                        % (self.rno, size, self.window))
                self.window -= size
            self.inbox.append(message)
            self._maybe_forget()
        self._wakeup.set()

    def fail(self, error: ZcLbError) -> None:
        """End the exchange here with ``error`` (waiters get it raised)."""
        if self.error is None:
            self.error = error
        self._wakeup.set()

    def _maybe_forget(self) -> None:
        if self.state.finished:
            self._forget()

    def _forget(self) -> None:
        self.connection.streams.pop(self.rno, None)
        self._wakeup.set()

    def __repr__(self) -> str:
        return "<Exchange %d on %s %s/%s credit=%d>" % (
            self.rno, self.connection.peer, self.state.sending,
            self.state.receiving, self.credit)


class Connection:
    """One multiplexed connection between an LB and a worker."""

    def __init__(
        self,
        sock: socket.socket,
        role: str,
        handler: Handler,
        peer: str = "",
        secret: Optional[bytes] = None,
        keepalive_interval: float = KEEPALIVE_INTERVAL,
        keepalive_timeout: float = KEEPALIVE_TIMEOUT,
    ) -> None:
        self.sock = sock
        self.role = role
        self.handler = handler
        self.peer = peer
        self.secret = secret
        self.keepalive_interval = keepalive_interval
        self.keepalive_timeout = keepalive_timeout
        self.streams: Dict[int, Exchange] = {}
        self.decoder = protocol.Decoder()
        self.closed = False
        self.draining = False  # the peer said GoAway
        self.error: Optional[ZcLbError] = None
        self.peer_hello: Optional[protocol.Hello] = None
        self._last_rno = 0
        self._last_received = time.monotonic()
        self._outgoing: List[bytes] = []
        self._wake_writer = gevent.event.Event()
        self._sending = False
        self._greenlets: List[gevent.Greenlet] = []
        self._lost_error = WorkerLost if role == "lb" else ConnectionLost
        self._closed_error = WorkerClosed if role == "lb" else ConnectionClosed
        set_nodelay(sock)

    # -- lifecycle ----------------------------------------------------

    def handshake(self, timeout: float = HANDSHAKE_TIMEOUT) -> None:
        """Exchange Hello (and Auth); raise on mismatch, failure or timeout."""
        ours = protocol.new_hello(self.role, self.secret)
        self.sock.sendall(protocol.encode(ours))
        with gevent.Timeout(timeout, RemoteProtocolError("handshake timed out")):
            theirs = self._read_one(protocol.Hello)
            protocol.check_hello(ours, theirs)
            if self.secret is not None:
                digest = protocol.auth_digest(self.secret, theirs.nonce, self.role)
                self.sock.sendall(protocol.encode(protocol.Auth(digest)))
                auth = self._read_one(protocol.Auth)
                protocol.check_auth(self.secret, ours, theirs, auth)
        self.peer_hello = theirs

    def start(self) -> None:
        """Start reading and keeping alive (after the handshake)."""
        self._greenlets = [gevent.spawn(self._read_loop), gevent.spawn(self._keepalive_loop),
                           gevent.spawn(self._write_loop)]

    def close(self, reason: str = "closed", flush_timeout: float = 0.0) -> None:
        """Close from our side, after up to ``flush_timeout`` seconds for
        what is queued to be sent; waiters get ConnectionClosed/WorkerClosed."""
        deadline = time.monotonic() + flush_timeout
        while ((self._outgoing or self._sending) and not self.closed
               and time.monotonic() < deadline):
            gevent.sleep(0.01)
        if not self.closed:
            try:
                self.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        self._end(self._closed_error("%s: %s" % (self.peer, reason)))

    def join(self, timeout: Optional[float] = None) -> None:
        """Wait for the reader to end."""
        gevent.joinall(self._greenlets[:1], timeout=timeout)

    # -- requests -----------------------------------------------------

    def open_request(self, environ: Dict[str, str], end: bool = False) -> Exchange:
        """LB side: start a request, with End at once when it has no body."""
        if self.closed:
            raise self.error or self._closed_error(self.peer)
        if self._last_rno >= RECYCLE_RNO and not self.draining:
            self.draining = True  # out of request numbers soon: make way for a new one
            self.handler.handle_goaway(self, "request numbers running out")
        if self._last_rno >= protocol.MAX_RNO:
            raise self._closed_error("%s: no request numbers left" % self.peer)
        self._last_rno += 1
        exchange = Exchange(self, self._last_rno)
        self.streams[exchange.rno] = exchange
        try:
            if end:
                exchange.send(Request(exchange.rno, environ), End(exchange.rno))
            else:
                exchange.send(Request(exchange.rno, environ))
        except MessageTooLarge:  # nothing was sent: this request only fails
            del self.streams[exchange.rno]
            raise
        return exchange

    def send_resume(self, skills: Dict[str, float]) -> None:
        """Worker side: send our résumé."""
        self.write(protocol.encode(Resume(skills)))

    def send_goaway(self, reason: str = "") -> None:
        """Tell the peer we are draining."""
        self.write(protocol.encode(GoAway(reason)))

    # -- writing ------------------------------------------------------

    def write(self, data: bytes) -> None:
        """Queue bytes for the writer greenlet, which sends everything
        queued in one loop turn with one ``sendall``."""
        if self.closed:
            raise self.error or self._closed_error(self.peer)
        self._outgoing.append(data)
        self._wake_writer.set()

    def _write_loop(self) -> None:
        outgoing, wake, sock = self._outgoing, self._wake_writer, self.sock
        try:
            while not self.closed:
                wake.wait()
                wake.clear()
                while outgoing:
                    chunk = outgoing[0] if len(outgoing) == 1 else b"".join(outgoing)
                    outgoing.clear()
                    self._sending = True
                    send_all(sock, chunk)
                    self._sending = False
        except OSError as exc:
            outgoing.clear()
            self._end(self._lost_error("%s: write failed: %s" % (self.peer, exc)))

    # -- reading ------------------------------------------------------

    def _read_one(self, expected: type) -> protocol.Message:
        while True:
            message = self.decoder.next_message()
            if message is not protocol.NEED_DATA:
                if not isinstance(message, expected):
                    raise RemoteProtocolError(
                        "expected %s, got %s" % (expected.__name__, type(message).__name__))
                return message
            data = self.sock.recv(RECV_SIZE)
            if not data:
                raise self._lost_error("%s closed during handshake" % self.peer)
            self.decoder.receive_data(data)

    def _read_loop(self) -> None:
        decoder, recv = self.decoder, self.sock.recv
        try:
            self._dispatch_all()
            while not self.closed:
                data = recv(RECV_SIZE)
                if not data:
                    raise self._lost_error("%s closed the connection" % self.peer)
                self._last_received = time.monotonic()
                decoder.receive_data(data)
                self._dispatch_all()
        except RemoteProtocolError as exc:
            log.warning("protocol error from %s, disconnecting: %s", self.peer, exc)
            self._end(self._lost_error("%s: protocol error: %s" % (self.peer, exc)))
        except ZcLbError as exc:
            self._end(exc)
        except OSError as exc:
            self._end(self._lost_error("%s: %s" % (self.peer, exc)))
        except Exception as exc:  # a bug; don't take the process down
            log.exception("connection to %s failed", self.peer)
            self._end(self._lost_error("%s: %r" % (self.peer, exc)))

    def _dispatch_all(self) -> None:
        next_message = self.decoder.next_message
        while True:
            message = next_message()
            if message is protocol.NEED_DATA:
                return
            self._dispatch(message)

    def _dispatch(self, message: protocol.Message) -> None:
        rno = getattr(message, "rno", 0)
        if rno:
            exchange = self.streams.get(rno)
            if exchange is not None:
                exchange._received(message)
            elif isinstance(message, Request):
                self._new_request(message)
            elif rno > self._last_rno:
                raise RemoteProtocolError("%s for unknown request %d"
                                          % (type(message).__name__, rno))
            # else: a request that already ended here; late frames are harmless
            return
        handler = self._CONNECTION_DISPATCH.get(type(message))
        if handler is None:
            raise RemoteProtocolError("unexpected %s" % type(message).__name__)
        handler(self, message)

    def _new_request(self, message: Request) -> None:
        if self.role != "worker" or message.rno <= self._last_rno:
            raise RemoteProtocolError("unexpected request %d" % message.rno)
        self._last_rno = message.rno
        exchange = Exchange(self, message.rno)
        self.streams[message.rno] = exchange
        exchange.state.receive(message)
        exchange.inbox.append(message)
        self.handler.handle_request(self, exchange)

    def _on_ping(self, message: Ping) -> None:
        self.write(protocol.encode(Pong()))

    def _on_pong(self, message: Pong) -> None:
        pass

    def _on_resume(self, message: Resume) -> None:
        if self.role != "lb":
            raise RemoteProtocolError("a worker got a résumé")
        self.handler.handle_resume(self, message.skills)

    def _on_goaway(self, message: GoAway) -> None:
        self.draining = True
        self.handler.handle_goaway(self, message.reason)

    _CONNECTION_DISPATCH = {
        Ping: _on_ping,
        Pong: _on_pong,
        Resume: _on_resume,
        GoAway: _on_goaway,
    }

    # -- keepalive and ending -----------------------------------------

    def _keepalive_loop(self) -> None:
        ping = protocol.encode(Ping())
        suspect = False
        while not self.closed:
            slept = time.monotonic()
            gevent.sleep(self.keepalive_interval)
            if self.closed:
                return
            now = time.monotonic()
            if now - slept > self.keepalive_interval + self.keepalive_timeout / 2:
                # Our own loop was stuck: the silence is ours, not the peer's.
                log.warning("our event loop was blocked for %.1fs; not blaming %s",
                            now - slept - self.keepalive_interval, self.peer)
                self._last_received = now
            silent = now - self._last_received
            if silent > self.keepalive_timeout:
                log.warning("%s silent for %.1fs, dropping it", self.peer, silent)
                self._end(self._lost_error("%s: no keepalive for %.1fs" % (self.peer, silent)))
                return
            if (silent > SUSPECT_AFTER * self.keepalive_interval) != suspect:
                suspect = not suspect
                if suspect:
                    self.handler.handle_silent(self, silent)
                else:
                    self.handler.handle_heard(self)
            try:
                self.write(ping)
            except ZcLbError:
                return

    def _end(self, error: ZcLbError) -> None:
        if self.closed:
            return
        self.closed = True
        self.error = error
        try:
            self.sock.close()
        except OSError:
            pass
        streams, self.streams = self.streams, {}
        for exchange in streams.values():
            exchange.fail(error)
        current = gevent.getcurrent()
        for greenlet in self._greenlets:
            if greenlet is not current:
                greenlet.kill(block=False)
        try:
            self.handler.connection_lost(self, error)
        except Exception:
            log.exception("connection_lost handler failed for %s", self.peer)

    def __str__(self) -> str:
        return self.peer

    def __repr__(self) -> str:
        return "<Connection %s %s streams=%d%s>" % (
            self.role, self.peer, len(self.streams), " closed" if self.closed else "")
