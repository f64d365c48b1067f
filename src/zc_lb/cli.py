"""``zc-lb`` and its subcommands: parse, build, run; nothing else.

Each ``run_*`` function builds the objects of one process from parsed
arguments, starts them, prints the address it listens on (one line on
standard output, so scripts and tests can find an ephemeral port), then
waits for a signal.  Signal handlers only queue the signal; the main loop
dispatches it, as gunicorn's arbiter does.
"""

from __future__ import annotations

import argparse
import functools
import gc
import logging
import os
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional

from zc_lb import config, settings
from zc_lb.process import restart
from zc_lb.front.accesslog import DEFAULT_FORMAT
from zc_lb.errors import ConfigurationError, ZcLbError
from zc_lb.sockets import address_text, parse_listen
from zc_lb.process.service import (DEFAULT_LISTEN, LBService, WorkerService, ignore_sighup,
                      keep_freed_memory, lb_status_app, parse_listeners, read_secret,
                      wait_for_signal)

log = logging.getLogger("zc_lb")



def _read_page(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ConfigurationError("cannot read error page %s: %s" % (path, exc))


# -- --config and SIGHUP --------------------------------------------------

COMMAND_SETTINGS = {"lb": settings.LB_SETTINGS, "worker": settings.WORKER_SETTINGS}
NOT_COMPARED = frozenset({"argv", "start_dir", "run", "config", "command", "log_level"})


def read_config(args: argparse.Namespace) -> argparse.Namespace:
    """``args.argv`` parsed again with ``args.config``'s values as the
    defaults (config.py): the command line overrides the file."""
    parser = build_parser()
    command = parser.commands[args.command]  # type: ignore[attr-defined]
    try:
        new = config.apply(parser, args.argv, command, args.config, args.command,
                           COMMAND_SETTINGS[args.command])
    except SystemExit:  # argparse refused the command line (it said why)
        raise ConfigurationError("the command line is no longer valid with %s" % args.config)
    new.argv, new.start_dir = args.argv, getattr(args, "start_dir", None)
    return new


def reload_config(args: argparse.Namespace, apply, live_extra=frozenset()) -> bool:
    """SIGHUP with --config: read the file again; pass the changed settings
    that may change live (``where`` has "live", and ``live_extra``) to
    ``apply``, whose configure method logs each as "name old -> new
    (file)" (``live_extra`` is logged here); log the others as needing a
    restart.  A bad file is logged and changes nothing.  Never exits."""
    try:
        new = read_config(args)
    except ConfigurationError as exc:
        log.error("SIGHUP: %s; keeping the running settings", exc)
        return False
    except Exception:  # a reload must never stop a serving process
        log.exception("SIGHUP: cannot read %s; keeping the running settings", args.config)
        return False
    live, restart = _changes(args, new, live_extra)
    if live:
        try:
            apply(live)
        except ConfigurationError as exc:
            log.error("SIGHUP: cannot apply %s: %s; keeping the running settings",
                      args.config, exc)
            return False
        except Exception:
            log.exception("SIGHUP: cannot apply %s", args.config)
            return False
        for dest, value in live.items():
            if dest in live_extra:  # (logged once applied, as configure logs the others)
                settings.log_change(dest, getattr(args, dest, None), value, args.config)
            setattr(args, dest, value)
    if not live and not restart:
        log.info("SIGHUP: %s read again; nothing changed", args.config)
    return False


def _changes(args: argparse.Namespace, new: argparse.Namespace, live_extra) -> tuple:
    """What ``new`` changes of ``args``: the live settings' new values,
    and the names of the others (each logged as needing a restart)."""
    table = COMMAND_SETTINGS[args.command]
    live, restart = {}, []
    for dest in sorted(set(vars(args)) | set(vars(new))):
        before, after = getattr(args, dest, None), getattr(new, dest, None)
        if dest in NOT_COMPARED or before == after:
            continue
        setting = table.get(dest)
        if dest in live_extra or (setting is not None and settings.LIVE in setting.where):
            live[dest] = after
        else:
            restart.append(dest)
            log.warning("%s changed in %s; restart to apply (%s stays in force)",
                        dest, args.config, settings.shown(before))
    return live, restart


def _sighup(args: argparse.Namespace, apply, live_extra=frozenset()):
    """The SIGHUP handler: reload ``--config``, or without one, say SIGHUP
    means nothing."""
    if not getattr(args, "config", None):
        return ignore_sighup
    return lambda: reload_config(args, apply, live_extra)


# -- worker -------------------------------------------------------------


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


def run_worker(args: argparse.Namespace) -> int:
    if args.workers < 1 or args.max_requests < 0 or args.max_requests_jitter < 0:
        raise ConfigurationError("-w is at least 1, --max-requests and its jitter at least 0")
    if args.workers > 1:
        from zc_lb.process.workergroup import run

        return run(args, args.argv)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # until wait_for_signal says so
    from zc_lb.process.service import PidFile

    service = build_worker(args)
    if args.max_requests:
        import random

        service.worker.max_requests = args.max_requests + random.randint(
            0, args.max_requests_jitter)
    service.start()
    pid_file = PidFile(args.pid_file)
    try:
        # Ready for LBs that know our address, whatever ZooKeeper is doing.
        print("zc-lb worker listening on %s" % address_text(service.worker.address),
              flush=True)
        if service.status is not None:
            print("zc-lb worker status on %s:%d" % service.status.address, flush=True)
        service.register()

        def apply(live: dict) -> None:
            service.configure(live, args.config)

        handlers = {"SIGTERM": service.stop, "SIGINT": service.stop,
                    "SIGHUP": _sighup(args, apply)}
        if args.reload:
            import gevent

            changed: List[str] = []
            handlers["SIGUSR2"] = lambda: bool(changed) and service.stop()
            gevent.spawn(_watch_sources, os.getcwd(), changed)
        wait_for_signal(handlers, ready=pid_file.write)
    finally:
        pid_file.remove()
    if args.reload and changed:  # (drained: the new one takes the address)
        log.warning("%s changed: starting again", changed[0])
        os.chdir(args.start_dir)
        os.execv(sys.executable, [sys.executable, "-m", "zc_lb.cli"] + list(args.argv))
    log.info("worker stopped")
    return 0


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


def _load_app(spec: str, load_app):
    """The application, or a ConfigurationError (exit status 2) with the
    short cause: a SyntaxError's file and line, an error raised while
    its module ran with where, not a traceback."""
    import traceback

    try:
        return load_app(spec)
    except ConfigurationError:
        raise
    except SyntaxError as exc:
        raise ConfigurationError("cannot load the application %s: %s (%s, line %s)" % (
            spec, exc.msg, exc.filename, exc.lineno))
    except Exception as exc:  # (its module raised as it ran)
        where = traceback.extract_tb(exc.__traceback__)[-1]
        raise ConfigurationError("cannot load the application %s: %s: %s (%s, line %s)" % (
            spec, type(exc).__name__, exc, where.filename, where.lineno))


def build_worker(args: argparse.Namespace) -> WorkerService:
    """The worker, its status server and membership, not started."""
    from zc_lb.sockets import parse_address
    from zc_lb.worker.server import Worker, load_app

    if not args.app:
        raise ConfigurationError("no application: give module:callable (or a PasteDeploy "
                                 ".ini file) on the command line, or app in --config")
    if args.concurrency and args.threads:
        raise ConfigurationError("--concurrency bounds --greenlets; with threads, --threads N "
                                 "is the bound")
    if args.threads_fixed and not args.threads:
        raise ConfigurationError("--threads-fixed is for thread mode, not --greenlets")
    from zc_lb.tls import worker_context

    listen = parse_listen(args.listen)
    if isinstance(listen, str) and args.zookeeper:
        raise ConfigurationError(
            "--listen unix:%s: a worker on a Unix socket is reached only from its own "
            "machine, so it does not register in ZooKeeper; give the LBs on this machine "
            "--worker unix:%s, or listen on HOST:PORT" % (listen, listen))
    secret = read_secret(args.secret_file)
    tls = worker_context(args.tls_cert, args.tls_key, args.tls_ca)
    _check_exposure(listen, secret, args.insecure, tls)
    worker = Worker(_load_app(args.app, load_app), listen=listen, history=args.history,
                    max_skill_age=args.max_skill_age, max_classes=args.max_classes,
                    resume_interval=args.resume_interval, resume_file=args.resume_file,
                    threads=args.threads, threads_fixed=args.threads_fixed,
                    concurrency=args.concurrency, secret=secret,
                    version=args.version, tls=tls, sendfile=args.sendfile)
    status = None
    if args.status:
        from zc_lb.front.server import FrontServer
        from zc_lb.status.metrics import WorkerCollector
        from zc_lb.status.document import status_app

        status = FrontServer(parse_address(args.status),
                             status_app(worker.status, collector=WorkerCollector(worker.status)))
    membership = None
    if args.zookeeper:
        from zc_lb.zookeeper.membership import WorkerMembership

        membership = WorkerMembership(worker, args.zookeeper, args.path,
                                      args.version, args.description,
                                      credentials=_zk_credentials(args))
    return WorkerService(worker, status, membership, args.drain_timeout)


# -- lb -----------------------------------------------------------------


def _spool_limits(args: argparse.Namespace):
    """The response buffers' bounds; the directory must be one."""
    from zc_lb.lb.spool import SpoolLimits

    if args.buffer_dir and not os.path.isdir(args.buffer_dir):
        raise ConfigurationError("--buffer-dir %s is not a directory" % args.buffer_dir)
    return SpoolLimits(args.buffer_memory, args.buffer_memory_total, args.buffer_disk,
                       args.buffer_disk_total, args.buffer_dir or None)


def _lb_document(lb, fronts) -> dict:
    """The LB's status document, with zc-lb's version and where it listens."""
    doc = lb.status()
    doc["version"] = version()
    doc["clients"] = sum(front.connections for front in fronts)
    doc["listen"] = ["%s://%s" % ("https" if getattr(front, "tls", None) else "http",
                                  address_text(front.address))
                     for front in fronts if getattr(front, "server", None) is not None]
    return doc


def build_lb(args: argparse.Namespace):
    """The LB object and its front and status servers, not started."""
    from zc_lb.front.accesslog import AccessLog, LogFormat
    from zc_lb.front.server import FrontServer, tls_context
    from zc_lb.sockets import parse_address

    lb = _make_lb(args)
    from zc_lb.tls import lb_context

    workers_tls = lb_context(args.worker_tls_cert, args.worker_tls_key, args.worker_tls_ca)
    if workers_tls is not None:  # (every link, from its first connection)
        import dataclasses

        lb.fleet.link_config = dataclasses.replace(lb.fleet.link_config, tls=workers_tls)
    if args.siblings_fd is not None:  # one of --processes N: they route as one
        from zc_lb.routing.siblings import Siblings

        lb.share_with(Siblings.attach(args.siblings_fd, args.process_index or 0))
    tls = None
    if args.certfile:
        tls = tls_context(args.certfile, args.keyfile, args.tls_min_version, args.tls_ciphers)
    elif args.keyfile:
        raise ConfigurationError("--keyfile needs --certfile")
    access_log = None
    if args.access_log:
        access_log = AccessLog.open(args.access_log, LogFormat(args.access_log_format))
    elif args.access_log_format != DEFAULT_FORMAT:
        LogFormat(args.access_log_format)  # refuse a bad one all the same
        log.warning("--access-log-format without --access-log: no access log is written")
    fronts = _build_fronts(args, lb, tls, access_log)
    status = None
    if args.status:
        status = FrontServer(restart.inherited("status") or parse_address(args.status),
                             lb_status_app(
            functools.partial(_lb_document, lb, fronts), lb_actions(lb), lambda: lb.counters.requests,
            read_secret(args.admin_token_file), lambda: len(lb.pool)))
    return lb, fronts, status


def _make_lb(args: argparse.Namespace):
    """The LB of the options: its pool, classifier, limits, error pages."""
    from zc_lb.routing.policies import make_pool
    from zc_lb.routing.classifier import get_classifier, get_key_function
    from zc_lb.lb.balancer import LB

    pool = make_pool(args.policy, _lb_settings(args))
    pages = {}
    if args.error_page:
        page = _read_page(args.error_page)
        pages = {502: page, 503: page}
    return LB(pool, get_classifier(args.classifier),
              affinity_key=get_key_function(args.affinity_key),
              max_retries=args.max_retries,
              outlier=dict(consecutive=args.eject_after or 10**9, base_time=args.eject_time,
                           max_time=10 * args.eject_time, max_share=args.max_ejected),
              no_worker_timeout=args.no_worker_timeout,
              response_timeout=args.response_timeout or None,
              keepalive_timeout=args.keepalive_timeout,
              drain_timeout=args.drain_timeout,
              secret=read_secret(args.secret_file), pages=pages,
              max_request_body=args.max_request_body, spool_limits=_spool_limits(args))


def _build_fronts(args: argparse.Namespace, lb, tls, access_log) -> list:
    """A front server per ``--listen``, on the socket inherited from the
    LB this one replaces or from the supervisor, if any, not started."""
    from zc_lb.front.forwarding import Forwarding, parse_headers, parse_networks
    from zc_lb.front.server import FrontServer, default_max_connections, https_redirect

    forwarding = Forwarding(parse_headers(args.forwarded),
                            parse_networks([args.trusted_proxies]))
    max_connections = (default_max_connections() if args.max_connections is None
                       else args.max_connections or None)
    listeners = parse_listeners(args)
    fronts: list = []

    def https_port() -> int:  # (where the first HTTPS listener is bound, once it is)
        return next((front.address[1] for front in fronts
                     if front.tls is not None and isinstance(front.address, tuple)), 443)
    for index, (scheme, where) in enumerate(listeners):
        listen = restart.inherited("front%d" % index)  # from the LB this one replaces
        if listen is None and args.listen_fd is not None:  # one of --processes N
            from zc_lb.process.processes import inherited_socket

            listen = inherited_socket(args.listen_fd)
        elif listen is None:
            listen = parse_listen(where)
        app = lb if scheme == "https" or not args.redirect_https else https_redirect(https_port)
        fronts.append(FrontServer(
            listen, app, access_log, tls=tls if scheme == "https" else None,
            client_timeout=args.client_timeout or None,
            header_timeout=args.header_timeout or None, max_connections=max_connections,
            counter=lb.count_answer, forwarding=forwarding,
            proxy_protocol=args.proxy_protocol, pages=lb.pages))
    return fronts


def _reload_tls(args: argparse.Namespace, servers: list) -> None:
    """SIGHUP: load the certificate and key again; a pair that does not
    load is logged and the one in use stays."""
    from zc_lb.front.server import tls_context

    try:
        context = tls_context(args.certfile, args.keyfile, args.tls_min_version,
                              args.tls_ciphers)
    except ConfigurationError as exc:
        log.error("SIGHUP: %s; still serving the certificate loaded before", exc)
        return
    for server in servers:
        server.set_tls(context)
    log.info("SIGHUP: certificate %s loaded again for new connections", args.certfile)


def _ready_when_serving(lb, timeout: float = 10.0) -> None:
    """Say we are ready (to an LB we replace, and to systemd) once the
    workers are connected, at most ``timeout`` seconds after the start."""
    lb.fleet.wait_until_serving(timeout)
    restart.announce_ready()


def lb_actions(lb) -> dict:
    """What an operator may POST to an LB's status address."""
    return {"reset-skills": lb.reset_skills,
            "drain": lambda worker: lb.fleet.drain_worker(worker) or {"worker": worker},
            "enable": lambda worker: lb.fleet.enable_worker(worker) or {"worker": worker}}


# ``zc-lb lb --help`` in groups: each option's dest, by the group it shows in
# (the rest, --config, --chdir, --log-level, stay under "options").
LB_HELP_GROUPS = {
    "front (clients, HTTP, TLS)": [
        "listen", "redirect_https", "processes", "certfile", "keyfile", "tls_min_version",
        "tls_ciphers", "client_timeout", "header_timeout", "max_connections", "forwarded",
        "proxy_protocol", "trusted_proxies", "max_request_body", "error_page"],
    "workers (where they are, how they are reached and judged)": [
        "worker", "zookeeper", "zookeeper_auth_file", "path", "secret_file", "worker_tls_cert",
        "worker_tls_key", "worker_tls_ca", "keepalive_timeout", "response_timeout",
        "max_retries", "health_check", "health_interval", "eject_after", "eject_time",
        "max_ejected", "no_worker_timeout", "single_version"],
    "routing": [
        "classifier", "policy", "affinity_key", "variance", "backlog_history", "unskilled_score",
        "spread", "footprint_window", "slow_start", "balance", "stick", "separate_books",
        "widen", "busy_members"],
    "buffering (responses held for slow clients)": [
        "buffer_memory", "buffer_memory_total", "buffer_disk", "buffer_disk_total", "buffer_dir"],
    "operations": [
        "status", "admin_token_file", "access_log", "access_log_format", "pid_file",
        "drain_timeout", "version"],
}


def _add_zookeeper_auth(p) -> None:
    p.add_argument("--zookeeper-auth-file", metavar="FILE",
                   help="ZooKeeper credentials, one line USER:PASSWORD: nodes this "
                   "creates only they may read or change")


def _zk_credentials(args: argparse.Namespace):
    """The ZooKeeper credentials of ``--zookeeper-auth-file``, or None."""
    if not getattr(args, "zookeeper_auth_file", None):
        return None
    from zc_lb.zookeeper.client import read_credentials

    return read_credentials(args.zookeeper_auth_file)


def run_lb(args: argparse.Namespace) -> int:
    from zc_lb.sockets import worker_addresses

    # A bad address is refused here, with exit 2, not found later as 503s.
    args.worker = worker_addresses(args.worker or []) or None
    if args.processes > 1:
        from zc_lb.process.processes import run

        return run(args, args.argv)

    import gevent

    for name in ("SIGHUP", "SIGUSR1", "SIGUSR2"):  # until wait_for_signal says so
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    from zc_lb.process.service import PidFile

    lb, fronts, status = build_lb(args)
    # What start-up made (modules, tables) lives as long as the process:
    # out of the collector's passes, which then scan only what serving
    # makes.  A full pass over a pool of large résumés took 25-40 ms of the
    # loop with them in, under 15 without (benchmarks: résumé intake).
    gc.freeze()
    service = LBService(lb, fronts, status, args.drain_timeout)
    service.start(args.worker or [], args.health_check, args.health_interval)
    if args.zookeeper:
        from zc_lb.zookeeper.membership import LBMembership

        service.register(LBMembership(
            lb, args.zookeeper, args.path, fronts[0].address,
            status.address if status is not None else None,
            base_settings=_lb_settings(args), instance=args.process_index,
            credentials=_zk_credentials(args)))
    for server in fronts:
        print("zc-lb lb listening on %s" % address_text(server.address), flush=True)
    if status is not None:
        print("zc-lb status on %s:%d" % status.address, flush=True)
    gevent.spawn(_ready_when_serving, lb)
    reload = _sighup(args, lambda live: service.configure(live, args.config),
                     frozenset() if args.zookeeper else frozenset({"worker"}))

    def hangup() -> bool:
        if args.certfile:  # new certificates, for new connections
            _reload_tls(args, [server for server in fronts if server.tls is not None])
            if not args.config:
                return False
        return reload()  # --config read again (without one: logged and ignored)

    # (one of --processes N: the supervisor has the pid file)
    pid_file = PidFile(args.pid_file if args.process_index is None else None)
    try:
        wait_for_signal({"SIGTERM": service.stop, "SIGINT": service.stop, "SIGHUP": hangup,
                         "SIGUSR1": service.reopen,
                         "SIGUSR2": lambda: service.hand_over(args)}, ready=pid_file.write)
    finally:
        pid_file.remove()
    log.info("lb stopped")
    return 0


def _lb_settings(args: argparse.Namespace) -> dict:
    """The settings ZooKeeper may override, as the command line set them."""
    return {name: getattr(args, name) if settings.CLI in setting.where else setting.default
            for name, setting in settings.LB_NODE_SETTINGS.items()}


# -- status -------------------------------------------------------------


def fetch_status(address: str, timeout: float = 5.0) -> dict:
    """The status document at ADDRESS, or an error that says what answered
    there instead: ConfigurationError (exit status 2) for anything that is
    not a zc-lb status server, ZcLbError (1) when nothing answers."""
    import json
    import urllib.error
    import urllib.request

    url = address if "://" in address else "http://%s/" % address
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            code, kind, body = response.status, response.headers.get_content_type(), response.read()
    except urllib.error.HTTPError as exc:
        code, kind, body = exc.code, exc.headers.get_content_type(), b""
    except (OSError, ValueError) as exc:  # refused, timed out, not HTTP at all
        raise ZcLbError("cannot reach a status server at %s: %s" % (
            address, getattr(exc, "reason", exc)))
    doc = None
    if code == 200 and kind == "application/json":
        try:
            doc = json.loads(body)
        except ValueError:
            pass
    if not (isinstance(doc, dict) and isinstance(doc.get("workers"), dict)
            and isinstance(doc.get("pool"), dict)):
        raise ConfigurationError("%s is not a zc-lb status server (got %d %s%s); give "
                                 "the address of an LB's --status" % (
                                     address, code, kind, "" if doc is None else
                                     ", a JSON document without workers and pool"))
    return doc


def run_status(args: argparse.Namespace) -> int:
    import json

    from zc_lb.status.document import format_status

    doc = fetch_status(args.address)
    if args.json:
        print(json.dumps(doc, indent=2, sort_keys=True))
    else:
        print(format_status(doc))
    return 0


# -- demo ---------------------------------------------------------------


def start_worker_process(argv: List[str], timeout: float = 30.0):
    """Start ``zc-lb worker ARGV...`` and return (process, "host:port")."""
    process = subprocess.Popen(
        [sys.executable, "-m", "zc_lb.cli", "worker"] + argv,
        stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line.startswith("zc-lb worker listening on "):
        process.kill()
        raise ConfigurationError("worker did not start: %r" % line)
    return process, line.split()[-1]


DEMO_CONNECT_TIMEOUT = 10.0  # seconds the demo waits for its workers before saying it is up

def run_demo(args: argparse.Namespace) -> int:
    processes = []
    try:
        addresses = []
        for _ in range(args.workers):
            process, address = start_worker_process(["zc_lb.demo:app"])
            processes.append(process)
            addresses.append(address)
        lb_args = build_parser().parse_args(
            ["lb", "--listen", args.listen, "--status", args.status, "--access-log", "-",
             "--variance", "2"] + [a for address in addresses for a in ("--worker", address)])
        lb, (front,), status = build_lb(lb_args)
        lb.fleet.set_workers(addresses)
        front.start()
        status.start()
        if not lb.fleet.wait_for_workers(DEMO_CONNECT_TIMEOUT):  # routing settles with all of them
            log.warning("not every demo worker is connected yet")
        _print_demo_help(front.address, status.address, addresses)

        def stop() -> bool:
            front.stop(timeout=1)
            status.stop(timeout=1)
            lb.stop()
            return True

        wait_for_signal({"SIGTERM": stop, "SIGINT": stop})
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(10)
    return 0


def _print_demo_help(address, status_address, workers) -> None:
    url = "http://%s:%d" % address
    print("zc-lb demo: LB on %s in front of %d workers (%s)" % (
        url, len(workers), ", ".join(workers)), flush=True)
    print("Try (each Host is a request class; watch it stick to a worker):")
    for host in ("alpha.example", "beta.example", "gamma.example", "www.alpha.example"):
        print("  curl -H 'Host: %s' %s/" % (host, url))
    print('  for i in $(seq 20); do curl -s -H "Host: site$((i %% 6)).example" %s/; done' % url)
    print("Status:  zc-lb status %s:%d   (or: .venv/bin/zc-lb status ...)" % status_address)
    print("Status page: http://%s:%d/   metrics: http://%s:%d/metrics" % (
        status_address + status_address))
    print("Stop with Ctrl-C.", flush=True)


# -- version, and the tools shipped beside zc_lb ---------------------------


def version_line() -> str:
    """``zc-lb --version``: the version, and which build runs (compiled, or
    the source and why: a pip install without a compiler gives the source)."""
    from zc_lb import build

    return "zc-lb %s (%s)" % (version(), build())


def version() -> str:
    """zc-lb's version: ``zc_lb.__version__``, which setup.py reads too."""
    from zc_lb import __version__

    return __version__


# command: (module, extra that installs it, what it does)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
PASS_THROUGH = {
    "replay": ("zc_lb.playback.replay", "playback",
               "replay access logs against a live URL (playback/replay.py)"),
    "compare": ("zc_lb.playback.compare", "playback",
                "compare zc-lb with HAProxy on the same log (playback/compare.py)"),
    "simulate": ("zc_lb.simulations.cli", "simulations",
                 "simulate routing policies on virtual time (simulations)"),
}


def run_pass_through(args: argparse.Namespace) -> int:
    """Run a shipped tool's own main with the arguments after its name."""
    import importlib

    module_name, extra, _ = PASS_THROUGH[args.command]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError("zc-lb %s needs %s (%s): pip install 'zc-lb[%s]'" % (
            args.command, module_name, exc, extra))
    return module.main(args.pass_through) or 0


def _add_pass_through_parsers(sub) -> None:
    for name, (_, _, description) in PASS_THROUGH.items():
        # No options of its own (not even --help): everything after the
        # name goes to the tool, which parses and documents it.
        p = sub.add_parser(name, help=description + "; --help for its options",
                           add_help=False)
        p.set_defaults(run=run_pass_through, pass_through=None)


# -- parser -------------------------------------------------------------


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def _add_worker_parser(sub) -> None:
    p = sub.add_parser("worker", help="run a worker hosting a WSGI application")
    p.add_argument("app", nargs="?",
                   help="module:callable, or a PasteDeploy .ini file (or app in --config)")
    _add_config_argument(p, "worker")
    p.add_argument("--listen", default="127.0.0.1:0", metavar="HOST:PORT|unix:PATH",
                   help="where LBs reach this worker: a TCP address (default: "
                        "127.0.0.1, a port of the kernel's choice) or a Unix socket, "
                        "whose file's permissions say who may connect")
    p.add_argument("--resume-file", help="read skills at start, save them as they change")
    mode = p.add_mutually_exclusive_group()
    for setting in settings.given_in(settings.WORKER_SETTINGS, settings.CLI).values():
        settings.add_argument(mode if setting.name == "threads" else p, setting)
    mode.add_argument("--greenlets", dest="threads", action="store_const", const=None,
                      help="run the application in greenlets, for applications that "
                           "cooperate with gevent (never block); a blocked loop is "
                           "logged with the request that blocked it")
    p.add_argument("--status", metavar="HOST:PORT",
                   help="serve the worker's status (JSON) and Prometheus /metrics")
    p.add_argument("--secret-file", help="shared secret for LB authentication")
    p.add_argument("--pid-file", metavar="FILE",
                   help="write the worker's pid here once it serves; removed when it ends")
    p.add_argument("--reload", action="store_true",
                   help="for development: start again when a source file of the "
                   "application (a module loaded from under the working directory) changes")
    p.add_argument("-w", "--workers", type=int, default=1, metavar="N",
                   help="run N worker processes, the i-th on --listen's port + i (and "
                   "--status's), or each on an ephemeral port, or on unix:PATH.i "
                   "(default 1)")
    p.add_argument("--max-requests", type=int, default=0, metavar="N",
                   help="drain and exit after serving about N requests (0: never), as "
                   "gunicorn's: with -w the process is started again")
    p.add_argument("--max-requests-jitter", type=int, default=0, metavar="J",
                   help="add 0 to J at random to --max-requests, so that processes do not "
                   "all restart at once (default 0)")
    p.add_argument("--tls-cert", metavar="FILE",
                   help="serve LBs over TLS with this certificate (naming the address "
                   "they connect to); needs --tls-ca: LBs must show a certificate of it")
    p.add_argument("--tls-key", metavar="FILE", help="its key (default: in --tls-cert)")
    p.add_argument("--tls-ca", metavar="FILE", help="the CA of the LBs' certificates")
    p.add_argument("--insecure", action="store_true",
                   help="listen on a non-loopback address without --secret-file")
    p.add_argument("--zookeeper", metavar="HOSTS", help="register in ZooKeeper (host:port,...)")
    _add_zookeeper_auth(p)
    p.add_argument("--path", default="/lb/workers",
                   help="ZooKeeper node of the workers (default /lb/workers)")
    p.add_argument("--version", help="the application version: told to every LB (status, "
                   "metrics) and, with --zookeeper, what --single-version LBs compare")
    p.add_argument("--description", help="a note for people reading the tree")
    p.set_defaults(run=run_worker)


def _add_config_argument(p, section: str) -> None:
    p.add_argument("--config", metavar="FILE",
                   help="read options from the [%s] table of a TOML file (keys: the long "
                        "options with _ for -); the command line overrides it; SIGHUP "
                        "reads it again" % section)
    p.add_argument("--chdir", metavar="DIR",
                   help="change to DIR before loading anything; modules (the "
                        "application, a classifier) are imported from the working "
                        "directory first, as gunicorn does")


def _enter_directory(directory: Optional[str]) -> None:
    """Change to ``directory`` (--chdir), and put the working directory
    first on sys.path, so that ``zc-lb worker app:application`` run
    beside app.py imports it (the console script, unlike ``python -m``,
    does not).  A ``--processes`` child and a successor (SIGUSR2) start
    where this process started (``args.start_dir``), so that a relative
    --chdir, --config or other path means the same to them."""
    if directory:
        try:
            os.chdir(directory)
        except OSError as exc:
            raise ConfigurationError("--chdir %s: %s" % (directory, exc.strerror or exc))
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)


def _add_lb_parser(sub) -> None:
    p = sub.add_parser("lb", help="run a load balancer")
    p.group(LB_HELP_GROUPS)
    _add_config_argument(p, "lb")
    p.add_argument("--listen", action="append", metavar="[SCHEME://]ADDRESS",
                   help="where to serve, repeatable (default %s): http://ADDRESS or "
                        "https://ADDRESS, the address HOST:PORT or unix:PATH (a Unix "
                        "socket, for a proxy on this machine); a bare ADDRESS is HTTPS "
                        "with --certfile, else HTTP" % DEFAULT_LISTEN)
    p.add_argument("--redirect-https", action="store_true",
                   help="the HTTP listeners answer every request with a redirect to the "
                        "HTTPS one")
    p.add_argument("--processes", type=_positive_int, default=1, metavar="N",
                   help="run N LB processes accepting on the one --listen address, each "
                        "with its own pool and worker connections (default 1); --status "
                        "then sums them")
    p.add_argument("--listen-fd", type=int, help=argparse.SUPPRESS)  # a --processes child
    p.add_argument("--process-index", type=int, help=argparse.SUPPRESS)
    p.add_argument("--siblings-fd", type=int, help=argparse.SUPPRESS)  # their shared memory
    p.add_argument("--worker", action="append", metavar="HOST:PORT|unix:PATH",
                   help="a worker address, repeatable")
    p.add_argument("--classifier", default="host",
                   help="host, re:ENVKEY:PATTERN or module:dotted.name (default host)")
    p.add_argument("--policy", choices=("affinity", "published", "classless", "resume"),
                   default="affinity",
                   help="affinity (default): résumés pick a class's workers, affinity "
                        "keys split the class among them; published: the published "
                        "résumé algorithm (resume is its old name); classless: least "
                        "backlog")
    p.add_argument("--affinity-key", default="path", metavar="path|none|re:ENVKEY:PATTERN",
                   help="what sends requests of a class to the same worker (default "
                        "path)")
    p.add_argument("--health-check", metavar="PATH",
                   help="GET PATH from every worker every --health-interval seconds; "
                        "failures count toward ejection as failed requests do")
    _add_lb_operator_arguments(p)
    p.add_argument("--version", action="version", version=version_line(),
                   help="print zc-lb's version and build, and exit")
    p.add_argument("--pid-file", metavar="FILE",
                   help="write the LB's pid here once it serves (a supervisor's, with "
                   "--processes); removed when it ends")
    p.add_argument("--zookeeper", metavar="HOSTS",
                   help="discover workers and settings in ZooKeeper (host:port,...)")
    _add_zookeeper_auth(p)
    p.add_argument("--path", default="/lb", help="ZooKeeper node of the LB (default /lb)")
    settings.add_arguments(p, settings.LB_SETTINGS)
    p.set_defaults(run=run_lb)


def _add_lb_operator_arguments(p) -> None:
    """The LB's logs, status address, error page, TLS and secret options."""
    p.add_argument("--access-log", metavar="FILE|-",
                   help="write an access log (reopened on SIGUSR1)")
    p.add_argument("--access-log-format", default=DEFAULT_FORMAT, metavar="FORMAT",
                   help="the access log's line, in Apache LogFormat %%-fields (default: "
                        "Apache combined + host, class, worker, upstream, time, retries; "
                        "see docs/reference/accesslog.rst)")
    p.add_argument("--status", metavar="HOST:PORT",
                   help="serve the status document (JSON), a status page, Prometheus "
                        "/metrics and /healthz")
    p.add_argument("--admin-token-file", metavar="FILE",
                   help="a token the status address's actions (drain, enable, "
                        "reset-skills) need, as 'Authorization: Bearer TOKEN'; without "
                        "it they are taken from this host only")
    p.add_argument("--error-page", metavar="FILE", help="HTML page for 502 and 503")
    p.add_argument("--certfile", help="TLS certificate (serve HTTPS)")
    p.add_argument("--keyfile", help="TLS private key (default: in the certfile)")
    p.add_argument("--tls-ciphers", default=None, metavar="OPENSSL-CIPHERS",
                   help="TLS 1.2 cipher list (default: Mozilla's intermediate list)")
    p.add_argument("--secret-file", help="shared secret for worker authentication")
    p.add_argument("--worker-tls-cert", metavar="FILE",
                   help="connect to workers over TLS, showing this certificate; needs "
                   "--worker-tls-ca: workers must show a certificate of it")
    p.add_argument("--worker-tls-key", metavar="FILE",
                   help="its key (default: in --worker-tls-cert)")
    p.add_argument("--worker-tls-ca", metavar="FILE", help="the CA of the workers' certificates")


def _add_status_parser(sub) -> None:
    p = sub.add_parser("status", help="print an LB's status")
    p.add_argument("address", help="the LB's --status HOST:PORT")
    p.add_argument("--json", action="store_true", help="print the raw JSON")
    p.set_defaults(run=run_status)


def _add_worker_state_parsers(sub) -> None:
    for name, help_text in (
            ("drain", "send one worker nothing new through an LB (its requests finish)"),
            ("enable", "let an LB send a drained worker requests again")):
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("address", help="the LB's --status HOST:PORT")
        p.add_argument("worker", help="the worker's HOST:PORT, as the LB knows it")
        p.add_argument("--token-file", metavar="FILE",
                       help="the LB's --admin-token-file")
        p.set_defaults(run=run_worker_state, action=name)


def run_worker_state(args: argparse.Namespace) -> int:
    from zc_lb.status.document import fetch

    fetch(args.address, action=args.action, params={"worker": args.worker},
          token=read_secret(args.token_file))
    print("%s %s on the LB at %s" % ("drained" if args.action == "drain" else "enabled",
                                     args.worker, args.address))
    return 0


def _add_reset_skills_parser(sub) -> None:
    p = sub.add_parser(
        "reset-skills", help="make LBs and workers forget skills (after a classifier change)")
    p.add_argument("--zookeeper", metavar="HOSTS",
                   help="set reset_skills in ZooKeeper: every LB and worker resets")
    _add_zookeeper_auth(p)
    p.add_argument("--path", default="/lb",
                   help="the LBs' node; the workers' is PATH/workers (default /lb)")
    p.add_argument("--status", action="append", metavar="HOST:PORT", default=[],
                   help="an LB's status address (static mode: that LB resets, its "
                        "workers keep their résumés); may be repeated")
    p.set_defaults(run=run_reset_skills)


def run_reset_skills(args: argparse.Namespace) -> int:
    from zc_lb.status.document import fetch

    if not args.zookeeper and not args.status:
        raise ConfigurationError("give --zookeeper or --status")
    for address in args.status:
        fetch(address, action="reset-skills")
        print("reset skills on the LB at %s" % address)
    if args.zookeeper:
        from zc_lb.zookeeper import client as zk

        logging.getLogger("kazoo").setLevel(logging.WARNING)
        token = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()) + "-%d" % os.getpid()
        client = zk.connect(args.zookeeper, credentials=(
            zk.read_credentials(args.zookeeper_auth_file) if args.zookeeper_auth_file else None))
        try:
            base = args.path.rstrip("/") or ""
            for path in (base + "/workers", base or "/"):  # workers first
                zk.set_properties(client, path, ["reset_skills=%s" % token])
                print("set reset_skills=%s on %s" % (token, path))
        finally:
            client.stop()
            client.close()
    return 0


