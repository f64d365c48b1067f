"""Routing policies, all with the pool's interface.

Theory of operation
-------------------

The simulator talks to every policy as the LB talks to
:class:`zc_lb.routing.pool.Pool`: ``add(handle)``, ``remove(handle)``,
``new_resume(handle, resume)``, ``get(rclass) -> handle or None`` and
``put(handle)`` when the request ends.  The résumé pool and least backlog
*are* the production classes (``Pool`` and ``ClasslessPool``); the others
are written here for comparison and keep their own backlog counts:

- round robin: each worker in turn;
- two choices: two distinct workers at random, the less loaded one;
- bounded hash: consistent hashing of the class with bounded loads
  (Mirrokni et al., HAProxy's ``hash-balance-factor``): walk the ring
  from the class's point and take the first worker whose backlog is below
  ``ceil(c * (total backlog + 1) / n_workers)``;
- LARD (Pai et al., 1998): each class sticks to one worker, and moves to
  the least loaded worker when its worker's backlog is past ``high`` while
  some worker is below ``low``, or past ``2 * high``.

``put`` for a worker that was removed is ignored, as the pool does.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
from typing import Dict, Hashable, List, Mapping, Optional, Tuple

from zc_lb.routing.affinity import AffinityPool
from zc_lb.routing.pool import ClasslessPool, Pool

from .config import Config


class Policy:
    """Base of the comparison policies: membership and backlogs."""

    def __init__(self) -> None:
        self.backlog: Dict[Hashable, int] = {}
        self.handles: List[Hashable] = []
        self.total = 0

    def add(self, handle: Hashable, resume: Optional[Mapping] = None) -> None:
        """Add a worker (idempotent)."""
        if handle not in self.backlog:
            self.backlog[handle] = 0
            self.handles.append(handle)
            self.changed()

    def remove(self, handle: Hashable) -> None:
        """Forget a worker, even with requests in flight on it."""
        if handle in self.backlog:
            self.total -= self.backlog.pop(handle)
            self.handles.remove(handle)
            self.changed()

    def changed(self) -> None:
        """Membership changed; subclasses rebuild what depends on it."""

    def new_resume(self, handle: Hashable, resume: Mapping[str, float]) -> None:
        """Résumés are ignored."""

    def get(self, rclass: str, key: Optional[str] = None) -> Optional[Hashable]:
        """Choose a worker; None if there is none.  Keys are ignored."""
        if not self.handles:
            return None
        handle = self.pick(rclass)
        self.backlog[handle] += 1
        self.total += 1
        return handle

    def pick(self, rclass: str) -> Hashable:
        raise NotImplementedError

    def choose(self, rclass: str, key: Optional[str] = None) -> Tuple[Optional[Hashable], None]:
        """``get``'s worker, placed with nothing for ``served`` to learn."""
        return self.get(rclass, key), None

    def served(self, placed: object, elapsed: float, cache: object = None) -> None:
        """Service times are ignored."""

    def put(self, handle: Hashable) -> None:
        """A request on ``handle`` ended."""
        if self.backlog.get(handle, 0) > 0:
            self.backlog[handle] -= 1
            self.total -= 1


class RoundRobin(Policy):
    """Each worker in turn."""

    def __init__(self) -> None:
        super().__init__()
        self.next = 0

    def pick(self, rclass: str) -> Hashable:
        i = self.next % len(self.handles)
        self.next = i + 1
        return self.handles[i]


class TwoChoices(Policy):
    """The less loaded of two workers drawn at random."""

    def __init__(self, rng: random.Random) -> None:
        super().__init__()
        self.rng = rng

    def pick(self, rclass: str) -> Hashable:
        handles = self.handles
        if len(handles) == 1:
            return handles[0]
        a, b = self.rng.sample(handles, 2)
        return a if self.backlog[a] <= self.backlog[b] else b


def _point(key: str) -> int:
    """A stable 64-bit hash (Python's str hash is salted per process)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


class BoundedHash(Policy):
    """Consistent hashing of the class, with bounded loads (factor c)."""

    def __init__(self, factor: float = 1.25, replicas: int = 100) -> None:
        super().__init__()
        if factor < 1:
            raise ValueError("hash balance factor must be >= 1")
        self.factor = factor
        self.replicas = replicas
        self.points: List[int] = []
        self.owners: List[Hashable] = []
        self.order: Dict[str, List[Hashable]] = {}  # class -> ring walk

    def changed(self) -> None:
        ring = sorted((_point("%s-%d" % (h, r)), i)
                      for i, h in enumerate(self.handles)
                      for r in range(self.replicas))
        self.points = [p for p, _ in ring]
        self.owners = [self.handles[i] for _, i in ring]
        self.order = {}

    def walk(self, rclass: str) -> List[Hashable]:
        """Distinct workers in ring order from the class's point."""
        start = bisect.bisect(self.points, _point(rclass))
        owners = self.owners[start:] + self.owners[:start]
        return list(dict.fromkeys(owners))

    def bound(self) -> int:
        """The most a worker may hold after the next request is placed."""
        return math.ceil(self.factor * (self.total + 1) / len(self.handles))

    def pick(self, rclass: str) -> Hashable:
        order = self.order.get(rclass)
        if order is None:
            order = self.order[rclass] = self.walk(rclass)
        bound = self.bound()
        backlog = self.backlog
        for handle in order:
            if backlog[handle] < bound:
                return handle
        raise AssertionError("no worker under the bound")  # c >= 1 prevents it


class LARD(Policy):
    """Locality-aware request distribution, basic form, per class."""

    def __init__(self, low: int = 2, high: int = 4) -> None:
        super().__init__()
        self.low = low
        self.high = high
        self.server: Dict[str, Hashable] = {}

    def changed(self) -> None:
        alive = self.backlog
        self.server = {c: h for c, h in self.server.items() if h in alive}

    def least_loaded(self) -> Hashable:
        backlog = self.backlog
        return min(self.handles, key=backlog.__getitem__)

    def pick(self, rclass: str) -> Hashable:
        handle = self.server.get(rclass)
        if handle is None:
            handle = self.server[rclass] = self.least_loaded()
            return handle
        load = self.backlog[handle]
        if load > self.high or load >= 2 * self.high:
            other = self.least_loaded()
            if load >= 2 * self.high or self.backlog[other] < self.low:
                handle = self.server[rclass] = other
        return handle


def make(name: str, config: Config, rng: random.Random):
    """The policy called ``name``, configured from ``config``."""
    pool_settings = dict(variance=config.variance,
                         backlog_history=config.backlog_history,
                         unskilled_score=config.unskilled_score)
    if name == "affinity":
        return AffinityPool(spread=config.spread,
                            footprint_window=config.footprint_window,
                            slow_start=config.slow_start, balance=config.balance,
                            stick=config.stick, widen=config.widen,
                            separate_books=config.separate_books,
                            busy_members=config.busy_members,
                            **pool_settings)
    if name == "published":
        return Pool(**pool_settings)
    if name == "least_backlog":
        return ClasslessPool(**pool_settings)
    if name == "round_robin":
        return RoundRobin()
    if name == "two_choices":
        return TwoChoices(rng)
    if name == "bounded_hash":
        return BoundedHash(config.hash_balance_factor, config.hash_replicas)
    if name == "lard":
        return LARD(config.lard_low, config.lard_high)
    raise ValueError("unknown policy %r" % (name,))


def uses_resumes(policy) -> bool:
    """Whether ``policy`` reads résumés (only then are they worth sending)."""
    return isinstance(policy, Pool) and not isinstance(policy, ClasslessPool)
