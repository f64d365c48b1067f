"""Response buffering: a worker's response body held for a slow client.

A worker's pool thread is the scarce thing in the site: while it streams
a response, it serves nobody else.  Without buffering, the LB grants the
worker credit for a response only as the client takes the bytes, so a
client reading a large body slowly holds a worker thread for as long as
it takes, and fifty such clients stall the pool.  As nginx's proxy
buffering does, the LB instead takes a response as fast as the worker
produces it and keeps it here until the client reads it: in memory up to
``memory`` bytes a response and ``total_memory`` bytes in all, then in a
temporary file (unlinked at once) up to ``disk`` bytes a response and
``total_disk`` in all.  The LB grants the worker credit for no more than
the spool has ``room`` for; with none, the spool is ``full``: the worker
waits, as it did before (flow control is the last resort, never loss).
A file counts for its size, not for what it holds unread: it gives its
room back when it is emptied, all read (a file written on while read
grew to the whole response, past every bound).  A disk that fails a write (full,
read-only, failing) or a read is logged, and buffering goes on in memory
alone, within the memory bounds (a response whose bytes could not be
read back fails with ``BufferUnreadable``: its client's connection is
closed).  A process out of file descriptors (EMFILE, ENFILE: a flood of
connections) is no failing disk: the response that found none goes on
in memory alone, within its bounds, and the next ones try the disk
again.  A response whose client has read all its spool holds is never
held back, so that no response waits for room that only other
responses' clients can make.

A ``Spool`` keeps its parts in order, each either bytes in memory or the
length of the next bytes in its file, so a body may go to disk and back
to memory as room comes and goes and still come out in order.  The file
is written and read by offset (``pwrite``, ``pread``) and emptied when all
it held has been read.  ``Spool`` is plain Python: no gevent, no sockets;
who waits for what is the caller's business (lb/balancer.py).
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import tempfile
import time
from typing import IO, Deque, Optional, Union

from zc_lb.errors import BufferUnreadable
from zc_lb.settings import LB_SETTINGS

log = logging.getLogger(__name__)

# Parts in memory smaller than SMALL are taken together, up to JOIN bytes:
# a send for each costs more than copying them into one; larger parts go
# as they are (copying them would cost more than their sends).
SMALL = 32 * 1024
JOIN = 256 * 1024
OUT_OF_FILES = frozenset((errno.EMFILE, errno.ENFILE))  # the process's, not the disk's
OUT_OF_FILES_LOG_EVERY = 10.0  # seconds between lines saying so


class SpoolLimits:
    """The bounds every response's spool shares, and what all of them hold."""

    def __init__(self, memory: int = LB_SETTINGS["buffer_memory"].default,
                 total_memory: int = LB_SETTINGS["buffer_memory_total"].default,
                 disk: int = LB_SETTINGS["buffer_disk"].default,
                 total_disk: int = LB_SETTINGS["buffer_disk_total"].default,
                 directory: Optional[str] = None,
                 request: int = LB_SETTINGS["buffer_request"].default) -> None:
        self.memory = memory
        self.total_memory = total_memory
        self.disk = disk
        self.total_disk = total_disk
        self.request = request  # bytes of a request body read before it goes to a worker
        # Found now: tempfile looks for a usable one at its first use, and
        # out of descriptors then, it says none is usable (ENOENT).
        self.directory = directory or _temporary_directory()
        self.in_memory = 0  # bytes every spool holds in memory
        self.on_disk = 0  # bytes every spool holds in its file
        self.spilled = 0  # responses and request bodies that went to disk, ever
        self.stalled = 0  # times a response filled its spool and held its worker
        self.out_of_files_logged = -OUT_OF_FILES_LOG_EVERY  # when last said (monotonic)

    def status(self) -> dict:
        return {"memory": self.in_memory, "disk": self.on_disk, "spilled": self.spilled,
                "stalled": self.stalled}


