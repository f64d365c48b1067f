"""The status document: served as JSON, printed as a table.

The LB's ``--status HOST:PORT`` serves ``LB.status()`` as JSON at ``/``
and ``/status.json``, an HTML page at ``/`` for browsers (status/page.py),
Prometheus metrics at ``/metrics`` (status/metrics.py) and ``/healthz``;
``zc-lb status HOST:PORT`` fetches the document and prints it for a person.
"""

from __future__ import annotations

import collections
import contextlib
import hmac
import http.client
import json
import logging
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import orjson
from webob import Request, Response  # type: ignore[import-untyped]

from zc_lb.errors import ChildUnavailable, ConfigurationError, ZcLbError
from zc_lb.lb.stats import MAX_COUNTED_CLASSES, OTHER_CLASS, STATUS_CLASSES, top_classes
from zc_lb.sockets import is_loopback
from zc_lb.status import deadline

log = logging.getLogger(__name__)

RECENT_ERRORS = 20  # in a merged document
STATUS_SKILLS = 100  # skills a worker in the document, unless ?skills= says
# How merge_status merges the children's pools; the rest is the first's:
# the policy and its settings (alike in every child), ``lbs``, and the
# gains, ratios each child measures of a share of the same traffic.
# Summed: the counters (an ended child's kept, process/retired.py), and
# ``backlog``, each child's own requests in flight (less its siblings',
# routing/siblings.py): the LB's are every child's.
POOL_COUNTERS = ("bounded", "spills", "explored", "widenings", "narrowings", "skill_resets")
POOL_SUMMED = POOL_COUNTERS + ("backlog",)
# Averaged: ``mean_backlog`` decays the backlog a child routes by, its
# siblings' requests counted in: each child's is the whole LB's already
# (a sum would count each request once a child).  The highest:
# ``starting`` (workers in slow start) and ``widened`` (classes given
# more members), which count workers and classes each child judges for
# itself: one worker or class is one, not one a child.
POOL_HIGHEST = ("starting", "widened")


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
        import gevent  # type: ignore[import-untyped]

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


def bound_skills(document: dict, n: int = STATUS_SKILLS) -> dict:
    """``document`` with at most ``n`` skills a worker (the best), and each
    worker's ``skills_count`` (as it was, if the document has one): a
    site with 40,000 classes made a document of megabytes."""
    workers = document.get("workers")
    if not workers:
        return document
    bounded = dict(document, workers=dict(workers))
    for address, info in workers.items():
        skills = info.get("skills")
        if skills is not None:
            info = bounded["workers"][address] = dict(
                info, skills_count=info.get("skills_count", len(skills)))
            if len(skills) > n:
                info["skills"] = dict(sorted(skills.items(), key=lambda item: -item[1])[:n])
    return bounded


def busiest_classes(document: dict, n: int = STATUS_CLASSES) -> dict:
    """``document`` with its ``n`` busiest classes, the rest summed as
    "other", and the latency of those listed."""
    classes = document.get("classes")
    if not classes or len(classes) <= n:
        return document
    bounded = top_classes(classes, n)
    latency = document.get("class_latency") or {}
    return dict(document, classes=bounded,
                class_latency={name: latency[name] for name in bounded if name in latency})


def _respond(body: bytes, content_type: str, status: int = 200) -> Response:
    """An uncached response of ``body`` (text in UTF-8)."""
    response = Response(body=body, status=status, content_type=content_type,
                        charset=None)
    if "charset" not in content_type and content_type.startswith("text/"):
        response.charset = "utf-8"
    response.cache_control = "no-store"
    return response


_JSON_OPTIONS = orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS


def _as_json(document, status: int = 200) -> Response:
    """An uncached response of ``document`` as indented JSON.  (By orjson:
    the standard library's encoder, indenting, took 1.9 ms of the 2.8 ms of
    LB CPU a status document of 150 classes cost, which ``zc-lb compare``
    asks for 20 times a second; orjson takes 0.1.)"""
    body = orjson.dumps(document, option=_JSON_OPTIONS) + b"\n"
    return _respond(body, "application/json", status)