def _add_zk_parser(sub) -> None:
    p = sub.add_parser("zk", help="import, export, read and set the ZooKeeper tree")
    p.add_argument("--zookeeper", default="127.0.0.1:2181", metavar="HOSTS",
                   help="host:port,...[/chroot] (default 127.0.0.1:2181)")
    _add_zookeeper_auth(p)
    p.add_argument("--timeout", type=float, default=10.0,
                   help="seconds to wait for ZooKeeper (default 10)")
    zk = p.add_subparsers(dest="zk_command", required=True, metavar="ZKCOMMAND")
    i = zk.add_parser("import", help="make the tree match FILE (- for stdin)")
    i.add_argument("file")
    i.add_argument("root", nargs="?", default="/", help="import under this path")
    i.add_argument("--dry-run", action="store_true", help="print the changes only")
    i.add_argument("--delete", action="store_true",
                   help="also delete nodes and properties absent from FILE")
    i.add_argument("--delete-at-root", action="store_true",
                   help="allow --delete at /, where it removes every other top-level tree")
    i.add_argument("--force", action="store_true",
                   help="accept properties that are no known setting")
    e = zk.add_parser("export", help="print the tree at PATH as text")
    e.add_argument("path", nargs="?", default="/")
    e.add_argument("--ephemeral", action="store_true",
                   help="list ephemeral nodes as comments")
    g = zk.add_parser("get", help="print a node's properties as JSON")
    g.add_argument("path")
    s = zk.add_parser("set", help="set properties: key=value (JSON, else string)")
    s.add_argument("path")
    s.add_argument("assignments", nargs="+", metavar="key=value")
    s.add_argument("--force", action="store_true",
                   help="accept properties that are no known setting")
    ls = zk.add_parser("ls", help="list a node's children")
    ls.add_argument("path", nargs="?", default="/")
    p.set_defaults(run=run_zk)


