"""A ZODB application behind a ZEO server, to measure balancers on the
case résumé-based balancing was made for.

Theory of operation
-------------------

The database holds one persistent page per path of a log, each holding
``parts`` persistent sub-objects of ``part_size`` bytes (a page's
template, its text, its images' metadata), under a BTree keyed by path
(``populate``).  A request opens a connection from the process's
``ZODB.DB``, reads the page at ``PATH_INFO`` and every part (``404`` for
a path the database does not hold), and closes the connection.

Each ZODB connection has an object cache of its own (``cache_size``
objects): a page read on one connection is not cached for the next
request that gets another.  ``DB.open`` hands out the connection closed
last, so a process that serves few requests at once reuses the same few
connections and their caches stay warm; one that lets 16 threads in at
once spreads the same pages over 16 caches, each loading them again.
Behind them the ZEO client cache (``zeo_cache_size`` bytes, small here)
and the ZEO server, which counts every load (``server_loads``).

A load is a round trip to the ZEO server; ``load_delay`` adds that many
seconds per load (``time.sleep``), for a database further away.  The
response says what happened, as ``playback.cacheapp`` does::

    X-Cache-Hits: 9      (the page's objects found in the connection's cache)
    X-Cache-Misses: 2    (loaded from the storage)
    X-Worker: host:pid   (or ZC_LB_ZODBAPP_WORKER_ID)

and with ``cache_signal`` tells a zc-lb worker whether anything was
loaded (``environ["zc_lb.cache"]``).

Host it with ``zc-lb worker playback.zodbapp:app`` or gunicorn
(``gunicorn -k gthread playback.zodbapp:app``); the module-level ``app``
is configured from the environment:

====================================  =======  ==========================
variable                              default  meaning
====================================  =======  ==========================
ZC_LB_ZODBAPP_ZEO                     (none)   HOST:PORT of the ZEO server
ZC_LB_ZODBAPP_CACHE_SIZE              400      objects per connection cache
ZC_LB_ZODBAPP_ZEO_CACHE_SIZE          65536    bytes of ZEO client cache
ZC_LB_ZODBAPP_POOL_SIZE               7        connections kept (ZODB's)
ZC_LB_ZODBAPP_LOAD_DELAY              0        seconds added per load
ZC_LB_ZODBAPP_CACHE_SIGNAL            0        1: tell a zc-lb worker
ZC_LB_ZODBAPP_WORKER_ID               host:pid name in X-Worker
====================================  =======  ==========================

The database is opened at the first request, in the process that serves
it (after a server's fork).  ZODB and ZEO come with the ``zodb`` extra.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, Iterable, Optional

import persistent

ENV_PREFIX = "ZC_LB_ZODBAPP_"
PARTS = 10  # sub-objects of a page
PART_SIZE = 2048  # bytes each


class Page(persistent.Persistent):
    """One path's page: its parts are separate persistent objects."""

    def __init__(self, path: str, parts: list) -> None:
        self.path = path
        self.parts = parts


class Part(persistent.Persistent):
    def __init__(self, data: bytes) -> None:
        self.data = data


