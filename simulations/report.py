"""Results as a table on stdout and as JSON."""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, TextIO

COLUMNS = [  # (key, heading, format)
    ("throughput", "req/s", "%9.0f"),
    ("throughput_ratio", "x lb", "%6.2f"),
    ("p50_ms", "p50 ms", "%8.1f"),
    ("p90_ms", "p90 ms", "%8.1f"),
    ("p99_ms", "p99 ms", "%8.1f"),
    ("misses_per_request", "miss/req", "%8.3f"),
    ("misses_ratio", "x lb", "%6.2f"),
    ("overlap", "overlap", "%7.2f"),
    ("imbalance", "imbal", "%6.2f"),
    ("idle_beside_queue", "idle", "%6.2f"),
    ("least_share", "least", "%6.2f"),
    ("least_busy", "l.busy", "%6.2f"),
    ("hot_worker_share", "hot wk", "%6.2f"),
    ("hot_backlog_share", "hot bl", "%6.2f"),
    ("new_worker_share", "new wk", "%6.3f"),
    ("recovery_requests", "recov", "%7s"),
    ("wall_seconds", "wall s", "%6.1f"),
]
BASELINE = "least_backlog"


def add_ratios(runs: List[Dict[str, Any]]) -> None:
    """Throughput and misses of each policy relative to least backlog."""
    base = next((r["summary"] for r in runs if r["policy"] == BASELINE), None)
    if base is None:
        return
    for run in runs:
        s = run["summary"]
        if base["throughput"]:
            s["throughput_ratio"] = s["throughput"] / base["throughput"]
        if base["misses_per_request"]:
            s["misses_ratio"] = s["misses_per_request"] / base["misses_per_request"]


def table(name: str, runs: List[Dict[str, Any]], out: TextIO,
          partition: Optional[float] = None) -> None:
    """Print one row per policy, with the columns any run has, and
    ``partition``, the perfect partition's misses per request (None:
    not defined for this run)."""
    columns = [c for c in COLUMNS if any(c[0] in r["summary"] for r in runs)]
    widths = [len(fmt % 0) for _, _, fmt in columns]
    out.write("scenario %s\n" % name)
    out.write("%-14s" % "policy")
    out.write("".join(" %*s" % (w, h) for (_, h, _), w in zip(columns, widths)))
    out.write("\n")
    for run in runs:
        s = run["summary"]
        out.write("%-14s" % run["policy"])
        for (key, _, fmt), width in zip(columns, widths):
            value = s.get(key, "")
            if key == "recovery_requests":  # requests, or never
                value = "never" if value is None else value
            out.write(" " + (fmt % value if value != "" else " " * width))
        out.write("\n")
    fair = next((r["summary"]["fair_share"] for r in runs
                 if "fair_share" in r["summary"]), None)
    if any("recovery_requests" in r["summary"] for r in runs):
        out.write("(recov: requests after the first action until misses/request "
                  "are within 10% of the level before it)\n")
    if any("least_share" in r["summary"] for r in runs):
        out.write("(least, l.busy: the fewest requests a worker served, and the fewest "
                  "seconds a worker's application took, over a fair share)\n")
    if fair is not None:
        out.write("(new wk: share of requests served by the added worker; "
                  "a fair share is %.3f)\n" % fair)
    if partition is not None:
        out.write("(partition: the caches as one LRU, the same requests: %.3f misses/request"
                  % partition)
        if partition > 0:
            out.write("; each policy's misses over it: %s" % ", ".join(
                "%s %.2fx" % (r["policy"], r["summary"]["misses_per_request"] / partition)
                for r in runs))
        out.write(")\n")
    if any("by_kind" in r["summary"] for r in runs):
        kinds(runs, out)


def kinds(runs: List[Dict[str, Any]], out: TextIO) -> None:
    """A mixed fleet's table: per policy and kind of worker, its share of
    the requests, of the biggest classes' requests, and its misses."""
    names = list(next(r["summary"]["by_kind"] for r in runs if "by_kind" in r["summary"]))
    out.write("by kind of worker: share of the requests / of the top tenth of the "
              "classes' / misses per request\n")
    out.write("%-14s" % "policy" + "".join(" %20s" % name for name in names) + "\n")
    for run in runs:
        by_kind = run["summary"].get("by_kind", {})
        out.write("%-14s" % run["policy"] + "".join(
            " %20s" % ("%.2f / %.2f / %.2f" % (by_kind[name]["share"],
                                               by_kind[name]["big_class_share"],
                                               by_kind[name]["misses_per_request"])
                       if name in by_kind else "") for name in names) + "\n")


def dump(name: str, config: Dict[str, Any], runs: List[Dict[str, Any]],
         out: TextIO, partition: Optional[float] = None) -> None:
    """Everything as one JSON document (``partition_misses_per_request``:
    null where the perfect partition is not defined)."""
    json.dump({"scenario": name, "config": config, "runs": runs,
               "partition_misses_per_request": partition}, out, indent=1)
    out.write("\n")
