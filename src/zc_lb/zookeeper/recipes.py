"""ZooKeeper recipes: a registration and two watches, kept up through
connection loss and session expiry.

Theory of operation
-------------------

The recipes (``Registration``, ``ProvidersWatch``, ``PropertiesWatch``)
share one shape, ``_Follower``: one greenlet per recipe (spawned through
``client.handler``) re-reads ZooKeeper whenever it is woken, and only it
does I/O.  ZooKeeper watches and the session listener only set the wake
event, so they never block kazoo's callback greenlet.  The greenlet is
woken on start, on every watch event and on every (re)connection.  After
a connection loss the session and its watches usually survive and the
re-read is a cheap no-op; after a session expiry (LOST then CONNECTED)
the re-read re-registers our ephemeral node and re-arms the watches.

While ZooKeeper is unreachable nothing is reported at all: the caller
keeps the last providers and settings it was given (Failure semantics).
Nor does our own session's expiry drop providers: the others' sessions
often expired with ours (a partition, a paused machine), and they
register again only once they too are back, a moment after us, so for
``ProvidersWatch.grace`` seconds a provider we knew is reported until it
registers again, and only one that has not by then is dropped.
Callbacks receive whole snapshots (every provider, every property), are
called only when the snapshot changed, run in the recipe's greenlet and
must be quick; an exception in one is logged and swallowed.

Weak spots: links are resolved when a recipe starts and after a session
expiry, so re-pointing a link takes effect for running processes only
then.  A provider's data is read when it appears (and re-read if its
node changes), which is enough for ephemeral registrations.
"""

from __future__ import annotations

import logging
import posixpath
import time
from collections import Counter
from typing import Any, Callable, Mapping, Optional

from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import ConnectionLoss, NoAuthError, NodeExistsError, NoNodeError

from zc_lb.zookeeper.client import (_DISCONNECTED, SESSION_TIMEOUT, decode, encode, normalize,
                                    resolve, settings_of)

log = logging.getLogger(__name__)