def populate(filename: str, paths: Iterable[str], parts: int = PARTS,
             part_size: int = PART_SIZE) -> int:
    """Write a FileStorage at ``filename`` with a page per distinct path;
    the number of pages."""
    import transaction
    import ZODB
    import ZODB.FileStorage
    from BTrees.OOBTree import OOBTree

    db = ZODB.DB(ZODB.FileStorage.FileStorage(filename))
    try:
        with db.transaction() as conn:
            pages = conn.root.pages = OOBTree()
        count = 0
        batch = 0
        conn = db.open()
        pages = conn.root()["pages"]
        for path in dict.fromkeys(paths):
            fill = path.encode("utf-8", "surrogateescape")[:64].ljust(64, b".")
            pages[path] = Page(path, [Part((fill * (part_size // 64 + 1))[:part_size])
                                      for _ in range(parts)])
            count += 1
            batch += 1
            if batch == 1000:
                transaction.commit()
                batch = 0
        transaction.commit()
        conn.close()
        return count
    finally:
        db.close()


def make_app(zeo: str, cache_size: int = 400, zeo_cache_size: int = 65536,
             pool_size: int = 7, load_delay: float = 0.0, cache_signal: bool = False,
             worker_id: Optional[str] = None):
    """The WSGI app: each request reads one page and its parts."""
    host, _, port = zeo.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError("the ZEO server's address must be HOST:PORT, not %r" % zeo)
    address = (host, int(port))
    state: Dict[str, object] = {}
    opening = threading.Lock()
    hostname = socket.gethostname()

    def database():
        db = state.get("db")
        if db is None:
            with opening:
                db = state.get("db")
                if db is None:
                    import ZEO.ClientStorage
                    import ZODB

                    storage = ZEO.ClientStorage.ClientStorage(
                        address, cache_size=zeo_cache_size, read_only=True, wait_timeout=30)
                    db = state["db"] = ZODB.DB(storage, cache_size=cache_size,
                                               pool_size=pool_size)
        return db

    def app(environ, start_response):
        path = environ.get("PATH_INFO") or "/"
        conn = database().open()  # type: ignore[attr-defined]
        try:
            conn.getTransferCounts(True)  # (counts from here)
            page = conn.root()["pages"].get(path)
            if page is not None:
                size = sum(len(part.data) for part in page.parts)
            loads, _ = conn.getTransferCounts(True)
        finally:
            conn.close()
        if load_delay and loads:
            time.sleep(loads * load_delay)
        if cache_signal:
            environ["zc_lb.cache"] = "miss" if loads else "hit"
        if page is None:
            status, body = "404 Not Found", b"no such page\n"
        else:
            status, body = "200 OK", ("%s: %d bytes\n" % (path, size)).encode(
                "utf-8", "surrogateescape")
        start_response(status, [
            ("Content-Type", "text/plain"), ("Content-Length", str(len(body))),
            ("X-Cache-Hits", str(max(0, (1 + PARTS) - loads))),
            ("X-Cache-Misses", str(loads)),
            ("X-Worker", worker_id or "%s:%d" % (hostname, os.getpid()))])
        return [] if environ.get("REQUEST_METHOD") == "HEAD" else [body]

    return app


def app_from_environment(environ=os.environ):
    """make_app() configured from ZC_LB_ZODBAPP_* variables."""

    def get(name, convert, default):
        value = environ.get(ENV_PREFIX + name)
        return convert(value) if value not in (None, "") else default

    zeo = get("ZEO", str, None)
    if zeo is None:
        raise ValueError("set %sZEO to the ZEO server's HOST:PORT" % ENV_PREFIX)
    return make_app(
        zeo, cache_size=get("CACHE_SIZE", int, 400),
        zeo_cache_size=get("ZEO_CACHE_SIZE", int, 65536),
        pool_size=get("POOL_SIZE", int, 7),
        load_delay=get("LOAD_DELAY", float, 0.0),
        cache_signal=get("CACHE_SIGNAL", lambda v: v.lower() in ("1", "true", "yes"), False),
        worker_id=get("WORKER_ID", str, None))


class _LazyApp:
    """The module-level ``app``: configured at its first call, so that
    importing this module needs no ZEO server."""

    def __init__(self) -> None:
        self._app = None

    def __call__(self, environ, start_response):
        if self._app is None:
            self._app = app_from_environment()
        return self._app(environ, start_response)


app = _LazyApp()


# -- the ZEO server, for a tool that runs one ------------------------------


def start_server(filename: str, address: str, log) -> subprocess.Popen:
    """``runzeo`` serving ``filename`` on ``address`` (HOST:PORT), its
    output to the file ``log``."""
    return subprocess.Popen([sys.executable, "-m", "ZEO.runzeo", "-a", address,
                             "-f", filename], stdout=log, stderr=log)


def server_loads(address: str, timeout: float = 30.0) -> int:
    """The loads the ZEO server at ``address`` has served so far (its
    ``server_status``), asked from a separate process: ZEO's client runs
    an asyncio loop in a thread, which a gevent-patched caller would
    turn into a greenlet."""
    code = ("import sys, ZEO.ClientStorage as C; host, _, port = sys.argv[1].rpartition(':'); "
            "s = C.ClientStorage((host, int(port)), read_only=True, wait_timeout=%r); "
            "print(s.server_status()['loads']); s.close()" % timeout)
    out = subprocess.run([sys.executable, "-c", code, address], capture_output=True,
                         text=True, timeout=timeout + 10)
    if out.returncode != 0:
        raise RuntimeError("cannot read the ZEO server's loads at %s: %s"
                           % (address, out.stderr.strip()[-500:]))
    return int(out.stdout.split()[-1])
