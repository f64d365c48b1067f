"""What every zc-lb process does around its own work: read its secret,
parse its listeners, wait for signals and dispatch them, hand its
sockets over to a successor (SIGUSR2), serve an LB's status address.

``cli/`` (one LB or worker) and ``process/processes.py`` (the supervisor of
``lb --processes N``) both build on these, and neither imports the other.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import logging
import os
import signal
import stat
from typing import Dict, FrozenSet, List, Optional, Tuple

from zc_lb.process import pending, restart
from zc_lb.errors import AddressUnavailable, ConfigurationError
from zc_lb.sockets import address_text, worker_addresses

log = logging.getLogger("zc_lb")

DEFAULT_LISTEN = "127.0.0.1:8080"


# glibc's malloc: the free memory it keeps at the top of its heap before
# giving it back to the kernel, and the size from which it maps an
# allocation on its own (``keep_freed_memory``).
MALLOC_TRIM_THRESHOLD = 4 * 1024 * 1024
MALLOC_MMAP_THRESHOLD = 1024 * 1024
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # (glibc's malloc.h)


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep up to MALLOC_TRIM_THRESHOLD of freed
    memory rather than give it back at once.  A large body moves in
    frames of up to 256 KiB, each in a buffer made and freed in turn;
    by default malloc gave each back to the kernel (its trim threshold
    follows its mmap threshold, which grows to the largest buffer freed)
    and took it again for the next: two ``brk`` calls a frame, and every
    page of it faulted in and zeroed once more.  That was most of the
    LB's system time for a 20 MB body, and the LB moved 1.1-1.3 GB/s;
    with this, 1.5-2.0.  (16 MiB kept did no better than 4, and cost a
    slow client's measure 16 KB more.)  Nothing is done where an operator set
    ``MALLOC_TRIM_THRESHOLD_`` or ``MALLOC_MMAP_THRESHOLD_``, or where
    the C library is not glibc (False)."""
    if "MALLOC_TRIM_THRESHOLD_" in os.environ or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        import ctypes

        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # (not glibc: musl has no mallopt)
        return False
    return bool(mallopt(M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD)
                and mallopt(M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD))


# The secret files this process read (the shared secret, the admin
# token), each with its content's digest: SIGHUP reads them again
# (``check_secret_files``).
SECRETS_READ: Dict[str, bytes] = {}

# A supervisor (``-w``, ``--processes``) reads the secret files before it
# starts its children, and names them to the children in this variable:
# it alone warns of their mode at start and of a change at SIGHUP, once
# for the group, not once a process.
SECRETS_WATCHED = "ZC_LB_SECRETS_WATCHED"
_watched: Optional[FrozenSet[str]] = None  # (read from it at the first secret)


def watch_secrets_for_children(*paths: Optional[str]) -> None:
    """(A supervisor, before it starts its children.)  Read the secret
    files at ``paths`` (a bad one is an error at start, once, not in each
    child), warn of each that others may read, and name them to the
    children (``SECRETS_WATCHED``)."""
    global _watched
    os.environ.pop(SECRETS_WATCHED, None)  # (an old supervisor's, at a hand-over)
    _watched = frozenset()
    for path in paths:
        read_secret(path)
    os.environ[SECRETS_WATCHED] = json.dumps(sorted(SECRETS_READ))


def _watched_by_supervisor() -> FrozenSet[str]:
    global _watched
    if _watched is None:
        try:
            _watched = frozenset(json.loads(os.environ.pop(SECRETS_WATCHED, "[]")))
        except (ValueError, TypeError):
            _watched = frozenset()
    return _watched


