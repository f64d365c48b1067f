"""What a replay measured: recording while it runs, the report after.

``Recorder.record`` is called once per finished request and does no
formatting: it appends a latency to two arrays (all requests and the
request's class) and bumps counters. ``Recorder.report()`` then builds a
plain dict (JSON-ready; times in seconds) and ``format_text`` renders it
for people (times in milliseconds).

Latency percentiles are nearest-rank over requests that got a response;
failed requests are counted under ``errors`` by kind, with a few
examples. ``cache`` sums the cache-model headers (``X-Cache-Hits``,
``X-Cache-Misses``) over the responses that carried them: ``misses`` are
database loads, and ``loads_per_request`` is the headline number;
``worker_loads`` splits them by the worker that answered (``X-Worker``).
"""

from __future__ import annotations

import array
import collections
import json
import math
from typing import Dict, Iterable, List, Optional

MAX_ERROR_EXAMPLES = 5


def percentiles(values: Iterable[float]) -> dict:
    """p50, p90, p99, max and mean of ``values`` (None when empty)."""
    ordered = sorted(values)
    if not ordered:
        return {"p50": None, "p90": None, "p99": None, "max": None, "mean": None}

    def rank(p: float) -> float:
        return ordered[max(0, math.ceil(p / 100.0 * len(ordered)) - 1)]

    return {"p50": rank(50), "p90": rank(90), "p99": rank(99), "max": ordered[-1],
            "mean": sum(ordered) / len(ordered)}


class _ClassStats:
    __slots__ = ("requests", "errors", "latencies", "cache_responses", "hits", "misses")

    def __init__(self) -> None:
        self.requests = self.errors = self.cache_responses = self.hits = self.misses = 0
        self.latencies = array.array("d")


class Recorder:
    """Accumulates per-request results; cheap enough for the hot path."""

    def __init__(self) -> None:
        self.sent = 0
        self.responses = 0
        self.latencies = array.array("d")
        self.status: collections.Counter = collections.Counter()
        self.errors: collections.Counter = collections.Counter()
        self.error_examples: List[str] = []
        self.classes: Dict[str, _ClassStats] = collections.defaultdict(_ClassStats)
        self.workers: collections.Counter = collections.Counter()
        self.worker_loads: collections.Counter = collections.Counter()
        self.cache_responses = self.hits = self.misses = 0
        self.late = 0
        self.max_lag = 0.0

    def __repr__(self) -> str:
        return "<Recorder %d sent, %d responses, %d errors>" % (
            self.sent, self.responses, sum(self.errors.values()))

    def record(self, cls: str, latency: float, status: int, headers: Dict[str, str]) -> None:
        """A response arrived ``latency`` seconds after the request was sent."""
        self.responses += 1
        self.latencies.append(latency)
        self.status[status] += 1
        stats = self.classes[cls]
        stats.requests += 1
        stats.latencies.append(latency)
        worker = headers.get("x-worker")
        if worker is not None:
            self.workers[worker] += 1
        missed = headers.get("x-cache-misses")
        if missed is not None:
            try:
                hits, misses = int(headers.get("x-cache-hits") or 0), int(missed)
            except ValueError:
                return
            self.cache_responses += 1
            self.hits += hits
            self.misses += misses
            if worker is not None:
                self.worker_loads[worker] += misses
            stats.cache_responses += 1
            stats.hits += hits
            stats.misses += misses

    def record_error(self, cls: str, kind: str, detail: str) -> None:
        """A request failed without a response."""
        self.errors[kind] += 1
        self.classes[cls].requests += 1
        self.classes[cls].errors += 1
        if len(self.error_examples) < MAX_ERROR_EXAMPLES:
            self.error_examples.append("%s: %s" % (kind, detail))

    def record_lag(self, lag: float) -> None:
        """Paced mode: a request left ``lag`` seconds after it was due."""
        if lag > 0.01:
            self.late += 1
        if lag > self.max_lag:
            self.max_lag = lag

    def report(self, duration: float, top: int = 10, **extra) -> dict:
        """The report as a JSON-ready dict; ``extra`` items are added as given."""
        errors = sum(self.errors.values())
        report = {
            "requests": self.sent,
            "responses": self.responses,
            "errors": errors,
            "error_kinds": dict(self.errors.most_common()),
            "error_examples": list(self.error_examples),
            "duration": duration,
            "throughput": self.responses / duration if duration > 0 else 0.0,
            "latency": percentiles(self.latencies),
            "status": {str(code): n for code, n in sorted(self.status.items())},
            "cache": self._cache(self.cache_responses, self.hits, self.misses),
            "workers": dict(self.workers.most_common()),
            "worker_loads": {worker: self.worker_loads[worker] for worker in self.workers
                             if worker in self.worker_loads},
            "classes": {"count": len(self.classes), "top": self._top(top)},
        }
        report.update(extra)
        return report

    def _top(self, top: int) -> List[dict]:
        ranked = sorted(self.classes.items(), key=lambda item: (-item[1].requests, item[0]))
        return [
            {"class": name, "requests": stats.requests, "errors": stats.errors,
             "latency": percentiles(stats.latencies),
             # over the responses that carried the cache model's headers, as the
             # report's own; None for a class whose responses said nothing of it
             "loads_per_request": (stats.misses / stats.cache_responses
                                   if stats.cache_responses else None)}
            for name, stats in ranked[:top]
        ]

    @staticmethod
    def _cache(responses: int, hits: int, misses: int) -> Optional[dict]:
        if not responses:
            return None
        return {"responses": responses, "hits": hits, "misses": misses,
                "loads_per_request": misses / responses,
                "hit_ratio": hits / (hits + misses) if hits + misses else None}


