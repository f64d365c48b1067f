"""ZooKeeper (kazoo, gevent handler): registration, watches, tree import/export.

Theory of operation
-------------------

Tree (DESIGN.md)::

    /lb                         LB settings: variance = 4, ...
      /providers/HOST:PORT      ephemeral, one per LB
      /workers                  worker settings: history = 9999, ...
        /providers/HOST:PORT    ephemeral, one per worker

Node data is a JSON object of properties.  A link ``name -> /target`` on
node N is the property ``"name ->": "/target"`` in N's data (zc.zk's
convention, see tree.py); ``resolve`` follows links segment by segment,
so any path given to us may pass through links.

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
Callbacks receive whole snapshots (every provider, every property), are
called only when the snapshot changed, run in the recipe's greenlet and
must be quick; an exception in one is logged and swallowed.

Weak spots: links are resolved when a recipe starts and after a session
expiry, so re-pointing a link takes effect for running processes only
then.  A provider's data is read when it appears (and re-read if its
node changes), which is enough for ephemeral registrations.

Command functions (``import_tree``, ``export_tree``, ``get``,
``set_properties``, ``ls``) and ``run_zk_command`` back ``zc-lb zk``,
whose arguments cli.py parses.  Import semantics are documented on
``import_tree``.
"""

from __future__ import annotations

import argparse
import json
import logging
import posixpath
import sys
from collections import Counter
from typing import Any, Callable, Iterable, Mapping, Optional

from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import (
    BadVersionError, ConnectionClosedError, ConnectionLoss, NodeExistsError,
    NoNodeError, NotEmptyError, OperationTimeoutError, RolledBackError,
    SessionExpiredError,
)
from kazoo.handlers.gevent import SequentialGeventHandler
from kazoo.retry import KazooRetry, RetryFailedError

from zc_lb import tree
from zc_lb.errors import ConfigurationError

log = logging.getLogger(__name__)

MAX_LINKS = 16  # links followed while resolving one path: more is a loop
_DISCONNECTED = (ConnectionLoss, SessionExpiredError, ConnectionClosedError,
                 OperationTimeoutError)
_CONFLICTS = (BadVersionError, NodeExistsError, NoNodeError, NotEmptyError)


class ZooKeeperUnavailable(ConfigurationError):
    """ZooKeeper could not be reached at startup (wrong hosts, or down)."""

    http_status = 503


def connect(hosts: str, timeout: float = 10.0, session_timeout: float = 10.0,
            max_reconnect_delay: float = 2.0) -> KazooClient:
    """A started KazooClient on the gevent handler.

    ``hosts`` is kazoo's ``host:port,host:port[/chroot]``.  Reconnection
    retries forever, at most ``max_reconnect_delay`` apart (kazoo's default
    backs off to an hour); a command's retries give up after ``timeout``.
    Raises ZooKeeperUnavailable when no server answers within ``timeout``.
    """
    handler = SequentialGeventHandler()
    retry = dict(max_tries=-1, delay=0.1, backoff=2, max_jitter=0.2,
                 max_delay=max_reconnect_delay, sleep_func=handler.sleep_func)
    client = KazooClient(
        hosts=hosts, handler=handler, timeout=session_timeout,
        connection_retry=KazooRetry(**retry),
        command_retry=KazooRetry(deadline=timeout, **retry))
    try:
        client.start(timeout=timeout)
    except handler.timeout_exception:
        client.close()
        raise ZooKeeperUnavailable(
            f"cannot reach ZooKeeper at {hosts} within {timeout:g}s")
    return client


# Data and paths -----------------------------------------------------------


def decode(raw: Optional[bytes]) -> dict[str, Any]:
    """Node data -> properties; empty data is {}; ValueError if not a JSON
    object."""
    if not raw:
        return {}
    data = json.loads(raw.decode("utf-8"))
    if not isinstance(data, dict):
        raise ValueError("node data is not a JSON object")
    return data


def encode(properties: Mapping[str, Any]) -> bytes:
    return json.dumps(dict(properties), ensure_ascii=False).encode("utf-8")


def settings_of(properties: Mapping[str, Any]) -> dict[str, Any]:
    """Properties without links: what a process reads as its settings."""
    return tree.from_data(dict(properties))[0]


def normalize(path: str) -> str:
    """'/a//b/' -> '/a/b'; a path must be absolute."""
    if not path.startswith("/"):
        raise ConfigurationError(f"ZooKeeper paths are absolute: {path!r}")
    return "/" + "/".join(s for s in path.split("/") if s)


def resolve(client: KazooClient, path: str) -> str:
    """``path`` with links followed, segment by segment.

    A segment that is a child node wins over a link of the same name.  A
    segment that is neither is kept as it is, with the rest of the path,
    so the result can be created.  A relative link target is taken from
    the node holding the link.  Raises ConfigurationError on a link loop.
    """
    return _resolve(client, normalize(path), [0])


