"""Re-learning: after a classifier change, the pool finds where each
class's data went: ``Relearning``, a part that ``affinity.AffinityPool``
holds and calls.

Theory of operation
-------------------

A changed classifier moves keys between classes, but their data stays
where it was.  The LB keeps a book of keys (``BOOK_SIZE``, and up to a
256th more between its sweeps): the class and worker each last went to
(which also keeps keys where they went, see "Stickiness" in
``routing/placement.py``).  When enough of a class's new keys
come from other classes, it follows them: the workers most of them came
from become its members (floored at the members' mean until the class
settles, ranked by how many keys came from each), and its old members,
which hold another class's data, lose their skill in it until their
résumés drop it.  A worker is followed only once it sent at least half
as many keys as the one that sent the most: a key that last went
elsewhere (spilled, or moved on by the balance bound) does not make a
member.  A path seen moving twice is in several classes (the same path
under several hosts) and is ignored from then on.  ``reset_skills()``
forgets every skill the LB holds (an operator's switch); the pool also
resets by itself when, over a window, most requests hit classes no
worker is skilled in after most had hit known ones (once, until fewer
than half as many do; not in a new pool, nor right after an operator's
reset, while the classes are learned).
Résumés then teach it again, and the book, which a reset keeps, comes
first: a class no worker is skilled in since the reset takes the worker
its first key the book knows last went to, which may still hold its
data, before it recruits a stranger.  (Not a class whose résumés merely
dropped it: its data is likely gone too.)

Structure.  ``Relearning`` owns the book, the stale skills, the measure
of unskilled requests that arms and fires a reset, and the counts of
resets and adoptions.  It is built with the pool's maps of workers,
skills and classes (the same dicts, which the pool never replaces): it
reads them, and changes skills in them.  The pool calls it with each
request's class and key (``notice_unskilled``, ``moved``,
``remember``), with each new résumé (``drop_stale``), for a reset
(``reset``), and when it makes a worker skilled itself (``fresh``) or
loses one (``remove``).  ``notice_unskilled`` and ``moved`` say whether
they changed skills (a reset always does), so that the pool, which
counts changes of skills (``skills_version``), marks them.  The pool
reads ``book`` (the same ``Book``) on its own path.

Weak spot, admitted.  A path shared by two classes may look moved before
it is seen moving twice: such a class may follow a few of its keys once,
at start.
"""

from __future__ import annotations

from typing import Dict, Final, Hashable, Iterator, List, Optional, Set, Tuple

from zc_lb.routing.classstats import ClassStats
from zc_lb.routing.pool import PoolWorker, unskill
from zc_lb.routing.skillmap import SkillMap

RELEARN_SHARE: Final = 0.5  # "most requests hit classes no worker is skilled in"
BOOK_SIZE = 1 << 16  # keys the book remembers, least recently seen forgotten
SHARD_KEYS: Final = 1 << 12  # keys in each of the book's dicts, about (``Book``)
MOVED_WINDOW: Final = 32  # new keys of a class over which moves count
SETTLE: Final = 0.995  # moves and new keys of a class fade with each key it had before
SETTLED: Final = 0.1  # moves below which a class that followed its keys is settled
MOVED_LEAST: Final = 2  # keys moved in before a class follows them
FOLLOW_SHARE: Final = 0.5  # a worker is followed once it sent half the top sender's keys


ADOPTED: Final = -1.0
"""The floor of a worker that followed a class's moved keys.  It is a mark,
not a ratio: the worker weighs the members' mean (``floor_weight``).  A
starter's floor, a ratio of keys, may be 1.0 too, so the mark is a value no
ratio takes; a value, not a type, as compiled code keeps floats unboxed."""


def adopted(ratio: Optional[float]) -> bool:
    """Whether a floor is ``ADOPTED`` (None, no floor, counts as adopted:
    nothing to fade or raise)."""
    return ratio is None or ratio < 0.0


def floor_weight(ratio: float) -> float:
    """How many times the members' mean a floor weighs."""
    return 1.0 if ratio < 0.0 else ratio


# (class, the ``ident`` of the worker a key last went to (0: none),
# whether it moved between classes, AWAY if that worker is not its owner
# in rendezvous order, else the class's ``joins`` then: see
# ``Placement._choose``; and the book's ``age`` when the key was last put
# at its end).  The book holds it as one number (``Book``).
BookEntry = Tuple[Optional[str], int, bool, int, int]
AWAY: Final = -1
SHARED: BookEntry = (None, 0, True, AWAY, 0)  # a key of several classes