class Spool:
    """One response body on its way from a worker to a client."""

    def __init__(self, limits: SpoolLimits) -> None:
        self.limits = limits
        self._parts: Deque[Union[bytes, int]] = collections.deque()
        self.memory = 0  # bytes held in memory
        self.disk = 0  # bytes the file takes: written since it was last emptied
        self._unread = 0  # of those, the bytes not read yet
        self._file: Optional[IO[bytes]] = None
        self._read_at = self._write_at = 0
        self._no_file = False  # no descriptor was left for a file: memory alone
        self.closed = False  # (its client is gone: what still comes is dropped)

    def __bool__(self) -> bool:
        return bool(self._parts)

    @property
    def full(self) -> bool:
        """No room for more, in memory or on disk: take nothing more from
        the worker until the client has read some."""
        return self.room == 0

    @property
    def room(self) -> Optional[int]:
        """Bytes the bounds leave room for, in memory and on disk: the
        credit the worker may be granted (granting all it sent whenever
        there was any room let memory grow past its bounds by a window
        at each grant).  None (no bound) while the spool holds nothing,
        whatever the others hold: its client has read all it has, and
        only the worker's next bytes wake either (past the bounds by at
        most a credit window a response)."""
        if not self._parts:
            return None
        return max(self._memory_left(), 0) + max(self._disk_left(), 0)

    def _memory_left(self) -> int:
        limits = self.limits
        return min(limits.memory - self.memory, limits.total_memory - limits.in_memory)

    def _disk_left(self) -> int:
        limits = self.limits
        return 0 if self._no_file else min(limits.disk - self.disk,
                                           limits.total_disk - limits.on_disk)

    def put(self, data: bytes) -> None:
        """Keep ``data``: in memory if there is room, else on disk if there
        is room, else in memory all the same (the caller, who grants
        credit within ``room``, bounds the excess to what the worker may
        send unasked).  Nothing, once closed: a pump on its
        way when the client left must not count bytes no one drops."""
        if self.closed:
            return
        size = len(data)
        if self._memory_left() <= 0 < self._disk_left():
            try:
                self._write(data)
            except OSError as exc:  # a full disk: memory, and flow control, it is
                self._disk_failed(exc)
            else:
                self._parts.append(size)
                return
        self._parts.append(data)
        self.memory += size
        self.limits.in_memory += size

    def _disk_failed(self, exc: OSError) -> None:
        """The disk refused ``data``: leave it, for good if it failed, for
        this response alone if the process was out of descriptors."""
        limits = self.limits
        if exc.errno not in OUT_OF_FILES:
            log.error("cannot buffer a body on disk (%s); buffering in memory "
                      "alone from now on", exc)
            limits.total_disk = 0
            return
        self._no_file = True
        now = time.monotonic()
        if now - limits.out_of_files_logged >= OUT_OF_FILES_LOG_EVERY:
            limits.out_of_files_logged = now
            log.warning("no file descriptor left to buffer a response on disk (%s); "
                        "that response is buffered in memory alone", exc)

    def take(self) -> bytes:
        """The oldest bytes held (b"" when none): small parts in memory
        joined (SMALL, JOIN), so that a body that came in small frames
        (an app writing 4 KiB blocks) goes to the client in fewer,
        larger writes."""
        parts = self._parts
        if not parts:
            return b""
        part = parts.popleft()
        if type(part) is not bytes:
            try:
                return self._read(part)  # type: ignore[arg-type]
            except OSError as exc:  # (not the client's socket: say so, and leave the disk)
                if self.limits.total_disk:
                    log.error("cannot read a buffered body back from disk (%s); "
                              "buffering in memory alone from now on", exc)
                    self.limits.total_disk = 0
                raise BufferUnreadable("buffered response unreadable: %s" % exc) from exc
        size = len(part)
        if size < SMALL and parts and type(parts[0]) is bytes:
            pieces = [part]
            while parts:
                following = parts[0]
                if (type(following) is not bytes or len(following) >= SMALL
                        or size + len(following) > JOIN):
                    break
                pieces.append(parts.popleft())  # type: ignore[arg-type]
                size += len(following)
            part = b"".join(pieces)
        self.memory -= size
        self.limits.in_memory -= size
        return part

    def _write(self, data: bytes) -> None:
        if self._file is None:
            self._file = tempfile.TemporaryFile(dir=self.limits.directory)
            self.limits.spilled += 1
        fd = self._file.fileno()
        view, at = memoryview(data), self._write_at
        while view:
            written = os.pwrite(fd, view, at)
            view, at = view[written:], at + written
        self._write_at = at
        self.disk += len(data)
        self._unread += len(data)
        self.limits.on_disk += len(data)

    def _read(self, size: int) -> bytes:
        assert self._file is not None
        data = os.pread(self._file.fileno(), size, self._read_at)
        if len(data) != size:
            raise OSError("buffer file %s short: %d of %d bytes"
                          % (self._file.name, len(data), size))
        self._read_at += size
        self._unread -= size
        if not self._unread:  # all read: start the file over, and give back its room
            self._file.truncate(0)
            self._read_at = self._write_at = 0
            self.limits.on_disk -= self.disk
            self.disk = 0
        return data

    def close(self) -> None:
        """Drop what is held, and the file; keep nothing more (``put``)."""
        self.closed = True
        self.limits.in_memory -= self.memory
        self.limits.on_disk -= self.disk
        self.memory = self.disk = self._unread = 0
        self._parts.clear()
        if self._file is not None:
            self._file.close()
            self._file = None


def _temporary_directory() -> Optional[str]:
    """The system's temporary directory, or None (tempfile looks again at
    the first spill, which then says why none is usable)."""
    try:
        return tempfile.gettempdir()
    except OSError:
        return None
