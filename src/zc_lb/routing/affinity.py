"""The affinity policy: résumés pick a class's workers, keys split the class.

Theory of operation
-------------------

The published algorithm (``pool.Pool``) sends a class to whichever of its
skilled workers has the best score per unit of backlog.  Every skilled
worker therefore ends up caching the class's whole working set: a class
bigger than one worker's cache misses on every worker it uses, and a
small one is copied wherever the cap spills it.  ``AffinityPool`` keeps
the published cap and résumés and adds three things.

Affinity.  A request may carry a *key* finer than its class (by default
its path).  Among the class's *members* under the cap, a key goes to the
member with the highest weighted rendezvous score ``score / -ln(u)``,
``u`` a hash of (key, worker name) in (0, 1): each member owns a share
of the keys in proportion to its skill, a member joining or leaving moves
only the keys it takes or held, and every LB computes the same owner
from the same résumés, so several LBs partition a class alike.

Members (``routing/members.py``).  A class's keys are split among its
*members*: as many of its skilled workers as its share of the requests
and of the distinct keys asks for (its *width*), the best-scored (or,
with ``busy_members``, those that would serve it soonest), one more
while they are much busier than the pool's other workers, and a recruit
when it has too few.  Members are worked out again every ``REFRESH``
requests of the class or when skills change, not on every request.

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
to 0.075-0.080 at more throughput and a better p99, and those of the
elastic log's second half from 0.124-0.158 to 0.095-0.104 (seeds 1-5;
the bounds of a perfect partition are 0.070 and 0.090).  Where caches
matter less (the synthetic scenarios, gains of 2-3) the bound stays
near ``balance`` and nothing changed by more than the seeds do; where
they are far too small it costs 3-5% of throughput for up to 8% fewer
loads.  (A bound added to the members' mean instead, 2 x (gain - 1)
requests more, did no better; see ``simulations/README.rst``.)

Stickiness.  When this LB is alone it goes further, with the book of
keys that re-learning keeps (the class and worker each key last went
to, the least recently seen forgotten first).  The member a key last
went to keeps it up to ``stick`` times the bound: that one holds the
key's data for sure, while a key the bound had moved on used to come
back to its rendezvous owner and be loaded there once more.  A key the
book does not know goes to the least busy member: no one holds it yet,
so placing it where it waits least costs nothing.  On the NASA log this
cut loads by an eighth.  Rendezvous still decides a key whose last
worker is busy or gone, a key whose owner is starting (slow start gives
a starter its keys by rendezvous), and a key that went to its owner
before the class grew (``joins``): at light load nothing else would
give a new member its share of the keys.  The
children of one ``--processes`` are not several LBs: they keep one book
of where keys went and one record of each class's last recruit in
shared memory, and count each other's requests in flight and measures
of locality (``routing/siblings.py``, ``share_with``), so they route as this
one LB.

Several LBs.  LBs on other hosts cannot share memory, but they share
the workers, and each worker hears every LB.  So each LB notes the
keys it sends each worker (``PoolWorker.sent``) and sends them to the
worker now and then (``sent_keys``, ``frames.Keys``, every 50 ms); the
worker relays them to its other LBs, which write them into their books
(``take_keys``) as if they had sent them.  While every worker relays
(``relayed``: several LBs, each worker's Hello offering ``keys``, and
``separate_books`` off) the LBs' books agree to within a relay, and
each routes as a lone LB does (its book, stickiness, the measured gain
and its balance), recruiting from the ring all LBs share.  In the
simulator that took NASA with 2 LBs from 0.145-0.161 loads a request
to 0.100-0.116, with 4 from 0.166-0.175 to 0.111-0.117, elastic with 2
from 0.173-0.198 to 0.114-0.125, and ``many_lbs`` with 2 from 4.16 to
4.03, each with more throughput.  It costs where workers differ much
(``mixed_fleet`` with 2 LBs: 667-697 requests a second against 779-812
with separate books) unless members count how busy they are
(``busy_members``: 820-834).  ``separate_books`` turns it off.
Without relays (a worker of the version before, or the setting) LBs
keep different books, so they go by rendezvous alone and still agree.
A key sent to two workers within one relay may be booked at either:
both hold its data for a while.  The cost: booking a relayed key takes
0.09 us compiled and decoding it 0.05, and each LB books the keys of
every other LB's requests, so with 8 LBs about 1 us a request of its own
(out of some 20 us of the LB's CPU a request).

Spill.  When no member is under the cap, the request goes, as in the
published algorithm, to the best skilled worker under the cap, unless
the quickest member is expected to serve it ``STAY`` times sooner (in
(backlog + 1) / score, the score being its requests per second in the
class): a worker cold in the class is slow there, and sending it the
request relieves no one.  Failing a skilled worker under the cap, the
request goes to the least recently chosen worker, which becomes skilled.

Locality (``routing/locality.py``).  Everything above holds keys where their
data is, which pays only where a worker serves a key faster for having
served it before.  Each worker says how long the application took for
each response, and the pool compares, per class, the requests it placed
at their key's home (the worker the key last went to) with those it
placed away.  Their ratio, the *gain*, bounds every choice: one request
more on the chosen worker may not take it past ``1 + MOVE_COST * (gain -
1 - NOISE)`` times the least busy worker's backlog plus one; past it the
request goes to the least busy worker.  A cache-less application (a
gain of 1: a CPU-bound view, a wait on a remote service) is then routed
by least backlog, its keys going home only on ties, and a hot key with
little data spreads over as many workers as its load needs, since a
second worker serves it as fast after its first request there.  Such a
class skips members, rendezvous and slow start altogether
(``_balanced``): the bound would overrule them anyway, and they cost
the LB some 20 us a request for nothing.  Where caches matter (the logs' gains are 2 to 10), the bound is dozens of
times the least busy backlog and the rules above decide alone.
``MOVE_COST`` (64) counts what a move costs beyond its own request (its
key's data loaded again, and its later requests'): tried on the
simulator's logs and synthetic scenarios, 16 and 32 loaded up to 4% more
than 64.  ``NOISE`` (0.2) is what a live measurement of no gain reads
over 1 (1.04-1.09 for a CPU-bound view on threads).  Until any gain is
known, one in ``EXPLORE`` requests that find their worker busier than
the least busy one goes to another member to learn one: with two
workers the balance bound, relative to the members' mean, never moves
a hot key, and without a request away nothing is learned.  Only an LB
alone, or LBs whose keys are relayed (see "Several LBs"), measures and
bounds: with several that go by rendezvous, a key's home is only its
rendezvous owner, which the other LBs' moves leave without its data,
and the gains read low (1.3-1.6 where a lone LB reads 2.7 on
``many_lbs``): the bound moved keys on, and loads grew 16-33%.

Slow start (``routing/slowstart.py``).  A worker added to a running pool joins
a class or two big enough for its fair share, its weight there floored
near the other members' so that its cold cache does not cost it the
keys, and takes no more than the mean backlog while it starts; once it
has its share, its floors fade while it takes more than that.

Re-learning (``routing/relearn.py``).  A book of recent keys tells the pool
when a changed classifier moved a class's keys, and where their data
went; ``reset_skills()`` forgets every skill, and the pool resets by
itself when most requests hit classes no worker is skilled in.

Structure.  ``AffinityPool`` is a ``pool.Pool`` that holds its parts and
calls them, each with state of its own: ``members``, a ``Members`` (the
classes' footprints and widths, their members and recruits, and the
keys each worker is counted to hold), ``slowstart``, a ``SlowStart``
(the starters and the workers whose floors fade), ``relearning``, a
``Relearning`` (the book of keys, stale skills, resets), and
``locality``, a ``Locality`` (the pool's measure of gains).  The pool
owns the classes' records (``classstats.ClassStats``, which the parts
read and change), the counts of requests and the ``skills_version`` that
any change of skills bumps: the parts' calls say when theirs changed
some.  Each part's module says what it is given and what it does.

Requests without a key (``key=None``, affinity turned off) go as in the
published algorithm: best score per unit of backlog among all skilled
workers, within the pool's gain's bound.  ``get`` costs O(workers
skilled in the class), plus O(log k) for the sketches on a key's first
request in a footprint window (again, it would change nothing there),
and its hashes on its first request (the classes remember them).
Memory is bounded: the book, the sketches and the keys remembered
(``members.MAX_KEYS_SEEN``) have sizes, and a class not requested for
two footprint windows, worth less than a request by then, is forgotten
(``Members._forget_idle``).

Weak spots, admitted.  Keys pinned to owners balance load worse than
the published choice by backlog: on single-threaded workers, where a
request queues behind another, the simulator shows less throughput than
the published policy (a lower ``balance`` helps).  A class whose
requests never go away from home keeps the pool's gain, which a site of
cache-bound and cache-less classes blends: with two workers, a hot
cache-less key of such a site may stay at its owner.  So may one behind
several LBs without relays, which measure nothing (the balance bound
spreads it over three members or more).
"""

