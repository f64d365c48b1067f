"""The worker server: runs a WSGI application for requests forwarded by LBs.

A worker listens; LBs connect and keep their connections open
(worker/lbs.py).  Each request arrives as an environ (strings only) or a
checked head, followed by body frames, and gets a greenlet of its own
(worker/greenlets.py), which builds a PEP 3333 environ around it
(worker/wsgi.py), runs the application (in the greenlet, or in a thread
pool with ``threads``) and streams the response back within the LB's
credit (worker/serving.py).  It never parses HTTP.

Skills: every request's class and the application's time go into the
worker's résumé, which goes to every LB on a schedule; all the worker's
live settings are the résumé's (worker/publisher.py).

``Worker`` composes those parts: it is the handler of every LB
connection, and owns the listening socket and the lifecycle.

Lifecycle: construct (nothing happens), ``start()`` binds, ``run()``
serves until ``stop()``, which tells every LB to send nothing new
(GoAway), waits for requests in flight, then closes.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, ClassVar, Dict, List, Mapping, Optional, Tuple

import gevent.event  # type: ignore[import-untyped]
import gevent.server  # type: ignore[import-untyped]
from mypy_extensions import mypyc_attr

from zc_lb.errors import ConfigurationError, ZcLbError
from zc_lb.settings import LATENCY_BUCKETS, WORKER_SETTINGS, check
from zc_lb.sockets import Listen, address_text, bound, listener
from zc_lb.wire.connection import Connection, Handler
from zc_lb.wire.exchange import Exchange
from zc_lb.wire.frames import WORKER_FEATURES
from zc_lb.worker import resume as resume_module
from zc_lb.worker.greenlets import Requests
from zc_lb.worker.lbs import LBConnections
from zc_lb.worker.publisher import ResumePublisher
from zc_lb.worker.serving import Serving

log = logging.getLogger(__name__)


def load_app(spec: str) -> Callable:
    """``module:callable`` or a PasteDeploy ``.ini`` file -> WSGI app
    (its ConfigurationErrors do not repeat ``spec``: ``load_object`` says
    which application)."""
    if spec.endswith(".ini") or spec.startswith("config:"):
        try:
            from paste.deploy import loadapp  # type: ignore[import-untyped, import-not-found]
        except ImportError:
            raise ConfigurationError("it needs PasteDeploy, which is not installed")
        path = spec[len("config:"):] if spec.startswith("config:") else spec
        if not os.path.exists(path):
            raise ConfigurationError("no such file: %s" % path)
        return loadapp("config:" + os.path.abspath(path))
    from zc_lb.routing.classifier import import_object
    app = import_object(spec)
    if not callable(app):
        raise ConfigurationError("it is not callable")
    return app  # type: ignore[return-value]


# -- the server -------------------------------------------------------------


@mypyc_attr(allow_interpreted_subclasses=True)  # (one of an older version, in tests)
class Worker(Handler):
    """A worker process's server: accepts LB connections, runs the app."""

    protocol_features: ClassVar[Tuple[str, ...]] = WORKER_FEATURES  # what we offer LBs beyond version 1

    def __init__(
        self,
        app: Callable,
        listen: Any = ("127.0.0.1", 0),  # a Listen, or a listening socket (-w N)
        history: int = resume_module.DEFAULT_HISTORY,
        max_skill_age: Optional[int] = None,
        max_classes: int = resume_module.MAX_CLASSES,
        resume_interval: float = WORKER_SETTINGS["resume_interval"].default,
        resume_file: Optional[str] = None,
        threads: Optional[int] = None,
        threads_fixed: bool = False,
        secret: Optional[bytes] = None,
        version: Optional[str] = None,
        concurrency: int = 0,
        tls: Any = None,
        sendfile: str = WORKER_SETTINGS["sendfile"].default,
        max_requests: int = 0,
    ) -> None:
        self.listen = listen
        self.lbs = LBConnections(self, self.protocol_features, secret, version, tls,
                                 check(WORKER_SETTINGS, "sendfile", sendfile))
        self.publisher = ResumePublisher(self.lbs, history, max_skill_age, max_classes,
                                         resume_interval, resume_file)
        # (--max-requests: served, then it drains and exits; 0: never)
        self.serving = Serving(app, self.publisher, threads, threads_fixed, concurrency,
                               max_requests)
        self.server: Optional[gevent.server.StreamServer] = None
        self.requests = Requests()
        self.stopping = False
        self._stopped = gevent.event.Event()

    @property
    def address(self) -> Listen:
        """The address actually bound (after start()): (host, port), or a
        Unix socket's path."""
        assert self.server is not None, "not started"
        return bound(self.server.address)

    def start(self) -> None:
        """Load the résumé file, bind, and start accepting LB connections."""
        self.publisher.start()
        self.server = gevent.server.StreamServer(listener(self.listen), self._accept)
        self.server.start()  # (accepting once this greenlet waits: serving is ready by then)
        self.serving.start(address_text(self.address))
        log.info("worker listening on %s", address_text(self.address))

    def run(self) -> None:
        """Serve until stop()."""
        self._stopped.wait()

    def drain(self, timeout: float = 30.0) -> bool:
        """Tell every LB to send nothing new, serve what they sent before
        they heard it, and wait until they hang up (an LB closes a
        draining connection once nothing is in flight on it) and the
        requests are done, at most ``timeout`` seconds; whether it got there."""
        deadline = time.monotonic() + timeout
        self.lbs.send_goaway("worker stopping")
        self.lbs.wait_gone(timeout)
        self.requests.join(timeout=max(deadline - time.monotonic(), 0))
        return not self.lbs.connections and not self.requests

    def stop(self, timeout: float = 30.0) -> None:
        """Stop listening, drain (at most ``timeout`` seconds), then close
        what is left, with every finished response sent whole."""
        if self.stopping:
            return
        self.stopping = True
        deadline = time.monotonic() + timeout
        if self.server is not None:
            self.server.close()
        self.drain(timeout)
        if self.requests:
            running = self.serving.running()
            log.warning("%d requests still in flight after the drain timeout (%g s) are cut "
                        "off%s", len(self.requests), timeout,
                        ": the application runs " + ", ".join(running) if running else "")
        self.lbs.close("worker stopped", deadline)
        self.serving.stop()
        self.publisher.stop()
        self._stopped.set()

    def configure(self, changes: Mapping[str, Any], source: str = "") -> None:
        """Apply live settings (``ResumePublisher.configure``: they are all
        the résumé's) from any source: the command line's file read again,
        ZooKeeper."""
        self.publisher.configure(changes, source)

    def settings(self) -> Dict[str, Any]:
        """The live settings' values now, by name."""
        return self.publisher.settings()

    def reset_skills(self, token: Optional[str] = None) -> None:
        """Forget every skill and tell the LBs (an operator's reset, by
        ZooKeeper's ``reset_skills`` value ``token``)."""
        self.publisher.reset(token)

    @property
    def reset_token(self) -> Optional[str]:
        """The ``reset_skills`` value the résumé file saw last (None: not known)."""
        return self.publisher.reset_token

    def seen_reset_token(self, token: str) -> None:
        """ZooKeeper's ``reset_skills`` value at start: kept in the résumé file."""
        self.publisher.seen_reset_token(token)

    # -- connections --------------------------------------------------

    def _accept(self, sock, address) -> None:
        """An LB connected: admitted (or refused), told our résumé at once,
        then heard until it goes."""
        connection = self.lbs.admit(sock, address)
        if connection is None:
            return
        if self.stopping:
            connection.close("worker stopping")
            return
        self.lbs.add(connection)
        self.publisher.greet(connection)
        connection.join()

    def connection_lost(self, connection: Connection, error: ZcLbError) -> None:
        self.lbs.lost(connection, error)

    def handle_keys(self, connection: Connection, keys: Dict[str, List[int]]) -> None:
        self.lbs.relay_keys(connection, keys)

    def handle_request(self, connection: Connection, exchange: Exchange) -> None:
        task = self.requests.spawn(self.serving.serve, exchange)
        exchange.on_cancel = lambda: self.requests.kill_one(task)

    def status(self) -> dict:
        """A JSON-able picture of this worker."""
        serving = self.serving
        return {
            "address": address_text(self.address) if self.server else None,
            "pid": os.getpid(),
            "lbs": sorted(c.peer for c in self.lbs.connections),
            "in_flight": len(self.requests),
            "served": serving.served,
            "failed": serving.failed,
            "app_seconds": round(serving.app_seconds, 6),
            "queued_seconds": round(serving.queued_seconds, 6),
            "latency": {"buckets": list(LATENCY_BUCKETS), "counts": list(serving.latency),
                        "sum": round(serving.app_seconds, 6)},
            "resume": self.publisher.resume(),
            "threads": serving.threadpool.status() if serving.threadpool else None,
        }

    def __repr__(self) -> str:
        where = address_text(self.address) if self.server else "unstarted"
        return "<Worker %s lbs=%d in_flight=%d>" % (
            where, len(self.lbs.connections), len(self.requests))