def _cross_site(request: Request) -> Optional[str]:
    """Why ``request`` comes from a web page of another site, or None: a
    browser's ``Origin`` naming another address than its ``Host``, or its
    ``Sec-Fetch-Site`` other than ``same-origin`` or ``none`` (typed in).
    ``zc-lb drain`` and curl send neither.  (Without a token, a page in a
    browser on the LB's host would otherwise post actions from loopback.)"""
    site = request.headers.get("Sec-Fetch-Site")
    if site is not None and site.strip().lower() not in ("same-origin", "none"):
        return "Sec-Fetch-Site: %s" % site
    origin = request.headers.get("Origin")
    if origin is not None:
        host = request.headers.get("Host", "")
        if urllib.parse.urlsplit(origin.strip()).netloc.lower() != host.strip().lower():
            return "Origin: %s, Host: %s" % (origin, host)
    return None


def _refusal(request: Request, token: Optional[bytes]) -> Optional[Response]:
    """The 401 or 403 answer to an action the client may not run, or None if it may."""
    cross_site = _cross_site(request)
    if cross_site is not None:
        return _as_json({"error": "actions are not taken from a web page of another "
                                  "site (%s)" % cross_site}, 403)
    if token is not None:
        # The scheme is case-insensitive (RFC 9110, 11.1); the token is not.
        scheme, _, credentials = request.headers.get("Authorization", "").strip().partition(" ")
        if not (scheme.lower() == "bearer" and hmac.compare_digest(
                credentials.strip().encode("latin-1", "replace"), token)):
            response = _as_json({"error": "this action needs the admin token"}, 401)
            response.headers["WWW-Authenticate"] = "Bearer"
            return response
    elif not is_loopback(request.remote_addr):
        return _as_json({"error": "actions from other hosts than this one need "
                                  "--admin-token-file"}, 403)
    return None


def _post(request: Request, actions: Dict[str, Callable[..., object]],
          token: Optional[bytes]) -> Response:
    """The answer to a POST: the action it names run with its query, or why not."""
    name = request.path_info.strip("/")
    refusal = _refusal(request, token)
    if refusal is not None:
        return refusal
    action = actions.get(name)
    if action is None:
        return _as_json({"error": "no such action", "actions": sorted(actions)}, 404)
    try:
        result: Any = action(**dict(request.GET))
    except (ConfigurationError, TypeError) as exc:
        return _as_json({"error": "%s: %s" % (name, exc)}, 400)
    except ChildUnavailable as exc:  # (a supervisor's: none of its children answered)
        return _as_json({"error": "%s: %s" % (name, exc)}, 503)
    log.warning("status action %s %s by %s", name, dict(request.GET), request.remote_addr)
    return _as_json(dict(result or {}, done=name))


def _metrics(collector) -> Response:
    """``collector``'s metrics in the Prometheus text format."""
    from zc_lb.status.metrics import CONTENT_TYPE_LATEST, exposition

    response = _respond(exposition(collector), "text/plain")
    response.headers["Content-Type"] = CONTENT_TYPE_LATEST
    return response


def _document(request: Request, document: dict, page: Optional[Callable[..., str]],
              history: Optional[RequestHistory]) -> Response:
    """The status document as JSON (its skills and classes bounded, by
    ``?skills=`` and ``?classes=`` if given: a count, or ``all``), or as
    the HTML page for a browser at ``/``."""
    try:
        skills = _limit(request, "skills", STATUS_SKILLS)
        classes = _limit(request, "classes", STATUS_CLASSES)
    except ValueError as exc:
        return _as_json({"error": str(exc)}, 400)
    if skills is not None:
        document = bound_skills(document, skills)
    if classes is not None:
        document = busiest_classes(document, classes)
    if request.path_info == "/" and page is not None and _wants_html(request):
        return _respond(page(document, history).encode("utf-8"), "text/html")
    return _as_json(document)


