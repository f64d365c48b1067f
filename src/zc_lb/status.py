"""The status document: served as JSON, printed as a table.

The LB's ``--status HOST:PORT`` serves ``LB.status()`` as JSON at ``/``;
``zc-lb status HOST:PORT`` fetches it and prints it for a person.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Callable, Dict, List, Optional

from .errors import ConfigurationError


def status_app(get_status: Callable[[], dict],
               actions: Optional[Dict[str, Callable[[], None]]] = None) -> Callable:
    """A WSGI app answering every GET with the status document as JSON,
    and a POST to ``/NAME`` by running ``actions[NAME]`` (operators only:
    the status address is not for the public)."""
    actions = actions or {}

    def app(environ, start_response):
        status = "200 OK"
        if environ.get("REQUEST_METHOD") == "POST":
            action = actions.get(environ.get("PATH_INFO", "").strip("/"))
            if action is None:
                status, document = "404 Not Found", {"error": "no such action"}
            else:
                action()
                document = {"done": environ["PATH_INFO"].strip("/")}
        else:
            document = get_status()
        body = json.dumps(document, indent=2, sort_keys=True).encode() + b"\n"
        start_response(status, [("Content-Type", "application/json"),
                                ("Content-Length", str(len(body))),
                                ("Cache-Control", "no-store")])
        return [body]

    return app


def merge_status(docs: List[dict]) -> dict:
    """One view of several LB processes' status documents: counters
    added up, each worker's backlog and streams summed, the pool's
    settings and each worker's skills as the first process has them."""
    good = [doc for doc in docs if "workers" in doc]
    if not good:
        return {"workers": {}, "errors": {}, "pool": {}}
    merged: dict = {}
    for doc in good:
        for key, value in doc.items():
            if isinstance(value, bool) or key in ("pool", "workers", "uptime"):
                merged.setdefault(key, value)
            elif isinstance(value, (int, float)):
                merged[key] = merged.get(key, 0) + value
            elif key in ("errors", "classifier_errors"):
                total = merged.setdefault(key, {})
                for name, count in value.items():
                    total[name] = total.get(name, 0) + count
            else:
                merged.setdefault(key, value)
    workers: Dict[str, dict] = {}
    for doc in good:
        for address, info in doc["workers"].items():
            into = workers.get(address)
            if into is None:
                workers[address] = dict(info)
                continue
            for key in ("backlog", "mean_backlog", "streams"):
                if key in info:
                    into[key] = into.get(key, 0) + info[key]
            for key in ("connected", "in_pool"):
                if key in info:
                    into[key] = bool(into.get(key)) and bool(info[key])
    merged["workers"] = workers
    merged["uptime"] = min(doc.get("uptime", 0) for doc in good)
    return merged


def fetch(address: str, timeout: float = 5.0, action: Optional[str] = None) -> dict:
    """Get the status document from an LB's status address (or POST to
    one of its actions and get the answer)."""
    url = address if "://" in address else "http://%s/" % address
    data = None
    if action is not None:
        url, data = url.rstrip("/") + "/" + action, b""
    try:
        with urllib.request.urlopen(url, data=data, timeout=timeout) as response:
            return json.load(response)
    except (OSError, ValueError) as exc:
        raise ConfigurationError("cannot get status from %s: %s" % (url, exc))


def _table(rows: List[List[str]]) -> List[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
            for row in rows]


def format_status(doc: dict, max_skills: int = 5) -> str:
    """The status document as text tables."""
    pool = doc.get("pool", {})
    lines = [
        "pool: %s  variance=%s  backlog_history=%s  unskilled_score=%s" % (
            pool.get("policy"), pool.get("variance"), pool.get("backlog_history"),
            pool.get("unskilled_score")),
        "backlog=%s  mean backlog=%s  in flight=%s  requests=%s  retries=%s  errors=%s" % (
            pool.get("backlog"), pool.get("mean_backlog"), doc.get("in_flight"),
            doc.get("requests"), doc.get("retries"), doc.get("errors")),
        "",
    ]
    rows = [["worker", "state", "backlog", "mean", "classes", "top skills (req/s)"]]
    workers: Dict[str, dict] = doc.get("workers", {})
    for address, info in sorted(workers.items()):
        skills = info.get("skills") or {}
        top = sorted(skills.items(), key=lambda item: -item[1])[:max_skills]
        state = ("in pool" if info.get("in_pool") else "draining") if info.get(
            "connected") else "down"
        rows.append([address, state, str(info.get("backlog", "-")),
                     str(info.get("mean_backlog", "-")), str(len(skills)),
                     ", ".join("%s=%.3g" % item for item in top)])
    lines.extend(_table(rows))
    for process in doc.get("processes", ()):
        lines.append("process %s (pid %s, status %s): %s requests, %s in flight" % (
            process.get("index"), process.get("pid"), process.get("status"),
            process.get("requests"), process.get("in_flight")))
    return "\n".join(lines)
