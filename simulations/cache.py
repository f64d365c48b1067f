"""A worker's object cache (LRU) and the pool-wide count of who holds what.

Theory of operation
-------------------

Each worker has an :class:`LRUCache` of a fixed number of objects.
Touching an object is a hit if it is cached (it becomes most recently
used) or a miss (it is loaded, a database load, and the least recently
used object is evicted when the cache is full).

:class:`Holders` counts, for every object, how many caches hold it, so
the *working-set overlap* (the share of cached objects held by more than
one worker) is known at any moment in O(1), without scanning caches.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from typing import Iterable, Optional


class Holders:
    """How many caches hold each object; objects are ints 0..n-1."""

    def __init__(self, n_objects: int) -> None:
        # (a count may pass 255: hundreds of workers, or of connections' caches)
        self.count = array("I", bytes(array("I").itemsize * n_objects))
        self.cached = 0  # objects held by at least one cache
        self.shared = 0  # objects held by at least two caches

    def add(self, obj: int) -> None:
        """One more cache holds ``obj``."""
        n = self.count[obj] + 1
        self.count[obj] = n
        if n == 1:
            self.cached += 1
        elif n == 2:
            self.shared += 1

    def discard(self, obj: int) -> None:
        """One cache fewer holds ``obj``."""
        n = self.count[obj] - 1
        self.count[obj] = n
        if n == 0:
            self.cached -= 1
        elif n == 1:
            self.shared -= 1

    def overlap(self) -> float:
        """Share of cached objects held by more than one cache."""
        return self.shared / self.cached if self.cached else 0.0


class LRUCache:
    """A least-recently-used cache of object ids, reporting to Holders."""

    def __init__(self, size: int, holders: Optional[Holders] = None) -> None:
        if size < 1:
            raise ValueError("cache size must be >= 1")
        self.size = size
        self.holders = holders
        self._items: "OrderedDict[int, None]" = OrderedDict()

    def touch(self, obj: int) -> bool:
        """Use ``obj``; True for a hit, False for a miss (it is loaded)."""
        return self.touch_all((obj,)) == 0

    def touch_all(self, objects: Iterable[int]) -> int:
        """Use each object in turn; return the number of misses."""
        items = self._items
        misses = 0
        for obj in objects:
            if obj in items:
                items.move_to_end(obj)
                continue
            misses += 1
            items[obj] = None
            if self.holders is not None:
                self.holders.add(obj)
            if len(items) > self.size:
                self._evict()
        return misses

    def _evict(self) -> None:
        obj, _ = self._items.popitem(last=False)
        if self.holders is not None:
            self.holders.discard(obj)

    def clear(self) -> None:
        """Drop everything (a worker that goes away)."""
        while self._items:
            self._evict()

    def __contains__(self, obj: int) -> bool:
        return obj in self._items

    def __len__(self) -> int:
        return len(self._items)

    def keys(self) -> list:
        """Cached objects, least recently used first."""
        return list(self._items)
