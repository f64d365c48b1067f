"""A site's classifier on the LB's event loop, timed, and moved off it if it blocks.

A classifier (or affinity-key function) runs for every request in the
LB's one event loop, so it must not block: a 20 ms one cut an LB from
about 1,560 requests per second to 69, and a 6 s one stopped every
worker connection's keepalive.  Calling every classifier in a thread
would cost each request some 65 microseconds of the LB's CPU, so a
``Guarded`` function runs inline and is timed (two clock reads).  The
first call that takes longer than ``slow`` seconds is logged once, with
the function's name, and from then on the function runs in a pool of
``threads`` threads: the loop stays free, and a function that waits on
I/O serves ``threads`` requests at once.  What it costs shows in the
status document (``classifier``).  There a request waits at most
``wait`` seconds for its answer (a thread to be free, then the call),
then raises TimeoutError, and the LB routes it without a class: a
function that hangs (a lookup with no timeout of its own) takes its
threads, not every request.

A fast function can read slow once (the process preempted on a busy
machine, a collection of the garbage, a first call's imports), so the
threads are not for life: after ``back_after`` calls in a row under
``slow`` there, the function runs inline again, and each time it
proves slow anew the next return waits twice as many calls.  A
function that blocks now and then stalls the loop less and less
often; one that never blocks again costs no thread's toll for good.

The first slow call has blocked the loop already; the connections'
keepalives allow for that (a loop stall on our side is not the peer's
silence, and workers give an LB a minute).  The built-in classifiers
(``host``, ``re:``, ``path``) never block and are not wrapped.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Mapping, Optional

import gevent  # type: ignore[import-untyped]

log = logging.getLogger(__name__)

SLOW = 0.005  # seconds: a call longer than this blocked the loop
THREADS = 8
WAIT = 1.0  # seconds a request waits for an answer from the threads
BACK_AFTER = 1000  # calls in a row under SLOW in the threads, then inline again (doubling)


def describe(func: Callable) -> str:
    """``module:qualname`` of a function, for a log line."""
    module = getattr(func, "__module__", None) or "?"
    name = getattr(func, "__qualname__", None) or type(func).__name__
    return "%s:%s" % (module, name)


class Guarded:
    """``func`` called inline and timed; in a thread pool once it was
    slow, until it proves fast there."""

    def __init__(self, func: Callable, what: str = "classifier", slow: float = SLOW,
                 threads: int = THREADS, wait: float = WAIT,
                 back_after: int = BACK_AFTER) -> None:
        self.func = func
        self.what = what
        self.name = describe(func)
        self.slow = slow
        self.threads = threads
        self.wait = wait
        self.pool: Any = None  # a gevent ThreadPool, once ``func`` proved slow
        self.threaded = False  # calls go to ``pool`` (else: inline)
        self.back_after = back_after  # fast calls in the threads, then inline again
        self.fast_calls = 0  # in a row, in the threads
        self.moved_back = 0  # times it went back inline
        self.slow_calls = 0
        self.slowest = 0.0

    def __call__(self, environ: Mapping[str, object]) -> Optional[str]:
        if not self.threaded:
            return self._timed(environ)
        timeout = gevent.Timeout.start_new(self.wait)
        try:
            return self.pool.apply(self._timed, (environ,))
        except gevent.Timeout as exc:
            if exc is not timeout:
                raise
            raise TimeoutError("%s %s gave no answer in %g s" % (self.what, self.name,
                                                                 self.wait)) from None
        finally:
            timeout.close()

    def _timed(self, environ: Mapping[str, object]) -> Optional[str]:
        started = time.perf_counter()
        try:
            return self.func(environ)
        finally:
            elapsed = time.perf_counter() - started
            if elapsed > self.slow:
                self._slow_call(elapsed)
            elif self.threaded:
                self._fast_call()

    def _slow_call(self, elapsed: float) -> None:
        self.slow_calls += 1
        self.slowest = max(self.slowest, elapsed)
        self.fast_calls = 0
        if self.threaded:
            return
        self.threaded = True
        if self.pool is None:
            import gevent.threadpool  # type: ignore[import-untyped]

            self.pool = gevent.threadpool.ThreadPool(self.threads)
            log.warning("%s %s took %.0f ms, blocking the LB's event loop: it runs in "
                        "%d threads from now on, until it proves fast (a %s must not "
                        "block; see docs/reference/failures.rst)", self.what, self.name,
                        elapsed * 1000, self.threads, self.what)
        else:
            self.back_after *= 2
            log.info("%s %s took %.0f ms on the event loop again: back in its threads "
                     "(%d calls under %.0f ms there before it returns)", self.what,
                     self.name, elapsed * 1000, self.back_after, self.slow * 1000)

    def _fast_call(self) -> None:
        self.fast_calls += 1
        if self.fast_calls >= self.back_after:
            self.threaded = False
            self.fast_calls = 0
            self.moved_back += 1
            log.info("%s %s: %d calls in a row under %.0f ms in its threads: it runs on "
                     "the event loop again", self.what, self.name, self.back_after,
                     self.slow * 1000)

    def close(self) -> None:
        """End the threads, if ``func`` was moved to them (the LB stops)."""
        if self.pool is not None:
            self.pool.kill()

    def status(self) -> dict:
        return {"name": self.name, "threaded": self.threaded, "moved_back": self.moved_back,
                "slow_calls": self.slow_calls, "slowest": round(self.slowest, 6)}
