"""The LB: connections to workers, and the WSGI app that forwards requests.

``LB`` keeps one ``WorkerLink`` per known worker address; a link keeps a
connection open, reconnecting with backoff, and tells the pool when its
worker comes, sends a résumé, drains or goes.  The pool's handles are the
live ``Connection`` objects, so a reconnected worker is a new handle and
a stale one can never be chosen.

``LB.__call__`` is the WSGI application the HTTP front server runs:
classify, get a worker from the pool (waiting up to
``no_worker_timeout``), forward environ and body, stream the response
back, and ``put`` the worker when the response ends.

Failure semantics (DESIGN.md): a worker lost before the response starts
means a transparent retry for a GET or HEAD without a body, and 502
otherwise; lost mid-body, the iterator raises and the front server closes
the client's connection, so a truncated body never looks complete; no
worker in time gives 503.  All errors become responses in ``_error``.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Dict, Iterable, Optional, Tuple

import gevent
import gevent.event
import gevent.socket

from .connection import Connection, Exchange, Handler
from .errors import (
    ConnectionClosed,
    ConnectionLost,
    NoWorkerAvailable,
    RequestCancelled,
    ZcLbError,
)
from .pool import Pool
from .protocol import End, Response
from .worker import HOP_BY_HOP, parse_address

log = logging.getLogger(__name__)

CONNECT_TIMEOUT = 5.0
BACKOFF_MIN = 0.1
BACKOFF_MAX = 5.0
UPLOAD_CHUNK = 64 * 1024
HOP_BY_HOP_ENVIRON = frozenset(
    "HTTP_" + name.upper().replace("-", "_") for name in HOP_BY_HOP
) | {"HTTP_PROXY_CONNECTION"}
RETRY_METHODS = frozenset(("GET", "HEAD"))

DEFAULT_PAGES = {
    413: "413 Request Entity Too Large",
    502: "502 Bad Gateway",
    503: "503 Service Unavailable",
}


class ClientGone(ZcLbError):
    """The HTTP client went away while we read its request body."""

    http_status = 499


class WorkerLink(Handler):
    """Keeps a connection to one worker address, reconnecting with backoff."""

    def __init__(self, lb: "LB", address: str) -> None:
        self.lb = lb
        self.address = address
        self.connection: Optional[Connection] = None
        self.stopped = False
        self.failures = 0
        self.last_error: Optional[str] = None
        self._greenlet: Optional[gevent.Greenlet] = None

    def start(self) -> None:
        self._greenlet = gevent.spawn(self._run)

    def stop(self) -> None:
        """Stop reconnecting and close the connection (in-flight requests fail)."""
        self.stopped = True
        if self._greenlet is not None:
            self._greenlet.kill(block=False)
        if self.connection is not None:
            self.connection.close("worker removed")

    def _run(self) -> None:
        backoff = BACKOFF_MIN
        while not self.stopped:
            connection = self._connect()
            if connection is not None:
                backoff = BACKOFF_MIN
                connection.join()
            if self.stopped:
                return
            gevent.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX)

    def _connect(self) -> Optional[Connection]:
        try:
            sock = gevent.socket.create_connection(
                parse_address(self.address), timeout=CONNECT_TIMEOUT)
            sock.settimeout(None)
        except (OSError, ZcLbError) as exc:
            self._failed(str(exc))
            return None
        connection = Connection(sock, "lb", self, peer=self.address,
                                secret=self.lb.secret,
                                keepalive_interval=self.lb.keepalive_interval,
                                keepalive_timeout=self.lb.keepalive_timeout)
        try:
            connection.handshake()
        except (OSError, ZcLbError) as exc:
            connection.close("handshake failed")
            self._failed("handshake: %s" % exc)
            return None
        if self.stopped:
            connection.close("worker removed")
            return None
        self.connection = connection
        self.failures = 0
        self.last_error = None
        connection.start()
        self.lb._worker_up(connection)
        log.info("connected to worker %s", self.address)
        return connection

    def _failed(self, error: str) -> None:
        self.failures += 1
        if self.failures == 1 or self.failures % 20 == 0:
            log.warning("cannot connect to worker %s (%d tries): %s",
                        self.address, self.failures, error)
        self.last_error = error

    def handle_resume(self, connection: Connection, skills: Dict[str, float]) -> None:
        self.lb.pool.new_resume(connection, skills)

    def handle_goaway(self, connection: Connection, reason: str) -> None:
        log.info("worker %s is draining: %s", self.address, reason)
        self.lb._worker_down(connection)

    def connection_lost(self, connection: Connection, error: ZcLbError) -> None:
        if not self.stopped:
            log.warning("lost worker %s: %s", self.address, error)
        self.lb._worker_down(connection)
        if self.connection is connection:
            self.connection = None

    def __repr__(self) -> str:
        return "<WorkerLink %s %s>" % (
            self.address, "connected" if self.connection else "disconnected")


class ResponseBody:
    """The response body as a WSGI iterable: granting credit back to the
    worker as the client takes each chunk, and returning the worker to
    the pool when it ends (or cancelling the request if it did not)."""

    def __init__(self, lb: "LB", connection: Connection, exchange: Exchange,
                 first: Optional[bytes]) -> None:
        self.lb = lb
        self.connection = connection
        self.exchange = exchange
        self.first = first
        self.done = False

    def __iter__(self):
        exchange = self.exchange
        pending = 0
        if self.first is not None:
            pending = len(self.first)
            yield self.first
        while True:
            if pending:
                exchange.consumed(pending)
            message = exchange.receive()
            if isinstance(message, End):
                self.done = True
                return
            pending = len(message.data)  # type: ignore[union-attr]
            yield message.data  # type: ignore[union-attr]

    def close(self) -> None:
        if not self.done or not self.exchange.state.finished:
            self.exchange.cancel()
        self.lb._put(self.connection)


class LB:
    """The load balancer: worker links, the pool, and the forwarding app."""

    def __init__(
        self,
        pool: Pool,
        classifier: Callable[[dict], str],
        no_worker_timeout: float = 30.0,
        secret: Optional[bytes] = None,
        pages: Optional[Dict[int, bytes]] = None,
        max_request_body: Optional[int] = None,
        keepalive_interval: float = 1.0,
        keepalive_timeout: float = 5.0,
    ) -> None:
        self.pool = pool
        self.classifier = classifier
        self.no_worker_timeout = no_worker_timeout
        self.secret = secret
        self.max_request_body = max_request_body
        self.keepalive_interval = keepalive_interval
        self.keepalive_timeout = keepalive_timeout
        self.pages = {status: ("<html><body><h1>%s</h1></body></html>" % text).encode()
                      for status, text in DEFAULT_PAGES.items()}
        self.pages.update(pages or {})
        self.links: Dict[str, WorkerLink] = {}
        self.in_flight = 0
        self.requests = 0
        self.retries = 0
        self.errors: Dict[int, int] = {}
        self._workers_changed = gevent.event.Event()
        self.started = time.time()

    # -- membership ---------------------------------------------------

    def set_workers(self, addresses: Iterable[str]) -> None:
        """Make the known worker addresses exactly ``addresses``."""
        wanted = set(addresses)
        for address in list(self.links):
            if address not in wanted:
                self.links.pop(address).stop()
                log.info("worker %s removed", address)
        for address in sorted(wanted - set(self.links)):
            link = self.links[address] = WorkerLink(self, address)
            link.start()

    def stop(self) -> None:
        """Close every worker connection."""
        for link in list(self.links.values()):
            link.stop()
        self.links.clear()

    def _worker_up(self, connection: Connection) -> None:
        self.pool.add(connection)
        self._workers_changed.set()

    def _worker_down(self, connection: Connection) -> None:
        self.pool.remove(connection)

    def _put(self, connection: Connection) -> None:
        self.in_flight -= 1
        self.pool.put(connection)

    # -- forwarding ---------------------------------------------------

    def __call__(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        self.requests += 1
        try:
            return self._forward(environ, start_response)
        except ZcLbError as exc:
            return self._error(exc, start_response)

    def _forward(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        rclass = self._classify(environ)
        has_body = _has_body(environ, self.max_request_body)
        retryable = not has_body and environ["REQUEST_METHOD"] in RETRY_METHODS
        forwarded = _forwarded_environ(environ, rclass)
        for attempt in range(max(len(self.links), 1) + 1):
            connection = self._get_worker(rclass)
            try:
                exchange, response = self._exchange(connection, forwarded, environ, has_body)
            except (ConnectionLost, ConnectionClosed) as exc:
                self._put(connection)
                if retryable and attempt < len(self.links):
                    self.retries += 1
                    continue
                raise exc
            except BaseException:
                self._put(connection)
                raise
            return self._respond(connection, exchange, response, start_response)
        raise NoWorkerAvailable("no worker answered")

    def _classify(self, environ: dict) -> str:
        try:
            return str(self.classifier(environ))
        except Exception:
            log.exception("classifier failed; using the empty class")
            return ""

    def _get_worker(self, rclass: str) -> Connection:
        deadline = time.monotonic() + self.no_worker_timeout
        while True:
            connection = self.pool.get(rclass)
            if connection is not None:
                self.in_flight += 1
                return connection  # type: ignore[return-value]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise NoWorkerAvailable("no worker available after %gs" % self.no_worker_timeout)
            self._workers_changed.clear()
            self._workers_changed.wait(remaining)

    def _exchange(self, connection: Connection, forwarded: Dict[str, str],
                  environ: dict, has_body: bool) -> Tuple[Exchange, Response]:
        exchange = connection.open_request(forwarded, end=not has_body)
        if has_body:
            try:
                self._upload(exchange, environ["wsgi.input"])
            except ClientGone:
                exchange.cancel()
                raise
        response = exchange.receive()
        if not isinstance(response, Response):
            exchange.cancel()
            raise ConnectionLost("worker sent %s before a response" % type(response).__name__)
        return exchange, response

    def _upload(self, exchange: Exchange, wsgi_input) -> None:
        while True:
            try:
                data = wsgi_input.read(UPLOAD_CHUNK)
            except (OSError, ValueError) as exc:
                raise ClientGone("client went away during upload: %s" % exc)
            if not data:
                exchange.send(End(exchange.rno))
                return
            if not exchange.send_body(data, stop_on_response=True):
                return  # the worker answered early; stop uploading

    def _respond(self, connection: Connection, exchange: Exchange, response: Response,
                 start_response: Callable) -> Iterable[bytes]:
        headers = [(k, v) for (k, v) in response.headers if k.lower() not in HOP_BY_HOP]
        start_response(response.status, headers)
        body = ResponseBody(self, connection, exchange, None)
        return body

    def _error(self, exc: ZcLbError, start_response: Callable) -> Iterable[bytes]:
        status = exc.http_status
        if isinstance(exc, (RequestCancelled, ConnectionLost, ConnectionClosed)):
            status = 502
        self.errors[status] = self.errors.get(status, 0) + 1
        if status == 499:
            return []  # the client is gone; nobody to answer
        page = self.pages.get(status) or self.pages[502]
        reason = {413: "Request Entity Too Large", 502: "Bad Gateway",
                  503: "Service Unavailable"}.get(status, "Error")
        log.warning("%d for a request: %s", status, exc)
        start_response("%d %s" % (status, reason), [
            ("Content-Type", "text/html; charset=utf-8"),
            ("Content-Length", str(len(page)))])
        return [page]

    # -- introspection ------------------------------------------------

    def status(self) -> dict:
        """The status document: workers, backlogs, skills, requests in flight."""
        pool_status = self.pool.status()
        workers = pool_status.pop("workers")
        links = {}
        for address, link in sorted(self.links.items()):
            info: Dict[str, object] = {"connected": link.connection is not None}
            if link.connection is not None:
                info["in_pool"] = link.connection in self.pool
                info.update(workers.get(str(link.connection), {}))
                info["streams"] = len(link.connection.streams)
            else:
                info["last_error"] = link.last_error
            links[address] = info
        return {
            "pool": pool_status,
            "workers": links,
            "in_flight": self.in_flight,
            "requests": self.requests,
            "retries": self.retries,
            "errors": {str(k): v for k, v in sorted(self.errors.items())},
            "uptime": round(time.time() - self.started, 1),
        }

    def __repr__(self) -> str:
        return "<LB workers=%d in_flight=%d %r>" % (len(self.links), self.in_flight, self.pool)


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


class RequestTooLarge(ZcLbError):
    """The request body is larger than the LB accepts."""

    http_status = 413


def _forwarded_environ(environ: dict, rclass: str) -> Dict[str, str]:
    forwarded = {
        key: value for key, value in environ.items()
        if type(value) is str and key not in HOP_BY_HOP_ENVIRON
        and not key.startswith(("wsgi.", "gevent.", "zc_lb."))
    }
    forwarded["wsgi.url_scheme"] = environ.get("wsgi.url_scheme", "http")
    forwarded["zc_lb.request_class"] = rclass
    return forwarded
