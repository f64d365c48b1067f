"""An LB's links to its workers: one connection per worker address,
kept open, reconnected with jittered backoff, and closed gently.

A ``WorkerLink`` knows nothing of the LB but two small things: a
``LinkConfig`` (secret, keepalives, drain timeout) and a ``LinkEvents``
to tell when its worker comes (``worker_up``), sends a résumé
(``worker_resume``), falls silent or speaks again, drains (GoAway) or
goes (``worker_down``).  A draining or removed worker leaves the pool at
once, but its connection is closed only once the requests in flight on
it are done (``close_when_idle``, on the connection's idle event), so
neither a worker's SIGTERM nor its removal from ZooKeeper cuts a
response.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import gevent  # type: ignore[import-untyped]
import gevent.socket  # type: ignore[import-untyped]

from zc_lb.wire.connection import Connection, Handler
from zc_lb.wire.intake import ResumeRefused
from zc_lb.wire.keepalive import KEEPALIVE_INTERVAL, KEEPALIVE_TIMEOUT
from zc_lb.sockets import connect, parse_listen
from zc_lb.errors import ZcLbError
from zc_lb.settings import LB_SETTINGS

log = logging.getLogger(__name__)

CONNECT_TIMEOUT = 5.0
BACKOFF_MIN = 0.1
BACKOFF_MAX = 5.0
STEADY = 10.0  # seconds a connection lasts for the next try to come at BACKOFF_MIN again
REFUSED_LOG_INTERVAL = 60.0  # seconds between the log lines of a worker's résumés refused


@dataclass(frozen=True)
class LinkConfig:
    """What every link of an LB shares."""

    secret: Optional[bytes] = None
    keepalive_interval: float = KEEPALIVE_INTERVAL
    keepalive_timeout: float = KEEPALIVE_TIMEOUT
    drain_timeout: float = LB_SETTINGS["drain_timeout"].default  # for a draining worker's requests
    tls: Any = None  # the client SSLContext for workers (tls.lb_context), or None: cleartext


class LinkEvents:
    """What a link tells its owner (the LB); subclass and override."""

    def worker_up(self, connection: Connection) -> None:
        """A connection to a worker is open and may take requests."""

    def worker_resume(self, connection: Connection, skills: Dict[str, float]) -> None:
        """The worker sent its résumé."""

    def worker_keys(self, connection: Connection, keys: Dict[str, List[int]]) -> None:
        """The worker relayed the keys another LB sent it (``frames.Keys``)."""

    def worker_silent(self, connection: Connection, seconds: float) -> None:
        """The worker has said nothing for ``seconds``: it may be stuck."""

    def worker_heard(self, connection: Connection) -> None:
        """The worker speaks again after a silence."""

    def worker_down(self, connection: Connection) -> None:
        """The connection must take no new request (draining, removed, lost)."""


class WorkerLink(Handler):
    """Keeps a connection to one worker address, reconnecting with backoff."""

    def __init__(self, address: str, config: LinkConfig, events: LinkEvents) -> None:
        self.config = config
        self.events = events
        self.address = address
        self.connection: Optional[Connection] = None
        self.stopped = False
        self.failures = 0
        self.last_error: Optional[str] = None
        self.refusals = 0  # connections in a row the worker refused once they seemed open
        self.greeted: Optional[Connection] = None  # the last connection the worker took
        self.resume: Dict[str, float] = {}
        self.draining: Optional[Connection] = None  # said GoAway: a planned end
        self.resumes_refused = 0  # all told (``handle_resume_refused``)
        self._refused_logged: Optional[float] = None  # when the last was logged
        self._refused_unlogged = 0  # refused since
        self._greenlet: Optional[gevent.Greenlet] = None
        self._successor: Optional[gevent.Greenlet] = None  # connecting while one drains

    def start(self) -> None:
        self._greenlet = gevent.spawn(self._run)

    def stop(self, drain_timeout: float = 0.0) -> None:
        """Stop reconnecting; close the connection once the requests in
        flight on it are done, or after ``drain_timeout`` seconds."""
        self.stopped = True
        if self._greenlet is not None:
            self._greenlet.kill(block=False)
        connection = self.connection
        if connection is not None:
            self.events.worker_down(connection)
            if drain_timeout > 0:
                gevent.spawn(close_when_idle, connection, drain_timeout, "worker removed")
            else:
                connection.close("worker removed")

    def _run(self) -> None:
        """Connect, and again whenever the connection ends, after a
        backoff that doubles up to BACKOFF_MAX: from BACKOFF_MIN again
        once a connection lasted STEADY seconds (a worker that restarts
        is back soon), not after one that ended at once (one that dies
        as it starts is not tried ten times a second)."""
        backoff = BACKOFF_MIN
        while not self.stopped:
            connection = self._connect()
            while connection is not None:
                began = time.monotonic()
                connection.join()
                if time.monotonic() - began >= STEADY:
                    backoff = BACKOFF_MIN
                connection = self._successor_of(connection)
            if self.stopped:
                return
            gevent.sleep(backoff * random.uniform(0.5, 1.0))  # LBs out of step
            backoff = min(backoff * 2, BACKOFF_MAX)

    def _successor_of(self, connection: Connection) -> Optional[Connection]:
        """The connection opened while ``connection`` drained (``handle_goaway``),
        once it is up, if it is."""
        successor, self._successor = self._successor, None
        if successor is not None:
            successor.join()
        current = self.connection
        return current if current is not None and current is not connection and (
            not current.closed) else None

    def _connect(self) -> Optional[Connection]:
        sock = self._socket()
        connection = None if sock is None else self._handshake(sock)
        if connection is None:
            return None
        if self.stopped:
            connection.close("worker removed")
            return None
        self.connection = connection
        self.failures = 0
        self.last_error = None
        connection.start()
        self.events.worker_up(connection)
        # (not said yet at INFO: without a secret our Hello is still the
        # worker's to refuse, and one that does would have every try say
        # "connected"; its first résumé says it took us, ``handle_resume``)
        log.debug("connected to worker %s; its résumé to come", self.address)
        return connection

    def _socket(self) -> Any:
        """A socket connected to the worker (through TLS if configured),
        or None (said in ``_failed``)."""
        tls = self.config.tls
        try:
            where = parse_listen(self.address)
            # (a Unix socket's worker is this machine: its certificate names localhost)
            host = where[0] if isinstance(where, tuple) else "localhost"
            sock = connect(where, CONNECT_TIMEOUT)
        except (OSError, UnicodeError, ZcLbError) as exc:  # (a host name IDNA refuses:
            # a label past 63 characters, or empty, as anyone may register in ZooKeeper)
            self._failed(str(exc))
            return None
        if tls is not None:
            try:  # (the handshake, within the connect timeout)
                sock = tls.wrap_socket(sock, server_hostname=host.strip("[]"))
            except OSError as exc:  # (ssl.SSLError too)
                sock.close()
                self._failed("TLS handshake: %s%s" % (exc, "" if "CERTIFICATE" in str(exc)
                                                     else " (does the worker have --tls-cert?)"))
                return None
        sock.settimeout(None)
        return sock

    def _handshake(self, sock: Any) -> Optional[Connection]:
        """The worker protocol's connection on ``sock``, past its handshake,
        or None (said in ``_failed``)."""
        config = self.config
        connection = Connection(sock, "lb", self, peer=self.address, secret=config.secret,
                                keepalive_interval=config.keepalive_interval,
                                keepalive_timeout=config.keepalive_timeout)
        try:
            connection.handshake()
        except (OSError, ZcLbError) as exc:
            connection.close("handshake failed")
            hint = ""
            if config.tls is None and (isinstance(exc, ConnectionResetError)
                                       or "closed during handshake, before" in str(exc)):
                # (a worker that takes TLS only drops a cleartext Hello unread)
                hint = (" (if the worker takes TLS only, give the LB --worker-tls-cert, "
                        "--worker-tls-key and --worker-tls-ca)")
            self._failed("handshake: %s%s" % (exc, hint))
            return None
        return connection

    def _failed(self, error: str) -> None:
        self.failures += 1
        if self.failures == 1 or self.failures % 20 == 0:
            log.warning("cannot connect to worker %s (%d tries): %s",
                        self.address, self.failures, error)
        self.last_error = error

    def handle_resume(self, connection: Connection, skills: Dict[str, float]) -> None:
        if connection is not self.greeted:  # (a worker greets an LB it takes with its résumé)
            self.greeted = connection
            log.info("connected to worker %s", self.address)
        self.resume = skills  # kept for a readmission after an ejection
        self.events.worker_resume(connection, skills)

    def handle_resume_refused(self, connection: Connection, refused: ResumeRefused) -> None:
        """Log a résumé refused (``wire/intake.py``): the first, then at
        most one line every REFUSED_LOG_INTERVAL, counting those between."""
        self.resumes_refused += 1
        now = time.monotonic()
        if self._refused_logged is not None and now - self._refused_logged < REFUSED_LOG_INTERVAL:
            self._refused_unlogged += 1
            return
        since = ""
        if self._refused_unlogged:
            since = " (and %d more since the last said)" % self._refused_unlogged
        log.warning("worker %s sent a résumé of %d bytes%s, %s: dropped, its skills kept%s",
                    self.address, refused.size, "" if refused.classes is None else
                    " and %d classes" % refused.classes, refused.reason, since)
        self._refused_logged, self._refused_unlogged = now, 0

    def handle_keys(self, connection: Connection, keys: Dict[str, List[int]]) -> None:
        self.events.worker_keys(connection, keys)

    def handle_goaway(self, connection: Connection, reason: str) -> None:
        """The worker said GoAway, or we did (the connection's request
        numbers run out): it drains, and for our own, the next connection
        opens at once, so that the worker serves on meanwhile."""
        if connection is self.draining:  # (once: a peer's repeats change nothing)
            return
        log.info("worker %s is draining: %s", self.address, reason)
        self.draining = connection
        self.events.worker_down(connection)
        gevent.spawn(close_when_idle, connection, self.config.drain_timeout, "worker draining")
        if (connection is self.connection and not connection.protocol.peer_goes_away
                and not self.stopped and self._successor is None):
            self._successor = gevent.spawn(self._connect)

    def handle_silent(self, connection: Connection, seconds: float) -> None:
        self.events.worker_silent(connection, seconds)

    def handle_heard(self, connection: Connection) -> None:
        self.events.worker_heard(connection)

    def connection_lost(self, connection: Connection, error: ZcLbError) -> None:
        if connection is self.draining:
            if not connection.broke_protocol:  # (the connection said that one)
                log.info("worker %s drained and closed", self.address)
            self.draining = None
        elif connection is not self.connection:
            return  # never came up (its handshake failed): nothing to take down
        elif connection.refused:  # (its handshake failed, as the worker saw it)
            self.refusals += 1
            if self.refusals == 1 or self.refusals % 20 == 0:
                log.warning("cannot connect to worker %s (refused %d times): %s",
                            self.address, self.refusals, error)
            self.last_error = str(error)
        elif not self.stopped:
            self.refusals = 0
            if not connection.broke_protocol:  # (the connection said that one)
                log.warning("lost worker %s: %s", self.address, error)
        self.events.worker_down(connection)
        if self.connection is connection:
            self.connection = None

    def __repr__(self) -> str:
        return "<WorkerLink %s %s>" % (
            self.address, "connected" if self.connection else "disconnected")


def close_when_idle(connection: Connection, timeout: float, reason: str) -> None:
    """Close ``connection`` once nothing is in flight on it (or at ``timeout``)."""
    connection.idle.wait(timeout)
    connection.close(reason, flush_timeout=1.0)
