"""The pool's skills: for each request class, the workers skilled in it
and their scores.

Theory of operation
-------------------

A worker's résumé may name tens of thousands of classes (a site of many
Host names; a flood of new ones), and the pool keeps every class any
worker is skilled in, while only those requested lately are routed.
Held as a dict of workers each, every class would be an object for
Python's cyclic collector to walk (a dict that holds a worker record is
tracked): a full pass over 40,000 of them takes 35-60 ms of the LB's
loop, and a large résumé's new classes bring one on.

So a class is held in one of two forms:

- *dormant*: a flat tuple ``(ident, score, ident, score, ...)`` of
  floats, the workers' numbers (``PoolWorker.ident``, by which the pool
  holds them) and scores, in the order they became skilled.  A tuple of
  numbers only is dropped from the collector's lists at its first pass,
  and never walked again.  Résumés update it in place of the dict
  (``add``, ``remove``), without waking it.
- *live*: a dict ``worker -> score``, which routing reads and changes.
  A class wakes when routing reads it (``get``, ``[]``): a request of it
  came.  It goes back to sleep (``rest``) when the pool forgets the
  class as idle.

Either way the workers keep the order they became skilled in, the order
one dict per class would have: every choice the pool makes, ties and
sums included, is the same as if every class were a dict.

Cost: a live class's read is one method call more than a dict's; a
class waking or going to sleep, and a dormant class's update, copy its
workers (O(workers skilled in it)).  A worker removed from the pool has
its classes taken out first (``remove``), so its number is left in no
tuple; a stale one would be skipped.
"""

from __future__ import annotations

from typing import Dict, Generic, Iterator, List, Optional, Protocol, Tuple, TypeVar


class Numbered(Protocol):
    """A worker record with its number in the pool (``PoolWorker``)."""

    ident: int


W = TypeVar("W", bound=Numbered)


class SkillMap(Generic[W]):
    """class -> worker -> score, with the classes routing has not read yet
    held dormant (see the module docstring).  Reads as a mapping of
    classes to dicts; ``add`` and ``remove`` are the résumés' updates.
    ``workers``: the pool's workers by number."""

    def __init__(self, workers: Dict[int, W]) -> None:
        self.live: Dict[str, Dict[W, float]] = {}
        self.dormant: Dict[str, Tuple[float, ...]] = {}
        self.workers = workers

    # -- routing's reads (a dormant class wakes) ------------------------

    def get(self, rclass: str, default: Optional[Dict[W, float]] = None
            ) -> Optional[Dict[W, float]]:
        """The workers skilled in ``rclass`` and their scores, or ``default``."""
        skilled = self.live.get(rclass)
        if skilled is None:
            if rclass in self.dormant:
                skilled = self._wake(rclass)
            if skilled is None:
                return default
        return skilled

    def __getitem__(self, rclass: str) -> Dict[W, float]:
        skilled = self.get(rclass)
        if skilled is None:
            raise KeyError(rclass)
        return skilled

    def setdefault(self, rclass: str) -> Dict[W, float]:
        """The workers skilled in ``rclass``, an empty dict put there first
        if there are none."""
        skilled = self.get(rclass)
        if skilled is None:
            skilled = self.live[rclass] = {}
        return skilled

    def __contains__(self, rclass: object) -> bool:
        return rclass in self.live or rclass in self.dormant

    def __len__(self) -> int:
        return len(self.live) + len(self.dormant)

    def __bool__(self) -> bool:
        return bool(self.live) or bool(self.dormant)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self.live) + list(self.dormant))

    def items(self) -> List[Tuple[str, Dict[W, float]]]:
        """Every class with its workers and scores (a dormant class's dict
        is built for the reading, and the class stays dormant)."""
        return (list(self.live.items())
                + [(rclass, self._built(held)) for rclass, held in self.dormant.items()])

    def clear(self) -> None:
        self.live.clear()
        self.dormant.clear()

    # -- résumés' updates (a dormant class stays dormant) ---------------

    def add(self, rclass: str, worker: W, score: float) -> None:
        """Make ``worker`` skilled in ``rclass`` with ``score``."""
        skilled = self.live.get(rclass)
        if skilled is not None:
            skilled[worker] = score
            return
        wid = float(worker.ident)
        held = self.dormant.get(rclass)
        if held is None:
            self.dormant[rclass] = (wid, score)
            return
        for at in range(0, len(held), 2):
            if held[at] == wid:
                self.dormant[rclass] = held[:at + 1] + (score,) + held[at + 2:]
                return
        self.dormant[rclass] = held + (wid, score)

    def remove(self, rclass: str, worker: W) -> None:
        """Take ``worker`` out of the workers skilled in ``rclass``, and
        the class out of the map if none is left."""
        skilled = self.live.get(rclass)
        if skilled is not None:
            skilled.pop(worker, None)
            if not skilled:
                del self.live[rclass]
            return
        held = self.dormant.get(rclass)
        if held is None:
            return
        wid = float(worker.ident)
        for at in range(0, len(held), 2):
            if held[at] == wid:
                rest = held[:at] + held[at + 2:]
                if rest:
                    self.dormant[rclass] = rest
                else:
                    del self.dormant[rclass]
                return

    def rest(self, rclass: str) -> None:
        """Put ``rclass`` to sleep: the pool forgot it as idle."""
        skilled = self.live.get(rclass)
        if not skilled:  # (none, or an empty dict kept as it is)
            return
        held: List[float] = []
        for worker, score in skilled.items():
            held.append(float(worker.ident))
            held.append(score)
        del self.live[rclass]
        self.dormant[rclass] = tuple(held)

    # -- the dormant form -------------------------------------------------

    def _wake(self, rclass: str) -> Optional[Dict[W, float]]:
        skilled = self._built(self.dormant.pop(rclass))
        if not skilled:
            return None
        self.live[rclass] = skilled
        return skilled

    def _built(self, held: Tuple[float, ...]) -> Dict[W, float]:
        workers = self.workers
        skilled: Dict[W, float] = {}
        for at in range(0, len(held), 2):
            worker = workers.get(int(held[at]))
            if worker is not None:
                skilled[worker] = held[at + 1]
        return skilled

    def __repr__(self) -> str:
        return "<SkillMap %d classes, %d live>" % (len(self), len(self.live))
