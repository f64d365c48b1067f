"""Where a key goes among its class's members, for the affinity policy
(``routing/affinity.py``): ``Placement``, a part that
``affinity.AffinityPool`` holds and calls.

Theory of operation
-------------------

Affinity.  A request may carry a *key* finer than its class (by default
its path).  Among the class's *members* (``routing/members.py``) under
the cap, a key goes to the member with the highest weighted rendezvous
score ``score / -ln(u)``, ``u`` a hash of (key, worker name) in (0, 1):
each member owns a share of the keys in proportion to its skill, a
member joining or leaving moves only the keys it takes or held, and
every LB computes the same owner from the same résumés, so several LBs
partition a class alike.

Balance.  A key goes to the first member, in the key's rendezvous order,
whose backlog is under ``balance`` times the members' mean (bounded-load
hashing, as HAProxy's ``hash-balance-factor``), so a burst on one key
moves on to its second owner instead of queueing.  The pool-wide cap on a
member is ``balance`` times the published one (its decayed mean backlog
within ``balance * variance`` times the pool's mean): the owner holds the
key's data, so it is worth a longer queue than any skilled worker.
How much longer depends on how much the data is worth, so when this LB
is alone and has measured the class's gain (see "Locality"), the
class's balance is at least ``GAIN_BALANCE`` (a half) times the gain: a
key whose requests take ten times longer away waits at its member
behind up to five times the members' mean.  With the one balance of 1.5
for every class, keys of the NASA log moved on in bursts, each move a
load, and the cap spilled 154 requests to workers outside their class;
with the gain's, the simulator's loads fell from 0.100-0.112 a request
to 0.075-0.081 at more throughput and a better p99, and those of the
elastic log's second half from 0.124-0.158 to 0.095-0.103 (seeds 1-5;
the bounds of a perfect partition are 0.070 and 0.090).  Where caches
matter less (the synthetic scenarios, gains of 2-3) the bound stays
near ``balance`` and nothing changed by more than the seeds do; where
they are far too small it costs 3-5% of throughput for up to 8% fewer
loads.  (A bound added to the members' mean instead, 2 x (gain - 1)
requests more, did no better; see ``simulations/README.rst``.)  Behind
several LBs, each sees its part of the workers' backlogs
(``AffinityPool.backlog_scale``), and the bound's one request more and its
least of two (``MIN_BOUND``, one at the least in this LB's view) are
requests of all LBs: counted in its view alone, a key stayed at its
owner behind two to four times the queue one LB allows.

Stickiness.  When this LB is alone it goes further, with the book of
keys that re-learning keeps (the class and worker each key last went
to, the least recently seen forgotten first).  The member a key last
went to keeps it up to ``stick`` times the bound: that one holds the
key's data for sure, while a key the bound had moved on used to come
back to its rendezvous owner and be loaded there once more.  A key the
book does not know goes to the least busy member: no one holds it yet,
so placing it where it waits least costs nothing.  On the NASA log this
cut loads by an eighth.  Of members equally busy, it goes to the one
the book has sent the fewest keys, of any class, for its score
(``PoolWorker.booked``; the score, its requests a second in the class,
stands for how much it can hold): a cache already full of other keys
would evict for it.  Of idle members, to the first in rendezvous order,
so that at light load a key is at its owner and follows rendezvous to
a member that joins its class.  Alone, over seeds 1-20, elastic's
second half loads 0.100 a request (0.108 at worst) against 0.101
(0.116), and the NASA log 0.079 as before.  Behind several LBs, whose
books differ (the booked counts loaded elastic with two LBs 8% more,
seeds 1-6), of idle members a new key goes to the one with the lowest
decayed mean backlog.  Each LB sees only its own requests in flight, so
members it sees idle are often busy with the other LBs' requests; in
rendezvous order every such key went to the class's best-scored member,
and the others, their scores measured on cold caches, drew fewer keys
still (NASA's most requested class, two LBs, seed 1: five members, one
serving 80% of it, while another worker served under 1% of the requests).
Over seeds 1-12 (NASA with eight LBs, 1-6), with the keys kept where
another LB sent them (below), NASA serves as much with two LBs, 4% more
with four and 16% more with eight, at 3% and 7% fewer loads; elastic's
halves within 1% with two and four and 4% more with eight;
``mixed_fleet`` and ``many_lbs`` as before.
Rendezvous still decides a key whose last worker is busy or gone, a
key whose owner is starting (slow start gives a starter its keys by
rendezvous), and a key that went to its owner
before the class grew (``joins``): at light load nothing else would
give a new member its share of the keys.  (The children of one
``--processes``, and LBs whose keys are relayed, route as this one LB:
see ``routing/affinity.py``.)  LBs whose keys are relayed may still not
agree on a class's members: each ranks them by the backlogs it sees,
and recruits when its own requests ask.  A key another LB sent to a
worker skilled in the class that this LB does not count among the
members stays there while that worker is no busier than the member it
would go to and under the cap (unless slow start is at work, and not
when every member is capped: the key spills as before): sent to this
LB's member it was loaded again, and the other LB moved it back.  By
itself this served NASA 9-19% more with two to eight LBs (seeds 1-12)
at 5-15% fewer loads, elastic's halves 4-8% more; what several LBs
serve is in ``simulations/README.rst``.

First visits.  A class whose requests are mostly for keys no worker
has served (``classstats.first_visits``: half of its last few hundred,
a shop's products each visited once) sends such a key to the least
busy worker of the pool when that one is at most half as busy as the
least busy member, each counted plus one (``_first_visit``).  The key's
data is on no worker, so a member holds only what the class's pages
share; a key kept among busy members waited while another worker idled.
Unless the class's first visits prove slower elsewhere than at its
members (``Locality.shares_data``, 1.5 times, measured again after
every ``locality.STALE_AFTER`` first visits at members): then its pages
share what the members hold, which every other worker would load too.
First visits as fast elsewhere as at their members over the whole pool
(``Locality.pages_apart``) say that the application's pages share
nothing, as ZODB's do: then a new key of any class goes as a first
visit does (but for a class whose own first visits proved slower
elsewhere), to any worker less busy than the least busy member: a
class whose pages come back has new pages too.  In the simulator, on
the NASA log with two requests in three made a page of their own
(seeds 1-6), an application whose pages share nothing (ZODB's pages of
eleven objects) served 471 requests a second, p99 166 ms, its least
busy worker 0.38 of a fair share of the work, below least backlog's
478; with the first rule 504, p99 101, 1.00, and with both (seeds
1-12) 501 at p99 68, least backlog's.  Where a class's pages share
objects (playback's cache app), 673 against 681 at 1% more loads (666
at 10% more without the measure of shared data; least backlog 560).

Spill.  When no member is under the cap, the request goes, as in the
published algorithm, to the best skilled worker under the cap, unless
the quickest member is expected to serve it ``STAY`` times sooner (in
(backlog + 1) / score, the score being its requests per second in the
class): a worker cold in the class is slow there, and sending it the
request relieves no one.  Failing a skilled worker under the cap, the
request goes to the least recently chosen worker, which becomes skilled.

Locality (``routing/locality.py``).  Everything above holds keys where
their data is, which pays only where a worker serves a key faster for
having served it before.  Each worker says how long the application took
for each response, and the pool compares, per class, the requests it
placed at their key's home (the worker the key last went to) with those
it placed away.  Their ratio, the *gain*, bounds every choice: one
request more on the chosen worker may not take it past ``1 + MOVE_COST *
(gain - 1 - NOISE)`` times the least busy worker's backlog plus one;
past it the request goes to the least busy worker.  A cache-less
application (a gain of 1: a CPU-bound view, a wait on a remote service)
is then routed by least backlog, its keys going home only on ties, and a
hot key with little data spreads over as many workers as its load needs,
since a second worker serves it as fast after its first request there.
Such a class skips members, rendezvous and slow start altogether
(``balanced``): the bound would overrule them anyway, and they cost the
LB some 20 us a request for nothing.  Where caches matter (the logs'
gains are 2 to 10), the bound is dozens of times the least busy backlog
and the rules above decide alone.  ``MOVE_COST`` (64) counts what a move
costs beyond its own request (its key's data loaded again, and its later
requests'): tried on the simulator's logs and synthetic scenarios, 16
and 32 loaded up to 4% more than 64.  ``NOISE`` (0.2) is what a live
measurement of no gain reads over 1 (1.04-1.09 for a CPU-bound view on
threads).  Until any gain is known, one in ``EXPLORE`` requests that
find their worker busier than the least busy one goes to another member
to learn one: with two workers the balance bound, relative to the
members' mean, never moves a hot key, and without a request away nothing
is learned.  Only an LB alone, or LBs whose keys are relayed (see
"Several LBs" in ``routing/affinity.py``), measures and bounds: with
several that go by rendezvous, a key's home is only its rendezvous
owner, which the other LBs' moves leave without its data, and the gains
read low (1.3-1.6 where a lone LB reads 2.7 on ``many_lbs``): the bound
moved keys on, and loads grew 16-33%.

Structure.  ``Placement`` places a key among the members that
``Members.of`` worked out (``place``: its owner, or where it spills,
then the bound of locality), a key of a class whose keys buy nothing
(``balanced``), and a request without a key within the bound
(``weighed``); the pool books where the key went.  It owns its counts of
spills, of requests moved past the bound and of those sent away to learn
a gain, and reads the rest through its pool, ``PlacementHost``.

Weak spots, admitted.  Keys pinned to owners balance load worse than
the published choice by backlog: on single-threaded workers, where a
request queues behind another, the simulator shows a worse p99 than the
published policy's (a lower ``balance`` helps).  A class whose
requests never go away from home keeps the pool's gain, which a site of
cache-bound and cache-less classes blends: with two workers, a hot
cache-less key of such a site may stay at its owner.  So may one behind
several LBs without relays, which measure nothing (the balance bound
spreads it over three members or more).
"""

