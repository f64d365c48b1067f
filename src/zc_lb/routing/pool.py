"""The routing algorithm: which worker gets a request of a given class.

Theory of operation
-------------------

Workers tell us what they are good at: a *résumé* maps request classes
to scores (requests per second while serving that class).  For each class
we keep the workers skilled in it with their scores; for each worker its
*backlog* (requests this LB has outstanding on it) and a decayed mean of
that backlog; the same decayed mean for the whole pool; and an order of
workers by when each was last chosen (least recently chosen first).

To route a request of class C (``get``):

1. The cap.  A worker may take C only while its decayed mean backlog,
   less (the least recently chosen worker's decayed mean backlog + 1),
   does not exceed ``max(variance * pool_mean_backlog / n_workers, 1)``.
   This is what keeps a hot class from taking the pool down: once its
   workers are loaded well past the mean, it spills onto others.
2. Among the workers skilled in C and under the cap, take the best score
   per unit of current backlog: ``score / backlog`` once the backlog is
   above 1, so the first outstanding request is not penalised.
3. If none qualifies, take the least recently chosen worker; if it was not
   skilled in C it becomes so, with ``unskilled_score``.
4. The chosen worker becomes the most recently chosen and its backlog and
   the pool's grow.  ``put`` reverses that when the response ends.

Decays: a worker's mean backlog decays by ``1 - 1/(2*backlog_history)``
per event on that worker, the pool's by
``1 - 1/(2*backlog_history*n_workers)`` per event on any worker.  The
means are normalised, as in the original zc.resumelb: a decayed sum of
backlogs over a decayed count of events.  A plain exponential average
started at zero would read low for the first ~2 x backlog_history events,
and the cap would do nothing just when a pool starts or a class moves.

Cost: ``get`` and ``put`` are O(workers skilled in C); nothing scans all
classes or all workers.  The LRU order is an ordered dict (O(1) move to
the end, O(1) first item).  The skills are a ``SkillMap``
(``routing/skillmap.py``), which holds the classes not requested lately
out of the cyclic collector's way.

Weak spots, admitted: skills are only as good as the workers' résumés, so
a changed classifier takes a while to be learned (a worker keeps its
skills until a résumé replaces them); and with very light load the
decayed means are tiny, so the cap is 1 and the order matters more than
the scores.

The pool is pure: no sockets, no gevent, no clock.  Waiting for a worker
when there is none is the caller's business (``get`` returns None).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import (Any, Callable, ClassVar, Container, Dict, Hashable, Iterable, Iterator, List,
                    Mapping, Optional, Set, Tuple)

from zc_lb.routing.classifier import MAX_CLASS
from zc_lb.routing.skillmap import SkillMap
from zc_lb.settings import LB_SETTINGS, check

RESUME_STEP = 1000  # changed classes of a résumé taken in between pauses (``new_resume``)


class PoolWorker:
    """The pool's record of one worker: backlog, decayed backlog, skills."""

    __slots__ = ("handle", "backlog", "mbacklog", "dsum", "dcount", "resume",
                 "version", "name", "salt", "given", "held", "booked", "elsewhere",
                 "sent", "ident")

    def __init__(self, handle: Hashable, version: Optional[str] = None,
                 name: Optional[str] = None) -> None:
        self.handle = handle
        self.backlog = 0  # requests in flight on it, sibling LBs' (``elsewhere``) included
        self.elsewhere = 0  # sibling LBs' requests in flight on it (routing/siblings.py)
        self.mbacklog = 0.0  # dsum / dcount
        self.dsum = 0.0  # decayed sum of backlogs
        self.dcount = 0.0  # decayed count of events
        self.resume: Dict[str, float] = {}
        self.version = version
        self.name = str(handle) if name is None else name
        self.salt = 0  # the affinity policy's per-worker hash salt
        self.held = 0.0  # and the distinct keys it counts the worker to hold
        self.booked = 0  # keys the book says last went to it (routing/relearn.py)
        self.ident = 0  # the number the pool gave it (``Pool.add``), never another's
        # classes the pool made it skilled in at ``unskilled_score``, which
        # its résumé has not scored yet
        self.given: Set[str] = set()
        # (class, key hash in the book) of the keys sent to it since the
        # other LBs were last told (the affinity policy's ``relayed``)
        self.sent: List[Tuple[str, int]] = []

    def status(self) -> dict:
        """A JSON-able picture of the worker, for the pool's status."""
        return {
            "backlog": self.backlog - self.elsewhere,
            "siblings_backlog": self.elsewhere,  # (--processes: routing/siblings.py)
            "mean_backlog": round(self.mbacklog, 4),
            "version": self.version,
            "skills": dict(sorted(self.resume.items())),
        }

    def __repr__(self) -> str:
        return "<PoolWorker %r backlog=%d mbacklog=%.2f skills=%d>" % (
            self.handle,
            self.backlog,
            self.mbacklog,
            len(self.resume),
        )


