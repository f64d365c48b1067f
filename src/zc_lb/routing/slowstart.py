"""Slow start: a worker added to a running pool takes its share without a
storm of misses: ``SlowStart``, a part that ``affinity.AffinityPool``
holds and calls.

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

Structure.  ``SlowStart`` owns the starters and the workers whose floors
fade (``Starter`` records), and keeps nothing of the pool's: the pool
tells it of workers added and removed (``add``, ``remove``), of each
request given (``got``) and of a worker no longer skilled in a class it
joined (``left``), and asks it to let a starter join a request's class
(``join``, given the class's skilled workers and the pool's numbers it
needs), to check the starters' keys (``offer``) and to fade floors
(``fade``).  ``join`` says which worker joined and ``offer`` how
many floors it raised, so that the pool, which counts changes of skills
(``skills_version``), marks them.  The pool reads ``starting`` and
``fading`` (the same dicts) on its own path.

Weak spot, admitted.  ``GIVE_UP`` ramps after a worker came, its floors
stay as they are whatever its résumé says later, so a worker that is
slow for good keeps the keys it then holds.
"""

from __future__ import annotations

from typing import Dict, Final, List, Optional

from zc_lb.routing.classstats import PRIOR, ClassStats, rendezvous_weight
from zc_lb.routing.pool import PoolWorker
from zc_lb.routing.relearn import adopted

STARTED: Final = 0.9  # a starter is behind while under 90% of its ramp's share
BIG_CLASS: Final = 1.0  # a starter joins classes worth a whole worker or more
OFFERED: Final = 400  # requests of a joined class before a starter checks its keys
MOST_RAISED: Final = 4.0  # the most that check raises its floor by
GIVE_UP: Final = 25  # slow starts after which a worker is done starting anyway
CLASS_TAKE: Final = 0.5  # the most of a class's keys a starter takes
OFF_FAIR: Final = 0.05  # a worker done starting is off its share beyond 5% of fair
FADE: Final = 4  # slow starts in which its floors change by e while it is off
AT_ONCE: Final = 100  # pool requests of a slow start with slow_start 0 ("at once")


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


