"""Outlier detection: eject a worker that keeps failing, as Envoy does.

Theory of operation
-------------------

The LB reports every request's outcome per worker: a success (a response
below 500) or a failure (a 5xx, or the connection failing under the
request).  ``consecutive`` failures in a row eject the worker: the LB
takes it out of its pool for an ejection time that starts at
``base_time`` and doubles with each ejection (at most ``max_time``).  When
the time is up the worker is readmitted (``readmit``) on probation: one
more failure ejects it again at once, for longer; successes bring it back
to good standing and, after ``4 * consecutive`` of them in a row, shorten
its next ejection again.  At most ``max_share`` of the workers are ejected
at once, so a bad deploy that fails everywhere degrades to errors instead
of to no workers at all.  The share is of the workers that could serve
(the caller says which: connected, neither draining nor silent), not of
all it knows: a worker down or silent serves nothing, and when one goes
the ejected ones past the share of those left come back on probation,
those whose ejection ends soonest first (``over_share``), so that the
workers down and the workers ejected never empty the pool together.

A failure the application answered (a 5xx response, with the request's
path) says less about the worker than one it could not answer: every
worker runs the same application, and a route that raises raises
everywhere.  And the affinity policy sends a path where it went before,
so a broken route's errors all land on one worker, which comparing
failure rates across workers would then take for the sick one.  So an
answered failure counts against the worker when another worker answered
the same path well since the path first failed, and has not failed it
since (the peers do not fail there: ``watched`` paths, and
``succeeded_on``), and otherwise a run of
them ejects only if its requests were for ``MIN_PATHS`` different paths:
a worker whose database connection broke fails whatever it is asked, a
broken route fails one path, everywhere.  A failure of the worker itself
(its connection, a timeout, a health check) counts as before.  Why a worker was ejected is kept
(``reason``), for the status, and an operator may readmit it at once
(``readmit_now``).  A worker ejected for failures it did not all
answer is readmitted on probation as soon as it connects anew
(``reconnected``): the process that failed is gone, and nothing else
would probe it before its ejection time is up.

Pure: no clock of its own (``now`` comes in), no I/O; keys are whatever
identifies a worker to the caller (its address).

Weak spots: a route that fails on one worker only (a file missing
there) is not ejected for; neither is an application that fails on
fewer than ``MIN_PATHS`` paths, all its requests, everywhere.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Dict, Final, Hashable, List, Optional, Set

from zc_lb.settings import LB_SETTINGS

DEFAULT_CONSECUTIVE: Final = LB_SETTINGS["eject_after"].default
DEFAULT_BASE_TIME: Final = LB_SETTINGS["eject_time"].default
DEFAULT_MAX_TIME: Final = 10 * DEFAULT_BASE_TIME  # as the command line sets it
DEFAULT_MAX_SHARE: Final = LB_SETTINGS["max_ejected"].default
MIN_PATHS: Final = 3  # paths a run of the application's own errors must span to eject
MAX_WATCHED: Final = 1024  # paths that failed lately, watched for a peer's success


class _Record:
    __slots__ = ("failures", "ejections", "until", "probation", "healthy", "paths",
                 "answered", "reason", "unanswered")

    def __init__(self) -> None:
        self.failures = 0  # in a row
        self.ejections = 0  # how often, lately: sets the next ejection's time
        self.until = 0.0  # ejected until then (0: not ejected)
        self.probation = False  # readmitted, not yet proven
        self.healthy = 0  # successes in a row
        self.paths: Set[str] = set()  # of the run's answered failures (MIN_PATHS at most)
        self.answered = True  # every failure of the run was the application's answer
        self.reason = ""  # why it was last ejected
        self.unanswered = False  # ... for failures not all answered (a reconnect ends it)


class Ejector:
    """Which workers are ejected, and until when."""

    def __init__(self, consecutive: int = DEFAULT_CONSECUTIVE,
                 base_time: float = DEFAULT_BASE_TIME, max_time: float = DEFAULT_MAX_TIME,
                 max_share: float = DEFAULT_MAX_SHARE) -> None:
        self.consecutive = consecutive
        self.base_time = base_time
        self.max_time = max_time
        self.max_share = max_share
        self.records: Dict[Hashable, _Record] = {}
        self.total_ejections = 0
        # Paths that failed lately -> the worker that last answered one well
        # since (None: none has), oldest first.
        self.watched: "OrderedDict[str, Optional[Hashable]]" = OrderedDict()

    def _record(self, key: Hashable) -> _Record:
        record = self.records.get(key)
        if record is None:
            record = self.records[key] = _Record()
        return record

    def success(self, key: Hashable) -> None:
        """A request on ``key`` succeeded."""
        record = self._record(key)
        record.failures = 0
        record.paths.clear()
        record.answered = True
        record.probation = False
        record.healthy += 1
        if record.healthy >= 4 * self.consecutive and record.ejections:
            record.ejections -= 1
            record.healthy = 0

    def failure(self, key: Hashable, now: float, workers: int,
                path: Optional[str] = None, ejected: Optional[int] = None) -> bool:
        """A request on ``key`` failed; whether that ejects it now.
        ``workers`` is how many there are, for the share cap, and
        ``ejected`` how many of them are ejected (None: every worker
        ejected here); ``path``, the request's, when the application
        answered it with a 5xx (None: the worker did not answer)."""
        record = self._record(key)
        record.failures += 1
        record.healthy = 0
        if path is not None:
            path = self._blamed_path(key, path)
        if path is None:
            record.answered = False
        elif len(record.paths) < MIN_PATHS:
            record.paths.add(path)
        if record.until or (record.failures < self.consecutive and not record.probation):
            return False
        if record.answered and len(record.paths) < MIN_PATHS:
            return False  # (the application's errors, on too few paths to blame the worker)
        if ejected is None:
            ejected = self.ejected_count()
        if ejected + 1 > self._allowed(workers):
            return False
        record.ejections += 1
        record.until = now + min(self.base_time * 2 ** (record.ejections - 1), self.max_time)
        record.reason = ("%d failed requests in a row%s" % (
            record.failures, ", answered 5xx on %d paths or more" % MIN_PATHS
            if record.answered else ", not all of them answered"))
        record.unanswered = not record.answered
        if record.probation:
            record.reason += ", on probation"
        record.failures = 0
        record.paths.clear()
        record.answered = True
        record.probation = False
        self.total_ejections += 1
        return True

    def _blamed_path(self, key: Hashable, path: str) -> Optional[str]:
        """The path of an answered failure on ``key``, watched from now on;
        None if a peer answers it well (then it is the worker's failure).
        A failure there of the peer that answered it well ends that: a
        route broken since breaks on it too."""
        watched = self.watched
        fine = watched.get(path)
        if fine is not None:
            if fine != key:
                return None
            # (the peer that answered it well fails it now: none is known to)
            watched[path] = None
        if path not in watched:
            watched[path] = None
            if len(watched) > MAX_WATCHED:
                watched.popitem(last=False)
        return path

    def succeeded_on(self, path: str, key: Hashable) -> None:
        """``key`` answered a request for ``path`` well (worth saying only
        while ``watched`` has paths)."""
        if path in self.watched:
            self.watched[path] = key

    def reconnected(self, key: Hashable) -> bool:
        """``key``'s worker connected anew (it restarted): if its ejection
        was for failures it did not answer (its connection, a timeout),
        readmit it now, on probation: the process that failed is gone.
        Whether it was readmitted."""
        record = self.records.get(key)
        if record is None or not record.until or not record.unanswered:
            return False
        record.until = 0.0
        record.probation = True
        return True

    def readmit_now(self, key: Hashable) -> bool:
        """An operator's word: ``key`` is healthy, back at once and in
        good standing; whether it was ejected."""
        record = self.records.get(key)
        if record is None or not record.until:
            return False
        record.until = 0.0
        record.probation = False
        record.failures = 0
        record.paths.clear()
        record.answered = True
        return True

    def readmit(self, now: float) -> List[Hashable]:
        """The ejected workers whose time is up, now on probation."""
        due = [key for key, record in self.records.items()
               if record.until and record.until <= now]
        for key in due:
            record = self.records[key]
            record.until = 0.0
            record.probation = True
        return due

    def ejected(self, key: Hashable) -> bool:
        record = self.records.get(key)
        return record is not None and bool(record.until)

    def ejected_count(self) -> int:
        return sum(1 for record in self.records.values() if record.until)

    def _allowed(self, workers: int) -> int:
        """How many of ``workers`` may be ejected at once."""
        return int(self.max_share * workers + 1e-9)  # (0.29 * 100 is 28.999999999999996)

    def over_share(self, present: List[Hashable]) -> List[Hashable]:
        """Of the ``present`` workers (those that could serve), the ejected
        ones past ``max_share`` of them, those whose ejection ends soonest
        first, readmitted now on probation (one more failure ejects them
        again, once the share has room)."""
        ejected = sorted((key for key in present if self.ejected(key)),
                         key=lambda key: self.records[key].until)
        back = ejected[:max(len(ejected) - self._allowed(len(present)), 0)]
        for key in back:
            record = self.records[key]
            record.until = 0.0
            record.probation = True
        return back

    def forget(self, key: Hashable) -> None:
        """The worker is gone: its record goes with it."""
        self.records.pop(key, None)

    def status(self, key: Hashable, now: float) -> dict:
        """A JSON-able picture of ``key``'s standing."""
        record = self.records.get(key)
        if record is None:
            return {"ejected": False, "consecutive_failures": 0, "ejections": 0}
        return {"ejected": bool(record.until),
                "ejected_for": round(max(record.until - now, 0.0), 1),
                "consecutive_failures": record.failures, "ejections": record.ejections,
                "probation": record.probation, "ejected_because": record.reason}
