"""The LB: the WSGI app that forwards requests to workers.

``LB`` holds the pool and its ``Fleet`` (lb/fleet.py): one ``WorkerLink``
per known worker address, each keeping a connection open and telling
the pool when its worker comes, sends a résumé, drains or goes.  The
pool's handles are the live ``Connection`` objects, so a reconnected
worker is a new handle and a stale one can never be chosen.

``LB.__call__`` is the WSGI application the HTTP front server runs:
classify, get a worker from the pool (waiting up to
``no_worker_timeout``), forward environ and body, stream the response
back, and ``put`` the worker when the response ends.

Failure semantics (docs/design.rst, "Failure semantics"): a worker lost
before the response starts means a transparent retry for a GET or HEAD
without a body, and 502 otherwise; lost mid-body, the iterator raises and the front server closes
the client's connection, so a truncated body never looks complete; no
worker in time gives 503.  All errors become responses in ``_error``.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import socket
import time
from bisect import bisect_left
from typing import (Any, Callable, ClassVar, DefaultDict, Dict, Hashable, Iterable, Mapping,
                    List, Optional, Tuple, cast)

import gevent  # type: ignore[import-untyped]
import gevent.event  # type: ignore[import-untyped]
import gevent.socket  # type: ignore[import-untyped]

from zc_lb import build
from zc_lb.routing.classifier import bounded_class
from zc_lb.wire.connection import Connection
from zc_lb.wire.exchange import Exchange
from zc_lb.wire.keepalive import KEEPALIVE_INTERVAL
from zc_lb.lb.fleet import Fleet
from zc_lb.lb.links import LinkConfig
from zc_lb.errors import (
    BadResponse,
    ConfigurationError,
    ClientError,
    ClientGone,
    ConnectionClosed,
    ConnectionLost,
    NoWorkerAvailable,
    RequestCancelled,
    RequestTooLarge,
    ResponseTimeout,
    WorkerLost,
    ZcLbError,
)
from zc_lb.front.h1 import BODILESS_STATUS, HOP_BY_HOP_KEYS, REASONS
from zc_lb.front.httpparse import HOP_BY_HOP
from zc_lb.front.pages import ErrorPages
from zc_lb.lb.outlier import Ejector
from zc_lb.routing.pool import Pool
from zc_lb.wire.protocol import MAX_BODY, Body, End, Response, head_fields
from zc_lb.lb.relay import Relay
from zc_lb.settings import LATENCY_BUCKETS, LB_SETTINGS, check, log_change
from zc_lb.routing.siblings import SYNC_INTERVAL, Siblings, sync
from zc_lb.lb.spool import Spool, SpoolLimits
from zc_lb.environ import (CLASS, CLIENT_SOCKET, COUNTED_CLASS, ERROR, FORWARD, RELAY,
                           REQUEST_CLASS, RETRIES, RETRY_REFUSED, START_READY, UPSTREAM_TIME,
                           WORKER)

log = logging.getLogger(__name__)

UPLOAD_CHUNK = MAX_BODY  # a request body is read and sent a frame at a time
WATCH_CLIENT_AFTER = 1.0  # seconds without a response before watching for a hang-up
WATCHDOG_INTERVAL = 0.25
RETRY_METHODS = frozenset(("GET", "HEAD"))
MAX_CLASSIFIER_ERRORS = 100  # distinct classifier errors kept in status
RETRY_ROOM = 3  # a healthy worker has room for at least this many retries
DRAIN_QUIET = 0.5  # seconds without requests in flight that end a drain
NO_WORKER_GRACE = 5.0  # seconds after the start before an empty pool is said

# The response latency histogram's upper bounds, in seconds (plus +Inf):
# fixed, so that a request costs one bisect and one list increment.
MAX_COUNTED_CLASSES = 1000  # distinct classes counted; later ones count as OTHER_CLASS
OTHER_CLASS = "other"
STATUS_CLASSES = 100  # the busiest classes in the status document (the rest: OTHER_CLASS)
RECENT_ERRORS = 20  # error responses kept for the status page

class Upload:
    """The request body, sent to the worker from a greenlet of its own,
    so that a worker may answer, and stream, while it still reads."""

    def __init__(self, exchange: Exchange, wsgi_input) -> None:
        self.exchange = exchange
        self.wsgi_input = wsgi_input
        self.error: Optional[Exception] = None
        self.done = False
        self.greenlet = gevent.spawn(self._run)

    def _run(self) -> None:
        exchange = self.exchange
        # (The front's input reads a piece as it came: see Input.read1.)
        read = getattr(self.wsgi_input, "read1", self.wsgi_input.read)
        try:
            while True:
                data = read(UPLOAD_CHUNK)
                if not data:
                    exchange.send(End(exchange.rno))
                    self.done = True
                    return
                exchange.send_body(data)
        except ClientError as exc:  # a malformed body, or the client left
            self.error = exc
            exchange.cancel()
        except ZcLbError:
            pass  # the request ended on the worker's side; nothing more to send
        except Exception as exc:  # the client's socket failed
            self.error = exc
            exchange.cancel()

    def failure(self) -> Optional[Exception]:
        """What went wrong on the client's side, as the error to raise."""
        if self.error is None:
            return None
        if isinstance(self.error, ClientError):
            return self.error  # a malformed body: answered 400, connection closed
        return ClientGone("client went away during upload: %s" % self.error)

    def stop(self) -> None:
        self.greenlet.kill()


