"""The sending side of a connection's socket, under gevent.

Writes from many greenlets are coalesced: they queue bytes, and a writer
greenlet sends everything queued in a loop turn with one ``sendall``, so
requests that arrive together share a system call.  Body bytes are
bounded by credit, so the queue is bounded by a window per request.

Rules: bytes go out in the order they were queued.  A loop callback
sends them without blocking (no greenlet switch) when the socket takes
them all; what it does not take, a file's region (sendfile(2)) and
anything over TLS (every byte through the SSL object) go to the writer
greenlet (``run``), the one that waits on the socket.  A large body
chunk goes out as it is, beside its frame's header, with sendmsg; a
file that ends short is made up with zeros, to keep its frame whole.
The writer knows nothing of the protocol: ``connection.Connection``
refuses writes once it has ended, then ``stop``s it.
"""

from __future__ import annotations

import errno
from typing import Any, Callable, List, Optional, cast

import gevent  # type: ignore[import-untyped]
import gevent.event  # type: ignore[import-untyped]

from zc_lb.sockets import send_file, send_pieces

# sendfile(2) errors that are the file's (read from it failed), not the socket's.
_FILE_ERRORS = frozenset({errno.EIO, errno.EBADF, errno.EINVAL})


class FileRegion:
    """``count`` bytes of an open file from ``offset``: a Body frame's
    chunk, queued to go out with sendfile(2) (``exchange.Exchange.send_file``).
    ``sent`` is set once it went (or the connection ended); ``short``
    says the file ended first and zeros went in its place, to keep the
    frame whole."""

    __slots__ = ("fd", "offset", "count", "sent", "short")

    def __init__(self, fd: int, offset: int, count: int) -> None:
        self.fd = fd
        self.offset = offset
        self.count = count
        self.sent = gevent.event.Event()
        self.short = False


class Writer:
    """A connection's outgoing bytes: queued by many greenlets, sent one
    system call a loop turn (``write``), or by the writer greenlet
    (``run``)."""

    def __init__(self, sock: Any, tls: bool) -> None:
        self.sock = sock
        self.stopped = False  # the connection ended: nothing more goes out
        self._tls = tls
        self._outgoing: List[bytes] = []
        self.queued = 0  # bytes in ``_outgoing``: what waits behind the socket
        self._wake = gevent.event.Event()  # wakes the writer greenlet
        self._flush_scheduled = False  # a _flush callback is pending
        self._busy = False  # the writer greenlet has bytes the socket did not take
        self._vectored = False  # a body chunk is queued: send the pieces with sendmsg
        self._regions = 0  # FileRegions queued: the writer greenlet sends them
        # The non-blocking socket under gevent's, for sending from the hub
        # (none over TLS: every byte goes through the SSL object).
        raw = None if tls else getattr(sock, "_sock", None)
        self._raw_send = getattr(raw, "send", None)
        self._raw_sendmsg = getattr(raw, "sendmsg", None)
        self.flushed = gevent.event.Event()  # set while nothing is queued or being sent
        self.flushed.set()

    def write(self, data: bytes) -> None:
        """Queue bytes; everything queued in one loop turn goes out with
        one system call, from a loop callback (no greenlet switch), or
        from the writer greenlet when the socket cannot take it all at
        once."""
        self._outgoing.append(data)
        self.queued += len(data)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.flushed.clear()
            if self._raw_send is None or self._busy:
                self._wake.set()
            else:
                gevent.get_hub().loop.run_callback(self._flush)

    def write_chunk(self, header: bytes, chunk) -> None:
        """Queue a Body frame's header and its large chunk as they are: the
        loop turn's writes then go out with one sendmsg, the chunk not
        copied into a joined buffer."""
        self._vectored = True
        self.write(header)
        self._outgoing.append(chunk)
        self.queued += len(chunk)

    def write_region(self, header: bytes, region: FileRegion) -> None:
        """Queue a Body frame's header and its chunk from a file, for the
        writer greenlet to send with sendfile(2) in its place in line."""
        self.write(header)
        self._outgoing.append(region)  # type: ignore[arg-type]
        self._regions += 1

    def _flush(self) -> None:
        """In the hub, after this turn's greenlets have queued their
        writes: send them without blocking; what the socket does not take
        (or an error) goes to the writer greenlet."""
        self._flush_scheduled = False
        outgoing = self._outgoing
        send = self._raw_send  # (not None: ``write`` schedules no flush without it)
        if self.stopped or self._busy or not outgoing or send is None:
            return
        if self._regions:  # (sendfile waits for the socket: the writer's)
            self._busy = True
            self._wake.set()
            return
        pieces, self._outgoing = outgoing, []
        self.queued = 0
        if not self._vectored:  # (small frames: one join costs less than sendmsg's buffers)
            pieces = [pieces[0] if len(pieces) == 1 else b"".join(pieces)]
        self._vectored = False
        try:
            rest = send_pieces(send, self._raw_sendmsg, pieces)
        except (BlockingIOError, InterruptedError):
            rest = pieces
        except OSError:
            rest = pieces  # the writer greenlet meets the error and ends the connection
        if rest:
            self._outgoing[:0] = rest
            self.queued += sum(map(len, rest))
            self._busy = True
            self._wake.set()
        else:
            self.flushed.set()

    def run(self) -> None:
        """The writer greenlet: whenever woken, send all that is queued,
        waiting on the socket as it must, until ``stop``.  An OSError
        (the socket failed) is raised, the queue dropped and its waiters
        released."""
        wake, sock = self._wake, self.sock
        try:
            while not self.stopped:
                wake.wait()
                wake.clear()
                self._flush_scheduled = False
                sendmsg = None if self._tls else getattr(sock, "sendmsg", None)
                while self._outgoing:
                    pieces, self._outgoing = self._outgoing, []
                    self.queued = 0
                    if self._regions:
                        self._send_with_regions(pieces, sendmsg)
                        continue
                    while pieces:  # (gevent's: waits until the socket takes more)
                        pieces = send_pieces(sock.send, sendmsg, pieces)
                self._busy = False
                self.flushed.set()
        except OSError:
            self._outgoing.clear()
            self.queued = 0
            self.flushed.set()
            raise

    def _send_with_regions(self, pieces: List, sendmsg: Optional[Callable]) -> None:
        """(The writer greenlet) send ``pieces`` in order, FileRegions
        among them with sendfile(2)."""
        sock, run = self.sock, []
        for piece in pieces:
            if type(piece) is not FileRegion:
                run.append(piece)
                continue
            while run:
                run = send_pieces(sock.send, sendmsg, run)
            region = cast(FileRegion, piece)
            self._regions -= 1
            try:
                sent = send_file(sock, region.fd, region.offset, region.count)
            except OSError as exc:
                if exc.errno in _FILE_ERRORS:
                    sent = 0  # (the file's fault, not the connection's)
                else:
                    region.sent.set()
                    raise
            if sent < region.count:  # the file ended (or failed): keep the frame whole
                region.short = True
                run = [bytes(region.count - sent)]
            region.sent.set()
        while run:
            run = send_pieces(sock.send, sendmsg, run)

    def stop(self) -> None:
        """The connection ended: send nothing more, and release whoever
        waits for the queue to go out or for a file's region."""
        self.stopped = True
        self.flushed.set()
        for piece in self._outgoing:  # (whoever waits for a file's region)
            if type(piece) is FileRegion:
                cast(FileRegion, piece).sent.set()
