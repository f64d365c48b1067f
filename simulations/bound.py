"""The perfect partition: the loads routing aims at on a workload.

All the workers' caches taken as one LRU, fed the same requests in the
order they were issued: its misses per request, counted after the same
warm-up, are the loads a perfect partition of the caches would cause
(``playback/compare.py`` prints the same bound for a real log as its
"floor").  A policy's misses over this bound say how far its routing is
from perfect locality.  With caches of a useful size no policy does
better; with tiny ones LRU's quirks can let one.

The bound is not defined while the caches' total changes (a scenario
that adds or removes a worker): ``partition_misses`` then says None.
"""

from __future__ import annotations

import random
from typing import Optional

from .cache import LRUCache
from .config import Config
from .workload import Workload

CHANGES_CAPACITY = ("add_worker", "remove_worker")


def partition_misses(config: Config) -> Optional[float]:
    """The perfect partition's misses per request on ``config``'s
    workload (the same seed, the same requests), or None when an action
    changes how much cache there is."""
    if any(action["do"] in CHANGES_CAPACITY for action in config.actions):
        return None
    sizes = config.cache_sizes
    total = sum(sizes[i % len(sizes)] if sizes else config.cache_size
                for i in range(config.workers))
    workload = Workload(config, random.Random(config.seed))
    cache = LRUCache(total)
    actions = sorted(config.actions, key=lambda action: action["at"])
    warmup = int(config.warmup * config.requests)
    misses = 0
    for issued in range(config.requests):
        while actions and actions[0]["at"] <= issued:
            _act(workload, actions.pop(0))
        request_misses = cache.touch_all(workload.next()[2])
        if issued >= warmup:
            misses += request_misses
    return misses / max(1, config.requests - warmup)


def _act(workload: Workload, action: dict) -> None:
    """The actions that change the requests, as the engine takes them."""
    if action["do"] == "hot_site":
        workload.make_hot(action["site"], action["fraction"])
    elif action["do"] == "change_classifier":
        workload.change_classifier(action.get("mode", "rename"))