# A book entry packed into one number (``Book``), from its lowest bit:
# whether the key moved, the class's joins then plus one (0 for AWAY),
# the book's age, the class's number in the book (0: SHARED), and above
# them the worker's ident.  Under 2**62, a number compiled code keeps
# unboxed, while idents are under 2**16 (past them, a larger number,
# which it boxes).  Joins and ages are counted modulo their fields
# (``JOINS_LIMIT``, ``AGE_LIMIT``), so that what the book gives back is
# what they are compared with: a count that wrapped only makes an entry
# 65,535 joins, or 16 million new keys, old look current.
JOINS_LIMIT: Final = (1 << 16) - 1
AGE_LIMIT: Final = 1 << 12
_AGE_AT: Final = 17
_CLASS_AT: Final = 29
_CLASS_MASK: Final = (1 << 17) - 1  # (no more classes than keys: BOOK_SIZE and a 256th)
_IDENT_AT: Final = 46


class Book:
    """The book of keys: a key's hash in the book -> its ``BookEntry``.
    An entry is kept as one number, in dicts that Python's cyclic
    collector never tracks (a dict of tuples is tracked again by each new
    tuple put in it, until a full pass, and under a flood of new keys the
    collector walked the book's 65,536 entries three times a cycle, in
    passes of up to 21 ms).

    The keys are split over ``shards`` by the low bits of their hash, each
    a dict of at most ``SHARD_KEYS`` or so, least recently put first: a
    dict that keys come and go through is rebuilt now and then (every
    ~109,000 new keys at 65,536), and one of 65,536 took 3.7-5 ms of the
    loop, where one of 4,096 takes about 0.3.  Each shard forgets its own
    least recently seen keys (``crowded``, ``oldest``), so that the book
    forgets the keys least recently seen across it to within a shard's
    luck of the hash; a book of under twice ``SHARD_KEYS`` keys is one
    dict, in exact order.

    A class is numbered while the book holds a key of it: ``numbers`` and
    ``names`` (number 0: none, SHARED), ``uses`` (its keys) and ``free``
    (numbers to give again).  ``get`` makes an entry a tuple again, for
    one request."""

    __slots__ = ("shards", "mask", "limit", "numbers", "names", "uses", "free")

    def __init__(self, size: int) -> None:
        count = 1
        while count * 2 * SHARD_KEYS <= size:
            count *= 2
        self.shards: List[Dict[int, int]] = [{} for _ in range(count)]
        self.mask = count - 1
        self.limit = size // count  # (keys each shard keeps)
        self.numbers: Dict[str, int] = {}
        self.names: List[str] = [""]
        self.uses: List[int] = [0]
        self.free: List[int] = []

    def get(self, book_hash: int) -> Optional[BookEntry]:
        packed = self.shards[book_hash & self.mask].get(book_hash)
        if packed is None:
            return None
        number = (packed >> _CLASS_AT) & _CLASS_MASK
        if not number:
            return SHARED
        return (self.names[number], packed >> _IDENT_AT, (packed & 1) != 0,
                ((packed >> 1) & JOINS_LIMIT) - 1, (packed >> _AGE_AT) & (AGE_LIMIT - 1))

    def put(self, book_hash: int, entry: BookEntry) -> None:
        """Put ``entry`` at the end of its shard (the key most recently
        seen): the caller has taken out what the book held for the key,
        if anything."""
        rclass = entry[0]
        number = 0
        if rclass is not None:
            number = self.numbers.get(rclass, 0)
            if not number:
                number = self._number(rclass)
            self.uses[number] += 1
        self.shards[book_hash & self.mask][book_hash] = (
            (1 if entry[2] else 0) | (((entry[3] + 1) & JOINS_LIMIT) << 1)
            | ((entry[4] & (AGE_LIMIT - 1)) << _AGE_AT) | (number << _CLASS_AT)
            | (entry[1] << _IDENT_AT))

    def _number(self, rclass: str) -> int:
        if self.free:
            number = self.free.pop()
            self.names[number] = rclass
        else:
            number = len(self.names)
            self.names.append(rclass)
            self.uses.append(0)
        self.numbers[rclass] = number
        return number

    def remove(self, book_hash: int) -> int:
        """Take out the key's entry; the ident of the worker it named."""
        packed = self.shards[book_hash & self.mask].pop(book_hash)
        number = (packed >> _CLASS_AT) & _CLASS_MASK
        if number:
            self.uses[number] -= 1
            if not self.uses[number]:  # (no key of the class left: its number is free)
                del self.numbers[self.names[number]]
                self.names[number] = ""
                self.free.append(number)
        return packed >> _IDENT_AT

    def crowded(self, book_hash: int) -> bool:
        """Whether the shard of ``book_hash`` holds a 256th more than its
        share: time to forget its oldest (``oldest``)."""
        limit = self.limit
        return len(self.shards[book_hash & self.mask]) > limit + (limit >> 8)

    def oldest(self, book_hash: int) -> List[int]:
        """The hashes of the keys least recently put in the shard of
        ``book_hash``, as many as it holds over its share."""
        shard = self.shards[book_hash & self.mask]
        oldest: List[int] = []
        excess = len(shard) - self.limit
        for other in shard:
            if len(oldest) >= excess:
                break
            oldest.append(other)
        return oldest

    def __len__(self) -> int:
        return sum(len(shard) for shard in self.shards)

    def __iter__(self) -> Iterator[int]:
        """The keys' hashes, shard by shard, each least recently put first."""
        for shard in self.shards:
            yield from shard

    def items(self) -> List[Tuple[int, Optional[BookEntry]]]:
        """(For tests.)"""
        return [(book_hash, self.get(book_hash)) for book_hash in self]


