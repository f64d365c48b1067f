"""When to send each entry in paced mode: log time -> replay offset. Pure.

Theory of operation
-------------------

The replay keeps a *log clock*: the log time of the latest entry seen so
far (``high``) and how many log seconds have elapsed since the first
entry (``position``). For each entry with time ``t``:

- ``t >= high``: the clock advances by ``t - high`` (capped at ``max_gap``
  when given, so a night without traffic need not be waited out), and the
  entry is due at ``position / speed`` seconds after the start;
- ``t`` is behind ``high`` by at most ``tolerance`` seconds: the entry is
  due *now* (at the current position); the log merely wrote lines out of
  order (Apache logs a request when it ends, and some logs order by the
  minute only). Counted as a backward step, not an error;
- ``t`` is further behind: the clock is *reset* (``high = t``, position
  unchanged), as when a second file starts earlier than the first ended;
  counted;
- no time: due now.

So offsets never decrease, and a replay of several files plays them one
after the other.
"""

from __future__ import annotations

from typing import Optional


class Pacer:
    """Turns log timestamps into offsets (seconds since the replay started)."""

    def __init__(self, speed: float = 1.0, tolerance: float = 60.0, max_gap: Optional[float] = None):
        if speed <= 0:
            raise ValueError("speed must be positive")
        self.speed = speed
        self.tolerance = tolerance
        self.max_gap = max_gap
        self.high: Optional[float] = None
        self.position = 0.0
        self.backward_steps = 0
        self.resets = 0

    def __repr__(self) -> str:
        return "<Pacer x%g at %.3fs>" % (self.speed, self.position / self.speed)

    def offset(self, stamp: Optional[float]) -> float:
        """The offset at which an entry logged at ``stamp`` is due."""
        if stamp is None:
            return self.position / self.speed
        if self.high is None:
            self.high = stamp
        elif stamp >= self.high:
            step = stamp - self.high
            if self.max_gap is not None:
                step = min(step, self.max_gap)
            self.position += step
            self.high = stamp
        elif self.high - stamp <= self.tolerance:
            self.backward_steps += 1
        else:
            self.resets += 1
            self.high = stamp
        return self.position / self.speed

    def as_dict(self) -> dict:
        return {
            "speed": self.speed,
            "tolerance": self.tolerance,
            "max_gap": self.max_gap,
            "backward_steps": self.backward_steps,
            "clock_resets": self.resets,
            "log_seconds": self.position,
        }
