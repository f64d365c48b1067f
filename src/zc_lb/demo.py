"""The bundled demo application: shows what résumé-based routing does.

Each worker process keeps a small LRU cache of "site data", one entry per
request class (the Host, by default).  A request whose site is cached is a
hit; otherwise the worker "loads" it (sleeps ``miss_cost`` seconds, like a
database load) and may evict another site.  Every response says which
worker served it and whether it hit, so a person can watch the LB send
each host to the workers that already hold its data.
"""

from __future__ import annotations

import collections
import json
import os

import gevent
from zc_lb.environ import REQUEST_CLASS, WORKER

CACHE_SITES = 3
MISS_COST = 0.02


class DemoApp:
    """A WSGI app with a per-process LRU cache of sites."""

    def __init__(self, cache_sites: int = CACHE_SITES, miss_cost: float = MISS_COST) -> None:
        self.cache_sites = cache_sites
        self.miss_cost = miss_cost
        self.cache: "collections.OrderedDict[str, int]" = collections.OrderedDict()
        self.hits = 0
        self.misses = 0

    def __call__(self, environ, start_response):
        site = environ.get(REQUEST_CLASS) or environ.get("HTTP_HOST", "")
        hit = site in self.cache
        if hit:
            self.cache.move_to_end(site)
            self.hits += 1
        else:
            gevent.sleep(self.miss_cost)
            self.cache[site] = 1
            while len(self.cache) > self.cache_sites:
                self.cache.popitem(last=False)
            self.misses += 1
        worker = environ.get(WORKER, "pid %d" % os.getpid())
        if environ.get("PATH_INFO") == "/stats":
            body = json.dumps({"worker": worker, "hits": self.hits, "misses": self.misses,
                               "cached": list(self.cache)}).encode() + b"\n"
            ctype = "application/json"
        else:
            body = ("%s served %r for site %r: %s (cached sites: %s)\n" % (
                worker, environ.get("PATH_INFO"), site, "cache hit" if hit else "cache miss",
                ", ".join(self.cache))).encode()
            ctype = "text/plain; charset=utf-8"
        start_response("200 OK", [("Content-Type", ctype), ("Content-Length", str(len(body))),
                                  ("X-Worker", worker), ("X-Cache", "hit" if hit else "miss")])
        return [body]


app = DemoApp()


def app_factory(global_config, **local_config):
    """PasteDeploy entry point: ``use = egg:zc-lb#demo``."""
    return DemoApp(int(local_config.get("cache_sites", CACHE_SITES)),
                   float(local_config.get("miss_cost", MISS_COST)))
