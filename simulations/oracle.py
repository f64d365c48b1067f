"""How low a placement could take the loads, planned by an oracle.

``python -m simulations.oracle SCENARIO [--slack S] [--PARAMETER VALUE ...]``
(the simulator's parameters: ``--seed 3``, ``--site-depth 2``, ...)

The partition bound (``bound.py``) is all the caches as one LRU; no
router has that, since a key's objects live in the cache of the worker
that serves it.  This module asks what the best router that keeps each
key on one worker could do: it plans a static placement (key -> worker)
with the whole run in view, which no router has either, routes every
request of the scenario by it through the workers' LRU caches, and
prints the misses per request after the warm-up, their ratio to the
bound, and the balance it cost: the busiest worker's share of the
measured requests over the mean share (``1.00``: even; a worker serving
one request at a time is saturated long before ``1.5``).

Placements:

- ``classes``: classes packed by their requests, the largest first onto
  the least loaded worker; a class with more than a worker's share split
  into parts of at most a share, its keys dealt to the parts by their
  requests.  What balancing the load alone can do.
- ``packed``: keys packed by cache footprint as well (objects: the key's
  own, and its class's shared ones on each worker that serves it).
  Classes go in order of requests, their keys in order of requests; a
  key goes to a worker within ``slack`` times the mean load whose cache
  has room, preferring one that holds its class already.  It needs the
  workers' cache size in objects, which an LB does not know.
- ``learned``: ``packed`` planned from the warm-up's requests alone; a
  key first seen later goes to the emptiest worker of its class.

What it found (scenarios ``nasa``, ``elastic`` and ``elastic_twice``,
seed 1): see ``simulations/README.rst``, "The oracle".
"""

from __future__ import annotations

import argparse
import collections
import math
import random
import sys
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

from . import bound
from . import config as config_module
from .cache import LRUCache
from .workload import Workload

Request = Tuple[int, str, List[int], Optional[str]]  # site, label, objects, key
Placement = Callable[[int, Optional[str]], int]
DEFAULT_SLACK = 1.2


def draw(config: config_module.Config) -> List[Request]:
    """The scenario's requests, as the simulator and the bound draw them."""
    workload = Workload(config, random.Random(config.seed))
    return [workload.next() for _ in range(config.requests)]


def route(config: config_module.Config, requests: Sequence[Request],
          place: Placement) -> Tuple[float, float]:
    """Every request to ``place``'s worker, through that worker's LRU:
    (misses per request after the warm-up, the busiest worker's share of
    those requests over the mean)."""
    workers = config.workers
    caches = [LRUCache(config.cache_size) for _ in range(workers)]
    warmup = int(config.warmup * len(requests))
    misses, counts = 0, [0] * workers
    for issued, (site, _, objects, key) in enumerate(requests):
        worker = place(site, key)
        request_misses = caches[worker].touch_all(objects)
        if issued >= warmup:
            misses += request_misses
            counts[worker] += 1
    measured = max(1, len(requests) - warmup)
    return misses / measured, max(counts) * workers / measured


def classes(requests: Sequence[Request], workers: int) -> Placement:
    """Classes packed by requests, the big ones split by key (see above)."""
    load = collections.Counter(site for site, _, _, _ in requests)
    key_load = collections.Counter((site, key) for site, _, _, key in requests)
    share = len(requests) / workers
    parts = []  # (requests a part, site, part, parts of the site)
    for site, count in load.items():
        split = max(1, math.ceil(count / share))
        parts.extend((count / split, site, part, split) for part in range(split))
    parts.sort(reverse=True)
    filled, home = [0.0] * workers, {}
    for count, site, part, _ in parts:
        worker = min(range(workers), key=filled.__getitem__)
        filled[worker] += count
        home[(site, part)] = worker
    split_of = {site: split for _, site, _, split in parts}
    part_of: Dict[Tuple[int, Optional[str]], int] = {}
    dealt = {site: [0.0] * split for site, split in split_of.items() if split > 1}
    for (site, key), count in sorted(key_load.items(), key=lambda item: -item[1]):
        if site in dealt:
            part = min(range(split_of[site]), key=dealt[site].__getitem__)
            dealt[site][part] += count
            part_of[(site, key)] = part
    return lambda site, key: home[(site, part_of.get((site, key), 0))]


