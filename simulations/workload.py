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

Pages (``pages_per_site`` > 0): a request is also for one of its site's
pages, drawn from a Zipf distribution of exponent ``page_zipf``; the page
owns ``page_objects`` objects of its own, which the request touches too,
and the page is the request's affinity *key* (as a path is for a host).
Without pages a request has no key.  With ``fixed_draws`` a page's
requests touch the same shared objects every time (drawn once per page,
without repetition, from a generator seeded by the run's seed and the
page), as playback's cache app draws them from a hash of the URL: a site
whose requests are for a few pages then touches only a few of its shared
objects.

A log (``log``, an access log in any format playback reads): the
requests are the log's, in order (again from the start when it runs
out); the site is the path's first segment (with ``site_depth`` D, the
section D directories deep: the first segment and the directories after
it, as playback's ``--host-depth``), the page its path without the
query.  This is the workload of playback's comparisons, on virtual time.

All draws come from one ``random.Random``, in request order, so every
policy sees the same sequence of requests.
"""

from __future__ import annotations

import importlib
import itertools
import math
import os
import random
from typing import List, Optional, Tuple

from zc_lb.errors import ConfigurationError

from .config import Config


def weights(kind: str, n: int, param: float) -> List[float]:
    """Popularity weights of ranks 0..n-1."""
    if kind == "zipf":
        return [1.0 / (i + 1) ** param for i in range(n)]
    return [math.exp(-i / param) for i in range(n)]


def cumulative(ws: List[float]) -> List[float]:
    """Cumulative weights, for ``random.choices(cum_weights=...)``."""
    return list(itertools.accumulate(ws))


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read_log(path: str, depth: int = 1) -> Tuple[List[Tuple[int, int]], int, int]:
    """A log's requests as (site, page) pairs; how many sites and pages.
    The site is the page's first segment, and with a ``depth`` over 1 the
    directories after it to that depth.  A relative path not found here
    is taken from the repository's root (scenario files name
    ``playback/logs/...``)."""
    # only log workloads need it: playback, beside this package (zc_lb.playback
    # installed, playback in a checkout)
    parent = (__package__ or "").rpartition(".")[0]
    logparse = importlib.import_module((parent + "." if parent else "") + "playback.logparse")

    if not os.path.exists(path) and os.path.exists(os.path.join(ROOT, path)):
        path = os.path.join(ROOT, path)
    entries, _ = logparse.read_entries([path])
    sites: dict = {}
    pages: dict = {}
    requests = []
    for entry in entries:
        page = entry.path.partition("?")[0]
        site = logparse.section(page.lstrip("/").split("/"), 0, depth)
        requests.append((sites.setdefault(site, len(sites)),
                         pages.setdefault(page, len(pages))))
    if not requests:  # (an empty log, one of garbage or of POSTs only)
        raise ConfigurationError("%s: no request to replay in it" % path)
    return requests, len(sites), len(pages)


class Workload:
    """A stream of requests: ``next() -> (site, class label, objects, key)``."""

    def __init__(self, config: Config, rng: random.Random) -> None:
        self.rng = rng
        self.per_site = config.objects_per_site
        self.per_request = config.objects_per_request
        self.page_objects = config.page_objects
        self.log: List[Tuple[int, int]] = []
        self.position = 0
        sites, self.pages_per_site = config.sites, config.pages_per_site
        self.pages = sites * self.pages_per_site
        if config.log:
            self.log, sites, self.pages = read_log(config.log, config.site_depth)
        self.site_ids = range(sites)
        self.site_cw = cumulative(
            weights(config.popularity, sites, config.popularity_param))
        self.object_ids = range(config.objects_per_site)
        self.object_cw = cumulative(
            weights("zipf", config.objects_per_site, config.object_zipf))
        self.page_ids = range(self.pages_per_site)
        self.page_cw = cumulative(
            weights("zipf", self.pages_per_site, config.page_zipf))
        self.fixed_draws = config.fixed_draws
        self.seed = config.seed
        self.drawn: dict = {}  # page -> its shared objects, with fixed_draws
        self.labels = ["s%d" % site for site in self.site_ids]
        self.hot_site = -1
        self.hot_fraction = 0.0

    @property
    def total_objects(self) -> int:
        """How many distinct objects exist."""
        return len(self.site_ids) * self.per_site + self.pages * self.page_objects

    def next(self) -> Tuple[int, str, List[int], Optional[str]]:
        """Draw the next request."""
        site, page = self._site_and_page()
        base = site * self.per_site
        if self.fixed_draws and page >= 0:
            objects = [base + o for o in self._page_draws(page)]
        else:
            objects = [base + o for o in self.rng.choices(
                self.object_ids, cum_weights=self.object_cw, k=self.per_request)]
        if page < 0:
            return site, self.labels[site], objects, None
        first = len(self.site_ids) * self.per_site + page * self.page_objects
        objects.extend(range(first, first + self.page_objects))
        return site, self.labels[site], objects, "p%d" % page

    def _page_draws(self, page: int) -> List[int]:
        """The shared objects (numbers within the site) every request for
        ``page`` touches: distinct, by the objects' popularity."""
        drawn = self.drawn.get(page)
        if drawn is None:
            rng = random.Random(self.seed * 1_000_003 + page)
            count = min(self.per_request, self.per_site)
            chosen: dict = {}
            while len(chosen) < count:
                chosen[rng.choices(self.object_ids, cum_weights=self.object_cw)[0]] = None
            drawn = self.drawn[page] = list(chosen)
        return drawn

    def _site_and_page(self) -> Tuple[int, int]:
        """The next request's site and global page number (-1: no pages)."""
        if self.log:
            request = self.log[self.position % len(self.log)]
            self.position += 1
            return request
        rng = self.rng
        if self.hot_fraction and rng.random() < self.hot_fraction:
            site = self.hot_site
        else:
            site = rng.choices(self.site_ids, cum_weights=self.site_cw)[0]
        if not self.pages_per_site:
            return site, -1
        page = rng.choices(self.page_ids, cum_weights=self.page_cw)[0]
        return site, site * self.pages_per_site + page

    def make_hot(self, site: int, fraction: float) -> None:
        """From now on ``site`` gets ``fraction`` of all requests."""
        if self.log:
            raise ValueError("a log workload cannot make a site hot")
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