def read_secret(path: Optional[str]) -> Optional[bytes]:
    """The shared secret (or admin token) in the file at ``path``, if any.
    A file that others may read, or a group this process is not in, is
    used with a warning (``secret_readers``), once a process, and not in
    a supervisor's child (``watch_secrets_for_children``)."""
    watched = _watched_by_supervisor()  # (read, and gone from the app's environment)
    if not path:
        return None
    secret, info = _read_secret_file(path)
    if path in watched:
        return secret  # (its supervisor warns, and reads it again at SIGHUP)
    readers = None if path in SECRETS_READ else secret_readers(info)
    if readers:
        log.warning("secret file %s can be read by %s (mode %04o): make it readable by "
                    "the service alone (chmod 600, or 640 and a group the service runs in)",
                    path, readers, stat.S_IMODE(info.st_mode))
    SECRETS_READ[path] = hashlib.sha256(secret).digest()
    return secret


def read_admin_token(path: Optional[str]) -> Optional[bytes]:
    """The admin token in the file at ``path`` (``read_secret``), if any;
    ConfigurationError if it holds a control character (a line break of
    a file of two lines, a byte of a random token not written as text):
    no ``Authorization`` header can carry it, so no action could ever be
    taken, and a client could only fail to send it."""
    token = read_secret(path)
    if token is not None and any(byte < 0x20 or byte == 0x7F for byte in token):
        raise ConfigurationError(
            "admin token file %s holds a control character (a line break?): no "
            "Authorization header can carry it; make it one line of text "
            "(head -c 32 /dev/urandom | base64)" % path)
    return token


def _read_secret_file(path: str) -> Tuple[bytes, os.stat_result]:
    """The secret in the file at ``path``, stripped, and the file's
    ``fstat``; ConfigurationError if it cannot be read or is empty."""
    try:
        with open(path, "rb") as f:
            info = os.fstat(f.fileno())
            secret = f.read().strip()
    except OSError as exc:
        raise ConfigurationError("cannot read secret file %s: %s" % (path, exc))
    if not secret:
        raise ConfigurationError("secret file %s is empty" % path)
    return secret, info


def check_secret_files() -> List[str]:
    """(SIGHUP) Read every secret file this process read again, and warn
    of each that changed, or cannot be read now: the secret read at start
    stays in force until a restart.  The paths of those."""
    changed = []
    for path, digest in SECRETS_READ.items():
        try:
            secret, _ = _read_secret_file(path)
        except ConfigurationError as exc:
            log.warning("SIGHUP: %s; the secret read at start stays in force", exc)
            changed.append(path)
            continue
        if not hmac.compare_digest(hashlib.sha256(secret).digest(), digest):
            log.warning("secret file %s changed: restart to apply (the secret read at "
                        "start stays in force)", path)
            changed.append(path)
    return changed


def secret_readers(info: os.stat_result) -> Optional[str]:
    """Who else than this service may read a secret file of ``info`` (its
    ``fstat``): "others", "group" (a group this process is not in: its
    own, as in docs/howto/deploy-systemd.rst, is the service), both, or
    None.  As ssh says of a key, but it is not refused: that would stop
    deployments that run."""
    if not stat.S_ISREG(info.st_mode):  # (a pipe, /dev/stdin)
        return None
    readers = []
    if info.st_mode & stat.S_IRGRP and info.st_gid not in (
            os.getegid(), *os.getgroups()):
        readers.append("group")
    if info.st_mode & stat.S_IROTH:
        readers.append("others")
    return " and ".join(readers) or None


def ignore_sighup() -> bool:
    # A terminal hang-up or a habitual "reload" must not kill a server with
    # requests in flight; SIGHUP has no meaning yet, so say so and go on.
    log.warning("SIGHUP ignored: zc-lb has no configuration to reload "
                "(SIGTERM drains and stops)")
    return False


# What a signal that came while a new LB started (SIGUSR2) is to the new
# LB, which is the service once it serves: passed on (``pass_on_pending``).
PASSED_ON = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1")