class _Follower:
    """One greenlet that re-reads ZooKeeper each time it is woken.

    Subclasses define ``_step()``, which reads, (re)arms watches with
    ``self._wake_up`` as the watch function and reports.  Losing the
    connection in a step just waits for the next CONNECTED, which wakes
    us; ZooKeeper refusing our credentials (NoAuthError) is logged in one
    line and the step retried every ``refused_delay``; any other error is
    logged and the step retried a second later.
    """

    retry_delay = 1.0
    refused_delay = 30.0  # after NoAuthError: waiting on an operator

    def __init__(self, client: KazooClient, path: str):
        self.client = client
        self.path = normalize(path)
        self._wake = client.handler.event_object()
        self._ready = client.handler.event_object()
        self._stopped = False
        self._started = False
        self._sessions_lost = 0  # a step spanning a loss is discarded

    def __repr__(self):
        return f"<{type(self).__name__} {self.path}>"

    def start(self) -> None:
        """Begin following; returns at once (see ``wait``)."""
        if self._started:
            return
        self._started = True
        self.client.add_listener(self._on_state)
        self.client.handler.spawn(self._run)
        self._wake.set()

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until the first successful step (True) or ``timeout``."""
        self._ready.wait(timeout)
        return self._ready.is_set()

    def stop(self) -> None:
        """Stop following (idempotent); nothing is reported afterwards."""
        self._stopped = True
        self.client.remove_listener(self._on_state)
        self._wake.set()

    def _wake_up(self, event=None) -> None:
        self._wake.set()  # a watch or listener: never block here

    def _on_state(self, state) -> bool:
        if state == KazooState.LOST:
            self._sessions_lost += 1
            self._session_lost()
        elif state == KazooState.CONNECTED:
            self._wake.set()
        return self._stopped  # True removes the listener

    def _session_lost(self) -> None:
        """Hook: our session expired (ephemerals and watches are gone).
        Runs in kazoo's greenlet, maybe while a step waits on I/O: a step
        works on locals and calls ``_check_session`` before keeping them."""

    def _check_session(self, lost_before: int) -> None:
        if self._sessions_lost != lost_before:
            raise _Again()  # CONNECTED will wake us to start over

    def _run(self) -> None:
        while True:
            self._wake.wait()
            if self._stopped:
                return
            self._wake.clear()
            try:
                self._step()
                self._ready.set()
            except _Again:
                pass  # a watch, or the step itself, wakes us again
            except _DISCONNECTED as e:
                log.info("%r: ZooKeeper unreachable (%r); waiting", self, e)
                if self.client.connected:  # e.g. a timeout: no CONNECTED
                    self._retry_later()
            except NoAuthError:  # an ACL changed since we started: no bug of ours
                log.error("%r: ZooKeeper refused (the node's ACL does not let our "
                          "credentials in); retrying in %gs", self, self.refused_delay)
                self._retry_later(self.refused_delay)
            except Exception:
                log.exception("%r failed; retrying", self)
                self._retry_later()

    def _retry_later(self, delay: Optional[float] = None) -> None:
        self.client.handler.sleep_func(self.retry_delay if delay is None else delay)
        self._wake.set()

    def _step(self) -> None:
        raise NotImplementedError

    def _report(self, callback, value) -> None:
        try:
            callback(value)
        except Exception:
            log.exception("%r: callback %r failed", self, callback)


class Registration(_Follower):
    """An ephemeral node at ``path`` holding ``data``, kept there.

    ``start()`` creates it (with missing parents; links in the parent
    path are followed) and it is created again after a session expiry or
    if someone deletes it.  A node left by one of our own earlier sessions
    is replaced; one owned by another session (a crashed predecessor on
    the same address whose session has not yet timed out, or a
    misconfiguration) is waited out with a warning, and a persistent one
    (made by hand or another tool) with an error, until it is deleted.  ``stop()`` deletes
    the node.
    """

    def __init__(self, client: KazooClient, path: str, data: Mapping[str, Any]):
        super().__init__(client, path)
        self.data = dict(data)
        self._sessions: set[int] = set()  # session ids we registered under
        self._node: Optional[str] = None  # resolved path, once known

    @property
    def registered(self) -> bool:
        return self._ready.is_set() and not self._stopped

    def _session_lost(self) -> None:
        self._ready.clear()
        self._node = None  # resolve again: links may have changed

    def _step(self) -> None:
        lost_before = self._sessions_lost
        node = self._node
        if node is None:
            parent, name = posixpath.split(self.path)
            node = posixpath.join(resolve(self.client, parent), name)
        session = self._session_id()
        if self._stopped:
            return  # stop() ran while we resolved; no yield from here on
        self._node = node
        try:
            self.client.create(node, encode(self.data), ephemeral=True,
                               makepath=True)
            self._sessions.add(session)
            log.info("registered %s", node)
        except NodeExistsError:
            pass
        _, stat = self.client.get(node, watch=self._wake_up)
        self._check_session(lost_before)
        if stat.ephemeralOwner == session:
            self._sessions.add(session)  # created before a connection loss
        elif stat.ephemeralOwner in self._sessions:
            log.info("replacing %s left by our expired session", node)
            self.client.delete(node, version=stat.version)
            self._wake.set()
            raise _Again()
        elif not stat.ephemeralOwner:
            log.error("%s is a persistent node, no registration: it blocks ours until "
                      "an operator deletes it; waiting", node)
            self._ready.clear()
            raise _Again()
        else:
            log.warning("%s is held by another session (0x%x); waiting for "
                        "it to go", node, stat.ephemeralOwner)
            self._ready.clear()
            raise _Again()

    def _session_id(self) -> int:
        client_id = self.client.client_id
        if client_id is None:
            raise ConnectionLoss("not connected")
        return client_id[0]

    def stop(self, timeout: float = 5.0) -> None:
        """Delete our node (when it is ours) and stop re-registering.

        Bounded by ``timeout``: with ZooKeeper unreachable the node goes
        anyway when the session ends (close the client)."""
        super().stop()
        self._ready.clear()
        node = self._node
        if node is None:
            return
        try:
            _, stat = _within(self.client.get_async(node), timeout)
            if stat.ephemeralOwner in self._sessions:
                _within(self.client.delete_async(node, stat.version), timeout)
                log.info("deregistered %s", node)
        except NoNodeError:
            pass
        except Exception as e:
            log.warning("could not delete %s (%r); it goes with the session",
                        node, e)


def _within(result: Any, timeout: float) -> Any:
    """An async result's value, or TimeoutError (on any kazoo handler)."""
    result.wait(timeout)
    if not result.ready():
        raise TimeoutError(f"no answer from ZooKeeper within {timeout:g}s")
    return result.get()