class Relearning:
    """The affinity pool's re-learning (see the module docstring).  It
    owns ``book`` (key -> ``BookEntry``, least recently seen first),
    ``stale`` (worker -> classes whose keys moved away from it, while
    its résumé still lists them), ``unskilled`` (decayed requests whose
    class had no skilled worker), ``armed`` (whether it may reset by
    itself, see ``notice_unskilled``) and the counts of ``resets`` and
    ``adoptions``.  ``workers``, ``by_ident``, ``skilled`` and ``classes``
    are the pool's maps, which it reads and changes skills in."""

    __slots__ = ("workers", "by_ident", "skilled", "classes", "book", "age", "new_keys",
                 "stale", "unskilled", "armed", "resets", "adoptions")

    def __init__(self, workers: Dict[Hashable, PoolWorker], by_ident: Dict[int, PoolWorker],
                 skilled: SkillMap[PoolWorker], classes: Dict[str, ClassStats]) -> None:
        self.workers = workers
        self.by_ident = by_ident
        self.skilled = skilled
        self.classes = classes
        # key -> (class, worker) it last went to, whether it moved
        self.book = Book(BOOK_SIZE)
        self.age = 0  # a sixteenth of the book's size in new keys, counted
        self.new_keys = 0  # (since the book last aged)
        # worker -> classes whose keys moved away from it, while its
        # résumé still lists them
        self.stale: Dict[PoolWorker, Set[str]] = {}
        self.unskilled = 0.0
        # Armed once most requests hit known classes: a pool that never
        # knew most of its classes has nothing a reset could bring back
        # (a site of thousands of classes each seen once reset itself at
        # the end of its first footprint window).
        self.armed = False
        self.resets = 0
        self.adoptions = 0

    def remove(self, worker: PoolWorker) -> None:
        """``worker`` left the pool: its stale skills go with it, and its
        votes as a sender of moved keys (``_sender``), which would stand as
        the top sender others must reach half of.  (Its floors go when
        each class's members are next worked out, ``Members._floored``.)"""
        self.stale.pop(worker, None)
        for stats in self.classes.values():
            senders = stats.senders
            if senders and worker in senders:
                del senders[worker]

    def holder(self, entry: Optional[BookEntry], rclass: str) -> Optional[PoolWorker]:
        """The worker in the pool that the book's ``entry`` says a key of
        ``rclass`` last went to, if any."""
        if entry is None or entry[0] != rclass:
            return None
        return self.by_ident.get(entry[1])

    def drop_stale(self, worker: PoolWorker, touched: Set[str]) -> None:
        """``worker`` has a new résumé: take back its skills in classes
        whose keys moved away from it (see ``moved``), adding them to
        ``touched``: it holds their old data, so its score for them means
        nothing until its résumé has dropped them."""
        stale = self.stale.get(worker)
        if stale:
            held = [rclass for rclass in stale if rclass in worker.resume]
            stale.intersection_update(held)  # (those its résumé dropped are done)
            for rclass in held:
                del worker.resume[rclass]
            unskill(self.skilled, worker, held)
            touched.update(held)
            if not stale:
                del self.stale[worker]

    def fresh(self, worker: PoolWorker, rclass: str) -> None:
        """The LB made ``worker`` skilled in ``rclass`` itself: its skill
        there is no longer stale."""
        stale = self.stale.get(worker)
        if stale and rclass in stale:
            stale.discard(rclass)
            if not stale:
                del self.stale[worker]

    def reset(self, total: float) -> None:
        """Forget every skill: résumés from now on teach the pool again
        (an operator's switch).  Every class is unknown now: as after a
        reset of its own, the pool may reset by itself again only once
        most requests hit known classes (``total``: the pool's decayed
        requests; without this a site of many classes reset itself right
        after the operator did, losing what résumés had taught since)."""
        self._forget_all_skills()
        self.unskilled = total
        self.armed = False

    def _forget_all_skills(self) -> None:
        for worker in self.workers.values():
            worker.resume.clear()  # (in place: an intake in a pause holds it, pool.py)
            worker.given.clear()
        self.skilled.clear()
        self.stale.clear()
        for stats in self.classes.values():
            stats.reset = True
        self.resets += 1

    def remember(self, book_hash: int, entry: Optional[BookEntry], rclass: str,
                 worker: PoolWorker, where: int) -> None:
        """Note which class and worker a key last went to, and ``where``
        (``AWAY`` or the class's joins, see ``BookEntry``); ``entry`` is
        what the book held for it (looked up once per request); a key seen
        moving twice is in several classes (a path under several hosts)
        and tells nothing: it stays ``SHARED``.  The book forgets the
        keys least recently seen first (``_forget_oldest``), to within an
        ``age``: a key seen again is put at its end once an age, not on
        every request.  Each worker counts the keys the book says went to
        it last (``PoolWorker.booked``)."""
        book = self.book
        ident = worker.ident
        age = self.age
        if entry is None:
            book.put(book_hash, (rclass, ident, False, where, age))
            worker.booked += 1
            self.new_keys += 1
            if self.new_keys >= BOOK_SIZE >> 4:
                self.new_keys = 0
                self.age = (self.age + 1) % AGE_LIMIT
            if book.crowded(book_hash):
                self._forget_oldest(book_hash)
            return
        if entry[0] != rclass:
            now: BookEntry = SHARED if entry[2] else (rclass, ident, True, where, age)
        elif entry[1] != ident or entry[3] != where or entry[4] != age:
            now = (rclass, ident, entry[2], where, age)
        else:
            return  # (put at the end already in this age)
        if entry[1] != now[1]:
            last = self.by_ident.get(entry[1])
            if last is not None:
                last.booked -= 1
            if now[1]:
                worker.booked += 1
        book.remove(book_hash)  # (and in again: the most recently seen, last)
        book.put(book_hash, now)

    def _forget_oldest(self, book_hash: int) -> None:
        """Forget the keys least recently seen in the shard of ``book_hash``,
        down to its share of ``BOOK_SIZE``.  Each shard lets a 256th more
        in first: a dict finds its first key by a scan from the start of
        its table, past every key taken out before, so it sweeps its oldest
        in batches, not one a key (and in batches small enough to hold up
        the loop for well under a millisecond)."""
        book = self.book
        by_ident = self.by_ident
        for oldest in book.oldest(book_hash):
            forgotten = by_ident.get(book.remove(oldest))
            if forgotten is not None:
                forgotten.booked -= 1

    def moved(self, rclass: str, stats: ClassStats, entry: Optional[BookEntry],
              unskilled_score: float) -> bool:
        """A key of ``rclass`` last went to ``entry``: (class,
        worker, whether it moved before), or None.  When keys new to a
        class come from other classes (``MOVED_LEAST`` of them, and more
        than a quarter of its new keys, decayed), its data is where they
        went (a changed classifier): the workers that sent it at least
        ``FOLLOW_SHARE`` times as many as the top one become its members
        (``_follow``).  Whether skills or floors changed."""
        if entry is not None and entry[0] is None:  # SHARED (told by value:
            return False                           # compiled code copies tuples)
        if entry is not None and entry[0] == rclass:
            stats.fresh *= SETTLE  # a key it already had: the class is settling
            stats.moved *= SETTLE
            if stats.following and stats.moved < SETTLED:
                return self._settled(stats)
            if stats.reset:  # the first of its keys the book knows since
                stats.reset = False
                if not self.skilled.get(rclass):
                    return self._returned(rclass, self.by_ident.get(entry[1]),
                                          unskilled_score)
            return False
        worker = self._sender(stats, entry)
        if worker is None:
            return False
        return self._follow(rclass, stats, worker, unskilled_score)

    def _sender(self, stats: ClassStats, entry: Optional[BookEntry]) -> Optional[PoolWorker]:
        """Count a key new to the class (``entry`` None: never seen) or
        moved in from another class (over the last ``MOVED_WINDOW`` or
        so); the worker the class should follow for it, if any: the one
        the moved key went to, once enough keys moved in and it sent at
        least ``FOLLOW_SHARE`` times as many as the top sender."""
        senders = stats.senders
        if stats.fresh + stats.moved > MOVED_WINDOW:
            stats.fresh /= 2.0
            stats.moved /= 2.0
            if senders:
                for sender in senders:
                    senders[sender] /= 2.0
        if entry is None:
            stats.fresh += 1.0
            return None
        stats.moved += 1.0
        worker = self.by_ident.get(entry[1])  # (one in the pool, if any)
        if worker is None:
            return None
        if senders is None:
            senders = stats.senders = {}
        votes = senders[worker] = senders.get(worker, 0.0) + 1.0
        # A key that last went elsewhere than its class's data (spilled,
        # or moved on by the balance bound) does not make a member.
        if (stats.moved < MOVED_LEAST or stats.moved * 4 <= stats.fresh
                or votes < FOLLOW_SHARE * max(senders.values())):
            return None
        return worker

    def _follow(self, rclass: str, stats: ClassStats, worker: PoolWorker,
                unskilled_score: float) -> bool:
        """The class follows its moved keys to ``worker``: it becomes a
        member, floored at the members' mean (``ADOPTED``), and the first
        time, the old members, which hold other data, no longer count for
        the class until their résumés drop it.  Whether skills changed."""
        skilled = self.skilled.setdefault(rclass)
        if not stats.following:  # the old members hold the class's old data
            stats.following = True
            stale = self.stale
            for old in skilled:
                old.resume.pop(rclass, None)
                stale.setdefault(old, set()).add(rclass)
            skilled.clear()  # (their floors are dropped when the members are next
            # worked out, ``Members._floored``, which tells slow start a starter left)
        if worker in skilled:
            return False
        self.fresh(worker, rclass)
        score = max(skilled.values()) if skilled else unskilled_score
        skilled[worker] = worker.resume[rclass] = score
        if stats.floors is None:
            stats.floors = {}
        stats.floors[worker] = ADOPTED
        self.adoptions += 1
        return True

    def _returned(self, rclass: str, worker: Optional[PoolWorker],
                  unskilled_score: float) -> bool:
        """A class no worker is skilled in since skills were reset takes
        the worker its key last went to, which may still hold its data,
        before it recruits a stranger.  Whether skills changed."""
        if worker is None or self.workers.get(worker.handle) is not worker:
            return False
        skilled = self.skilled.setdefault(rclass)
        self.fresh(worker, rclass)
        skilled[worker] = worker.resume[rclass] = unskilled_score
        worker.given.add(rclass)
        return True

    def _settled(self, stats: ClassStats) -> bool:
        """A class that followed its moved keys has them all: the workers
        it took lose their floors, and résumés rank its members again.
        Whether floors changed."""
        stats.following = False
        stats.senders = None
        floors = stats.floors
        if floors:
            for worker in [w for w, ratio in floors.items() if adopted(ratio)]:
                del floors[worker]
            if not floors:
                stats.floors = None
            return True
        return False

    def notice_unskilled(self, skilled: Optional[dict], decay: float, requests: int,
                         total: float, window: int) -> bool:
        """Reset skills when most requests hit classes no worker knows;
        then not again until fewer than half as many do.  A second reset
        while they still do cannot help, and a flood of classes seen once
        (a client sending a new Host with every request) would otherwise
        reset the pool over and over, moving every other class's keys.
        ``skilled``: the request's class's skilled workers; ``requests``,
        ``total``: the pool's requests and decayed requests of every
        class; ``window``: its footprint window.  Whether it reset."""
        self.unskilled = unskilled = self.unskilled * decay + (0.0 if skilled else 1.0)
        if not self.armed:
            self.armed = unskilled < RELEARN_SHARE / 2 * total
        elif (requests > window and self.skilled
                and unskilled > RELEARN_SHARE * total):
            self._forget_all_skills()  # (``unskilled`` still measured, to re-arm)
            self.armed = False
            return True
        return False
