"""The greenlets that serve a worker's requests (``Requests``).

Raw greenlets, not gevent's ``Greenlet``: each, once its request is
done, waits for the next one, so that handing a request over is one loop
callback rather than a new greenlet's stack and bookkeeping.  At most
``Requests.MAX_IDLE`` wait; a burst past that ends its extras.  A
request is killed (its LB cancelled it) by raising ``GreenletExit`` in
its greenlet from the hub, or, before it started, by its never running.
Nothing a request raises escapes its greenlet, whose parent is the hub:
it is logged and the greenlet serves on.
"""

from __future__ import annotations

import logging
from typing import Callable, Dict, List, Optional

import gevent  # type: ignore[import-untyped]
import gevent.event  # type: ignore[import-untyped]
import gevent.hub  # type: ignore[import-untyped]
import greenlet  # type: ignore[import-untyped]

log = logging.getLogger(__name__)


class Task:
    """One request's call in a Requests greenlet."""

    __slots__ = ("func", "args", "glet", "started", "killed", "done")

    def __init__(self, func: Callable, args: tuple, glet: greenlet.greenlet) -> None:
        self.func = func
        self.args = args
        self.glet = glet
        self.started = self.killed = self.done = False


class Requests:
    """The greenlets serving requests: raw greenlets that, once a request
    is done, wait for the next one.  A new greenlet per request cost a
    fresh Python data stack (an mmap and a munmap, and their page faults)
    and, as gevent's Greenlet in a Group, links and pool bookkeeping;
    handing a request to an idle greenlet is one loop callback.  Enough of
    ``gevent.pool.Group`` for drains, status and tests: ``len``,
    ``join``, ``kill``."""

    MAX_IDLE = 64  # idle greenlets kept; a burst past that ends its extras

    def __init__(self) -> None:
        self._hub: Optional[gevent.hub.Hub] = None  # the one requests run in, once known
        self._running: Dict[greenlet.greenlet, Task] = {}
        self._idle: List[greenlet.greenlet] = []
        self._empty = gevent.event.Event()
        self._empty.set()

    def __len__(self) -> int:
        return len(self._running)

    def __bool__(self) -> bool:
        return bool(self._running)

    def spawn(self, func: Callable, *args) -> Task:
        """Run ``func(*args)`` in a greenlet, from the next loop turn."""
        hub = self._hub or gevent.get_hub()
        self._hub = hub
        glet = self._idle.pop() if self._idle else greenlet.greenlet(self._serve, hub)
        task = Task(func, args, glet)
        self._running[glet] = task
        self._empty.clear()
        hub.loop.run_callback(glet.switch, task)
        return task

    def _serve(self, task: Task) -> None:
        current = greenlet.getcurrent()
        hub = current.parent
        running, idle = self._running, self._idle
        while True:
            task.started = True
            try:
                if not task.killed:
                    task.func(*task.args)
            except gevent.GreenletExit:
                pass
            except BaseException:  # its parent is the hub: nothing may escape
                log.exception("request greenlet failed")
            finally:
                task.done = True
                # Its arguments (the exchange, whose on_cancel holds the
                # task) go now: a cycle left per request for the garbage
                # collector was most of what it collected.
                task.args = ()
                if running.get(current) is task:
                    del running[current]
                if not running:
                    self._empty.set()
            task = None  # type: ignore[assignment]  # not kept alive while idle
            if len(idle) >= self.MAX_IDLE:
                return
            idle.append(current)
            task = hub.switch()  # the next request, from spawn()

    def kill_one(self, task: Task) -> None:
        """Raise GreenletExit in ``task``'s greenlet, from the hub (or, if
        it has not started, make it return as soon as it does)."""
        if task.done:
            return
        if not task.started:
            task.killed = True
            return
        gevent.get_hub().loop.run_callback(self._throw, task)

    def _throw(self, task: Task) -> None:
        if task.started and not task.done:
            task.glet.throw(gevent.GreenletExit)

    def kill(self, block: bool = True, timeout: Optional[float] = None) -> None:
        for task in list(self._running.values()):
            self.kill_one(task)
        if block:
            self.join(timeout)

    def join(self, timeout: Optional[float] = None) -> bool:
        return self._empty.wait(timeout)
