"""PNG plots of a scenario's windows: one figure, a panel per metric,
a line per policy, a dashed mark where each scheduled action happened.

The x axis counts completed requests, not virtual seconds: every policy
sees the same request stream and actions fall at the same request number,
so the lines line up; a faster policy simply covers it in less time."""

from __future__ import annotations

import os
from typing import Any, Dict, List

import matplotlib

matplotlib.use("Agg")  # no display; must precede pyplot
import matplotlib.pyplot as plt  # noqa: E402

PANELS = [  # (key, title, log scale)
    ("misses_per_request", "misses per request", False),
    ("p90_ms", "latency p90 (ms)", True),
    ("throughput", "throughput (req/s)", False),
    ("overlap", "working-set overlap", False),
    ("imbalance", "load imbalance (max/mean backlog)", False),
    ("hot_worker_share", "share of workers busy with the hot site", False),
    ("hot_backlog_share", "hot site's share of outstanding requests", False),
    ("new_worker_share", "share of requests served by the added worker", False),
]


def panels_for(runs: List[Dict[str, Any]]) -> List[tuple]:
    """The panels some window of some run has data for."""
    return [p for p in PANELS
            if any(p[0] in w for r in runs for w in r["windows"])]


def draw(ax, runs: List[Dict[str, Any]], key: str, title: str, log: bool) -> None:
    """One panel: ``key`` over virtual time for every policy."""
    for i, run in enumerate(runs):
        points = [(w["completed"] / 1000, w[key]) for w in run["windows"]
                  if key in w]
        if points:
            ax.plot(*zip(*points), label=run["policy"], color="C%d" % i, lw=1.2)
    for at in sorted({e["at"] for run in runs for e in run.get("events", ())}):
        ax.axvline(at / 1000, color="k", ls="--", lw=0.8, alpha=0.6)
    ax.set_xlim(left=0)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("thousand requests completed", fontsize=8)
    ax.tick_params(labelsize=8)
    if log:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)


def plot(name: str, runs: List[Dict[str, Any]], out_dir: str) -> str:
    """Write ``<out_dir>/<name>.png``; return its path."""
    panels = panels_for(runs)
    rows = (len(panels) + 1) // 2
    fig, axes = plt.subplots(rows, 2, figsize=(12, 3.3 * rows), squeeze=False)
    flat = axes.ravel()
    for ax, (key, title, log) in zip(flat, panels):
        draw(ax, runs, key, title, log)
    for ax in flat[len(panels):]:
        ax.axis("off")
    flat[0].legend(fontsize=8)
    fig.suptitle("scenario %s (dashed: scheduled actions)" % name)
    fig.tight_layout()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "%s.png" % name)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
