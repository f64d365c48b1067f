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

Width.  How many members a class gets is set from what the LB sees:
``max(load, footprint)``, where ``load = ceil(n * spread * share)``
(``share``, the class's decayed share of requests: a class with a third
of the traffic needs a third of the pool) and ``footprint = ceil(n *
keys / all_keys)`` (``keys``, the class's distinct keys over the last
``footprint_window`` requests, estimated in bounded memory by a
k-minimum-values sketch: a class with a third of the distinct keys needs
a third of the pool's cache).  A class with more skilled workers than
its width uses the best-scored ones; the rest, no longer sent the class,
drop it from their résumés after ``max_skill_age`` requests, so a hot
class's skilled set grows only while it is needed.  A class short of
members recruits one worker not yet skilled in it: the least recently
chosen one when this LB is alone; with several LBs (``lbs``, which
ZooKeeper tells) the less loaded of the first two on a hash ring from
the class's point, so that every LB recruits the same workers and a
class is not copied once per LB.  A recruit starts with the class's
lowest score, so it takes a real share of the keys at once (with
``unskilled_score`` it would take almost none until its résumé came).
Members are worked out again every ``REFRESH`` requests of the class or
when skills change, not on every request.

Balance.  A key goes to the first member, in the key's rendezvous order,
whose backlog is under ``balance`` times the members' mean (bounded-load
hashing, as HAProxy's ``hash-balance-factor``), so a burst on one key
moves on to its second owner instead of queueing.  The pool-wide cap on a
member is ``balance`` times the published one (its decayed mean backlog
within ``balance * variance`` times the pool's mean): the owner holds the
key's data, so it is worth a longer queue than any skilled worker.

Spill.  When no member is under the cap, the request goes, as in the
published algorithm, to the best skilled worker under the cap, else to
the least recently chosen worker, which becomes skilled.

Slow start.  A worker added to a running pool ramps up over
``slow_start`` requests of the pool.  While its recent share of requests
is under its due (its fair share times the ramp) it joins the next class
that comes big enough for the rest of its fair share with at most half
its keys (once ``PRIOR`` requests per worker have passed without one:
the next worth a whole worker), taking enough of the class's keys for
the rest of its fair share: its weight is floored
at a ratio of the other members' mean score, so its cold cache, which
ranks it last in its own résumé, does not cost it the keys before it
has warmed them.  Few classes warm a cold cache soonest, so while it
starts it is not spilled to (as the least recently chosen worker it
would be, and a class it does not hold costs it a load per object).
It never takes
more than the pool's mean backlog while it starts, so its cold cache
does not turn into a storm of misses: keys it cannot take yet go on to
their next owner, the one that held them.  It is done starting once it
has its share after the ramp (or after ``GIVE_UP`` ramps); the floors
stay as long as it is skilled in those classes.  Keys are not alike (a
third of a class's keys may carry a fifth of its requests): after
``OFFERED`` requests of a class it joined, a starter whose keys carried
less than the share it came for raises its floor there, once, by the
ratio (at most ``MOST_RAISED``).

Re-learning.  A changed classifier moves keys between classes, but
their data stays where it was.  The LB keeps a book of keys (at most
``BOOK_SIZE``): the class and worker each last went to.  When enough of
a class's new keys come from other classes, it follows them: the
workers most of them came from become its members (floored at the
members' mean until the class settles, ranked by how many keys came
from each), and its old members, which hold another class's data, lose
their skill in it until their résumés drop it.  A worker is followed
only once it sent at least half as many keys as the one that sent the
most: a key that last went elsewhere (spilled, or moved on by the
balance bound) does not make a member.  A
path seen moving twice is in several classes (the same path under
several hosts) and is ignored from then on.  ``reset_skills()`` forgets
every skill the LB holds (an operator's switch); the pool also resets by
itself when, over a window, most requests hit classes no worker is
skilled in.  Résumés then teach it again, and the book, which a reset
keeps, comes first: a class no worker is skilled in since the reset
takes the worker its first key the book knows last went to, which may
still hold its data, before it recruits a stranger.  (Not a class
whose résumés merely dropped it: its data is likely gone too.)

Requests without a key (``key=None``, affinity turned off) go as in the
published algorithm: best score per unit of backlog among all skilled
workers.  ``get`` costs O(workers skilled in the class), plus
O(log k) for the sketch.

Weak spots, admitted.  Keys pinned to owners balance load worse than
the published choice by backlog: on single-threaded workers, where a
request queues behind another, the simulator shows less throughput than
the published policy (a lower ``balance`` helps).  A new worker's floors
are kept whatever its résumé says later, so a worker that is slow for
good keeps the keys it took while starting.  Shares
and footprints are per LB: with k LBs each sees all of a class's keys
but only its own load.  The footprint counts keys, not bytes.  A
path shared by two classes may look moved before it is seen moving
twice: such a class may follow a few of its keys once, at start.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from zlib import crc32
from heapq import nlargest
from operator import itemgetter
from typing import Dict, Hashable, List, Mapping, Optional, Tuple

from .errors import ConfigurationError
from .pool import ClasslessPool, Pool, PoolWorker
from .settings import LB_SETTINGS

MASK64 = (1 << 64) - 1
SKETCH_SIZE = 64  # k of the k-minimum-values sketch: ~1/sqrt(k) error
UNIT = float(1 << 53)
STARTED = 0.9  # a starter is behind while under 90% of its ramp's share
RING_CHOICES = 2  # ring recruiting: the less loaded of the first two
RING_POINTS = 16  # points per worker on the recruiting ring
BIG_CLASS = 1.0  # a starter joins classes worth a whole worker or more
OFFERED = 400  # requests of a joined class before a starter checks its keys
MOST_RAISED = 4.0  # the most that check raises its floor by
GIVE_UP = 25  # slow starts after which a worker is done starting anyway
CLASS_TAKE = 0.5  # the most of a class's keys a starter takes
PRIOR = 16  # requests and keys per worker before shares and footprints count
REFRESH = 16  # requests of a class between working out its members again
RELEARN_SHARE = 0.5  # "most requests hit classes no worker is skilled in"
MIN_BOUND = 2.0  # a key may always wait behind one request at its owner
BOOK_SAMPLE = 1  # one key in BOOK_SAMPLE is noted in the book of keys' classes
BOOK_SIZE = 1 << 16  # sampled keys the book remembers, oldest forgotten
MOVED_WINDOW = 32  # sampled new keys of a class over which moves count
SETTLE = 0.995  # moves and new keys of a class fade with each key it had before
ADOPTED = 1.0  # the floor of a worker that followed a class's moved keys
SETTLED = 0.1  # moves below which a class that followed its keys is settled
MOVED_LEAST = 2  # sampled keys moved in before a class follows them
FOLLOW_SHARE = 0.5  # a worker is followed once it sent half the top sender's keys


BookEntry = Tuple[Optional[str], Optional[PoolWorker], bool]
SHARED: BookEntry = (None, None, True)  # a key of several classes


def stable_hash(text: str) -> int:
    """A 64-bit hash of ``text``, the same in every process (unlike hash())."""
    data = text.encode("utf-8", "surrogateescape")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def mix(x: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit function of ``x``."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def rendezvous_weight(key_hash: int, salt: int, score: float) -> float:
    """Weighted rendezvous: the owner of a key is the highest ``score/-ln(u)``."""
    u = ((mix(key_hash ^ salt) >> 11) + 0.5) / UNIT  # in (0, 1)
    return score / -math.log(u)


def _by_score(item: Tuple[PoolWorker, float]) -> Tuple[float, int]:
    """Best score first; ties by the worker's salt, alike on every LB."""
    return item[1], item[0].salt


class Sketch:
    """Distinct values seen, estimated from the k smallest 64-bit hashes."""

    __slots__ = ("smallest",)

    def __init__(self) -> None:
        self.smallest: List[int] = []

    def add(self, value: int) -> bool:
        """Note a hash; whether the estimate changed."""
        smallest = self.smallest
        if len(smallest) >= SKETCH_SIZE and value >= smallest[-1]:
            return False
        i = bisect.bisect_left(smallest, value)
        if i < len(smallest) and smallest[i] == value:
            return False
        smallest.insert(i, value)
        if len(smallest) > SKETCH_SIZE:
            smallest.pop()
        return True

    def estimate(self) -> float:
        """How many distinct values were added."""
        smallest = self.smallest
        if len(smallest) < SKETCH_SIZE:
            return float(len(smallest))
        return (SKETCH_SIZE - 1) * float(MASK64) / (smallest[-1] + 1)


class Footprint:
    """Distinct keys over the last one or two windows of the pool."""

    __slots__ = ("window", "current", "previous")

    def __init__(self, window: int) -> None:
        self.window = window  # the pool's window number this one counts
        self.current = Sketch()
        self.previous = 0.0  # the last full window's estimate

    def add(self, value: int, window: int) -> None:
        """Note a key hash seen in pool window ``window``."""
        if window != self.window:
            self.previous = (self.current.estimate()
                             if window == self.window + 1 else 0.0)
            self.current = Sketch()
            self.window = window
        self.current.add(value)

    def estimate(self, window: int) -> float:
        """Distinct keys, as of pool window ``window``."""
        if window > self.window + 1:
            return 0.0
        if window == self.window + 1:
            return self.current.estimate()
        return max(self.previous, self.current.estimate())


class Starter:
    """A worker in slow start: when it came, and its recent requests."""

    __slots__ = ("added", "recent", "seen", "joined", "offered")

    def __init__(self, added: int) -> None:
        self.added = added  # pool requests when it was added
        self.joined: Dict[object, float] = {}  # classes joined -> share expected
        self.recent = 0.0  # its requests, decayed over the slow start
        self.seen = added
        # joined class -> [its requests since, those whose key it owns]
        self.offered: Dict[object, List[int]] = {}

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


class ClassStats:
    """What the LB sees of one class: its decayed request count, its keys."""

    __slots__ = ("count", "seen", "footprint", "salt", "members", "uses", "version",
                 "floors", "fresh", "moved", "following", "senders", "reset")

    def __init__(self, rclass: str, window: int, seed: int = 0) -> None:
        self.members: Optional[Dict[PoolWorker, float]] = None  # as last worked out
        self.uses = 0  # requests since the members were worked out
        self.version = -1  # the pool's skills_version then
        self.count = 0.0  # decayed requests, as of pool request ``seen``
        self.seen = 0
        self.footprint = Footprint(window)
        self.salt = stable_hash(rclass) ^ seed
        # workers that joined while starting -> pool request when they did
        self.floors: Optional[Dict[PoolWorker, float]] = None
        # sampled keys new to the class: never seen, or last in another class
        self.fresh = 0.0
        self.moved = 0.0
        self.following = False  # its keys moved in: it follows them
        # while following: worker -> sampled keys moved in from it, decayed
        self.senders: Optional[Dict[PoolWorker, float]] = None
        self.reset = False  # its skills were reset: the book knows better


class AffinityPool(Pool):
    """Résumé routing with affinity keys, footprint-sized classes, slow
    start and re-learning; see the module docstring."""

    SETTINGS = Pool.SETTINGS + ("spread", "footprint_window", "slow_start", "balance")
    spread: float
    footprint_window: int
    slow_start: int
    balance: float

    def __init__(self, *args, spread: float = LB_SETTINGS["spread"].default,
                 footprint_window: int = LB_SETTINGS["footprint_window"].default,
                 slow_start: int = LB_SETTINGS["slow_start"].default,
                 balance: float = LB_SETTINGS["balance"].default, **kw) -> None:
        self._set_settings(spread=spread, footprint_window=footprint_window,
                           slow_start=slow_start, balance=balance)
        self.requests = 0
        self.classes: Dict[str, ClassStats] = {}
        self.total = 0.0  # decayed requests of every class
        self.footprint = Footprint(0)  # distinct (class, key) pairs
        self.unskilled = 0.0  # decayed requests whose class had no skilled worker
        self.resets = 0
        self.spills = 0
        self.skills_version = 0  # changes whenever any skill or worker does
        self.starting: Dict[PoolWorker, Starter] = {}
        # sampled key -> (class, worker) it last went to, whether it moved
        self.book: Dict[int, BookEntry] = {}
        self.adoptions = 0
        # worker -> classes whose keys moved away from it, while its
        # résumé still lists them
        self.stale: Dict[PoolWorker, set] = {}
        self.lbs = 1  # LBs sharing the workers (ZooKeeper tells)
        self.hash_seed = 0  # the same on every LB; the simulator varies it
        self._ring: Optional[List[Tuple[int, PoolWorker]]] = None
        super().__init__(*args, **kw)

    def _settings_changed(self) -> None:
        super()._settings_changed()
        self._update_rate_decay()

    def _update_rate_decay(self) -> None:
        self.rate_decay = 1.0 - 1.0 / self.footprint_window

    # -- membership ---------------------------------------------------

    def _added(self, worker: PoolWorker) -> None:
        worker.salt = stable_hash(worker.name)
        self.skills_version += 1
        self._ring = None
        if self.requests and self.slow_start:
            self.starting[worker] = Starter(self.requests)

    def remove(self, handle: Hashable) -> None:
        """Forget a worker entirely, even with requests in flight on it."""
        worker = self.workers.get(handle)
        if worker is not None:
            self.starting.pop(worker, None)
            self.stale.pop(worker, None)
            self._ring = None
        super().remove(handle)
        self.skills_version += 1

    def new_resume(self, handle: Hashable, resume: Mapping[str, float]) -> None:
        """Replace a worker's skills by those of its new résumé, but for
        classes whose keys moved away from it (see ``_moved``): it holds
        their old data, so its score for them means nothing until its
        résumé has dropped them."""
        super().new_resume(handle, resume)
        self.skills_version += 1
        worker = self.workers.get(handle)
        if worker is None:
            return
        stale = self.stale.get(worker)
        if stale:
            for rclass in list(stale):
                if rclass in worker.resume:
                    del worker.resume[rclass]
                    skilled = self.skilled[rclass]
                    del skilled[worker]
                    if not skilled:
                        del self.skilled[rclass]
                else:
                    stale.discard(rclass)
            if not stale:
                del self.stale[worker]

    def _fresh(self, worker: PoolWorker, rclass: str) -> None:
        """The LB made ``worker`` skilled in ``rclass`` itself: its skill
        there is no longer stale."""
        stale = self.stale.get(worker)
        if stale and rclass in stale:
            stale.discard(rclass)
            if not stale:
                del self.stale[worker]

    def reset_skills(self) -> None:
        """Forget every skill: résumés from now on teach the pool again."""
        for worker in self.workers.values():
            worker.resume = {}
        self.skilled.clear()
        self.stale.clear()
        for stats in self.classes.values():
            stats.reset = True
        self.skills_version += 1
        self.unskilled = 0.0
        self.resets += 1

    # -- routing ------------------------------------------------------

    def get(self, rclass: Optional[str], key: Optional[str] = None
            ) -> Optional[Hashable]:
        """Choose a worker for a request of ``rclass`` with affinity ``key``."""
        if not self._lru:
            return None
        if rclass is None:
            return self._least_backlog()
        self.requests += 1
        decay = self.rate_decay
        self.total = self.total * decay + 1.0
        skilled = self.skilled.get(rclass)
        self._notice_unskilled(skilled, decay)
        if key is None:
            return super().get(rclass)
        stats, key_hash, book_hash = self._observe(rclass, key)
        if book_hash is not None:
            self._moved(rclass, stats, self.book.get(book_hash))
        if self.starting:
            self._slow_start(rclass, stats)
        members = self._members(rclass, stats)
        if self.starting:
            self._offer(stats, members, key_hash)
        chosen = self._owner(members, key_hash)
        if chosen is None:
            self.spills += 1
            chosen = self._owner(self.skilled[rclass], key_hash)
            if chosen is None:
                for worker in self.starting:  # a cold cache spills worst
                    self._lru.move_to_end(worker)
                handle = super().get(rclass)  # the published spill
                worker = self.workers[handle]
                self._fresh(worker, rclass)
                if book_hash is not None:
                    self._book(book_hash, rclass, worker)
                return handle
        if book_hash is not None:
            self._book(book_hash, rclass, chosen)
        return self._chosen(chosen)

    def _book(self, book_hash: int, rclass: str, worker: PoolWorker) -> None:
        """Note which class and worker a sampled key last went to; a key
        seen moving twice is in several classes (a path under several
        hosts) and tells nothing: it stays ``SHARED``."""
        book = self.book
        entry = book.get(book_hash)
        if entry is not None and entry[0] != rclass:
            book[book_hash] = SHARED if entry[2] else (rclass, worker, True)
        elif entry is None or entry[1] is not worker:
            book[book_hash] = (rclass, worker, entry[2] if entry else False)
            if len(book) > BOOK_SIZE:
                del book[next(iter(book))]

    def _moved(self, rclass: str, stats: ClassStats,
               entry: Optional[BookEntry]) -> None:
        """A sampled key of ``rclass`` last went to ``entry``: (class,
        worker, whether it moved before), or None.  When keys new to a
        class come from other classes (``MOVED_LEAST`` of them, and more
        than a quarter of its new keys, decayed), its data is where they
        went (a changed classifier): the workers that sent it at least
        ``FOLLOW_SHARE`` times as many as the top one become its members,
        floored at the members' mean, and its old members,
        which hold other data, no longer count for it until their
        résumés drop it."""
        if entry is SHARED:
            return
        if entry is not None and entry[0] == rclass:
            stats.fresh *= SETTLE  # a key it already had: the class is settling
            stats.moved *= SETTLE
            if stats.following and stats.moved < SETTLED:
                self._settled(stats)
            elif stats.reset:  # the first of its keys the book knows since
                stats.reset = False
                if not self.skilled.get(rclass):
                    self._returned(rclass, entry[1])
            return
        senders = stats.senders
        if stats.fresh + stats.moved > MOVED_WINDOW:
            stats.fresh /= 2.0
            stats.moved /= 2.0
            if senders:
                for sender in senders:
                    senders[sender] /= 2.0
        if entry is None:
            stats.fresh += 1.0
            return
        stats.moved += 1.0
        worker = entry[1]
        if worker is None or self.workers.get(worker.handle) is not worker:
            return
        if senders is None:
            senders = stats.senders = {}
        votes = senders[worker] = senders.get(worker, 0.0) + 1.0
        # A key that last went elsewhere than its class's data (spilled,
        # or moved on by the balance bound) does not make a member.
        if (stats.moved < MOVED_LEAST or stats.moved * 4 <= stats.fresh
                or votes < FOLLOW_SHARE * max(senders.values())):
            return
        skilled = self.skilled.get(rclass)
        if skilled is None:
            skilled = self.skilled[rclass] = {}
        if not stats.following:  # the old members hold the class's old data
            stats.following = True
            stale = self.stale
            for old in skilled:
                old.resume.pop(rclass, None)
                stale.setdefault(old, set()).add(rclass)
            skilled.clear()
            stats.floors = None
        if worker in skilled:
            return
        self._fresh(worker, rclass)
        score = max(skilled.values()) if skilled else self.unskilled_score
        skilled[worker] = worker.resume[rclass] = score
        if stats.floors is None:
            stats.floors = {}
        stats.floors[worker] = ADOPTED
        self.adoptions += 1
        self.skills_version += 1

    def _returned(self, rclass: str, worker: Optional[PoolWorker]) -> None:
        """A class no worker is skilled in since skills were reset takes
        the worker its key last went to, which may still hold its data,
        before it recruits a stranger."""
        if worker is None or self.workers.get(worker.handle) is not worker:
            return
        skilled = self.skilled.setdefault(rclass, {})
        self._fresh(worker, rclass)
        skilled[worker] = worker.resume[rclass] = self.unskilled_score
        self.skills_version += 1

    def _settled(self, stats: ClassStats) -> None:
        """A class that followed its moved keys has them all: the workers
        it took lose their floors, and résumés rank its members again."""
        stats.following = False
        stats.senders = None
        floors = stats.floors
        if floors:
            for worker in [w for w, ratio in floors.items() if ratio == ADOPTED]:
                del floors[worker]
            if not floors:
                stats.floors = None
            self.skills_version += 1

    def _notice_unskilled(self, skilled: Optional[dict], decay: float) -> None:
        """Reset skills when most requests hit classes no worker knows."""
        self.unskilled = self.unskilled * decay + (0.0 if skilled else 1.0)
        if (self.requests > self.footprint_window and self.skilled
                and self.unskilled > RELEARN_SHARE * self.total):
            self.reset_skills()

    def _observe(self, rclass: str, key: str
                 ) -> Tuple[ClassStats, int, Optional[int]]:
        """Count the request and its key in the class's statistics; the
        class's stats, the key's hash, and the key's book hash if the key
        is one of those sampled for the book (else None)."""
        window = self.requests // self.footprint_window
        stats = self.classes.get(rclass)
        if stats is None:
            stats = self.classes[rclass] = ClassStats(rclass, window, self.hash_seed)
        stats.count = stats.count * self.rate_decay ** (self.requests - stats.seen) + 1.0
        stats.seen = self.requests
        crc = crc32(key.encode("utf-8", "surrogateescape"))
        key_hash = mix(stats.salt ^ crc)
        stats.footprint.add(key_hash, window)
        self.footprint.add(key_hash, window)
        book_hash = mix(crc ^ self.hash_seed)
        return stats, key_hash, (book_hash if book_hash % BOOK_SAMPLE == 0 else None)

    def width(self, stats: ClassStats) -> int:
        """How many workers the class should be spread over."""
        n = len(self.workers)
        # Few requests or keys prove nothing: until there are PRIOR per
        # worker, a class is judged against that many.
        least = PRIOR * n
        load = math.ceil(n * self.spread * stats.count / max(self.total, least))
        window = self.requests // self.footprint_window
        all_keys = max(self.footprint.estimate(window), least)
        footprint = math.ceil(n * stats.footprint.estimate(window) / all_keys)
        return max(1, min(n, max(load, footprint)))

    def _members(self, rclass: str, stats: ClassStats) -> Dict[PoolWorker, float]:
        """The class's members and their scores: its best ``width`` skilled
        workers, recruiting one when it has fewer; a worker that joined
        the class while starting counts at least as the members' mean
        (see ``_floored``).  Worked out again after a change of skills or
        every ``REFRESH`` requests of the class, not every time."""
        members = stats.members
        stats.uses += 1
        if (members is not None and stats.version == self.skills_version
                and stats.uses < REFRESH and not self.starting):
            return members
        stats.uses = 0
        width = self.width(stats)
        skilled = self.skilled.get(rclass)
        if skilled is None:
            skilled = self.skilled[rclass] = {}
        if len(skilled) < width and not (skilled and stats.moved >= 1.0):
            # (a class following its moved keys waits for their workers)
            self._recruit(rclass, skilled)
        if stats.floors:
            members = self._floored(stats, skilled, width)
        elif len(skilled) <= width:
            members = skilled
        else:
            members = dict(nlargest(width, skilled.items(), key=_by_score))
        stats.members, stats.version = members, self.skills_version
        if len(members) < width:
            stats.uses = REFRESH  # still recruiting: again on the next request
        return members

    def _floored(self, stats: ClassStats, skilled: Dict[PoolWorker, float],
                 width: int) -> Dict[PoolWorker, float]:
        """The best ``width`` of ``skilled``, and the workers that joined
        the class while starting, each weighing at least its ratio times
        the mean of the others' scores: a cold cache does not rank a
        newcomer last before its résumé shows the keys it holds.  A floor
        lasts as long as the worker is skilled in the class."""
        floors = stats.floors
        assert floors is not None
        others = nlargest(width, ((w, s) for w, s in skilled.items() if w not in floors),
                          key=_by_score)
        mean = (sum(s for _, s in others) / len(others) if others
                else max(skilled.values(), default=self.unskilled_score))
        members = dict(others)
        for worker, ratio in list(floors.items()):
            score = skilled.get(worker)
            if score is None:
                del floors[worker]
                starter = self.starting.get(worker)
                if starter is not None:
                    starter.joined.pop(stats, None)
                continue
            members[worker] = max(score, ratio * mean)
        if not floors:
            stats.floors = None
        # Workers that followed moved keys count among the ``width``;
        # starters come on top, as they take their share.
        width += sum(1 for ratio in floors.values() if ratio != ADOPTED)
        if len(members) <= width:
            return members
        senders = stats.senders
        if stats.following and senders:
            # Starters first, then the workers most moved keys came from.
            return dict(nlargest(width, members.items(), key=lambda item: (
                floors.get(item[0], ADOPTED) != ADOPTED, senders.get(item[0], 0.0),
                item[1], item[0].salt)))
        return dict(nlargest(width, members.items(), key=_by_score))

    def _recruit(self, rclass: str, skilled: Dict[PoolWorker, float]) -> None:
        """Make a worker not skilled in ``rclass`` skilled in it, at the
        class's lowest score: alone, the least recently chosen one; with
        other LBs, the less loaded of the first two on a ring of workers
        from the class's point, so that every LB recruits alike."""
        score = min(skilled.values()) if skilled else self.unskilled_score
        worker = self._ring_recruit(rclass, skilled) if self.lbs > 1 else None
        if worker is None:
            for worker in self._lru:  # at most len(skilled) + 1 steps
                if worker not in skilled:
                    break
            else:
                return
        skilled[worker] = worker.resume[rclass] = score
        self._fresh(worker, rclass)
        self.skills_version += 1

    def _ring_recruit(self, rclass: str, skilled: Dict[PoolWorker, float]
                      ) -> Optional[PoolWorker]:
        ring = self._ring
        if ring is None:
            ring = self._ring = sorted(
                (mix(worker.salt ^ replica), worker)
                for worker in self.workers.values() for replica in range(RING_POINTS))
        start = bisect.bisect(ring, (stable_hash(rclass), ))
        n = len(ring)
        best = None
        seen = 0
        for i in range(min(n, (len(skilled) + RING_CHOICES + 1) * RING_POINTS)):
            worker = ring[(start + i) % n][1]
            if worker in skilled or worker is best:
                continue
            if best is None or worker.mbacklog < best.mbacklog:
                best = worker
            seen += 1
            if seen == RING_CHOICES:
                break
        return best

    def _owner(self, members: Dict[PoolWorker, float], key_hash: int
               ) -> Optional[PoolWorker]:
        """The worker owning ``key_hash`` among ``members`` under the cap:
        the first in the key's rendezvous order whose backlog is within
        ``balance`` times the members' mean (bounded-load hashing).

        The pool-wide cap is ``balance`` times the published one: the
        balance bound already keeps the members even among themselves, so
        the cap only has to catch members far over the pool's mean, and a
        key's owner, which holds its data, is worth a longer queue than
        the published policy lets a skilled worker have."""
        max_backlog = self.balance * self.variance * self.mbacklog / len(self.workers)
        if max_backlog < 1.0:
            max_backlog = 1.0
        min_backlog = next(iter(self._lru)).mbacklog + 1.0
        starting = self.starting
        busy = self.backlog / len(self.workers)  # a starter takes no more than the mean
        ranked = []
        total = 0
        for worker, score in members.items():
            if worker.mbacklog - min_backlog > max_backlog:
                continue
            if starting and worker in starting and worker.backlog > busy:
                continue
            ranked.append((rendezvous_weight(key_hash, worker.salt, score), worker))
            total += worker.backlog
        if not ranked:
            return None
        first = max(ranked, key=itemgetter(0))[1]
        bound = max(self.balance * (total + 1) / len(ranked), MIN_BOUND)
        if len(ranked) == 1 or first.backlog < bound:
            return first
        ranked.sort(key=itemgetter(0), reverse=True)
        for _, worker in ranked:
            if worker.backlog < bound:
                return worker
        return ranked[0][1]

    def _chosen(self, worker: PoolWorker) -> Hashable:
        if self.starting:
            starter = self.starting.get(worker)
            if starter is not None:
                starter.got(self.requests, self.slow_start)
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
            share = starter.share(self.requests, self.slow_start)
            if share >= ramp * fair * STARTED:
                if ramp >= 1.0:
                    del self.starting[worker]
                continue
            if self.requests - starter.added > GIVE_UP * self.slow_start:
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
                big = cshare * len(self.workers) >= BIG_CLASS
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
                self.skills_version += 1
                return

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
                    and floors.get(worker, ADOPTED) != ADOPTED):
                expected = joined * self.total / stats.count
                got = max(counts[1], 1) / counts[0]
                if got < expected:
                    floors[worker] *= min(expected / got, MOST_RAISED)
                    self.skills_version += 1

    def _ramp(self, worker: PoolWorker) -> float:
        """How far a starting worker is into its slow start, in (0, 1]."""
        done = (self.requests - self.starting[worker].added) / self.slow_start
        return min(max(done, 0.01), 1.0)

    # -- introspection ------------------------------------------------

    def status(self) -> dict:
        """The published pool's status, with the affinity settings."""
        status = super().status()
        status.update(spread=self.spread, footprint_window=self.footprint_window,
                      balance=self.balance, spills=self.spills,
                      slow_start=self.slow_start, skill_resets=self.resets,
                      starting=len(self.starting), lbs=self.lbs)
        return status


POLICIES = {"affinity": AffinityPool, "published": Pool, "classless": ClasslessPool,
            "resume": Pool}  # resume: the published policy's old name


def make_pool(policy: str, settings: Mapping[str, object]) -> Pool:
    """The pool of ``policy``, with those of ``settings`` it takes."""
    try:
        pool_class = POLICIES[policy]
    except KeyError:
        raise ConfigurationError("unknown policy %r (one of %s)"
                                 % (policy, ", ".join(POLICIES)))
    pool = pool_class()
    pool.configure(settings)
    return pool