def _resolve(client: KazooClient, path: str, hops: list[int]) -> str:
    resolved = "/"
    segments = [s for s in path.split("/") if s]
    for i, name in enumerate(segments):
        child = posixpath.join(resolved, name)
        if client.exists(child):
            resolved = child
            continue
        target = _link_target(client, resolved, name)
        if target is None:
            return posixpath.join(resolved, *segments[i:])
        hops[0] += 1
        if hops[0] > MAX_LINKS:
            raise ConfigurationError(f"too many links resolving {path}")
        resolved = _resolve(
            client, normalize(posixpath.join(resolved, target)), hops)
    return resolved


def _link_target(client: KazooClient, path: str, name: str) -> Optional[str]:
    try:
        data = decode(client.get(path)[0])
    except (NoNodeError, ValueError):
        return None
    target = data.get(name + tree.LINK_SUFFIX)
    return target if isinstance(target, str) else None


def _read(client: KazooClient, path: str) -> tuple[dict[str, Any], Any]:
    """(properties, stat) of an existing node, with errors for people."""
    try:
        raw, stat = client.get(path)
    except NoNodeError:
        raise ConfigurationError(f"no such node: {path}") from None
    try:
        return decode(raw), stat
    except ValueError:
        raise ConfigurationError(
            f"{path} holds data that is not a JSON object") from None


# Commands -----------------------------------------------------------------


def get(client: KazooClient, path: str) -> dict[str, Any]:
    """A node's properties (links included, as ``"name ->"`` keys)."""
    return client.retry(lambda: _read(client, resolve(client, path))[0])


def ls(client: KazooClient, path: str) -> list[str]:
    """A node's children, sorted."""
    def attempt():
        resolved = resolve(client, path)
        try:
            return sorted(client.get_children(resolved))
        except NoNodeError:
            raise ConfigurationError(f"no such node: {resolved}")
    return client.retry(attempt)


def set_properties(client: KazooClient, path: str,
                   assignments: Iterable[str]) -> dict[str, Any]:
    """Set ``key=value`` properties (value JSON when it parses, else a
    string), keeping the others; return the node's new properties."""
    updates = dict(tree.parse_assignment(a) for a in assignments)

    def attempt():
        resolved = resolve(client, path)
        while True:
            properties, stat = _read(client, resolved)
            properties.update(updates)
            try:
                client.set(resolved, encode(properties), version=stat.version)
                return properties
            except BadVersionError:
                continue  # changed since we read it: merge again
    return client.retry(attempt)


def export_tree(client: KazooClient, path: str = "/",
                ephemeral: bool = False) -> str:
    """The subtree at ``path`` as tree text, the node under its own name
    (so importing the text under the parent of ``path`` recreates it).
    Ephemeral nodes are runtime state, not configuration: left out, or
    with ``ephemeral`` listed as comments."""
    path = normalize(path)

    def attempt():
        resolved = resolve(client, path)
        try:
            raw, stat = client.get(resolved)
        except NoNodeError:
            raise ConfigurationError(f"no such node: {resolved}")
        node = _read_subtree(client, resolved, raw, ephemeral)
        if path == "/":
            return tree.format(node)
        return tree.format(tree.Node(children={posixpath.basename(path): node}))
    return client.retry(attempt)


def _read_subtree(client, path, raw, ephemeral) -> tree.Node:
    node = tree.Node()
    try:
        node.properties, node.links = tree.from_data(decode(raw))
    except ValueError:
        node.notes.append("data is not a JSON object; left out")
    for name in sorted(client.get_children(path)):
        if path == "/" and name == "zookeeper":
            continue
        child_path = posixpath.join(path, name)
        try:
            child_raw, stat = client.get(child_path)
        except NoNodeError:
            continue  # gone while we looked
        if stat.ephemeralOwner:
            if ephemeral:
                node.notes.append(f"/{name} (ephemeral) {child_raw.decode()}")
            continue
        node.children[name] = _read_subtree(client, child_path, child_raw,
                                            ephemeral)
    return node


def import_tree(client: KazooClient, text: str, root: str = "/",
                dry_run: bool = False, delete: bool = False,
                out: Optional[Any] = None) -> list[tree.Change]:
    """Make ZooKeeper match tree ``text`` under ``root``; return the changes.

    - The text is parsed first: a malformed file raises ConfigurationError
      naming the line, and nothing is written.
    - Nodes in the file are created (with any missing ancestors of
      ``root``); their properties and links are set.  Properties, links
      and nodes absent from the file are kept, unless ``delete``: then
      they are removed, except ephemeral nodes and subtrees holding any
      (live registrations) and /zookeeper.
    - Ephemeral nodes are never written, even when the file names them.
    - All changes are committed in one ZooKeeper transaction, with the
      versions read while planning: a concurrent change makes it fail
      whole and we plan again.  Importing the same file again changes
      nothing; ``dry_run`` only reports.
    The changes (or "no changes") are written to ``out`` when given.
    """
    desired = tree.parse(text)
    root = normalize(root)
    for _ in range(5):
        changes = client.retry(plan_import, client, desired, root, delete)
        if dry_run or not changes:
            break
        try:
            client.retry(apply_changes, client, changes)
            break
        except _CONFLICTS as e:
            log.info("tree changed while importing (%r); planning again", e)
    else:
        raise ConfigurationError("the tree kept changing during the import")
    if out is not None:
        for change in changes:
            out.write(f"{change}\n")
        if not changes:
            out.write("no changes\n")
    return changes


