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
of to no workers at all.

Pure: no clock of its own (``now`` comes in), no I/O; keys are whatever
identifies a worker to the caller (its address).

Weak spots: a worker that fails only some requests (one broken page)
fails consecutively only if that page dominates; Envoy's success-rate
ejection, which compares workers with each other, is not done here.
"""

from __future__ import annotations

from typing import Dict, Final, Hashable, List

from .settings import LB_SETTINGS

DEFAULT_CONSECUTIVE: Final = LB_SETTINGS["eject_after"].default
DEFAULT_BASE_TIME: Final = LB_SETTINGS["eject_time"].default
DEFAULT_MAX_TIME: Final = 10 * DEFAULT_BASE_TIME  # as the command line sets it
DEFAULT_MAX_SHARE: Final = LB_SETTINGS["max_ejected"].default


class _Record:
    __slots__ = ("failures", "ejections", "until", "probation", "healthy")

    def __init__(self) -> None:
        self.failures = 0  # in a row
        self.ejections = 0  # how often, lately: sets the next ejection's time
        self.until = 0.0  # ejected until then (0: not ejected)
        self.probation = False  # readmitted, not yet proven
        self.healthy = 0  # successes in a row


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

    def _record(self, key: Hashable) -> _Record:
        record = self.records.get(key)
        if record is None:
            record = self.records[key] = _Record()
        return record

    def success(self, key: Hashable) -> None:
        """A request on ``key`` succeeded."""
        record = self._record(key)
        record.failures = 0
        record.probation = False
        record.healthy += 1
        if record.healthy >= 4 * self.consecutive and record.ejections:
            record.ejections -= 1
            record.healthy = 0

    def failure(self, key: Hashable, now: float, workers: int) -> bool:
        """A request on ``key`` failed; whether that ejects it now.
        ``workers`` is how many there are, for the share cap."""
        record = self._record(key)
        record.failures += 1
        record.healthy = 0
        if record.until or (record.failures < self.consecutive and not record.probation):
            return False
        if self.ejected_count() + 1 > self.max_share * workers:
            return False
        record.ejections += 1
        record.until = now + min(self.base_time * 2 ** (record.ejections - 1), self.max_time)
        record.failures = 0
        record.probation = False
        self.total_ejections += 1
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
                "probation": record.probation}
