"""A class's *members*, the workers its keys are split among: how many
and which, for the affinity policy (``routing/affinity.py``):
``Members``, a part that ``affinity.AffinityPool`` holds and calls.

Theory of operation
-------------------

Width.  How many members a class gets is set from what the LB sees:
``max(load, footprint)``, where ``load = ceil(n * spread * share)``
(``share``, the class's decayed share of requests: a class with a third
of the traffic needs a third of the pool) and ``footprint = ceil(n *
keys / all_keys)`` (``keys``, the class's distinct keys over the last
``footprint_window`` requests, estimated in bounded memory by a
k-minimum-values sketch: a class with a third of the distinct keys needs
a third of the pool's cache).  A class with more skilled workers than
its width uses those that would serve it soonest (``busy_members``,
the default; without it the best-scored: see "Members"); the rest, no
longer sent the class, drop it from their résumés after
``max_skill_age`` requests, so a hot class's skilled set grows only
while it is needed.  A class short of members recruits one worker not
yet skilled in it: the one another LB recruited, if the relays or the
siblings say; else when this LB is alone, the one whose classes leave it
the fewest keys to hold (``held``: each class's distinct keys shared
among its members), so that a big class is not split over the workers
that already cache another big one; a *light* class (its keys ask for
under ``LIGHT`` of a worker), which adds little to a cache, the one with
the fewest keys and the least decayed backlog, each plus one, multiplied
(by keys alone, they piled onto a worker that a share of a costly class
kept queued, while a worker of rare classes idled), with ``busy_members``
and unless its gain is known and under ``LIGHT_GAIN`` (the bound then
spreads a queue before it grows, and by backlog the p99 suffered).  With
several LBs (``lbs``, which ZooKeeper tells) it is one near the class's
point on a hash ring, so that a class is not copied once per LB
(``_ring_recruit``).  A recruit starts with the class's lowest score, so
it takes a real share of the keys at once (with ``unskilled_score`` it
would take almost none until its résumé came).  A class keeps the
members its keys asked for until its footprint falls ``NARROW`` of a
worker under one member fewer: a footprint hovering at a whole number
took a member and gave it back in turn, and each time that member's keys
were loaded again elsewhere.
Members are worked out again every ``REFRESH`` requests of the class or
when skills change, not on every request.

Members.  A score is a worker's speed in one class, blind to how busy
its other classes keep it: on a fleet of two machine sizes the fast
workers, best-scored in every class, took all the big ones and queued
while the slow ones idled.  So (``busy_members``, the default), once
this LB measures what moving the class costs (its gain,
``routing/locality.py``), members are ranked by score over decayed
backlog plus one, the requests a second each would give the class, a
current member's backlog counted ``stick`` times smaller (the class's
gain or ``MEMBER_STICK``, whichever is more): a class whose keys take
ten times longer away moves only from a member ten times busier, and a
better-scored worker (one that now holds the data) takes over at once.
Before any gain is known, or behind LBs that measure none, members go
by score alone.  Each LB's view of a backlog is scaled to all LBs'
(``AffinityPool.backlog_scale``), here and in pressure.  What this
serves: ``simulations/README.rst``.

Widening.  Shares say what a class needs, not how busy its members are
with the other classes they hold.  So each class keeps its *pressure*,
its members' mean backlog over the pool's mean (each plus one: at light
load no one is busier), decayed over its member refreshes.  While that
stays above ``1 + widen`` the class takes a member more than its width,
the least busy worker not in it, and once that one joined a second if
it stays there (``MAX_EXTRA``; with one, elastic left a worker idle
beside its two busiest classes in a third of its seeds); below ``1 / (1
+ widen)`` it gives one back.  A new member takes the class's new keys
and those the bound moves on (not those at their owners: they would load
again).  Not more (three measured as two): they mend packing accidents,
and a class still the busiest is hot, which the bound and the cap
spread.  Only a class with half a worker's fair share of the work per
member widens (its decayed requests, each weighed by its members'
seconds): a lighter one relieves little, and its new member loads the
class's shared data.

Structure.  ``Members`` counts each request and its key into the
class's statistics (``observe``) and works out the class's members
(``of``), among which ``routing/placement.py`` places the key.  It owns
what it counts with (the footprint of all classes and its windows, their
decayed work, the keys whose hashes they remember, the keys each worker
is counted to hold), the recruiting ring and the counts of widenings;
the rest it reads and changes through its pool, ``MembersHost``.

Weak spots, admitted.  Shares and footprints are per LB: with k LBs each sees
all of a class's keys but only its own load.  Footprints count keys, not bytes.
"""

