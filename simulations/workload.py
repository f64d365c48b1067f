"""The workload: which site (request class) each request is for, and
which objects it touches.

Theory of operation
-------------------

There are ``sites`` sites, ranked by popularity: Zipf (weight of rank i is
``1 / i**s``) or exponential (``exp(-i / scale)``).  Each site owns
``objects_per_site`` objects, numbered ``site * objects_per_site + j`` so
that sites share nothing, and a request touches ``objects_per_request`` of
its site's objects, drawn (with repetition) from a Zipf distribution of
exponent ``object_zipf`` (0: uniform).

Two changes can be made while running: a site made *hot* (it then gets a
fixed share of all requests), and a changed *classifier* (the class label
of each site changes, as when an operator switches from classifying by
host to classifying by path).

All draws come from one ``random.Random``, in request order, so every
policy sees the same sequence of requests.
"""

from __future__ import annotations

import itertools
import math
import random
from typing import List, Tuple

from .config import Config


def weights(kind: str, n: int, param: float) -> List[float]:
    """Popularity weights of ranks 0..n-1."""
    if kind == "zipf":
        return [1.0 / (i + 1) ** param for i in range(n)]
    return [math.exp(-i / param) for i in range(n)]


def cumulative(ws: List[float]) -> List[float]:
    """Cumulative weights, for ``random.choices(cum_weights=...)``."""
    return list(itertools.accumulate(ws))


class Workload:
    """A stream of requests: ``next() -> (site, class label, objects)``."""

    def __init__(self, config: Config, rng: random.Random) -> None:
        self.rng = rng
        self.per_site = config.objects_per_site
        self.per_request = config.objects_per_request
        self.site_ids = range(config.sites)
        self.site_cw = cumulative(
            weights(config.popularity, config.sites, config.popularity_param))
        self.object_ids = range(config.objects_per_site)
        self.object_cw = cumulative(
            weights("zipf", config.objects_per_site, config.object_zipf))
        self.labels = ["s%d" % site for site in self.site_ids]
        self.hot_site = -1
        self.hot_fraction = 0.0

    @property
    def total_objects(self) -> int:
        """How many distinct objects exist."""
        return len(self.site_ids) * self.per_site

    def next(self) -> Tuple[int, str, List[int]]:
        """Draw the next request."""
        rng = self.rng
        if self.hot_fraction and rng.random() < self.hot_fraction:
            site = self.hot_site
        else:
            site = rng.choices(self.site_ids, cum_weights=self.site_cw)[0]
        base = site * self.per_site
        objects = rng.choices(self.object_ids, cum_weights=self.object_cw,
                              k=self.per_request)
        return site, self.labels[site], [base + o for o in objects]

    def make_hot(self, site: int, fraction: float) -> None:
        """From now on ``site`` gets ``fraction`` of all requests."""
        if site not in self.site_ids or not 0 <= fraction <= 1:
            raise ValueError("hot site %r (of %d) with fraction %r"
                             % (site, len(self.site_ids), fraction))
        self.hot_site = site
        self.hot_fraction = fraction

    def change_classifier(self, mode: str = "rename") -> None:
        """Change every site's class label.

        ``rename``: every class is new to the pool (skills useless but
        harmless).  ``permute``: the old labels are reused for other sites
        (skills point at workers whose caches hold the wrong data).
        """
        if mode == "rename":
            self.labels = ["t%d" % site for site in self.site_ids]
        elif mode == "permute":
            order = list(self.site_ids)
            random.Random(len(order)).shuffle(order)
            self.labels = ["s%d" % order[site] for site in self.site_ids]
        else:
            raise ValueError("unknown classifier change %r" % (mode,))
