"""``zc-lb worker``: build a worker process from its options, serve,
stop on a signal (``run_worker``).

Rules: a worker is refused before it starts when its options do not go
together, when its application does not load (one line saying why, exit
status 2), and when anyone who reaches it could use it (a non-loopback
address without a secret or TLS, unless --insecure).  Ready, it prints
``zc-lb worker listening on ADDRESS`` (one line, for scripts and tests)
and only then registers in ZooKeeper.  ``-w N`` hands the process to
process/workergroup.py; --reload starts it again, drained, once a source
file of the application changes.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import Callable, Dict, List, Optional

from zc_lb.cli.parsers import zk_credentials
from zc_lb.cli.reload import sighup
from zc_lb.errors import ConfigurationError
from zc_lb.process.service import WorkerService, read_secret, wait_for_signal
from zc_lb.sockets import address_text, inherited_socket, parse_listen

log = logging.getLogger("zc_lb")


def run_worker(args: argparse.Namespace) -> int:
    """``zc-lb worker``: serve until a signal says to stop (with -w N, as
    the supervisor of N worker processes)."""
    if args.workers < 1 or args.max_requests < 0 or args.max_requests_jitter < 0:
        raise ConfigurationError("-w is at least 1, --max-requests and its jitter at least 0")
    for name in ("SIGHUP", "SIGUSR1", "SIGUSR2"):  # until wait_for_signal says so
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    if args.workers > 1:
        from zc_lb.cli.reload import KeptConfig
        from zc_lb.process.workergroup import run

        return run(args, args.argv, KeptConfig(args))
    from zc_lb.process.service import PidFile

    service = build_worker(args)
    service.start()
    pid_file = PidFile(args.pid_file)
    changed: List[str] = []  # (--reload: the application's file that changed)
    try:
        wait_for_signal(_handlers(args, service, changed),
                        ready=lambda: _ready(service, pid_file))
    finally:
        pid_file.remove()
    if changed and args.listen_fd is not None:  # (one of -w N: its supervisor
        log.warning("%s changed: ending, to be started again", changed[0])
        return 0  # starts the next on the socket it holds, as after --max-requests)
    if changed:  # (--reload, drained: the new one takes the address)
        log.warning("%s changed: starting again", changed[0])
        os.chdir(args.start_dir)
        os.execv(sys.executable, [sys.executable, "-m", "zc_lb.cli"] + list(args.argv))
    log.info("worker stopped")
    return 0


def _ready(service: WorkerService, pid_file) -> None:
    """Write the pid file, say where the worker listens, register: once
    signals are handled (so that one sent on seeing the line counts), the
    pid file naming us by then, and before ZooKeeper is reached (ready for
    LBs that know our address)."""
    pid_file.write()
    print("zc-lb worker listening on %s" % address_text(service.worker.address), flush=True)
    if service.status is not None:
        print("zc-lb worker status on %s:%d" % service.status.address, flush=True)
    service.register()


def _handlers(args: argparse.Namespace, service: WorkerService,
              changed: List[str]) -> Dict[str, Callable]:
    """What a worker process does on each signal: SIGTERM and SIGINT stop
    it, SIGHUP reads --config again; with --reload, SIGUSR2 (sent once a
    source file is in ``changed``) stops it to start again.  SIGUSR1 (a
    log rotation's, sent to every process of a unit) and SIGUSR2 otherwise
    mean nothing to a worker, and are not its end."""

    def apply(live: dict) -> None:
        service.configure(live, args.config)

    def nothing() -> bool:
        log.info("nothing to do for that signal in a worker")
        return False

    handlers = {"SIGTERM": service.stop, "SIGINT": service.stop,
                "SIGHUP": sighup(args, apply), "SIGUSR1": nothing, "SIGUSR2": nothing}
    if args.reload:
        import gevent

        handlers["SIGUSR2"] = lambda: bool(changed) and service.stop()
        gevent.spawn(_watch_sources, os.getcwd(), changed)
    return handlers


RELOAD_POLL = 0.5  # seconds between looks at the application's files (--reload)


def _watch_sources(root: str, changed: List[str]) -> None:
    """(--reload) Look at the source files of the modules loaded from under
    ``root`` every RELOAD_POLL; the first one changed goes in ``changed``,
    and SIGUSR2 to ourselves drains and starts us again (run_worker)."""
    import gevent

    root = os.path.join(os.path.abspath(root), "")
    seen: Dict[str, float] = {}
    while not changed:
        for module in list(sys.modules.values()):
            path = getattr(module, "__file__", None)
            if not path or not path.startswith(root) or "site-packages" in path:
                continue
            try:
                mtime = os.stat(path).st_mtime
            except OSError:
                continue
            if seen.setdefault(path, mtime) != mtime:
                changed.append(path)
                os.kill(os.getpid(), signal.SIGUSR2)
                return
        gevent.sleep(RELOAD_POLL)


def build_worker(args: argparse.Namespace) -> WorkerService:
    """The worker, its status server and membership, not started."""
    from zc_lb.routing.classifier import load_object
    from zc_lb.tls import worker_context
    from zc_lb.worker.server import Worker, load_app

    _check_modes(args)

    listen = parse_listen(args.listen)
    if isinstance(listen, str) and args.zookeeper:
        raise ConfigurationError(
            "--listen unix:%s: a worker on a Unix socket is reached only from its own "
            "machine, so it does not register in ZooKeeper; give the LBs on this machine "
            "--worker unix:%s, or listen on HOST:PORT" % (listen, listen))
    secret = read_secret(args.secret_file)
    tls = worker_context(args.tls_cert, args.tls_key, args.tls_ca)
    _check_exposure(listen, secret, args.insecure, tls)
    if args.listen_fd is not None:  # one of -w N: the supervisor holds the socket
        listen = inherited_socket(args.listen_fd)
    app = load_object(args.app, "application", load_app)
    worker = Worker(app, listen=listen, history=args.history,
                    max_skill_age=args.max_skill_age, max_classes=args.max_classes,
                    resume_interval=args.resume_interval, resume_file=args.resume_file,
                    threads=args.threads, threads_fixed=args.threads_fixed,
                    concurrency=args.concurrency, secret=secret,
                    version=args.version, tls=tls, sendfile=args.sendfile,
                    max_requests=_max_requests(args))
    return WorkerService(worker, _status_server(args, worker), _membership(args, worker),
                         args.drain_timeout)


def _check_modes(args: argparse.Namespace) -> None:
    """Refuse an application missing, or options of the two modes
    (threads, greenlets) mixed."""
    if not args.app:
        raise ConfigurationError("no application: give module:callable (or a PasteDeploy "
                                 ".ini file) on the command line, or app in --config")
    if args.concurrency and args.threads:
        raise ConfigurationError("--concurrency bounds --greenlets; with threads, --threads N "
                                 "is the bound")
    if args.threads_fixed and not args.threads:
        raise ConfigurationError("--threads-fixed is for thread mode, not --greenlets")


def _check_exposure(listen, secret: Optional[bytes], insecure: bool, tls=None) -> None:
    """Refuse a worker reachable from other hosts that anyone could use
    (mutual TLS, like the secret, lets in only the site's LBs)."""
    from zc_lb.sockets import is_loopback

    if isinstance(listen, str):  # a Unix socket: its file's permissions say who may
        return
    if not (is_loopback(listen[0]) or secret or insecure or tls is not None):
        raise ConfigurationError(
            "a worker listening on %s without --secret-file lets anyone who reaches it "
            "send requests (with any REMOTE_ADDR) and read its résumé; give "
            "--secret-file (or --tls-cert), or --insecure if that is what you want"
            % (listen[0] or "*"))


def _max_requests(args: argparse.Namespace) -> int:
    """--max-requests, with its jitter added (0: never)."""
    max_requests = args.max_requests
    if max_requests:
        import random

        max_requests += random.randint(0, args.max_requests_jitter)
    return max_requests


def _status_server(args: argparse.Namespace, worker):
    """The worker's --status server (JSON and /metrics), or None."""
    if not args.status:
        return None
    from zc_lb.front.server import FrontServer
    from zc_lb.sockets import parse_address
    from zc_lb.status.document import status_app
    from zc_lb.status.metrics import WorkerCollector

    return FrontServer(parse_address(args.status),
                       status_app(worker.status, collector=WorkerCollector(worker.status)))


def _membership(args: argparse.Namespace, worker):
    """The worker's registration in ZooKeeper (--zookeeper), or None."""
    if not args.zookeeper:
        return None
    from zc_lb.zookeeper.membership import WorkerMembership

    return WorkerMembership(worker, args.zookeeper, args.path, args.version, args.description,
                            credentials=zk_credentials(args))