_Waiting = Tuple[float, dict, Optional[Upload], bool]
"""A request waiting for its response to start: when it was sent, its
environ, its upload if it has a body, and whether it may be retried (a
GET or HEAD without a body).  A tuple: an object of a class of its own
cost a call of its ``__init__`` on every request."""


class ResponseBody:
    """The response body as a WSGI iterable, buffered (lb/spool.py).

    A greenlet of its own takes the body from the worker as fast as it
    comes, granting credit as it keeps each chunk, and gives the worker
    back to the pool at the body's End; the client reads at its own pace
    from the spool.  So a slow client holds memory or disk, never a
    worker thread (and, past the spool's bounds, the worker waits, as flow
    control makes it).  The worker is held to its Content-Length: bytes
    past it are dropped, and a body that ends short, or a worker lost
    mid-body, raises once the client has what came (the front server then
    closes the connection, so a truncated body never looks complete)."""

    def __init__(self, lb: "LB", connection: Connection, exchange: Exchange,
                 upload: Optional[Upload], length: Optional[int], response: Response) -> None:
        self.lb = lb
        self.connection = connection
        self.exchange = exchange
        self.upload = upload
        self.remaining = length
        self.spool = Spool(lb.spool_limits)
        self.ended = False  # all of the body is here, or all that will come
        self.error: Optional[ZcLbError] = None  # raised once the spool is read
        self._released = False  # the worker is back in the pool
        self._arrived = gevent.event.Event()  # the pump kept something, or ended
        self._room = gevent.event.Event()  # the client took something
        self._pump: Optional[gevent.Greenlet] = None
        self._closed = False
        lb.response_started()  # (a drain waits for the client to have it all)
        if self._keep(response.body):
            if response.end:
                self._end()
            else:
                self._pump = gevent.spawn(self._take_body, len(response.body))

    def _take_body(self, owed: int) -> None:
        """The pump: receive the body, keep it, grant credit while there is
        room (``owed``: bytes kept and not yet granted back)."""
        exchange, spool = self.exchange, self.spool
        try:
            while True:
                if owed:
                    if spool.full:
                        self.lb.spool_limits.stalled += 1
                        while spool.full:
                            self._room.clear()
                            self._room.wait()
                    exchange.consumed(owed)
                if not spool:
                    # The client keeps up (it took all so far): let the
                    # body come at full speed.  If it stops reading, what
                    # waits here for room in its spool stays within
                    # WIDE_WINDOW (flow control holds the worker).
                    exchange.widen()
                message = exchange.receive()
                if type(message) is End:
                    self._end()
                    return
                data = message.data  # type: ignore[union-attr]
                if not self._keep(data):
                    return
                owed = len(data)
        except ZcLbError as exc:  # the worker lost, or the request cancelled
            self.error = exc
            self._arrived.set()

    def _keep(self, data: bytes) -> bool:
        """Spool ``data``; False (and the body over) if it goes past the
        Content-Length, whose bytes would read as the next response on a
        keep-alive connection."""
        remaining = self.remaining
        if remaining is not None and len(data) > remaining:
            log.warning("worker %s sent a body longer than its Content-Length",
                        self.connection.peer)
            data, self.remaining = data[:remaining], 0
            if data:
                self.spool.put(data)
            self.exchange.cancel()
            self._end()
            return False
        if remaining is not None:
            self.remaining = remaining - len(data)
        if data:
            self.spool.put(data)
            self._arrived.set()
        return True

    def _end(self) -> None:
        if self.remaining:
            self.error = BadResponse("worker's body ended %d bytes short" % self.remaining)
        self.ended = True
        self._release()
        self._arrived.set()

    def _release(self) -> None:
        if not self._released:
            self._released = True
            self.lb.worker_done(self.connection)

    def __iter__(self):
        spool, arrived = self.spool, self._arrived
        while True:
            data = spool.take()
            if data:
                self._room.set()
                yield data
            elif self.error is not None:
                raise self.error
            elif self.ended:
                return
            else:
                arrived.clear()  # (no switch since the checks: no wake-up lost)
                arrived.wait()

    def close(self) -> None:
        if self._pump is not None:
            self._pump.kill(block=False)
        self.spool.close()
        if self.upload is not None:
            self.upload.stop()
        self.exchange.cancel()  # a no-op once both directions have ended
        self._release()
        if not self._closed:
            self._closed = True
            self.lb.response_sent()


