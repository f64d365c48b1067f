"""How LBs and workers take part in a ZooKeeper tree.

A worker registers ``<path>/providers/HOST:PORT`` (pid, version,
description) and follows its live settings (``history``, ``max_skill_age``,
``max_classes``, ``resume_interval``) in ``<path>``.
An LB follows its settings in ``<path>``, the workers registered under
``<path>/workers/providers``, and registers itself at
``<path>/providers/HOST:PORT`` with its status address.

The recipes in zookeeper/client.py do the ZooKeeper work (retries, session expiry,
links); this module only turns what they report into calls on the Worker
and the LB.  Their callbacks run in a recipe greenlet and must be quick:
``Fleet.set_workers`` only starts or stops link greenlets.

Settings from ZooKeeper override those given on the command line; a
property removed from ZooKeeper falls back to the command line's value.
A bad value is logged and the current setting kept.  While ZooKeeper is
unreachable nothing is reported, so everyone keeps what they know.  Both
roles follow their node with one ``NodeSettings``, which holds that rule.
"""

from __future__ import annotations

import logging
import os
import socket
import urllib.parse
from typing import Any, Dict, Mapping, Optional, Tuple

import gevent

from zc_lb.zookeeper import recipes
from zc_lb.zookeeper import client as zk
from zc_lb.errors import ConfigurationError
from zc_lb.zookeeper.client import ZooKeeperUnavailable
from zc_lb.settings import LB_NODE_SETTINGS, WORKER_NODE_SETTINGS, parse_each

log = logging.getLogger(__name__)


def advertised(address) -> str:
    """HOST:PORT for others to reach a bound address (0.0.0.0 -> our name);
    for a Unix socket's (an LB behind a proxy on its machine), ``unix:``
    and its path quoted, ``@`` our name: a node name has no slashes.  (A
    worker on one does not register: the command line refuses it.)"""
    if isinstance(address, str):
        return "unix:%s@%s" % (urllib.parse.quote(address, safe=""), socket.gethostname())
    host, port = address[:2]
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    return "%s:%d" % (host, port)


def _connect(hosts: str, path: str, timeout: float,
             credentials: Optional[Tuple[str, str]]):
    """A client of ``hosts`` that may read ``path``: ConfigurationError
    (the ``zk`` commands' message, exit 2) when the ACL refuses our
    credentials, before any recipe retries for ever."""
    client = zk.connect(hosts, timeout=timeout, credentials=credentials)
    try:
        zk.check_access(client, path, credentials)
    except Exception:
        client.stop()
        client.close()
        raise
    return client


class NodeSettings:
    """Following a node's properties as live settings, for either role:
    the command line's values (``base``) under the node's, a property
    removed falling back to ``base``, a bad one logged and the value in
    force kept (``applied``), and a new ``reset_skills`` token resetting
    skills.  A role says what its node may set (``node_settings``), how
    to apply settings (``_configure``) and to reset skills
    (``_reset_skills``)."""

    role = ""
    node_settings: Mapping[str, Any] = {}

    def _follow(self, path: str, base: Mapping[str, Any]) -> None:
        self.path = path
        self.base: Dict[str, Any] = dict(base)
        self.applied: Dict[str, Any] = {}  # the settings in force
        self.properties: Optional[Dict[str, Any]] = None  # the node's, last seen
        self.reset_token: Optional[str] = None  # the reset_skills token last seen

    def _configure(self, settings: Mapping[str, Any], source: str) -> None:
        raise NotImplementedError

    def _reset_skills(self, token: str) -> None:
        raise NotImplementedError

    def _token_seen(self, token: str) -> None:
        """The first ``reset_skills`` value seen, which resets nothing."""

    def settings_changed(self, properties: Dict[str, Any], source: str = "") -> None:
        """The node's properties, as they are now; a JSON null is no
        value: the setting falls back to the command line's."""
        properties = {name: value for name, value in properties.items() if value is not None}
        self.properties = properties
        good, bad = parse_each(self.node_settings, properties)
        for message in bad:
            log.error("ignoring a bad %s setting in %s: %s", self.role, self.path, message)
        settings = dict(self.base)
        settings.update((name, value) for name, value in self.applied.items()
                        if name in properties)
        settings.update(good)  # (checked by the table)
        try:
            self._configure(settings, source or "ZooKeeper %s" % self.path)
        except ConfigurationError as exc:  # (settings that do not go together)
            log.error("ignoring bad %s settings in %s: %s", self.role, self.path, exc)
            return
        self.applied = settings
        # A new token resets; its removal (a tree imported with --delete that
        # does not name it) is no new token, nor is the same one put back.
        # The first one seen is none either, but for a worker's résumé
        # file's: the token it saw before it stopped.
        token = settings["reset_skills"]
        if self.reset_token is None:
            self._token_seen(token)
        elif token and token != self.reset_token:
            self._reset_skills(token)
        if token or self.reset_token is None:
            self.reset_token = token

    def rebase(self, changes: Mapping[str, Any], source: str = "") -> None:
        """New values under ZooKeeper's (a config file read again): applied
        unless the node sets them (its properties win, as over the command
        line)."""
        self.base.update(changes)
        overridden = sorted(set(changes) & set(self.properties or ()))
        if overridden:
            log.warning("%s set in ZooKeeper (%s): the node's value stays in force",
                        ", ".join(overridden), self.path)
        if self.properties is not None:
            self.settings_changed(self.properties, source)
        else:
            self._configure(self.base, source)


