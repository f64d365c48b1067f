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
samples with any backlog.  The hot-class figures (sampled) are the share
of live workers with a request of the hot class outstanding, and the hot
class's share of all outstanding requests.
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

    def __init__(self, start: float) -> None:
        self.start = start
        self.latencies: List[float] = []
        self.misses = 0
        self.imbalance: List[float] = []
        self.hot_workers: List[float] = []
        self.hot_backlog: List[float] = []

    def stats(self, end: float) -> Dict[str, float]:
        """This series' figures, ending at virtual time ``end``."""
        n = len(self.latencies)
        result = {"requests": n,
                  "throughput": n / (end - self.start) if end > self.start else 0.0,
                  "misses_per_request": self.misses / n if n else 0.0,
                  "imbalance": mean(self.imbalance)}
        result.update(latency_stats(self.latencies))
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
        self.summary: Optional[Series] = None
        self.windows: List[Dict[str, float]] = []
        self.overlaps: List[float] = []

    def request(self, now: float, latency: float, misses: int) -> None:
        """A request completed at ``now``."""
        self.completed += 1
        for series in (self.window, self.summary):
            if series is not None:
                series.latencies.append(latency)
                series.misses += misses
        if self.completed == self.warmup:
            self.summary = Series(now)
        if len(self.window.latencies) >= self.window_size:
            self.close_window(now)

    def sample(self, imbalance: Optional[float], hot_workers: Optional[float],
               hot_backlog: Optional[float]) -> None:
        """A snapshot of backlogs (None: nothing to say)."""
        for series in (self.window, self.summary):
            if series is None:
                continue
            if imbalance is not None:
                series.imbalance.append(imbalance)
            if hot_workers is not None:
                series.hot_workers.append(hot_workers)
                series.hot_backlog.append(hot_backlog)

    def close_window(self, now: float) -> None:
        """End the current window at ``now`` and start the next."""
        stats = self.window.stats(now)
        stats["time"] = now
        stats["overlap"] = self.holders.overlap()
        if self.summary is not None:
            self.overlaps.append(stats["overlap"])
        self.windows.append(stats)
        self.window = Series(now)

    def finish(self, now: float) -> Dict[str, float]:
        """Close the last window; return the summary."""
        if self.window.latencies:
            self.close_window(now)
        series = self.summary or Series(0.0)
        result = series.stats(now)
        result["overlap"] = mean(self.overlaps) or self.holders.overlap()
        return result
