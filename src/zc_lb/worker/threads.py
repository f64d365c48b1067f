"""The threads a thread-mode worker runs its application in.

A call goes to the threads through a queue written in C, and its result
comes back to the hub through one async watcher, which wakes the hub
once for however many calls have finished since.  (gevent's ThreadPool
made a result object, an async watcher and a Python condition
variable's round per call, and woke the hub for each.)

Only the first ``limit.value`` threads take calls; the others are
parked, each on a lock of its own.  worker/concurrency.py says how many, from
what the pool samples every ``SAMPLE`` seconds: which of its threads
running a call are blocked outside the interpreter (the kernel's
``/proc/thread-self/syscall``, and for a lock wait, whether the thread
got CPU time lately: ``/proc/thread-self/schedstat``).  A thread past
the limit parks after the call it has (or, waiting for one when the
limit fell, gives the call it gets back to the queue); one let in again
is woken at once.  Calls wait in the queue, not in the threads, and a
thread that finishes one takes the next without the hub.

Each thread keeps those two files open: a pool whose files would take
more than ``FILES_SHARE`` of the descriptors the process may open
(``ulimit -n``) would leave too few for the LBs' connections and the
application's own (at 1,024, 600 threads took them all and the worker
could accept no LB), so such a pool does not adapt: all its threads take
calls, and the log says why.

A pool whose calls wait while none has finished for ``HUNG`` seconds
(every thread let in runs one: an application deadlocked, or waiting on
something that does not answer) says so in the log once, with what its
threads run and for how long, and again when calls finish.  Its status
has the threads running a call (``busy``, a call whose request was
cancelled too: the thread runs on) and the calls waiting for one.
"""

from __future__ import annotations

import collections
import logging
import os
import resource
import sys
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import gevent  # type: ignore[import-untyped]
import gevent.hub  # type: ignore[import-untyped]
from gevent.monkey import get_original  # type: ignore[import-untyped]

from zc_lb.worker.concurrency import (BLOCKED, COMPUTES, FUTEX, HELD, QUEUED, QUICK_TURN,
                                      RUNNING, SAMPLE, STALL, Limit, state, syscall, turns)

log = logging.getLogger(__name__)

# The real ones, even where an application patched them for gevent.
_start_thread = get_original("_thread", "start_new_thread")
_allocate_lock = get_original("_thread", "allocate_lock")
_SimpleQueue = get_original("queue", "SimpleQueue")
_get_ident = get_original("_thread", "get_ident")

FILES_SHARE = 0.5  # of the process's file descriptors, at most, for the threads' /proc files
HUNG = 10.0  # seconds calls wait and none finished: the log says what the threads run
WATCH = 1.0  # seconds between looks for that, while calls run

# Every pool's threads, by ident (a thread is in one pool): ``current``,
# and threadio marks its thread as waiting on the hub (``in_hub``).
_records: Dict[int, "_Thread"] = {}


class _Thread:
    """What the pool knows of one of its threads."""

    __slots__ = ("gate", "busy", "syscall", "schedstat", "cpu", "cpu_at", "futex",
                 "in_hub", "held", "queued", "queued_until", "started", "environ")

    def __init__(self) -> None:
        self.gate = _allocate_lock()  # held while the thread may run: it parks on it
        self.gate.acquire()
        self.busy = False  # running a call
        self.syscall: Optional[int] = None  # its /proc files, opened by the thread
        self.schedstat: Optional[int] = None
        self.cpu = b""  # its CPU time when last sampled, and when that changed
        self.cpu_at = 0.0
        self.futex = False  # in a lock wait when last sampled
        self.in_hub = False  # waiting for the hub (threadio): on the LB, not the app
        self.held = 0.0  # seconds of its call it was in_hub
        self.queued = 0.0  # seconds of its call seen queued on a lock (worker/concurrency.py)
        self.queued_until = 0.0  # (monotonic) how far ``queued`` counts: its call's start at first
        self.started = 0.0  # (monotonic) when its call started
        self.environ: Optional[Mapping[str, Any]] = None  # its call's request's, for the log


