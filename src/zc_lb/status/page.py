"""The status page: the status document as HTML, for a person with a browser.

Served at ``/`` on the status address to clients that ask for text/html
(status.status_app).  One self-contained page, no scripts, no assets: a
summary, an inline SVG sparkline of the request rate (status.RequestHistory),
the workers with their state, counts and best-scored classes, the busiest
classes, and the recent error responses.  It reloads itself every 10 s.
"""

from __future__ import annotations

import time
from html import escape
from typing import Dict, List, Optional, Sequence, Tuple

from zc_lb.status.document import worker_state
from zc_lb.status.metrics import workers_5xx

REFRESH = 10  # seconds
TOP_SKILLS = 5
TOP_CLASSES = 20
# The pool's class -> the --policy name an operator gave.
POLICY_NAMES = {"AffinityPool": "affinity", "Pool": "published", "ClasslessPool": "classless"}


def percentile(latency: dict, share: float) -> str:
    """The bucket bound under which ``share`` of a latency histogram's
    counts fall (``<= 25 ms``), from the status document's buckets."""
    counts = latency.get("counts") or []
    total = sum(counts)
    if not total:
        return "-"
    seen = 0
    bounds = list(latency.get("buckets") or [])
    for index, count in enumerate(counts):
        seen += count
        if seen >= share * total:
            if index >= len(bounds):
                return "> %g s" % bounds[-1] if bounds else "-"
            bound = bounds[index]
            return "<= %g ms" % (bound * 1000) if bound < 1 else "<= %g s" % bound
    return "-"


def sparkline(rates: Sequence[Tuple[float, float]], width: int = 300,
              height: int = 40) -> str:
    """An inline SVG polyline of (time, rate) points, scaled to fit."""
    if len(rates) < 2:
        return ('<svg class="sparkline" width="%d" height="%d" role="img" '
                'aria-label="request rate: not enough samples yet"></svg>' % (width, height))
    values = [rate for _, rate in rates]
    top = max(values) or 1.0
    step = width / (len(values) - 1)
    points = " ".join("%.1f,%.1f" % (i * step, height - 2 - (height - 4) * v / top)
                      for i, v in enumerate(values))
    span = rates[-1][0] - rates[0][0]
    # (the scale: the top line's rate and the span the line covers)
    return ('<svg class="sparkline" width="%d" height="%d" viewBox="0 0 %d %d" role="img" '
            'aria-label="request rate, peak %.1f/s"><polyline fill="none" stroke="#2a6" '
            'stroke-width="1.5" points="%s"/></svg> <span class="scale">top %.1f '
            'requests/s, the last %s</span>' % (
                width, height, width, height, top, points, top,
                "%.0f min" % (span / 60) if span >= 120 else "%.0f s" % span))


def _table(header: List[str], rows: List[List[str]], css: str) -> str:
    """A table; cells are HTML already escaped by the caller."""
    head = "".join("<th>%s</th>" % escape(h) for h in header)
    body = "".join("<tr>%s</tr>" % "".join("<td>%s</td>" % c for c in row) for row in rows)
    return '<table class="%s"><thead><tr>%s</tr></thead><tbody>%s</tbody></table>' % (
        css, head, body)


def render(doc: dict, history=None) -> str:
    """The HTML page of a status document (``history``: a RequestHistory)."""
    workers: Dict[str, dict] = doc.get("workers", {})
    rates = history.rates() if history is not None else []
    return "".join([
        _head(), _summary(doc), _request_rate(rates), _workers(workers),
        _busiest_classes(doc, workers), _recent_errors(doc), _processes(doc),
        '<p><a href="/status.json">status.json</a> · <a href="/metrics">metrics</a>'
        "</p></body></html>",
    ])


def _head() -> str:
    """The page's doctype, head (refresh, title, style) and heading."""
    return "".join([
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        "<meta http-equiv='refresh' content='%d'>" % REFRESH,
        "<title>zc-lb status</title><style>",
        "body{font-family:sans-serif;margin:1em 2em}table{border-collapse:collapse;"
        "margin-bottom:1.5em}td,th{border:1px solid #ccc;padding:2px 8px;text-align:left;"
        "vertical-align:top}th{background:#eee}.down,.ejected{color:#b00}"
        ".draining,.drained,.idle{color:#a60}dl.summary{display:flex;flex-wrap:wrap;gap:0 2em}"
        "dl.summary div{display:flex;gap:.4em}svg.sparkline{border-bottom:1px solid #ccc}dt{font-weight:bold}dd{margin:0}",
        "</style></head><body><h1>zc-lb status</h1>",
    ])


def _p50_p99(latency: Optional[dict]) -> str:
    """A latency histogram's median and 99th percentile, as bucket bounds."""
    if not latency or not any(latency.get("counts") or ()):
        return "-"
    return "%s / %s" % (percentile(latency, 0.5).lstrip("<= "),
                        percentile(latency, 0.99).lstrip("<= "))


