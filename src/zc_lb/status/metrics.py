"""Prometheus metrics, collected from the status document at scrape time.

Nothing here runs per request: the LB keeps plain counters (lb/balancer.py), its
status document carries them, and a custom prometheus_client collector
turns one document into metric families when ``/metrics`` is scraped.
Working from the document means an ``lb --processes N`` supervisor, which
serves a summed document (status.merge_status), serves summed metrics too.

Per-class series are bounded: the ``top_classes`` busiest classes by
request count keep their own ``class`` label; the rest are summed under
``class="other"``.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Iterator, Optional

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from zc_lb.lb.stats import STATUS_CLASSES
from zc_lb.routing.locality import INFINITE

TOP_CLASSES = 20
OTHER = "other"

# The LB's error responses (exception class names) by cause.
CAUSES = {
    "NoWorkerAvailable": "no_worker",
    "ConnectionLost": "worker_lost", "WorkerLost": "worker_lost", "WorkerSilent": "worker_lost",
    "ConnectionClosed": "worker_lost", "WorkerClosed": "worker_lost",
    "PeerCancelled": "worker_lost",
    "ResponseTimeout": "timeout",
    "BadResponse": "bad_response", "RemoteProtocolError": "bad_response",
    "AuthenticationError": "bad_response",
    "TooManyConnections": "overload",
}
CODE_CLASSES = ("1xx", "2xx", "3xx", "4xx", "5xx")


def bound_classes(classes: Dict[str, int], n: int = TOP_CLASSES) -> Dict[str, int]:
    """The ``n`` busiest classes, the rest (and any "other" already) summed
    as "other": at most n + 1 label values whatever the traffic."""
    ranked = sorted(((name, count) for name, count in classes.items() if name != OTHER),
                    key=lambda item: (-item[1], item[0]))
    top = dict(ranked[:n])
    rest = sum(count for name, count in classes.items() if name not in top)
    if rest or OTHER in classes:
        top[OTHER] = rest
    return top


class LBCollector:
    """Metric families of an LB's (or a supervisor's summed) status document."""

    def __init__(self, get_status: Callable[[], dict], top_classes: int = TOP_CLASSES) -> None:
        self.get_status = get_status
        self.top_classes = top_classes

    def describe(self) -> list:
        return []  # unchecked: the families depend on the document

    def collect(self) -> Iterator[Metric]:
        doc = self.get_status()
        yield build_info()
        yield from lb_families(doc, self.top_classes)


def build_info() -> GaugeMetricFamily:
    """``zc_lb_build_info{version, build} 1``: which zc-lb runs, and whether
    compiled (a pip install without a compiler runs the source, some
    twice the CPU a request)."""
    from zc_lb import __version__, build

    family = GaugeMetricFamily("zc_lb_build_info", "zc-lb's version and build (compiled, or "
                               "the source and why), as a label; always 1.",
                               labels=["version", "build"])
    family.add_metric([__version__, build()], 1)
    return family


def _counter(name: str, doc: str, value, labels=None) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=sorted(labels) if labels else None)
    if not labels:
        family.add_metric([], float(value or 0))
    return family


def lb_families(doc: dict, top_classes: int = TOP_CLASSES) -> Iterator[Metric]:
    """Every metric family of an LB's status document, in exposition order."""
    workers = doc.get("workers", {})
    yield from traffic_families(doc)
    yield from buffer_families(doc.get("buffers") or {})
    yield from latency_families(doc.get("latency"))
    yield from worker_latency_families(workers)
    yield from error_families(doc, workers)
    yield from pool_families(doc.get("pool", {}))
    yield from worker_families(workers)
    yield from class_families(doc.get("classes", {}), workers, top_classes)


def traffic_families(doc: dict) -> Iterator[Metric]:
    """The LB's request, retry, failure, health check and client counts, and its uptime."""
    yield _counter("zc_lb_requests", "Requests the LB received.", doc.get("requests"))
    yield GaugeMetricFamily("zc_lb_in_flight", "Requests forwarded and not yet answered.",
                            value=doc.get("in_flight") or 0)
    yield _counter("zc_lb_retries", "Requests retried on another worker.", doc.get("retries"))
    yield _counter("zc_lb_retries_refused", "Retries the retry budget refused.",
                   doc.get("retries_refused"))
    yield _counter("zc_lb_worker_failures",
                   "Worker 5xx answers and connections failing under a request.",
                   doc.get("worker_failures"))
    yield _counter("zc_lb_ejections", "Outlier ejections of workers.", doc.get("ejections"))
    yield _counter("zc_lb_health_checks", "Health checks made.", doc.get("health_checks"))
    yield GaugeMetricFamily("zc_lb_clients_connected", "Client connections open now.",
                            value=doc.get("clients") or 0)
    yield GaugeMetricFamily("zc_lb_uptime_seconds", "Seconds since the LB started.",
                            value=doc.get("uptime") or 0)