def _ms(value: Optional[float]) -> str:
    return "-" if value is None else "%.1f" % (value * 1000.0)


def _latency_line(latency: dict) -> str:
    return "p50 %s  p90 %s  p99 %s  max %s ms" % tuple(
        _ms(latency[k]) for k in ("p50", "p90", "p99", "max"))


def format_text(report: dict) -> str:
    """The report for a terminal."""
    out: List[str] = []
    add = out.append
    add("target      %s (%s, concurrency %s)" % (
        report.get("target", "?"), report.get("mode", "?"), report.get("concurrency", "?")))
    parse = report.get("parse")
    if parse:
        skipped = sum(parse["skipped_methods"].values())
        add("log         %d lines, %d entries, %d unparsable, %d skipped by method%s" % (
            parse["lines"], parse["entries"], parse["unparsable"], skipped,
            _counts(parse["skipped_methods"])))
        for example in parse["examples"]:
            add("  unparsable  " + example)
    if report.get("interrupted"):
        add("INTERRUPTED before the end")
    add("requests    %d sent, %d responses, %d errors%s" % (
        report["requests"], report["responses"], report["errors"], _counts(report["error_kinds"])))
    for example in report["error_examples"]:
        add("  error       " + example)
    add("duration    %.2f s, %.1f responses/s" % (report["duration"], report["throughput"]))
    add("latency     " + _latency_line(report["latency"]))
    add("status      " + (", ".join("%s: %d" % item for item in report["status"].items()) or "-"))
    cache = report.get("cache")
    if cache:
        add("cache       %.3f database loads/request (%d hits, %d misses over %d responses)" % (
            cache["loads_per_request"], cache["hits"], cache["misses"], cache["responses"]))
    if report.get("workers"):
        loads = report.get("worker_loads") or {}
        add("workers     " + ", ".join(
            "%s: %d%s" % (worker, n, " (%d loads)" % loads[worker] if worker in loads else "")
            for worker, n in report["workers"].items()))
    overlap = report.get("overlap")
    if overlap:
        add("overlap     %.1f%% of %d cached objects on more than one of %d workers" % (
            overlap["overlap"] * 100.0, overlap["distinct"], overlap["workers"]))
        for error in overlap.get("errors", ()):
            add("  stats error " + error)
    pacing = report.get("pacing")
    if pacing:
        add("pacing      x%g, %d late (max lag %.3f s), %d backward steps, %d clock resets" % (
            pacing["speed"], pacing["late"], pacing["max_lag"], pacing["backward_steps"],
            pacing["clock_resets"]))
    classes = report["classes"]
    add("classes     %d; top %d:" % (classes["count"], len(classes["top"])))
    for row in classes["top"]:
        loads = row["loads_per_request"]
        add("  %-32s %7d req %4d err  %s%s" % (
            row["class"][:32], row["requests"], row["errors"], _latency_line(row["latency"]),
            "" if loads is None else "  %.2f loads/req" % loads))
    return "\n".join(out)


def _counts(counts: Dict[str, int]) -> str:
    if not counts:
        return ""
    return " (" + ", ".join("%s %d" % item for item in counts.items()) + ")"


def to_json(report: dict) -> str:
    return json.dumps(report, indent=2, sort_keys=False)