def _limit(request: Request, name: str, default: int) -> Optional[int]:
    """How many of its ``name`` the document keeps: ``?NAME=``'s count,
    None for ``all``, else ``default``; ValueError for anything else."""
    value = request.GET.get(name)
    if value is None:
        return default
    if value == "all":
        return None
    if value.isascii() and value.isdigit():
        return int(value)
    raise ValueError("?%s= takes a count or 'all', not %r" % (name, value[:40]))


def status_app(get_status: Callable[[], dict],
               actions: Optional[Dict[str, Callable[..., object]]] = None,
               collector=None, page: Optional[Callable[..., str]] = None,
               history: Optional[RequestHistory] = None,
               token: Optional[bytes] = None,
               unready: Optional[Callable[[], Optional[str]]] = None) -> Callable:
    """The status address's WSGI app (operators only: not for the public).

    GET ``/status.json``: the status document as JSON, with at most
    STATUS_SKILLS skills a worker (``?skills=N``: N, ``all``: every one)
    and STATUS_CLASSES classes (``?classes=N``, ``all``); GET ``/``:
    the same document, or the HTML status page (``page(doc, history)``)
    for a client that asks for text/html; ``/metrics``: ``collector``'s
    metrics in the Prometheus text format; ``/healthz``: 200 "ok" while
    this process answers and can serve, 503 with the reason while
    ``unready()`` gives one (an LB with no worker in its pool); any other
    GET: 404; another method than GET, HEAD and POST: 405.  A POST to ``/NAME`` runs
    ``actions[NAME](**query)`` (``/drain?worker=HOST:PORT``), answering
    what it returns; with a ``token`` it needs ``Authorization: Bearer
    TOKEN``, without one it is taken from loopback addresses only.
    """
    actions = actions or {}

    def handle(request: Request) -> Response:
        path = request.path_info
        if request.method == "POST":
            return _post(request, actions, token)
        if request.method not in ("GET", "HEAD"):  # (a DELETE is no GET)
            response = _as_json({"error": "method %s not allowed" % request.method}, 405)
            response.allow = ("GET", "HEAD", "POST")
            return response
        if path == "/healthz":
            return _health(unready() if unready is not None else None)
        if path == "/metrics" and collector is not None:
            return _metrics(collector)
        if path not in ("/", "/status.json"):
            return _as_json({"error": "no such page", "pages": [
                "/", "/status.json", "/metrics", "/healthz"]}, 404)
        return _document(request, get_status(), page, history)

    def app(environ, start_response):
        return handle(Request(environ))(environ, start_response)

    return app


def _health(why: Optional[str]) -> Response:
    """``/healthz``: 200 "ok", or 503 with ``why`` the process cannot serve."""
    if why:
        return _respond(("not ready: %s\n" % why).encode(), "text/plain", 503)
    return _respond(b"ok\n", "text/plain")


def merge_status(docs: List[dict]) -> dict:
    """One view of several LB processes' status documents: counters
    (the pool's too) added up, the pool's backlog and each worker's backlog
    and streams summed, the pool's other gauges as ``POOL_HIGHEST`` says,
    the pool's settings and each worker's skills as the first process
    has them."""
    good = [doc for doc in docs if "workers" in doc]
    if not good:
        return {"workers": {}, "errors": {}, "pool": {}}
    merged = _merge_totals(good)
    cap_classes(merged)
    pool = merged["pool"] = dict(merged.get("pool") or {})
    for key in POOL_SUMMED + POOL_HIGHEST + ("mean_backlog",):
        values = [value for value in ((doc.get("pool") or {}).get(key) for doc in good)
                  if isinstance(value, (int, float)) and not isinstance(value, bool)]
        if not values:
            continue
        if key == "mean_backlog":
            pool[key] = round(sum(values) / len(values), 4)
        else:
            pool[key] = sum(values) if key in POOL_SUMMED else max(values)
    merged["workers"] = _merge_workers(good)
    merged["uptime"] = min(doc.get("uptime", 0) for doc in good)
    return merged


