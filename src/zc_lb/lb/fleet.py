"""The LB's workers: a link to each, and who of them is in the pool.

``Fleet`` keeps one ``WorkerLink`` (lb/links.py) per known worker
address and hears what the links tell (``LinkEvents``): a worker
connected, sent a résumé, fell silent or spoke again, went.  It decides
which connected workers are in the pool: not one ejected for failing
where its peers do not (lb/outlier.py: each request's outcome is told
to ``outcome``, health checks count as requests), nor one an operator
drained, until its ejection ends or an operator enables it.  With
several LBs it relays the keys this LB sent each worker through the
workers to the others (``relay_turn``, routing/affinity.py, "Several
LBs").

The LB (lb/balancer.py) forwards requests; it reads the fleet's
``changed`` event while it waits for a worker, and is told through two
callables when a worker is added and removed (its counters begin and end
with it), when one falls silent (its requests waiting for a response move
elsewhere) and when one is ejected (the chores that readmit it must run,
requests or none: ``LB._tick``).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Dict, Hashable, Iterable, List, Optional, Set, cast

import gevent  # type: ignore[import-untyped]
import gevent.event  # type: ignore[import-untyped]
import orjson

from zc_lb.environ import REQUEST_CLASS
from zc_lb.errors import ConfigurationError, ZcLbError
from zc_lb.lb.links import LinkConfig, LinkEvents, WorkerLink
from zc_lb.lb.outlier import Ejector
from zc_lb.routing.affinity import AffinityPool
from zc_lb.routing.pool import RESUME_STEP, Pool
from zc_lb.wire.connection import Connection
from zc_lb.wire.frames import Response

log = logging.getLogger(__name__)

RELAY_INTERVAL = 0.05  # seconds between the keys an LB sends each worker to relay
RELAY_FRAME = 128 * 1024  # bytes of keys in one frame at most (frames.Keys)

# What the status document says of a worker not in the pool: every key a
# pooled one has, so that a reader need not guess.
_DOWN: Dict[str, object] = {"connected": False, "in_pool": False, "drained": False, "standby": False,
         "twin_of": None,
         "backlog": 0, "siblings_backlog": 0, "mean_backlog": 0.0, "skills": {},
         "version": None, "streams": 0, "last_error": None}


class Fleet(LinkEvents):
    """The known workers' links, and which of them the pool may choose."""

    def __init__(self, pool: Pool, link_config: LinkConfig, ejector: Ejector,
                 added: Callable[[str], None], removed: Callable[[str], None],
                 silent: Callable[[Connection, float], int],
                 ejected: Callable[[], None]) -> None:
        self.pool = pool
        # The pool's book of keys, relayed between the LBs: the affinity
        # policy's alone (a pool of another policy leaves the relayed keys).
        self.book: Optional[AffinityPool] = pool if isinstance(pool, AffinityPool) else None
        self.link_config = link_config
        self.ejector = ejector
        self.added = added  # a worker address known
        self.removed = removed  # a worker address gone for good
        self.silent = silent  # a silent worker's waiting requests moved: how many
        self.ejected = ejected  # a worker ejected: the chores that readmit it run
        self.links: Dict[str, WorkerLink] = {}
        self.drained: Set[str] = set()  # addresses an operator drained
        self.standby: Dict[str, Optional[str]] = {}  # other-version workers: their versions
        # Addresses of a worker reached by another address too, which the
        # pool has (the same process: its Hello's ``instance``): that one
        self.twins: Dict[str, str] = {}  # is pooled, this one not; by address
        self.changed = gevent.event.Event()  # set when a worker joins the pool
        self.worker_failures = 0  # worker 5xx and connections failing under a request
        self.health_checks = 0
        self._health: Optional[gevent.Greenlet] = None
        self._relay: Optional[gevent.Greenlet] = None  # (``_relay_keys``)

    def set_workers(self, addresses: Iterable[str],
                    standby: Optional[Dict[str, Optional[str]]] = None) -> None:
        """Make the known worker addresses exactly ``addresses``;
        ``standby``: workers of another version, not served (ZooKeeper's
        ``single_version``), with their versions, shown in the status."""
        self.standby = dict(standby or {})
        wanted = set(addresses)
        for address in list(self.links):
            if address not in wanted:
                self.links.pop(address).stop(self.link_config.drain_timeout)
                self.ejector.forget(address)  # (an ejection of a worker gone counts no more)
                self.removed(address)
                log.info("worker %s removed", address)
        for address in sorted(wanted - set(self.links)):
            self.added(address)
            link = self.links[address] = WorkerLink(address, self.link_config, self)
            link.start()

    def known(self) -> str:
        """The known workers, for a log line: their addresses and last errors."""
        if not self.links:
            return "none known: give --worker, or register workers in ZooKeeper"
        return "known: " + ", ".join(
            "%s%s" % (address, " (%s)" % link.last_error if link.last_error else "")
            for address, link in sorted(self.links.items())[:10])

    def wait_for_workers(self, timeout: float) -> bool:
        """Wait until every known worker is connected and in the pool, at
        most ``timeout`` seconds; whether they all are."""
        return self._wait_until(self._all_in_pool, timeout)

    def wait_until_serving(self, timeout: float) -> bool:
        """Wait until the pool has a worker and every known worker is in
        it (ZooKeeper may name them later than the start), at most
        ``timeout`` seconds; whether it got there."""
        return self._wait_until(lambda: bool(len(self.pool)) and self._all_in_pool(), timeout)

    def wait_for_pool(self, timeout: float) -> bool:
        """Wait until the pool has a worker, at most ``timeout`` seconds;
        whether it has."""
        return self._wait_until(lambda: bool(len(self.pool)), timeout)

    def _all_in_pool(self) -> bool:
        return all(link.connection is not None
                   and (link.connection in self.pool or address in self.twins)
                   for address, link in self.links.items())

    def _wait_until(self, condition: Callable[[], bool], timeout: float) -> bool:
        """Wait, as workers come and go, until ``condition()``, at most
        ``timeout`` seconds; whether it came true."""
        deadline = time.monotonic() + timeout
        while not condition():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self.changed.clear()
            self.changed.wait(min(remaining, 0.1))
        return True

    def stop(self) -> None:
        """Close every worker connection."""
        if self._health is not None:
            self._health.kill(block=False)
        if self._relay is not None:
            self._relay.kill(block=False)
        for link in list(self.links.values()):
            link.stop()
        self.links.clear()

    # -- what the links tell (LinkEvents) ------------------------------

    def worker_up(self, connection: Connection) -> None:
        if self.ejector.reconnected(connection.peer):
            log.info("worker %s connected anew: readmitted on probation", connection.peer)
        if not self._admit(connection):
            self._hold_share()  # (ejected: it may be the one left)
        self.lbs_changed()

    def worker_resume(self, connection: Connection, skills: Dict[str, float]) -> None:
        """A worker's new résumé: a large one is taken in steps, the rest
        of the loop running between them (``Pool.new_resume``)."""
        self.pool.new_resume(connection, skills,
                             _let_others_run if len(skills) > RESUME_STEP else None)

    def worker_keys(self, connection: Connection, keys: Dict[str, List[int]]) -> None:
        """A worker relayed the keys another LB sent it: the pool's book
        says they are there.  A pool of another policy keeps no book: the
        workers relay to every LB all the same, and it leaves them."""
        book = self.book
        if book is not None and connection in book:
            book.take_keys(connection, keys)

    def worker_silent(self, connection: Connection, seconds: float) -> None:
        """A worker says nothing (stopped, or its loop blocked): send it
        nothing new, and move its GETs and HEADs that have no answer yet to
        other workers now, not when its keepalive times out.  The silence
        is one failure toward its ejection, however many requests moved
        (a pause of two seconds under six GETs is not six failures in a
        row: those ejected a worker that spoke again a moment later)."""
        self.pool.remove(connection)
        moved = self.silent(connection, seconds)
        log.warning("worker %s silent for %.1fs: sending it nothing new, %d GET/HEAD "
                    "moved to other workers", connection.peer, seconds, moved)
        self.outcome(connection, ok=False)
        self._hold_share()

    def worker_heard(self, connection: Connection) -> None:
        link = self.links.get(connection.peer)
        if link is None or _open(link) is not connection:
            return
        log.info("worker %s speaks again", connection.peer)
        if not self._admit(connection, link.resume):
            self._hold_share()  # (ejected: it may be the one left)

    def worker_down(self, connection: Connection) -> None:
        self.pool.remove(connection)
        address = connection.peer
        self.twins.pop(address, None)
        for twin in [twin for twin, of in self.twins.items() if of == address]:
            link = self.links.get(twin)  # (the same worker, by another address)
            if link is not None and link.connection is not None:
                self._admit(link.connection, link.resume)
        self._hold_share()

    # -- who is in the pool ----------------------------------------------

    def _admit(self, connection: Connection, resume: Optional[Dict[str, float]] = None) -> bool:
        """Put a connected worker in the pool, unless its connection takes no
        request (not its link's open one, draining, or silent: it comes back
        once heard), it is ejected (it is readmitted when its ejection is
        over) or an operator drained it."""
        address = connection.peer
        link = self.links.get(address)
        if (link is None or _open(link) is not connection or connection.suspect
                or self.ejector.ejected(address) or address in self.drained
                or self._twin(connection)):
            return False
        self.pool.add(connection, resume, version=app_version(connection))
        self.changed.set()
        return True

    def _twin(self, connection: Connection) -> bool:
        """Whether the pool has ``connection``'s worker already by another
        address (``_pooled_as``): it is pooled once, said once (``twins``)."""
        address = connection.peer
        pooled_as = _pooled_as(connection, self.links, self.pool)
        if pooled_as is not None:
            if self.twins.get(address) != pooled_as:
                self.twins[address] = pooled_as
                log.warning("worker %s is worker %s by another address (one process): "
                            "it is pooled once, as %s", address, pooled_as, pooled_as)
            return True
        if self.twins.pop(address, None) is not None:
            log.info("worker %s pooled: the worker it was reached as too is not", address)
        return False

    def drain_worker(self, address: str) -> None:
        """An operator's drain: send the worker nothing new (its requests in
        flight finish) until ``enable_worker``; it stays connected."""
        link = self._known(address)
        self.drained.add(address)
        if link.connection is not None:
            self.pool.remove(link.connection)
        log.warning("worker %s drained by an operator: nothing new goes to it", address)
        self._hold_share()

    def _serving(self) -> List[str]:
        """The workers that could serve now, ejected or not: connected,
        neither draining, silent nor drained by an operator."""
        return [address for address, link in self.links.items()
                if address not in self.drained
                and (connection := _open(link)) is not None and not connection.suspect]

    def _hold_share(self) -> None:
        """The workers that could serve changed (one went, or an ejected
        one came): readmit, on probation, the ejected ones past
        ``max_ejected`` of them (``Ejector.over_share``), so that the
        workers down and the workers ejected never empty the pool
        together."""
        serving = self._serving()
        for address in self.ejector.over_share(cast(List[Hashable], serving)):
            link = self.links[cast(str, address)]
            if link.connection is not None and self._admit(link.connection, link.resume):
                log.warning("readmitted worker %s on probation: its ejection was past "
                            "max_ejected of the %d worker(s) that can serve now", address,
                            len(serving))

    def enable_worker(self, address: str) -> bool:
        """Undo ``drain_worker``, or readmit an ejected worker at once (the
        operator's word that it is healthy); whether there was anything
        to undo.  As a drain, it may be asked again: a worker neither
        drained nor ejected is left as it is (a retried action, or one
        through a ``--processes`` supervisor some children had taken).
        A drained worker not known now (deregistered, away for
        maintenance) is enabled too: it comes back so."""
        if address not in self.links and address in self.drained:
            self.drained.discard(address)
            log.warning("worker %s enabled by an operator (not known now: it comes back "
                        "enabled)", address)
            return True
        link = self._known(address)
        readmitted = self.ejector.readmit_now(address)
        if not (readmitted or address in self.drained):
            log.info("worker %s enabled by an operator: it was neither drained nor ejected",
                     address)
            return False
        self.drained.discard(address)
        if link.connection is not None:
            self._admit(link.connection, link.resume)
        log.warning("worker %s %s by an operator", address,
                    "readmitted" if readmitted else "enabled")
        return True

    def _known(self, address: str) -> WorkerLink:
        """The link of worker ``address``, for an operator's action;
        ConfigurationError naming the known ones if there is none."""
        link = self.links.get(address)
        if link is None:
            raise ConfigurationError("no worker %s (known: %s)"
                                     % (address, ", ".join(sorted(self.links)) or "none"))
        return link

    def outcome(self, connection: Connection, ok: bool, path: Optional[str] = None) -> None:
        """Count a request's outcome on its worker; eject a failing one.
        ``path``: the request's, when the worker answered 5xx (lb/outlier.py).
        A worker removed (``set_workers``) is counted no more: its record
        went with it, and its requests ending after it went make none anew."""
        address = connection.peer
        if ok:
            if address in self.links:
                self.ejector.success(address)
            return
        self.worker_failures += 1
        if address not in self.links:
            return
        serving = self._serving()  # (the share cap's: this worker, and those that serve)
        ejected = sum(1 for other in serving if self.ejector.ejected(other))
        if self.ejector.failure(address, time.monotonic(),
                                len(serving) + (address not in serving), path, ejected):
            self.pool.remove(connection)
            link = self.links.get(address)  # (ejected by address: its link's connection too,
            if link is not None and link.connection is not None:  # if this one is an old one)
                self.pool.remove(link.connection)
            self.ejected()
            record = self.ejector.records[address]
            log.warning("ejected worker %s for %gs: %s (ejection %d)", address,
                        record.until - time.monotonic(), record.reason, record.ejections)

    def readmit(self, now: float) -> None:
        """Readmit the workers whose ejection is over, on probation."""
        for address in self.ejector.readmit(now):
            link = self.links.get(cast(str, address))  # (ejected by address: see outcome)
            if link is not None and link.connection is not None:
                if self._admit(link.connection, link.resume):
                    log.info("readmitted worker %s on probation", address)

    def start_health_checks(self, path: str, interval: float = 5.0,
                            timeout: float = 2.0) -> None:
        """Every ``interval``, GET ``path`` from every connected worker (not
        one draining: it takes no request); a response head under 500
        within ``timeout`` counts as a success, anything else as a failure,
        for outlier detection as requests do.  The check is cancelled once
        its head came or its time is up: its body is not wanted, and a
        worker that hangs is not left one more request each time."""
        environ = {"REQUEST_METHOD": "GET", "PATH_INFO": path, "QUERY_STRING": "",
                   "SERVER_NAME": "zc-lb", "SERVER_PORT": "0", "HTTP_HOST": "zc-lb",
                   "SERVER_PROTOCOL": "HTTP/1.1", "wsgi.url_scheme": "http",
                   REQUEST_CLASS: "", "HTTP_USER_AGENT": "zc-lb health check"}

        def check(connection: Connection) -> None:
            exchange = None
            try:
                exchange = connection.open_request(environ, end=True)
                with gevent.Timeout(timeout):
                    response = exchange.receive()
                ok = isinstance(response, Response) and response.status[:1] != "5"
            except (ZcLbError, gevent.Timeout):
                ok = False
            finally:
                if exchange is not None:
                    exchange.cancel()  # (nothing, once it ended)
            self.health_checks += 1
            self.outcome(connection, ok)

        def loop() -> None:
            while True:
                gevent.sleep(interval)
                for link in list(self.links.values()):
                    connection = _open(link)
                    if connection is not None:
                        gevent.spawn(check, connection)
        self._health = gevent.spawn(loop)

    # -- the keys relayed between LBs ------------------------------------

    def lbs_changed(self) -> None:
        """ZooKeeper counted the LBs anew (``pool.lbs``): with several,
        the keys sent to workers are relayed from now on (``_relay_keys``,
        which then runs for good: it notices when they are one again).
        An LB alone starts nothing, and wakes for nothing."""
        book = self.book
        if self._relay is None and book is not None and book.lbs > 1:
            self._relay = gevent.spawn(self._relay_keys)

    def _relay_keys(self) -> None:
        """Every RELAY_INTERVAL: whether the pool hears where the other
        LBs send keys (there are others, their books are not kept apart,
        and the pool has workers to relay ``frames.Keys``: then the books
        agree, and the pool routes as a lone LB does, see
        ``routing/affinity.py``), and if it does, the keys it sent each
        worker since, to the worker, which relays them to the other LBs."""
        while True:
            gevent.sleep(RELAY_INTERVAL)
            try:
                self.relay_turn()
            except Exception:  # (a bug here must not stop the relays for good)
                log.exception("relaying keys failed")

    def relay_turn(self) -> None:
        """One turn of ``_relay_keys``."""
        pool = self.book
        if pool is None:  # (a pool of another policy: nothing to relay)
            return
        connections = []
        if pool.lbs > 1 and not pool.separate_books:  # (an LB alone: nothing to do)
            connections = [link.connection for link in list(self.links.values())
                           if link.connection is not None and link.connection in pool]
        relayed = bool(connections)
        if relayed != pool.relayed:
            pool.relayed = relayed
            log.info("keys %s relayed between the LBs through the workers",
                     "are" if relayed else "are no longer")
        if not relayed:
            return
        for connection in connections:
            try:
                for part in _parts(pool.sent_keys(connection)):
                    connection.send_keys(part)
            except ZcLbError:
                pass

    # -- introspection ------------------------------------------------

    def status(self, pooled: Dict[str, dict]) -> Dict[str, dict]:
        """Each known worker's part of the status document, by address:
        its link, ejection, and the pool's view of it (``pooled``)."""
        links: Dict[str, dict] = {}
        for address, link in sorted(self.links.items()):
            info: Dict[str, object] = dict(_DOWN, connected=link.connection is not None,
                                           drained=address in self.drained)
            info.update(self.ejector.status(address, time.monotonic()))
            info["counts"] = {}
            if link.connection is not None:
                info["in_pool"] = link.connection in self.pool
                info["twin_of"] = self.twins.get(address)
                info["version"] = app_version(link.connection)
                info.update(pooled.get(str(link.connection), {}))
                info["streams"] = len(link.connection.protocol.streams)
            else:
                info["last_error"] = link.last_error
            links[address] = info
        for address, version in sorted(self.standby.items()):
            if address not in links:  # idle: another version than the one served
                links[address] = dict(_DOWN, version=version, standby=True, counts={},
                                      last_error="version %s is not the one served" % version)
        return links


