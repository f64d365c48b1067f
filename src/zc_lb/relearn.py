"""Re-learning: after a classifier change, the pool finds where each
class's data went.  A part of ``affinity.AffinityPool``.

Theory of operation
-------------------

A changed classifier moves keys between classes, but their data stays
where it was.  The LB keeps a book of keys (at most ``BOOK_SIZE``): the
class and worker each last went to (which also keeps keys where they
went, see "Stickiness" in ``affinity.py``).  When enough of a class's new keys
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
worker is skilled in (once, until fewer than half as many do).
Résumés then teach it again, and the book, which a reset keeps, comes
first: a class no worker is skilled in since the reset takes the worker
its first key the book knows last went to, which may still hold its
data, before it recruits a stranger.  (Not a class whose résumés merely
dropped it: its data is likely gone too.)

Weak spot, admitted.  A path shared by two classes may look moved before
it is seen moving twice: such a class may follow a few of its keys once,
at start.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Dict, Hashable, Mapping, Optional, Set, Tuple

from .classstats import ClassStats, PoolPart
from .pool import PoolWorker

RELEARN_SHARE = 0.5  # "most requests hit classes no worker is skilled in"
BOOK_SIZE = 1 << 16  # keys the book remembers, least recently seen forgotten
MOVED_WINDOW = 32  # new keys of a class over which moves count
SETTLE = 0.995  # moves and new keys of a class fade with each key it had before
SETTLED = 0.1  # moves below which a class that followed its keys is settled
MOVED_LEAST = 2  # keys moved in before a class follows them
FOLLOW_SHARE = 0.5  # a worker is followed once it sent half the top sender's keys


class Adopted(float):
    """The floor of a worker that followed a class's moved keys: 1 (the
    mean), and marked as such by its type, not its value (a starter's floor,
    a ratio of keys, may be 1.0 too: taken for adopted, the starter was
    left out of a one-member class and got no request)."""


ADOPTED = Adopted(1.0)


def adopted(ratio: Optional[float]) -> bool:
    """Whether a floor is ``ADOPTED`` (None, no floor, counts as adopted:
    nothing to fade or raise)."""
    return ratio is None or type(ratio) is Adopted


# (class, worker a key last went to, whether it moved between classes,
# AWAY if that worker is not its owner in rendezvous order, else the
# class's ``joins`` then: see ``AffinityPool.get``)
BookEntry = Tuple[Optional[str], Optional[PoolWorker], bool, int]
AWAY = -1
SHARED: BookEntry = (None, None, True, AWAY)  # a key of several classes


class Relearning(PoolPart):
    """The affinity pool's re-learning (see the module docstring)."""

    footprint_window: int
    unskilled: float  # decayed requests whose class had no skilled worker
    relearn_armed: bool  # may reset by itself (see ``_notice_unskilled``)
    resets: int
    book: OrderedDict[int, BookEntry]
    adoptions: int
    stale: Dict[PoolWorker, Set[str]]

    def new_resume(self, handle: Hashable, resume: Mapping[str, float]) -> Set[str]:
        """Replace a worker's skills by those of its new résumé, but for
        classes whose keys moved away from it (see ``_moved``): it holds
        their old data, so its score for them means nothing until its
        résumé has dropped them."""
        touched = super().new_resume(handle, resume)
        worker = self.workers.get(handle)
        if worker is None:
            return touched
        stale = self.stale.get(worker)
        if stale:
            for rclass in list(stale):
                if rclass in worker.resume:
                    del worker.resume[rclass]
                    skilled = self.skilled[rclass]
                    del skilled[worker]
                    if not skilled:
                        del self.skilled[rclass]
                    touched.add(rclass)
                else:
                    stale.discard(rclass)
            if not stale:
                del self.stale[worker]
        classes = self.classes
        for rclass in touched:  # their members are worked out again
            stats = classes.get(rclass)
            if stats is not None:
                stats.version = -1
        return touched

    def _fresh(self, worker: PoolWorker, rclass: str) -> None:
        """The LB made ``worker`` skilled in ``rclass`` itself: its skill
        there is no longer stale."""
        stale = self.stale.get(worker)
        if stale and rclass in stale:
            stale.discard(rclass)
            if not stale:
                del self.stale[worker]

    def reset_skills(self) -> None:
        """Forget every skill: résumés from now on teach the pool again
        (an operator's switch: what requests hit before counts no more)."""
        self._forget_all_skills()
        self.unskilled = 0.0

    def _forget_all_skills(self) -> None:
        for worker in self.workers.values():
            worker.resume = {}
            worker.given.clear()
        self.skilled.clear()
        self.stale.clear()
        for stats in self.classes.values():
            stats.reset = True
        self.skills_version += 1
        self.resets += 1

    def _book(self, book_hash: int, entry: Optional[BookEntry], rclass: str,
              worker: PoolWorker, where: int) -> None:
        """Note which class and worker a key last went to, and ``where``
        (``AWAY`` or the class's joins, see ``BookEntry``); ``entry`` is
        what the book held for it (looked up once per request); a key seen
        moving twice is in several classes (a path under several hosts)
        and tells nothing: it stays ``SHARED``.  The book forgets the
        keys least recently seen first."""
        book = self.book
        if entry is None:
            book[book_hash] = (rclass, worker, False, where)
            if len(book) > BOOK_SIZE:
                book.popitem(last=False)
            return
        if entry[0] != rclass:
            book[book_hash] = SHARED if entry[2] else (rclass, worker, True, where)
        elif entry[1] is not worker or entry[3] != where:
            book[book_hash] = (rclass, worker, entry[2], where)
        book.move_to_end(book_hash)

    def _moved(self, rclass: str, stats: ClassStats,
               entry: Optional[BookEntry]) -> None:
        """A key of ``rclass`` last went to ``entry``: (class,
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
        worker.given.add(rclass)
        self.skills_version += 1

    def _settled(self, stats: ClassStats) -> None:
        """A class that followed its moved keys has them all: the workers
        it took lose their floors, and résumés rank its members again."""
        stats.following = False
        stats.senders = None
        floors = stats.floors
        if floors:
            for worker in [w for w, ratio in floors.items() if adopted(ratio)]:
                del floors[worker]
            if not floors:
                stats.floors = None
            self.skills_version += 1

    def _notice_unskilled(self, skilled: Optional[dict], decay: float) -> None:
        """Reset skills when most requests hit classes no worker knows;
        then not again until fewer than half as many do.  A second reset
        while they still do cannot help, and a flood of classes seen once
        (a client sending a new Host with every request) would otherwise
        reset the pool over and over, moving every other class's keys."""
        self.unskilled = unskilled = self.unskilled * decay + (0.0 if skilled else 1.0)
        if not self.relearn_armed:
            self.relearn_armed = unskilled < RELEARN_SHARE / 2 * self.total
        elif (self.requests > self.footprint_window and self.skilled
                and unskilled > RELEARN_SHARE * self.total):
            self._forget_all_skills()  # (``unskilled`` still measured, to re-arm)
            self.relearn_armed = False

