"""A WSGI application that models a working set, to measure balancers.

Theory of operation
-------------------

Each process (worker) holds an LRU cache of at most ``cache_size``
objects. A request belongs to a *class*: ``environ['zc_lb.request_class']``
when a zc-lb worker hosts the app, else the Host header (lower-cased,
without ``www.`` and port, as zc-lb's ``host`` classifier). Each class owns
``objects_per_class`` objects, named ``CLASS#N``, so classes never share
objects. A request touches ``objects_per_request`` of its class's objects,
chosen by a random generator seeded with a hash of (class, path and
query): the same URL always touches the same objects.  ``page_key``
"path" names a page by its path alone, the query ignored, as the ZODB
app (``playback.zodbapp``), the simulator and zc-lb's default affinity
key do: ``/search?q=a`` and ``/search?q=b`` are then one page, where by
default ("url") each query is a page of its own, loaded once.  ``skew``
> 0 draws low object numbers more often (``N = int(objects_per_class *
u ** (1 + skew))``), as when pages of a site share templates; 0 draws
uniformly.

A hit costs ``hit_cost`` seconds, a miss ``miss_cost`` (a database load),
both spent in ``gevent.sleep``.  ``concurrency`` (0: unbounded) is how
many requests a process serves at once; the rest wait their turn, as
requests wait for one of a Python worker's threads or database
connections, or for the GIL when a load is CPU (unpickling).

``cache_signal`` makes it tell a zc-lb worker whether its cache had
what the request needed: ``environ["zc_lb.cache"]`` is "hit" when the
request loaded nothing, else "miss".

``blocking`` makes it an ordinary threaded application, as a user
deploys behind ``zc-lb worker`` (thread mode, the default): the costs
are spent in ``time.sleep`` and the ``concurrency`` bound is a
``threading`` semaphore that the request threads queue on, as they
would on an application's lock (1) or on a pool of N database
connections.  The server's threads then wait *inside* the application,
where the server cannot tell the wait from work.  With 1 a
process's loads are its own time, so fewer misses mean more throughput;
unbounded, a load costs only latency.  The response says what happened in its headers::

    X-Cache-Hits: 7
    X-Cache-Misses: 3
    X-Worker: host:pid (or ZC_LB_CACHEAPP_WORKER_ID)
    X-Request-Class: example.com

``/_cacheapp/stats`` answers JSON: worker, requests, hits, misses and the
cached object ids; ``/_cacheapp/reset`` empties the cache and counters.
Neither counts as a request. ``overlap()`` turns the stats of all workers
into the share of cached objects held by more than one worker.

Behind a balancer a stats URL reaches whichever worker the balancer
picks, and a zc-lb worker does not speak HTTP at all. So each process can
also serve just those two URLs on a side port of its own:
``ZC_LB_CACHEAPP_STATS_LISTEN=127.0.0.1:9201`` (one address per worker
process) starts that server when the module-level ``app`` is built, and
``http://127.0.0.1:9201/_cacheapp/stats`` is then that worker's stats URL.

Host it with ``zc-lb worker playback.cacheapp:app`` or
``python -m playback.cacheapp --listen 127.0.0.1:9001``. The module-level
``app`` is configured from the environment:

====================================  =======  ==========================
variable                              default  meaning
====================================  =======  ==========================
ZC_LB_CACHEAPP_CACHE_SIZE             1000     objects cached per process
ZC_LB_CACHEAPP_MISS_COST              0.002    seconds per miss
ZC_LB_CACHEAPP_HIT_COST               0        seconds per hit
ZC_LB_CACHEAPP_OBJECTS_PER_REQUEST    10       objects a request touches
ZC_LB_CACHEAPP_OBJECTS_PER_CLASS      1000     objects in a class's space
ZC_LB_CACHEAPP_SKEW                   0        0: uniform, >0: skewed
ZC_LB_CACHEAPP_PAGE_OBJECTS           0        objects of the URL's own, touched too
ZC_LB_CACHEAPP_PAGE_KEY               url      url: a query is a page; path: not
ZC_LB_CACHEAPP_CONCURRENCY            0        requests served at once (0: no bound)
ZC_LB_CACHEAPP_BLOCKING               0        1: time.sleep and threading locks
ZC_LB_CACHEAPP_CACHE_SIGNAL           0        1: tell a zc-lb worker hit or miss
ZC_LB_CACHEAPP_WORKER_ID              host:pid name in X-Worker and stats
ZC_LB_CACHEAPP_STATS_LISTEN           (none)   HOST:PORT of a side stats server
====================================  =======  ==========================
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import random
import socket
from typing import Dict, Iterable, List, Optional

STATS_PATH = "/_cacheapp/stats"
RESET_PATH = "/_cacheapp/reset"
ENV_PREFIX = "ZC_LB_CACHEAPP_"


def request_class(environ: dict) -> str:
    """The class: zc-lb's, else the Host header without www. and port."""
    cls = environ.get("zc_lb.request_class")
    if cls is not None:
        return str(cls)
    host = str(environ.get("HTTP_HOST") or environ.get("SERVER_NAME") or "").lower()
    if host.startswith("["):
        host = host[: host.find("]") + 1] if "]" in host else host
    else:
        host = host.partition(":")[0]
    return host[4:] if host.startswith("www.") else host


