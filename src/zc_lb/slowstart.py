"""Slow start: a worker added to a running pool takes its share without a
storm of misses.  A part of ``affinity.AffinityPool``.

Theory of operation
-------------------

A worker added to a running pool ramps up over ``slow_start`` requests
of the pool.  While its recent share of requests is under its due (its
fair share times the ramp) it joins the next class that comes big enough
for the rest of its fair share with at most half its keys (once
``PRIOR`` requests per worker have passed without one: the next worth a
whole worker, then half a worker, a quarter..., halving every ``PRIOR``
requests per worker without a join, so that many small classes or a
light load still give it its share), taking enough of the class's keys for the rest of its
fair share: its weight is floored at a ratio of the other members' mean
score, so its cold cache, which ranks it last in its own résumé, does
not cost it the keys before it has warmed them.  Few classes warm a cold
cache soonest, so while it starts it is not spilled to (as the least
recently chosen worker it would be, and a class it does not hold costs
it a load per object).  It never takes more than the pool's mean backlog
while it starts, so its cold cache does not turn into a storm of misses:
keys it cannot take yet go on to their next owner, the one that held
them.  Keys are not alike (a third of a class's keys may carry a fifth
of its requests): after ``OFFERED`` requests of a class it joined, a
starter whose keys carried less than the share it came for raises its
floor there, once, by the ratio (at most ``MOST_RAISED``).

It is done starting once it has its share after the ramp, and its
floors then follow its share: they fade by e every ``FADE`` ramps while
it takes more than ``OFF_FAIR`` over its fair share, and come back
(never above where they were) while it takes as much less, until
``GIVE_UP`` ramps after it came.  (A worker still short of its share
then is done starting anyway, its floors as they are.)  A floor that made up
for a cold cache is worth too much once the cache is warm, and the keys
it bought may carry more than the share they were for: with its floors
kept, the simulator's added worker ended at 1.3-1.5 times its fair
share.  A floor fades only down to the résumé's ranking, below which it
no longer counts: a worker whose score alone ranks it high keeps what
its score earns.

Weak spot, admitted.  ``GIVE_UP`` ramps after a worker came, its floors
stay as they are whatever its résumé says later, so a worker that is
slow for good keeps the keys it then holds.
"""

from __future__ import annotations

from typing import Dict, Hashable, List

from .classstats import PRIOR, ClassStats, PoolPart, rendezvous_weight
from .pool import PoolWorker
from .relearn import adopted

STARTED = 0.9  # a starter is behind while under 90% of its ramp's share
BIG_CLASS = 1.0  # a starter joins classes worth a whole worker or more
OFFERED = 400  # requests of a joined class before a starter checks its keys
MOST_RAISED = 4.0  # the most that check raises its floor by
GIVE_UP = 25  # slow starts after which a worker is done starting anyway
CLASS_TAKE = 0.5  # the most of a class's keys a starter takes
OFF_FAIR = 0.05  # a worker done starting is off its share beyond 5% of fair
FADE = 4  # slow starts in which its floors change by e while it is off
AT_ONCE = 100  # pool requests of a slow start with slow_start 0 ("at once")


class Starter:
    """A worker in slow start: when it came, and its recent requests."""

    __slots__ = ("added", "recent", "seen", "joined", "offered", "most", "last_join")

    def __init__(self, added: int) -> None:
        self.added = added  # pool requests when it was added
        self.last_join = added  # pool requests when it last joined a class
        self.joined: Dict[ClassStats, float] = {}  # classes joined -> share expected
        self.recent = 0.0  # its requests, decayed over the slow start
        self.seen = added
        # joined class -> [its requests since, those whose key it owns]
        self.offered: Dict[ClassStats, List[int]] = {}
        # joined class -> its floor when done starting: the most it fades to
        self.most: Dict[ClassStats, float] = {}

    def got(self, now: int, horizon: int) -> None:
        """It was given a request at pool request ``now``."""
        self.recent = self.recent * (1.0 - 1.0 / horizon) ** (now - self.seen) + 1.0
        self.seen = now

    def share(self, now: int, horizon: int) -> float:
        """Its share of the pool's recent requests."""
        decay = 1.0 - 1.0 / horizon
        total = (1.0 - decay ** (now - self.added)) / (1.0 - decay)
        if total <= 0:
            return 0.0
        return self.recent * decay ** (now - self.seen) / total