def buffer_families(buffers: dict) -> Iterator[Metric]:
    """The bytes held for slow clients (responses, request bodies), and how
    often buffering spilled or stalled."""
    held = GaugeMetricFamily("zc_lb_buffer_bytes",
                             "Response and request body bytes held for slow clients.",
                             labels=["where"])
    for where in ("memory", "disk"):
        held.add_metric([where], buffers.get(where) or 0)
    yield held
    yield _counter("zc_lb_buffer_spilled", "Responses and request bodies buffered partly on disk.",
                   buffers.get("spilled"))
    yield _counter("zc_lb_buffer_stalled",
                   "Times a response filled its buffers and its worker waited for the client.",
                   buffers.get("stalled"))
    yield GaugeMetricFamily("zc_lb_buffer_holding",
                            "Request bodies being read from their clients, no worker yet.",
                            value=buffers.get("holding") or 0)


def latency_families(latency: Optional[dict], name: str = "zc_lb_response_seconds",
                     text: str = "Seconds from a request's arrival until its response starts "
                     "(the head is with the front server), for every request answered."
                     ) -> Iterator[Metric]:
    """The response time histogram, if the document has one."""
    if not latency:
        return
    yield HistogramMetricFamily(name, text, buckets=_cumulative(latency),
                                sum_value=latency.get("sum", 0.0))


def _cumulative(latency: dict) -> list:
    """A status histogram's buckets as Prometheus takes them: cumulative."""
    buckets, cumulative = [], 0
    for bound, count in zip(list(latency["buckets"]) + ["+Inf"], latency["counts"]):
        cumulative += count
        buckets.append((bound if bound == "+Inf" else repr(float(bound)), cumulative))
    return buckets


def worker_latency_families(workers: Dict[str, dict]) -> Iterator[Metric]:
    """The response time histogram by the worker that answered."""
    family = HistogramMetricFamily(
        "zc_lb_worker_response_seconds", "Seconds from a request's arrival until its "
        "response starts, by the worker that answered it.", labels=["worker"])
    for address, info in sorted(workers.items()):
        latency = info.get("latency")
        if latency:
            family.add_metric([address], _cumulative(latency), latency.get("sum", 0.0))
    yield family


def error_families(doc: dict, workers: Dict[str, dict]) -> Iterator[Metric]:
    """The LB's error responses by status and by cause, and the 5xx to clients by cause."""
    errors = CounterMetricFamily("zc_lb_errors", "Error responses the LB made, by status.",
                                 labels=["status"])
    for status, count in sorted(doc.get("errors", {}).items()):
        errors.add_metric([str(status)], count)
    yield errors

    by_cause = CounterMetricFamily(
        "zc_lb_error_causes", "Answers the LB made itself, by cause: the client's "
        "(BadRequest, HeadTimeout, RequestTooLarge...) and the LB's (NoWorkerAvailable, "
        "WorkerLost, TooManyConnections...).", labels=["cause"])
    for name, count in sorted(doc.get("error_causes", {}).items()):
        by_cause.add_metric([name], count)
    yield by_cause

    family = CounterMetricFamily("zc_lb_5xx", "5xx responses to clients, by cause: no_worker "
                                 "(503), worker_lost (502), timeout (504), bad_response "
                                 "(502), overload (503 past --max-connections), worker (the "
                                 "application's own 5xx), other.",
                                 labels=["cause"])
    for cause, count in causes_of_5xx(doc, workers).items():
        family.add_metric([cause], count)
    yield family


