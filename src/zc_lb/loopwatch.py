"""Noticing a blocked event loop, and the request that blocked it.

Theory of operation
-------------------

In greenlet mode a worker runs its application in the event loop's own
thread: an application that blocks (a database driver, ``time.sleep``,
file I/O, a CPU burst) stops everything, keepalives to the LBs included,
and the LBs then declare the worker dead.  ``LoopWatch`` says so in the
log instead of leaving it to be guessed: a greenlet in the loop stamps
the time every ``interval``; an OS thread of its own checks the stamp,
and when it is older than ``threshold`` it logs, once per stall, which
request was running (tracked with ``greenlet.settrace``: the greenlet
switched to last) and, when the loop moves again, how long it was
stuck.  Thread mode (the default) needs none of this: the application
runs in a thread pool and the loop stays free.

Weak spots: the report names the request whose greenlet ran last, which
is the culprit unless the loop is stuck in gevent's own code; ``settrace``
costs a little on every greenlet switch, which is why only greenlet mode
pays it.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Dict, Optional

import gevent
import greenlet
from gevent.monkey import get_original

log = logging.getLogger(__name__)

_start_thread = get_original("_thread", "start_new_thread")
_sleep = get_original("time", "sleep")


class LoopWatch:
    """Logs stalls of the event loop longer than ``threshold`` seconds."""

    def __init__(self, threshold: float = 1.0, interval: float = 0.1) -> None:
        self.threshold = threshold
        self.interval = interval
        self.stamp = time.monotonic()
        self.running: Optional[greenlet.greenlet] = None
        self.requests: Dict[greenlet.greenlet, str] = {}  # greenlet -> what it serves
        self.stalls = 0
        self.stopped = False
        self._previous_trace: Optional[Callable] = None

    def start(self) -> None:
        self._previous_trace = greenlet.settrace(self._trace)
        gevent.spawn(self._stamp)
        _start_thread(self._watch, ())

    def stop(self) -> None:
        self.stopped = True
        greenlet.settrace(self._previous_trace)

    def serving(self, what: str) -> None:
        """The current greenlet serves ``what`` (e.g. "GET /path")."""
        self.requests[gevent.getcurrent()] = what

    def done(self) -> None:
        self.requests.pop(gevent.getcurrent(), None)

    def _trace(self, event: str, args) -> None:
        if event in ("switch", "throw"):
            self.running = args[1]
        if self._previous_trace is not None:
            self._previous_trace(event, args)

    def _stamp(self) -> None:
        while not self.stopped:
            self.stamp = time.monotonic()
            gevent.sleep(self.interval)

    def _watch(self) -> None:
        stuck_since = None
        while not self.stopped:
            _sleep(self.interval)
            age = time.monotonic() - self.stamp
            if age > self.threshold and stuck_since is None:
                stuck_since = self.stamp
                self.stalls += 1
                what = self.requests.get(self.running, "no request (gevent or the app's "
                                                       "own greenlet)")
                log.error("event loop blocked for %.1fs by %s: the application blocks "
                          "(use threads, the default, for blocking code); keepalives "
                          "stop meanwhile", age, what)
            elif age <= self.threshold and stuck_since is not None:
                log.warning("event loop ran again after %.1fs",
                            self.stamp - stuck_since)
                stuck_since = None