def _merge_totals(docs: List[dict]) -> dict:
    """The documents' top-level entries merged: numbers, latency histograms and
    counts by name added up, recent errors interleaved, the rest the first's."""
    merged: dict = {}
    for doc in docs:
        for key, value in doc.items():
            if isinstance(value, bool) or key in ("pool", "workers", "uptime", "pid"):
                merged.setdefault(key, value)
            elif isinstance(value, (int, float)):
                merged[key] = merged.get(key, 0) + value
            elif key == "latency":
                merged[key] = add_histograms(merged.get(key), value)
            elif key == "class_latency":
                into = merged.setdefault(key, {})
                for name, histogram in value.items():
                    into[name] = add_histograms(into.get(name), histogram)
            elif key == "recent_errors":
                merged[key] = sorted(merged.get(key, []) + list(value),
                                     key=lambda e: e.get("time", 0))[-RECENT_ERRORS:]
            elif key in ("errors", "classifier_errors", "error_causes", "classes", "buffers",
                         "retired_workers"):
                total = merged.setdefault(key, {})
                for name, count in value.items():
                    total[name] = total.get(name, 0) + count
            else:
                merged.setdefault(key, value)
    return merged


def cap_classes(merged: dict) -> None:
    """At most MAX_COUNTED_CLASSES classes in ``merged`` (the busiest), as
    in an LB's document: the rest, and their latency, summed as "other"."""
    classes = merged.get("classes")
    if not classes or len(classes) <= MAX_COUNTED_CLASSES + 1:
        return
    merged["classes"] = kept = top_classes(classes, MAX_COUNTED_CLASSES)
    latency = merged.get("class_latency") or {}
    for name in [name for name in latency if name not in kept]:
        histogram = latency.pop(name)
        latency[OTHER_CLASS] = add_histograms(latency.get(OTHER_CLASS), histogram)


def add_histograms(into: Optional[dict], value: dict) -> dict:
    """Two latency histograms of the status document's added up (``into``
    None: a copy of ``value``)."""
    if into is None:
        return dict(value, counts=list(value["counts"]))
    if into["buckets"] == value["buckets"]:
        into["counts"] = [a + b for a, b in zip(into["counts"], value["counts"])]
        into["sum"] = round(into["sum"] + value["sum"], 6)
    return into


def _merge_workers(docs: List[dict]) -> Dict[str, dict]:
    """The documents' workers merged: backlogs, streams and counts added up,
    connected and in_pool only if so in every document, the rest the first's.
    A child's ``siblings_backlog`` (the others' requests on the worker) is
    left out: the summed backlog holds every child's.  ``mean_backlog`` is
    the children's mean: each decays the worker's backlog it routes by,
    its siblings' requests counted in (as the pool's, ``POOL_HIGHEST``)."""
    workers: Dict[str, dict] = {}
    means: Dict[str, List[float]] = {}
    for doc in docs:
        for address, info in doc["workers"].items():
            if isinstance(info.get("mean_backlog"), (int, float)):
                means.setdefault(address, []).append(info["mean_backlog"])
    for doc in docs:
        for address, info in doc["workers"].items():
            into = workers.get(address)
            if into is None:
                workers[address] = dict(info)
                workers[address].pop("siblings_backlog", None)
                if "counts" in info:
                    workers[address]["counts"] = dict(info["counts"])
                if "latency" in info:
                    workers[address]["latency"] = add_histograms(None, info["latency"])
                continue
            if "latency" in info:
                into["latency"] = add_histograms(into.get("latency"), info["latency"])
            for key in ("backlog", "streams"):
                if key in info:
                    into[key] = into.get(key, 0) + info[key]
            if "counts" in info:
                counts = into.setdefault("counts", {})
                for what, count in info["counts"].items():
                    counts[what] = counts.get(what, 0) + count
            for key in ("connected", "in_pool"):
                if key in info:
                    into[key] = bool(into.get(key)) and bool(info[key])
            _take_twin(into, info)
    for address, values in means.items():
        workers[address]["mean_backlog"] = round(sum(values) / len(values), 4)
    return workers