from __future__ import annotations

import math
from typing import Any, Callable, ClassVar, Dict, Final, Hashable, List, Mapping, Optional, Set, Tuple

from zc_lb.routing.classstats import ClassStats, rendezvous_draw, stable_hash
from zc_lb.routing.locality import Locality
from zc_lb.routing.members import Members, MembersHost
from zc_lb.routing.pool import Pool, PoolWorker
from zc_lb.routing.relearn import AWAY, BookEntry, Relearning
from zc_lb.settings import LB_SETTINGS
from zc_lb.routing.slowstart import SlowStart

# (Final: compiled code has them as constants, where it would look a plain
# module name up in the module's dict each time, some 30 times a request
# in all the pool's modules.  Those the tests change stay plain: MAX_KEYS_SEEN
# in members, PRIOR, MAX_MIXED and MAX_DRAWS in classstats, BOOK_SIZE in relearn.)
MIN_BOUND: Final = 2.0  # a key may always wait behind one request at its owner
GAIN_BALANCE: Final = 0.5  # a class's balance is at least this times its gain
STAY: Final = 2.0  # a capped member twice as quick as the spill target keeps a request
MOVE_COST: Final = 64.0  # a key moved costs its request's gain this many times over
EXPLORE: Final = 16  # before any gain is known, one in this many busy requests goes away
NOISE: Final = 0.2  # of a gain: what a measurement of no gain at all may read over 1
MAX_SENT: Final = 4096  # keys noted for a worker between two relays (50 ms), at most


