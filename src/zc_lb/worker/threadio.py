"""A pool thread's request body and response body, through the hub.

In thread mode the application runs in a pool thread, while the
connection to the LB belongs to the hub (the event loop in the main
thread).  A handoff between them (a callback in the hub, a wait in the
thread) costs a loop turn and two thread switches: made for every block
an application yields or reads (Django iterates a file in 4 KiB
blocks), it was most of a large body's time.  So blocks cross in bulk,
and the thread waits for the hub only when it must:

``ThreadOutput``
    The response.  The thread appends the application's blocks to a
    queue and goes on; the first block into an empty queue wakes the
    hub, whose sender greenlet takes everything queued and sends it as
    one chunk, so the blocks that come while the hub sends go together
    next.  The thread waits when ``HIGH`` bytes are queued or on their
    way (the LB's credit, a slow client: flow control reaches the
    application), and never at the end: the hub ends the response once
    the thread has returned and the queue is sent, so a response in one
    piece costs the thread no handoff at all.

``ThreadInput``
    ``wsgi.input``.  A pump in the hub hands the body over to the thread
    as it comes, up to ``READ_AHEAD`` bytes ahead of the thread's reads;
    the thread waits only when it has read all that came.  A thread that
    waits is woken once ``GATHER`` bytes came, or the body's end, or
    ``LINGER`` seconds after the first of them: woken for each piece the
    connection brings (a quarter megabyte at most), a thread reading a
    large upload cost the worker a quarter of its CPU in thread switches.

Errors the hub meets (the LB went away, the request was cancelled) are
raised in the thread at its next write, or in the hub when it ends the
response.  While the thread waits for the hub it is marked ``in_hub``,
so the pool's sampler counts the wait as the LB's, not the app's, and
the wait is taken off the app's measured time.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable, Deque, List, Optional, Tuple

import gevent  # type: ignore[import-untyped]
import gevent.event  # type: ignore[import-untyped]

from zc_lb.errors import CancelledHere, ZcLbError
from zc_lb.front.h1 import start_again

HIGH = 1024 * 1024  # response bytes queued or on their way before the thread waits
CHUNK = 256 * 1024  # at most this much of the queue is sent as one chunk
READ_AHEAD = 1024 * 1024  # request body bytes handed over ahead of the thread's reads
PIECE = 256 * 1024  # at most this much of the body taken from the connection at a time
GATHER = 512 * 1024  # a waiting thread is woken once this much came (or the end)
LINGER = 0.0005  # or this many seconds after the first of it came

# PEP 3333: a response body is bytes (gunicorn and gevent's server refuse
# anything else too); the worker's message, in either mode.
NOT_BYTES = "the application's response body must be bytes, not %s"
_NO_CHUNKS: Deque[bytes] = collections.deque()  # (ThreadInput's until its first read)
# A file given to the hub by a thread whose request's greenlet may be gone:
# who closes it (``ThreadOutput.send_file`` and ``abandon``; rare, so one lock).
_HANDOFF = threading.Lock()


def _in_hub(thread: Any) -> float:
    """A pool thread (its record, or None) starts to wait on the hub: for
    its request's body, or for room for its response.  The sampler counts
    the wait as the LB's, not the app's, and so does the app's measured
    time (the record's ``held``).  When it began: for ``_out_of_hub``."""
    if thread is not None:
        thread.in_hub = True
    return time.perf_counter()


def _out_of_hub(thread: Any, began: float) -> None:
    if thread is not None:
        thread.in_hub = False
        thread.held += time.perf_counter() - began


class ThreadOutput:
    """A response body written in a pool thread and sent by the hub.

    ``writer`` is the request's ``ResponseWriter`` (its ``write`` and
    ``finish`` run in the hub); ``thread`` the pool's record of the
    thread (``threads._Thread``), or None.  The thread calls ``write``
    and at most one of ``finish`` and ``fail``; the hub then calls
    ``close``.  Most responses are one piece (``finish`` alone): the
    lock and the hub's event are made at the first ``write``, not for
    every request.
    """

    __slots__ = ("_hub", "_writer", "thread", "_lock", "_room", "_blocks", "_held",
                 "_sending", "_sent", "error", "_last", "_failed", "_file", "_wrote",
                 "_abandoned")

    def __init__(self, hub: Any, writer: Any, thread: Any = None) -> None:
        self._hub = hub
        self._writer = writer
        self.thread = thread
        self._lock: Optional[threading.Lock] = None  # (made by the first write)
        self._room: Optional[threading.Condition] = None  # under HIGH bytes held
        self._blocks: List[bytes] = []  # queued, not yet taken by the sender
        self._held = 0  # bytes queued or being sent
        self._sending = False  # the hub has a sender running, or coming
        self._sent: Any = None  # (hub) a gevent Event, set while no sender runs
        self.error: Optional[BaseException] = None  # what the hub met sending
        # What the hub does once the queue is sent: finish the response
        # with these bytes, or (``fail``) answer 500 or cancel.
        self._last: Optional[bytes] = None
        self._failed = False
        # Or send this file with sendfile(2), then close it: (wrapper, region).
        self._file: Optional[Tuple[Any, Tuple[int, int, int]]] = None
        self._wrote = False  # (the thread) a block went: the head counts as sent
        self._abandoned = False  # the request's greenlet left first (``abandon``)

    # -- in the pool thread ---------------------------------------------

    def start_response(self, status: str, headers: Any, exc_info: Any = None) -> Callable:
        """The application's ``start_response``: the writer's, whose
        ``write`` callable is this output's.  Once a block was written the
        head counts as sent (PEP 3333), though the hub may not have sent it
        yet: ``exc_info`` is raised again, as the writer would."""
        if exc_info and self._wrote:
            start_again(exc_info, True, True)  # (raises)
        self._writer.start_response(status, headers, exc_info)
        return self.write

    def write(self, data: object) -> None:
        """Queue ``data``; wait only while HIGH bytes are held."""
        if type(data) is not bytes:  # (``object``: compiled, a str gets this message)
            raise TypeError(NOT_BYTES % type(data).__name__)
        assert isinstance(data, bytes)
        if self.error is not None:
            raise self.error
        if self._writer.status is None:
            raise AssertionError("write() before start_response()")
        if not data:
            return
        if not self._wrote:  # (the head is out, for the app: what it said of its cache)
            self._wrote = True
            self._writer.cache_now()
        lock = self._lock
        if lock is None:  # (before the hub can see any of it)
            lock = self._lock = threading.Lock()
            self._room = threading.Condition(lock)
        with lock:
            self._blocks.append(data)
            self._held += len(data)
            wake = not self._sending
            self._sending = True
            if wake:
                self._hub.loop.run_callback_threadsafe(self._start_sender)
            if self._held >= HIGH:
                self._wait_for_room()
        if self.error is not None:
            raise self.error

    def finish(self, data: object = b"") -> None:
        """The response ends after ``data``; the hub ends it (``close``)."""
        if type(data) is not bytes:
            raise TypeError(NOT_BYTES % type(data).__name__)
        assert isinstance(data, bytes)
        self._last = data

    def send_file(self, wrapper: Any, region: Tuple[int, int, int]) -> None:
        """The body is ``region`` of the file ``wrapper`` holds
        (``filewrapper.FileWrapper.region``): the hub sends it with
        sendfile(2), ends the response and closes the file; or, if the
        request's greenlet is gone (``abandon``), this thread closes it."""
        with _HANDOFF:
            if not self._abandoned:
                self._file = (wrapper, region)
                return
        wrapper.close()

    def fail(self) -> None:
        """The application failed: the hub answers 500, or cancels a
        response already started, once what was queued is sent."""
        self._failed = True

    def _wait_for_room(self) -> None:
        """(Under the lock) wait while HIGH bytes are held and all goes well."""
        room, thread = self._room, self.thread
        assert room is not None
        began = _in_hub(thread)
        try:
            while self._held >= HIGH and self.error is None:
                room.wait()
        finally:
            _out_of_hub(thread, began)

    # -- in the hub -----------------------------------------------------

    def abandon(self) -> None:
        """The request's greenlet leaves before the thread's result came
        (killed: the LB cancelled it, or went): nothing will ``close``
        this output, so a file it was given is closed here, or by the
        thread when it gives one (PEP 3333: ``close`` is called)."""
        with _HANDOFF:
            self._abandoned = True
            given, self._file = self._file, None
        if given is not None:
            given[0].close()

    def _start_sender(self) -> None:
        sent = self._sent
        if sent is None:
            sent = self._sent = gevent.event.Event()
        sent.clear()
        gevent.spawn(self._send_queued)

    def _send_queued(self) -> None:
        writer, lock, room = self._writer, self._lock, self._room
        assert lock is not None and room is not None and self._sent is not None
        try:
            while True:
                with lock:
                    blocks = self._take()
                    if not blocks:
                        self._sending = False
                        return
                data = blocks[0] if len(blocks) == 1 else b"".join(blocks)
                try:
                    if self.error is None:
                        writer.write(data)
                except BaseException as exc:  # (raised in the thread, or by close)
                    self.error = exc
                with lock:
                    self._held -= len(data)
                    if self._held < HIGH or self.error is not None:
                        room.notify()
        finally:
            self._sent.set()

    def _take(self) -> List[bytes]:
        """Up to CHUNK bytes of queued blocks (at least one), taken off
        the queue.  (Under the lock.)"""
        blocks = self._blocks
        if not blocks:
            return blocks
        size = 0
        for n, block in enumerate(blocks):
            size += len(block)
            if size >= CHUNK:
                taken, self._blocks = blocks[:n + 1], blocks[n + 1:]
                return taken
        self._blocks = []
        return blocks

    def close(self) -> None:
        """Back in the hub after the thread returned: wait for the queue
        to be sent, then end the response (``writer.fail()`` if the
        application failed).  Raises a ZcLbError the hub met sending."""
        try:
            while self._sending:
                sent = self._sent
                if sent is None or sent.is_set():  # (its start is on its way)
                    gevent.sleep(0)
                else:
                    sent.wait()
            error = self.error
            if isinstance(error, ZcLbError):
                raise error
            writer = self._writer
            if self._failed or error is not None:
                writer.fail()
            elif self._file is not None:
                writer.send_file(*self._file[1])
                writer.finish()
            elif self._last is not None:
                writer.finish(self._last)
        finally:
            if self._file is not None:
                self._file[0].close()


def read_line(view: Callable[[], Tuple[bytes, int]], fill: Callable[[], bool],
              take: Callable[[int], bytes], size: Optional[int] = -1) -> bytes:
    """A body's next line, at most ``size`` bytes (any, if negative or
    None), from a reader's buffer: ``view()`` the buffer and the position
    in it, ``fill()`` more (False at the end), ``take(n)`` the next ``n``
    bytes buffered.  Each chunk searched once and taken as it is, the
    pieces joined once: a long line grown chunk by chunk was copied and
    searched whole with each one (seconds for a line of some megabytes).
    (``ThreadInput``'s and ``wsgi.RequestInput``'s.)"""
    limit = -1 if size is None else size
    pieces: List[bytes] = []
    got = 0
    while limit < 0 or got < limit:
        buffer, pos = view()
        if pos == len(buffer):
            if not fill():
                break
            buffer, pos = view()
        n = (buffer.find(b"\n", pos) + 1 or len(buffer)) - pos
        piece = take(n if limit < 0 else min(n, limit - got))
        pieces.append(piece)
        got += len(piece)
        if piece[-1:] == b"\n":
            break
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


class ThreadInput:
    """``wsgi.input`` for an application in a pool thread.

    Its first read starts a pump in the hub, which takes the body as it
    comes (``source.read1``) and hands it over to the thread, staying up
    to READ_AHEAD bytes ahead of what the thread has read; the thread
    waits only when it has read all that came, and is woken once GATHER
    bytes came, or the end, or LINGER seconds after the first of them
    (a timer in the hub).  Errors the pump meets
    (the LB went away) are raised in the thread's next read past what it
    holds."""

    __slots__ = ("_hub", "_source", "thread", "_lock", "_arrived", "_chunks", "_held",
                 "_ended", "_error", "_started", "_room", "_pumping", "_buffer", "_pos")

    def __init__(self, hub: Any, source: Any) -> None:
        self._hub = hub
        self._source = source
        self.thread: Any = None  # the pool's record of the reading thread
        # (Made by the first read: most requests read no body.)
        self._lock: Any = None
        self._arrived: Any = None  # a Condition on the lock: the thread waits on it
        self._chunks: Deque[bytes] = _NO_CHUNKS  # handed over, not yet taken
        self._held = 0  # bytes in _chunks
        self._ended = False  # the pump handed over all there is (or failed)
        self._error: Optional[BaseException] = None
        self._started = False
        self._room: Optional[Any] = None  # (hub) the pump waits for the thread to read
        self._pumping: Optional[Any] = None  # (hub) the pump's greenlet
        self._buffer = b""  # the chunk the thread reads from
        self._pos = 0

    # -- in the hub -------------------------------------------------------

    def _pump(self) -> None:
        read1, room = self._source.read1, gevent.event.Event()
        lock, arrived = self._lock, self._arrived
        late = self._hub.loop.timer(LINGER)  # (wakes a waiting thread for less than GATHER)

        def wake() -> None:
            with lock:
                arrived.notify()

        self._room, self._pumping = room, gevent.getcurrent()
        try:
            while True:
                data = read1(PIECE)
                with lock:
                    if data:
                        self._chunks.append(data)
                        self._held += len(data)
                    else:
                        self._ended = True
                    full = self._held >= READ_AHEAD
                    if full:
                        room.clear()
                    if not data or self._held >= GATHER:
                        late.stop()
                        arrived.notify()
                    elif not late.active:
                        late.start(wake)
                if not data:
                    return
                if full:
                    room.wait()
        except BaseException as exc:  # (the thread raises it)
            if isinstance(exc, gevent.GreenletExit):  # stopped: the request is over
                exc = CancelledHere("the request ended before its body was read")
            with lock:
                self._error, self._ended = exc, True
                arrived.notify()
        finally:
            late.close()

    def stop(self) -> None:
        """The request is over: end the pump, if the app left some of
        the body unread."""
        pumping = self._pumping
        if pumping is not None and not pumping.dead:
            pumping.kill(block=False)

    # -- in the pool thread -----------------------------------------------

    def _fill(self) -> bool:
        """Take the next chunk that came, waiting for one if need be;
        False at the body's end."""
        if not self._started:  # (before the hub can see any of it)
            self._started = True
            self._lock = threading.Lock()
            self._arrived = threading.Condition(self._lock)
            self._chunks = collections.deque()
            self._hub.loop.run_callback_threadsafe(gevent.spawn, self._pump)
        with self._lock:
            if not self._chunks and not self._ended:
                thread = self.thread
                began = _in_hub(thread)
                try:
                    while not self._chunks and not self._ended:
                        self._arrived.wait()
                finally:
                    _out_of_hub(thread, began)
            if not self._chunks:
                if self._error is not None:
                    raise self._error
                return False
            data = self._chunks.popleft()
            held = self._held
            self._held = held - len(data)
            room = self._room if held >= READ_AHEAD > self._held else None
        if room is not None:  # (the pump waits for room: there is some now)
            self._hub.loop.run_callback_threadsafe(room.set)
        if self._pos < len(self._buffer):
            data = self._buffer[self._pos:] + data
        self._buffer, self._pos = data, 0
        return True

    def _take(self, n: int) -> bytes:
        buffer, pos = self._buffer, self._pos
        data = buffer if pos == 0 and n >= len(buffer) else buffer[pos:pos + n]
        self._pos = min(pos + n, len(buffer))
        return data

    def read(self, size: Optional[int] = -1) -> bytes:
        pos = self._pos
        if size is not None and 0 <= size <= len(self._buffer) - pos:
            # (Most reads: what is here already.  This module is not
            # compiled, so the common case is as few steps as it can be.)
            self._pos = end = pos + size
            return self._buffer[pos:end]
        if size is None or size < 0:
            pieces = []
            while self._pos < len(self._buffer) or self._fill():
                pieces.append(self._take(len(self._buffer)))
            return b"".join(pieces)
        pieces, wanted = [], size
        while wanted > 0:
            if self._pos == len(self._buffer) and not self._fill():
                break
            piece = self._take(wanted)
            pieces.append(piece)
            wanted -= len(piece)
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def readline(self, size: Optional[int] = -1) -> bytes:
        return read_line(self._view, self._fill, self._take, size)

    def _view(self) -> Tuple[bytes, int]:
        return self._buffer, self._pos

    def readlines(self, hint: int = -1) -> List[bytes]:
        lines: List[bytes] = []
        total = 0
        for line in iter(self.readline, b""):
            lines.append(line)
            total += len(line)
            if 0 < hint <= total:
                break
        return lines

    def __iter__(self):
        return iter(self.readline, b"")
