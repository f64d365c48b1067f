"""``zc-lb lb``: build an LB process from its options, serve, stop on a
signal (``run_lb``; ``build_lb`` for the demo too).

Rules: a bad worker address, certificate, access log format or error
page is refused before anything starts (exit status 2).  Ready, it
prints ``zc-lb lb listening on ADDRESS`` for each front (one line each,
for scripts and tests), and says it is ready (to the LB it replaces, and
to systemd) once its workers are connected.  ``--processes N`` hands the
process to process/processes.py.  SIGHUP loads the certificate again and
reads --config again; SIGUSR1 reopens the access log; SIGUSR2 hands the
sockets over to a successor.
"""

from __future__ import annotations

import argparse
import functools
import gc
import logging
import os
import signal
from typing import Callable

from zc_lb import settings
from zc_lb.cli.parsers import version, zk_credentials
from zc_lb.cli.reload import sighup
from zc_lb.errors import ConfigurationError
from zc_lb.front.accesslog import DEFAULT_FORMAT
from zc_lb.process import restart
from zc_lb.process.service import (LBService, lb_status_app, parse_listeners,
                                   read_admin_token, read_secret, wait_for_signal)
from zc_lb.sockets import address_text, parse_listen

log = logging.getLogger("zc_lb")


def run_lb(args: argparse.Namespace) -> int:
    """``zc-lb lb``: serve until a signal says to stop (with --processes N,
    as the supervisor of N LB processes)."""
    from zc_lb.sockets import worker_addresses

    # A bad address is refused here, with exit 2, not found later as 503s.
    args.worker = worker_addresses(args.worker or []) or None
    for name in ("SIGHUP", "SIGUSR1", "SIGUSR2"):  # until wait_for_signal says so
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    if args.processes > 1:
        from zc_lb.cli.reload import KeptConfig
        from zc_lb.process.processes import run

        return run(args, args.argv, KeptConfig(args))

    import gevent
    from zc_lb.process.service import PidFile

    service = _start(args)
    gevent.spawn(_ready_when_serving, service.lb)
    # (one of --processes N: the supervisor has the pid file)
    pid_file = PidFile(args.pid_file if args.process_index is None else None)

    def ready() -> None:
        # (said once signals are handled, so that one sent on seeing it
        # counts, and the pid file written, so that it names us by then)
        pid_file.write()
        for server in service.fronts:
            print("zc-lb lb listening on %s" % address_text(server.address), flush=True)
        if service.status is not None:
            print("zc-lb status on %s:%d" % service.status.address, flush=True)

    try:
        wait_for_signal({"SIGTERM": service.stop, "SIGINT": service.stop,
                         "SIGHUP": _hangup(args, service), "SIGUSR1": service.reopen,
                         "SIGUSR2": lambda: service.hand_over(args)}, ready=ready)
    finally:
        pid_file.remove()
    log.info("lb stopped")
    return 0


def _start(args: argparse.Namespace) -> LBService:
    """The LB process's parts, built and started, and registered in
    ZooKeeper with --zookeeper."""
    lb, fronts, status = build_lb(args)
    # What start-up made (modules, tables) lives as long as the process:
    # out of the collector's passes, which then scan only what serving
    # makes.  (The résumés' classes no request asked for lately stay out
    # of them too: routing/skillmap.py.)
    gc.freeze()
    service = LBService(lb, fronts, status, args.drain_timeout)
    service.start(args.worker or [], args.health_check, args.health_interval)
    if getattr(args, "single_version", False) and not args.zookeeper:
        log.warning("--single-version does nothing without --zookeeper: the workers' "
                    "versions are counted there")
    if args.zookeeper:
        from zc_lb.zookeeper.membership import LBMembership

        service.register(LBMembership(
            lb, args.zookeeper, args.path, fronts[0].address,
            status.address if status is not None else None,
            base_settings=_lb_settings(args), instance=args.process_index,
            credentials=zk_credentials(args)))
    return service


def _hangup(args: argparse.Namespace, service: LBService) -> Callable[[], bool]:
    """What SIGHUP does: load the certificate again (--certfile), and read
    --config again."""
    reload = sighup(args, lambda live: service.configure(live, args.config),
                    frozenset() if args.zookeeper else frozenset({"worker"}))

    def hangup() -> bool:
        if args.certfile:  # new certificates, for new connections
            _reload_tls(args, [server for server in service.fronts if server.tls is not None])
            if not args.config:
                return False
        return reload()  # --config read again (without one: logged and ignored)

    return hangup


def _ready_when_serving(lb, timeout: float = 10.0) -> None:
    """Say we are ready (to an LB we replace, and to systemd) once the
    workers are connected, at most ``timeout`` seconds after the start."""
    lb.fleet.wait_until_serving(timeout)
    restart.announce_ready()


def _lb_settings(args: argparse.Namespace) -> dict:
    """The settings ZooKeeper may override, as the command line set them."""
    return {name: getattr(args, name) if settings.CLI in setting.where else setting.default
            for name, setting in settings.LB_NODE_SETTINGS.items()}


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
        status = FrontServer(restart.inherited("status", args.status) or parse_address(args.status),
                             lb_status_app(
            functools.partial(_lb_document, lb, fronts), lb_actions(lb),
            lambda: lb.counters.requests, read_admin_token(args.admin_token_file),
            lambda: len(lb.pool)))
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
    lb = LB(pool, get_classifier(args.classifier),
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
    lb.configure(_lb_settings(args))  # (says the settings another policy would take)
    return lb


def _read_page(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ConfigurationError("cannot read error page %s: %s" % (path, exc))


def _spool_limits(args: argparse.Namespace):
    """The buffers' bounds; the directory must be one."""
    from zc_lb.lb.spool import SpoolLimits

    if args.buffer_dir and not os.path.isdir(args.buffer_dir):
        raise ConfigurationError("--buffer-dir %s is not a directory" % args.buffer_dir)
    return SpoolLimits(args.buffer_memory, args.buffer_memory_total, args.buffer_disk,
                       args.buffer_disk_total, args.buffer_dir or None, args.buffer_request)


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
        listen = restart.inherited("front%d" % index, where)  # from the LB this one replaces
        if listen is None and args.listen_fd is not None:  # one of --processes N
            from zc_lb.sockets import inherited_socket

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


def _lb_document(lb, fronts) -> dict:
    """The LB's status document, with zc-lb's version and where it listens."""
    doc = lb.status()
    doc["version"] = version()
    doc["clients"] = sum(front.connections for front in fronts)
    doc["listen"] = ["%s://%s" % ("https" if getattr(front, "tls", None) else "http",
                                  address_text(front.address))
                     for front in fronts if getattr(front, "server", None) is not None]
    return doc


def lb_actions(lb) -> dict:
    """What an operator may POST to an LB's status address."""
    return {"reset-skills": lb.reset_skills,
            "drain": lambda worker: lb.fleet.drain_worker(worker) or {"worker": worker},
            "enable": lambda worker: {"worker": worker,
                                      "changed": lb.fleet.enable_worker(worker)}}


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