def unskill(skilled_map: SkillMap[PoolWorker], worker: PoolWorker,
            classes: Iterable[str]) -> None:
    """Take ``worker`` out of the skilled workers of ``classes`` in
    ``skilled_map``, and a class left with none out of the map."""
    remove = skilled_map.remove
    for rclass in classes:
        remove(rclass, worker)


def _changes(old: Dict[str, float], new: Dict[Any, Any]) -> Iterator[Tuple[str, float]]:
    """The classes whose score in résumé ``new`` is not the one in
    ``old``, each with its score, ``new`` cleaned as they come (one at a
    time, as ``Pool.new_resume`` takes them): their classes made strings
    and their scores floats, and those that are not positive finite
    numbers taken out, as are classes longer than ``MAX_CLASS``: no
    request has one (``classifier.bounded_class``), and a worker's
    résumé (4 MiB, RESUME_LIMIT) is not to make one of megabytes in the pool and in
    the status document."""
    for rclass in [rclass for rclass, score in new.items()  # (None is no class's score)
                   if score is None or old.get(rclass) != score]:
        score = new.pop(rclass)
        try:
            score = float(score)
        except (TypeError, ValueError):
            continue
        if not 0.0 < score < math.inf:  # (NaN too)
            continue
        rclass = str(rclass)
        if len(rclass) > MAX_CLASS:
            continue
        new[rclass] = score
        yield rclass, score


class Departed:
    """Requests still in flight on workers removed from a pool, by handle:
    each ends with ``Pool.put``, and a worker added again before they all
    ended starts with those left (silent then heard, drained then enabled,
    ejected then readmitted: the same connection, still busy)."""

    __slots__ = ("counts",)

    def __init__(self) -> None:
        self.counts: Dict[Hashable, int] = {}

    def left(self, handle: Hashable, in_flight: int) -> None:
        """``handle`` was removed with ``in_flight`` requests of its own."""
        if in_flight > 0:
            self.counts[handle] = in_flight

    def ended(self, handle: Hashable) -> None:
        """One of them ended."""
        count = self.counts.pop(handle, 0) - 1
        if count > 0:
            self.counts[handle] = count

    def back(self, handle: Hashable) -> int:
        """``handle`` is added again: its requests still in flight, now its own."""
        return self.counts.pop(handle, 0)


