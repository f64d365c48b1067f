"""The affinity policy: résumés pick a class's workers, keys split the class.

Theory of operation
-------------------

The published algorithm (``pool.Pool``) sends a class to whichever of its
skilled workers has the best score per unit of backlog.  Every skilled
worker therefore ends up caching the class's whole working set: a class
bigger than one worker's cache misses on every worker it uses, and a
small one is copied wherever the cap spills it.  ``AffinityPool`` keeps
the published cap and résumés and adds what follows, each part in a
module of its own, whose docstring tells its rules and their evidence.

Members (``routing/members.py``).  A class's keys are split among its
*members*: as many of its skilled workers as its share of the requests
and of the distinct keys asks for (its *width*), those that would serve
it soonest (``busy_members``; without it the best-scored), one more
while they are much busier than the pool's other workers, and a recruit
when it has too few.  Members are worked out again every ``REFRESH``
requests of the class or when skills change, not on every request.

Placement (``routing/placement.py``).  A request may carry a *key*
finer than its class (by default its path).  Among the class's members
under the cap, a key goes to its owner by weighted rendezvous, so that
each member owns a share of the keys in proportion to its skill and
every LB computes the same owner from the same résumés ("Affinity"); on
to the next member in the key's order while the owner is busy past a
bound ("Balance"); to the member it last went to, which holds its data,
when this LB knows it ("Stickiness"); outside the members when none is
under the cap ("Spill"); and to the least busy worker when what keeping
it buys (its class's *gain*, measured by ``routing/locality.py``) is
not worth the wait ("Locality").

Siblings.  The children of one ``--processes`` are not several LBs:
they keep one book of where keys went and one record of each class's
last recruit in shared memory, and count each other's requests in
flight and measures of locality (``routing/siblings.py``,
``share_with``), so they route as one LB.

Several LBs.  LBs on other hosts cannot share memory, but they share
the workers, and each worker hears every LB.  So each LB notes the
keys it sends each worker (``PoolWorker.sent``) and sends them to the
worker now and then (``sent_keys``, ``frames.Keys``, every 50 ms); the
worker relays them to its other LBs, which write them into their books
(``take_keys``) as if they had sent them.  While every worker relays
(``relayed``: several LBs, each worker's Hello offering ``keys``, and
``separate_books`` off) the LBs' books agree to within a relay, and
each routes as a lone LB does (its book, stickiness, the measured gain
and its balance), recruiting the worker another LB recruited, which
the relays tell (``recruited_elsewhere``), else from the ring all LBs
share.  In the simulator that took NASA with 2 LBs from 0.145-0.161 loads a request
to 0.098-0.114, with 4 from 0.166-0.175 to 0.113-0.119, elastic with 2
from 0.173-0.198 to 0.112-0.122, and ``many_lbs`` with 2 from 4.16 to
4.09, each with more throughput.  Where workers differ much it cost
throughput (``mixed_fleet`` with 2 LBs: 667-697 requests a second
against 779-812 with separate books) until members counted how busy
they are (``busy_members``, the default: 801-840).  ``separate_books``
turns it off.  A class this LB already routes takes another LB's
recruit at once, short of a member or not (``_take_recruit``): kept
for when it was short, the recruit went unused here while the LBs'
widths for the class differed, and idled in this LB's view (NASA with
4 LBs, seeds 1-24: a worker under half a fair share of the work on 12
seeds, and 5 with it, at 4% more throughput).
Without relays (the setting) LBs keep different books, so they go by
rendezvous alone and still agree.
A key sent to two workers within one relay may be booked at either:
both hold its data for a while.  The cost: booking a relayed key takes
0.09 us compiled and decoding it 0.05, and each LB books the keys of
every other LB's requests, so with 8 LBs about 1 us a request of its own
(out of some 20 us of the LB's CPU a request).

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
keys each worker is counted to hold), ``placement``, a ``Placement``
(where a key goes among them), ``slowstart``, a ``SlowStart`` (the
starters and the workers whose floors fade), ``relearning``, a
``Relearning`` (the book of keys, stale skills, resets), and
``locality``, a ``Locality`` (the pool's measure of gains).  The pool
owns the classes' records (``classstats.ClassStats``, which the parts
read and change), the counts of requests and the ``skills_version`` that
any change of skills bumps: the parts' calls say when theirs changed
some.  It keeps the book's relays and the siblings' view of it itself
(``get``, ``sent_keys``, ``take_keys``, ``share_with``).  Each part's
module says what it is given and what it does; ``Members`` and
``Placement`` read the pool through a trait each declares
(``MembersHost``, ``PlacementHost``).

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

Weak spots, admitted.  Each part's module admits its own (placement's
keys pinned to their owners balance load worse than backlogs do; shares
and footprints are per LB).  The book's are under "Several LBs": a key
sent to two workers within one relay may be booked at either, and each
LB books the keys of every other LB's requests.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Dict, Final, Hashable, List, Mapping, Optional, Set, Tuple

from zc_lb.routing.classifier import MAX_CLASS, bounded_class
from zc_lb.routing.classstats import ClassStats, stable_hash
from zc_lb.routing.locality import PLACED_AWAY, PLACED_HOME, Locality, shown_ratio
from zc_lb.routing.members import Members, MembersHost
from zc_lb.routing.placement import NOISE, Placement, PlacementHost
from zc_lb.routing.pool import Pool, PoolWorker
from zc_lb.routing.relearn import AWAY, BookEntry, Relearning
from zc_lb.settings import LB_SETTINGS
from zc_lb.routing.slowstart import SlowStart

# (Final: compiled code has them as constants, where it would look a plain
# module name up in the module's dict each time, some 30 times a request
# in all the pool's modules.  Those the tests change stay plain: MAX_KEYS_SEEN
# in members, PRIOR in classstats, BOOK_SIZE in relearn.)
MAX_SENT: Final = 4096  # keys noted for a worker between two relays (50 ms), at most
MAX_RECRUITS: Final = 65536  # classes whose recruit by another LB is remembered, at most


class AffinityPool(Pool, MembersHost, PlacementHost):
    """Résumé routing with affinity keys, footprint-sized classes, slow
    start and re-learning; see the module docstring.

    The pool owns the classes (``classes``: name -> ``ClassStats``), the
    counts every part reads (``requests``, ``total``, ``skills_version``),
    the measure of locality and the siblings' view of the book
    (``siblings``, ``by_hash``).  Its parts own the rest: ``members``
    (footprints, widths, members, recruits, the keys each worker holds)
    and ``placement`` (where a key goes among them), which read the pool
    as their ``MembersHost`` and ``PlacementHost``; ``slowstart`` (the
    starters, and the workers whose floors fade) and ``relearning`` (the
    book of keys, stale skills, resets), whose ``starting``, ``fading``
    and ``book`` are read as the pool's, and their counts as properties."""

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
        self.locality = Locality()
        self.skills_version = 0  # changes whenever any skill or worker does
        self.members = Members(self, self.footprint_window)
        self.placement = Placement(self)
        self.slowstart = SlowStart(slow_start)
        self.starting = self.slowstart.starting  # (read on every request)
        self.fading = self.slowstart.fading  # done starting, floors fading
        self.hash_seed = 0  # the same on every LB; the simulator varies it
        # With several LBs, whether each hears, through the workers, where
        # the others sent keys (``take_keys``): then their books agree
        # enough to route as a lone LB does, recruiting as the others did.
        self.relayed = False
        # Each class's last recruit by another LB, as the relays tell
        # (``take_keys``), until this LB recruits for the class.
        self.recruits: Dict[str, PoolWorker] = {}
        self.siblings: Any = None  # the other processes of --processes (``share_with``)
        self.by_hash: Dict[int, PoolWorker] = {}  # (their hashes of the workers' names)
        super().__init__(variance, backlog_history, unskilled_score)
        self.relearning = Relearning(self.workers, self.by_ident, self.skilled, self.classes)
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
            if self.siblings is not None:  # (its own entry, not a namesake's added since)
                self.by_hash = {h: w for h, w in self.by_hash.items() if w is not worker}
        super().remove(handle)
        self.skills_version += 1

    def new_resume(self, handle: Hashable, resume: Mapping[str, float],
                   pause: Optional[Callable[[], None]] = None) -> Set[str]:
        """Replace a worker's skills by those of its new résumé, but for
        classes whose keys moved away from it (``routing/relearn.py``): its
        score for their old data means nothing until its résumé has dropped
        them.  The classes touched work out their members again.  (``pause``:
        see ``Pool.new_resume``.)"""
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
        self._placed_as = None
        if not self._lru:
            return None
        if rclass is None:
            return self._least_backlog()
        self.requests += 1
        decay = self.rate_decay
        self.total = total = self.total * decay + 1.0
        if self.relearning.notice_unskilled(self.skilled.get(rclass), decay, self.requests,
                                            total, self.footprint_window):
            self.skills_version += 1
        if key is None:
            return self._unkeyed(rclass)
        if len(key) > MAX_CLASS:  # (the classes remember keys: short, as a class's name)
            key = bounded_class(key)
        return self._keyed(rclass, key)

    def _keyed(self, rclass: str, key: str) -> Hashable:
        """A request with a key: counted in its class (``Members.observe``)
        and given, by what the book (and the siblings) say of the key, to the
        least busy worker if the class's keys buy nothing where they are
        (``_balanced``), else to a member (``_placed``); booked where it went."""
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
        chosen, away, home = self._placed(rclass, stats, key_hash, entry, alone, gain)
        self._booked(book_hash, booked, rclass, chosen, AWAY if away else stats.joins)
        if siblings is not None and alone:
            chosen_hash = siblings.worker_hash(chosen.name)
            if chosen_hash != placed:
                siblings.place(book_hash, stats.salt, chosen_hash)
        if home is not None and home.handle in self.workers:
            self._placed_as = (stats, PLACED_HOME if chosen is home else PLACED_AWAY)
        elif self.placement.first:  # (a first visit: at a member or elsewhere)
            self._placed_as = (stats, self.placement.first)
        return self._chosen(chosen)

    def _placed(self, rclass: str, stats: ClassStats, key_hash: int,
                entry: Optional[BookEntry], alone: bool, gain: Optional[float]
                ) -> Tuple[PoolWorker, bool, Optional[PoolWorker]]:
        """Where a key goes whose data is worth keeping: re-learning told where
        it last went (``Relearning.moved``), slow start given its part, the
        class's members worked out (``Members.of``), and the key placed among
        them (``Placement.place``, which says what it returns)."""
        if self.relearning.moved(rclass, stats, entry, self.unskilled_score):
            self.skills_version += 1
        if self.starting or self.fading:
            self._slow_start(rclass, stats)
        members = self.members.of(rclass, stats)
        if self.starting:
            self.skills_version += self.slowstart.offer(stats, members, key_hash, self.total)
        return self.placement.place(rclass, stats, members, key_hash, entry, alone, gain)

    def _balanced(self, rclass: str, stats: ClassStats, book_hash: int,
                  entry: Optional[BookEntry], booked: Optional[BookEntry]) -> Hashable:
        """A key of a class whose keys buy nothing where they are goes by
        least backlog (``Placement.balanced``); the book still says where it
        went, and its last worker counts as its home, so that the gain stays
        measured.  ``booked``: this LB's book's entry; ``entry``, with its
        siblings' worker (``_siblings_entry``)."""
        chosen, home = self.placement.balanced(rclass, entry)
        self._booked(book_hash, booked, rclass, chosen, AWAY)
        if home is not None:
            self._placed_as = (stats, PLACED_HOME if chosen is home else PLACED_AWAY)
        return self._chosen(chosen)

    def _unkeyed(self, rclass: str) -> Hashable:
        """A request without a key goes as in the published algorithm,
        within the bound of the pool's gain (see "Locality" in
        ``routing/placement.py``)."""
        published = self.published(rclass)
        if published.backlog and self.lbs == 1:
            published = self.placement.weighed(published, self.locality.pool_gain())
        return self._chosen(published)

    def _slow_start(self, rclass: str, stats: ClassStats) -> None:
        """Slow start's part in a request of ``rclass`` (``routing/slowstart.py``): a
        starter behind its ramp may join the class; the floors of those done follow their shares."""
        slowstart = self.slowstart
        if self.starting:
            new = slowstart.join(rclass, stats, self.skilled.setdefault(rclass), self.requests,
                                 len(self.workers), self.backlog, self.total, self.unskilled_score)
            if new is not None:  # (skilled afresh, as a recruit: not stale there)
                self.relearning.fresh(new, rclass)
                self.skills_version += 1
        if self.fading:
            slowstart.fade(self.requests, len(self.workers))

    def _chosen(self, worker: PoolWorker) -> Hashable:
        """Account a request given to ``worker`` (and to slow start, see
        ``routing/slowstart.py``); its handle."""
        if self.starting or self.fading:
            self.slowstart.got(worker, self.requests)
        return super()._chosen(worker)

    def served(self, placed: Optional[Tuple[ClassStats, int]], elapsed: float,
               cache: Optional[bool] = None) -> None:
        """The application took ``elapsed`` seconds for a request that
        ``choose`` placed at its key's home, away, or as a first visit
        (``routing/locality.py``).  Where the app said whether its ``cache``
        hit, a hit counts as served where its data is and a miss as not,
        whatever the book said (data evicted at home, or loaded away)."""
        if placed is not None:  # (int(cache): PLACED_HOME on a hit, PLACED_AWAY on a miss)
            how = placed[1] if cache is None or placed[1] > PLACED_HOME else int(cache)
            self.locality.observe(placed[0], how, elapsed)

    # -- the book: relayed between LBs, shared with siblings -----------

    def _booked(self, book_hash: int, booked: Optional[BookEntry], rclass: str,
                chosen: PoolWorker, where: int) -> None:
        """A key of ``rclass`` goes to ``chosen``: the book says so
        (``Relearning.remember``; ``booked``, what it said before), and
        with relays, so will the other LBs (``sent_keys``)."""
        self.relearning.remember(book_hash, booked, rclass, chosen, where)
        if self.relayed and len(chosen.sent) < MAX_SENT:
            chosen.sent.append((rclass, book_hash))

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
            return (rclass, worker.ident, False, AWAY, 0)
        if entry[0] == rclass and entry[1] != worker.ident:
            return (rclass, worker.ident, entry[2], AWAY, entry[4])
        return entry

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
        they stay), and a worker this LB knew unskilled in their class is
        that LB's recruit (``_take_recruit``)."""
        worker = self.workers.get(handle)
        if worker is None:
            return
        book = self.book
        remember = self.relearning.remember
        for rclass, hashes in keys.items():
            if rclass not in worker.resume:  # (another LB's recruit, as far as this one knows)
                self._take_recruit(rclass, worker)
            for book_hash in hashes:
                remember(book_hash, book.get(book_hash), rclass, worker, AWAY)

    def _take_recruit(self, rclass: str, worker: PoolWorker) -> None:
        """Another LB's recruit, for this LB's next recruit in the class
        (``recruited_elsewhere``): made at once where this LB routes the
        class ("Several LBs"), at the class's lowest score."""
        if len(self.recruits) >= MAX_RECRUITS:
            self.recruits.clear()
        self.recruits[rclass] = worker
        skilled = self.skilled.get(rclass)
        if skilled and rclass in self.classes:  # (``worker``, here and unskilled, is the one)
            self.members.recruit(rclass, skilled)

    def backlog_scale(self) -> float:
        """All LBs over those whose requests in flight this one counts (its
        own and its siblings'), ``lbs / siblings``, at least 1: its view of
        a backlog times this stands for the worker's whole backlog (each
        host running as many processes) where one request more is light load."""
        seen = self.siblings.count if self.siblings is not None else 1
        return float(self.lbs) / float(seen) if self.lbs > seen else 1.0

    def recruited_elsewhere(self, rclass: str, skilled: Dict[PoolWorker, float],
                            busiest: bool) -> Optional[PoolWorker]:
        """The worker another LB recruited for ``rclass`` (the last one the
        relays or the siblings tell of) for this LB to recruit too, so that
        their members agree; None if there is none, or it is gone, already
        skilled, or a starter for a class ``busiest``.  (From the ring alone,
        2 and 8 LBs loaded NASA 9% and 13% more: simulations/README.rst.)"""
        worker = self.recruits.pop(rclass, None)
        if worker is None and self.siblings is not None:
            worker = self.by_hash.get(self.siblings.recruited(stable_hash(rclass)))
        if (worker is None or self.workers.get(worker.handle) is not worker
                or worker in skilled or (busiest and worker in self.starting)):
            return None
        return worker

    def recruited(self, rclass: str, worker: PoolWorker) -> None:
        """This LB recruited ``worker`` for ``rclass``: the siblings hear
        of it at once (the other LBs when its keys are relayed)."""
        siblings = self.siblings
        if siblings is not None:
            siblings.recruit(stable_hash(rclass), siblings.worker_hash(worker.name))

    def share_with(self, siblings: Any) -> None:
        """Route as one LB with the other processes of ``--processes``
        (a ``siblings.Siblings``): one book of where keys went, each
        class's last recruit, and the backlogs and the pool's measure of
        locality counted over all (``take_elsewhere``, ``take_measure``)."""
        self.siblings = siblings
        self.by_hash = {siblings.worker_hash(worker.name): worker
                        for worker in self.workers.values()}

    def measure(self) -> Tuple[float, float]:
        """The pool's measure of locality (decayed sums of away over home time,
        and their count), for the siblings: the pool's gain counts all theirs."""
        return self.locality.ratio, self.locality.weight

    def take_measure(self, ratio: float, weight: float) -> None:
        self.locality.ratio_elsewhere = ratio
        self.locality.weight_elsewhere = weight

    # -- introspection ------------------------------------------------

    def status(self) -> dict:
        """The published pool's status, with the affinity settings."""
        status = super().status()
        gain, first = self.locality.pool_gain(), self.locality.first_visit_gain()
        status.update(spread=self.spread, footprint_window=self.footprint_window,
                      balance=self.balance, stick=self.stick, widen=self.widen,
                      separate_books=self.separate_books, busy_members=self.busy_members,
                      widened=sum(1 for stats in self.classes.values() if stats.extra),
                      widenings=self.members.widenings, narrowings=self.members.narrowings,
                      spills=self.placement.spills, bounded=self.placement.bounded,
                      explored=self.placement.explored,
                      locality_gain=shown_ratio(gain), first_visit_gain=shown_ratio(first),
                      slow_start=self.slow_start, skill_resets=self.resets,
                      starting=len(self.starting), lbs=self.lbs, keys_relayed=self.relayed)
        return status