def _summary(doc: dict) -> str:
    """The summary list: the document's counters and the pool's settings."""
    pool = doc.get("pool", {})
    app_errors = workers_5xx(doc)
    latency = doc.get("latency") or {}
    summary = [
        ("requests", doc.get("requests")), ("in flight", doc.get("in_flight")),
        ("retries", doc.get("retries")), ("clients", doc.get("clients")),
        ("errors", ", ".join("%s: %s" % item for item in sorted(doc.get("errors", {}).items()))
         or "none"),
        ("app 5xx", app_errors),
        ("latency p50", percentile(latency, 0.5)), ("latency p99", percentile(latency, 0.99)),
        ("policy", POLICY_NAMES.get(pool.get("policy"), pool.get("policy"))),
        ("version", doc.get("version") or "-"), ("build", doc.get("build") or "-"),
        ("listening on", ", ".join(doc.get("listen") or ()) or "-"),
        ("variance", pool.get("variance")),
        ("backlog", pool.get("backlog")), ("mean backlog", pool.get("mean_backlog")),
        ("uptime", "%ss" % doc["uptime"] if doc.get("uptime") is not None else "-"),
    ]
    return '<dl class="summary">%s</dl>' % "".join(
        '<div><dt>%s</dt><dd id="%s">%s</dd></div>' % (
            escape(name), escape(name.replace(" ", "-")), escape(str(value)))
        for name, value in summary)


def _request_rate(rates: Sequence[Tuple[float, float]]) -> str:
    """The request rate section: the sparkline and the latest rate."""
    rate = rates[-1][1] if rates else None
    return '<h2>Request rate</h2><p id="rate">%s %s</p>' % (
        sparkline(rates), "" if rate is None else escape("%.1f requests/s now" % rate))


def _workers(workers: Dict[str, dict]) -> str:
    """The workers section: a row per worker with its state, counts and best classes."""
    rows = []
    for address, info in sorted(workers.items()):
        counts = info.get("counts", {})
        skills = info.get("skills") or {}
        top = sorted(skills.items(), key=lambda item: -item[1])[:TOP_SKILLS]
        state = worker_state(info)
        shown = state
        if info.get("ejected"):  # why, and how long still
            shown = "ejected, %ss more: %s" % (info.get("ejected_for", "?"),
                                              info.get("ejected_because") or "failures")
        rows.append([
            '<span class="address">%s</span>' % escape(address),
            '<span class="%s">%s</span>' % (escape(state.split()[0]), escape(shown)),
            escape(str(counts.get("requests", 0))),
            escape(" ".join("%s:%s" % (code, counts[code]) for code in
                            ("1xx", "2xx", "3xx", "4xx", "5xx") if counts.get(code)) or "-"),
            escape(str(counts.get("errors", 0))),
            escape(_p50_p99(info.get("latency"))),
            escape(str(info.get("backlog", "-"))),
            escape(str(info.get("mean_backlog", "-"))),
            escape(str(info.get("skills_count", len(skills)))),
            escape(", ".join("%s=%.3g" % item for item in top)),
            escape(str(info.get("version") or info.get("last_error") or "")),
        ])
    return "<h2>Workers</h2>" + _table(
        ["worker", "state", "requests", "responses", "errors", "latency p50 / p99",
         "backlog", "mean backlog",
         "classes", "best classes (score, req/s)", "version / last error"], rows, "workers")


def _busiest_classes(doc: dict, workers: Dict[str, dict]) -> str:
    """The busiest classes section: each with its workers, best scored first."""
    classes = sorted(doc.get("classes", {}).items(), key=lambda item: -item[1])[:TOP_CLASSES]
    latencies = doc.get("class_latency") or {}
    rows = []
    for name, count in classes:
        skilled = sorted((info["skills"][name], address) for address, info in workers.items()
                         if name in (info.get("skills") or {}))
        rows.append([escape(name or "(no class)"), escape(str(count)),
                     escape(_p50_p99(latencies.get(name))),
                     escape(", ".join("%s=%.3g" % (address, score)
                                      for score, address in reversed(skilled)) or "-")])
    return "<h2>Busiest classes</h2>" + _table(
        ["class", "requests", "latency p50 / p99", "workers (score)"], rows, "classes")


def _recent_errors(doc: dict) -> str:
    """The recent errors section: the LB's error responses, newest first."""
    rows = [[escape(time.strftime("%H:%M:%S", time.localtime(error.get("time", 0)))),
             escape(str(error.get("status"))), escape(str(error.get("cause"))),
             escape("%s %s" % (error.get("method"), error.get("path"))
                    if error.get("method") else "(a malformed request)"),
             escape(str(error.get("message")))]
            for error in reversed(doc.get("recent_errors", []))]
    return ("<h2>Recent errors</h2><p>Error responses the LB made; the "
            "application's own 5xx are counted per worker above.</p>"
            + (_table(["time", "status", "cause", "request", "message"], rows, "errors")
               if rows else '<p class="errors">none</p>'))


def _processes(doc: dict) -> str:
    """A paragraph per LB process of a summed document (none otherwise)."""
    return "".join(
        "<p>process %s (pid %s, status %s): %s requests</p>" % tuple(
            escape(str(process.get(key))) for key in ("index", "pid", "status", "requests"))
        for process in doc.get("processes", ()))


__all__ = ["render", "sparkline"]