def pass_on_pending(pid: int) -> None:
    """(The new LB of pid ``pid`` serves.)  Pass it the signals that came
    while it started, meant for the service it now is: a SIGTERM stops it
    too, a SIGHUP has it read --config again (it may have read it before
    the change the SIGHUP was sent for); a SIGUSR2 is the restart just
    done, and is dropped.  Each said."""
    queued = pending.queue
    while queued is not None and not queued.empty():
        name = queued.get()[0]
        if name not in PASSED_ON:
            log.warning("%s came while the new LB (pid %d) started: not passed on to it",
                        name, pid)
            continue
        log.warning("%s came while the new LB (pid %d) started: passed on to it", name, pid)
        try:
            os.kill(pid, getattr(signal, name))
        except OSError as exc:
            log.error("cannot pass %s on to the new LB (pid %d): %s", name, pid, exc)


def wait_for_signal(handlers: dict, ready=None) -> None:
    """Queue SIGTERM/SIGINT/SIGHUP (and any other signal ``handlers``
    names, e.g. SIGUSR1); dispatch each to ``handlers[name]`` until a
    handler returns True (meaning: exit); SIGHUP reads the secret files
    again first (``check_secret_files``).  ``ready()``, if given, runs
    once they are handled (the pid file: a SIGTERM to the pid it names
    must find them)."""
    import gevent
    import gevent.queue

    signals: "gevent.queue.Queue[Tuple[str, str]]" = gevent.queue.Queue()
    pending.queue = signals
    handlers = dict(handlers)
    handlers.setdefault("SIGHUP", ignore_sighup)  # its default would kill us
    # (cancelled on return: a watcher left behind keeps its signal from
    # the next watchers of this process, which libev then never installs)
    watchers = [gevent.signal_handler(getattr(signal, name), signals.put, (name, "got " + name))
                for name in handlers]
    try:
        if ready is not None:
            ready()
        while True:
            name, why = signals.get()
            log.info("%s", why)
            if name == "SIGHUP":
                check_secret_files()
            if handlers[name]():
                # Signals that came while the last one was handled (a second
                # SIGUSR2 during a restart, say, or any during the drain
                # that follows one) go to no one: say so.
                while not signals.empty():
                    log.warning("%s came while %s was handled, and is not acted on by this "
                                "process, which is ending", signals.get()[0], name)
                return
    finally:
        pending.queue = None
        for watcher in watchers:
            watcher.cancel()


def parse_listeners(args: argparse.Namespace) -> List[Tuple[str, str]]:
    """(scheme, HOST:PORT) of every ``--listen``: ``https://`` is HTTPS,
    ``http://`` plain HTTP, and a bare HOST:PORT HTTPS with --certfile."""
    found = []
    for text in args.listen or [DEFAULT_LISTEN]:
        scheme, sep, where = text.partition("://")
        if not sep:
            scheme, where = ("https" if args.certfile else "http"), text
        if scheme not in ("http", "https"):
            raise ConfigurationError("--listen %s: the scheme is http:// or https://" % text)
        if scheme == "https" and not args.certfile:
            raise ConfigurationError("--listen %s needs --certfile" % text)
        found.append((scheme, where))
    if args.redirect_https and not any(scheme == "https" for scheme, _ in found):
        raise ConfigurationError("--redirect-https needs an HTTPS --listen")
    if len(found) > 1 and getattr(args, "processes", 1) > 1:
        raise ConfigurationError("--processes takes one --listen address")
    return found


def hand_over(args: argparse.Namespace, sockets: dict, addresses: Dict[str, str]) -> bool:
    """SIGUSR2: start a new LB on our ``sockets`` (name -> socket, each
    listening at ``addresses[name]``, its option's text) and wait until
    it serves; whether it does (then this one drains and exits)."""
    restart.sd_notify("RELOADING=1")
    successor = restart.Successor(restart.command_line(args.argv), sockets,
                                  cwd=getattr(args, "start_dir", None), addresses=addresses)
    log.info("SIGUSR2: starting a new LB on our sockets")
    if not successor.start():
        restart.sd_notify("READY=1")
        try:  # (the new LB wrote its own pid there before it failed)
            PidFile(getattr(args, "pid_file", None)).write()
        except ConfigurationError as exc:
            log.error("%s", exc)
        return False
    pid = successor.process.pid  # type: ignore[union-attr]
    log.info("the new LB (pid %d) serves: this one (pid %d) stops accepting and drains",
             pid, os.getpid())
    pass_on_pending(pid)
    return True