def run_zk(args: argparse.Namespace) -> int:
    from zc_lb.zookeeper.client import run_zk_command

    logging.getLogger("kazoo").setLevel(logging.WARNING)  # a command, not a service

    return run_zk_command(args)


def _add_demo_parser(sub) -> None:
    text = "an LB on 127.0.0.1:8080 with 4 local demo workers (what make run starts)"
    p = sub.add_parser("demo", help=text, description=text + "; Ctrl-C stops them all.")
    p.add_argument("--workers", type=_positive_int, default=4,
                   help="demo worker processes to start (default 4)")
    p.add_argument("--listen", default="127.0.0.1:8080",
                   help="the LB's HOST:PORT (default 127.0.0.1:8080)")
    p.add_argument("--status", default="127.0.0.1:8079",
                   help="the LB's status address: page, JSON, /metrics (default "
                        "127.0.0.1:8079)")
    p.set_defaults(run=run_demo)


def build_parser() -> argparse.ArgumentParser:
    parser = config.Parser(
        prog="zc-lb", description="A résumé-based load balancer for WSGI applications.")
    parser.add_argument("--log-level", default="INFO", choices=LOG_LEVELS,
                        help="before or after the command (default INFO)")
    parser.add_argument("--version", action="version", version=version_line())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parser.commands = sub.choices  # type: ignore[attr-defined]  # name -> its parser
    for add in (_add_worker_parser, _add_lb_parser, _add_status_parser, _add_zk_parser,
                _add_worker_state_parsers, _add_reset_skills_parser, _add_demo_parser,
                _add_pass_through_parsers):
        add(sub)
    for name, command in sub.choices.items():
        if name not in PASS_THROUGH:  # (those parse their own options)
            command.add_argument("--log-level", choices=LOG_LEVELS, default=argparse.SUPPRESS,
                                 help="as before the command (default INFO)")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args, rest = parser.parse_known_args(argv)
    if "pass_through" in args:
        args.pass_through = rest
    elif rest:
        parser.error("unrecognized arguments: %s" % " ".join(rest))
    args.argv = argv  # lb --processes starts copies; SIGHUP parses it again
    args.start_dir = os.getcwd()  # where copies start, so that --chdir means the same
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if getattr(args, "config", None):
            args = read_config(args)
            # (SIGHUP reads it again, after --chdir: by where it was)
            args.config = os.path.abspath(args.config)
            if not any(a == "--log-level" or a.startswith("--log-level=") for a in argv):
                logging.getLogger().setLevel(args.log_level)  # the file's, then
        if "chdir" in args:
            _enter_directory(args.chdir)
        keep_freed_memory()  # (large bodies: see there)
        return args.run(args)
    except ZcLbError as exc:  # a configuration error exits 2, ZooKeeper down 69
        print("zc-lb %s: error: %s" % (args.command, exc), file=sys.stderr)
        return exc.exit_status
    except OSError as exc:  # e.g. the address is in use
        print("zc-lb %s: error: %s" % (args.command, exc), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