class SlowStart:
    """The affinity pool's slow start (see the module docstring).  It
    owns ``starting`` (workers in slow start -> their ``Starter``),
    ``fading`` (workers done starting whose floors still follow their
    share) and ``horizon`` (the pool requests a slow start takes, from
    the pool's ``slow_start`` setting); the floors it sets are kept in
    the classes' ``ClassStats``."""

    __slots__ = ("starting", "fading", "horizon")

    def __init__(self, slow_start: int) -> None:
        self.starting: Dict[PoolWorker, Starter] = {}
        self.fading: Dict[PoolWorker, Starter] = {}  # done starting, floors fading
        self.horizon = AT_ONCE
        self.configure(slow_start)

    def configure(self, slow_start: int) -> None:
        """Take the pool's ``slow_start`` setting: a slow start takes that
        many pool requests, and for 0 ("at once") ``AT_ONCE``, enough for
        the joins that give a new worker its share (without them it was
        given none at all)."""
        self.horizon = slow_start or AT_ONCE

    def add(self, worker: PoolWorker, now: int) -> None:
        """``worker`` was added to the running pool at pool request ``now``."""
        self.starting[worker] = Starter(now)

    def remove(self, worker: PoolWorker) -> None:
        """``worker`` left the pool."""
        self.starting.pop(worker, None)
        self.fading.pop(worker, None)

    def got(self, worker: PoolWorker, now: int) -> None:
        """``worker`` was given a request at pool request ``now``."""
        starter = self.starting.get(worker) or self.fading.get(worker)
        if starter is not None:
            starter.got(now, self.horizon)

    def left(self, worker: PoolWorker, stats: ClassStats) -> None:
        """``worker`` is no longer skilled in the class of ``stats``: if it
        is starting, that class no longer counts toward its share."""
        starter = self.starting.get(worker)
        if starter is not None:
            starter.joined.pop(stats, None)

    def join(self, rclass: str, stats: ClassStats, skilled: Dict[PoolWorker, float],
             now: int, n: int, backlog: int, total: float, unskilled_score: float
             ) -> Optional[PoolWorker]:
        """Make a starting worker that is behind its ramp, and not busier
        than the mean, one of ``rclass``'s members (``skilled``: its
        skilled workers, floored in ``stats``), so it takes whole keys of
        warm classes; one that has its share after the ramp is done
        starting.  ``now``, ``n``, ``backlog`` and ``total``: the pool's
        requests, workers, backlog and decayed requests of every class.
        The worker that joined, if one did (a skill changed)."""
        fair = 1.0 / n
        for worker, starter in list(self.starting.items()):
            if not self._behind(worker, starter, now, fair):
                continue
            busy = worker.backlog * n > backlog
            cshare = stats.count / total
            due = fair - sum(starter.joined.values())
            if (worker not in skilled and self._worth(starter, cshare, due, now, n)
                    and not busy):
                # Take enough of this class's keys for the rest of its due,
                # at most half.
                take = min(CLASS_TAKE, due / cshare)
                members = len(stats.members) if stats.members else len(skilled)
                score = min(skilled.values()) if skilled else unskilled_score
                skilled[worker] = worker.resume[rclass] = score
                if stats.floors is None:
                    stats.floors = {}
                stats.floors[worker] = take / (1.0 - take) * max(members, 1)
                starter.joined[stats] = take * cshare
                starter.offered[stats] = [0, 0]
                starter.last_join = now
                return worker
        return None

    def _behind(self, worker: PoolWorker, starter: Starter, now: int, fair: float) -> bool:
        """Whether a starter is behind its ramp and short of what it needs
        once its cache is warm, so that it may join a class (``fair``: a
        worker's fair share).  One that has its share after the ramp is
        done starting (``_done``), one that came ``GIVE_UP`` slow starts
        ago is done anyway."""
        ramp = self._ramp(starter, now)
        share = starter.share(now, self.horizon)
        if share >= ramp * fair * STARTED:
            if ramp >= 1.0:
                self._done(worker, starter)
            return False
        if now - starter.added > GIVE_UP * self.horizon:
            del self.starting[worker]
            return False
        if sum(starter.joined.values()) >= fair * STARTED:
            return False  # what it holds is enough once its cache is warm
        return True

    def _worth(self, starter: Starter, cshare: float, due: float, now: int, n: int) -> bool:
        """Whether a class with ``cshare`` of the pool's requests is big
        enough for a starter still ``due`` that share: one whose keys
        cover the rest of its due, or once any such class would have come
        (``PRIOR`` requests per worker), any worth a whole worker (see
        ``_big``).  A cold cache warms soonest on few classes' data."""
        if now - starter.added <= PRIOR * n:
            return cshare * CLASS_TAKE >= due
        return cshare * n >= self._big(starter, now, n)

    @staticmethod
    def _big(starter: Starter, now: int, n: int) -> float:
        """How many workers' worth a class must be for a starter to join it:
        BIG_CLASS, halved every PRIOR requests per worker that pass without
        a join, so that a site of many small classes (none worth a whole
        worker), or a light load, still gives a new worker its share."""
        per_worker = PRIOR * n
        waited = now - max(starter.added + per_worker, starter.last_join)
        return BIG_CLASS * 0.5 ** max(waited / per_worker, 0.0)

    def offer(self, stats: ClassStats, members: Dict[PoolWorker, float],
              key_hash: int, total: float) -> int:
        """Count, for a starter that joined the class, whether it owns the
        key; after ``OFFERED`` requests of the class, raise its floor once
        if its keys carry less than the share it came for (keys are not
        alike: a third of them may carry a fifth of the requests).
        ``total``: the pool's decayed requests of every class.  How many
        floors it raised."""
        raised = 0
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
                expected = joined * total / stats.count
                got = max(counts[1], 1) / counts[0]
                if got < expected:
                    floors[worker] *= min(expected / got, MOST_RAISED)
                    raised += 1
        return raised

    def _done(self, worker: PoolWorker, starter: Starter) -> None:
        """The worker has its share after the ramp: it is done starting,
        and its floors start fading (see ``fade``)."""
        del self.starting[worker]
        for stats in starter.joined:
            floors = stats.floors
            if floors and not adopted(floors.get(worker)):
                starter.most[stats] = floors[worker]
        if starter.most:
            self.fading[worker] = starter

    def fade(self, now: int, n: int) -> None:
        """Move the floors of the workers done starting toward their fair
        share (``now``, ``n``: the pool's requests and workers): down
        while a worker takes more than ``OFF_FAIR`` over it, up (to at
        most where they were) while it takes that much less.  A floor that
        made up for a cold cache is worth too much once the cache is warm,
        and a starter's keys may carry more than the share it came for
        (keys are not alike), so without this it would keep more than its
        share for good.  Floors change by e every ``FADE`` slow starts,
        slower than its share is measured, so they follow the share rather
        than its noise (a class's members pick them up when next worked
        out); ``GIVE_UP`` slow starts after the worker came, they stay as
        they are."""
        horizon = self.horizon
        fair = 1.0 / n
        fade = 1.0 - 1.0 / (FADE * horizon)
        for worker, starter in list(self.fading.items()):
            if now - starter.added > GIVE_UP * horizon:
                del self.fading[worker]
                continue
            off = starter.share(now, horizon) / fair - 1.0
            if -OFF_FAIR <= off <= OFF_FAIR:
                continue
            factor = fade if off > 0 else 1.0 / fade
            for stats, most in starter.most.items():
                floors = stats.floors
                if floors and not adopted(floors.get(worker)):
                    floors[worker] = min(floors[worker] * factor, most)

    def _ramp(self, starter: Starter, now: int) -> float:
        """How far a starter is into its slow start, in (0, 1]."""
        done = (now - starter.added) / self.horizon
        return min(max(done, 0.01), 1.0)