class Packing:
    """``packed``: keys on workers by load and cache footprint (see above)."""

    def __init__(self, requests: Sequence[Request], workers: int, capacity: int,
                 slack: float) -> None:
        self.workers = workers
        key_load = collections.Counter((site, key) for site, _, _, key in requests)
        shared: Dict[int, Set[int]] = collections.defaultdict(set)
        site_load: Dict[int, int] = collections.Counter()
        for site, _, objects, key in requests:
            shared[site].update(objects[:-1] if key is not None else objects)
            site_load[site] += 1
        self.shared = {site: len(objects) for site, objects in shared.items()}
        self.filled = [0] * workers  # objects
        self.load = [0] * workers  # requests
        self.holds: List[Set[int]] = [set() for _ in range(workers)]
        self.home: Dict[Tuple[int, Optional[str]], int] = {}
        most = len(requests) / workers * slack
        keys: Dict[int, List[Optional[str]]] = collections.defaultdict(list)
        for site, key in key_load:
            keys[site].append(key)
        for site in sorted(keys, key=lambda s: -site_load[s]):
            for key in sorted(keys[site], key=lambda k: -key_load[(site, k)]):
                count = key_load[(site, key)]

                def cost(worker: int) -> Tuple[bool, bool, bool, int]:
                    return (self.load[worker] + count > most,
                            self.filled[worker] + self._adds(site, worker) > capacity,
                            site not in self.holds[worker], self.load[worker])

                self._put(site, key, min(range(workers), key=cost), count)

    def _adds(self, site: int, worker: int) -> int:
        """Objects a key of ``site`` adds to ``worker``'s cache."""
        return 1 + (0 if site in self.holds[worker] else self.shared.get(site, 0))

    def _put(self, site: int, key: Optional[str], worker: int, count: int) -> None:
        self.filled[worker] += self._adds(site, worker)
        self.load[worker] += count
        self.holds[worker].add(site)
        self.home[(site, key)] = worker

    def place(self, site: int, key: Optional[str]) -> int:
        """The key's worker; a key the plan has not seen goes to the
        emptiest worker holding its class (any, if none does)."""
        worker = self.home.get((site, key))
        if worker is None:
            holders = [w for w in range(self.workers) if site in self.holds[w]]
            worker = min(holders or range(self.workers), key=self.filled.__getitem__)
            self._put(site, key, worker, 0)
        return worker


def placements(config: config_module.Config, requests: Sequence[Request],
               slack: float) -> Dict[str, Placement]:
    """The three placements of the module's docstring, by name."""
    warmup = int(config.warmup * len(requests))
    return {
        "classes": classes(requests, config.workers),
        "packed": Packing(requests, config.workers, config.cache_size, slack).place,
        "learned": Packing(requests[:warmup], config.workers, config.cache_size, slack).place,
    }


def report(config: config_module.Config, slack: float) -> List[str]:
    """The table for ``config``: each placement's loads and balance."""
    requests = draw(config)
    limit = bound.partition_misses(config)
    lines = ["scenario %s, seed %d: partition bound %s misses/request" % (
        config.name, config.seed, "-" if limit is None else "%.4f" % limit),
        "placement   miss/req  over bound  busiest/mean  (slack %.2f)" % slack]
    for name, place in placements(config, requests, slack).items():
        misses, busiest = route(config, requests, place)
        over = "-" if not limit else "%.2fx" % (misses / limit)
        lines.append("%-10s  %8.4f  %10s  %12.2f" % (name, misses, over, busiest))
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m simulations.oracle",
        description="Static placements planned with the whole run in view: how low "
                    "the loads of a router that keeps each key on one worker could go.")
    parser.add_argument("scenario", help="scenario file, or name in simulations/scenarios/")
    parser.add_argument("--slack", type=float, default=DEFAULT_SLACK,
                        help="packed and learned: a worker's requests at most this "
                             "times the mean (default %(default)s)")
    from .cli import add_parameters, configured

    add_parameters(parser)  # (``--seed``, ``--site-depth 2``, ...)
    args = vars(parser.parse_args(argv))
    slack = args.pop("slack")
    if not 1 <= slack < math.inf:  # (below 1 no worker could keep to it: all were over)
        parser.error("--slack must be a number >= 1, not %r" % (slack,))
    config = configured(args.pop("scenario"), args, "oracle")
    if config.cache_sizes or config.speeds or config.actions:
        parser.error("the oracle takes one cache size, one speed and no actions")
    print("\n".join(report(config, slack)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
