"""Whether a worker sat idle while another had requests waiting, on a
running site: the simulator's ``idle`` column, measured live.

While a replay runs, a thread reads each zc-lb LB's status document
(``zc_lb.status.document.fetch``) every ``interval`` seconds and sums
each worker's backlog, its requests in flight, over the LBs (workers
out of the pool left out: down, ejected or drained, they are not idle).
A sample is *idle* when some worker had none while another had more
than its application serves at once (``concurrency``): a request waited
that the idle worker could have started.  An application with no bound
(``concurrency`` 0) keeps no request waiting, so ``idle`` is None.  A
worker's *busy* share is the share of samples in which it had a request
in flight, over the mean of those shares, so that 1 is a fair share of
the time: a worker whose requests cost more serves fewer of them and
is as busy.

Usage::

    with BacklogSampler(["127.0.0.1:8081"], concurrency=1) as sampler:
        replay(...)
    sampler.summary()  # {"samples": ..., "idle": ..., "busy": {...}}

Weak spots: a sample is a moment, so a spell shorter than ``interval``
is missed or counted whole; several LBs are read one after the other, a
few milliseconds apart.  Measuring costs what it measures: each LB
writes its status document 20 times a second, about 0.5 ms of CPU each
with 6 workers (asked without skills or classes, ``?skills=0&classes=0``:
8 KB where the full one was 42 KB on NASA, and 0.6 ms), counted in its
time a request, and the sampler is a thread beside the replay's
clients; HAProxy runs carry neither cost.
"""

from __future__ import annotations

import threading
from typing import Dict, List, Optional, Sequence

INTERVAL = 0.05  # seconds between samples
LIGHT = {"skills": "0", "classes": "0"}  # the document's backlogs, without skills or classes


class BacklogSampler:
    """Samples of each worker's backlog, summed over the LBs whose status
    addresses are ``statuses``, taken while the ``with`` block runs."""

    def __init__(self, statuses: Sequence[str], concurrency: int,
                 interval: float = INTERVAL) -> None:
        self.statuses = list(statuses)
        self.serves = concurrency  # requests a worker's app serves at once; 0: no bound
        self.interval = interval
        self.samples: List[Dict[str, int]] = []
        self.failures = 0  # status reads that failed (an LB busy past the timeout)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "BacklogSampler":
        if self.statuses:
            self._thread = threading.Thread(target=self._run, name="backlogs", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        from zc_lb.status.document import fetch

        while not self._stop.wait(self.interval):
            sample: Dict[str, int] = {}
            try:
                for status in self.statuses:
                    doc = fetch(status, timeout=1.0, params=LIGHT)
                    for worker, info in doc.get("workers", {}).items():
                        if info.get("in_pool", True):
                            sample[worker] = sample.get(worker, 0) + int(info.get("backlog") or 0)
            except Exception:  # (any failed read, not only the ones fetch names)
                self.failures += 1
                continue
            if sample:
                self.samples.append(sample)

    def summary(self) -> dict:
        """``samples``; ``idle``, the share of them in which a worker had
        nothing in flight while another had requests waiting (None
        without samples, or for an app with no bound); ``busy``, worker
        -> its share of samples with a request in flight over the mean
        share; ``failures``."""
        idle = 0
        in_flight: Dict[str, int] = {}
        for sample in self.samples:
            backlogs = sample.values()
            if self.serves and min(backlogs) == 0 and max(backlogs) > self.serves:
                idle += 1
            for worker, backlog in sample.items():
                in_flight[worker] = in_flight.get(worker, 0) + (backlog > 0)
        mean = sum(in_flight.values()) / len(in_flight) if in_flight else 0.0
        return {
            "samples": len(self.samples),
            "idle": idle / len(self.samples) if self.samples and self.serves else None,
            "busy": {worker: count / mean for worker, count in in_flight.items()} if mean else {},
            "failures": self.failures,
        }
