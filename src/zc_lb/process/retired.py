"""The counters of the LB processes of ``--processes N`` that ended.

The supervisor's status document sums its children's.  A child that
dies is started again counting from nothing, under a new status
address: summed over the children that run, the supervisor's counters
would go back by all the one that died had counted, which Prometheus
takes for a reset of the whole sum (its ``rate`` and ``increase`` then
count the other children's totals again, as new requests).  So the
supervisor keeps the counters of each child's last document once the
child has ended (``Retired.add``), none of its gauges (an ended process
has nothing in flight, no client, no buffer), and adds them to every sum
(``Retired.into``): summed counters never go back.  A worker the
children no longer know has its counts added to ``retired_workers``, as
an LB adds a worker's it forgets.
"""

from __future__ import annotations

from typing import Dict, Optional

from zc_lb.status.document import POOL_COUNTERS, add_histograms, cap_classes

COUNTERS = ("requests", "retries", "retries_refused", "worker_failures", "ejections",
            "health_checks")  # the document's top-level counters
COUNTS = ("errors", "error_causes", "classifier_errors", "classes", "retired_workers")
BUFFER_COUNTERS = ("spilled", "stalled")


def _add(into: Dict[str, int], counts: Dict[str, int]) -> None:
    for name, count in counts.items():
        if isinstance(count, int) and not isinstance(count, bool):
            into[name] = into.get(name, 0) + count


class Retired:
    """What the children that ended had counted, added up."""

    def __init__(self) -> None:
        self.counters: Dict[str, int] = {}
        self.counts: Dict[str, Dict[str, int]] = {name: {} for name in COUNTS}
        self.buffers: Dict[str, int] = {}
        self.pool: Dict[str, int] = {}
        self.latency: Optional[dict] = None
        self.class_latency: Dict[str, dict] = {}
        self.workers: Dict[str, Dict[str, int]] = {}  # worker address -> its counts
        self.worker_latency: Dict[str, dict] = {}

    def add(self, doc: dict) -> None:
        """Keep the counters of ``doc``, the last status document of a
        child that has ended."""
        if "workers" not in doc:  # (an error, in place of a document)
            return
        _add(self.counters, {name: doc[name] for name in COUNTERS if name in doc})
        for name in COUNTS:
            _add(self.counts[name], doc.get(name) or {})
        buffers = doc.get("buffers") or {}
        _add(self.buffers, {name: buffers[name] for name in BUFFER_COUNTERS if name in buffers})
        pool = doc.get("pool") or {}
        _add(self.pool, {name: pool[name] for name in POOL_COUNTERS if name in pool})
        if doc.get("latency"):
            self.latency = add_histograms(self.latency, doc["latency"])
        for name, histogram in (doc.get("class_latency") or {}).items():
            self.class_latency[name] = add_histograms(self.class_latency.get(name), histogram)
        for address, info in doc["workers"].items():
            _add(self.workers.setdefault(address, {}), info.get("counts") or {})
            if info.get("latency"):
                self.worker_latency[address] = add_histograms(
                    self.worker_latency.get(address), info["latency"])
        # (each document holds its busiest classes, but children that end
        # again and again may each bring others: as many kept as one holds)
        kept: Dict[str, dict] = {"classes": self.counts["classes"],
                                 "class_latency": self.class_latency}
        cap_classes(kept)
        self.counts["classes"] = kept["classes"]

    def into(self, merged: dict) -> dict:
        """Add what the children that ended counted to ``merged``, the sum of
        the others' documents (``merge_status``); ``merged``."""
        for name, count in self.counters.items():
            merged[name] = merged.get(name, 0) + count
        for name, counts in self.counts.items():
            if counts:
                _add(merged.setdefault(name, {}), counts)
        if self.buffers:
            _add(merged.setdefault("buffers", {}), self.buffers)
        if self.pool:
            _add(merged.setdefault("pool", {}), self.pool)
        if self.latency is not None:
            merged["latency"] = add_histograms(merged.get("latency"), self.latency)
        for name, histogram in self.class_latency.items():
            into = merged.setdefault("class_latency", {})
            into[name] = add_histograms(into.get(name), histogram)
        cap_classes(merged)  # (as many as the sum of the others' may hold)
        workers = merged.setdefault("workers", {})
        for address, counts in self.workers.items():
            info = workers.get(address)
            if info is None:  # (gone from every child: counted as an LB counts one gone)
                _add(merged.setdefault("retired_workers", {}), counts)
                continue
            _add(info.setdefault("counts", {}), counts)
            if address in self.worker_latency:
                info["latency"] = add_histograms(info.get("latency"),
                                                 self.worker_latency[address])
        return merged