from __future__ import annotations

import math
from typing import Container, Dict, Final, Hashable, Optional, Tuple

from mypy_extensions import trait

from zc_lb.routing.classstats import ClassStats, first_visits, rendezvous_draw
from zc_lb.routing.locality import FIRST_AT_MEMBER, FIRST_ELSEWHERE, Locality
from zc_lb.routing.pool import PoolWorker, SkillMap
from zc_lb.routing.relearn import AWAY, BookEntry, Relearning
from zc_lb.routing.slowstart import Starter

# (Final: constants in compiled code, see routing/affinity.py)
MIN_BOUND: Final = 2.0  # a key may always wait behind one request at its owner
GAIN_BALANCE: Final = 0.5  # a class's balance is at least this times its gain
STAY: Final = 2.0  # a capped member twice as quick as the spill target keeps a request
MOVE_COST: Final = 64.0  # a key moved costs its request's gain this many times over
EXPLORE: Final = 16  # before any gain is known, one in this many busy requests goes away
NOISE: Final = 0.2  # of a gain: what a measurement of no gain at all may read over 1
EMPTY: Final[Dict[PoolWorker, float]] = {}  # (no worker is skilled in a class never seen)
# Which of the members equally busy a new key goes to (``Placement._ranked``):
FIRST: Final = 0  # the first in the key's rendezvous order
ROOMIEST: Final = 1  # above nothing, the fewest keys booked for its score (this LB alone)
QUIETEST: Final = 2  # idle, the lowest decayed mean backlog (behind several LBs)

