"""A client's socket as the front reads and writes it, and parks it.

gevent's socket methods cost a Timeout object per wait, and a change of
the socket's timeout for each wait as much again.  On a plain socket a
``Transport`` reads and writes the non-blocking socket itself, and only
what it does not take waits, on a read watcher of the loop with a timer
of the loop (``wait_readable``); a TLS socket reads and writes through
gevent.  Reads and writes wait at most the client timeout for progress
(the socket's own timeout); a request head's wait has a deadline of its
own, which the caller passes.

Between requests an idle client's connection may ``park``: its
greenlet is let go, and the read watcher calls back when the client
sends again (or hangs up), or the timer when the client timeout passes.
A greenlet's saved stack and its frames were a third of what an idle
keep-alive client cost.  ``linger`` closes gently: stop sending, then
read and drop what the client still sends, so that closing with unread
bytes does not reset the connection before the client has our answer.
"""

from __future__ import annotations

import socket
import time
from typing import Any, Callable, Optional

import gevent.ssl  # type: ignore[import-untyped]
from gevent.hub import Waiter, get_hub  # type: ignore[import-untyped]

from zc_lb.sockets import send_all, wait

RECV_SIZE = 64 * 1024
LINGER = 0.5  # seconds to read and drop a refused client's bytes before closing
LINGER_BYTES = 1024 * 1024


class Transport:
    """A client connection's socket: reads, writes, waits, parking."""

    def __init__(self, sock: Any, client_timeout: Optional[float]) -> None:
        self.sock = sock
        self.client_timeout = client_timeout
        sock.settimeout(client_timeout)
        raw: Any = getattr(sock, "_sock", None)
        plain = not isinstance(sock, gevent.ssl.SSLSocket) and raw is not None
        # (Both None on a TLS socket: it is read and written through gevent.)
        self.raw_recv: Optional[Callable[[int], bytes]] = raw.recv if plain else None
        self._raw_send: Optional[Callable[[Any], int]] = raw.send if plain else None
        self._readable: Any = None  # the socket's read watcher, made at the first wait
        self._idle: Any = None  # while parked, the client timeout's timer
        self.parked = False  # its greenlet let go while the client idles

    def recv(self, timeout: Optional[float], drained: bool = False) -> bytes:
        """What the client sent, within ``timeout`` seconds (socket.timeout
        past it); ``drained``: the socket was just found empty, so wait
        before reading."""
        raw_recv = self.raw_recv
        if raw_recv is None:
            sock = self.sock
            sock.settimeout(timeout)
            try:
                return sock.recv(RECV_SIZE)
            finally:
                sock.settimeout(self.client_timeout)
        if drained:
            self.wait_readable(timeout)
        while True:
            try:
                return raw_recv(RECV_SIZE)
            except BlockingIOError:
                self.wait_readable(timeout)

    def wait_readable(self, timeout: Optional[float]) -> None:
        hub = get_hub()
        readable = self._readable
        if readable is None:
            readable = self._readable = hub.loop.io(self.sock.fileno(), 1)
        waiter = Waiter(hub)
        readable.start(waiter.switch, None)
        try:
            wait(waiter, timeout, socket.timeout, "timed out")
        finally:
            readable.stop()

    def send(self, data: bytes) -> None:
        """Send all of ``data``: straight to the non-blocking socket first (a
        response's one send, without gevent's wrapper), what it does not
        take through gevent's, which waits for the socket."""
        raw_send = self._raw_send
        if raw_send is None:
            send_all(self.sock, data)
            return
        try:
            sent = raw_send(data)
        except BlockingIOError:
            sent = 0
        if sent < len(data):
            send_all(self.sock, memoryview(data)[sent:])

    def park(self, timeout: Optional[float], ready: Callable[[], None],
             expired: Callable[[], None]) -> None:
        """Call ``ready`` (from the hub) when the client sends or hangs up,
        or ``expired`` after ``timeout`` seconds (None: never); the
        caller lets its greenlet go.  Only after a wait of
        ``wait_readable`` timed out (a plain socket)."""
        assert self._readable is not None  # (made by the wait that timed out)
        self.parked = True
        self._readable.start(ready)
        if timeout is not None:
            self._idle = get_hub().loop.timer(timeout)
            self._idle.start(expired, update=True)

    def stop_parking(self) -> None:
        assert self._readable is not None
        self.parked = False
        self._readable.stop()
        if self._idle is not None:
            self._idle.close()
            self._idle = None

    def linger(self) -> None:
        """Close gently: stop sending, then read and drop what the client
        still sends (up to LINGER_BYTES, for LINGER seconds)."""
        linger(self.sock)


def linger(sock: Any, seconds: float = LINGER) -> None:
    """Stop sending on ``sock``, then read and drop what its client still
    sends, up to LINGER_BYTES for ``seconds`` in all: a client that sends
    without end is not waited for."""
    try:
        sock.shutdown(socket.SHUT_WR)
        deadline, dropped = time.monotonic() + seconds, 0
        while dropped < LINGER_BYTES:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            sock.settimeout(left)
            data = sock.recv(RECV_SIZE)
            if not data:
                return
            dropped += len(data)
    except OSError:
        pass