class WorkerMembership(NodeSettings):
    """A worker's registration and live settings."""

    role = "worker"
    node_settings = WORKER_NODE_SETTINGS

    def __init__(self, worker, hosts: str, path: str, version: Optional[str] = None,
                 description: Optional[str] = None,
                 credentials: Optional[Tuple[str, str]] = None) -> None:
        self.worker = worker
        self.hosts = hosts
        self.credentials = credentials  # (zk.connect: digest auth, and ACLs on what it makes)
        self.version = version
        self.description = description
        base = worker.settings()
        self._follow(path, dict(base, reset_skills=""))
        self.client = None
        self.registration: Optional[recipes.Registration] = None
        self.watch: Optional[recipes.PropertiesWatch] = None
        self._waiting: Optional[gevent.Greenlet] = None  # retrying to reach ZooKeeper

    def start(self, timeout: float = 10.0) -> None:
        """Connect, follow the settings, then register (after start()).
        ZooKeeper unreachable: the worker serves the LBs that connect to it
        directly, and registers as soon as ZooKeeper answers."""
        try:
            self._start(timeout)
        except ZooKeeperUnavailable as exc:
            log.warning("%s: serving the LBs that connect directly meanwhile; "
                        "registering in %s when ZooKeeper answers", exc, self.path)
            self._waiting = gevent.spawn(self._start_when_reachable, timeout)

    def _start_when_reachable(self, timeout: float) -> None:
        while True:
            try:
                self._start(timeout)
            except ZooKeeperUnavailable as exc:
                log.info("still waiting for ZooKeeper (%s)", exc)
                continue
            except ConfigurationError as exc:
                log.error("%s: not registering in %s", exc, self.path)
                return
            log.warning("ZooKeeper reached: registered in %s", self.path)
            return

    def _start(self, timeout: float) -> None:
        self.client = _connect(self.hosts, self.path, timeout, self.credentials)
        if self.reset_token is None:  # (its résumé file's, if it has one)
            self.reset_token = self.worker.reset_token
        self.watch = recipes.PropertiesWatch(self.client, self.path, self.settings_changed)
        self.watch.start()
        self.watch.wait(timeout)
        data = {"pid": os.getpid(), "version": self.version,
                "description": self.description}
        node = "%s/providers/%s" % (self.path.rstrip("/"), advertised(self.worker.address))
        self.registration = recipes.Registration(self.client, node, data)
        self.registration.start()
        self.registration.wait(timeout)

    def deregister(self) -> None:
        """Leave the tree first, so LBs stop sending before we drain."""
        if self.registration is not None:
            self.registration.stop()

    def stop(self) -> None:
        if self._waiting is not None:
            self._waiting.kill()
        self.deregister()
        if self.watch is not None:
            self.watch.stop()
        if self.client is not None:
            self.client.stop()
            self.client.close()

    def _configure(self, settings: Mapping[str, Any], source: str) -> None:
        self.worker.configure(settings, source)

    def _reset_skills(self, token: str) -> None:
        log.warning("skills reset (reset_skills=%r)", token)
        self.worker.reset_skills(token)

    def _token_seen(self, token: str) -> None:
        self.worker.seen_reset_token(token)