# (members under the cap and their backlog; the first of them, ``last``,
# the owner, the least busy: see ``Placement._ranked``)
Ranked = Tuple[int, int, Optional[PoolWorker], Optional[PoolWorker], Optional[PoolWorker],
               Optional[PoolWorker]]


@trait
class PlacementHost:
    """What ``Placement`` reads and asks of its pool, the affinity pool
    (``affinity.AffinityPool``, which the module does not import); a
    trait, as ``members.MembersHost`` is."""

    # the published pool's (``pool.Pool``)
    workers: Dict[Hashable, PoolWorker]
    skilled: SkillMap[PoolWorker]
    backlog: int
    mbacklog: float
    variance: float
    unskilled_score: float
    # the affinity pool's settings and parts
    lbs: int
    balance: float
    stick: float
    starting: Dict[PoolWorker, Starter]
    relearning: Relearning
    locality: Locality

    def oldest(self) -> PoolWorker:
        raise NotImplementedError

    def backlog_scale(self) -> float:
        raise NotImplementedError

    def least_loaded(self, skip: Container[PoolWorker] = ()) -> Optional[PoolWorker]:
        raise NotImplementedError

    def published(self, rclass: str) -> PoolWorker:
        raise NotImplementedError

    def to_end(self, worker: PoolWorker) -> None:
        raise NotImplementedError


