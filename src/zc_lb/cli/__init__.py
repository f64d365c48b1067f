"""``zc-lb`` and its subcommands: parse, build, run; nothing else.

Each ``run_*`` function builds the objects of one process from parsed
arguments, starts them, prints the address it listens on (one line on
standard output, so scripts and tests can find an ephemeral port), then
waits for a signal.  Signal handlers only queue the signal; the main loop
dispatches it, as gunicorn's arbiter does.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time
from typing import List, Optional

from zc_lb.cli.lb import build_lb, run_lb
from zc_lb.cli.parsers import build_parser
from zc_lb.cli.reload import read_config
from zc_lb.cli.tools import PASS_THROUGH, run_pass_through
from zc_lb.cli.worker import run_worker
from zc_lb.errors import ConfigurationError, ZcLbError
from zc_lb.process.service import keep_freed_memory, read_secret, wait_for_signal

log = logging.getLogger("zc_lb")


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