class PidFile:
    """``--pid-file``: this process's pid, written (atomically) once it
    serves, removed when it ends if it still names this process (after a
    hitless restart it names the new LB, which wrote it when ready)."""

    def __init__(self, path: Optional[str]) -> None:
        self.path = path

    def write(self) -> None:
        if not self.path:
            return
        directory = os.path.dirname(os.path.abspath(self.path))
        temporary = os.path.join(directory, ".%s.%d" % (os.path.basename(self.path),
                                                         os.getpid()))
        try:
            with open(temporary, "w") as f:
                f.write("%d\n" % os.getpid())
            os.replace(temporary, self.path)
        except OSError as exc:
            raise ConfigurationError("--pid-file %s: %s" % (self.path, exc.strerror or exc))

    def remove(self) -> None:
        if not self.path:
            return
        try:
            with open(self.path) as f:
                if f.read().strip() != str(os.getpid()):
                    return  # (another process's now)
            os.unlink(self.path)
        except OSError:
            pass


def start_named(option: str, address, start) -> None:
    """``start()`` a server of ``option``'s address: an address in use or
    not ours is an AddressUnavailable that names the option (exit status
    1), not a raw errno."""
    try:
        start()
    except OSError as exc:
        shown = address_text(address) if isinstance(address, (tuple, str)) else address
        reason = (exc.strerror or str(exc)).split(": (")[0]  # (gevent adds the address)
        raise AddressUnavailable("%s %s: %s" % (option, shown or "", reason))


def lb_status_app(get_status, actions, get_requests, token=None, workers_in_pool=None):
    """The status app of an LB (or a supervisor): JSON, the HTML page,
    /metrics from the document, /healthz (503 while ``workers_in_pool()``
    is 0: an LB that can only answer 503 is not ready, and a balancer in
    front of several should send elsewhere), the actions (with the admin
    ``token``, if any); the request rate sampled every 5 s for the page's
    sparkline."""
    from zc_lb.status.metrics import LBCollector
    from zc_lb.status.document import RequestHistory, status_app
    from zc_lb.status.page import render

    history = RequestHistory(get_requests).start()

    def unready():
        if workers_in_pool is not None and not workers_in_pool():
            return "no worker in the pool"
        return None

    return status_app(get_status, actions, collector=LBCollector(get_status),
                      page=render, history=history, token=token, unready=unready)


class WorkerService:
    """A worker process's parts and their lifecycle: the worker, and
    perhaps its status server and its ZooKeeper membership.  ``start()``
    serves (LBs that know the address may connect at once); ``register()``
    joins ZooKeeper; ``configure()`` applies live settings (ZooKeeper's
    values win over a file's); ``stop()`` leaves ZooKeeper first, so
    LBs send nothing new, then drains and closes."""

    def __init__(self, worker, status=None, membership=None,
                 drain_timeout: float = 30.0) -> None:
        self.worker = worker
        self.status = status
        self.membership = membership
        self.drain_timeout = drain_timeout

    def start(self) -> None:
        start_named("--listen", self.worker.listen, self.worker.start)
        if self.status is not None:
            start_named("--status", getattr(self.status, "listen", None), self.status.start)

    def register(self) -> None:
        if self.membership is not None:
            self.membership.start()

    def configure(self, live: dict, source: str = "") -> None:
        if self.membership is not None:
            self.membership.rebase(live, source)
        else:
            self.worker.configure(live, source)

    def stop(self) -> bool:
        """Leave, drain, close; True (the process may exit)."""
        if self.membership is not None:
            self.membership.deregister()  # LBs stop sending before we drain
        self.worker.stop(timeout=self.drain_timeout)
        if self.status is not None:
            self.status.stop(timeout=1)
        if self.membership is not None:
            self.membership.stop()
        return True