PAGE_KEYS = ("url", "path")


def page_name(url: str, page_key: str = "url") -> str:
    """What names the page of ``url`` (a path, with any query): the URL
    itself, or with ``page_key`` "path" its path alone."""
    return url.partition("?")[0] if page_key == "path" else url


def objects_for(cls: str, url: str, count: int, per_class: int, skew: float = 0.0) -> List[str]:
    """The ids of the objects a request for ``url`` of class ``cls`` touches."""
    count = min(count, per_class)
    seed = int.from_bytes(hashlib.blake2b(("%s\0%s" % (cls, url)).encode("utf-8", "surrogateescape"),
                                          digest_size=8).digest(), "big")
    rng = random.Random(seed)
    if skew <= 0:
        numbers = rng.sample(range(per_class), count)
    else:
        chosen: Dict[int, None] = {}
        for _ in range(count * 8):
            chosen[int(per_class * rng.random() ** (1.0 + skew))] = None
            if len(chosen) == count:
                break
        numbers = list(chosen)
    return ["%s#%d" % (cls, n) for n in numbers]


class CacheModel:
    """One process's LRU cache and counters; no I/O, no time."""

    def __init__(self, cache_size: int):
        self.cache_size = cache_size
        self.cache: "collections.OrderedDict[str, None]" = collections.OrderedDict()
        self.requests = self.hits = self.misses = 0

    def __repr__(self) -> str:
        return "<CacheModel %d/%d cached, %d hits, %d misses>" % (
            len(self.cache), self.cache_size, self.hits, self.misses)

    def touch(self, ids: Iterable[str]) -> tuple:
        """Look the objects up, loading the missing ones: (hits, misses)."""
        cache = self.cache
        hits = misses = 0
        for oid in ids:
            if oid in cache:
                cache.move_to_end(oid)
                hits += 1
            else:
                cache[oid] = None
                misses += 1
                if len(cache) > self.cache_size:
                    cache.popitem(last=False)
        self.requests += 1
        self.hits += hits
        self.misses += misses
        return hits, misses

    def reset(self) -> None:
        self.cache.clear()
        self.requests = self.hits = self.misses = 0


