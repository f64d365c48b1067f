"""The LB's counters: what its status document and its metrics read.

Each is a plain increment or dict update per request, no lock and no
labels, read at scrape time (status/metrics.py).  Per-class counts are
bounded: at most ``MAX_COUNTED_CLASSES`` classes are counted by name
(the status address lists the ``STATUS_CLASSES`` busiest, the rest
summed as ``OTHER_CLASS``, unless asked for all);
when a new one comes and the table is full, the tenth of them with the
fewest requests (the oldest first among equals) is folded into
``OTHER_CLASS``, so that the busiest classes keep their names whatever
came first, and no count goes back.  A worker's counts are kept
while the LB knows its address (``worker_added`` to ``worker_removed``);
the counts of workers gone, and of their answers that end after, are
added up in ``retired``, so that totals over workers never go back
either.  Latency is counted until
the response starts (its head is with the front server), in the fixed
buckets of ``settings.LATENCY_BUCKETS``, so that a request costs one
bisect and one list increment: in all, by the worker that answered (the
last, after retries), and by counted class.
"""

from __future__ import annotations

import collections
import logging
import time
from bisect import bisect_left
from typing import Dict, List, Optional, Set, Tuple

from zc_lb.settings import LATENCY_BUCKETS

log = logging.getLogger(__name__)

MAX_COUNTED_CLASSES = 1000  # classes counted by name at once (the rest: OTHER_CLASS)
OTHER_CLASS = "other"
STATUS_CLASSES = 100  # the busiest classes in the status document (the rest: OTHER_CLASS)
RECENT_ERRORS = 20  # error responses kept for the status page
MAX_CLASSIFIER_ERRORS = 100  # distinct classifier errors kept in status
MAX_CLASSIFIER_ERROR = 200  # characters of one kept (its message may hold what a client sent)
MAX_FAILED_AT = 1000  # places a classifier failed at that are remembered as logged