class _Again(Exception):
    """A step that is not done: the wake event says when to try again."""


class ProvidersWatch(_Follower):
    """Report the providers registered under ``path``.

    ``callback({"HOST:PORT": data, ...})`` is called with every provider
    and its data, at start and whenever the set or a provider's data
    changes; a missing ``path`` means no providers.  Nothing is reported
    while ZooKeeper is unreachable: the caller keeps the last set, and an
    LB must diff snapshots by address so a flapping ZooKeeper never gives
    it two connections to one worker.  After our session expires, the
    providers we knew are reported for ``grace`` seconds more while they
    register again (see the module's docstring).
    """

    grace = SESSION_TIMEOUT  # seconds: as long as the providers' sessions outlive a cut

    def __init__(self, client: KazooClient, path: str,
                 callback: Callable[[dict[str, dict]], Any]):
        super().__init__(client, path)
        self.callback = callback
        self.providers: Optional[dict[str, dict]] = None  # last reported
        self._resolved: Optional[str] = None
        self._data: dict[str, dict] = {}  # provider data read so far
        self._stale: set[str] = set()  # providers whose node changed
        self._refetch = False  # the data watches were lost with the connection
        # Known before our session expired and not back yet: each one's data,
        # and until when it is kept (time.monotonic; None: from when we are back)
        self._held: dict[str, tuple[dict, Optional[float]]] = {}

    def _session_lost(self) -> None:
        self._resolved = None
        self._data = {}  # nodes may have been replaced while we were away
        # (one held already keeps its time: sessions that expire again and
        # again would keep a provider that is gone for good)
        self._held = {name: self._held.get(name, (data, None))
                      for name, data in (self.providers or {}).items()}

    def _step(self) -> None:
        lost_before = self._sessions_lost
        path = self._resolved or resolve(self.client, self.path)
        try:
            names = self.client.get_children(path, watch=self._wake_up)
        except NoNodeError:
            if self.client.exists(path, watch=self._wake_up):
                self._wake.set()  # created meanwhile: read it
                raise _Again()
            names = []
        if self._refetch:  # read every provider again, re-arming its watch
            self._refetch = False
            self._data = {}
        while self._stale:
            self._data.pop(self._stale.pop(), None)
        data = {n: d for n, d in self._data.items() if n in names}
        data.update(self._fetch(path, [n for n in names if n not in data]))
        self._check_session(lost_before)
        self._resolved, self._data = path, data
        data = self._with_held(data)
        if data != self.providers:
            self.providers = {n: dict(d) for n, d in data.items()}
            self._report(self.callback, dict(self.providers))

    def _with_held(self, data: dict[str, dict]) -> dict[str, dict]:
        """``data``, and for ``grace`` seconds after our session expired,
        the providers we knew then that have not registered again."""
        for name in data:
            self._held.pop(name, None)  # back: what it says now counts
        if not self._held:
            return data
        now = time.monotonic()
        fresh = sorted(name for name, (_, until) in self._held.items() if until is None)
        if fresh:
            until = now + self.grace
            for name in fresh:
                self._held[name] = (self._held[name][0], until)
            self.client.handler.spawn(self._wake_at, until)
            log.warning("%r: our session expired; keeping %d providers not registered "
                        "again yet for %gs: %s", self, len(fresh), self.grace, " ".join(fresh))
        gone = sorted(name for name, (_, until) in self._held.items()
                      if until is not None and now >= until)
        if gone:
            log.info("%r: %d providers did not register again within %gs: %s", self,
                     len(gone), self.grace, " ".join(gone))
            for name in gone:
                del self._held[name]
        return {**{name: held for name, (held, _) in self._held.items()}, **data}

    def _wake_at(self, deadline: float) -> None:
        while (left := deadline - time.monotonic()) > 0:  # (a timer may fire early)
            self.client.handler.sleep_func(left)
        self._wake.set()

    def _fetch(self, path: str, names: list[str]) -> dict[str, dict]:
        """Read new providers' data in parallel, watching their nodes."""
        pending = [(n, self.client.get_async(posixpath.join(path, n),
                                             watch=self._child_watch))
                   for n in names]
        data = {}
        for name, result in pending:
            try:
                raw, _ = result.get()
            except NoNodeError:
                continue  # gone already; the children watch has fired
            try:
                data[name] = decode(raw)
            except ValueError as e:  # (not UTF-8 too)
                log.warning("%s: bad provider data (%s); taken as none",
                            posixpath.join(path, name), e)
                data[name] = {}
        return data

    def _child_watch(self, event) -> None:
        if event.path:
            self._stale.add(posixpath.basename(event.path))
        else:  # a connection event (kazoo gives no path): that watch is spent
            self._refetch = True
        self._wake.set()