def make_app(cache_size: int = 1000, miss_cost: float = 0.002, objects_per_request: int = 10,
             objects_per_class: int = 1000, hit_cost: float = 0.0, skew: float = 0.0,
             worker_id: Optional[str] = None, page_objects: int = 0, concurrency: int = 0,
             blocking: bool = False, cache_signal: bool = False, page_key: str = "url"):
    """A WSGI app with its own cache (one per process that calls this);
    ``blocking``: an ordinary threaded app (time.sleep, threading locks)."""
    if concurrency < 0:
        raise ValueError("concurrency must be 0 (no bound) or more, not %r" % concurrency)
    if page_key not in PAGE_KEYS:
        raise ValueError("page_key must be one of %s, not %r" % (", ".join(PAGE_KEYS), page_key))
    model = CacheModel(cache_size)
    if blocking:
        import threading
        import time

        sleep = time.sleep
        slots = threading.BoundedSemaphore(concurrency) if concurrency else None
        guard = threading.Lock()  # the LRU, shared by the threads (held for microseconds)
    else:
        import gevent
        import gevent.lock

        sleep = gevent.sleep
        slots = gevent.lock.Semaphore(concurrency) if concurrency else None
        guard = None
    hostname = socket.gethostname()

    def worker_name() -> str:  # computed late: the process may fork after make_app
        return worker_id or "%s:%d" % (hostname, os.getpid())

    def stats() -> dict:
        return {
            "worker": worker_name(), "pid": os.getpid(), "requests": model.requests,
            "hits": model.hits, "misses": model.misses, "cache_size": cache_size,
            "objects": list(model.cache),
        }

    def serve(ids: List[str]) -> tuple:
        if guard is None:
            hits, misses = model.touch(ids)
        else:
            with guard:
                hits, misses = model.touch(ids)
        cost = hits * hit_cost + misses * miss_cost
        if cost > 0:
            sleep(cost)
        return hits, misses

    def app(environ, start_response):
        path = environ.get("PATH_INFO") or "/"
        if path == STATS_PATH:
            return _respond(start_response, environ, json.dumps(stats()).encode(), "application/json")
        if path == RESET_PATH:
            model.reset()
            return _respond(start_response, environ, b"reset\n")
        cls = request_class(environ)
        query = environ.get("QUERY_STRING")
        url = path + "?" + query if query else path
        page = page_name(url, page_key)
        ids = objects_for(cls, page, objects_per_request, objects_per_class, skew)
        ids.extend("%s|%s|%d" % (cls, page, n) for n in range(page_objects))
        if slots is None:
            hits, misses = serve(ids)
        else:
            with slots:
                hits, misses = serve(ids)
        if cache_signal:
            environ["zc_lb.cache"] = "miss" if misses else "hit"
        body = ("%s %s: %d hits, %d misses\n" % (cls, url, hits, misses)).encode("utf-8", "replace")
        return _respond(start_response, environ, body, extra=[
            ("X-Cache-Hits", str(hits)), ("X-Cache-Misses", str(misses)),
            ("X-Worker", worker_name()), ("X-Request-Class", cls.encode("latin-1", "replace").decode("latin-1")),
        ])

    app.model = model  # type: ignore[attr-defined]
    app.stats = stats  # type: ignore[attr-defined]
    return app


def _respond(start_response, environ, body: bytes, content_type: str = "text/plain", extra=()):
    headers = [("Content-Type", content_type), ("Content-Length", str(len(body)))]
    headers.extend(extra)
    start_response("200 OK", headers)
    return [] if environ.get("REQUEST_METHOD") == "HEAD" else [body]


def overlap(stats: Iterable[dict]) -> dict:
    """Working-set overlap between workers, from their stats documents.

    ``overlap`` is the share of distinct cached objects held by more than
    one worker (0: disjoint caches, 1: every object everywhere);
    ``duplication`` is cached copies per distinct object.
    """
    holders: collections.Counter = collections.Counter()
    workers = 0
    copies = 0
    for doc in stats:
        objects = set(doc.get("objects", ()))
        holders.update(objects)
        copies += len(objects)
        workers += 1
    distinct = len(holders)
    shared = sum(1 for n in holders.values() if n > 1)
    return {
        "workers": workers,
        "cached": copies,
        "distinct": distinct,
        "shared": shared,
        "overlap": shared / distinct if distinct else 0.0,
        "duplication": copies / distinct if distinct else 0.0,
    }