class Counters:
    """Requests, retries, errors and latency, in all, by worker address
    and by class."""

    def __init__(self) -> None:
        self.started = time.time()
        self.requests = 0
        self.retries = 0
        self.retries_refused = 0  # retries the budget did not allow
        self.errors: Dict[int, int] = {}  # by status
        self.error_causes: Dict[str, int] = {}  # exception class name -> count
        self.recent_errors: "collections.deque[dict]" = collections.deque(maxlen=RECENT_ERRORS)
        self.classifier_errors: Dict[str, int] = {}
        self.classifier_failed_at: Set[Tuple[str, str, int]] = set()  # (logged: ``failed_at``)
        # address -> what -> count (a dict each: no key tuple to build and hash a
        # request), for the known workers; the workers gone: what -> count
        self.workers: Dict[str, Dict[str, int]] = {}
        self.retired: Dict[str, int] = {}
        self.classes: Dict[str, int] = {}
        self.latency = [0] * (len(LATENCY_BUCKETS) + 1)
        self.latency_sum = 0.0
        # The same by worker address and by counted class: [counts..., sum].
        self.worker_latency: Dict[str, List[float]] = {}
        self.class_latency: Dict[str, List[float]] = {}

    def count_class(self, name: str) -> str:
        """Count a request of class ``name`` ("" for none); the name it is
        counted under."""
        classes = self.classes
        count = classes.get(name)
        if count is None:
            count = 0
            if len(classes) - (OTHER_CLASS in classes) >= MAX_COUNTED_CLASSES:
                self._evict_classes()
        classes[name] = count + 1
        return name

    def _evict_classes(self) -> None:
        """Fold the tenth of the counted classes with the fewest requests
        (the oldest first among equals: a class just come is not the
        first to go) into ``OTHER_CLASS``, latency too."""
        classes = self.classes
        named = [name for name in classes if name != OTHER_CLASS]
        named.sort(key=classes.__getitem__)  # (stable: the oldest first among equals)
        other = classes.get(OTHER_CLASS, 0)
        for name in named[:max(1, MAX_COUNTED_CLASSES // 10)]:
            other += classes.pop(name)
            latency = self.class_latency.pop(name, None)
            if latency is not None:
                into = self.class_latency.get(OTHER_CLASS)
                if into is None:
                    self.class_latency[OTHER_CLASS] = latency
                else:
                    for i, value in enumerate(latency):
                        into[i] += value
        classes[OTHER_CLASS] = other

    def worker_added(self, address: str) -> None:
        """A worker address is known: its counts begin."""
        self.workers.setdefault(address, {})

    def worker_counts(self, address: str) -> Dict[str, int]:
        """The counts of worker ``address``: its own while it is known,
        else the retired workers' (an answer that ends after its worker
        was removed)."""
        counts = self.workers.get(address)
        return self.retired if counts is None else counts

    def count_latency(self, elapsed: float, worker: Optional[str],
                      counted_class: Optional[str]) -> None:
        """A response started ``elapsed`` seconds after its request came."""
        bucket = bisect_left(LATENCY_BUCKETS, elapsed)
        self.latency[bucket] += 1
        self.latency_sum += elapsed
        if worker is not None and worker not in self.workers:
            worker = None  # (removed meanwhile: its series ended)
        if counted_class is not None and counted_class not in self.classes:
            counted_class = OTHER_CLASS  # (folded into it meanwhile)
        for table, name in ((self.worker_latency, worker),
                            (self.class_latency, counted_class)):
            if name is not None:
                counts = table.get(name)
                if counts is None:
                    counts = table[name] = [0.0] * (len(LATENCY_BUCKETS) + 2)
                counts[bucket] += 1
                counts[-1] += elapsed

    def count_error(self, status: int, cause: str, message: str,
                    environ: Optional[dict]) -> None:
        """An error response: by status, by cause, and among the recent."""
        self.errors[status] = self.errors.get(status, 0) + 1
        self.error_causes[cause] = self.error_causes.get(cause, 0) + 1
        environ = environ or {}
        self.recent_errors.append({
            "time": round(time.time(), 3), "status": status, "cause": cause,
            "method": environ.get("REQUEST_METHOD"), "path": environ.get("PATH_INFO"),
            "message": message[:200]})

    def classifier_failed(self, exc: BaseException) -> None:
        """A classifier or key function raised: counted by its error (the
        message cut to ``MAX_CLASSIFIER_ERROR``), and logged once per
        type of error and where it was raised (``failed_at``): a message
        may say what each client sent, and each must not log a
        traceback."""
        error = ("%s: %s" % (type(exc).__name__, exc))[:MAX_CLASSIFIER_ERROR]
        count = self.classifier_errors.get(error, 0) + 1
        self.classifier_errors[error] = count
        if count == 1 and len(self.classifier_errors) > MAX_CLASSIFIER_ERRORS:
            self.classifier_errors.pop(next(iter(self.classifier_errors)))
        where = failed_at(exc)
        if where not in self.classifier_failed_at:
            if len(self.classifier_failed_at) >= MAX_FAILED_AT:
                self.classifier_failed_at.clear()
            self.classifier_failed_at.add(where)
            log.error("classifier failed (routing such requests without a class; "
                      "logged once, counted in status)", exc_info=exc)

    def worker_removed(self, address: str) -> None:
        """A worker address is gone for good: its series end with it, its
        counts added to the retired workers'."""
        counts = self.workers.pop(address, None)
        if counts:
            retired = self.retired
            for what, count in counts.items():
                retired[what] = retired.get(what, 0) + count
        self.worker_latency.pop(address, None)

    def document(self) -> dict:
        """The counters' part of the LB's status document, with every
        class counted (``top_classes`` bounds them for a reader)."""
        classes = self.classes
        return {
            "requests": self.requests,
            "retries": self.retries,
            "errors": {str(k): v for k, v in sorted(self.errors.items())},
            "uptime": round(time.time() - self.started, 1),
            "classifier_errors": dict(self.classifier_errors),
            "retries_refused": self.retries_refused,
            "latency": {"buckets": list(LATENCY_BUCKETS), "counts": list(self.latency),
                        "sum": round(self.latency_sum, 6)},
            "error_causes": dict(self.error_causes),
            "recent_errors": list(self.recent_errors),
            "classes": dict(classes),
            "class_latency": {name: histogram(counts)
                              for name, counts in self.class_latency.items()},
            "retired_workers": dict(self.retired),
        }

    def add_to_workers(self, workers: Dict[str, dict]) -> Dict[str, dict]:
        """The status document's ``workers`` (by address), with this LB's
        counts of each one's answers and their latency."""
        for address, counts in list(self.workers.items()):
            if address in workers:
                workers[address]["counts"].update(counts)
        for address, latency in self.worker_latency.items():
            if address in workers:
                workers[address]["latency"] = histogram(latency)
        return workers


def histogram(counts: List[float]) -> dict:
    """A latency histogram as the status document gives it, from
    [count per bucket..., sum of seconds]."""
    return {"buckets": list(LATENCY_BUCKETS), "counts": [int(n) for n in counts[:-1]],
            "sum": round(counts[-1], 6)}


def top_classes(counts: Dict[str, int], n: int) -> Dict[str, int]:
    """The ``n`` classes with the most requests, the rest summed as OTHER_CLASS."""
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    top = {name: count for name, count in ranked[:n] if name != OTHER_CLASS}
    rest = sum(count for name, count in counts.items() if name not in top)
    if rest:
        top[OTHER_CLASS] = rest
    return top


def failed_at(exc: BaseException) -> Tuple[str, str, int]:
    """An error's type, and the file and line it was raised at."""
    tb = exc.__traceback__
    filename, line = "", 0
    while tb is not None:
        filename, line = tb.tb_frame.f_code.co_filename, tb.tb_lineno
        tb = tb.tb_next
    return type(exc).__name__, filename, line