class AffinityPool(Pool, MembersHost):
    """Résumé routing with affinity keys, footprint-sized classes, slow
    start and re-learning; see the module docstring.

    The pool owns the classes (``classes``: name -> ``ClassStats``),
    the counts every part reads (``requests``, ``total``,
    ``skills_version``), the measure of locality (``locality``) and its
    own counters.  Its parts own the rest and are called with what they
    need: ``members`` (a ``Members``: the classes' footprints and
    widths, their members, recruits, the keys each worker is counted to
    hold), which reads the pool as its ``MembersHost``, ``slowstart``
    (a ``SlowStart``: the starters and the workers whose floors fade)
    and ``relearning`` (a ``Relearning``: the book of keys, stale
    skills, resets).  Their dicts ``starting``, ``fading`` and ``book``
    are read here as attributes of the pool, and their counts
    (``resets``, ``adoptions``, ``unskilled``, ``relearn_armed``) are
    properties."""

    SETTINGS: ClassVar[Tuple[str, ...]] = Pool.SETTINGS + (
        "spread", "footprint_window", "slow_start", "balance", "stick", "widen",
        "separate_books", "busy_members")
    spread: float
    footprint_window: int
    slow_start: int
    balance: float
    stick: float
    widen: float
    separate_books: bool
    busy_members: bool

    def __init__(self, variance: Any = LB_SETTINGS["variance"].default,
                 backlog_history: Any = LB_SETTINGS["backlog_history"].default,
                 unskilled_score: Any = LB_SETTINGS["unskilled_score"].default,
                 spread: Any = LB_SETTINGS["spread"].default,
                 footprint_window: Any = LB_SETTINGS["footprint_window"].default,
                 slow_start: Any = LB_SETTINGS["slow_start"].default,
                 balance: Any = LB_SETTINGS["balance"].default,
                 stick: Any = LB_SETTINGS["stick"].default,
                 widen: Any = LB_SETTINGS["widen"].default,
                 separate_books: Any = LB_SETTINGS["separate_books"].default,
                 busy_members: Any = LB_SETTINGS["busy_members"].default) -> None:
        # (Any: checked by the settings table, as ``Pool``'s are)
        self._set_settings(spread=spread, footprint_window=footprint_window,
                           slow_start=slow_start, balance=balance, stick=stick, widen=widen,
                           separate_books=separate_books, busy_members=busy_members)
        self.requests = 0  # requests routed with a class
        self.classes: Dict[str, ClassStats] = {}
        self.total = 0.0  # decayed requests of every class
        self.spills = 0
        self.bounded = 0  # requests moved off a worker past the bound of locality
        self.unexplored = 0  # requests that could have gone away to learn a gain
        self.explored = 0  # and those that did
        self.locality = Locality()
        self.skills_version = 0  # changes whenever any skill or worker does
        self.members = Members(self, self.footprint_window)
        self.slowstart = SlowStart(slow_start)
        self.starting = self.slowstart.starting  # (read on every request)
        self.fading = self.slowstart.fading  # done starting, floors fading
        self.hash_seed = 0  # the same on every LB; the simulator varies it
        # With several LBs, whether each hears, through the workers, where
        # the others sent keys (``take_keys``): then their books agree
        # enough to route as a lone LB does, recruiting from the ring.
        self.relayed = False
        self.siblings: Any = None  # the other processes of --processes (``share_with``)
        self.by_hash: Dict[int, PoolWorker] = {}  # (their hashes of the workers' names)
        super().__init__(variance, backlog_history, unskilled_score)
        self.relearning = Relearning(self.workers, self.skilled, self.classes)
        self.book = self.relearning.book  # (read on every request)

    @property
    def resets(self) -> int:
        """Times every skill was forgotten (``reset_skills``, or by itself)."""
        return self.relearning.resets

    @property
    def adoptions(self) -> int:
        """Workers that classes took following their moved keys."""
        return self.relearning.adoptions

    @property
    def unskilled(self) -> float:
        """Decayed requests whose class had no skilled worker."""
        return self.relearning.unskilled

    @property
    def relearn_armed(self) -> bool:
        """Whether the pool may reset skills by itself."""
        return self.relearning.armed

    @property
    def stale(self) -> Dict[PoolWorker, Set[str]]:
        """Worker -> classes whose keys moved away from it (``routing/relearn.py``)."""
        return self.relearning.stale

    def _settings_changed(self) -> None:
        super()._settings_changed()
        self.rate_decay = 1.0 - 1.0 / self.footprint_window
        self.members.configure(self.footprint_window)
        self.slowstart.configure(self.slow_start)

    # -- membership ---------------------------------------------------

    def _added(self, worker: PoolWorker) -> None:
        worker.salt = stable_hash(worker.name)
        if self.siblings is not None:
            self.by_hash[self.siblings.worker_hash(worker.name)] = worker
        self.skills_version += 1
        self.members.workers_changed()
        if self.requests:  # (a running pool: eased in, or at once with slow_start 0)
            self.slowstart.add(worker, self.requests)

    def remove(self, handle: Hashable) -> None:
        """Forget a worker entirely, even with requests in flight on it."""
        worker = self.workers.get(handle)
        if worker is not None:
            self.slowstart.remove(worker)
            self.relearning.remove(worker)
            self.members.workers_changed()
            if self.siblings is not None:
                self.by_hash.pop(self.siblings.worker_hash(worker.name), None)
        super().remove(handle)
        self.skills_version += 1

    def new_resume(self, handle: Hashable, resume: Mapping[str, float],
                   pause: Optional[Callable[[], None]] = None) -> Set[str]:
        """Replace a worker's skills by those of its new résumé, but for
        classes whose keys moved away from it (see ``routing/relearn.py``): it
        holds their old data, so its score for them means nothing until
        its résumé has dropped them.  The classes touched work out their
        members again.  (``pause``: see ``Pool.new_resume``.)"""
        touched = super().new_resume(handle, resume, pause)
        worker = self.workers.get(handle)
        if worker is None:
            return touched
        self.relearning.drop_stale(worker, touched)
        self.members.rework(touched)
        return touched

    def reset_skills(self) -> None:
        """Forget every skill: résumés from now on teach the pool again
        (an operator's switch: what requests hit before counts no more)."""
        self.relearning.reset(self.total)
        self.skills_version += 1

    # -- routing ------------------------------------------------------

    def get(self, rclass: Optional[str], key: Optional[str] = None
            ) -> Optional[Hashable]:
        """Choose a worker for a request of ``rclass`` with affinity ``key``."""
        self.placed = None
        if not self._lru:
            return None
        if rclass is None:
            return self._least_backlog()
        self.requests += 1
        decay = self.rate_decay
        self.total = total = self.total * decay + 1.0
        skilled = self.skilled.get(rclass)
        relearning = self.relearning
        if relearning.notice_unskilled(skilled, decay, self.requests, total,
                                       self.footprint_window):
            self.skills_version += 1
        if key is None:
            return self._unkeyed(rclass)
        stats, key_hash, book_hash = self.members.observe(rclass, key)
        entry = booked = self.book.get(book_hash)
        # (what locality buys is measured by a lone LB, or by LBs whose
        # books the workers' relays keep alike)
        alone = self.lbs == 1 or self.relayed
        siblings = self.siblings
        placed = 0  # (the worker a sibling LB last sent the key to, hashed)
        if siblings is not None and alone:
            placed = siblings.placed(book_hash, stats.salt)
            if placed:
                entry = self._siblings_entry(rclass, entry, placed)
        gain = self.locality.gain(stats) if alone else None
        if gain is not None and gain <= 1.0 + NOISE:  # (its keys buy nothing)
            return self._balanced(rclass, stats, book_hash, entry, booked)
        if relearning.moved(rclass, stats, entry, self.unskilled_score):
            self.skills_version += 1
        if self.starting or self.fading:
            self._slow_start(rclass, stats)
        members = self.members.of(rclass, stats)
        if self.starting:
            self.skills_version += self.slowstart.offer(stats, members, key_hash, self.total)
        balance = self.balance
        if gain is not None and gain * GAIN_BALANCE > balance:
            balance = gain * GAIN_BALANCE  # (a key worth more at home waits longer there)
        chosen, away, home = self._place(rclass, stats, members, key_hash, entry, alone,
                                         balance)
        if chosen.backlog and alone:  # (an idle worker is within every bound)
            weighed = self._weighed(chosen, gain, members)
            if weighed is not chosen:
                chosen, away = weighed, True
        self._booked(book_hash, booked, rclass, chosen, AWAY if away else stats.joins)
        if siblings is not None and alone:
            chosen_hash = siblings.worker_hash(chosen.name)
            if chosen_hash != placed:
                siblings.place(book_hash, stats.salt, chosen_hash)
        if home is not None and home.handle in self.workers:
            self.placed = (stats, chosen is home)
        return self._chosen(chosen)

    def _siblings_entry(self, rclass: str, entry: Optional[BookEntry], placed: int
                        ) -> Optional[BookEntry]:
        """The book's ``entry`` for a key, with the worker a sibling LB
        last sent it to in ``rclass`` (``placed``, its name hashed) as the
        worker that holds its data (routing/siblings.py): the siblings keep one
        book of where keys are, each its own of the rest."""
        worker = self.by_hash.get(placed)
        if worker is None:
            return entry
        if entry is None:
            return (rclass, worker, False, AWAY)
        if entry[0] == rclass and entry[1] is not worker:
            return (rclass, worker, entry[2], AWAY)
        return entry

    def share_with(self, siblings: Any) -> None:
        """Route as one LB with the other processes of ``--processes``
        (a ``siblings.Siblings``): one book of where keys went, each
        class's last recruit, and the backlogs and the pool's measure of
        locality counted over all (``take_elsewhere``, ``take_measure``)."""
        self.siblings = siblings
        self.by_hash = {siblings.worker_hash(worker.name): worker
                         for worker in self.workers.values()}

    def _booked(self, book_hash: int, booked: Optional[BookEntry], rclass: str,
                chosen: PoolWorker, where: int) -> None:
        """A key of ``rclass`` goes to ``chosen``: the book says so
        (``Relearning.remember``; ``booked``, what it said before), and
        with relays, so will the other LBs (``sent_keys``)."""
        self.relearning.remember(book_hash, booked, rclass, chosen, where)
        if self.relayed and len(chosen.sent) < MAX_SENT:
            chosen.sent.append((rclass, book_hash))

    def sent_keys(self, handle: Hashable) -> Dict[str, List[int]]:
        """The keys sent to worker ``handle`` since the last call, class
        -> their hashes in the book, for the other LBs (``take_keys``),
        to which the worker relays them; forgotten here."""
        worker = self.workers.get(handle)
        keys: Dict[str, List[int]] = {}
        if worker is None or not worker.sent:
            return keys
        sent, worker.sent = worker.sent, []
        for rclass, book_hash in sent:
            hashes = keys.get(rclass)
            if hashes is None:
                keys[rclass] = [book_hash]
            else:
                hashes.append(book_hash)
        return keys

    def take_keys(self, handle: Hashable, keys: Mapping[str, List[int]]) -> None:
        """Another LB sent these keys (class -> their hashes in the book)
        to worker ``handle``, which relayed them here: the book now says
        they are there, as if this LB had sent them (moved on, so that
        they stay)."""
        worker = self.workers.get(handle)
        if worker is None:
            return
        book = self.book
        remember = self.relearning.remember
        for rclass, hashes in keys.items():
            for book_hash in hashes:
                remember(book_hash, book.get(book_hash), rclass, worker, AWAY)

    def measure(self) -> Tuple[float, float]:
        """The pool's measure of locality (its decayed sums of away time
        over home time, and their count), for the siblings: each sees a
        part of the requests, and the pool's gain counts all of them."""
        return self.locality.ratio, self.locality.weight

    def take_measure(self, ratio: float, weight: float) -> None:
        self.locality.ratio_elsewhere = ratio
        self.locality.weight_elsewhere = weight

    def _unkeyed(self, rclass: str) -> Hashable:
        """A request without a key goes as in the published algorithm,
        within the bound of the pool's gain (see "Locality")."""
        published = self.published(rclass)
        if published.backlog and self.lbs == 1:
            published = self._weighed(published, self.locality.pool_gain())
        return self._chosen(published)

    def _slow_start(self, rclass: str, stats: ClassStats) -> None:
        """Slow start's part in a request of ``rclass`` (``routing/slowstart.py``):
        a starter behind its ramp may join the class; the floors of the
        workers done starting follow their shares."""
        slowstart = self.slowstart
        if self.starting:
            skilled = self.skilled.get(rclass)
            if skilled is None:
                skilled = self.skilled[rclass] = {}
            if slowstart.join(rclass, stats, skilled, self.requests, len(self.workers),
                              self.backlog, self.total, self.unskilled_score):
                self.skills_version += 1
        if self.fading:
            slowstart.fade(self.requests, len(self.workers))

    def _place(self, rclass: str, stats: ClassStats, members: Dict[PoolWorker, float],
               key_hash: int, entry: Optional[BookEntry], alone: bool, balance: float
               ) -> Tuple[PoolWorker, bool, Optional[PoolWorker]]:
        """Where a key goes among the class's ``members`` (``_owner``), or
        else where it spills: the worker, whether it is not the key's
        owner, and the key's home, the worker that holds its data if any
        does (None behind other LBs, whose moves it cannot know).
        ``entry`` is what the book holds for the key; ``balance``, the
        class's balance (see "Balance" in the module docstring)."""
        if alone and self.stick:  # (other LBs keep books of their own)
            # The worker holding the key's data, unless the key went to
            # its owner there before the class grew: a new member may
            # own it now.
            home = entry[1] if entry is not None and entry[0] == rclass else None
            last = home if entry is not None and (
                entry[3] == AWAY or entry[3] == stats.joins) else None
            chosen, away, owner = self._owner(members, key_hash, balance, last, entry is None)
            if entry is not None and entry[0] != rclass:
                home = owner  # (a path of several classes: the book cannot say)
        else:
            chosen, away, owner = self._owner(members, key_hash, balance)
            home = owner if alone else None
        if chosen is None:
            chosen, away = self._spill(rclass, members, key_hash, balance), True
        return chosen, away, home

    def _chosen(self, worker: PoolWorker) -> Hashable:
        """Account a request given to ``worker`` (and to slow start, see
        ``routing/slowstart.py``); its handle."""
        if self.starting or self.fading:
            self.slowstart.got(worker, self.requests)
        return super()._chosen(worker)

    def _balanced(self, rclass: str, stats: ClassStats, book_hash: int,
                  entry: Optional[BookEntry], booked: Optional[BookEntry]) -> Hashable:
        """Least backlog, the worker the key last went to on ties: for a
        class whose keys buy nothing where they are, the bound of
        ``_weighed`` would send every request there anyway, and members,
        rendezvous and slow start cost the LB's time for nothing.  The
        key's last worker still counts as its home, so that the gain
        stays measured and the class goes back to its members if its
        keys come to buy something (a cache warmed up, an app changed).
        A worker that is starting takes its share at once: slow start
        eases in a cold cache, and here there is none.  (Left out, a
        worker that joined under load never served and never started.)
        ``booked`` is this LB's own book's entry, ``entry`` the same with
        its siblings' worker (``_siblings_entry``)."""
        home = entry[1] if entry is not None and entry[0] == rclass else None
        if home is not None and self.workers.get(home.handle) is not home:
            home = None
        least = self.least_loaded()  # (a starter too: it has no cache to warm)
        assert least is not None
        chosen = home if home is not None and home.backlog <= least.backlog else least
        self._booked(book_hash, booked, rclass, chosen, AWAY)
        if home is not None:
            self.placed = (stats, chosen is home)
        return self._chosen(chosen)

    def _spill(self, rclass: str, members: Dict[PoolWorker, float],
               key_hash: int, balance: float) -> PoolWorker:
        """Where a request goes that no member can take under the cap:
        the key's owner among the class's skilled workers under the cap,
        unless a member is quicker (``_stay``), else the published
        spill."""
        chosen = self._owner(self.skilled[rclass], key_hash, balance)[0]
        if chosen is not None:
            chosen = self._stay(rclass, members, chosen)
        if chosen not in members:
            self.spills += 1
        if chosen is None:
            for worker in self.starting:  # a cold cache spills worst
                self.to_end(worker)
            chosen = self.published(rclass)
            self.relearning.fresh(chosen, rclass)
        return chosen

    def _weighed(self, chosen: PoolWorker, gain: Optional[float],
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
        least = self.least_loaded(self.starting)
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
            other = self.least_loaded()
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
        scores = [score for other, score in self.skilled.get(rclass, {}).items()
                  if rclass not in other.given]
        return sum(scores) / len(scores) if scores else self.unskilled_score

    def served(self, placed: Optional[Tuple[ClassStats, bool]], elapsed: float,
               cache: Optional[bool] = None) -> None:
        """The application took ``elapsed`` seconds for a request that
        ``get`` placed at its key's home, or away from it.  When the
        application said whether its ``cache`` hit, that stands for where
        the request was placed: a hit is a request served where its data
        is, a miss one served where it is not, whatever the book said
        (the data evicted at home, or already loaded away)."""
        if placed is not None:
            self.locality.observe(placed[0], placed[1] if cache is None else cache, elapsed)

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
        skilled = self.skilled[rclass]
        fastest = None
        for worker in members:
            score = skilled.get(worker)
            if not score or worker in self.starting:
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
        to the least busy member (ties in rendezvous order): no one holds
        it yet."""
        count, total, first, kept, owner, least = self._ranked(members, key_hash, balance, last)
        if first is None:
            return None, False, owner
        # (float(): compiled, a float over an int is worked out on objects)
        bound = balance * float(total + 1) / float(count)
        if bound < MIN_BOUND:
            bound = MIN_BOUND
        starting = self.starting
        if (kept is not None and kept.backlog < self.stick * bound
                and not (starting and owner in starting)):
            return kept, kept is not owner, owner
        if new:
            chosen = least
        elif count == 1 or first.backlog < bound:
            chosen = first
        else:  # the first in rendezvous order under the bound, if any
            chosen = self._ranked(members, key_hash, balance, None, bound)[2] or first
        return chosen, chosen is not owner, owner

    def _ranked(self, members: Dict[PoolWorker, float], key_hash: int, balance: float,
                last: Optional[PoolWorker], below: float = math.inf
                ) -> Tuple[int, int, Optional[PoolWorker], Optional[PoolWorker],
                           Optional[PoolWorker], Optional[PoolWorker]]:
        """How many members are under the cap (and with a backlog
        ``below``), and their total backlog; the first of them in the
        key's rendezvous order, ``last`` if one of them, the key's owner
        (the first of all members), and the least busy of them (ties to
        the first in rendezvous order).  (Not a starter busier than the
        pool's mean.)  The cap is ``balance`` (the class's) times the
        published one: the bound keeps the members even among themselves,
        so the cap only has to catch members far over the pool's mean, and
        a key's owner, which holds its data, is worth a longer queue than
        a skilled worker.  (No list of them: three requests in four want
        only these.)"""
        n = len(self.workers)
        max_backlog = balance * self.variance * self.mbacklog / n
        if max_backlog < 1.0:
            max_backlog = 1.0
        min_backlog = self.oldest().mbacklog + 1.0
        starting = self.starting
        busy = self.backlog / n  # a starter takes no more than the mean
        count = total = 0
        owner = first = least = None  # first: the owner among those under the cap
        top = best = least_weight = 0.0
        kept = None  # ``last``, if under the cap
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
            if least is None or backlog < least.backlog or (
                    backlog == least.backlog and weight > least_weight):
                least, least_weight = worker, weight
        return count, total, first, kept, owner, least

    # -- introspection ------------------------------------------------

    def status(self) -> dict:
        """The published pool's status, with the affinity settings."""
        status = super().status()
        gain = self.locality.pool_gain()
        status.update(spread=self.spread, footprint_window=self.footprint_window,
                      balance=self.balance, stick=self.stick, widen=self.widen,
                      separate_books=self.separate_books, busy_members=self.busy_members,
                      widened=sum(1 for stats in self.classes.values() if stats.extra),
                      widenings=self.members.widenings, narrowings=self.members.narrowings,
                      spills=self.spills, bounded=self.bounded, explored=self.explored,
                      locality_gain=(None if gain is None else round(gain, 3)),
                      slow_start=self.slow_start, skill_resets=self.resets,
                      starting=len(self.starting), lbs=self.lbs, keys_relayed=self.relayed)
        return status
