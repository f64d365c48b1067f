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
request was running and where it is stuck (the loop thread's innermost
frame), and, when the loop moves again, how long it was stuck.  Thread
mode (the default) needs none of this: the application runs in a thread
pool and the loop stays free.

A stamp grows old too when the whole process stands still (SIGSTOP, a
suspended virtual machine, a machine starved of CPU): then the checking
thread's own sleep ends as late, and the process spent no CPU
meanwhile (an application that blocks the loop in C, holding the GIL,
makes the thread's sleep late too, but burns CPU).  The watch then says
the process was stopped, and counts a stall of the loop from when it
runs again, blaming no application for time nothing ran.

The running request is found when a stall is seen, not tracked on every
switch: of the greenlets serving requests, the running one is the one
alive with no saved frame (``gr_frame`` is None only while a greenlet
runs).  A ``greenlet.settrace`` hook did this before, at the cost of a
Python call on every greenlet switch of every request.

Weak spots: the checking thread reads the loop's greenlets without a
lock (a stalled loop does not change them); when gevent's own code is
stuck, no request is named.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Dict, Optional

import gevent  # type: ignore[import-untyped]
import greenlet  # type: ignore[import-untyped]
from gevent.monkey import get_original  # type: ignore[import-untyped]

log = logging.getLogger(__name__)

_start_thread = get_original("_thread", "start_new_thread")
_sleep = get_original("time", "sleep")
_thread_id = get_original("_thread", "get_ident")  # the OS thread's, even when patched


class LoopWatch:
    """Logs stalls of the event loop longer than ``threshold`` seconds."""

    def __init__(self, threshold: float = 1.0, interval: float = 0.1) -> None:
        self.threshold = threshold
        self.interval = interval
        self.stamp = time.monotonic()
        self.requests: Dict[greenlet.greenlet, str] = {}  # greenlet -> what it serves
        self.stalls = 0
        self.pauses = 0  # times the whole process was seen stopped
        self.stopped = False
        self._loop_thread: Optional[int] = None

    def start(self) -> None:
        self._loop_thread = _thread_id()
        gevent.spawn(self._stamp)
        _start_thread(self._watch, ())

    def stop(self) -> None:
        self.stopped = True

    def serving(self, what: str) -> None:
        """The current greenlet serves ``what`` (e.g. "GET /path")."""
        self.requests[gevent.getcurrent()] = what

    def done(self) -> None:
        self.requests.pop(gevent.getcurrent(), None)

    def running(self) -> str:
        """What the loop's thread runs now: the request, and where."""
        what = "no request (gevent or the app's own greenlet)"
        for serving, request in list(self.requests.items()):
            if serving and not serving.dead and serving.gr_frame is None:
                what = request
                break
        frame = sys._current_frames().get(self._loop_thread)  # type: ignore[arg-type]
        if frame is not None:
            what += " at %s:%d in %s" % (os.path.basename(frame.f_code.co_filename),
                                         frame.f_lineno, frame.f_code.co_name)
        return what

    def _stamp(self) -> None:
        while not self.stopped:
            self.stamp = time.monotonic()
            gevent.sleep(self.interval)

    def paused(self, late: float, cpu: float) -> bool:
        """Whether the whole process stood still, not just its loop: this
        thread's sleep ended ``late`` seconds late, past ``threshold``,
        and the process spent less than half of that on the CPU meanwhile
        (``cpu`` seconds)."""
        return late > self.threshold and cpu < late / 2

    def _watch(self) -> None:
        stuck_since = None
        resumed = 0.0  # (when the process last ran again after a stop)
        last, cpu = time.monotonic(), time.process_time()
        while not self.stopped:
            _sleep(self.interval)
            now, cpu_now = time.monotonic(), time.process_time()
            late = now - last - self.interval
            if self.paused(late, cpu_now - cpu):
                self.pauses += 1
                resumed = now
                log.warning("this process was stopped for %.1fs (SIGSTOP, a suspended "
                            "machine, or no CPU to be had), its application with it: "
                            "keepalives stopped meanwhile", late)
            last, cpu = now, cpu_now
            age = now - self.stamp
            blocked = now - max(self.stamp, resumed)  # (not the time nothing ran)
            if blocked > self.threshold and stuck_since is None:
                stuck_since = self.stamp
                self.stalls += 1
                what = self.running()
                log.error("event loop blocked for %.1fs by %s: the application blocks "
                          "(use threads, the default, for blocking code); keepalives "
                          "stop meanwhile", blocked, what)
            elif age <= self.threshold and stuck_since is not None:
                log.warning("event loop ran again after %.1fs",
                            self.stamp - stuck_since)
                stuck_since = None
