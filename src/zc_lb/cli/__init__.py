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
from typing import List, Optional

from zc_lb import settings
from zc_lb.cli.parsers import build_parser, version, zk_credentials
from zc_lb.cli.reload import read_config, sighup
from zc_lb.cli.tools import PASS_THROUGH, run_pass_through
from zc_lb.cli.worker import run_worker
from zc_lb.process import restart
from zc_lb.front.accesslog import DEFAULT_FORMAT
from zc_lb.errors import ConfigurationError, ZcLbError
from zc_lb.sockets import address_text, parse_listen
from zc_lb.process.service import (LBService,
                      keep_freed_memory, lb_status_app, parse_listeners, read_secret,
                      wait_for_signal)

log = logging.getLogger("zc_lb")


def _read_page(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ConfigurationError("cannot read error page %s: %s" % (path, exc))


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
    lb.fronts = fronts  # their client connections go in the status document
    status = None
    if args.status:
        status = FrontServer(restart.inherited("status") or parse_address(args.status),
                             lb_status_app(
            functools.partial(_lb_document, lb, fronts), lb_actions(lb), lambda: lb.requests,
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
            credentials=zk_credentials(args)))
    for server in fronts:
        print("zc-lb lb listening on %s" % address_text(server.address), flush=True)
    if status is not None:
        print("zc-lb status on %s:%d" % status.address, flush=True)
    gevent.spawn(_ready_when_serving, lb)
    reload = sighup(args, lambda live: service.configure(live, args.config),
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


def run_worker_state(args: argparse.Namespace) -> int:
    from zc_lb.status.document import fetch

    fetch(args.address, action=args.action, params={"worker": args.worker},
          token=read_secret(args.token_file))
    print("%s %s on the LB at %s" % ("drained" if args.action == "drain" else "enabled",
                                     args.worker, args.address))
    return 0


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


def run_zk(args: argparse.Namespace) -> int:
    from zc_lb.zookeeper.client import run_zk_command

    logging.getLogger("kazoo").setLevel(logging.WARNING)  # a command, not a service

    return run_zk_command(args)


# What runs each command, by name (cli/parsers.py says its options).
COMMANDS = {"worker": run_worker, "lb": run_lb, "status": run_status, "zk": run_zk,
            "drain": run_worker_state, "enable": run_worker_state,
            "reset-skills": run_reset_skills, "demo": run_demo,
            **dict.fromkeys(PASS_THROUGH, run_pass_through)}


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
        return COMMANDS[args.command](args)
    except ZcLbError as exc:  # a configuration error exits 2, ZooKeeper down 69
        print("zc-lb %s: error: %s" % (args.command, exc), file=sys.stderr)
        return exc.exit_status
    except OSError as exc:  # e.g. the address is in use
        print("zc-lb %s: error: %s" % (args.command, exc), file=sys.stderr)
        return 1