class LBService:
    """An LB process's parts and their lifecycle: the LB, its front
    servers (the first one's address is the one registered), perhaps a
    status server and a ZooKeeper membership.  ``start()`` serves;
    ``register()`` joins ZooKeeper; ``configure()`` applies live
    settings; ``reopen()`` the access log (SIGUSR1); ``hand_over()`` its
    sockets to a successor (SIGUSR2); ``stop()`` stops accepting, drains
    what is in flight, then closes everything."""

    def __init__(self, lb, fronts: list, status=None, drain_timeout: float = 30.0) -> None:
        self.lb = lb
        self.fronts = fronts
        self.status = status
        self.membership = None
        self.drain_timeout = drain_timeout

    def start(self, workers: List[str], health_check: Optional[str] = None,
              health_interval: float = 5.0) -> None:
        lb = self.lb
        lb.fleet.set_workers(workers)
        lb.watch_workers()
        if health_check:
            lb.fleet.start_health_checks(health_check, health_interval)
        for server in self.fronts:
            start_named("--listen", getattr(server, "listen", None), server.start)
        if self.status is not None:
            start_named("--status", getattr(self.status, "listen", None), self.status.start)

    def register(self, membership) -> None:
        """Join ZooKeeper through ``membership`` (made after ``start()``:
        it registers the bound addresses)."""
        self.membership = membership
        membership.start()

    def configure(self, live: dict, source: str = "") -> None:
        """Live settings, and for a static LB its ``worker`` list, taken
        whole or not at all: a list with a bad address is refused
        (ConfigurationError) before anything changes; no list at all (None)
        keeps the workers.  (``live`` is left as it is: the caller records
        it as what runs.)"""
        live = dict(live)
        workers = None
        if "worker" in live:
            given = live.pop("worker")
            if given is None:  # (a file cut short, a key commented out: not a list)
                log.warning("no worker list in %s any more: the %d workers stay (an empty "
                            "list, worker = [], empties the pool)", source or "the configuration",
                            len(self.lb.fleet.links))
            else:
                workers = worker_addresses(given, "worker")
        if live:
            if self.membership is not None:  # ZooKeeper's values still win
                self.membership.rebase(live, source)
            else:
                self.lb.configure(live, source)
        if workers is not None:
            if not workers:
                log.warning("the worker list in %s is empty: every worker leaves the pool",
                            source or "the configuration")
            self.lb.fleet.set_workers(workers)

    def reopen(self) -> bool:
        access_log = self.fronts[0].access_log
        if access_log is not None:
            access_log.reopen()
        return False

    def hand_over(self, args: argparse.Namespace) -> bool:
        """SIGUSR2: a new LB on our sockets; once it serves, we stop."""
        sockets = {"front%d" % i: server.server.socket for i, server in enumerate(self.fronts)}
        addresses = {"front%d" % i: where for i, (_, where) in enumerate(parse_listeners(args))}
        if self.status is not None:
            sockets["status"] = self.status.server.socket
            addresses["status"] = args.status
        return hand_over(args, sockets, addresses) and self.stop()

    def stop(self) -> bool:
        """Stop accepting, finish what is in flight, close; True."""
        for server in self.fronts:
            server.drain()
        self.lb.drain(self.drain_timeout)
        for server in self.fronts:  # (they share the access log: closed once all are done)
            server.stop(timeout=1, close_log=False)
        if self.fronts[0].access_log is not None:
            self.fronts[0].access_log.close()
        if self.status is not None:
            self.status.stop(timeout=1)
        if self.membership is not None:
            self.membership.stop()
        self.lb.stop()
        return True