def causes_of_5xx(doc: dict, workers: Dict[str, dict]) -> Dict[str, float]:
    """The 5xx responses to clients, counted by cause (the zc_lb_5xx label values)."""
    causes: Dict[str, float] = dict.fromkeys(
        ("no_worker", "worker_lost", "timeout", "bad_response", "overload", "worker", "other"),
        0)
    for name, count in doc.get("error_causes", {}).items():
        cause = CAUSES.get(name)
        if cause is None:
            continue  # a client's error (4xx), not a 5xx
        causes[cause] += count
    # 5xx the LB made for reasons outside CAUSES (e.g. a local protocol error)
    made = sum(count for status, count in doc.get("errors", {}).items()
               if str(status)[:1] == "5")
    causes["other"] += max(made - sum(causes.values()), 0)
    causes["worker"] = workers_5xx(doc)
    return causes


def workers_5xx(doc: dict) -> int:
    """The workers' own 5xx answers: those of the workers known, and of
    those gone (``retired_workers``), so that the total never goes back."""
    known = sum((info.get("counts") or {}).get("5xx", 0)
                for info in (doc.get("workers") or {}).values())
    return known + (doc.get("retired_workers") or {}).get("5xx", 0)


def pool_families(pool: dict) -> Iterator[Metric]:
    """The pool's policy, its numeric settings and state, and its counters."""
    yield InfoMetricFamily("zc_lb_pool", "The pool's routing policy.",
                           value={"policy": str(pool.get("policy", ""))})
    for key, help_text in (("variance", "The pool's variance setting."),
                           ("backlog_history", "The pool's backlog_history setting."),
                           ("unskilled_score", "The pool's unskilled_score setting."),
                           ("backlog", "Requests in flight on the pool's workers."),
                           ("mean_backlog", "The pool's decayed mean backlog."),
                           ("locality_gain", "How many times longer a request takes away "
                            "from its key's home (the affinity policy; absent until "
                            "measured)."),
                           ("first_visit_gain", "How many times longer a key no worker "
                            "has served takes away from its class's members (the "
                            "affinity policy; absent until measured).")):
        value = pool.get(key)
        if value == INFINITE:  # (the document's word for it: +Inf here)
            value = math.inf
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            yield GaugeMetricFamily("zc_lb_pool_" + key, help_text, value=value)
    for key, help_text in (("bounded", "Requests sent to the least busy worker because "
                            "their key's worker was past the bound of what locality buys."),
                           ("spills", "Requests no member of their class could take.")):
        value = pool.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            yield CounterMetricFamily("zc_lb_pool_" + key, help_text, value=value)


def worker_families(workers: Dict[str, dict]) -> Iterator[Metric]:
    label = ["worker"]
    requests = CounterMetricFamily("zc_lb_worker_requests",
                                   "Requests sent to the worker.", labels=label)
    responses = CounterMetricFamily("zc_lb_worker_responses",
                                    "Responses from the worker, by status class.",
                                    labels=["worker", "code"])
    errors = CounterMetricFamily("zc_lb_worker_errors", "Requests that failed on the worker "
                                 "before its response started (lost, timed out, bad "
                                 "response, client gone).", labels=label)
    retries = CounterMetricFamily("zc_lb_worker_retries",
                                  "Requests retried elsewhere after failing here.",
                                  labels=label)
    gauges = {key: GaugeMetricFamily("zc_lb_worker_" + key, help_text, labels=label)
              for key, help_text in (
                  ("in_flight", "Requests in flight on the worker's connection (streams)."),
                  ("backlog", "The worker's backlog in the pool."),
                  ("mean_backlog", "The worker's decayed mean backlog."),
                  ("skills", "Classes in the worker's résumé."),
                  ("connected", "1 if the LB is connected to the worker."),
                  ("in_pool", "1 if the worker is in the pool (gets new requests)."),
                  ("ejected", "1 if the worker is ejected as an outlier."))}
    info = InfoMetricFamily("zc_lb_worker", "The worker's application version.",
                            labels=label)
    for address, data in sorted(workers.items()):
        counts = data.get("counts", {})
        requests.add_metric([address], counts.get("requests", 0))
        for code in CODE_CLASSES:
            responses.add_metric([address, code], counts.get(code, 0))
        errors.add_metric([address], counts.get("errors", 0))
        retries.add_metric([address], counts.get("retries", 0))
        values = {"in_flight": data.get("streams", 0), "backlog": data.get("backlog", 0),
                  "mean_backlog": data.get("mean_backlog", 0),
                  "skills": data.get("skills_count", len(data.get("skills") or {})),
                  "connected": bool(data.get("connected")),
                  "in_pool": bool(data.get("in_pool")), "ejected": bool(data.get("ejected"))}
        for key, value in values.items():
            gauges[key].add_metric([address], float(value or 0))
        info.add_metric([address], {"version": str(data.get("version") or "")})
    yield from (requests, responses, errors, retries, *gauges.values(), info)


