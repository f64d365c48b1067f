"""What a run measured: per window and in summary.

Theory of operation
-------------------

The engine calls :meth:`Recorder.request` for every completed request and
:meth:`Recorder.sample` every few issued requests (a snapshot of worker
backlogs).  Completions are grouped in windows of ``window`` requests; a
window closes with its throughput, latency percentiles, misses per
request, the working-set overlap at that moment, and the mean of the
backlog samples taken in it.  The summary covers everything after the
first ``warmup`` share of completions, so start-up (cold caches, no
skills yet) does not blur steady-state numbers; the windows show it all.

Load imbalance is max over mean backlog of the live workers, averaged over
samples with any backlog; ``idle_beside_queue`` is the share of samples in
which a worker has nothing to do while another has requests waiting (more
than its application serves at once).  The hot-class figures (sampled) are the share
of live workers with a request of the hot class outstanding, and the hot
class's share of all outstanding requests.  Once a worker has been added,
each window also has the share of its requests served by added workers.
"""

from __future__ import annotations

from typing import Dict, List, Optional


def percentile(ordered: List[float], q: float) -> float:
    """The q-quantile (0..1) of a sorted list; 0 for an empty one."""
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def latency_stats(latencies: List[float]) -> Dict[str, float]:
    """p50, p90, p99 and mean, in milliseconds."""
    ordered = sorted(latencies)
    mean = sum(ordered) / len(ordered) if ordered else 0.0
    return {"p50_ms": 1000 * percentile(ordered, 0.5),
            "p90_ms": 1000 * percentile(ordered, 0.9),
            "p99_ms": 1000 * percentile(ordered, 0.99),
            "mean_ms": 1000 * mean}


def mean(values: List[float]) -> float:
    """Arithmetic mean; 0 for nothing."""
    return sum(values) / len(values) if values else 0.0


class Series:
    """Samples of one window (or of the summary period)."""

    def __init__(self, start: float, track_new: bool = False) -> None:
        self.start = start
        self.track_new = track_new
        self.latencies: List[float] = []
        self.misses = 0
        self.imbalance: List[float] = []
        self.idle: List[float] = []
        self.hot_workers: List[float] = []
        self.hot_backlog: List[float] = []
        self.by_new = 0  # requests served by workers added during the run

    def stats(self, end: float) -> Dict[str, float]:
        """This series' figures, ending at virtual time ``end``."""
        n = len(self.latencies)
        result = {"requests": n,
                  "throughput": n / (end - self.start) if end > self.start else 0.0,
                  "misses_per_request": self.misses / n if n else 0.0,
                  "imbalance": mean(self.imbalance),
                  "idle_beside_queue": mean(self.idle)}
        result.update(latency_stats(self.latencies))
        if self.track_new:
            result["new_worker_share"] = self.by_new / n if n else 0.0
        if self.hot_workers:
            result["hot_worker_share"] = mean(self.hot_workers)
            result["hot_backlog_share"] = mean(self.hot_backlog)
        return result


class Recorder:
    """Collects windows and the summary for one policy's run."""

    def __init__(self, window: int, warmup_requests: int, holders) -> None:
        self.window_size = window
        self.warmup = warmup_requests
        self.holders = holders
        self.completed = 0
        self.window = Series(0.0)
        # (from the start with no warm-up: ``request`` starts it at a completion)
        self.summary: Optional[Series] = Series(0.0) if warmup_requests <= 0 else None
        self.windows: List[Dict[str, float]] = []
        self.overlaps: List[float] = []
        self.track_new = False

    def request(self, now: float, latency: float, misses: int,
                new: bool = False) -> None:
        """A request completed at ``now`` (``new``: on an added worker)."""
        self.completed += 1
        for series in (self.window, self.summary):
            if series is not None:
                series.latencies.append(latency)
                series.misses += misses
                series.by_new += new
        if self.completed == self.warmup:
            self.summary = Series(now)
        if len(self.window.latencies) >= self.window_size:
            self.close_window(now)

    def sample(self, imbalance: Optional[float], hot_workers: Optional[float],
               hot_backlog: Optional[float], idle: bool = False) -> None:
        """A snapshot of backlogs (None: nothing to say; ``idle``: a worker
        idle while another has requests waiting)."""
        for series in (self.window, self.summary):
            if series is None:
                continue
            series.idle.append(1.0 if idle else 0.0)
            if imbalance is not None:
                series.imbalance.append(imbalance)
            if hot_workers is not None:
                series.hot_workers.append(hot_workers)
                series.hot_backlog.append(hot_backlog)

    def close_window(self, now: float) -> None:
        """End the current window at ``now`` and start the next."""
        stats = self.window.stats(now)
        stats["time"] = now
        stats["completed"] = self.completed
        stats["overlap"] = self.holders.overlap()
        if self.summary is not None:
            self.overlaps.append(stats["overlap"])
        self.windows.append(stats)
        self.window = Series(now, self.track_new)

    def worker_added(self) -> None:
        """From the current window on, windows report the share of requests
        served by added workers."""
        self.track_new = True
        self.window.track_new = True

    def finish(self, now: float) -> Dict[str, float]:
        """Close the last window; return the summary."""
        if self.window.latencies:
            self.close_window(now)
        series = self.summary or Series(0.0)
        result = series.stats(now)
        result["overlap"] = mean(self.overlaps) or self.holders.overlap()
        return result


def recovery(windows: List[Dict[str, float]], at: int, before: int = 5,
             slack: float = 1.1) -> Optional[int]:
    """Requests after request ``at`` until misses per request are back
    within ``slack`` times their mean over the ``before`` windows that
    ended before it; None if they never are (or nothing to compare)."""
    earlier = [w["misses_per_request"] for w in windows
               if w["completed"] <= at][-before:]
    if not earlier:
        return None
    target = slack * mean(earlier)
    for window in windows:
        if window["completed"] > at and window["misses_per_request"] <= target:
            return int(window["completed"] - at)
    return None