class Threads:
    """``size`` threads, of which ``limit.value`` take calls."""

    def __init__(self, size: int, fixed: bool = False) -> None:
        self._hub = gevent.get_hub()
        self._calls = _SimpleQueue()
        self._results: collections.deque = collections.deque()
        self._wake = self._hub.loop.async_()
        self._wake.start(self._deliver)
        self._wake.ref = False  # (it keeps the loop alive only while calls run)
        self._in_pool = 0  # calls given and not yet handed back
        self._finished = time.monotonic()  # when a call last finished
        self.size = size
        self.limit = Limit(size)
        self._active = size  # threads numbered below this take calls
        self._threads = [_Thread() for _ in range(size)]
        self._futex = FUTEX.get(os.uname().machine)
        self._sampler = None  # (started by a call, stopped when the pool is idle)
        self._blind: Optional[OSError] = None  # a thread could not open its states
        self._watch = self._hub.loop.timer(WATCH, WATCH)  # (looks for a pool stuck: HUNG)
        self._watch.ref = False
        self._hung = False  # said so, until a call finishes
        gil = getattr(sys, "_is_gil_enabled", lambda: True)()  # (False: free-threaded)
        if (not fixed and gil and self._futex is not None
                and os.path.exists("/proc/thread-self/syscall") and self._files_fit(size)):
            self._sampler = self._hub.loop.timer(SAMPLE, SAMPLE)
            self._sampler.ref = False
        for index in range(size):
            _start_thread(self._run, (index,))

    @staticmethod
    def _files_fit(size: int) -> bool:
        """Whether ``size`` threads' /proc files (two a thread) leave the
        process enough file descriptors; if not, log why the pool does
        not adapt."""
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft == resource.RLIM_INFINITY or 2 * size <= soft * FILES_SHARE:
            return True
        log.warning("%d threads would keep %d of the %d file descriptors this process may "
                    "open (ulimit -n) to see which are blocked, two a thread: all %d take "
                    "requests, as with --threads-fixed; raise the limit to %d or more for "
                    "the worker to adapt how many do", size, 2 * size, soft, size,
                    int(2 * size / FILES_SHARE))
        return False

    def apply(self, func: Callable[[], Any],
              environ: Optional[Mapping[str, Any]] = None) -> Any:
        """``func()``, run in one of the threads (from a greenlet of the
        hub's); what it raises is raised here.  ``environ``: its
        request's, named in the log should the pool hang (``running``)."""
        waiter = gevent.hub.Waiter(self._hub)
        self._calls.put((func, waiter, environ))
        self._in_pool += 1
        if self._in_pool == 1:
            self._wake.ref = True
            self._finished = time.monotonic()  # (an idle pool has not stalled)
            if not self._watch.active:
                self._watch.start(self._look)
            if self._sampler is not None and not self._sampler.active:
                self._sampler.start(self._sample)
        return waiter.get()

    def current(self) -> Optional[_Thread]:
        """(In a pool thread) its record, whose ``queued`` is the seconds
        its call has been seen queued on a lock so far; None elsewhere."""
        return _records.get(_get_ident())

    def _run(self, index: int) -> None:
        calls, results, wake = self._calls, self._results, self._wake
        thread = self._threads[index]
        _records[_get_ident()] = thread
        if self._sampler is not None:
            try:
                thread.syscall = os.open("/proc/thread-self/syscall", os.O_RDONLY)
                thread.schedstat = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
            except OSError as exc:  # (the sampler gives up: see _sample)
                self._blind = exc
        while True:
            while index >= self._active:
                thread.gate.acquire()  # (parked until _let_in releases it)
            call = calls.get()
            if call is None:
                break
            if index >= self._active:  # the limit fell while this one waited
                calls.put(call)  # (for a thread let in; behind the others)
                continue
            func, waiter, thread.environ = call
            thread.started = thread.queued_until = time.monotonic()
            thread.queued = thread.held = 0.0
            thread.busy = True
            try:
                outcome = (waiter, True, func())
            except BaseException as exc:  # (raised in the waiting greenlet)
                outcome = (waiter, False, exc)
            thread.busy = False
            results.append(outcome)
            wake.send()
        _records.pop(_get_ident(), None)
        files, thread.syscall, thread.schedstat = (thread.syscall, thread.schedstat), None, None
        for fd in files:
            if fd is not None:
                os.close(fd)

    def _deliver(self) -> None:
        """(In the hub) hand each finished call's result to its greenlet."""
        results = self._results
        now = time.monotonic()
        if self._hung:
            self._hung = False
            log.warning("the application's threads finish requests again, after %.0f s",
                        now - self._finished)
        self._finished = now  # (for the limit: no stall)
        while results:
            waiter, ok, value = results.popleft()
            self._in_pool -= 1
            if not self._in_pool:
                self._wake.ref = False
            if ok:
                waiter.switch(value)
            else:
                waiter.throw(value)

    def running(self, most: int = 5) -> List[str]:
        """What the threads run, the longest first ("GET /path for 12 s"),
        at most ``most`` of them."""
        now = time.monotonic()
        busy = sorted(((thread.started, thread.environ) for thread in self._threads
                       if thread.busy), key=lambda item: item[0])
        return ["%s for %.0f s" % ("a call" if environ is None else "%s %s" % (
            environ.get("REQUEST_METHOD"), environ.get("PATH_INFO")), now - started)
                for started, environ in busy[:most]]

    def _look(self) -> None:
        """(A timer in the hub, every WATCH while calls run) say once when
        calls wait and none has finished for HUNG seconds."""
        if not self._in_pool:
            self._watch.stop()
            return
        waiting = self._calls.qsize()
        stuck = time.monotonic() - self._finished
        if self._hung or not waiting or stuck < HUNG:
            return
        self._hung = True
        busy = sum(thread.busy for thread in self._threads)
        log.warning("no request has finished for %.0f s and %d wait for a thread; %d "
                    "threads run one (%s): is the application stuck?",
                    stuck, waiting, busy, ", ".join(self.running()))

    # -- the limit ------------------------------------------------------

    def _sample(self) -> None:
        """(A timer in the hub) count the threads blocked outside the
        interpreter, and let in or park threads as the limit says."""
        if not self._in_pool and self._blind is None:
            self._sampler.stop()  # type: ignore[union-attr]  # (idle: no wakeups)
            return
        now = time.monotonic()
        try:
            counts, queued = self._states(now)
        except OSError as exc:
            log.warning("cannot read the threads' states (%s); all of them take "
                        "requests", exc)
            self._sampler.stop()  # type: ignore[union-attr]
            self._sampler = None
            self._let_in(self.size)
            return
        working = counts[COMPUTES] + counts[BLOCKED]
        if working:  # queued behind the others: their wait is not the app's time
            for thread in queued:
                since = max(thread.cpu_at, thread.queued_until)  # (from its call's start)
                thread.queued += now - since
                thread.queued_until = now
            blocked, waits = counts[BLOCKED], counts[QUEUED]
        else:  # a lock wait beside no other request: on the process's own I/O
            blocked, waits = counts[BLOCKED] + counts[QUEUED], 0
        held = counts[HELD]  # (let in on top: see worker/concurrency.py)
        stuck = sum(thread.busy and now - thread.started >= STALL
                    for thread in self._threads) - held
        self._let_in(self.limit.update(blocked, self._calls.qsize() > 0,
                                       now - self._finished, waits, working, stuck, held))

    def _states(self, now: float) -> Tuple[List[int], List[_Thread]]:
        """The threads running calls, counted by state (COMPUTES, BLOCKED,
        QUEUED, HELD), and those queued (hung too: behind the others, if
        they are, for as long as they were seen so); OSError if their
        states cannot be read."""
        busy = [thread for thread in self._threads
                if thread.busy and thread.schedstat is not None]
        counts = [0, 0, 0, 0]  # COMPUTES, BLOCKED, QUEUED, HELD
        queued = []
        if self._blind is not None:
            raise self._blind
        futex = self._futex
        assert futex is not None  # (sampling needs it)
        seen = [self._seen(thread, now) for thread in busy]
        # A lock wait is a turn at the interpreter lock while another
        # thread computes; while none does, a wait without CPU time
        # for two samples is on something else.
        turn = (turns(len(busy), sys.getswitchinterval())
                if any(call == RUNNING for call, _ in seen) else QUICK_TURN)
        for thread, (call, since_cpu) in zip(busy, seen):
            kind = BLOCKED if thread.in_hub else state(call, futex, since_cpu, turn)
            counts[kind] += 1
            if kind == QUEUED or kind == HELD:
                queued.append(thread)
        return counts, queued

    def _seen(self, thread: _Thread, now: float) -> Tuple[Optional[int], float]:
        """The system call ``thread`` is in, and, in a lock wait, the
        seconds since it last got CPU time (since the wait began, at most)."""
        call = syscall(os.pread(thread.syscall, 32, 0))  # type: ignore[arg-type]
        if call != self._futex:
            thread.futex = False
            return call, 0.0
        cpu = os.pread(thread.schedstat, 64, 0).split(b" ", 1)[0]  # type: ignore[arg-type]
        if cpu != thread.cpu or not thread.futex:  # (a new wait: not since before it)
            thread.cpu, thread.cpu_at = cpu, now
        thread.futex = True
        return call, now - thread.cpu_at

    def _let_in(self, active: int) -> None:
        """Let the first ``active`` threads take calls: those past it park
        after their call; those let in again are woken."""
        # (``_active`` first: a thread woken reads it at once, and with the
        # old value would park again on the gate it was just let through)
        before, self._active = self._active, active
        for thread in self._threads[before:active]:
            if thread.gate.locked():  # (only the hub releases, so this is no race)
                thread.gate.release()

    def stop(self) -> None:
        """End the threads once they are done with what they run."""
        if self._sampler is not None:
            self._sampler.stop()
        self._watch.stop()
        self._let_in(self.size)
        for _ in range(self.size):
            self._calls.put(None)
        self._wake.stop()

    def status(self) -> dict:
        """The pool's size, and how many of its threads take requests now."""
        return {"size": self.size, "taking_requests": self._active,
                "busy": sum(thread.busy for thread in self._threads),
                "waiting": self._calls.qsize(),
                "blocked": round(self.limit.blocked, 2), "stalls": self.limit.stalls,
                "hung": self.limit.held,
                "ceiling": self.limit.ceiling, "adapts": self._sampler is not None}