class PropertiesWatch(_Follower):
    """Report a node's settings: ``callback(dict)`` at start and on each
    change, with links left out.  A missing node reports {} (defaults);
    data that is not a JSON object is logged and the last good kept."""

    def __init__(self, client: KazooClient, path: str,
                 callback: Callable[[dict[str, Any]], Any]):
        super().__init__(client, path)
        self.callback = callback
        self.properties: Optional[dict[str, Any]] = None  # last reported
        self._resolved: Optional[str] = None

    def _session_lost(self) -> None:
        self._resolved = None

    def _step(self) -> None:
        lost_before = self._sessions_lost
        path = self._resolved or resolve(self.client, self.path)
        try:
            raw, _ = self.client.get(path, watch=self._wake_up)
        except NoNodeError:
            if self.client.exists(path, watch=self._wake_up):
                self._wake.set()  # created meanwhile: read it
                raise _Again()
            raw = b""
        self._check_session(lost_before)
        self._resolved = path
        try:
            properties = settings_of(decode(raw))
        except ValueError as e:
            log.error("%s: bad properties (%s); keeping the last good ones",
                      path, e)
            return
        if properties != self.properties:
            self.properties = properties
            self._report(self.callback, dict(properties))


def majority_version(providers: Mapping[str, Mapping[str, Any]],
                     current: Optional[str] = None) -> Optional[str]:
    """The version most providers run, for ``--single-version``.

    A provider without a version counts as version None.  On a tie the
    ``current`` version is kept if it is among the leaders (so the LB
    switches only when another version has strictly more workers), else
    the highest version string wins (usually the newest).  None when
    there are no providers.
    """
    counts = Counter(data.get("version") for data in providers.values())
    if not counts:
        return None
    best = max(counts.values())
    leaders = [v for v, n in counts.items() if n == best]
    if current in leaders:
        return current
    return max(leaders, key=lambda v: (v is not None, str(v)))


def of_version(providers: Mapping[str, Mapping[str, Any]],
               version: Optional[str]) -> dict[str, Mapping[str, Any]]:
    """The providers running ``version``."""
    return {a: d for a, d in providers.items() if d.get("version") == version}