def plan_import(client: KazooClient, desired: tree.Node, root: str = "/",
                delete: bool = False) -> list[tree.Change]:
    """The changes ``import_tree`` would make (reads only)."""
    return tree.plan(_Reader(client), desired, resolve(client, root), delete)


class _Reader:
    """tree.Reader on a kazoo client."""

    def __init__(self, client: KazooClient):
        self.client = client

    def node(self, path: str) -> Optional[tree.Stored]:
        try:
            raw, stat = self.client.get(path)
        except NoNodeError:
            return None
        try:
            data: Optional[dict] = decode(raw)
        except ValueError:
            data = None
        return tree.Stored(data, stat.version, bool(stat.ephemeralOwner))

    def children(self, path: str) -> list[str]:
        try:
            return self.client.get_children(path)
        except NoNodeError:
            return []


def apply_changes(client: KazooClient, changes: Iterable[tree.Change]) -> None:
    """Commit planned changes in one transaction; raise the first failure
    (a conflict such as BadVersionError when the tree moved meanwhile)."""
    transaction = client.transaction()
    for c in changes:
        if c.action == "create":
            transaction.create(c.path, encode(c.data or {}))
        elif c.action == "set":
            transaction.set_data(c.path, encode(c.data or {}), c.version)
        elif c.action == "delete":
            transaction.delete(c.path, c.version)
    if not transaction.operations:
        return
    for result in transaction.commit():
        if isinstance(result, Exception) and not isinstance(
                result, RolledBackError):
            raise result


# Recipes ------------------------------------------------------------------


class _Follower:
    """One greenlet that re-reads ZooKeeper each time it is woken.

    Subclasses define ``_step()``, which reads, (re)arms watches with
    ``self._wake_up`` as the watch function and reports.  Losing the
    connection in a step just waits for the next CONNECTED, which wakes
    us; any other error is logged and the step retried a second later.
    """

    retry_delay = 1.0

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
            except Exception:
                log.exception("%r failed; retrying", self)
                self._retry_later()

    def _retry_later(self) -> None:
        self.client.handler.sleep_func(self.retry_delay)
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
    misconfiguration) is waited out with a warning.  ``stop()`` deletes
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
    it two connections to one worker.
    """

    def __init__(self, client: KazooClient, path: str,
                 callback: Callable[[dict[str, dict]], Any]):
        super().__init__(client, path)
        self.callback = callback
        self.providers: Optional[dict[str, dict]] = None  # last reported
        self._resolved: Optional[str] = None
        self._data: dict[str, dict] = {}  # provider data read so far
        self._stale: set[str] = set()  # providers whose node changed

    def _session_lost(self) -> None:
        self._resolved = None
        self._data = {}  # nodes may have been replaced while we were away

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
        while self._stale:
            self._data.pop(self._stale.pop(), None)
        data = {n: d for n, d in self._data.items() if n in names}
        data.update(self._fetch(path, [n for n in names if n not in data]))
        self._check_session(lost_before)
        self._resolved, self._data = path, data
        if data != self.providers:
            self.providers = {n: dict(d) for n, d in data.items()}
            self._report(self.callback, dict(self.providers))

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
            except ValueError:
                log.warning("provider %s: data is not a JSON object", name)
                data[name] = {}
        return data

    def _child_watch(self, event) -> None:
        self._stale.add(posixpath.basename(event.path))
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


# `zc-lb zk` ---------------------------------------------------------------


def run_zk_command(args: argparse.Namespace, out: Any = None) -> int:
    """Run a parsed ``zc-lb zk`` command; ConfigurationError for mistakes."""
    out = out or sys.stdout
    text = None
    if args.zk_command == "import":  # a bad file fails before connecting
        text = _read_file(args.file)
        tree.parse(text)
    client = connect(args.zookeeper, timeout=args.timeout)
    try:
        _run_command(client, args, text, out)
    except (RetryFailedError, *_DISCONNECTED) as e:
        raise ZooKeeperUnavailable(f"lost ZooKeeper at {args.zookeeper}: {e!r}")
    finally:
        client.stop()
        client.close()
    return 0


def _run_command(client: KazooClient, args: argparse.Namespace,
                 text: Optional[str], out: Any) -> None:
    if args.zk_command == "import":
        import_tree(client, text or "", args.root, dry_run=args.dry_run,
                    delete=args.delete, out=out)
    elif args.zk_command == "export":
        out.write(export_tree(client, args.path, args.ephemeral))
    elif args.zk_command == "get":
        out.write(json.dumps(get(client, args.path), indent=2,
                             ensure_ascii=False) + "\n")
    elif args.zk_command == "set":
        set_properties(client, args.path, args.assignments)
    elif args.zk_command == "ls":
        out.writelines(name + "\n" for name in ls(client, args.path))


def _read_file(path: str) -> str:
    try:
        if path == "-":
            return sys.stdin.read()
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ConfigurationError(f"cannot read {path}: {e.strerror}")