def stats_only(app):
    """A WSGI app answering only the stats and reset URLs of a cacheapp."""

    def stats_app(environ, start_response):
        if environ.get("PATH_INFO") in (STATS_PATH, RESET_PATH):
            return app(environ, start_response)
        start_response("404 Not Found", [("Content-Type", "text/plain"), ("Content-Length", "10")])
        return [b"not found\n"]

    return stats_app


def start_stats_server(app, listen: str):
    """Serve the stats and reset URLs of ``app`` on ``listen`` (HOST:PORT); the server."""
    from gevent.pywsgi import WSGIServer

    host, _, port = listen.rpartition(":")
    server = WSGIServer((host or "127.0.0.1", int(port)), stats_only(app), log=None)
    server.start()
    return server


def _yes(value: str) -> bool:
    return value.lower() in ("1", "true", "yes")


def app_from_environment(environ=os.environ):
    """make_app() configured from ZC_LB_CACHEAPP_* variables (and its stats server)."""

    def get(name, convert, default):
        value = environ.get(ENV_PREFIX + name)
        return convert(value) if value not in (None, "") else default

    wsgi = make_app(
        cache_size=get("CACHE_SIZE", int, 1000),
        miss_cost=get("MISS_COST", float, 0.002),
        hit_cost=get("HIT_COST", float, 0.0),
        objects_per_request=get("OBJECTS_PER_REQUEST", int, 10),
        objects_per_class=get("OBJECTS_PER_CLASS", int, 1000),
        skew=get("SKEW", float, 0.0),
        worker_id=get("WORKER_ID", str, None),
        page_objects=get("PAGE_OBJECTS", int, 0),
        concurrency=get("CONCURRENCY", int, 0),
        blocking=get("BLOCKING", _yes, False),
        cache_signal=get("CACHE_SIGNAL", _yes, False),
        page_key=get("PAGE_KEY", str, "url"),
    )
    listen = get("STATS_LISTEN", str, None)
    if listen:
        wsgi.stats_server = start_stats_server(wsgi, listen)
    return wsgi


# Built on import, as hosts expect; not when run as a script, which builds its own.
app = app_from_environment() if __name__ != "__main__" else None


def main(argv=None) -> None:
    """Serve the app with gevent.pywsgi: ``python -m playback.cacheapp --listen H:P``."""
    import argparse

    from gevent.pywsgi import WSGIServer

    parser = argparse.ArgumentParser(description="Serve the cache-model WSGI app.")
    parser.add_argument("--listen", default="127.0.0.1:9001", help="HOST:PORT (default %(default)s)")
    parser.add_argument("--cache-size", type=int, default=1000)
    parser.add_argument("--miss-cost", type=float, default=0.002)
    parser.add_argument("--hit-cost", type=float, default=0.0)
    parser.add_argument("--objects-per-request", type=int, default=10)
    parser.add_argument("--objects-per-class", type=int, default=1000)
    parser.add_argument("--skew", type=float, default=0.0)
    parser.add_argument("--page-objects", type=int, default=0)
    parser.add_argument("--page-key", choices=PAGE_KEYS, default="url",
                        help="what names a page: its URL (default) or its path alone")
    parser.add_argument("--concurrency", type=int, default=0,
                        help="requests served at once (default 0: no bound)")
    parser.add_argument("--worker-id")
    parser.add_argument("--stats-listen", metavar="HOST:PORT", help="also serve stats on this side port")
    args = parser.parse_args(argv)
    host, _, port = args.listen.rpartition(":")
    wsgi = make_app(args.cache_size, args.miss_cost, args.objects_per_request,
                    args.objects_per_class, args.hit_cost, args.skew, args.worker_id,
                    args.page_objects, args.concurrency, page_key=args.page_key)
    if args.stats_listen:
        wsgi.stats_server = start_stats_server(wsgi, args.stats_listen)
    server = WSGIServer((host or "127.0.0.1", int(port)), wsgi, log=None)
    server.init_socket()
    server.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    print("cacheapp %s on http://%s:%s/" % (wsgi.stats()["worker"], host, port), flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