class Pool:
    """Résumé-based routing: skilled workers first, backlog capped."""

    SETTINGS: ClassVar[Tuple[str, ...]] = ("variance", "backlog_history", "unskilled_score")
    variance: float
    backlog_history: int
    unskilled_score: float

    # The constructors' settings are Any: each is checked against the
    # settings table, and a bad one is a ConfigurationError that names it
    # (compiled code would refuse a wrong type first, with a bare TypeError).
    def __init__(
        self,
        variance: Any = LB_SETTINGS["variance"].default,
        backlog_history: Any = LB_SETTINGS["backlog_history"].default,
        unskilled_score: Any = LB_SETTINGS["unskilled_score"].default,
    ) -> None:
        self._set_settings(variance=variance, backlog_history=backlog_history,
                           unskilled_score=unskilled_score)
        self.workers: Dict[Hashable, PoolWorker] = {}
        # least recently chosen first
        self._lru: "OrderedDict[PoolWorker, None]" = OrderedDict()
        self._first: Optional[PoolWorker] = None  # its first, if known (``oldest``)
        self.by_ident: Dict[int, PoolWorker] = {}  # (the skills and the book name them so)
        self._last_ident = 0
        self.skilled: SkillMap[PoolWorker] = SkillMap(self.by_ident)  # class -> worker -> score
        self.backlog = 0
        self.departed = Departed()  # (removed workers' requests still in flight)
        self.mbacklog = 0.0
        self.dsum = 0.0
        self.dcount = 0.0
        # What the last ``get`` placed, for ``served`` (given by ``choose``);
        # None when there is nothing to learn from its service time.
        self._placed_as: Any = None
        # LBs sharing the workers, ZooKeeper's count or --processes N (the
        # affinity policy routes alike on every one when there are several)
        self.lbs = 1
        self._settings_changed()

    # -- settings -----------------------------------------------------

    def update_settings(self, **changes: Any) -> None:
        """Change settings of this policy (its ``SETTINGS``) at run time;
        None leaves a setting as it is, a bad value changes nothing."""
        unknown = set(changes) - set(self.SETTINGS)
        if unknown:
            raise TypeError("%s has no setting %s"
                            % (type(self).__name__, ", ".join(sorted(unknown))))
        self._set_settings(**{name: value for name, value in changes.items()
                              if value is not None})
        self._settings_changed()

    def configure(self, settings: Mapping[str, object]) -> None:
        """``update_settings`` with those of ``settings`` this policy has."""
        chosen: Dict[str, Any] = {name: settings[name] for name in self.SETTINGS
                                  if name in settings}
        self.update_settings(**chosen)

    def _set_settings(self, **values: Any) -> None:
        """Check every value against the settings table, then set them all."""
        checked = {name: check(LB_SETTINGS, name, value) for name, value in values.items()}
        for name, value in checked.items():
            setattr(self, name, value)

    def _settings_changed(self) -> None:
        """Work out what depends on the settings."""
        self._update_decays()

    def _update_decays(self) -> None:
        history = self.backlog_history
        self.worker_decay = 1.0 - 1.0 / (2 * history)
        self.pool_decay = 1.0 - 1.0 / (2 * history * max(len(self.workers), 1))

    # -- membership ---------------------------------------------------

    def add(self, handle: Hashable, resume: Optional[Mapping[str, float]] = None,
            version: Optional[str] = None, name: Optional[str] = None) -> None:
        """Add a worker (idempotent); it is least recently chosen.

        ``name`` identifies the worker across LBs and reconnections (its
        address); it defaults to ``str(handle)``.
        """
        if handle in self.workers:
            if resume is not None:
                self.new_resume(handle, resume)
            return
        worker = PoolWorker(handle, version, name)
        worker.backlog = self.departed.back(handle)
        self.backlog += worker.backlog
        self._last_ident += 1
        worker.ident = self._last_ident
        self.by_ident[worker.ident] = worker
        self._added(worker)
        self.workers[handle] = worker
        self._lru[worker] = None
        self._lru.move_to_end(worker, last=False)
        self._first = worker
        self._update_decays()
        if resume:
            self.new_resume(handle, resume)

    def _added(self, worker: PoolWorker) -> None:
        """A hook for policies that keep more per worker."""

    def remove(self, handle: Hashable) -> None:
        """Forget a worker entirely, even with requests in flight on it."""
        worker = self.workers.pop(handle, None)
        if worker is None:
            return
        self.departed.left(handle, worker.backlog - worker.elsewhere)
        self._forget_skills(worker)
        del self.by_ident[worker.ident]
        del self._lru[worker]
        self._first = None
        self.backlog -= worker.backlog
        worker.backlog = 0
        self._update_decays()

    def new_resume(self, handle: Hashable, resume: Mapping[str, float],
                   pause: Optional[Callable[[], None]] = None) -> Set[str]:
        """Replace a worker's skills by those of its new résumé; the classes
        whose skill changed.  Only those are touched: an idle class's score
        does not move (worker/resume.py), so a résumé of 10,000 classes of
        which a hundred were served costs a hundred updates.  A score that
        is not a positive finite number drops the class, as does its
        absence or a name past MAX_CLASS; the LB's own skills (``given``) give way.
        ``pause``, if given, is called after every ``RESUME_STEP`` changed
        classes (the LB's loop runs there: 10,000 changed take 20-60 ms).
        Meanwhile ``worker.resume`` holds what the skilled workers hold (a
        worker removed then leaves nothing behind, and the intake stops),
        and what the pool grants or takes away there stands."""
        worker = self.workers.get(handle)
        if worker is None:
            return set()
        old = worker.resume
        new: Dict[Any, Any] = dict(resume)  # (cleaned below: any key, any score)
        touched = set(worker.given)
        current: Optional[Dict[str, float]] = None  # (with ``pause``: what is skilled so far)
        if pause is not None:
            current = worker.resume = dict(old)
        added = self._take_scores(worker, old, new, touched, current, pause)
        if added is None:
            return touched  # (removed meanwhile: nothing of it is left)
        if len(new) - added < len(old):  # some classes left the résumé
            dropped = [c for c in old if c not in new]
            if not self._drop_classes(worker, dropped, current, pause):
                return touched
            touched.update(dropped)
        if current is None:
            worker.resume = new
            worker.given.clear()
        else:  # (the skilled map's: with what the pool did meanwhile)
            worker.resume = current
            worker.given.intersection_update(current.keys() - new.keys())
        return touched

    def _take_scores(self, worker: PoolWorker, old: Dict[str, float], new: Dict[Any, Any],
                     touched: Set[str], current: Optional[Dict[str, float]],
                     pause: Optional[Callable[[], None]]) -> Optional[int]:
        """``new_resume``'s intake: make ``worker`` skilled in the classes
        of ``_changes``, adding them to ``touched`` (and to ``current``,
        with ``pause``); how many are new to it, or None if it was
        removed during a pause."""
        add = self.skilled.add
        added = steps = 0
        for rclass, score in _changes(old, new):
            added += rclass not in old
            add(rclass, worker, score)
            touched.add(rclass)
            if current is not None:
                current[rclass] = score
                steps += 1
                if steps == RESUME_STEP:
                    steps = 0
                    pause()  # type: ignore[misc]
                    if self.workers.get(worker.handle) is not worker:
                        return None
        return added

    def _drop_classes(self, worker: PoolWorker, dropped: List[str],
                      current: Optional[Dict[str, float]],
                      pause: Optional[Callable[[], None]]) -> bool:
        """``new_resume``'s other half: take ``worker`` out of the skilled workers
        of the classes its résumé ``dropped`` (with ``pause``, in steps, each out
        of ``current`` as it goes); whether it is still in the pool."""
        for start in range(0, len(dropped), RESUME_STEP):
            if start and pause is not None:
                pause()
                if self.workers.get(worker.handle) is not worker:
                    return False
            part = dropped[start:start + RESUME_STEP]
            unskill(self.skilled, worker, part)
            if current is not None:
                for rclass in part:
                    current.pop(rclass, None)  # (unless taken away meanwhile)
        return True

    def _forget_skills(self, worker: PoolWorker) -> None:
        unskill(self.skilled, worker, worker.resume)
        worker.resume = {}
        worker.given.clear()

    def __contains__(self, handle: Hashable) -> bool:
        return handle in self.workers

    def __len__(self) -> int:
        return len(self.workers)

    # -- routing ------------------------------------------------------

    def get(self, rclass: Optional[str], key: Optional[str] = None
            ) -> Optional[Hashable]:
        """Choose a worker for a request of ``rclass``; None if there is none.

        ``rclass`` None means the request has no class: it goes to the
        least loaded worker.  The published algorithm ignores ``key``.
        """
        if not self._lru:
            return None
        if rclass is None:
            return self._least_backlog()
        return self._chosen(self.published(rclass))

    def published(self, rclass: str) -> PoolWorker:
        """The published choice for ``rclass`` (the module docstring's steps 1-3), unaccounted."""
        oldest = self.oldest()
        max_backlog = self.variance * self.mbacklog / float(len(self.workers))
        if max_backlog < 1.0:
            max_backlog = 1.0
        min_backlog = oldest.mbacklog + 1.0

        best_worker = None
        best_score = 0.0
        skilled = self.skilled.get(rclass)
        if skilled:
            for worker, score in skilled.items():
                if worker.mbacklog - min_backlog > max_backlog:
                    continue
                backlog = worker.backlog
                if backlog > 1:
                    score /= backlog
                if score > best_score:
                    best_score = score
                    best_worker = worker

        if best_worker is None:
            best_worker = oldest
            if rclass not in best_worker.resume:
                score = self.unskilled_score
                best_worker.resume[rclass] = score
                best_worker.given.add(rclass)
                self.skilled.setdefault(rclass)[best_worker] = score
        return best_worker

    def _chosen(self, worker: PoolWorker) -> Hashable:
        """Account a request given to ``worker``; its handle."""
        self.to_end(worker)
        worker.backlog += 1
        self.backlog += 1
        self._decay(worker)
        return worker.handle

    def to_end(self, worker: PoolWorker) -> None:
        """Make ``worker`` the most recently chosen."""
        if worker is self._first:
            self._first = None
        self._lru.move_to_end(worker)

    def oldest(self) -> PoolWorker:
        """The least recently chosen worker (there is one).  Remembered
        until it is chosen or removed: the first of an ordered dict costs
        an iterator (compiled, some 600 instructions), and most requests
        do not change it."""
        oldest = self._first
        if oldest is None:
            for oldest in self._lru:
                break
            else:
                raise LookupError("the pool has no workers")
            self._first = oldest
        return oldest

    def by_recency(self) -> Iterable[PoolWorker]:
        """The workers, least recently chosen first (the pool's own
        order: read it, and change it only by choosing)."""
        return self._lru

    def _least_backlog(self) -> Optional[Hashable]:
        """The least loaded worker, ties to the least recently chosen: O(workers)."""
        best = self.least_loaded()
        return None if best is None else self._chosen(best)

    def least_loaded(self, skip: Container[PoolWorker] = ()) -> Optional[PoolWorker]:
        """The worker with the least backlog but for those in ``skip``,
        ties to the least recently chosen, not yet accounted: O(workers)."""
        best = None
        for worker in self._lru:  # least recently chosen first
            if (best is None or worker.backlog < best.backlog) and worker not in skip:
                best = worker
                if not worker.backlog:
                    break
        return best

    def room(self, load: float, floor: int = 1) -> int:
        """Requests the workers can take before any of them passes the cap
        that ``load`` requests spread over the pool would set: ``variance``
        times the mean backlog per worker (the decayed mean, if higher), and
        at least ``floor`` each.  What a retry may use: work moved from a
        lost worker to others with room, never piled on a pool at its cap."""
        if not self.workers:
            return 0
        load = max(load, self.mbacklog)
        cap = max(math.ceil(self.variance * load / len(self.workers)), floor)
        return sum(max(cap - worker.backlog, 0) for worker in self._lru)

    def choose(self, rclass: Optional[str], key: Optional[str] = None
               ) -> Tuple[Optional[Hashable], Any]:
        """``get``'s worker, and how it was placed: what ``served`` learns
        from once the request's service time is known (None: nothing)."""
        handle = self.get(rclass, key)
        return handle, self._placed_as

    def served(self, placed: Any, elapsed: float, cache: Optional[bool] = None) -> None:
        """The application took ``elapsed`` seconds for a request that
        ``choose`` placed as ``placed``, and said whether its ``cache``
        hit (None: it did not say).  The published policy learns from
        résumés alone."""

    def put(self, handle: Hashable) -> None:
        """A request given to ``handle`` by ``get`` has ended."""
        worker = self.workers.get(handle)
        if worker is None:
            self.departed.ended(handle)  # (removed while the request was in flight)
        elif worker.backlog > worker.elsewhere:
            worker.backlog -= 1
            self.backlog -= 1
            self._decay(worker)

    def share_with(self, siblings: Any) -> None:
        """Route as one LB with the other processes of ``--processes``
        (a ``siblings.Siblings``): here, the backlogs counted over all
        (``take_elsewhere``), which the LB brings; a policy with more to
        share takes it."""

    def measure(self) -> Tuple[float, float]:
        """What this pool measured that its siblings count too (see
        ``take_measure``): nothing here."""
        return 0.0, 0.0

    def take_measure(self, ratio: float, weight: float) -> None:
        """The siblings' measures (``measure``), summed: nothing here."""

    def take_elsewhere(self, elsewhere: Mapping[str, int]) -> Dict[str, int]:
        """Count the requests sibling LBs have in flight on the workers
        (worker name -> requests; routing/siblings.py) into their backlogs, in
        place of the last such count; this pool's own requests in flight,
        by worker name, for the siblings."""
        own: Dict[str, int] = {}
        for worker in self.workers.values():
            count = elsewhere.get(worker.name, 0)
            change = count - worker.elsewhere
            if change:
                worker.elsewhere = count
                worker.backlog += change
                self.backlog += change
            own[worker.name] = worker.backlog - count
        return own

    def _decay(self, worker: PoolWorker) -> None:
        decay = self.worker_decay
        worker.dsum = dsum = decay * worker.dsum + worker.backlog
        worker.dcount = dcount = decay * worker.dcount + 1.0
        worker.mbacklog = dsum / dcount
        decay = self.pool_decay
        self.dsum = dsum = decay * self.dsum + self.backlog
        self.dcount = dcount = decay * self.dcount + 1.0
        self.mbacklog = dsum / dcount

    # -- introspection ------------------------------------------------

    def order(self) -> Iterable[Hashable]:
        """Worker handles, least recently chosen first."""
        return [worker.handle for worker in self._lru]

    def status(self) -> dict:
        """A JSON-able picture of the pool, for the status document."""
        return {
            "policy": type(self).__name__,
            "variance": self.variance,
            "backlog_history": self.backlog_history,
            "unskilled_score": self.unskilled_score,
            "backlog": self.backlog - sum(w.elsewhere for w in self._lru),
            "mean_backlog": round(self.mbacklog, 4),
            "workers": {str(worker.handle): worker.status() for worker in self._lru},
        }

    def __repr__(self) -> str:
        return "<%s workers=%d classes=%d backlog=%d mbacklog=%.2f variance=%g>" % (
            type(self).__name__, len(self.workers), len(self.skilled), self.backlog,
            self.mbacklog, self.variance)


class ClasslessPool(Pool):
    """Least backlog, ignoring classes and résumés; ties go to the least
    recently chosen worker.  For applications without a useful classifier.
    """

    def new_resume(self, handle: Hashable, resume: Mapping[str, float],
                   pause: Optional[Callable[[], None]] = None) -> Set[str]:
        """Résumés are ignored."""
        return set()

    def get(self, rclass: Optional[str], key: Optional[str] = None
            ) -> Optional[Hashable]:
        """Choose the worker with the least backlog; None if there is none."""
        return self._least_backlog()
