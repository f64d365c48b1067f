"""gevent glue: a pump between a socket and a ``protocol.Connection``.

A ``Connection`` owns a connected socket and the sans-I/O protocol
machine that decides everything (phases, request numbers, stream states,
credit, cancels).  ``handshake()`` exchanges Hello (and Auth, with a
shared secret) in the calling greenlet; ``start()`` spawns a reader
greenlet, which feeds received bytes to the machine and hands its events
to whoever waits, a writer greenlet, and a keepalive greenlet, which
pings the peer and declares it lost when nothing has arrived for
``keepalive_timeout`` seconds (``wire/keepalive.py`` judges).

Each request in flight is an ``Exchange`` (``wire/exchange.py``): the
reader only appends to its inbox and wakes its waiters, so a slow
consumer of one request never blocks the reader or other requests.
``idle`` is set while no request is in flight, for drains to wait on.

Writes from many greenlets are coalesced (``wire/writer.py``): they
queue bytes, and everything queued in a loop turn goes out with one
system call.

When the connection breaks, every exchange's waiters are woken with the
error: ``ConnectionLost`` (WorkerLost on the LB) when it broke from
outside, ``ConnectionClosed`` (WorkerClosed) when we closed it.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any, Callable, Dict, List, Optional, Tuple, cast

import gevent  # type: ignore[import-untyped]
import gevent.event  # type: ignore[import-untyped]
from mypy_extensions import mypyc_attr

from zc_lb.wire import decoder, frames, protocol
from zc_lb.errors import (
    BadResponse,
    ConnectionClosed,
    ConnectionLost,
    RemoteProtocolError,
    WorkerClosed,
    WorkerLost,
    ZcLbError,
)
from zc_lb.wire.frames import GoAway, Keys, Ping, Request, Resume
from zc_lb.wire.encoder import encode
from zc_lb.wire.handshake import REFUSED, SHOWN, refusal, shown, stranger
from zc_lb.wire.intake import ResumeIntake, ResumeRefused
from zc_lb.wire.protocol import StreamEnded
from zc_lb.sockets import set_nodelay
from zc_lb.wire.exchange import Exchange, Link
from zc_lb.wire.keepalive import KEEPALIVE_INTERVAL, KEEPALIVE_TIMEOUT, Keepalive
from zc_lb.wire.writer import FileRegion, Writer

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT = 10.0
HANDSHAKE_RECV = 16 * 1024  # Hello and Auth are small: no quarter megabyte per wait
RECV_SIZE = 256 * 1024


def looks_like_tls(data: bytes) -> bool:
    """Whether bytes a peer sent first are a TLS record (a handshake or an
    alert, version 3.x), not a Hello frame (whose first bytes, request
    number 0, are zeros)."""
    return len(data) >= 2 and data[0] in (0x15, 0x16) and data[1] == 0x03


@mypyc_attr(allow_interpreted_subclasses=True)  # (the LB's links and the worker, interpreted)
class Handler:
    """What a connection tells its owner; subclass and override."""

    def handle_request(self, connection: "Connection", exchange: "Exchange") -> None:
        """A new request arrived (worker side)."""
        raise RemoteProtocolError("unexpected request")

    def handle_resume(self, connection: "Connection", skills: Dict[str, float]) -> None:
        """The peer sent its résumé (LB side)."""

    def handle_resume_refused(self, connection: "Connection", refused: ResumeRefused) -> None:
        """The peer sent a résumé past what we take (LB side, ``wire/intake.py``):
        dropped, the connection kept."""

    def handle_goaway(self, connection: "Connection", reason: str) -> None:
        """The peer is draining."""

    def handle_keys(self, connection: "Connection", keys: Dict[str, List[int]]) -> None:
        """The peer sent keys (``frames.Keys``): an LB, the keys it sent
        this worker; a worker, keys another LB sent it."""

    def handle_silent(self, connection: "Connection", seconds: float) -> None:
        """The peer has said nothing for a while: it may be stuck."""

    def handle_heard(self, connection: "Connection") -> None:
        """The peer speaks again after handle_silent."""

    def connection_lost(self, connection: "Connection", error: ZcLbError) -> None:
        """The connection ended, from outside or by our own close()."""


def tell_refused(sock: Any, refused: Optional[frames.Hello], error: Exception) -> None:
    """Tell a peer whose Hello (``refused``) we refused why, if it takes
    the connection for open (``handshake.refusal``); it may be gone."""
    goaway = refusal(refused, error)
    if goaway is not None:
        try:
            sock.sendall(encode(goaway))
        except OSError:
            pass


class Connection(Link):
    """One multiplexed connection between an LB and a worker: a pump
    between a socket and a ``protocol.Connection``; to its Exchanges, a
    ``Link``."""

    def __init__(
        self,
        sock: socket.socket,
        role: str,
        handler: Handler,
        peer: str = "",
        secret: Optional[bytes] = None,
        keepalive_interval: float = KEEPALIVE_INTERVAL,
        keepalive_timeout: float = KEEPALIVE_TIMEOUT,
        app_version: Optional[str] = None,
        features: Optional[Tuple[str, ...]] = None,
        instance: Optional[str] = None,
        intake: Optional[ResumeIntake] = None,
    ) -> None:
        self.sock, self.role, self.handler = sock, role, handler
        self.peer, self.secret = peer, secret
        # (It holds the requests in flight, their Exchanges as owners, and draining.)
        self.protocol = protocol.Connection(role, secret, app_version=app_version,
                                            features=features, instance=instance,
                                            intake=intake)
        self.closed = False
        self.error: Optional[ZcLbError] = None
        self.peer_hello: Optional[frames.Hello] = None
        self.idle = gevent.event.Event()  # set while no request is in flight
        self.idle.set()
        self._keepalive = Keepalive(keepalive_interval, keepalive_timeout, time.monotonic())
        # Over TLS (``tls.py``) every byte goes through the SSL object (no raw
        # sends from the hub, no sendmsg, no sendfile(2): the kernel must see
        # the bytes), and decrypted bytes it holds (``pending``) are read first.
        self._pending: Optional[Callable[[], int]] = getattr(sock, "pending", None)
        self._writer = Writer(sock, self._pending is not None)
        self.sendfile = self._pending is None and hasattr(os, "sendfile")  # (not over TLS)
        self._greenlets: List[gevent.Greenlet] = []
        self._lost_error = WorkerLost if role == "lb" else ConnectionLost
        self.refused = False  # the peer refused our Hello, once it seemed open (``_refused``)
        self.broke_protocol = False  # the peer sent what the protocol forbids (logged here)
        self.closed_error = WorkerClosed if role == "lb" else ConnectionClosed
        set_nodelay(sock)

    # -- lifecycle ----------------------------------------------------

    def handshake(self, timeout: float = HANDSHAKE_TIMEOUT) -> None:
        """Exchange Hello (and Auth); raise on mismatch, failure or timeout,
        saying what came instead when the peer is no zc-lb peer."""
        received = bytearray()  # (the peer's first bytes: what it is, if not ours)
        with gevent.Timeout(timeout, False):
            try:
                self._exchange_hellos(received)
            except (BrokenPipeError, ConnectionResetError):
                if self.protocol.peer_hello is None:
                    raise
                raise self._closed_in_handshake(received) from None  # (our Auth cut off)
            return
        if self.protocol.peer_hello is not None:
            raise RemoteProtocolError("handshake timed out: %s sent its Hello but no Auth "
                                      "in %gs" % (self.peer, timeout))
        raise RemoteProtocolError("handshake timed out: no Hello from %s in %gs, %s" % (
            self.peer, timeout, self._heard(received)))

    def _exchange_hellos(self, received: bytearray) -> None:
        """``handshake``'s exchange, keeping the peer's first bytes in
        ``received`` (handshake.SHOWN)."""
        proto = self.protocol
        self.sock.sendall(proto.data_to_send())  # our Hello
        while True:
            try:
                event = proto.next_event()
            except RemoteProtocolError as exc:
                what = None if proto.peer_hello else stranger(self.role, bytes(received))
                if what is None:
                    tell_refused(self.sock, proto.refused_hello, exc)
                    raise
                raise RemoteProtocolError(what) from None
            out = proto.data_to_send()  # our Auth, once the peer's Hello came
            if out:
                self.sock.sendall(out)
            if event is decoder.NEED_DATA:
                data = self.sock.recv(HANDSHAKE_RECV)
                if not data:
                    raise self._closed_in_handshake(received)
                if self._pending is None and looks_like_tls(data):
                    raise RemoteProtocolError(
                        "%s speaks TLS and this side does not: %s" % (self.peer, (
                            "give the LB --worker-tls-cert, --worker-tls-key and "
                            "--worker-tls-ca" if self.role == "lb" else
                            "give the worker --tls-cert, --tls-key and --tls-ca")))
                if len(received) < SHOWN + 1:
                    received += data[:SHOWN + 1 - len(received)]
                proto.receive_data(data)
            elif isinstance(event, protocol.Ready):
                self.peer_hello = event.peer
                return
            else:  # Closed: nothing else passes the handshake's limits
                raise self._closed_in_handshake(received)

    def _refused(self, reason: str) -> ZcLbError:
        """The error of a connection whose peer refused our Hello, saying
        why in a GoAway (``handshake.REFUSED``); ``refused`` says so."""
        self.refused = True
        return self._lost_error("%s refused this %s at its Hello: %s" % (
            self.peer, "LB" if self.role == "lb" else "worker", reason[len(REFUSED):]))

    def _closed_in_handshake(self, received: bytearray) -> ZcLbError:
        """The error of a peer that closed the connection in the handshake:
        after its Hello, it refused ours (its log says why); before, it
        may be no zc-lb peer at all."""
        if self.protocol.peer_hello is not None:
            return self._lost_error("%s closed during handshake, after its Hello: it "
                                    "refused this %s (its log says why)" % (
                                        self.peer, "LB" if self.role == "lb" else "worker"))
        return self._lost_error("%s closed during handshake, before its Hello: %s" % (
            self.peer, self._heard(received)))

    def _heard(self, received: bytearray) -> str:
        """What came from a peer that sent no Hello, for a log line."""
        if received:
            return "received %s" % shown(bytes(received))
        if self.role == "lb":
            return "nothing received (is it a zc-lb worker's port?)"
        return "nothing received"

    def start(self) -> None:
        """Start reading and keeping alive (after the handshake)."""
        self._greenlets = [gevent.spawn(self._read_loop), gevent.spawn(self._keepalive_loop),
                           gevent.spawn(self._write_loop)]

    def close(self, reason: str = "closed", flush_timeout: float = 0.0) -> None:
        """Close from our side, after up to ``flush_timeout`` seconds for
        what is queued to be sent; waiters get ConnectionClosed/WorkerClosed."""
        if flush_timeout > 0 and not self.closed:
            self._writer.flushed.wait(flush_timeout)
        if not self.closed:
            try:
                self.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        self._end(self.closed_error("%s: %s" % (self.peer, reason)))

    def join(self, timeout: Optional[float] = None) -> None:
        """Wait for the reader to end."""
        gevent.joinall(self._greenlets[:1], timeout=timeout)

    @property
    def suspect(self) -> bool:
        """The peer has been silent long enough to be suspected
        (``Handler.handle_silent``), and not heard since."""
        return self._keepalive.suspect

    # -- requests -----------------------------------------------------

    def open_request(self, environ: Optional[Dict[str, str]], end: bool = False,
                     head: Optional[bytes] = None) -> Exchange:
        """LB side: start a request, ended at once when it has no body:
        its ``head`` (a HEAD_REQUEST's payload), or else its ``environ``
        (see ``protocol.Connection.start_request``)."""
        if self.closed:
            raise self.error or self.closed_error(self.peer)
        proto = self.protocol
        if proto.peer_goes_away:
            raise self.closed_error("%s is going away" % self.peer)
        if proto.last_rno >= protocol.RECYCLE_RNO and proto.running_out():
            # (``proto.draining`` from now on): make way for a new connection
            self.handler.handle_goaway(self, "request numbers running out")
        if proto.last_rno >= frames.MAX_RNO:
            raise self.closed_error("%s: no request numbers left" % self.peer)
        rno, data = proto.start_request(environ, end, head)  # MessageTooLarge: nothing sent
        exchange = proto.streams[rno].owner = Exchange(self, rno)
        self.idle.clear()
        self.write(data)
        return exchange

    def send_resume(self, skills: Dict[str, float]) -> None:
        """Worker side: send our résumé."""
        self.write(self.protocol.send(Resume(skills)))

    def send_keys(self, keys: Dict[str, List[int]]) -> None:
        """Send ``keys`` (``frames.Keys``)."""
        self.write(self.protocol.send(Keys(keys)))

    def send_goaway(self, reason: str = "") -> None:
        """Tell the peer we are draining."""
        self.write(self.protocol.send(GoAway(reason)))

    # -- writing ------------------------------------------------------

    def write(self, data: bytes) -> None:
        """Queue bytes to send (``writer.Writer.write``); raise once the
        connection has ended."""
        if self.closed:
            raise self.error or self.closed_error(self.peer)
        self._writer.write(data)

    @property
    def queued(self) -> int:
        """Bytes queued that the socket has not taken yet (a peer that
        reads nothing makes them grow)."""
        return self._writer.queued

    def wait_flushed(self, timeout: Optional[float] = None) -> bool:
        """Wait, at most ``timeout`` seconds, until the socket took every
        byte queued or the connection ended; whether it did."""
        return bool(self._writer.flushed.wait(timeout))

    def write_chunk(self, header: bytes, chunk) -> None:
        """Queue a Body frame's header and its large chunk as they are
        (``writer.Writer.write_chunk``); raise once the connection has
        ended."""
        if self.closed:
            raise self.error or self.closed_error(self.peer)
        self._writer.write_chunk(header, chunk)

    def write_region(self, header: bytes, region: FileRegion) -> None:
        """Queue a Body frame's header and its chunk from a file
        (``writer.Writer.write_region``); raise once the connection has
        ended."""
        if self.closed:
            raise self.error or self.closed_error(self.peer)
        self._writer.write_region(header, region)

    def _write_loop(self) -> None:
        try:
            self._writer.run()
        except OSError as exc:
            self._end(self._lost_error("%s: write failed: %s" % (self.peer, exc)))

    # -- reading ------------------------------------------------------

    def _read_loop(self) -> None:
        # Into one buffer: recv(RECV_SIZE) allocated (and often mmapped)
        # a quarter megabyte per read, then shrank it.  But the rest of a
        # large body frame is read by itself with recv, its bytes handed
        # on as they are (see ``decoder.Decoder.wants``).
        buffer = bytearray(RECV_SIZE)
        # After a short read the socket is drained: wait for it to be
        # readable, rather than let recv() try first, fail with EAGAIN
        # (a system call and a Python exception per batch) and then wait.
        readable = gevent.get_hub().loop.io(self.sock.fileno(), 1)
        try:
            self._read(buffer, readable)
        except RemoteProtocolError as exc:
            # (said here alone, the handlers told by ``broke_protocol``)
            self.broke_protocol = True
            log.warning("protocol error from %s %s, disconnecting: %s",
                        "worker" if self.role == "lb" else "LB", self.peer, exc)
            stream = self.protocol.streams.get(exc.rno) if exc.rno else None
            culprit = None if stream is None else stream.owner
            if isinstance(culprit, Exchange):  # its request must not be tried again elsewhere
                culprit.fail(BadResponse("%s broke the protocol answering it: %s"
                                         % (self.peer, exc)))
            self._end(self._lost_error("%s: protocol error: %s" % (self.peer, exc)))
        except ZcLbError as exc:
            self._end(exc)
        except OSError as exc:
            self._end(self._lost_error("%s: %s" % (self.peer, exc)))
        except Exception as exc:  # a bug; don't take the process down
            log.exception("connection to %s failed", self.peer)
            self._end(self._lost_error("%s: %r" % (self.peer, exc)))

    def _read(self, buffer: bytearray, readable: Any) -> None:
        """Read the socket into the protocol (into ``buffer``, waiting on
        the watcher ``readable``) and hand on the events its bytes make,
        until the connection ends; raise what ends it."""
        sock = self.sock
        proto, recv, recv_into = self.protocol, sock.recv, sock.recv_into
        view = memoryview(buffer)
        hub = gevent.get_hub()
        pending, intake = self._pending, proto.intake
        self._dispatch_events()
        while not self.closed:
            size = proto.wants()
            if size:
                data = recv(min(size, RECV_SIZE))
                n = len(data)
                proto.receive_data(data)
            else:
                size = RECV_SIZE
                n = recv_into(buffer)
                proto.receive_data(view[:n] if n else b"")
            self._keepalive.last_received = time.monotonic()
            self._dispatch_events()
            held = intake is not None and intake.held is not None
            if 0 < n and (n < size or held) and not self.closed and not (pending and pending()):
                if held:  # (a résumé waits its turn: taken when due, whatever comes)
                    _wait_readable(self, hub, readable, self._dispatch_events)
                else:
                    hub.wait(readable)
            elif n:  # (more waits: a turn for the rest of the loop first)
                gevent.sleep(0)

    def _dispatch_events(self) -> None:
        """Hand every event the bytes so far make to whoever waits for it."""
        proto = self.protocol
        next_event, live = proto.next_event, proto.streams
        while True:
            event = next_event()
            if event is decoder.NEED_DATA:
                break
            rno = getattr(event, "rno", 0)
            if rno:
                exchange = cast(Optional[Exchange], proto.event_owner)
                if exchange is None:  # (a new request: no owner yet)
                    if type(event) is Request:
                        self._new_request(cast(Request, event))
                    continue
                if type(event) is StreamEnded:
                    exchange.cancelled_by_peer()
                else:
                    exchange.received(event)  # type: ignore[arg-type]
                if not live:
                    self.idle.set()
            elif type(event) is Resume:
                self.handler.handle_resume(self, event.skills)  # type: ignore[union-attr]
            elif type(event) is GoAway:
                reason = event.reason  # type: ignore[union-attr]
                if reason.startswith(REFUSED):  # (nothing more goes to a peer that refused us)
                    raise self._refused(reason)
                self.handler.handle_goaway(self, reason)
            elif type(event) is Keys:
                self.handler.handle_keys(self, event.keys)  # type: ignore[union-attr]
            elif type(event) is ResumeRefused:
                self.handler.handle_resume_refused(self, event)  # type: ignore[arg-type]
            elif type(event) is protocol.Closed:
                raise self._lost_error("%s closed the connection" % self.peer)
        keepalive = self._keepalive
        if proto.pings != keepalive.pings_counted:  # (a Ping a second, from a live peer)
            keepalive.count_pings(proto.pings, time.monotonic())
        out = proto.data_to_send()  # our Pongs
        if out:
            self.write(out)

    def _new_request(self, message: Request) -> None:
        exchange = self.protocol.streams[message.rno].owner = Exchange(self, message.rno)
        self.idle.clear()
        exchange.inbox.append(message)
        self.handler.handle_request(self, exchange)

    # -- keepalive and ending -----------------------------------------

    def _keepalive_loop(self) -> None:
        keepalive = self._keepalive
        while not self.closed:
            slept = time.monotonic()
            gevent.sleep(keepalive.interval)
            if self.closed:
                return
            now = time.monotonic()
            stalled = keepalive.stalled(slept, now)
            if stalled > keepalive.interval:  # (our own loop was stuck: not the peer's silence)
                log.warning("our event loop was blocked for %.1fs; not blaming %s",
                            stalled, self.peer)
            silent = now - keepalive.last_received
            if silent > keepalive.timeout:  # (its owner says so: "lost worker", "ended")
                self._end(self._lost_error("%s: no keepalive for %.1fs" % (self.peer, silent)))
                return
            if keepalive.suspicion_changed(silent):
                if keepalive.suspect:
                    self.handler.handle_silent(self, silent)
                else:
                    self.handler.handle_heard(self)
            try:
                self.write(self.protocol.send(Ping()))
            except ZcLbError:
                return

    def _end(self, error: ZcLbError) -> None:
        if self.closed:
            return
        self.closed = True
        self.error = error
        streams = self.protocol.close()
        try:
            self.sock.close()
        except OSError:
            pass
        for stream in streams:
            if isinstance(stream.owner, Exchange):  # (every one, once its event was handed on)
                stream.owner.lost(error)
        self.idle.set()
        self._writer.stop()
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
            self.role, self.peer, len(self.protocol.streams), " closed" if self.closed else "")


def _wait_readable(connection: Connection, hub: Any, readable: Any,
                   dispatch: Callable[[], None]) -> None:
    """Wait for ``connection``'s socket to be readable (at once if more
    came); meanwhile, ``dispatch`` a résumé the intake holds once its time
    comes (``wire/intake.py``), not when the worker next sends something:
    a Ping a keepalive interval later, or nothing from one that stopped."""
    intake = connection.protocol.intake
    while intake is not None and not connection.closed:
        due = intake.due_at
        if due is None:
            break
        timer = gevent.Timeout(max(0.0, due - time.monotonic()))
        timer.start()
        try:
            hub.wait(readable)
            return
        except gevent.Timeout as exc:
            if exc is not timer:
                raise
        finally:
            timer.close()
        dispatch()
    hub.wait(readable)
