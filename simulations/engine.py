"""The discrete-event engine: virtual time, workers, clients, the LB.

Theory of operation
-------------------

Events live in a heap of ``(time, sequence, kind, data)``; the sequence
number breaks ties so runs are deterministic.  Two kinds:

- ARRIVE: a client (closed loop) or the arrival process (open loop)
  issues a request.  The LB classifies it, asks the policy for a worker
  (``get``) and hands it over; if there is no worker at all it waits.
- DONE: a worker finished a request.  The policy hears ``put``, the
  worker's :class:`zc_lb.worker.resume.Skills` records (class, service time) and,
  every ``history`` requests, the résumé goes to the policy exactly as a
  real worker's would (``new_resume``).
- TIMER: with ``resume_interval``, a worker that has served something
  since its last résumé sends one when the interval since then is up, as
  a real worker's timer does (the checks that found nothing new count as
  the timer's restarts).  A timer moves no clock: a run's length is its
  requests'.

A worker serves ``concurrency`` requests at once and queues the rest in
order.  Serving touches the request's objects in the worker's LRU cache
when service starts; it takes ``base + hits * hit_cost + misses *
miss_cost``.  The backlog the policy sees is what it was given and has not
seen end: queued plus in service.  With ``threads`` the worker lets in
that many and the application serves ``concurrency`` of them: the rest
wait inside it, in order, and the time the worker records (its résumé,
what it tells the LB) counts that wait.  With ``connection_caches`` the
application's cache is per connection (ZODB): a request takes the
connection given back last, or opens one, and touches its cache.  With
``cache_signal`` the application says whether its cache hit (a request
with no miss), and the worker passes that on to the LB.

Scheduled actions (add or remove a worker, make a site hot, change the
classifier) happen just before the request numbered ``at`` is issued, so
they fall at the same point of the request stream for every policy.

A removed worker drains what it already has (the LB has forgotten it, so
its ``put`` is ignored) and its cache no longer counts for the overlap.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from typing import Any, Dict, List, Optional

from zc_lb.errors import ConfigurationError
from zc_lb.worker.resume import Skills
from zc_lb.routing.siblings import SYNC_INTERVAL, Siblings, sync

from . import policies
from .cache import Holders, LRUCache
from .config import Config
from .metrics import Recorder, recovery
from .workload import Workload

ARRIVE, DONE, TIMER = 0, 1, 2


class SimWorker:
    """One worker: a cache, skills, a queue and a few service slots."""

    __slots__ = ("id", "cache", "speed", "skills", "busy", "queue", "outstanding",
                 "hot", "alive", "served", "published_at", "published", "timer",
                 "measured", "measured_misses", "measured_big", "measured_busy",
                 "relayed_at", "serving", "inside", "connections", "free")

    def __init__(self, wid: int, config: Config, holders: Holders) -> None:
        self.id = wid
        sizes, speeds = config.cache_sizes, config.speeds
        self.cache = LRUCache(sizes[wid % len(sizes)] if sizes else config.cache_size, holders)
        self.speed = speeds[wid % len(speeds)] if speeds else 1.0
        self.skills = Skills(config.history, config.max_skill_age or None)
        self.busy = 0
        self.queue: deque = deque()
        self.outstanding = 0
        self.hot = 0  # outstanding requests of the hot site
        self.alive = True
        self.served = 0
        self.published_at = 0.0  # when its last résumé went out
        self.published = 0  # the skills' generation it had
        self.timer = False  # a TIMER event is pending
        # after the warm-up: requests served, their misses, and those of
        # the biggest classes (``Simulation.big_sites``)
        self.measured = self.measured_misses = self.measured_big = 0
        self.measured_busy = 0.0  # and the seconds the application took for them
        self.relayed_at = 0.0  # when the keys the LBs sent it were last relayed
        # With ``threads``: requests the application serves now, and those
        # let in that wait inside it (request, when let in).  With
        # ``connection_caches``: every connection's cache, and the free ones.
        self.serving = 0
        self.inside: deque = deque()
        self.connections: List[LRUCache] = [self.cache]
        self.free: List[LRUCache] = [self.cache]

    def __repr__(self) -> str:
        return "<SimWorker %d outstanding=%d>" % (self.id, self.outstanding)


class Simulation:
    """One policy on one workload; ``run()`` returns the results."""

    def __init__(self, config: Config, policy_name: str) -> None:
        self.config = config
        self.policy_name = policy_name
        seed = config.seed
        self.workload = Workload(config, random.Random(seed))
        self.timing = random.Random(seed * 7919 + 1)  # think times, arrivals
        # One policy per LB: each routes its share of the requests with its
        # own backlogs; every one hears every worker's résumés.
        self.lbs = [policies.make(policy_name, config, random.Random(seed * 31 + 2 + i))
                    for i in range(config.lbs)]
        for lb in self.lbs:
            if hasattr(lb, "lbs"):  # as ZooKeeper (or --processes) tells a real LB
                lb.lbs = config.lbs_told or config.lbs
            if hasattr(lb, "hash_seed"):
                lb.hash_seed = config.seed  # so that seeds vary the hashing too
        self.now = 0.0
        self.siblings: List[Any] = [None] * len(self.lbs)
        if config.siblings and len(self.lbs) > 1 and hasattr(self.lbs[0], "share_with"):
            # the LBs are one host's processes, sharing a book of keys and
            # their backlogs (zc_lb/routing/siblings.py), on the simulation's clock
            self.siblings = list(Siblings.in_memory(len(self.lbs), lambda: self.now))
            for lb, siblings in zip(self.lbs, self.siblings):
                lb.share_with(siblings)
        self.synced = [-1.0] * len(self.lbs)  # when each LB last took in its siblings'
        # (LBs told they are alone relay nothing, as a real LB that counts
        # one does not: zc_lb/lb/fleet.py)
        self.relaying = (not config.separate_books and len(self.lbs) > 1
                         and (config.lbs_told or config.lbs) > 1
                         and hasattr(self.lbs[0], "take_keys"))
        if self.relaying:
            for lb in self.lbs:
                lb.relayed = True
        self.policy = self.lbs[0]
        self.resumes = policies.uses_resumes(self.policy)
        self.holders = Holders(self.workload.total_objects)
        warmup = int(config.warmup * config.requests)
        self.recorder = Recorder(config.window, warmup, self.holders)
        self.workers: List[SimWorker] = []
        self.live: List[SimWorker] = []
        self.heap: List[Any] = []
        self.seq = 0
        self.now = 0.0
        self.issued = 0
        self.waiting: deque = deque()  # requests with no worker to go to
        self.actions = sorted(config.actions, key=lambda a: a["at"])
        self.joined: Dict[int, int] = {}  # added worker -> completions before
        self.join_completed = 0
        self.events: List[Dict[str, Any]] = []  # actions taken, with times
        # the biggest classes: the top tenth of the sites by popularity
        self.big_sites = max(1, len(self.workload.site_ids) // 10)
        for _ in range(config.workers):
            self.add_worker()

    # -- events ---------------------------------------------------------

    def push(self, time: float, kind: int, data: Any) -> None:
        """Schedule an event."""
        self.seq += 1
        heapq.heappush(self.heap, (time, self.seq, kind, data))

    def run(self) -> Dict[str, Any]:
        """Run to the end: every request issued and completed."""
        self.start_load()
        heap = self.heap
        pop = heapq.heappop
        while heap:
            now, _, kind, data = pop(heap)
            if kind == TIMER:
                self.timer(data, now)
                continue
            self.now = now
            if kind == DONE:
                self.done(data)
            else:
                self.issue(data)
        if self.waiting:  # (their clients wait for ever: nothing more was issued)
            raise ConfigurationError(
                "%d requests found no worker: the actions removed every worker and "
                "none was added in time" % len(self.waiting))
        return self.results()

    def start_load(self) -> None:
        """Schedule the first arrival of each client, or the arrival process."""
        config = self.config
        if config.clients > 0:
            for client in range(config.clients):
                self.push(self.think(), ARRIVE, client)
        else:
            self.push(self.timing.expovariate(config.arrival_rate), ARRIVE, -1)

    def think(self) -> float:
        """A closed-loop client's pause before its next request."""
        mean = self.config.think_time
        return self.timing.expovariate(1.0 / mean) if mean > 0 else 0.0

    # -- requests -------------------------------------------------------

    def issue(self, client: int) -> None:
        """A request arrives at the LB."""
        if self.issued >= self.config.requests:
            return
        while self.actions and self.actions[0]["at"] <= self.issued:
            self.act(self.actions.pop(0))
        self.issued += 1
        if client < 0:
            self.push(self.now + self.timing.expovariate(self.config.arrival_rate),
                      ARRIVE, -1)
        if self.issued % self.config.sample_every == 0:
            self.sample()
        site, label, objects, key = self.workload.next()
        lb = self.issued % len(self.lbs)  # clients spread over the LBs evenly
        self.route([site, label, objects, self.now, client, key, lb, None])

    def route(self, request: list) -> None:
        """Ask the policy for a worker and hand the request over."""
        lb = self.lbs[request[6]]
        siblings = self.siblings[request[6]]
        if siblings is not None and self.now - self.synced[request[6]] >= SYNC_INTERVAL:
            self.synced[request[6]] = self.now  # (as the LB does, on a request)
            sync(siblings, lb)
        wid, placed = lb.choose(request[1], request[5])
        if wid is None:
            self.waiting.append(request)
            return
        request[7] = placed  # (for ``served``, as the LB keeps it)
        worker = self.workers[wid]
        worker.outstanding += 1
        if request[0] == self.workload.hot_site:
            worker.hot += 1
        if worker.busy < (self.config.threads or self.config.concurrency):
            self.serve(worker, request)
        else:
            worker.queue.append(request)

    def serve(self, worker: SimWorker, request: list) -> None:
        """Let it in: serve it, or (``threads``) queue it inside the app."""
        worker.busy += 1
        if worker.serving < self.config.concurrency:
            self.start(worker, request, self.now)
        else:
            worker.inside.append((request, self.now))

    def start(self, worker: SimWorker, request: list, let_in: float) -> None:
        """Start serving: touch the objects, schedule the end."""
        config = self.config
        objects = request[2]
        cache = worker.cache
        if config.connection_caches:
            if worker.free:
                cache = worker.free.pop()
            else:
                cache = LRUCache(worker.cache.size, self.holders)
                worker.connections.append(cache)
        misses = cache.touch_all(objects)
        service = (config.base_cost + misses * config.miss_cost
                   + (len(objects) - misses) * config.hit_cost) / worker.speed
        worker.serving += 1
        # (what the worker records: its service, and any wait inside the app)
        self.push(self.now + service, DONE,
                  (worker, request, service + (self.now - let_in), misses, cache))

    def done(self, data: tuple) -> None:
        """A worker finished a request."""
        worker, request, service, misses, cache = data
        worker.busy -= 1
        worker.serving -= 1
        if self.config.connection_caches:
            worker.free.append(cache)
        if worker.inside:
            self.start(worker, *worker.inside.popleft())
        worker.outstanding -= 1
        worker.served += 1
        if request[0] == self.workload.hot_site:
            worker.hot -= 1
        lb = self.lbs[request[6]]
        # as the worker's response says
        if self.config.cache_signal:
            lb.served(request[7], service, misses == 0)
        else:
            lb.served(request[7], service)
        lb.put(worker.id)
        if self.relaying and self.now - worker.relayed_at >= self.config.relay_interval:
            self.relay(worker)
        resume = worker.skills.record(request[1], service)
        if resume is not None:
            self.publish(worker, resume, self.now)
        elif self.config.resume_interval and not worker.timer:
            self.arm(worker)
        if worker.queue:
            self.serve(worker, worker.queue.popleft())
        self.recorder.request(self.now, self.now - request[3], misses,
                              worker.id in self.joined)
        if self.recorder.summary is not None:
            worker.measured += 1
            worker.measured_misses += misses
            worker.measured_big += request[0] < self.big_sites
            worker.measured_busy += service
        if request[4] >= 0:
            self.push(self.now + self.think(), ARRIVE, request[4])

    def relay(self, worker: SimWorker) -> None:
        """Each LB's keys sent to ``worker`` since the last relay, to
        every other LB, as the worker relays them."""
        worker.relayed_at = self.now
        if not worker.alive:
            return
        for i, lb in enumerate(self.lbs):
            keys = lb.sent_keys(worker.id)
            if keys:
                for j, other in enumerate(self.lbs):
                    if j != i:
                        other.take_keys(worker.id, keys)

    def publish(self, worker: SimWorker, resume: Dict[str, float], now: float) -> None:
        """The worker's résumé goes to every LB."""
        worker.published_at, worker.published = now, worker.skills.generation
        if self.resumes and worker.alive:
            for lb in self.lbs:
                lb.new_resume(worker.id, resume)

    def arm(self, worker: SimWorker) -> None:
        """Schedule the worker's timer: the first of its checks, an
        interval apart since its last résumé, that is not yet past."""
        interval = self.config.resume_interval
        checks = max(1, math.ceil((self.now - worker.published_at) / interval))
        worker.timer = True
        self.push(worker.published_at + checks * interval, TIMER, worker)

    def timer(self, worker: SimWorker, now: float) -> None:
        """The worker's timer: a résumé, if something was served since the
        last and the interval since it is up (one every ``history``
        requests may have gone out meanwhile: then wait for its interval)."""
        worker.timer = False
        if worker.skills.generation == worker.published:
            return
        due = worker.published_at + self.config.resume_interval
        if now < due:
            worker.timer = True
            self.push(due, TIMER, worker)
        else:
            self.publish(worker, worker.skills.resume(), now)

    # -- measurement ----------------------------------------------------

    def sample(self) -> None:
        """Snapshot backlogs: imbalance, whether a worker is idle while
        another has requests waiting, and the hot site's share."""
        live = self.live
        if not live:
            return
        total = sum(w.outstanding for w in live)
        imbalance = None
        if total:
            imbalance = max(w.outstanding for w in live) * len(live) / total
        serves = self.config.concurrency  # (at once, by the application)
        idle = (any(w.outstanding == 0 for w in live)
                and any(w.outstanding > serves for w in live))
        hot_workers = hot_backlog = None
        if self.workload.hot_fraction:
            hot = sum(w.hot for w in live)
            hot_workers = sum(1 for w in live if w.hot) / len(live)
            hot_backlog = hot / total if total else 0.0
        self.recorder.sample(imbalance, hot_workers, hot_backlog, idle)

    def results(self) -> Dict[str, Any]:
        """Summary and windows of the run."""
        summary = self.recorder.finish(self.now)
        summary["virtual_seconds"] = self.now
        if self.events:
            summary["recovery_requests"] = recovery(
                self.recorder.windows, self.events[0]["at"])
        if self.joined:
            added = sum(self.workers[w].served - before
                        for w, before in self.joined.items())
            since = self.recorder.completed - self.join_completed
            summary["new_worker_share"] = added / since if since else 0.0
            summary["fair_share"] = len(self.joined) / len(self.live)
        if self.config.cache_sizes or self.config.speeds:
            summary["by_kind"] = self.by_kind()
        summary.update(self.least_busy())
        return {"policy": self.policy_name, "summary": summary,
                "windows": self.recorder.windows, "events": self.events}

    def least_busy(self) -> Dict[str, float]:
        """The least busy worker after the warm-up, as the share of a fair
        share of the requests it served (``least_share``: 1 is a fair
        share) and of the mean work (``least_busy``: the seconds its
        application took, over the workers' mean).  A worker serving
        fewer requests than others may be as busy, with dearer ones."""
        live = self.live
        served = sum(w.measured for w in live)
        busy = sum(w.measured_busy for w in live)
        if not served or not busy:
            return {}
        return {"least_share": min(w.measured for w in live) * len(live) / served,
                "least_busy": min(w.measured_busy for w in live) * len(live) / busy}

    def by_kind(self) -> Dict[str, Dict[str, float]]:
        """For a mixed fleet, per kind of worker (cache size and speed):
        its share of the requests after the warm-up against its share of
        the workers, its misses per request, and its share of the biggest
        classes' requests."""
        kinds: Dict[str, List[SimWorker]] = {}
        for worker in self.live:
            kinds.setdefault("cache %d speed %g" % (worker.cache.size, worker.speed),
                             []).append(worker)
        served = sum(w.measured for w in self.live) or 1
        big = sum(w.measured_big for w in self.live) or 1
        return {kind: {"workers": len(workers),
                       "fair_share": len(workers) / len(self.live),
                       "share": sum(w.measured for w in workers) / served,
                       "big_class_share": sum(w.measured_big for w in workers) / big,
                       "misses_per_request": (sum(w.measured_misses for w in workers)
                                              / max(1, sum(w.measured for w in workers)))}
                for kind, workers in sorted(kinds.items())}

    # -- actions --------------------------------------------------------

    def act(self, action: Dict[str, Any]) -> None:
        """Carry out one scheduled action."""
        kind = action["do"]
        self.events.append({"time": self.now, "at": self.issued, "do": kind})
        if kind == "add_worker":
            self.join_completed = self.recorder.completed
            wid = self.add_worker()
            self.joined[wid] = 0
            self.recorder.worker_added()
        elif kind == "remove_worker":
            self.remove_worker(action.get("worker"))
        elif kind == "hot_site":
            self.workload.make_hot(action["site"], action["fraction"])
        elif kind == "change_classifier":
            self.workload.change_classifier(action.get("mode", "rename"))
            if action.get("reset_skills") and hasattr(self.policy, "reset_skills"):
                self.reset_skills()
        else:
            raise ValueError("unknown action %r" % (kind,))

    def reset_skills(self) -> None:
        """The operator's reset: every worker and the LB forget skills."""
        for worker in self.live:
            worker.skills.reset()
        for lb in self.lbs:
            lb.reset_skills()

    def add_worker(self) -> int:
        """A new worker with a cold cache and no skills joins the pool."""
        worker = SimWorker(len(self.workers), self.config, self.holders)
        self.workers.append(worker)
        self.live.append(worker)
        for lb in self.lbs:
            lb.add(worker.id)
        while self.waiting:
            self.route(self.waiting.popleft())
        return worker.id

    def remove_worker(self, wid: Optional[int] = None) -> None:
        """Take a worker (the busiest-skilled one by default: worker 0) away."""
        if wid is None and self.live:
            wid = self.live[0].id
        if wid is None or wid >= len(self.workers) or not self.workers[wid].alive:
            raise ConfigurationError("remove_worker at request %d: no worker %s to remove"
                                     % (self.issued, "left" if wid is None else wid))
        worker = self.workers[wid]
        worker.alive = False
        self.live.remove(worker)
        for lb in self.lbs:
            lb.remove(worker.id)
        for cache in worker.connections:
            cache.clear()


def simulate(config: Config, policy_name: str) -> Dict[str, Any]:
    """Run one policy on ``config``'s workload."""
    return Simulation(config, policy_name).run()