class LB:
    """The load balancer: worker links, the pool, and the forwarding app."""

    relays: ClassVar[bool] = True  # takes a front server's Relay (lb/relay.py) in the environ

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
        self.spool_limits = spool_limits or SpoolLimits()
        self.affinity_key = affinity_key
        self.classifier_errors: Dict[str, int] = {}
        self.response_timeout = response_timeout
        self.classifier = classifier
        self.no_worker_timeout = no_worker_timeout
        self.max_request_body = max_request_body
        self.pages = ErrorPages(pages)  # (the front's refusals take the same: front/pages.py)
        self.in_flight = 0
        self.relaying = 0  # buffered responses a client is still being sent
        self.idle = gevent.event.Event()  # set while none is in flight or relayed
        self.idle.set()
        self._woken = gevent.event.Event()  # set when a request ends an idle spell
        self.requests = 0
        self.retries = 0
        self.errors: Dict[int, int] = {}
        self.max_retries = max_retries
        self.retries_refused = 0  # retries the budget did not allow
        self._waiting: Dict[Exchange, _Waiting] = {}
        # Of those, the ones whose client is watched for a hang-up (``_watch``).
        self._watchers: Dict[Exchange, gevent.Greenlet] = {}
        self._watchdog: Optional[gevent.Greenlet] = None
        self._no_worker_watch: Optional[gevent.Greenlet] = None
        self.started = time.time()
        # Counters for metrics, read at scrape time (status/metrics.py): each is a
        # plain increment or dict update per request, no lock, no labels.
        # address -> what -> count (a dict each: no key tuple to build and hash a request)
        self.worker_counts: DefaultDict[str, Dict[str, int]] = collections.defaultdict(dict)
        self.class_requests: Dict[str, int] = {}
        self.latency = [0] * (len(LATENCY_BUCKETS) + 1)
        self.latency_sum = 0.0
        # The same by worker address and by counted class: [counts..., sum].
        self.worker_latency: Dict[str, List[float]] = {}
        self.class_latency: Dict[str, List[float]] = {}
        self.error_causes: Dict[str, int] = {}  # exception class name -> count
        self.recent_errors: "collections.deque[dict]" = collections.deque(maxlen=RECENT_ERRORS)
        self.fronts: list = []  # the front servers: their client connections go in status
        link_config = LinkConfig(secret, keepalive_interval, keepalive_timeout, drain_timeout)
        self.fleet = Fleet(pool, link_config, Ejector(**(outlier or {})),
                           self._worker_removed, self._worker_silent)

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
        """Wait until no request has been in flight for ``quiet`` seconds
        (a keep-alive client may still send a last request after the
        front stopped accepting new connections), at most ``timeout``
        seconds; whether it got there.  Call it after the front's drain."""
        deadline = time.monotonic() + timeout
        while True:
            if not self.idle.wait(max(deadline - time.monotonic(), 0)):
                return False
            self._woken.clear()
            remaining = deadline - time.monotonic()
            if not self._woken.wait(max(min(quiet, remaining), 0)):
                return remaining >= quiet or not self.in_flight

    def stop(self) -> None:
        """Close every worker connection."""
        if self._watchdog is not None:
            self._watchdog.kill(block=False)
        if self._no_worker_watch is not None:
            self._no_worker_watch.kill(block=False)
        self.fleet.stop()

    def _worker_removed(self, address: str) -> None:
        """A worker address is gone for good: its series end with it."""
        self.worker_counts.pop(address, None)
        self.worker_latency.pop(address, None)

    def _worker_silent(self, connection: Connection, seconds: float) -> int:
        """A worker fell silent: its GETs and HEADs that have no answer yet
        move to other workers now; how many."""
        moved = 0
        for exchange, entry in list(self._waiting.items()):
            if exchange.connection is connection and entry[3]:  # (retryable)
                exchange.fail(WorkerLost("%s silent for %.1fs" % (connection.peer, seconds)))
                moved += 1
        return moved

    # The seam a ``ResponseBody`` uses: a response the client is being sent
    # keeps a drain waiting, as a request in flight on a worker does.

    def worker_done(self, connection: Hashable) -> None:
        """A request given to worker ``connection`` has ended there."""
        self.in_flight -= 1
        if not self.in_flight and not self.relaying:
            self.idle.set()
        self.pool.put(connection)

    def response_started(self) -> None:
        """A buffered response is being sent to its client."""
        self.relaying += 1

    def response_sent(self) -> None:
        """A buffered response is all sent (or abandoned)."""
        self.relaying -= 1
        if not self.in_flight and not self.relaying:
            self.idle.set()

    # -- forwarding ---------------------------------------------------

    def __call__(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        self.requests += 1
        started = time.monotonic()
        try:
            result = self._forward(environ, start_response)
        except ClientGone:
            raise  # nobody to answer: the front server closes the connection
        except ZcLbError as exc:
            result = self._error(exc, environ, start_response)
        # Latency: until the response starts (its head is with the front server).
        elapsed = time.monotonic() - started
        bucket = bisect_left(LATENCY_BUCKETS, elapsed)
        self.latency[bucket] += 1
        self.latency_sum += elapsed
        # And by the worker that answered (the last, after retries) and by
        # class (as counted: past MAX_COUNTED_CLASSES, OTHER_CLASS's).
        for table, name in ((self.worker_latency, environ.get(WORKER)),
                            (self.class_latency, environ.get(COUNTED_CLASS))):
            if name is not None:
                counts = table.get(name)
                if counts is None:
                    counts = table[name] = [0.0] * (len(LATENCY_BUCKETS) + 2)
                counts[bucket] += 1
                counts[-1] += elapsed
        return result

    def _forward(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        # From the front server, a Relay (lb/relay.py): the checked head,
        # classified from itself, and sent as it is to a worker that
        # takes it; from elsewhere, an environ.
        relay = environ.get(RELAY)
        rclass, key = self._classify(environ if relay is None else relay)
        environ[CLASS] = rclass  # for the access log, as are the zc_lb.* below
        name = request_class = "" if rclass is None else rclass
        classes = self.class_requests
        count = classes.get(name)
        if count is None and len(classes) >= MAX_COUNTED_CLASSES:
            name, count = OTHER_CLASS, classes.get(OTHER_CLASS)
        classes[name] = (count or 0) + 1
        environ[COUNTED_CLASS] = name
        if relay is not None:
            has_body = cast(Relay, relay).has_body(self.max_request_body)
        else:
            has_body = (("CONTENT_LENGTH" in environ or "HTTP_TRANSFER_ENCODING" in environ)
                        and _has_body(environ, self.max_request_body))  # (most have neither)
        retryable = not has_body and environ["REQUEST_METHOD"] in RETRY_METHODS
        forwarded: Optional[Dict[str, str]] = None  # (the JSON environ, made if needed)
        for attempt in range(self.max_retries + 1):
            connection = cast(Connection, self._get_worker(rclass, key))
            placed = self.pool.placed  # (``get`` has just set it: no switch since)
            peer = connection.peer
            counts = self.worker_counts[peer]
            counts["requests"] = counts.get("requests", 0) + 1
            environ[WORKER] = peer
            exchange = upload = None
            try:
                if relay is not None and connection.protocol.relay:
                    exchange = connection.open_request(
                        None, not has_body, cast(Relay, relay).payload(request_class, not has_body))
                else:
                    if forwarded is None:
                        forwarded = _forwarded_environ(environ, request_class)
                    exchange = connection.open_request(forwarded, end=not has_body)
                if has_body:
                    upload = _send_body(exchange, environ["wsgi.input"])
                response = self._await_response(exchange, upload, environ, retryable)
                if placed is not None and response.elapsed is not None:
                    self.pool.served(placed, response.elapsed, response.cache)
                length = self._start(connection, response, environ, start_response)
            except (ConnectionLost, ConnectionClosed):
                self._abort(connection, exchange, upload)
                self.fleet.outcome(connection, ok=False)
                if retryable and attempt < self.max_retries and self._may_retry(environ):
                    self.retries += 1
                    counts["retries"] = counts.get("retries", 0) + 1
                    environ[RETRIES] = attempt + 1
                    continue
                raise
            except BaseException:
                self._abort(connection, exchange, upload)
                raise
            if (response.end and upload is None
                    and (length is None or length == len(response.body))):
                # The whole response came in one piece: the worker is
                # done with it, and the front sends it in one write.
                self.worker_done(connection)
                return [response.body]
            return ResponseBody(self, connection, exchange, upload, length, response)
        raise NoWorkerAvailable("no worker answered")

    def _may_retry(self, environ: dict) -> bool:
        """The retry budget: a request lost with its worker is tried again
        while the healthy workers have room for it (``Pool.room``: none
        past the backlog cap of the load in flight, this request counted,
        and at least RETRY_ROOM each), so work moves off a lost worker but
        a pool at its cap is not flooded with retries.  A refusal is said
        in the 502's log line and in the access log (``%{error}z``)."""
        if not len(self.pool) or self.pool.room(self.in_flight + 1, RETRY_ROOM) > 0:
            return True  # (with no worker, it waits for one as a new request does)
        self.retries_refused += 1
        environ[RETRY_REFUSED] = (
            "retry refused: no worker has room (%d requests in flight over %d workers)"
            % (self.in_flight, len(self.pool)))
        return False

    def _classify(self, environ: Any) -> Tuple[Optional[str], Optional[str]]:
        """The request's class (None: no class) and affinity key, from an
        environ or a Relay (a mapping of the request's variables).  A failing
        classifier or key function routes the request without either, and
        is logged once per distinct error, then counted."""
        try:  # (a user's function may return any object: its str is used)
            rclass = self.classifier(environ)
            key = self.affinity_key(environ) if self.affinity_key else None
        except Exception as exc:
            self._classifier_failed(exc)
            return None, None
        return (None if rclass is None else bounded_class(str(rclass)),
                None if key is None else str(key))

    def _classifier_failed(self, exc: Exception) -> None:
        error = "%s: %s" % (type(exc).__name__, exc)
        count = self.classifier_errors.get(error, 0) + 1
        self.classifier_errors[error] = count
        if count == 1:
            if len(self.classifier_errors) > MAX_CLASSIFIER_ERRORS:
                self.classifier_errors.pop(next(iter(self.classifier_errors)))
            log.error("classifier failed (routing such requests without a class; "
                      "logged once, counted in status)", exc_info=exc)

    def share_with(self, siblings: Siblings) -> None:
        """Route as one LB with the other processes of ``--processes``
        (routing/siblings.py): their requests in flight counted in the backlogs,
        exchanged on requests at most every ``SYNC_INTERVAL``, and what
        the pool shares besides."""
        self.siblings = siblings
        self.pool.share_with(siblings)

    def _get_worker(self, rclass: Optional[str], key: Optional[str]) -> Hashable:
        """The pool's choice: a handle, which the LB's own pool holds as
        worker connections."""
        now = time.monotonic()
        if self.siblings is not None and now >= self._next_sync:
            self._next_sync = now + SYNC_INTERVAL
            sync(self.siblings, self.pool)
        deadline = now + self.no_worker_timeout
        while True:
            connection = self.pool.get(rclass, key)
            if connection is not None:
                self.in_flight += 1
                if self.in_flight == 1:
                    self.idle.clear()
                    self._woken.set()
                return connection
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise NoWorkerAvailable("no worker available after %gs" % self.no_worker_timeout)
            changed = self.fleet.changed
            changed.clear()
            changed.wait(remaining)

    def _await_response(self, exchange: Exchange, upload: Optional[Upload],
                        environ: dict, retryable: bool) -> Response:
        waiting = self._waiting
        started = time.monotonic()
        waiting[exchange] = (started, environ, upload, retryable)
        if self._watchdog is None:
            self._watchdog = gevent.spawn(self._watch_slow_responses)
        try:
            response = exchange.receive()
        except RequestCancelled:
            failure = upload.failure() if upload is not None else None
            if failure is not None:
                raise failure
            raise
        finally:
            waiting.pop(exchange, None)
            if self._watchers:
                watcher = self._watchers.pop(exchange, None)
                if watcher is not None:
                    watcher.kill(block=False)
        if not isinstance(response, Response):
            raise BadResponse("worker sent %s before a response" % type(response).__name__)
        environ[UPSTREAM_TIME] = time.monotonic() - started
        return response

    def _watch_slow_responses(self) -> None:
        """One greenlet, not a timer per request: time out responses that
        do not start, and watch the clients of slow ones for a hang-up."""
        while True:
            gevent.sleep(WATCHDOG_INTERVAL)
            now = time.monotonic()
            self.fleet.readmit(now)
            if self.siblings is not None:  # (a sibling idle since still says what ended)
                sync(self.siblings, self.pool)
            timeout = self.response_timeout
            for exchange, (started, environ, upload, _) in list(self._waiting.items()):
                age = now - started
                if timeout is not None and age > timeout:
                    exchange.fail(ResponseTimeout("no response within %gs" % timeout))
                elif age > WATCH_CLIENT_AFTER and exchange not in self._watchers:
                    self._watch(exchange, environ, upload)

    def _watch(self, exchange: Exchange, environ: dict, upload: Optional[Upload]) -> None:
        """Cancel the exchange if the client hangs up (once the upload,
        which reads the same socket, is over)."""
        sock = environ.get(CLIENT_SOCKET)
        if sock is not None and (upload is None or upload.done):
            self._watchers[exchange] = gevent.spawn(_watch_client, sock, exchange)

    def _start(self, connection: Connection, response: Response, environ: dict,
               start_response: Callable) -> Optional[int]:
        """Start the client's response; the body length to hold the worker to."""
        code = response.status[:3]
        if code[0] != "5":
            ejector = self.fleet.ejector
            ejector.success(connection.peer)  # (``Fleet.outcome``, without its call)
            if ejector.watched:  # (paths failed lately: is this one among them?)
                ejector.succeeded_on(_request_path(environ), connection.peer)
        else:
            self.fleet.outcome(connection, False, _request_path(environ))
        counts, what = self.worker_counts[connection.peer], code[0] + "xx"
        counts[what] = counts.get(what, 0) + 1
        bodiless = code in BODILESS_STATUS or environ["REQUEST_METHOD"] == "HEAD"
        if response.head is not None:  # ready for the client: the worker checked it
            length = response.length
            start_ready = environ.get(START_READY)
            if start_ready is not None:
                start_ready(response.status, response.head, length)
                return 0 if bodiless else length
            headers = head_fields(response.head)  # (run by another WSGI server)
        else:
            headers, length = [], None
            for name, value in response.headers:
                lowered = name.lower()
                if lowered in HOP_BY_HOP or (code in BODILESS_STATUS
                                             and lowered == "content-length"):
                    continue
                if lowered == "content-length":
                    length = _content_length(value)
                headers.append((name, value))
        try:
            start_response(response.status, headers)
        except Exception as exc:  # the front refused the status or a header
            raise BadResponse("worker sent a response head HTTP forbids: %s" % exc)
        return 0 if bodiless else length

    def _abort(self, connection: Connection, exchange: Optional[Exchange],
               upload: Optional[Upload]) -> None:
        counts = self.worker_counts[connection.peer]  # failed here before its response started
        counts["errors"] = counts.get("errors", 0) + 1
        if upload is not None:
            upload.stop()
        if exchange is not None:
            exchange.cancel()
        self.worker_done(connection)

    def _error(self, exc: ZcLbError, environ: dict,
               start_response: Callable) -> Iterable[bytes]:
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
        self._count_error(status, cause, message, environ)
        page = self.pages.body(status)
        log.warning("%d for %s %s: %s", status, environ.get("REQUEST_METHOD"),
                    environ.get("PATH_INFO"), message)
        headers = [("Content-Type", "text/html; charset=utf-8"),
                   ("Content-Length", str(len(page)))]
        if status == 503:  # when to ask again: about when a worker may be back
            headers.append(("Retry-After", str(max(1, math.ceil(self.no_worker_timeout)))))
        if not getattr(environ.get("wsgi.input"), "complete", True):
            # Reading a body nobody wants could take forever; hang up instead.
            headers.append(("Connection", "close"))
        start_response("%d %s" % (status, REASONS.get(status, "Error")), headers)
        return [page]

    def _count_error(self, status: int, cause: str, message: str,
                     environ: Optional[dict]) -> None:
        self.errors[status] = self.errors.get(status, 0) + 1
        self.error_causes[cause] = self.error_causes.get(cause, 0) + 1
        environ = environ or {}
        self.recent_errors.append({
            "time": round(time.time(), 3), "status": status, "cause": cause,
            "method": environ.get("REQUEST_METHOD"), "path": environ.get("PATH_INFO"),
            "message": message[:200]})

    def count_answer(self, status: int, cause: str, message: str,
                     environ: Optional[dict] = None) -> None:
        """An answer the front server gave itself (400, 408, 431, 501, a
        503 past --max-connections...): a request received and an error
        made, counted as the LB's own are."""
        if environ is None:  # (the LB's app saw it, and counted it, otherwise)
            self.requests += 1
        self._count_error(status, cause, message, environ)

    def configure(self, changes: Mapping[str, Any], source: str = "") -> None:
        """Apply live settings from any source (the command line's file
        read again, ZooKeeper): the pool's (its policy's ``SETTINGS``) and
        ``no_worker_timeout`` of ``changes``, each checked against the
        settings table first (ConfigurationError, and nothing changed, if
        one is bad), each change logged as "name old -> new (source)"."""
        names = [name for name in self.pool.SETTINGS if name in changes]
        checked = {name: check(LB_SETTINGS, name, changes[name]) for name in names}
        timeout = changes.get("no_worker_timeout")
        if timeout is not None:
            timeout = check(LB_SETTINGS, "no_worker_timeout", timeout)
        old = {name: getattr(self.pool, name) for name in names}
        old["no_worker_timeout"] = self.no_worker_timeout
        self.pool.update_settings(**checked)
        if timeout is not None:
            checked["no_worker_timeout"] = self.no_worker_timeout = timeout
        for name, value in checked.items():
            if value != old[name]:
                log_change(name, old[name], value, source)

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
        return {
            "pool": pool_status,
            "workers": self._workers_status(pool_status.pop("workers")),
            "in_flight": self.in_flight,
            "requests": self.requests,
            "retries": self.retries,
            "errors": {str(k): v for k, v in sorted(self.errors.items())},
            "uptime": round(time.time() - self.started, 1),
            "pid": os.getpid(),
            "build": build(),  # compiled, or the source (and why)
            "classifier_errors": dict(self.classifier_errors),
            "classifier": getattr(self.classifier, "status", dict)(),
            "worker_failures": self.fleet.worker_failures,
            "retries_refused": self.retries_refused,
            "health_checks": self.fleet.health_checks,
            "buffers": self.spool_limits.status(),
            "ejections": self.fleet.ejector.total_ejections,
            "clients": sum(getattr(front.server, "connections", 0) for front in self.fronts),
            "latency": {"buckets": list(LATENCY_BUCKETS), "counts": list(self.latency),
                        "sum": round(self.latency_sum, 6)},
            "error_causes": dict(self.error_causes),
            "recent_errors": list(self.recent_errors),
            "classes": top_classes(self.class_requests, STATUS_CLASSES),
            "class_latency": {name: _histogram(self.class_latency[name])
                              for name in top_classes(self.class_requests, STATUS_CLASSES)
                              if name in self.class_latency},
        }

    def _workers_status(self, pooled: Dict[str, dict]) -> Dict[str, dict]:
        """Each known worker's part of the status document, by address:
        the fleet's (its link, ejection, the pool's view of it) and this
        LB's counts of its answers and their latency."""
        links = self.fleet.status(pooled)
        for address, counts in list(self.worker_counts.items()):
            if address in links:
                links[address]["counts"].update(counts)
        for address, latency in self.worker_latency.items():
            if address in links:
                links[address]["latency"] = _histogram(latency)
        return links

    def __repr__(self) -> str:
        return "<LB workers=%d in_flight=%d %r>" % (len(self.fleet.links), self.in_flight,
                                                     self.pool)


def _request_path(environ: dict) -> str:
    """The request's path, without its query (a relayed request's environ
    has no PATH_INFO until completed: its head has the target)."""
    path = environ.get("PATH_INFO")
    if path is None:
        relay = environ.get(RELAY)
        target = relay.head.path if relay is not None else "/"
        path = target.partition("?")[0]
    return path or "/"


def _histogram(counts: List[float]) -> dict:
    """A latency histogram as the status document gives it, from
    [count per bucket..., sum of seconds]."""
    return {"buckets": list(LATENCY_BUCKETS), "counts": [int(n) for n in counts[:-1]],
            "sum": round(counts[-1], 6)}


def top_classes(counts: Dict[str, int], n: int) -> Dict[str, int]:
    """The ``n`` classes with the most requests, the rest summed as OTHER_CLASS."""
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    top = {name: count for name, count in ranked[:n] if name != OTHER_CLASS}
    rest = sum(count for name, count in counts.items() if name not in top)
    if rest:
        top[OTHER_CLASS] = rest
    return top


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


def _send_body(exchange: Exchange, wsgi_input) -> Optional[Upload]:
    """Send the request body: at once, in the same frame batch as the
    request, if it has all come and fits the worker's credit; else from an
    Upload greenlet, as it arrives, while the worker may answer."""
    size = getattr(wsgi_input, "buffered", -1)
    if getattr(wsgi_input, "complete", False) and 0 <= size <= min(exchange.credit, MAX_BODY):
        exchange.send(Body(exchange.rno, wsgi_input.read(size)), End(exchange.rno))
        return None
    return Upload(exchange, wsgi_input)


def _watch_client(sock, exchange: Exchange) -> None:
    """Cancel ``exchange`` if the client closes its connection."""
    try:
        gevent.socket.wait_read(sock.fileno())
        if sock.recv(1, socket.MSG_PEEK):
            return  # a pipelined request, not a hang-up
    except OSError:
        pass
    exchange.cancel(ClientGone("client went away while the worker worked"))


def _content_length(value: str) -> Optional[int]:
    try:
        length = int(value)
    except ValueError:
        raise BadResponse("worker sent Content-Length %r" % value)
    if length < 0:
        raise BadResponse("worker sent Content-Length %r" % value)
    return length


def _forwarded_environ(environ: dict, rclass: str) -> Dict[str, str]:
    """What the worker gets of ``environ``: its CGI variables less the
    hop-by-hop fields.  The front server's Relay makes them (for a worker
    that does not take head requests); an environ from elsewhere is
    sifted."""
    relay = environ.get(RELAY)
    forwarded = relay.variables() if relay is not None else environ.get(FORWARD)
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