class Placement:
    """The affinity pool's placement (see the module docstring): its
    counts, and ``pool``, the pool it places for."""

    def __init__(self, pool: PlacementHost) -> None:
        self.pool = pool
        self.spills = 0
        self.bounded = 0  # requests moved off a worker past the bound of locality
        self.unexplored = 0  # requests that could have gone away to learn a gain
        self.explored = 0  # and those that did
        # how the last key placed went as a first visit (the locality's
        # FIRST_AT_MEMBER or FIRST_ELSEWHERE), or 0, for the pool to learn from
        self.first = 0

    def place(self, rclass: str, stats: ClassStats, members: Dict[PoolWorker, float],
              key_hash: int, entry: Optional[BookEntry], alone: bool, gain: Optional[float]
              ) -> Tuple[PoolWorker, bool, Optional[PoolWorker]]:
        """Where a key goes among the class's ``members`` (``_choose``),
        within the bound of what locality buys, ``gain`` (``weighed``):
        the worker, whether it is not the key's owner, and the key's home
        (see ``_choose``).  ``entry`` is what the book holds for the key;
        ``alone``, whether this LB routes as a lone one (see "Stickiness"
        and "Locality")."""
        self.first = 0  # (not a first visit: see ``_first_visit``)
        balance = self.pool.balance
        if gain is not None and gain * GAIN_BALANCE > balance:
            balance = gain * GAIN_BALANCE  # (a key worth more at home waits longer there)
        chosen, away, home = self._choose(rclass, stats, members, key_hash, entry, alone,
                                          balance)
        if chosen.backlog and alone:  # (an idle worker is within every bound)
            weighed = self.weighed(chosen, gain, members)
            if weighed is not chosen:
                chosen, away = weighed, True
        if self.first and chosen not in members:  # (a first visit, where it went at last)
            self.first = FIRST_ELSEWHERE
        return chosen, away, home

    def _choose(self, rclass: str, stats: ClassStats, members: Dict[PoolWorker, float],
                key_hash: int, entry: Optional[BookEntry], alone: bool, balance: float
                ) -> Tuple[PoolWorker, bool, Optional[PoolWorker]]:
        """Where a key goes among the class's ``members`` (``_owner``), or
        else where it spills: the worker, whether it is not the key's
        owner, and the key's home, the worker that holds its data if any
        does (None behind other LBs, whose moves it cannot know).
        ``entry`` is what the book holds for the key; ``balance``, the
        class's balance (see "Balance" in the module docstring)."""
        if alone and self.pool.stick:  # (other LBs keep books of their own)
            # The worker holding the key's data, unless the key went to
            # its owner there before the class grew: a new member may
            # own it now.
            home = self.pool.relearning.holder(entry, rclass)
            last = home if entry is not None and (
                entry[3] == AWAY or entry[3] == stats.joins) else None
            new = entry is None  # (a key no worker has served)
            chosen, away, owner = self._owner(members, key_hash, balance, last, new)
            first = first_visits(stats, new)  # (counts every request of the class)
            apart = new and self.pool.locality.pages_apart()
            if new and chosen is not None and (first or apart):
                chosen, away = self._first_visit(stats, chosen, owner, apart)
                self.first = FIRST_AT_MEMBER  # (or elsewhere: ``place`` says at last)
            if (self.pool.lbs > 1 and last is not None and chosen is not None
                    and chosen is not last
                    and self._sent_elsewhere(rclass, members, last, chosen, owner, balance)):
                chosen, away = last, True
            if entry is not None and entry[0] != rclass:
                home = owner  # (a path of several classes: the book cannot say)
        else:
            chosen, away, owner = self._owner(members, key_hash, balance)
            home = owner if alone else None
        if chosen is None:
            chosen, away = self._spill(rclass, members, key_hash, balance), True
        return chosen, away, home

    def _first_visit(self, stats: ClassStats, chosen: PoolWorker, owner: Optional[PoolWorker],
                     apart: bool) -> Tuple[PoolWorker, bool]:
        """Where a key no worker has served goes, in a class of first visits
        (``classstats.first_visits``), or in any once the pages proved
        ``apart`` (``Locality.pages_apart``): to the least busy worker of the
        pool (but for starters) if at most half as busy as ``chosen``, the
        least busy member, each counted plus one (less busy at all if
        ``apart``), unless its class's first visits proved slower away from
        its members (``Locality.shares_data``); and whether it is not the
        key's ``owner``.  See "First visits"."""
        if chosen.backlog and not Locality.shares_data(stats):
            least = self.pool.least_loaded(self.pool.starting)
            if least is not None and (
                    least.backlog < chosen.backlog if apart
                    else 2 * (least.backlog + 1) <= chosen.backlog + 1):
                return least, least is not owner
        return chosen, chosen is not owner

    def _sent_elsewhere(self, rclass: str, members: Dict[PoolWorker, float],
                        last: PoolWorker, chosen: PoolWorker,
                        owner: Optional[PoolWorker], balance: float) -> bool:
        """Behind several LBs: whether a key another LB sent to ``last``,
        a worker skilled in ``rclass`` that this LB does not count among
        the ``members``, stays there rather than go to ``chosen`` (see
        "Stickiness" in the module docstring): while ``last`` is no
        busier and under the cap a member is held to (``_cap``, with the
        class's ``balance``), and unless slow start is at work (the
        key's ``owner`` or ``last`` starting: slow start gives a starter
        its keys by rendezvous, and holds its backlog to the mean)."""
        if last in members or last.backlog > chosen.backlog:
            return False
        starting = self.pool.starting
        if starting and (owner in starting or last in starting):
            return False
        if last not in (self.pool.skilled.get(rclass) or EMPTY):
            return False
        max_backlog, min_backlog = self._cap(balance)
        return last.mbacklog - min_backlog <= max_backlog

    def balanced(self, rclass: str, entry: Optional[BookEntry]
                 ) -> Tuple[PoolWorker, Optional[PoolWorker]]:
        """Least backlog, the worker the key last went to on ties: for a
        class whose keys buy nothing where they are, the bound of
        ``weighed`` would send every request there anyway, and members,
        rendezvous and slow start cost the LB's time for nothing.  The
        key's last worker still counts as its home (returned with the
        worker chosen), so that the gain stays measured and the class
        goes back to its members if its keys come to buy something (a
        cache warmed up, an app changed).  A worker that is starting
        takes its share at once: slow start eases in a cold cache, and
        here there is none.  (Left out, a worker that joined under load
        never served and never started.)  ``entry`` is what the book
        holds for the key."""
        pool = self.pool
        home = pool.relearning.holder(entry, rclass)  # (one in the pool)
        least = pool.least_loaded()  # (a starter too: it has no cache to warm)
        assert least is not None
        chosen = home if home is not None and home.backlog <= least.backlog else least
        return chosen, home

    def _spill(self, rclass: str, members: Dict[PoolWorker, float],
               key_hash: int, balance: float) -> PoolWorker:
        """Where a request goes that no member can take under the cap:
        the key's owner among the class's skilled workers under the cap,
        unless a member is quicker (``_stay``), else the published
        spill."""
        pool = self.pool
        # (none left, its skills dropped part by part as a résumé comes in steps)
        chosen = self._owner(pool.skilled.get(rclass) or EMPTY, key_hash, balance)[0]
        if chosen is not None:
            chosen = self._stay(rclass, members, chosen)
        if chosen not in members:
            self.spills += 1
        if chosen is None:
            for worker in pool.starting:  # a cold cache spills worst
                pool.to_end(worker)
            chosen = pool.published(rclass)
            pool.relearning.fresh(chosen, rclass)
        return chosen

    def weighed(self, chosen: PoolWorker, gain: Optional[float],
                members: Optional[Dict[PoolWorker, float]] = None) -> PoolWorker:
        """``chosen``, unless its backlog would pass the bound of what
        locality buys, ``gain`` (see "Locality" in the module docstring):
        one request more there may not exceed ``1 + MOVE_COST * (gain - 1
        - NOISE)`` times the least busy worker's backlog plus one.  Past
        it, the least busy worker but for starters (slow start gives them
        their keys, and holds their backlogs to the mean), where the
        request is expected to be served sooner, counting what the move
        costs the caches.  Before any gain is known, a keyed request
        (``members`` given) may go elsewhere to learn one: ``_explore``."""
        if gain is None:
            return chosen if members is None else self._explore(chosen, members)
        bound = 1.0 + MOVE_COST * max(0.0, gain - 1.0 - NOISE)
        if chosen.backlog + 1 <= bound:
            return chosen  # (within the bound of an idle worker: no need to look)
        least = self.pool.least_loaded(self.pool.starting)
        if least is not None and chosen.backlog + 1 > bound * (least.backlog + 1):
            self.bounded += 1
            return least
        return chosen

    def _explore(self, chosen: PoolWorker, members: Dict[PoolWorker, float]) -> PoolWorker:
        """Before any gain is known: one in ``EXPLORE`` of the requests
        that find ``chosen`` busy goes to the least busy of the other
        ``members`` (where the balance bound would move it: a key moved
        within its class loads less), or, for a class of one member, of
        all workers, if that one is less busy than ``chosen``, so that
        its service time away from home teaches the pool a gain.  Without this a hot key of two workers stayed at
        its owner: the balance bound, relative to the members' mean,
        never moved it.  (To a starter too: a pool whose second worker
        joined under load, still starting, else learned nothing and
        served from one worker.)"""
        self.unexplored += 1
        if self.unexplored % EXPLORE:
            return chosen
        other = None  # the least busy other member, the first of equals
        for worker in members:
            if worker is not chosen and (other is None or worker.backlog < other.backlog):
                other = worker
        if other is None:
            other = self.pool.least_loaded()
        if other is None or other.backlog >= chosen.backlog:
            return chosen
        self.explored += 1
        return other

    def _estimate(self, rclass: str, worker: PoolWorker) -> float:
        """How fast ``worker``, skilled in ``rclass`` by the LB and not yet
        by its résumé, may serve it: the mean of the class's learned
        scores elsewhere, or the unskilled score when no worker has
        learned it.  (Not the unskilled score of 1 request a second
        against the owner's hundreds: that kept requests queued at the
        owner while the other worker idled, and it never learned.)"""
        scores = [score for other, score in (self.pool.skilled.get(rclass) or EMPTY).items()
                  if rclass not in other.given]
        return sum(scores) / len(scores) if scores else self.pool.unskilled_score

    def _stay(self, rclass: str, members: Dict[PoolWorker, float],
              target: PoolWorker) -> PoolWorker:
        """Where a request goes that no member can take under the cap:
        to ``target``, the skilled worker under the cap it would spill to,
        unless a member is expected to serve it ``STAY`` times sooner.  A
        worker is expected to serve it in (backlog + 1) / score, its score
        being its résumé's requests per second in the class, so a target
        whose cache is cold for the class counts as slow: the cap keeps a
        class from flooding its workers, and sending a request where it
        takes far longer relieves no one.  (Not a starter, whose score is
        that of a cold cache and whose backlog is kept to the mean.)"""
        skilled = self.pool.skilled[rclass]
        starting = self.pool.starting
        fastest = None
        for worker in members:
            score = skilled.get(worker)
            if not score or worker in starting:
                continue
            time = (worker.backlog + 1) / score
            if fastest is None or time < fastest[0]:
                fastest = (time, worker)
        score = skilled.get(target)
        if rclass in target.given:  # (the LB made it skilled: see ``_estimate``)
            score = self._estimate(rclass, target)
        if fastest is not None and score and fastest[0] * STAY <= (target.backlog + 1) / score:
            return fastest[1]
        return target

    def _owner(self, members: Dict[PoolWorker, float], key_hash: int, balance: float,
               last: Optional[PoolWorker] = None, new: bool = False
               ) -> Tuple[Optional[PoolWorker], bool, Optional[PoolWorker]]:
        """The worker for ``key_hash`` among ``members`` under the cap,
        whether it is not the key's owner, and the owner: the first of
        all members in the key's rendezvous order (see ``_ranked``).

        Bounded-load hashing, as HAProxy's ``hash-balance-factor``: the
        first member in rendezvous order whose backlog is under the
        bound, ``balance`` (the class's) times the members' mean.  When
        this LB is alone, two things come first.  ``last``, the member the key last
        went to (the caller leaves it out if the key was at its owner
        then and the class has grown since), keeps it up to
        ``stick`` times the bound, unless the owner is starting (see
        ``routing/slowstart.py``): it holds the key's data for sure, and a key
        the bound moved on stays where it went instead of coming back to
        be loaded again.  A ``new`` key, one the book does not know, goes
        to the least busy member (of members equally busy, the one with
        the most room, or behind several LBs the quietest: see
        "Stickiness" in the module docstring): no one holds it yet."""
        ties = (ROOMIEST if self.pool.lbs == 1 else QUIETEST) if new else FIRST
        count, total, first, kept, owner, least = self._ranked(
            members, key_hash, balance, last, ties=ties)
        if first is None:
            return None, False, owner
        # The one request more, and the least bound, count requests of all
        # LBs, of which this one sees a part (``backlog_scale``); the least
        # bound stays one request at least in its own view.
        # (float(): compiled, a float over an int is worked out on objects)
        scale = self.pool.backlog_scale()
        bound = balance * (float(total) + 1.0 / scale) / float(count)
        least_bound = MIN_BOUND / scale if MIN_BOUND > scale else 1.0
        if bound < least_bound:
            bound = least_bound
        starting = self.pool.starting
        if (kept is not None and kept.backlog < self.pool.stick * bound
                and not (starting and owner in starting)):
            return kept, kept is not owner, owner
        if new:
            chosen = least
        elif count == 1 or first.backlog < bound:
            chosen = first
        else:  # the first in rendezvous order under the bound, if any
            chosen = self._ranked(members, key_hash, balance, None, bound)[2] or first
        return chosen, chosen is not owner, owner

    def _cap(self, balance: float) -> Tuple[float, float]:
        """The cap on a member, ``balance`` (the class's) times the
        published one, as the most its decayed mean backlog may be over
        the second number (the least recently chosen worker's plus one).
        The bound keeps the members even among themselves, so the cap
        only has to catch members far over the pool's mean, and a key's
        owner, which holds its data, is worth a longer queue than a
        skilled worker.  At least 1.0, also where inf * 0 is NaN (an
        infinite gain's balance, an idle pool), which compares as false."""
        pool = self.pool
        max_backlog = balance * pool.variance * pool.mbacklog / len(pool.workers)
        if not max_backlog >= 1.0:  # (NaN too)
            max_backlog = 1.0
        return max_backlog, pool.oldest().mbacklog + 1.0

    def _ranked(self, members: Dict[PoolWorker, float], key_hash: int, balance: float,
                last: Optional[PoolWorker], below: float = math.inf,
                ties: int = FIRST) -> Ranked:
        """How many members are under the cap (``_cap``; and with a
        backlog ``below``), and their total backlog; the first of them in
        the key's rendezvous order, ``last`` if one of them, the key's
        owner (the first of all members), and the least busy of them.  Of
        equal backlogs, ``ties`` says which (for a new key: see
        ``_owner``): ``ROOMIEST``, above nothing, the one with the fewest
        keys booked for its score; ``QUIETEST``, idle, the one with the
        lowest decayed mean backlog; then the first in rendezvous order.  (Not a starter
        busier than the pool's mean.  No list of them: three requests in
        four want only these.)"""
        max_backlog, min_backlog = self._cap(balance)
        starting = self.pool.starting
        busy = self.pool.backlog / len(self.pool.workers)  # a starter takes no more than the mean
        count = total = 0
        owner = first = least = kept = None  # first: the owner under the cap; kept: ``last``
        top = best = least_score = least_weight = 0.0
        # A class of one member (most requests) has no order to draw:
        # its weights are only compared with one another.
        single = len(members) == 1
        for worker, score in members.items():
            weight = score if single else score / rendezvous_draw(key_hash ^ worker.salt)
            if weight > top:
                owner, top = worker, weight
            if worker.mbacklog - min_backlog > max_backlog:
                continue
            backlog = worker.backlog
            if starting and worker in starting and backlog > busy or backlog >= below:
                continue
            if worker is last:
                kept = worker
            count += 1
            total += backlog
            if weight > best:
                first, best = worker, weight
            if least is None or backlog < least.backlog:
                least, least_score, least_weight = worker, score, weight
            elif backlog == least.backlog:
                if ties == ROOMIEST and backlog:  # (keys booked over score, cross-multiplied)
                    room, least_room = worker.booked * least_score, least.booked * score
                    better = room < least_room or (room == least_room and weight > least_weight)
                elif ties == QUIETEST and not backlog:
                    quiet, least_quiet = worker.mbacklog, least.mbacklog
                    better = quiet < least_quiet or (
                        quiet == least_quiet and weight > least_weight)
                else:
                    better = weight > least_weight
                if better:
                    least, least_score, least_weight = worker, score, weight
        return count, total, first, kept, owner, least