def _pooled_as(connection: Connection, links: Dict[str, WorkerLink],
               pool: Pool) -> Optional[str]:
    """The address by which ``pool`` has ``connection``'s worker already,
    if it does (two names of one host, or a worker both listed and
    registered): the same process, by its Hello's ``instance``.  Pooled
    twice, its requests would count twice toward its backlog, its share
    and the classes' widths."""
    hello = connection.peer_hello
    instance = None if hello is None else hello.instance
    if instance is None:  # (a worker of a release before it)
        return None
    for address, link in links.items():
        other = link.connection
        if (other is not None and other is not connection and other in pool
                and other.peer_hello is not None and other.peer_hello.instance == instance):
            return address
    return None


def _open(link: WorkerLink) -> Optional[Connection]:
    """The link's connection if it may take requests: open, and not
    draining (its worker said GoAway)."""
    connection = link.connection
    if connection is None or connection.closed or link.draining is connection:
        return None
    return connection


def app_version(connection: Connection) -> Optional[str]:
    """The application version the worker gave in its Hello, if any."""
    hello = connection.peer_hello
    return hello.app_version if hello is not None else None


def _let_others_run() -> None:
    """Between the steps of a large résumé: the rest of the loop's turn."""
    gevent.sleep(0)


def _parts(keys: Dict[str, List[int]]) -> List[Dict[str, List[int]]]:
    """``keys`` (class -> key hashes) in parts of at most RELAY_FRAME
    bytes of JSON each (a class's name counted as JSON writes it: a
    control character takes six bytes), under the peer's frame limit."""
    parts: List[Dict[str, List[int]]] = []
    part: Dict[str, List[int]] = {}
    size = 2  # (the braces)
    for rclass, hashes in keys.items():
        name = len(orjson.dumps(rclass)) + 4  # (quoted; a colon, brackets, a comma)
        step = max(1, (RELAY_FRAME - 2 - name) // 21)  # (a hash: 20 digits and a comma)
        for start in range(0, len(hashes), step):
            chunk = hashes[start:start + step]
            cost = name + 21 * len(chunk)
            if part and size + cost > RELAY_FRAME:
                parts.append(part)
                part, size = {}, 2
            part.setdefault(rclass, []).extend(chunk)
            size += cost
    if part:
        parts.append(part)
    return parts
