"""The LB: the application that forwards requests to workers.

``LB`` holds the pool and its ``Fleet`` (lb/fleet.py): one ``WorkerLink``
per known worker address, each keeping a connection open and telling
the pool when its worker comes, sends a résumé, drains or goes.  The
pool's handles are the live ``Connection`` objects, so a reconnected
worker is a new handle and a stale one can never be chosen.

``LB.forward`` is what the HTTP front server runs for each request
(the LB is its ``Forwarder``, front/forwarder.py; as a plain WSGI
application, ``LB.__call__`` does the same): classify, get a worker
from the pool (waiting up to ``no_worker_timeout``), forward the head
and body, answer through the front's ``Responder``, and ``put`` the
worker when the response ends.

Failure semantics (docs/design.rst, "Failure semantics"): a worker lost
before the response starts means a transparent retry for a GET or HEAD
without a body, and 502 otherwise; lost mid-body, the iterator raises and the front server closes
the client's connection, so a truncated body never looks complete (either
way the loss counts toward the worker's ejection); no
worker in time gives 503.  All errors become responses in ``_error``.
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import (Any, Callable, ClassVar, Dict, Hashable, Iterable, Mapping, Optional,
                    Tuple, cast)

import gevent  # type: ignore[import-untyped]

from zc_lb import build
from zc_lb.routing.classifier import as_text, bounded_class
from zc_lb.wire.connection import Connection
from zc_lb.wire.exchange import Exchange
from zc_lb.wire.keepalive import KEEPALIVE_INTERVAL
from zc_lb.lb.fleet import Fleet
from zc_lb.lb.links import LinkConfig
from zc_lb.errors import (
    BadResponse,
    ClientError,
    ClientGone,
    ConnectionClosed,
    ConnectionLost,
    NoWorkerAvailable,
    RequestTooLarge,
    ResponseTimeout,
    WorkerSilent,
    ZcLbError,
)
from zc_lb.front.h1 import BODILESS_STATUS, HOP_BY_HOP_KEYS
from zc_lb.front.forwarder import Responder
from zc_lb.front.pages import ErrorPages, status_line
from zc_lb.lb.outlier import Ejector
from zc_lb.routing.pool import Pool
from zc_lb.routing.policies import POOL_SETTINGS, policy_name, takers
from zc_lb.wire.decoder import head_fields
from zc_lb.wire.frames import Response
from zc_lb.lb.relay import Relay
from zc_lb.settings import LB_SETTINGS, check, log_change, shown
from zc_lb.routing.siblings import SYNC_INTERVAL, Siblings, sync
from zc_lb.lb.awaiting import Awaiting
from zc_lb.lb.bodies import (InFlight, ResponseBody, Upload, body_in_hand, drop_held_body,
                             request_path, send_body)
from zc_lb.lb.spool import SpoolLimits
from zc_lb.lb.stats import Counters
from zc_lb.environ import (CLASS, COUNTED_CLASS, ERROR, FORWARD, RELAY,
                           REQUEST_CLASS, RETRIES, RETRY_REFUSED, UPSTREAM_TIME,
                           WORKER)

log = logging.getLogger(__name__)

RETRY_METHODS = frozenset(("GET", "HEAD"))
RETRY_ROOM = 3  # a healthy worker has room for at least this many retries
DRAIN_QUIET = 0.5  # seconds without requests in flight that end a drain
NO_WORKER_GRACE = 5.0  # seconds after the start before an empty pool is said

class LB:
    """The load balancer: worker links, the pool, and the forwarding app."""

    # The live settings the LB holds itself, as a policy's ``SETTINGS`` are
    # the pool's (the settings table says which are live: settings.LIVE).
    SETTINGS: ClassVar[Tuple[str, ...]] = ("no_worker_timeout",)

    def __init__(
        self,
        pool: Pool,
        classifier: Callable[[dict], object],
        no_worker_timeout: float = LB_SETTINGS["no_worker_timeout"].default,
        secret: Optional[bytes] = None,
        pages: Optional[Dict[int, bytes]] = None,
        max_request_body: Optional[int] = None,
        keepalive_interval: float = KEEPALIVE_INTERVAL,
        keepalive_timeout: float = LB_SETTINGS["keepalive_timeout"].default,
        response_timeout: Optional[float] = LB_SETTINGS["response_timeout"].default,
        drain_timeout: float = LB_SETTINGS["drain_timeout"].default,
        affinity_key: Optional[Callable[[dict], object]] = None,
        outlier: Optional[Dict[str, Any]] = None,
        max_retries: int = LB_SETTINGS["max_retries"].default,
        spool_limits: Optional[SpoolLimits] = None,
    ) -> None:
        self.pool = pool
        self.siblings: Optional[Siblings] = None  # the other processes of --processes
        self._next_sync = 0.0  # when to exchange requests in flight with them next
        self.affinity_key = affinity_key
        self.classifier = classifier
        self.no_worker_timeout = no_worker_timeout
        self.max_request_body = max_request_body
        self.pages = ErrorPages(pages)  # (the front's refusals take the same: front/pages.py)
        self.flight = InFlight(pool, spool_limits or SpoolLimits())
        self.max_retries = max_retries
        self.counters = Counters()
        self.awaiting = Awaiting(response_timeout, self._tick, self.flight)
        self._no_worker_watch: Optional[gevent.Greenlet] = None
        link_config = LinkConfig(secret, keepalive_interval, keepalive_timeout, drain_timeout)
        self.fleet = Fleet(pool, link_config, Ejector(**(outlier or {})),
                           self.counters.worker_added, self.counters.worker_removed,
                           self.awaiting.fail_silent, self.awaiting.start)
        # Settings of other policies than the pool's, as last given (said once a value)
        self.unused: Dict[str, Any] = {}

    # -- the fleet ----------------------------------------------------

    def watch_workers(self, interval: float = NO_WORKER_GRACE) -> None:
        """Say when the pool has no worker: ``interval`` seconds after the
        start if none came (a missing --worker, a worker down, ZooKeeper
        with none registered), and whenever the last one goes; and say
        when one is back.  Requests meanwhile get 503 with Retry-After
        after ``no_worker_timeout``."""
        def watch() -> None:
            had = True
            while True:
                gevent.sleep(interval)
                has = bool(len(self.pool))
                if has != had:
                    if has:
                        log.info("%d worker(s) in the pool again", len(self.pool))
                    else:
                        log.warning("no worker in the pool (%s): requests get 503 after "
                                    "%gs", self.fleet.known(), self.no_worker_timeout)
                    had = has
        self._no_worker_watch = gevent.spawn(watch)

    def drain(self, timeout: float, quiet: float = DRAIN_QUIET) -> bool:
        """Wait until no request has been in flight for ``quiet`` seconds,
        at most ``timeout`` seconds (``InFlight.drain``); whether it got
        there.  Call it after the front's drain."""
        return self.flight.drain(timeout, quiet)

    @property
    def in_flight(self) -> int:
        """Requests on workers now."""
        return self.flight.requests

    def stop(self) -> None:
        """Close every worker connection, and end a site classifier's
        threads (lb/guard.py)."""
        self.awaiting.stop()
        if self._no_worker_watch is not None:
            self._no_worker_watch.kill(block=False)
        self.fleet.stop()
        close = getattr(self.classifier, "close", None)
        if close is not None:
            close()

    def _tick(self, now: float) -> None:
        """The periodic chores (from the watchdog, lb/awaiting.py)."""
        self.fleet.readmit(now)
        if self.siblings is not None:  # (a sibling idle since still says what ended)
            sync(self.siblings, self.pool)

    # -- forwarding ---------------------------------------------------

    def __call__(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        """The LB as a plain WSGI application (run by another server)."""
        return self.forward(environ, WSGIResponder(start_response, environ))

    def forward(self, environ: dict, responder: Responder) -> Iterable[bytes]:
        """The LB as the front server's Forwarder (front/forwarder.py):
        forward the request, and answer through ``responder``."""
        counters = self.counters
        counters.requests += 1
        started = time.monotonic()
        try:
            result = self._forward(environ, responder)
        except BaseException as exc:
            drop_held_body(environ)  # (sent, it is its Upload's to close)
            if isinstance(exc, ClientGone) or not isinstance(exc, ZcLbError):
                raise  # nobody to answer: the front server closes the connection
            result = self._error(exc, environ, responder)
        counters.count_latency(time.monotonic() - started, environ.get(WORKER),
                               environ.get(COUNTED_CLASS))
        return result

    def _forward(self, environ: dict, responder: Responder) -> Iterable[bytes]:
        # From the front server, a Relay (lb/relay.py): the checked head,
        # classified from itself, and sent as it is; from elsewhere, an
        # environ.
        relay = cast(Optional[Relay], environ.get(RELAY))
        rclass, key = self._route(environ, relay)
        has_body = self._has_body(environ, relay)  # (RequestTooLarge past the limit)
        if has_body:  # (one that has not all come: held first, --buffer-request; but
            # not read, nor a 100 Continue sent for it, with no worker to take it)
            if not len(self.pool) and not self.fleet.wait_for_pool(self.no_worker_timeout):
                raise NoWorkerAvailable("no worker available after %gs" % self.no_worker_timeout)
            self.flight.hold(environ, self.max_request_body)
        retryable = not has_body and environ["REQUEST_METHOD"] in RETRY_METHODS
        for attempt in range(self.max_retries + 1):
            handle, placed = self._get_worker(rclass, key)
            connection = cast(Connection, handle)
            environ[WORKER] = connection.peer
            counts = self.counters.worker_counts(connection.peer)
            counts["requests"] = counts.get("requests", 0) + 1
            exchange = upload = None
            try:
                exchange = self._open(connection, environ, relay, has_body)
                if has_body:
                    upload = send_body(exchange, environ["wsgi.input"], self.max_request_body)
                sent = time.monotonic()
                response = self.awaiting.receive(exchange, upload, responder.sock, retryable, sent)
                environ[UPSTREAM_TIME] = time.monotonic() - sent
                if placed is not None and response.elapsed is not None:
                    self.pool.served(placed, response.elapsed, response.cache)
                length = self._start(connection, response, environ, responder)
            except (ConnectionLost, ConnectionClosed) as exc:
                self._abort(connection, exchange, upload)
                if exchange is None:  # nothing sent: it was closing, and takes nothing new
                    self.fleet.worker_down(connection)
                    if self._retry(environ, counts, attempt):  # (any request may go on)
                        continue
                    raise
                if not isinstance(exc, WorkerSilent):  # (its silence counted once: fleet.py)
                    self.fleet.outcome(connection, ok=False)
                if retryable and self._retry(environ, counts, attempt):
                    continue
                raise
            except ResponseTimeout:  # (a worker stuck under its requests: counted to eject it)
                self._abort(connection, exchange, upload)
                self.fleet.outcome(connection, ok=False)
                raise
            except BaseException:
                self._abort(connection, exchange, upload)
                raise
            return self._body(connection, exchange, upload, length, response, environ)
        raise NoWorkerAvailable("no worker answered")

    def _body(self, connection: Connection, exchange: Exchange, upload: Optional[Upload],
              length: Optional[int], response: Response, environ: dict) -> Iterable[bytes]:
        """The response's body: ``length`` bytes of it (None: all that come)."""
        body = body_in_hand(self.flight, connection, exchange, upload, length, response,
                            environ["REQUEST_METHOD"] == "HEAD")
        if body is not None:
            return body
        return ResponseBody(self.flight, connection, exchange, upload, length, response,
                            self.fleet.outcome, environ)

    def _retry(self, environ: dict, counts: Dict[str, int], attempt: int) -> bool:
        """Whether a request lost with its worker (whose ``counts`` these
        are) after ``attempt`` retries is tried again, counted if so."""
        if attempt >= self.max_retries or not self._may_retry(environ):
            return False
        self.counters.retries += 1
        counts["retries"] = counts.get("retries", 0) + 1
        environ[RETRIES] = attempt + 1
        return True

    def _route(self, environ: dict, relay: Optional[Relay]) -> Tuple[Optional[str], Optional[str]]:
        """The request's class and affinity key (``_classify``), noted in
        the environ for the access log and counted."""
        rclass, key = self._classify(environ if relay is None else relay)
        environ[CLASS] = rclass  # for the access log, as are the zc_lb.* below
        environ[COUNTED_CLASS] = self.counters.count_class("" if rclass is None else rclass)
        return rclass, key

    def _has_body(self, environ: dict, relay: Optional[Relay]) -> bool:
        """Whether the request has a body (RequestTooLarge if it is over
        ``max_request_body``)."""
        if relay is not None:
            return relay.has_body(self.max_request_body)
        return (("CONTENT_LENGTH" in environ or "HTTP_TRANSFER_ENCODING" in environ)
                and _has_body(environ, self.max_request_body))  # (most have neither)

    def _open(self, connection: Connection, environ: dict, relay: Optional[Relay],
              has_body: bool) -> Exchange:
        """Send the request's head to the worker: the Relay's, as the
        front checked it; else its variables."""
        request_class = environ[CLASS] or ""
        if relay is not None:
            return connection.open_request(None, not has_body,
                                           relay.payload(request_class, not has_body))
        return connection.open_request(_forwarded_environ(environ, request_class),
                                       end=not has_body)

    def _may_retry(self, environ: dict) -> bool:
        """The retry budget: a request lost with its worker is tried again
        while the healthy workers have room for it (``Pool.room``: none
        past the backlog cap of the load in flight, this request counted,
        and at least RETRY_ROOM each), so work moves off a lost worker but
        a pool at its cap is not flooded with retries.  A refusal is said
        in the 502's log line and in the access log (``%{error}z``)."""
        if not len(self.pool) or self.pool.room(self.in_flight + 1, RETRY_ROOM) > 0:
            return True  # (with no worker, it waits for one as a new request does)
        self.counters.retries_refused += 1
        environ[RETRY_REFUSED] = (
            "retry refused: no worker has room (%d requests in flight over %d workers)"
            % (self.in_flight, len(self.pool)))
        return False

    def _classify(self, environ: Any) -> Tuple[Optional[str], Optional[str]]:
        """The request's class (None: no class) and affinity key, from an
        environ or a Relay (a mapping of the request's variables), as text
        (``as_text``).  A classifier or key function that fails (or exits)
        routes the request without either, counted (``classifier_failed``)."""
        try:
            rclass = as_text(self.classifier(environ))
            key = as_text(self.affinity_key(environ)) if self.affinity_key else None
        except (Exception, SystemExit) as exc:  # (SystemExit would end the LB)
            self.counters.classifier_failed(exc)
            return None, None
        return None if rclass is None else bounded_class(rclass), key

    def share_with(self, siblings: Siblings) -> None:
        """Route as one LB with the other processes of ``--processes``
        (routing/siblings.py): their requests in flight counted in the backlogs,
        exchanged on requests at most every ``SYNC_INTERVAL``, and what
        the pool shares besides."""
        self.siblings = siblings
        self.pool.share_with(siblings)

    def _get_worker(self, rclass: Optional[str], key: Optional[str]) -> Tuple[Hashable, Any]:
        """The pool's choice (``Pool.choose``): a handle, which the LB's own
        pool holds as worker connections, and how it was placed."""
        now = time.monotonic()
        if self.siblings is not None and now >= self._next_sync:
            self._next_sync = now + SYNC_INTERVAL
            sync(self.siblings, self.pool)
        deadline = now + self.no_worker_timeout
        while True:
            connection, placed = self.pool.choose(rclass, key)
            if connection is not None:
                self.flight.started()
                return connection, placed
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise NoWorkerAvailable("no worker available after %gs" % self.no_worker_timeout)
            changed = self.fleet.changed
            changed.clear()
            changed.wait(remaining)

    def _start(self, connection: Connection, response: Response, environ: dict,
               responder: Responder) -> Optional[int]:
        """Start the client's response, its head as the worker made it
        ready for the client; the body length to hold the worker to."""
        code = response.status[:3]
        self._count_answer(connection, code, environ)
        length = response.length
        responder.start_ready(response.status, response.head, length)
        if code in BODILESS_STATUS or environ["REQUEST_METHOD"] == "HEAD":
            return 0
        return length

    def _count_answer(self, connection: Connection, code: str, environ: dict) -> None:
        """A worker's answer: a success or a failure for ejection
        (lb/outlier.py), and counted by its status's first digit."""
        if code[0] != "5":
            ejector = self.fleet.ejector
            if connection.peer in self.fleet.links:  # (``Fleet.outcome``, without its call)
                ejector.success(connection.peer)
            if ejector.watched:  # (paths failed lately: is this one among them?)
                ejector.succeeded_on(request_path(environ), connection.peer)
        else:
            self.fleet.outcome(connection, False, request_path(environ))
        counts, what = self.counters.worker_counts(connection.peer), code[0] + "xx"
        counts[what] = counts.get(what, 0) + 1

    def _abort(self, connection: Connection, exchange: Optional[Exchange],
               upload: Optional[Upload]) -> None:
        counts = self.counters.worker_counts(connection.peer)  # (failed before its response)
        counts["errors"] = counts.get("errors", 0) + 1
        if upload is not None:
            upload.stop()
        if exchange is not None:
            exchange.cancel()
        self.flight.worker_done(connection)

    def _error(self, exc: ZcLbError, environ: dict, responder: Responder) -> Iterable[bytes]:
        status = exc.http_status
        relay = environ.get(RELAY)
        if relay is not None:  # (the log line and the count read the variables)
            cast(Relay, relay).complete(environ)
        cause = environ[ERROR] = type(exc).__name__  # (for the access log)
        message = str(exc)
        refused = environ.get(RETRY_REFUSED)
        if refused:
            message = "%s; %s" % (message, refused)
            environ[ERROR] = cause + ",retry-refused"
        self.counters.count_error(status, cause, message, environ)
        log.log(_log_level(exc), "%d for %s %s: %s", status, environ.get("REQUEST_METHOD"),
                environ.get("PATH_INFO"), message)
        # A 503 asks again about when a worker may be back; a body nobody
        # wants could take forever to read: hang up instead (and after a
        # body too large, whether or not it has all come).
        close = (isinstance(exc, RequestTooLarge)
                 or not getattr(environ.get("wsgi.input"), "complete", True))
        head = self.pages.head(status, max(1, math.ceil(self.no_worker_timeout)), close=close)
        responder.start_response(status_line(status), head)
        return [self.pages.body(status)]

    def count_answer(self, status: int, cause: str, message: str,
                     environ: Optional[dict] = None) -> None:
        """An answer the front server gave itself (400, 408, 431, 501, a
        503 past --max-connections...): a request received and an error
        made, counted as the LB's own are."""
        if environ is None:  # (the LB's app saw it, and counted it, otherwise)
            self.counters.requests += 1
        self.counters.count_error(status, cause, message, environ)

    def configure(self, changes: Mapping[str, Any], source: str = "") -> None:
        """Apply live settings from any source (the command line's file
        read again, ZooKeeper): those of ``changes`` that the pool takes
        (its policy's ``SETTINGS``) and the LB's own (``SETTINGS``), each
        checked against the settings table first (ConfigurationError, and
        nothing changed, if one is bad), each change logged as "name old
        -> new (source)"."""
        pooled = {name: check(LB_SETTINGS, name, changes[name])
                  for name in self.pool.SETTINGS if name in changes}
        own = {name: check(LB_SETTINGS, name, changes[name])
               for name in self.SETTINGS if changes.get(name) is not None}
        unused = {name: check(LB_SETTINGS, name, changes[name])
                  for name in POOL_SETTINGS.difference(self.pool.SETTINGS)
                  if changes.get(name) is not None}
        old = {name: getattr(self.pool, name) for name in pooled}
        old.update((name, getattr(self, name)) for name in own)
        self.pool.update_settings(**pooled)
        for name, value in own.items():
            setattr(self, name, value)
        for name, value in {**pooled, **own}.items():
            if value != old[name]:
                log_change(name, old[name], value, source)
        _say_unused(unused, self.unused, self.pool, source)

    def reset_skills(self, why: str = "by an operator") -> None:
        """Forget the skills the pool holds; résumés teach them again."""
        reset = getattr(self.pool, "reset_skills", None)
        if reset is not None:
            reset()
            log.warning("skills reset %s: learning them again from résumés", why)

    # -- introspection ------------------------------------------------

    def status(self) -> dict:
        """The status document: workers, backlogs, skills, requests in flight."""
        pool_status = self.pool.status()
        workers = self.fleet.status(pool_status.pop("workers"))
        return {
            "pool": pool_status,
            "workers": self.counters.add_to_workers(workers),
            "in_flight": self.in_flight,
            **self.counters.document(),
            "pid": os.getpid(),
            "build": build(),  # compiled, or the source (and why)
            "classifier": getattr(self.classifier, "status", dict)(),
            "worker_failures": self.fleet.worker_failures,
            "health_checks": self.fleet.health_checks,
            "buffers": dict(self.flight.spool_limits.status(), holding=self.flight.holding),
            "ejections": self.fleet.ejector.total_ejections,
        }

    def __repr__(self) -> str:
        return "<LB workers=%d in_flight=%d %r>" % (len(self.fleet.links), self.in_flight,
                                                     self.pool)


class WSGIResponder:
    """A WSGI server's ``start_response`` as a Responder
    (front/forwarder.py), for the LB run by a server other than its own
    front: a worker's ready head goes as its fields, and no client socket
    is watched for a hang-up."""

    def __init__(self, start_response: Callable, environ: Optional[dict] = None) -> None:
        self.start_response = start_response
        self.environ = environ  # (the request's: the worker it went to, for errors)
        self.sock: Any = None

    def start_ready(self, status: str, head: bytes, length: Optional[int]) -> Callable:
        """Start the response with the head's fields, as WSGI does; a
        status or field the server refuses (an older worker passes on an
        application's status past 599, which some servers refuse) is a
        BadResponse naming the worker and the status."""
        try:
            return self.start_response(status, head_fields(head))
        except Exception as exc:
            worker = (self.environ or {}).get(WORKER)
            raise BadResponse("worker %s's response head (status %r) was refused by the "
                              "WSGI server running the LB: %s" % (worker, status, exc))


def _say_unused(unused: Dict[str, Any], said: Dict[str, Any], pool: Pool, source: str) -> None:
    """Say a setting of another policy than ``pool``'s given away from its
    default, once a value (``said``: the values given before): it changes
    nothing here, and would otherwise change nothing without a word."""
    for name, value in sorted(unused.items()):
        if value != said.get(name, LB_SETTINGS[name].default):
            log.warning("%s = %s%s: the %s policy does not use it (%s does)",
                        name, shown(value), " (%s)" % source if source else "",
                        policy_name(pool), takers(name))
        said[name] = value


def _log_level(exc: ZcLbError) -> int:
    """How an error answered is logged: the client's own (a bad or too
    large body) at INFO, as the front logs a refused head (any client
    could fill the warnings otherwise); the LB's and workers' as warnings."""
    return logging.INFO if isinstance(exc, ClientError) else logging.WARNING


def _has_body(environ: dict, limit: Optional[int]) -> bool:
    if environ.get("HTTP_TRANSFER_ENCODING", "").lower() == "chunked":
        return True
    length = environ.get("CONTENT_LENGTH") or "0"
    try:
        size = int(length)
    except ValueError:
        size = 0  # the front server rejects these with 400 before we run
    if limit is not None and size > limit:
        raise RequestTooLarge("Content-Length %d is over the limit of %d" % (size, limit))
    return size > 0


def _forwarded_environ(environ: dict, rclass: str) -> Dict[str, str]:
    """What the worker gets of ``environ``: its CGI variables less the
    hop-by-hop fields.  The front server made them (``FORWARD``, for an
    application that takes no Relay); an environ from elsewhere is
    sifted."""
    forwarded = environ.get(FORWARD)
    if forwarded is not None:
        forwarded[REQUEST_CLASS] = rclass
        return forwarded
    forwarded = {
        key: value for key, value in environ.items()
        if type(value) is str and key not in HOP_BY_HOP_KEYS
        and not key.startswith(("wsgi.", "gevent.", "zc_lb."))
    }
    connection = environ.get("HTTP_CONNECTION")
    if connection:  # headers it names are hop-by-hop too
        for name in connection.split(","):
            forwarded.pop("HTTP_" + name.strip().upper().replace("-", "_"), None)
    forwarded["wsgi.url_scheme"] = environ.get("wsgi.url_scheme", "http")
    forwarded[REQUEST_CLASS] = rclass
    return forwarded
