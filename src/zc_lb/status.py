"""The status document: served as JSON, printed as a table.

The LB's ``--status HOST:PORT`` serves ``LB.status()`` as JSON at ``/``
and ``/status.json``, an HTML page at ``/`` for browsers (statuspage.py),
Prometheus metrics at ``/metrics`` (metrics.py) and ``/healthz``;
``zc-lb status HOST:PORT`` fetches the document and prints it for a person.
"""

from __future__ import annotations

import collections
import json
import logging
import time
import urllib.request
from typing import Callable, Dict, List, Optional, Tuple

from webob import Request, Response

from .errors import ConfigurationError

log = logging.getLogger(__name__)

RECENT_ERRORS = 20  # in a merged document


class RequestHistory:
    """Request counts sampled every ``interval`` seconds, the last ``size``
    of them (a ring): the status page's sparkline of the request rate."""

    def __init__(self, get_requests: Callable[[], int], interval: float = 5.0,
                 size: int = 60) -> None:
        self.get_requests = get_requests
        self.interval = interval
        self.samples: "collections.deque[Tuple[float, int]]" = collections.deque(maxlen=size)
        self._greenlet = None

    def sample(self) -> None:
        try:
            self.samples.append((time.time(), int(self.get_requests())))
        except Exception as exc:  # a supervisor's child may not answer
            log.debug("no request count to sample: %s", exc)

    def rates(self) -> List[Tuple[float, float]]:
        """(time, requests per second) between consecutive samples."""
        samples = list(self.samples)
        return [(t1, max(n1 - n0, 0) / max(t1 - t0, 1e-9))
                for (t0, n0), (t1, n1) in zip(samples, samples[1:])]

    def start(self) -> "RequestHistory":
        import gevent

        def loop() -> None:
            while True:
                self.sample()
                gevent.sleep(self.interval)
        self._greenlet = gevent.spawn(loop)
        return self

    def stop(self) -> None:
        if self._greenlet is not None:
            self._greenlet.kill(block=False)


def _wants_html(request: Request) -> bool:
    """A browser asks for text/html before (or instead of) JSON; urllib,
    curl and ``zc-lb status`` send no Accept (or */*) and get JSON."""
    if "text/html" not in request.headers.get("Accept", ""):
        return False
    offers = request.accept.acceptable_offers(["application/json", "text/html"])
    return bool(offers) and offers[0][0] == "text/html"


def status_app(get_status: Callable[[], dict],
               actions: Optional[Dict[str, Callable[[], None]]] = None,
               collector=None, page: Optional[Callable[..., str]] = None,
               history: Optional[RequestHistory] = None) -> Callable:
    """The status address's WSGI app (operators only: not for the public).

    GET ``/status.json``: the status document as JSON; GET ``/``: the same
    document, or the HTML status page (``page(doc, history)``) for a client
    that asks for text/html; ``/metrics``: ``collector``'s metrics in the
    Prometheus text format; ``/healthz``: 200 "ok" while this process
    answers; any other GET: the document as JSON (what every GET was
    before).  A POST to ``/NAME`` runs ``actions[NAME]``.
    """
    actions = actions or {}

    def respond(body: bytes, content_type: str, status: int = 200) -> Response:
        response = Response(body=body, status=status, content_type=content_type,
                            charset=None)
        if "charset" not in content_type and content_type.startswith("text/"):
            response.charset = "utf-8"
        response.cache_control = "no-store"
        return response

    def as_json(document, status: int = 200) -> Response:
        body = json.dumps(document, indent=2, sort_keys=True).encode() + b"\n"
        return respond(body, "application/json", status)

    def handle(request: Request) -> Response:
        path = request.path_info
        if request.method == "POST":
            action = actions.get(path.strip("/"))
            if action is None:
                return as_json({"error": "no such action"}, 404)
            action()
            return as_json({"done": path.strip("/")})
        if path == "/healthz":
            return respond(b"ok\n", "text/plain")
        if path == "/metrics" and collector is not None:
            from .metrics import CONTENT_TYPE_LATEST, exposition

            response = respond(exposition(collector), "text/plain")
            response.headers["Content-Type"] = CONTENT_TYPE_LATEST
            return response
        document = get_status()
        if path == "/" and page is not None and _wants_html(request):
            return respond(page(document, history).encode("utf-8"), "text/html")
        return as_json(document)

    def app(environ, start_response):
        return handle(Request(environ))(environ, start_response)

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
            elif key == "latency":
                into = merged.get(key)
                if into is None:
                    merged[key] = dict(value, counts=list(value["counts"]))
                elif into["buckets"] == value["buckets"]:
                    into["counts"] = [a + b for a, b in zip(into["counts"], value["counts"])]
                    into["sum"] = round(into["sum"] + value["sum"], 6)
            elif key == "recent_errors":
                merged[key] = sorted(merged.get(key, []) + list(value),
                                     key=lambda e: e.get("time", 0))[-RECENT_ERRORS:]
            elif key in ("errors", "classifier_errors", "error_causes", "classes"):
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
                if "counts" in info:
                    workers[address]["counts"] = dict(info["counts"])
                continue
            for key in ("backlog", "mean_backlog", "streams"):
                if key in info:
                    into[key] = into.get(key, 0) + info[key]
            if "counts" in info:
                counts = into.setdefault("counts", {})
                for what, count in info["counts"].items():
                    counts[what] = counts.get(what, 0) + count
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