def _take_twin(into: dict, info: dict) -> None:
    """A worker's ``twin_of`` in the merged document: any child's (each
    pools a worker reached by two addresses by the one it reached first,
    and children may differ), not the first's null beside in_pool false."""
    if info.get("twin_of") and not into.get("twin_of"):
        into["twin_of"] = info["twin_of"]


def fetch(address: str, timeout: float = 5.0, action: Optional[str] = None,
          params: Optional[Dict[str, str]] = None, token: Optional[bytes] = None) -> dict:
    """Get the status document from an LB's status address, ``params``
    its query (or POST to one of its actions, with ``params`` and the
    admin ``token``, and get the answer, which says it was ``done``).
    Nothing answering there (or a 503: try again) is a ZcLbError (exit
    status 1); an answer that is no zc-lb status server's, or a refusal,
    a ConfigurationError (2): the address, the token or the worker given
    is wrong.  (process/asking.py asks the same, over gevent's sockets.)"""
    url, data = status_request(address, action, params)
    request = urllib.request.Request(url, data=data)
    if token is not None:
        request.add_header("Authorization", "Bearer " + token.decode("latin-1"))
    code, _, body, reason = answer_at(request, url, timeout)
    return status_answer(url, action, code, body, reason)


def status_request(address: str, action: Optional[str] = None,
                   params: Optional[Dict[str, str]] = None) -> Tuple[str, Optional[bytes]]:
    """The URL that ``fetch`` asks at ``address`` (its ``action``, its
    query ``params``), and its body: b"" for an action's POST, None for a GET."""
    url = address if "://" in address else "http://%s/" % address
    data = None
    if action is not None:
        url, data = url.rstrip("/") + "/" + action, b""
    if params:
        url += "?" + urllib.parse.urlencode(params)
    return url, data


def status_answer(url: str, action: Optional[str], code: int, body: bytes,
                  reason: str) -> dict:
    """The status document (or an ``action``'s answer) that ``url``
    answered with HTTP status ``code``, ``body`` and ``reason``; the
    errors ``fetch`` raises for an answer that is none."""
    if code == 503:  # (a supervisor none of whose children answered: try again)
        raise ZcLbError("%s answered %s: %s" % (url, code, _said(body, reason)))
    if not 200 <= code < 300:  # (what urllib raises for)
        raise ConfigurationError("%s answered %s: %s" % (url, code, _said(body, reason)))
    try:
        answer = json.loads(body)
    except ValueError:
        raise ConfigurationError("%s is not a zc-lb status server: its answer is not JSON"
                                 % url)
    if action is not None and not (isinstance(answer, dict) and answer.get("done") == action):
        # (an LB's front port hands the POST to the application, which may
        # answer JSON too: nothing was done)
        raise ConfigurationError("%s is not a zc-lb status server: its answer does not say "
                                 "%s was done; give the address of an LB's --status" % (
                                     url, action))
    return answer


@contextlib.contextmanager
def answering(where: str, unreachable: str = "cannot get status from %s") -> Iterator[None]:
    """The errors of asking ``where``: nothing answering (refused, timed
    out: an OSError) a ZcLbError saying ``unreachable`` (of ``where``)
    and why; an answer not in HTTP, or no address, a ConfigurationError."""
    try:
        yield
    except OSError as exc:  # refused, timed out: nothing answers
        raise ZcLbError("%s: %s" % (unreachable % where, getattr(exc, "reason", exc)))
    except (http.client.HTTPException, ValueError) as exc:  # not HTTP, or no address
        raise ConfigurationError("%s is not a zc-lb status server: %s" % (where, _named(exc)))