from __future__ import annotations

import bisect
import logging
import math
from heapq import nlargest
from operator import attrgetter
from typing import Dict, Final, Hashable, Iterable, List, Optional, Tuple
from zlib import crc32

from mypy_extensions import trait

from zc_lb.routing.classstats import (MASK64, PRIOR, ClassStats, Footprint, forget_keys, mix,
                                      mixed, stable_hash, text_bytes)
from zc_lb.routing.locality import Locality
from zc_lb.routing.pool import PoolWorker, SkillMap
from zc_lb.routing.relearn import JOINS_LIMIT, Relearning, adopted, floor_weight
from zc_lb.routing.slowstart import SlowStart, Starter

log = logging.getLogger(__name__)

# (Final: constants in compiled code, see routing/affinity.py; MAX_KEYS_SEEN
# stays plain, for the tests to change)
RING_CHOICES: Final = 2  # ring recruiting: the less loaded of the first two,
RING_ROOM: Final = 4  # or with relays the one of the first four sent the fewest keys,
RING_ROOMIER: Final = 0.5  # if under half as many as that one
RING_POINTS: Final = 16  # points per worker on the recruiting ring
REFRESH: Final = 16  # requests of a class between working out its members again
MEMBER_STICK: Final = 2.5  # a member is favoured this much (or its class's gain) to stay one
PRESSURE_DECAY: Final = 0.95  # per member refresh: a class's pressure follows some 20 of them
NARROW: Final = 0.25  # of a worker, under one member fewer, before a class's keys give one back
WIDEN_SHARE: Final = 0.5  # of a worker's fair share of work, per member, before a class widens
LIGHT: Final = 0.5  # of a worker's cache: a class whose keys ask for less recruits by backlog too,
LIGHT_GAIN: Final = 4.0  # unless its gain is known and under this
MAX_EXTRA: Final = 2  # members a class may take over its width for its pressure
MAX_KEYS_SEEN = 1 << 16  # keys whose hashes the classes remember, in all


def _by_score(item: Tuple[PoolWorker, float]) -> Tuple[float, int]:
    """Best score first; ties by the worker's salt, alike on every LB."""
    return item[1], item[0].salt


def _top_scored(skilled: Dict[PoolWorker, float], width: int) -> Dict[PoolWorker, float]:
    """The ``width`` best of ``skilled`` by ``_by_score`` (``nlargest`` is
    Python code: several times slower for a handful of workers)."""
    if width == 1:
        return _best_scored(skilled)
    return dict(sorted(skilled.items(), key=_by_score, reverse=True)[:width])


def _best_scored(skilled: Dict[PoolWorker, float]) -> Dict[PoolWorker, float]:
    """The first of ``skilled`` by ``_by_score``, without sorting (for a
    class of one member, most of them)."""
    best: Optional[PoolWorker] = None
    top = 0.0
    for worker, score in skilled.items():
        if best is None or score > top or (score == top and worker.salt > best.salt):
            best, top = worker, score
    return {} if best is None else {best: top}