def class_families(classes: Dict[str, int], workers: Dict[str, dict],
                   top: int) -> Iterator[Metric]:
    bounded = bound_classes(classes, top)
    family = CounterMetricFamily(
        "zc_lb_class_requests", "Requests by class: the %d busiest classes, the rest "
        "summed as class=\"other\" (class=\"\" is no class)." % top, labels=["class"])
    for name, count in bounded.items():
        family.add_metric([name], count)
    yield family
    skilled = GaugeMetricFamily("zc_lb_class_workers",
                                "Workers whose résumé lists the class (busiest classes).",
                                labels=["class"])
    for name in bounded:
        if name != OTHER:
            skilled.add_metric([name], sum(1 for info in workers.values()
                                           if name in (info.get("skills") or {})))
    yield skilled
    yield GaugeMetricFamily("zc_lb_classes", "Classes in the status document: the "
                            "distinct ones up to its %d busiest, plus 'other'."
                            % STATUS_CLASSES, value=len(bound_classes(classes, STATUS_CLASSES)))


class WorkerCollector:
    """Metric families of a worker's status document (``zc-lb worker --status``)."""

    def __init__(self, get_status: Callable[[], dict]) -> None:
        self.get_status = get_status

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[Metric]:
        doc = self.get_status()
        yield build_info()
        requests = CounterMetricFamily(
            "zc_lb_app_requests", "Requests the worker's application served, by outcome "
            "(failed: a 5xx, an exception or a cancel).", labels=["outcome"])
        requests.add_metric(["served"], doc.get("served", 0))
        requests.add_metric(["failed"], doc.get("failed", 0))
        yield requests
        yield _counter("zc_lb_app_seconds", "Seconds the application spent on served "
                       "requests (what the résumé measures).", doc.get("app_seconds", 0))
        yield from latency_families(
            doc.get("latency"), "zc_lb_app_request_seconds",
            "Seconds the application took for each served request (its own time: not "
            "its wait for a thread, nor one seen queued inside it, nor one on the LB "
            "for the request's body or for room for the response).")
        yield GaugeMetricFamily("zc_lb_app_in_flight", "Requests being served now.",
                                value=doc.get("in_flight", 0))
        yield GaugeMetricFamily("zc_lb_app_resume_classes", "Classes in the résumé.",
                                value=len(doc.get("resume") or {}))
        yield GaugeMetricFamily("zc_lb_app_lbs", "LBs connected to the worker.",
                                value=len(doc.get("lbs") or ()))
        yield from _thread_families(doc.get("threads"))
        yield _counter("zc_lb_app_queued_seconds", "Seconds requests' threads were seen "
                       "queued inside the application behind others (thread mode), "
                       "taken off their time.", doc.get("queued_seconds", 0))


def _thread_families(threads: Optional[dict]) -> Iterator[Metric]:
    """A thread-mode worker's pool, from its status document's ``threads``."""
    if not threads:
        return
    yield GaugeMetricFamily(
        "zc_lb_app_threads_taking_requests", "Threads of the pool that take "
        "requests now (thread mode): two, and two for each request blocked "
        "outside the interpreter, at most the ceiling.",
        value=threads["taking_requests"])
    yield GaugeMetricFamily(
        "zc_lb_app_threads_ceiling", "Requests the application was last seen to "
        "serve at once (thread mode): --threads until a thread is seen queued "
        "on a lock inside it.", value=threads.get("ceiling", threads["size"]))
    yield GaugeMetricFamily(
        "zc_lb_app_threads_busy", "Threads running a request now (thread mode).",
        value=threads.get("busy", 0))
    yield GaugeMetricFamily(
        "zc_lb_app_threads_waiting", "Requests waiting for a thread (thread mode): "
        "the worker's queue (growing while every thread stays busy: a hung "
        "application).", value=threads.get("waiting", 0))


def exposition(collector) -> bytes:
    """``collector``'s metrics in the Prometheus text format."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return generate_latest(registry)


__all__ = ["LBCollector", "WorkerCollector", "exposition", "bound_classes",
           "CONTENT_TYPE_LATEST", "TOP_CLASSES"]