class SlowStart(PoolPart):
    """The affinity pool's slow start (see the module docstring)."""

    slow_start: int
    starting: Dict[PoolWorker, Starter]
    fading: Dict[PoolWorker, Starter]

    def _chosen(self, worker: PoolWorker) -> Hashable:
        if self.starting or self.fading:
            starter = self.starting.get(worker) or self.fading.get(worker)
            if starter is not None:
                starter.got(self.requests, self._horizon)
        return super()._chosen(worker)

    def _slow_start(self, rclass: str, stats: ClassStats) -> None:
        """Make a starting worker that is behind its ramp, and not busier
        than the mean, one of ``rclass``'s members, so it takes
        whole keys of warm classes; one that has its share after the ramp
        is done starting."""
        skilled = self.skilled.get(rclass)
        if skilled is None:
            skilled = self.skilled[rclass] = {}
        fair = 1.0 / len(self.workers)
        for worker, starter in list(self.starting.items()):
            ramp = self._ramp(worker)
            share = starter.share(self.requests, self._horizon)
            if share >= ramp * fair * STARTED:
                if ramp >= 1.0:
                    self._done(worker, starter)
                continue
            if self.requests - starter.added > GIVE_UP * self._horizon:
                del self.starting[worker]
                continue
            if sum(starter.joined.values()) >= fair * STARTED:
                continue  # what it holds is enough once its cache is warm
            busy = worker.backlog * len(self.workers) > self.backlog
            cshare = stats.count / self.total
            due = fair - sum(starter.joined.values())
            # One class whose keys cover the rest of its due, or once any
            # such class would have come (PRIOR requests per worker), any
            # worth a whole worker: a cold cache warms soonest on few
            # classes' data.
            if self.requests - starter.added <= PRIOR * len(self.workers):
                big = cshare * CLASS_TAKE >= due
            else:
                big = cshare * len(self.workers) >= self._big(starter)
            if worker not in skilled and big and not busy:
                # Take enough of this class's keys for the rest of its due,
                # at most half.
                take = min(CLASS_TAKE, due / cshare)
                members = len(stats.members) if stats.members else len(skilled)
                score = min(skilled.values()) if skilled else self.unskilled_score
                skilled[worker] = worker.resume[rclass] = score
                if stats.floors is None:
                    stats.floors = {}
                stats.floors[worker] = take / (1.0 - take) * max(members, 1)
                starter.joined[stats] = take * cshare
                starter.offered[stats] = [0, 0]
                starter.last_join = self.requests
                self.skills_version += 1
                return

    def _big(self, starter: Starter) -> float:
        """How many workers' worth a class must be for a starter to join it:
        BIG_CLASS, halved every PRIOR requests per worker that pass without
        a join, so that a site of many small classes (none worth a whole
        worker), or a light load, still gives a new worker its share."""
        per_worker = PRIOR * len(self.workers)
        waited = self.requests - max(starter.added + per_worker, starter.last_join)
        return BIG_CLASS * 0.5 ** max(waited / per_worker, 0.0)

    def _offer(self, stats: ClassStats, members: Dict[PoolWorker, float],
               key_hash: int) -> None:
        """Count, for a starter that joined the class, whether it owns the
        key; after ``OFFERED`` requests of the class, raise its floor once
        if its keys carry less than the share it came for (keys are not
        alike: a third of them may carry a fifth of the requests)."""
        for worker, starter in self.starting.items():
            counts = starter.offered.get(stats)
            if counts is None or worker not in members:
                continue
            counts[0] += 1
            weight = rendezvous_weight(key_hash, worker.salt, members[worker])
            if all(rendezvous_weight(key_hash, other.salt, score) <= weight
                   for other, score in members.items()):
                counts[1] += 1
            floors = stats.floors
            joined = starter.joined.get(stats)
            if (counts[0] == OFFERED and floors and joined is not None
                    and not adopted(floors.get(worker))):
                expected = joined * self.total / stats.count
                got = max(counts[1], 1) / counts[0]
                if got < expected:
                    floors[worker] *= min(expected / got, MOST_RAISED)
                    self.skills_version += 1

    def _done(self, worker: PoolWorker, starter: Starter) -> None:
        """The worker has its share after the ramp: it is done starting,
        and its floors start fading (see ``_fade``)."""
        del self.starting[worker]
        for stats in starter.joined:
            floors = stats.floors
            if floors and not adopted(floors.get(worker)):
                starter.most[stats] = floors[worker]
        if starter.most:
            self.fading[worker] = starter

    def _fade(self) -> None:
        """Move the floors of the workers done starting toward their fair
        share: down while a worker takes more than ``OFF_FAIR`` over it, up
        (to at most where they were) while it takes that much less.  A
        floor that made up for a cold cache is worth too much once the
        cache is warm, and a starter's keys may carry more than the share
        it came for (keys are not alike), so without this it would keep
        more than its share for good.  Floors change by e every ``FADE``
        slow starts, slower than its share is measured, so they follow
        the share rather than its noise (a class's members pick them up
        when next worked out); ``GIVE_UP`` slow starts after the worker
        came, they stay as they are."""
        fair = 1.0 / len(self.workers)
        fade = 1.0 - 1.0 / (FADE * self._horizon)
        for worker, starter in list(self.fading.items()):
            if self.requests - starter.added > GIVE_UP * self._horizon:
                del self.fading[worker]
                continue
            off = starter.share(self.requests, self._horizon) / fair - 1.0
            if -OFF_FAIR <= off <= OFF_FAIR:
                continue
            factor = fade if off > 0 else 1.0 / fade
            for stats, most in starter.most.items():
                floors = stats.floors
                if floors and not adopted(floors.get(worker)):
                    floors[worker] = min(floors[worker] * factor, most)

    @property
    def _horizon(self) -> int:
        """The pool requests a slow start takes: ``slow_start``, and for 0
        ("at once") ``AT_ONCE``, enough for the joins that give a new
        worker its share (without them it was given none at all)."""
        return self.slow_start or AT_ONCE

    def _ramp(self, worker: PoolWorker) -> float:
        """How far a starting worker is into its slow start, in (0, 1]."""
        done = (self.requests - self.starting[worker].added) / self._horizon
        return min(max(done, 0.01), 1.0)