def _placing(worker: PoolWorker, score: float, members: List[PoolWorker],
             stick: float, scale: float) -> Tuple[float, bool, int]:
    """How well ``worker`` would serve a class it has ``score`` in, as a
    sort key: its requests a second in the class over its decayed backlog
    plus one, so that a worker fast at everything, and busy with it, does
    not take every class.  The backlog is this LB's, ``scale`` times
    (``AffinityPool.backlog_scale``: all LBs' over this one's).  A
    current member of the class (in ``members``) counts its backlog
    ``stick`` times smaller: backlogs going up and down do not move a
    class, and its data, back and forth.  Ties go to current members,
    then by the worker's salt, alike on every LB (see "Members" in the
    module docstring)."""
    load = worker.mbacklog * scale + 1.0
    member = worker in members
    if member:
        load /= stick
        if load < 1.0:
            load = 1.0
    return score / load, member, worker.salt


def _held_and_busy(worker: PoolWorker) -> float:
    return (worker.held + 1.0) * (worker.mbacklog + 1.0)  # (a light class's recruit)


def _best_placed(skilled: Dict[PoolWorker, float], members: List[PoolWorker],
                 stick: float, scale: float) -> Dict[PoolWorker, float]:
    """The first of ``skilled`` by ``_placing``, without sorting."""
    best: Optional[PoolWorker] = None
    top = (0.0, False, 0)
    for worker, score in skilled.items():
        placing = _placing(worker, score, members, stick, scale)
        if best is None or placing > top:
            best, top = worker, placing
    return {} if best is None else {best: skilled[best]}


@trait
class MembersHost:
    """What ``Members`` reads and changes of its pool, the affinity pool
    (``affinity.AffinityPool``, which the module does not import).  A trait:
    compiled, read as natively as the pool's own names (a ``Protocol``'s are
    looked up by name)."""

    # the published pool's (``pool.Pool``)
    workers: Dict[Hashable, PoolWorker]
    skilled: SkillMap[PoolWorker]
    backlog: int
    lbs: int
    unskilled_score: float
    # the affinity pool's settings, classes and counts
    spread: float
    widen: float
    busy_members: bool
    classes: Dict[str, ClassStats]
    requests: int
    total: float
    rate_decay: float
    skills_version: int
    hash_seed: int
    relayed: bool
    # and its other parts
    locality: Locality
    slowstart: SlowStart
    starting: Dict[PoolWorker, Starter]
    relearning: Relearning

    def by_recency(self) -> Iterable[PoolWorker]:
        raise NotImplementedError

    def backlog_scale(self) -> float:
        raise NotImplementedError

    def recruited_elsewhere(self, rclass: str, skilled: Dict[PoolWorker, float],
                            busiest: bool) -> Optional[PoolWorker]:
        raise NotImplementedError

    def recruited(self, rclass: str, worker: PoolWorker) -> None:
        raise NotImplementedError


