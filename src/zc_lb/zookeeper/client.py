"""ZooKeeper (kazoo, gevent handler): connecting, paths and links, tree import/export.

Theory of operation
-------------------

Tree (docs/design.rst, "The ZooKeeper tree")::

    /lb                         LB settings: variance = 4, ...
      /providers/HOST:PORT      ephemeral, one per LB
      /workers                  worker settings: history = 9999, ...
        /providers/HOST:PORT    ephemeral, one per worker

Node data is a JSON object of properties.  A link ``name -> /target`` on
node N is the property ``"name ->": "/target"`` in N's data (zc.zk's
convention, see zookeeper/tree.py); ``resolve`` follows links segment by segment,
so any path given to us may pass through links.

Weak spot: links are resolved when a recipe (zookeeper/recipes.py) starts and
after a session expiry, so re-pointing a link takes effect for running
processes only then.

Command functions (``import_tree``, ``export_tree``, ``get``,
``set_properties``, ``ls``) and ``run_zk_command`` back ``zc-lb zk``,
whose arguments cli/parsers.py parses.  Import semantics are documented on
``import_tree``.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import posixpath
import sys
import warnings
from typing import Any, Iterable, Mapping, Optional, Tuple

from kazoo.client import KazooClient
from kazoo.exceptions import (
    BadVersionError, ConnectionClosedError, ConnectionLoss, NodeExistsError,
    NoAuthError, NoNodeError, NotEmptyError, OperationTimeoutError, RolledBackError,
    SessionExpiredError,
)
from kazoo.handlers.gevent import SequentialGeventHandler
from kazoo.retry import KazooRetry, RetryFailedError
from kazoo.security import make_digest_acl

from zc_lb.zookeeper import tree
from zc_lb.errors import ConfigurationError, ZooKeeperUnavailable

log = logging.getLogger(__name__)

MAX_LINKS = 16  # links followed while resolving one path: more is a loop
# What one request may carry: ZooKeeper's default jute.maxbuffer (1 MiB
# less a byte) less room for the request's headers.  A larger request
# makes the server drop the connection, which looks like an outage.
MAX_REQUEST = 1_000_000
OP_OVERHEAD = 256  # bytes counted for an operation besides its path and data
_DISCONNECTED = (ConnectionLoss, SessionExpiredError, ConnectionClosedError,
                 OperationTimeoutError)
_CONFLICTS = (BadVersionError, NodeExistsError, NoNodeError, NotEmptyError)
SESSION_TIMEOUT = 10.0  # seconds: what LBs and workers ask for


def read_credentials(path: str) -> Tuple[str, str]:
    """The site's ZooKeeper credentials from a file: one line,
    ``USER:PASSWORD`` (ZooKeeper's digest scheme).  ConfigurationError,
    saying what is wrong but never the password, for anything else."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line.strip() for line in f.read().splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigurationError(f"cannot read the ZooKeeper credentials in {path}: {e}")
    user, sep, password = lines[0].partition(":") if len(lines) == 1 else ("", "", "")
    if not (sep and user and password):
        raise ConfigurationError(
            f"{path} must hold one line, USER:PASSWORD (the ZooKeeper credentials)")
    return user, password


def connect(hosts: str, timeout: float = 10.0, session_timeout: float = SESSION_TIMEOUT,
            max_reconnect_delay: float = 2.0,
            credentials: Optional[Tuple[str, str]] = None) -> KazooClient:
    """A started KazooClient on the gevent handler.

    ``hosts`` is kazoo's ``host:port,host:port[/chroot]``.  Reconnection
    retries forever, at most ``max_reconnect_delay`` apart (kazoo's default
    backs off to an hour); a command's retries give up after ``timeout``.
    Raises ZooKeeperUnavailable when no server answers within ``timeout``:
    the session timeout asked for is at most ``timeout``, since it bounds
    each attempt on a server that takes the connection and never answers
    (one stopped or overloaded), and kazoo waits out the attempt under
    way before it gives up.
    A chroot that does not exist is created, with every missing node
    above it (as ZooKeeper's own paths are, by the first process or
    command of a new site).

    With ``credentials`` (user, password) the client authenticates
    (ZooKeeper's digest scheme), and every node it creates gets an ACL
    that gives those credentials all rights and nobody else any: only
    the site's processes and operators then read or change its settings
    and registrations.
    """
    client = _started(hosts, timeout, min(session_timeout, timeout), max_reconnect_delay,
                      credentials)
    try:
        if client.chroot and client.retry(client.exists, "/") is None:
            _make_chroot(hosts, client.chroot, timeout, credentials)
    except (RetryFailedError, *_DISCONNECTED) as e:
        client.stop()
        client.close()
        raise ZooKeeperUnavailable(f"lost ZooKeeper at {hosts}: {e!r}") from None
    except BaseException:
        client.stop()
        client.close()
        raise
    return client


def _started(hosts: str, timeout: float, session_timeout: float,
             max_reconnect_delay: float,
             credentials: Optional[Tuple[str, str]]) -> KazooClient:
    handler = SequentialGeventHandler()
    retry = dict(max_tries=-1, delay=0.1, backoff=2, max_jitter=0.2,
                 max_delay=max_reconnect_delay, sleep_func=handler.sleep_func)
    auth: dict[str, Any] = {}
    if credentials is not None:
        user, password = credentials
        auth = dict(auth_data=[("digest", f"{user}:{password}")],
                    default_acl=[make_digest_acl(user, password, all=True)])
    client = KazooClient(
        hosts=hosts, handler=handler, timeout=session_timeout,
        connection_retry=KazooRetry(**retry),
        command_retry=KazooRetry(deadline=timeout, **retry), **auth)
    try:
        with warnings.catch_warnings():  # (a missing chroot: connect makes it)
            warnings.filterwarnings("ignore", "No chroot path exists")
            client.start(timeout=timeout)
    except handler.timeout_exception:
        client.close()
        raise ZooKeeperUnavailable(
            f"cannot reach ZooKeeper at {hosts} within {timeout:g}s")
    return client


def _make_chroot(hosts: str, chroot: str, timeout: float,
                 credentials: Optional[Tuple[str, str]]) -> None:
    """Create ``chroot`` and the nodes above it, from a client without it."""
    client = _started(hosts.split("/", 1)[0], timeout, timeout, 2.0, credentials)
    try:
        client.retry(client.ensure_path, chroot)
        log.info("created the chroot %s", chroot)
    except NoAuthError:
        raise refused(credentials) from None
    finally:
        client.stop()
        client.close()


def refused(credentials: Optional[Tuple[str, str]]) -> ConfigurationError:
    """The error for ZooKeeper's NoAuthError: the ACL refuses us."""
    return ConfigurationError(
        "ZooKeeper refused: the nodes' ACL lets only the site's credentials read or "
        "change them (%s)" % ("these are not they" if credentials
                              else "give them with --zookeeper-auth-file"))


def check_access(client: KazooClient, path: str,
                 credentials: Optional[Tuple[str, str]] = None) -> None:
    """Read ``path`` (or, missing, its nearest ancestor) once, so that a
    process whose credentials the ACL refuses fails at start with
    ``refused``'s ConfigurationError, not in its recipes for ever;
    ZooKeeperUnavailable if ZooKeeper goes meanwhile."""
    def attempt() -> None:
        node = resolve(client, path)
        while True:
            try:
                client.get(node)
                return
            except NoNodeError:
                if node == "/":
                    return
                node = posixpath.dirname(node)
    try:
        client.retry(attempt)
    except NoAuthError:
        raise refused(credentials) from None
    except (RetryFailedError, *_DISCONNECTED) as e:
        raise ZooKeeperUnavailable(f"lost ZooKeeper: {e!r}") from None


# Data and paths -----------------------------------------------------------


def decode(raw: Optional[bytes]) -> dict[str, Any]:
    """Node data -> properties; empty data is {}; ValueError if not a JSON
    object (nested too deep to read is not one either)."""
    if not raw:
        return {}
    try:
        data = json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise ValueError("node data is nested too deeply") from None
    if not isinstance(data, dict):
        raise ValueError("node data is not a JSON object")
    return data


def encode(properties: Mapping[str, Any], path: Optional[str] = None) -> bytes:
    """Properties -> node data; with ``path``, ConfigurationError naming
    the node if ZooKeeper would refuse data that large."""
    raw = json.dumps(dict(properties), ensure_ascii=False).encode("utf-8")
    if path is not None and _cost(path, raw) > MAX_REQUEST:
        raise ConfigurationError(
            f"{path}: its data would be {len(raw):,} bytes, more than ZooKeeper takes"
            f" in one node (some {MAX_REQUEST:,} bytes, jute.maxbuffer)")
    return raw


def _cost(path: str, raw: bytes) -> int:
    """The bytes an operation on ``path`` writing ``raw`` adds to a request."""
    return len(path.encode("utf-8")) + len(raw) + OP_OVERHEAD


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
                client.set(resolved, encode(properties, resolved), version=stat.version)
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
    - Ephemeral nodes are never written, even when the file names them,
      nor is anything under a ``providers`` node (where processes
      register): such nodes are planned as skips.
    - The changes are committed in one ZooKeeper transaction, with the
      versions read while planning: a concurrent change makes it fail
      whole and we plan again; changes too large for one request are
      committed in several (see ``batches``), and one node's data too
      large refused, even with ``dry_run``.  Importing the same file
      again changes nothing; ``dry_run`` only reports.
    The changes (or "no changes") are written to ``out`` when given.
    """
    changes = _plan_and_commit(client, tree.parse(text), normalize(root), dry_run, delete)
    if out is not None:
        for change in changes:
            out.write(f"{change}\n")
        if not changes:
            out.write("no changes\n")
    return changes


def _plan_and_commit(client: KazooClient, desired: tree.Node, root: str,
                     dry_run: bool, delete: bool) -> list[tree.Change]:
    for _ in range(5):
        changes = client.retry(plan_import, client, desired, root, delete)
        transactions = batches(changes)  # (a node too large fails here)
        if dry_run or not changes:
            return changes
        try:
            for transaction in transactions:
                client.retry(apply_changes, client, transaction)
            return changes
        except _CONFLICTS as e:
            log.info("tree changed while importing (%r); planning again", e)
    raise ConfigurationError("the tree kept changing during the import")


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


def batches(changes: Iterable[tree.Change]) -> list[list[tree.Change]]:
    """Planned changes cut, in order (parents created first, children
    deleted first), into transactions that each fit in one ZooKeeper
    request (``MAX_REQUEST``); ConfigurationError naming a node whose
    data alone would not.  A concurrent change fails the transaction it
    meets, and the import plans what is left again."""
    result: list[list[tree.Change]] = []
    size = MAX_REQUEST
    for change in changes:
        if change.action == "skip":
            continue
        raw = b"" if change.action == "delete" else encode(change.data or {}, change.path)
        cost = _cost(change.path, raw)
        if size + cost > MAX_REQUEST:
            result.append([])
            size = 0
        result[-1].append(change)
        size += cost
    return result


def apply_changes(client: KazooClient, changes: Iterable[tree.Change]) -> None:
    """Commit planned changes in one transaction (``batches`` cuts those
    too large for one); raise the first failure (a conflict such as
    BadVersionError when the tree moved meanwhile)."""
    transaction = client.transaction()
    for c in changes:
        if c.action == "create":
            transaction.create(c.path, encode(c.data or {}, c.path))
        elif c.action == "set":
            transaction.set_data(c.path, encode(c.data or {}, c.path), c.version)
        elif c.action == "delete":
            transaction.delete(c.path, c.version)
    if not transaction.operations:
        return
    for result in transaction.commit():
        if isinstance(result, Exception) and not isinstance(
                result, RolledBackError):
            raise result


# `zc-lb zk` ---------------------------------------------------------------


def run_zk_command(args: argparse.Namespace, out: Any = None) -> int:
    """Run a parsed ``zc-lb zk`` command; ConfigurationError for mistakes."""
    out = out or sys.stdout
    text = None
    force = getattr(args, "force", False)
    check = functools.partial(_check_property, force=force)
    if args.zk_command == "import":  # a bad file fails before connecting
        text = _read_file(args.file)
        root = normalize(args.root)
        tree.parse(text, lambda path, key, value: check(
            root.rstrip("/") + path if root != "/" else path, key, value))
        if args.delete and root == "/" and not args.delete_at_root:
            raise ConfigurationError(
                "--delete at / removes every top-level tree the file does not name "
                "(other sites' and services'); import under a path, or add "
                "--delete-at-root to mean it")
    elif args.zk_command == "set":  # so does a bad setting
        for assignment in args.assignments:
            check(normalize(args.path), *tree.parse_assignment(assignment))
    credentials = (read_credentials(args.zookeeper_auth_file)
                   if getattr(args, "zookeeper_auth_file", None) else None)
    client = connect(args.zookeeper, timeout=args.timeout, credentials=credentials)
    try:
        _run_command(client, args, text, out)
    except NoAuthError:
        raise refused(credentials) from None
    except (RetryFailedError, *_DISCONNECTED) as e:
        raise ZooKeeperUnavailable(f"lost ZooKeeper at {args.zookeeper}: {e!r}")
    finally:
        client.stop()
        client.close()
    return 0


def _check_property(path: str, key: str, value: Any, force: bool) -> None:
    """A property of ``path`` that is no good setting is refused."""
    from zc_lb.settings import check_property
    check_property(path, key, value, force)


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
    except UnicodeDecodeError as e:  # (a tree file is UTF-8 text)
        raise ConfigurationError(
            f"{path} is not UTF-8 text: byte {e.object[e.start]:#04x} at offset {e.start}")