def answer_at(request, where: str, timeout: float = 5.0,
              unreachable: str = "cannot get status from %s") -> Tuple[int, str, bytes, str]:
    """What answers ``request`` (a URL, or a urllib Request), named
    ``where`` in errors: its HTTP status, content type, body and reason,
    an error status's too.  Nothing answering is a ZcLbError (exit
    status 1: try again), saying ``unreachable`` (of ``where``) and why;
    an answer not in HTTP, or no address, a ConfigurationError (2: fix
    it) (``answering``); no answer in ``timeout`` seconds, all of it
    (status/deadline.py), is nothing answering.  For ``zc-lb status``
    and the actions alike."""
    with answering(where, unreachable):
        try:
            with deadline.urlopen(request, timeout) as response:  # (in all, not a read)
                return (response.status, response.headers.get_content_type(), response.read(),
                        str(response.reason))
        except urllib.error.HTTPError as exc:
            try:
                body = exc.read()
            except (OSError, http.client.HTTPException):
                body = b""
            return exc.code, exc.headers.get_content_type(), body, str(exc.reason)


def _named(error: Exception) -> str:
    """``error`` as one line with its kind (http.client's say only what
    they read: "SSH-2.0-OpenSSH")."""
    return "%s: %s" % (type(error).__name__, str(error).strip() or "-")


def _said(body: bytes, reason: str) -> str:
    """The ``error`` of a JSON answer's ``body``, or the HTTP ``reason``."""
    try:
        return json.loads(body)["error"]
    except Exception:
        return reason


def _table(rows: List[List[str]]) -> List[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
            for row in rows]


def worker_state(info: dict) -> str:
    """One word or two for a worker's standing in the status document."""
    if info.get("standby"):
        return "idle (other version)"
    if info.get("drained"):
        return "drained"
    if not info.get("connected"):
        return "down"
    if info.get("twin_of"):
        return "pooled as %s" % info["twin_of"]
    if info.get("in_pool"):
        return "in pool"
    return "ejected" if info.get("ejected") else "draining"


def format_status(doc: dict, max_skills: int = 5) -> str:
    """The status document as text tables."""
    pool = doc.get("pool", {})
    lines = [
        "pool: %s  variance=%s  backlog_history=%s  unskilled_score=%s%s" % (
            pool.get("policy"), pool.get("variance"), pool.get("backlog_history"),
            pool.get("unskilled_score"), "  build: %s" % doc["build"] if doc.get("build") else ""),
        "backlog=%s  mean backlog=%s  in flight=%s  requests=%s  retries=%s  errors=%s" % (
            pool.get("backlog"), pool.get("mean_backlog"), doc.get("in_flight"),
            doc.get("requests"), doc.get("retries"), doc.get("errors")),
        "",
    ]
    rows = [["worker", "state", "version", "backlog", "mean", "classes",
             "top skills (req/s)"]]
    workers: Dict[str, dict] = doc.get("workers", {})
    for address, info in sorted(workers.items()):
        skills = info.get("skills") or {}
        top = sorted(skills.items(), key=lambda item: -item[1])[:max_skills]
        rows.append([address, worker_state(info), str(info.get("version") or "-"),
                     str(info.get("backlog", "-")), str(info.get("mean_backlog", "-")),
                     str(info.get("skills_count", len(skills))),
                     ", ".join("%s=%.3g" % item for item in top)])
    lines.extend(_table(rows))
    for address, info in sorted(workers.items()):  # why a worker is not serving
        if info.get("last_error") and worker_state(info) in ("down", "ejected",
                                                              "idle (other version)"):
            lines.append("%s %s: %s" % (address, worker_state(info), info["last_error"]))
    for process in doc.get("processes", ()):
        lines.append("process %s (pid %s, status %s): %s requests, %s in flight" % (
            process.get("index"), process.get("pid"), process.get("status"),
            process.get("requests"), process.get("in_flight")))
    return "\n".join(lines)
