"""The LBs' connections to a worker: admitted, kept, and told what every
LB is told (``LBConnections``).

Rules:

- A connection is admitted once through its TLS handshake (when the
  worker has TLS), bounded by ``HANDSHAKE_TIMEOUT``, and the protocol's
  handshake, in which the LB proves the shared secret.  At most
  ``MAX_HANDSHAKING`` are in their handshakes (either) at once: they are
  unauthenticated and held, so the oldest is closed to make room for a
  newer one.
- A refusal is logged: each at once, but in a flood (a port scanned,
  junk) one line every ``CROWDED_LOG_EVERY`` seconds with the count, so
  that it cannot fill the log.
- An LB silent for ``LB_SILENCE`` seconds is dropped.  A connection over
  loopback or a Unix socket sends files by copying (``sendfile`` auto:
  see the settings).
- What goes to every LB (a résumé, the keys another LB sent, GoAway)
  skips a connection that fails: it is ending, and its loss comes as
  ``lost`` from the worker's ``connection_lost``.
- The keys another LB sent skip an LB that takes nothing in (stuck,
  its connection open): while more than ``RELAY_BACKLOG`` bytes wait
  for its socket, they are dropped, said once when it starts and once
  when it catches up, so that it costs the worker at most that much
  until its silence drops it (``LB_SILENCE``).  A book missing a few
  keys only routes them as if new.  A résumé for such an LB waits
  instead, one at most, a newer one replacing it, and goes once the
  bytes ahead of it went out: each supersedes the last, so the LB gets
  the newest skills when it reads again.

The worker (the connections' handler) decides what an admitted
connection is first told and when to stop admitting.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import time
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import gevent  # type: ignore[import-untyped]
import gevent.event  # type: ignore[import-untyped]

from zc_lb.errors import ConfigurationError, ZcLbError
from zc_lb.sockets import is_loopback
from zc_lb.wire.connection import HANDSHAKE_TIMEOUT, Connection, Handler
from zc_lb.wire.encoder import encode
from zc_lb.wire.frames import HEADER_SIZE
from zc_lb.wire.handshake import HANDSHAKE_LIMIT, new_hello

log = logging.getLogger(__name__)

# Seconds of silence before a worker drops an LB: long, since an LB whose
# loop was blocked (a site's classifier) must not lose every worker, and
# a dead LB costs a worker only the requests it had sent.
LB_SILENCE = 60.0
MAX_HANDSHAKING = 64  # connections in their handshake at once; the oldest makes room
CROWDED_LOG_EVERY = 10.0
# bytes waiting for an LB's socket past which keys skip it and résumés wait
RELAY_BACKLOG = 1024 * 1024


class LBConnections:
    """A worker's connections from its LBs: ``admit`` one accepted on the
    worker's port, ``add`` it to keep it; ``connections`` are those kept."""

    def __init__(self, handler: Handler, features: Tuple[str, ...],
                 secret: Optional[bytes] = None, version: Optional[str] = None,
                 tls: Any = None, sendfile: str = "auto") -> None:
        self.handler = handler  # (the worker: what each connection tells)
        self.features = features  # what we offer LBs beyond version 1
        self.secret = secret
        self.version = version  # the application's, told to every LB in our Hello
        self._instance = ("", "")  # (pid, this worker's id in its Hellos: ``instance``)
        hello = len(encode(new_hello("worker", secret, version, features))) - HEADER_SIZE
        if hello > HANDSHAKE_LIMIT:  # (every LB would refuse every connection)
            raise ConfigurationError(
                "--version is too long: %d characters make a Hello of %d bytes, over the "
                "%d an LB takes" % (len(version or ""), hello, HANDSHAKE_LIMIT))
        self.tls = tls  # the server SSLContext (tls.worker_context), or None: cleartext
        self.sendfile = sendfile
        self.connections: Set[Connection] = set()
        # Connections not yet through their handshakes (TLS's, then the
        # protocol's), oldest first, each with what closes it: at most
        # MAX_HANDSHAKING (an LB's take milliseconds; held ones cost a
        # descriptor and memory).
        self._handshaking: "collections.OrderedDict[Any, Callable[[], None]]" = (
            collections.OrderedDict())
        self._crowded = 0
        self._crowded_logged = -CROWDED_LOG_EVERY
        self._rejected = 0  # connections refused in their handshake since the last line
        self._rejected_logged = -CROWDED_LOG_EVERY
        self._behind: Dict[Connection, int] = {}  # LBs keys skip (RELAY_BACKLOG): how many
        self._owed: Dict[Connection, Dict[str, float]] = {}  # the résumé each such LB waits for
        self._no_lbs = gevent.event.Event()  # set while no LB is connected
        self._no_lbs.set()

    @property
    def instance(self) -> str:
        """This worker's id in its Hellos: random, alike on all its
        connections, another in a process forked after it was made."""
        pid = str(os.getpid())
        if self._instance[0] != pid:
            self._instance = (pid, os.urandom(8).hex())
        return self._instance[1]

    def admit(self, sock: Any, address: Any) -> Optional[Connection]:
        """The connection of ``sock``, accepted from ``address``, through
        its handshakes and not yet started; None if it was refused (and
        closed, and logged)."""
        peer = "%s:%s" % address[:2] if isinstance(address, tuple) else "a local process"
        handshaking = self._handshaking
        if len(handshaking) >= MAX_HANDSHAKING:  # unauthenticated, and held: make room
            _, close = handshaking.popitem(last=False)
            close()
            self._say_crowded(peer)
        key = sock  # (its place among those in their handshakes, kept through both)
        handshaking[key] = sock.close
        try:
            if self.tls is not None:
                sock = self._wrap(key, sock, peer)
                if sock is None:
                    return None
            connection = Connection(sock, "worker", self.handler, peer=peer,
                                    secret=self.secret, app_version=self.version,
                                    features=self.features, keepalive_timeout=LB_SILENCE,
                                    instance=self.instance)
            if self.sendfile == "off" or (self.sendfile == "auto" and (
                    not isinstance(address, tuple) or is_loopback(address[0]))):
                connection.sendfile = False  # (its bytes are copied either way: see settings)
            return connection if self._handshake(key, connection, peer) else None
        finally:
            handshaking.pop(key, None)

    def _wrap(self, key: Any, sock: Any, peer: str) -> Any:
        """``sock`` through its TLS handshake, or None (closed, logged
        unless it was closed to make room)."""
        tls_sock = None
        try:  # (bounded: a peer that stalls it holds nothing for long)
            with gevent.Timeout(HANDSHAKE_TIMEOUT):
                tls_sock = self.tls.wrap_socket(sock, server_side=True,
                                                do_handshake_on_connect=False)
                if key in self._handshaking:  # (what closes it now: it took the descriptor)
                    self._handshaking[key] = tls_sock.close
                tls_sock.do_handshake()
                return tls_sock
        except (OSError, gevent.Timeout) as exc:  # (ssl.SSLError too)
            (sock if tls_sock is None else tls_sock).close()
            if key in self._handshaking:  # (not: it made room for a newer one)
                self._say_rejected(peer, "TLS handshake: %s%s" % (
                    exc or "timed out", " (a cleartext LB? give it --worker-tls-cert)"
                    if "WRONG_VERSION" in str(exc) or "HTTP_REQUEST" in str(exc) else ""))
            return None

    def _handshake(self, key: Any, connection: Connection, peer: str) -> bool:
        """The protocol's handshake, ``connection`` holding the place of
        ``key`` among those in their handshakes; whether it went through
        (if not, the connection is closed)."""
        if key in self._handshaking:
            self._handshaking[key] = functools.partial(
                connection.close, "too many connections in their handshake")
        else:  # (made room for a newer one during its TLS handshake)
            connection.close("too many connections in their handshake")
            return False
        try:
            connection.handshake()
        except (ZcLbError, OSError) as exc:
            if not connection.closed:  # (closed: it made room for a newer one)
                self._say_rejected(peer, exc)
                connection.close("handshake failed")
            return False
        return True

    def _say_crowded(self, peer: str) -> None:
        """Log connections crowding the handshake, at most every 10 s."""
        now = time.monotonic()
        self._crowded += 1
        if now - self._crowded_logged >= CROWDED_LOG_EVERY:
            log.warning("%d connections closed in their handshake to make room for "
                        "newer ones (more than %d at once; the latest from %s)",
                        self._crowded, MAX_HANDSHAKING, peer)
            self._crowded, self._crowded_logged = 0, now

    def _say_rejected(self, peer: str, error: object) -> None:
        """Log a connection refused in its handshake (no secret, a wrong
        one, junk): each at once, but in a flood one line every 10 s
        with the count (a port scanned must not fill the log)."""
        now = time.monotonic()
        self._rejected += 1
        if now - self._rejected_logged >= CROWDED_LOG_EVERY:
            if self._rejected == 1:
                log.warning("rejected connection from %s: %s", peer, error)
            else:
                log.warning("rejected %d connections in their handshake in %.0fs (the "
                            "latest from %s: %s)", self._rejected,
                            now - self._rejected_logged, peer, error)
            self._rejected, self._rejected_logged = 0, now

    def add(self, connection: Connection) -> None:
        """Keep an admitted connection, and start it."""
        self.connections.add(connection)
        self._no_lbs.clear()
        connection.start()
        log.info("LB connected from %s", connection.peer)

    def lost(self, connection: Connection, error: ZcLbError) -> None:
        """``connection`` ended (the worker's ``connection_lost``)."""
        self._behind.pop(connection, None)
        self._owed.pop(connection, None)
        if connection in self.connections:
            self.connections.discard(connection)
            if not self.connections:
                self._no_lbs.set()
            if connection.refused:  # (in a flood, one line every 10 s)
                self._say_rejected(connection.peer, error)
            elif not connection.broke_protocol:  # (the connection said that one)
                log.info("LB connection from %s ended: %s", connection.peer, error)

    def wait_gone(self, timeout: Optional[float] = None) -> bool:
        """Wait until no LB is connected, at most ``timeout`` seconds;
        whether none is."""
        return self._no_lbs.wait(timeout)

    def relay_keys(self, connection: Connection, keys: Dict[str, List[int]]) -> None:
        """An LB sent the keys it sent us: relay them to our other LBs
        (``frames.Keys``), so that each knows where every key's data is;
        not to one that takes nothing in (``RELAY_BACKLOG``)."""
        for other in list(self.connections):
            if other is connection:
                continue
            if self._backed_up(other):
                self._behind[other] += 1
                continue
            try:
                other.send_keys(keys)
            except ZcLbError:
                pass

    def _backed_up(self, connection: Connection) -> bool:
        """Whether keys skip ``connection``: more than RELAY_BACKLOG bytes
        wait for its socket.  Said when it starts, and when it ends."""
        behind = self._behind
        if connection.queued > RELAY_BACKLOG:
            if connection not in behind:
                behind[connection] = 0
                log.warning("LB %s takes nothing in (%d bytes wait for its socket): the "
                            "keys other LBs send are not relayed to it, and its next résumé "
                            "waits, until it catches up", connection.peer, connection.queued)
            return True
        if connection in behind:
            log.info("LB %s takes its bytes in again: %d relays of keys were dropped for it",
                     connection.peer, behind.pop(connection))
        return False

    def send_resume(self, skills: Dict[str, float]) -> None:
        """Send every LB the résumé ``skills``; to one that takes nothing in
        (``RELAY_BACKLOG``), once it reads again, unless a newer one comes
        first (``_resume_when_read``)."""
        owed = self._owed
        for connection in list(self.connections):
            if connection in owed or self._backed_up(connection):
                if connection not in owed:
                    gevent.spawn(self._resume_when_read, connection)
                owed[connection] = skills  # (in place of one still waiting)
                continue
            try:
                connection.send_resume(skills)
            except ZcLbError:
                pass

    def _resume_when_read(self, connection: Connection) -> None:
        """Send ``connection`` the résumé it waits for once no more than
        ``RELAY_BACKLOG`` bytes wait for its socket (or nothing, if it ends)."""
        while not connection.closed and self._backed_up(connection):
            connection.wait_flushed(1.0)  # (and look again: it may read a little)
        skills = self._owed.pop(connection, None)
        if skills is not None and not connection.closed:
            try:
                connection.send_resume(skills)
            except ZcLbError:
                pass

    def send_goaway(self, reason: str) -> None:
        """Tell every LB to send nothing new."""
        for connection in list(self.connections):
            try:
                connection.send_goaway(reason)
            except ZcLbError:
                pass

    def close(self, reason: str, deadline: float) -> None:
        """Close every connection, each with until ``deadline`` (monotonic;
        a second at least) to send what it holds."""
        for connection in list(self.connections):
            connection.close(reason, flush_timeout=max(deadline - time.monotonic(), 1))