class LBMembership(NodeSettings):
    """An LB's settings, worker discovery and registration."""

    role = "LB"
    node_settings = LB_NODE_SETTINGS

    def __init__(self, lb, hosts: str, path: str, listen, status_address=None,
                 base_settings: Optional[Mapping[str, Any]] = None,
                 instance: Optional[int] = None,
                 credentials: Optional[Tuple[str, str]] = None) -> None:
        self.lb = lb
        self.instance = instance  # which of --processes N, each an LB of its own
        self.hosts = hosts
        self.credentials = credentials
        self._follow(path.rstrip("/") or "/", base_settings or {})
        self.listen = listen
        self.status_address = status_address
        self.single_version = bool(self.base.get("single_version"))
        self.version: Optional[str] = None
        self.providers: Dict[str, dict] = {}
        self.client = None
        self.recipes: list = []

    def start(self, timeout: float = 10.0) -> None:
        """Connect, follow settings and workers, register; ConfigurationError
        if ZooKeeper refuses our credentials."""
        self.client = _connect(self.hosts, self.path, timeout, self.credentials)
        settings = recipes.PropertiesWatch(self.client, self.path, self.settings_changed)
        workers = recipes.ProvidersWatch(self.client, self._join("workers/providers"),
                                    self._providers_changed)
        lbs = recipes.ProvidersWatch(self.client, self._join("providers"), self._lbs_changed)
        data = {"pid": os.getpid(),
                "status": advertised(self.status_address) if self.status_address else None}
        name = advertised(self.listen)
        if self.instance is not None:
            name += "#%d" % self.instance
        registration = recipes.Registration(self.client, self._join("providers/" + name), data)
        self.recipes = [settings, workers, lbs, registration]
        for recipe in self.recipes:
            recipe.start()
        for recipe in self.recipes:
            recipe.wait(timeout)

    def stop(self) -> None:
        for recipe in reversed(self.recipes):
            recipe.stop()
        if self.client is not None:
            self.client.stop()
            self.client.close()

    def _join(self, relative: str) -> str:
        return "%s/%s" % ("" if self.path == "/" else self.path, relative)

    def _configure(self, settings: Mapping[str, Any], source: str) -> None:
        self.lb.configure(settings, source)
        if bool(settings.get("single_version")) != self.single_version:
            self.single_version = bool(settings.get("single_version"))
            self._update_workers()

    def _reset_skills(self, token: str) -> None:
        """A new ``reset_skills`` value (not the first one seen) resets skills."""
        self.lb.reset_skills("(reset_skills=%r in ZooKeeper)" % token)

    def _lbs_changed(self, providers: Dict[str, dict]) -> None:
        """How many LBs share the workers: the affinity pool recruits alike
        on every LB when there are several."""
        self.lb.pool.lbs = max(len(providers), 1)
        self.lb.fleet.lbs_changed()

    def _providers_changed(self, providers: Dict[str, dict]) -> None:
        self.providers = providers
        self._update_workers()

    def _update_workers(self) -> None:
        providers, standby = self.providers, {}
        if self.single_version:
            version = recipes.majority_version(providers, self.version)
            if version != self.version:
                log.warning("serving worker version %r (was %r): %d of %d workers",
                            version, self.version,
                            len(recipes.of_version(providers, version)), len(providers))
                self.version = version
            served = recipes.of_version(providers, version)
            standby = {address: data.get("version") for address, data in providers.items()
                       if address not in served}  # shown idle, with their version
            providers = served
        self.lb.fleet.set_workers(providers, standby)