class Members:
    """The affinity pool's members (see the module docstring): the state
    it counts with, and ``pool``, the pool it works for."""

    def __init__(self, pool: MembersHost, footprint_window: int) -> None:
        self.pool = pool
        self.footprint = Footprint(0)  # distinct (class, key) pairs
        self.work = 0.0  # decayed seconds of work of every class
        self.keys_seen = 0  # keys the classes remember (``observe``)
        self.forgetting: List[Tuple[str, ClassStats]] = []  # (``_forget_keys``)
        self.widenings = 0  # classes given a member for their pressure
        self.narrowings = 0  # and given one back
        self.held_window = 0  # the footprint window ``held`` was counted in
        self.idle_window = 0  # the one idle classes were last forgotten in
        # Footprint windows numbered on from ``window_base`` at ``window_start``
        # requests, in windows of ``window_size`` (see ``window``).
        self.window_base = self.window_start = 0
        self.window_size = footprint_window
        self._ring: Optional[List[Tuple[int, PoolWorker]]] = None

    def configure(self, footprint_window: int) -> None:
        """Take the pool's ``footprint_window``: changed live, footprint
        windows are numbered on from the one the pool is in."""
        if footprint_window != self.window_size:
            self.window_base = self.window()
            self.window_start = self.pool.requests
            self.window_size = footprint_window

    def window(self) -> int:
        """The footprint window the pool is in, numbered on from the last
        change of ``footprint_window``: renumbered, a class's footprint would
        count from nothing again, and its width fall to one member."""
        return self.window_base + (self.pool.requests - self.window_start) // self.window_size

    @property
    def held(self) -> Dict[PoolWorker, float]:
        """Worker -> distinct keys of its classes it is counted to hold (kept on
        the workers, ``PoolWorker.held``: in a dict, each change cost more)."""
        return {worker: worker.held for worker in self.pool.workers.values()}

    def workers_changed(self) -> None:
        """A worker was added or removed: the recruiting ring is drawn again."""
        self._ring = None

    def rework(self, classes: Iterable[str]) -> None:
        """The skills of ``classes`` changed: each works out its members
        again on its next request."""
        known = self.pool.classes
        for rclass in classes:
            stats = known.get(rclass)
            if stats is not None:
                stats.version = -1

    def observe(self, rclass: str, key: str) -> Tuple[ClassStats, int, int]:
        """Count the request and its key in the class's statistics; the
        class's stats, the key's hash in the class, and its hash in the
        book (the same in every class)."""
        pool = self.pool
        window = self.window()
        if window != self.idle_window:  # (every class's way: none may keep one for good)
            self.idle_window = window
            self._forget_idle(window)
        stats = pool.classes.get(rclass)
        if stats is None:
            stats = pool.classes[rclass] = ClassStats(rclass, window, pool.hash_seed)
        # Its work: a class not yet scored costs the mean so far.
        cost = stats.cost
        if cost is None:
            cost = self.work / pool.total
        decay = math.pow(pool.rate_decay, float(pool.requests - stats.seen))
        stats.count = stats.count * decay + 1.0
        stats.work = stats.work * decay + cost
        self.work = self.work * pool.rate_decay + cost
        stats.seen = pool.requests
        hashes = stats.keys.get(key)
        if hashes is None:  # (most keys come back: no hashing then)
            crc = crc32(text_bytes(key))
            # (a book hash is the same in every class, and / is in many: remembered)
            key_hash, book_hash = mix(stats.salt ^ crc), mixed(crc ^ pool.hash_seed)
            self.keys_seen += 1
            if self.keys_seen > MAX_KEYS_SEEN or self.forgetting:
                self._forget_keys()
            stats.keys[key] = key_hash | (book_hash << 64)  # (``KeyHashes``)
        else:
            key_hash, book_hash = hashes & MASK64, hashes >> 64
        # (a key counted again in a window changes no sketch)
        if stats.footprint.add(key_hash, window) and stats.members:
            self._hold(stats, stats.members)  # (its keys held, counted again)
        self.footprint.add(key_hash, window)
        return stats, key_hash, book_hash

    def _forget_keys(self) -> None:
        """The classes remember more than ``MAX_KEYS_SEEN`` keys: they forget
        half, a few with each new key (``classstats.forget_keys``)."""
        self.keys_seen -= forget_keys(self.pool.classes, self.forgetting)
        if self.keys_seen <= MAX_KEYS_SEEN // 2:
            self.forgetting.clear()

    def width(self, stats: ClassStats) -> int:
        """How many workers the class should be spread over."""
        return self.widths(stats)[0]

    def widths(self, stats: ClassStats) -> Tuple[int, int, float]:
        """The class's width; the part of it its keys ask for, kept until
        they ask for ``NARROW`` of a worker less than one member fewer
        (see the module docstring); and the workers they ask for."""
        pool = self.pool
        n = len(pool.workers)
        # Few requests or keys prove nothing: until there are PRIOR per
        # worker, a class is judged against that many.
        least = PRIOR * n
        load = math.ceil(n * pool.spread * stats.count / max(pool.total, least))
        window = self.window()
        all_keys = max(self.footprint.estimate(window), least)
        need = n * stats.footprint.estimate(window) / all_keys
        footprint = math.ceil(need)
        if footprint < stats.key_width <= n and need > stats.key_width - 1 - NARROW:
            footprint = stats.key_width
        return max(1, min(n, max(load, footprint))), footprint, need

    def of(self, rclass: str, stats: ClassStats) -> Dict[PoolWorker, float]:
        """The class's members and their scores: its best ``width`` skilled
        workers, recruiting one when it has fewer; a worker that joined
        the class while starting counts at least as the members' mean
        (see ``_floored``).  Worked out again after a change of skills or
        every ``REFRESH`` requests of the class, not every time."""
        pool = self.pool
        members = stats.members
        stats.uses += 1
        if (members is not None and stats.version == pool.skills_version
                and stats.uses < REFRESH and not pool.starting):
            return members
        stats.uses = 0
        share, stats.key_width, need = self.widths(stats)
        width = share
        if members and pool.widen:
            width = self._widen(rclass, stats, members, share)
        elif stats.extra:  # (``widen`` set to 0 while the class was wide)
            stats.extra, stats.pressure = 0, 1.0
        skilled = pool.skilled.setdefault(rclass)
        if len(skilled) < width and not (skilled and stats.moved >= 1.0):
            # (a class following its moved keys waits for their workers)
            gain = pool.locality.gain(stats)
            light = need < LIGHT and pool.busy_members and (gain is None or gain >= LIGHT_GAIN)
            self.recruit(rclass, skilled, busiest=stats.extra > 0, light=light)
        if stats.floors:
            members = self._floored(stats, skilled, width)
        elif len(skilled) <= width:
            members = skilled
        elif pool.busy_members:
            members = self._soonest(stats, skilled, width)
        else:
            members = _top_scored(skilled, width)
        self._new_members(stats, members, share)
        if len(members) < width:
            stats.uses = REFRESH  # still recruiting: again on the next request
        return members

    def _soonest(self, stats: ClassStats, skilled: Dict[PoolWorker, float],
                 width: int) -> Dict[PoolWorker, float]:
        """With ``busy_members``: the ``width`` of the class's ``skilled``
        workers that would serve it soonest, counting how busy they are
        (``_placing``), the current members favoured by the class's gain
        (at least ``MEMBER_STICK``): moving a class costs loading its data
        again.  By score while no gain is measured (see "Members")."""
        pool = self.pool
        gain = pool.locality.gain(stats) if pool.lbs == 1 or pool.relayed else None
        if gain is None:  # (nothing says what moving the class costs)
            return _top_scored(skilled, width)
        stick = gain if gain > MEMBER_STICK else MEMBER_STICK
        scale = pool.backlog_scale()  # (backlogs as all LBs' are)
        current = stats.holders  # (not ``members``: see ``_new_members``)
        if width == 1:
            return _best_placed(skilled, current, stick, scale)
        # (``nlargest`` is Python code: several times slower for a few workers)
        ranked = sorted(skilled.items(), reverse=True,
                        key=lambda item: _placing(item[0], item[1], current, stick, scale))
        return dict(ranked[:width])

    def _new_members(self, stats: ClassStats, members: Dict[PoolWorker, float],
                     share: int) -> None:
        """The class's members were worked out again (``share``: the width its
        share of requests and keys asks for): note them, what a request costs
        them, whether the class grew (``joins``), and the keys they hold."""
        pool = self.pool
        stats.members, stats.version = members, pool.skills_version
        times = [1.0 / score for score in members.values() if score > pool.unskilled_score]
        stats.cost = sum(times) / len(times) if times else None
        # (``holders`` is the members as they were: ``stats.members`` may be the
        # class's skilled dict itself, which a recruit has just grown.  A member taken
        # for pressure takes new keys and those the bound moves on, not those at home.)
        if len(members) > len(stats.holders) and not (
                stats.extra and len(stats.holders) >= share):
            stats.joins = (stats.joins + 1) % JOINS_LIMIT  # (as the book keeps it)
        self._hold(stats, members)

    def _widen(self, rclass: str, stats: ClassStats, members: Dict[PoolWorker, float],
               width: int) -> int:
        """``width`` plus the members (``MAX_EXTRA`` at most) the class has over
        it for its pressure, one taken or given back when that stayed past
        ``widen`` (the module docstring); a change sets the pressure back to 1."""
        pool = self.pool
        n = len(pool.workers)
        if stats.extra > n - width:  # (workers gone, or its share grown: no room)
            stats.extra = max(0, n - width)
        # (backlogs as all LBs' are, one more on either side: at light load no one is
        # busier; decayed means are taken at each worker's events, a busy member's more)
        scale = pool.backlog_scale()
        mine = scale * float(sum(worker.backlog for worker in members)) / len(members) + 1.0
        mean = scale * float(pool.backlog) / n + 1.0
        stats.pressure = PRESSURE_DECAY * stats.pressure + (1.0 - PRESSURE_DECAY) * mine / mean
        high, pressure, change = 1.0 + pool.widen, stats.pressure, ""
        if (pressure > high and stats.extra < MAX_EXTRA and width + stats.extra < n
                and (not stats.extra or len(members) >= width + stats.extra)  # (it joined)
                and stats.work * n >= WIDEN_SHARE * self.work * len(members)):
            stats.extra += 1
            self.widenings += 1
            change = "widened"
        elif pressure < 1.0 / high and stats.extra:
            stats.extra -= 1
            self.narrowings += 1
            change = "narrowed"
        if change:
            stats.pressure = 1.0
            log.info("class %s %s to %d members: they were %.2f times as busy as the "
                     "pool's workers", rclass, change, width + stats.extra, pressure)
        return width + stats.extra

    def _floored(self, stats: ClassStats, skilled: Dict[PoolWorker, float],
                 width: int) -> Dict[PoolWorker, float]:
        """The best ``width`` of ``skilled``, and the workers that joined the
        class while starting, each weighing at least its ratio times the mean
        of the others' scores: a cold cache does not rank a newcomer last before
        its résumé shows its keys.  A floor lasts while it is skilled in the class."""
        floors = stats.floors
        assert floors is not None
        others = nlargest(width, ((w, s) for w, s in skilled.items() if w not in floors),
                          key=_by_score)
        mean = (sum(s for _, s in others) / len(others) if others
                else max(skilled.values(), default=self.pool.unskilled_score))
        members = dict(others)
        for worker, ratio in list(floors.items()):
            score = skilled.get(worker)
            if score is None:
                del floors[worker]
                self.pool.slowstart.left(worker, stats)
                continue
            members[worker] = max(score, floor_weight(ratio) * mean)
        if not floors:
            stats.floors = None
        # Workers that followed moved keys count among the ``width``;
        # starters come on top, as they take their share.
        width += sum(1 for ratio in floors.values() if not adopted(ratio))
        if len(members) <= width:
            return members
        senders = stats.senders
        if stats.following and senders:
            # Starters first, then the workers most moved keys came from.
            return dict(nlargest(width, members.items(), key=lambda item: (
                not adopted(floors.get(item[0])), senders.get(item[0], 0.0),
                item[1], item[0].salt)))
        return dict(nlargest(width, members.items(), key=_by_score))

    def recruit(self, rclass: str, skilled: Dict[PoolWorker, float],
                busiest: bool = False, light: bool = False) -> None:
        """Make a worker not skilled in ``rclass`` skilled in it, at the
        class's lowest score: one another LB recruited for it, if any
        (``recruited_elsewhere``); else alone, the one holding the fewest
        keys (the least recently chosen of those), for a ``light`` class
        the fewest and least busy (the module docstring), or, for a class
        ``busiest`` (widened for its pressure), the least busy but for
        starters; with other LBs, from a ring (``_ring_recruit``)."""
        pool = self.pool
        score = min(skilled.values()) if skilled else pool.unskilled_score
        worker = pool.recruited_elsewhere(rclass, skilled, busiest)
        if worker is None and pool.lbs > 1:
            worker = self._ring_recruit(rclass, skilled)
        if worker is None:
            # (ties: the least recently chosen; a busy class takes no starter: it is cold)
            key = (attrgetter("mbacklog") if busiest
                   else _held_and_busy if light else attrgetter("held"))
            worker = min((w for w in pool.by_recency() if w not in skilled
                          and not (busiest and w in pool.starting)), key=key, default=None)
            if worker is None:
                return
        pool.recruited(rclass, worker)
        skilled[worker] = worker.resume[rclass] = score
        pool.relearning.fresh(worker, rclass)
        pool.skills_version += 1

    def _ring_recruit(self, rclass: str, skilled: Dict[PoolWorker, float]
                      ) -> Optional[PoolWorker]:
        """Of the workers not skilled in ``rclass`` on a ring from the class's
        point, the less busy of the first ``RING_CHOICES``; with relays (all
        LBs' books hear all keys, so count alike), the non-starter of the first
        ``RING_ROOM`` sent the fewest keys, if under ``RING_ROOMIER`` times as many."""
        ring = self._ring
        if ring is None:
            ring = self._ring = sorted(  # (by ident where two workers of one name tie)
                [(mix(worker.salt ^ replica), worker) for worker in self.pool.workers.values()
                 for replica in range(RING_POINTS)], key=lambda p: (p[0], p[1].ident))
        start = bisect.bisect(ring, (stable_hash(rclass), ))
        n = len(ring)
        relayed = self.pool.relayed
        choices = RING_ROOM if relayed else RING_CHOICES
        best = roomiest = None
        seen: List[PoolWorker] = []
        for i in range(min(n, (len(skilled) + choices + 1) * RING_POINTS)):
            worker = ring[(start + i) % n][1]
            if worker in skilled or worker in seen:
                continue
            seen.append(worker)
            if len(seen) <= RING_CHOICES and (best is None or worker.mbacklog < best.mbacklog):
                best = worker
            if relayed and (roomiest is None or worker.booked < roomiest.booked) and (
                    worker not in self.pool.starting):
                roomiest = worker
            if len(seen) == choices:
                break
        if best is not None and roomiest is not None:  # (with relays only)
            return roomiest if roomiest.booked < RING_ROOMIER * best.booked else best
        return best

    def _hold(self, stats: ClassStats, members: Dict[PoolWorker, float]) -> None:
        """Count the class's distinct keys as held by ``members``, each an equal
        part, instead of by those they were counted on before.  Every class is
        counted again in each new footprint window (``observe`` forgot the idle)."""
        window = self.window()
        if window != self.held_window:
            self.held_window = window
            for worker in self.pool.workers.values():
                worker.held = 0.0
            for other in self.pool.classes.values():
                other.holders, other.held = [], 0.0
                if other.members and other is not stats:
                    self._count_held(other, other.members, window)
        else:
            for worker in stats.holders:  # (one removed since counts for no one)
                worker.held -= stats.held
        self._count_held(stats, members, window)

    def _forget_idle(self, window: int) -> None:
        """Forget the classes not requested in this footprint window or the last,
        whose decayed count has fallen under one request: their footprint is gone
        and their share is nothing, so one coming back is a new class.  Without
        this a client sending a new Host header with every request (or a site
        with a subdomain per user) would grow the LB without end.  At most the
        classes of two windows and those worth a request are kept (not one a
        starter or moved keys gave floors while a floored worker is in the pool).
        Their skills sleep (``SkillMap.rest``)."""
        pool = self.pool
        horizon = self.window_start + (window - 1 - self.window_base) * self.window_size
        decay, requests = pool.rate_decay, pool.requests
        classes, workers = pool.classes, pool.workers
        idle = [name for name, stats in classes.items()
                if stats.seen < horizon and stats.count * decay ** (requests - stats.seen) < 1.0
                and not (stats.floors and any(workers.get(w.handle) is w for w in stats.floors))]
        for name in idle:
            self.keys_seen -= len(classes[name].keys)
            del classes[name]
            pool.skilled.rest(name)

    def _count_held(self, stats: ClassStats, members: Dict[PoolWorker, float],
                    window: int) -> None:
        stats.holders = list(members.keys())  # (compiled, the dict's own copy)
        stats.held = held = (stats.footprint.estimate(window) / float(len(members))
                             if members else 0.0)
        for worker in stats.holders:
            worker.held += held
