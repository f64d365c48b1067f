"""``zc-lb demo``: an LB in front of local demo workers (zc_lb/demo.py),
what ``make run`` starts.

Rules: the workers are processes of their own (``zc-lb worker``), ended
with the demo (killed if they do not end within ``WORKER_STOP_TIMEOUT``);
the LB is built as ``zc-lb lb`` builds it, and says it is up once its
workers are connected (at most ``DEMO_CONNECT_TIMEOUT`` seconds), with
commands to try.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
import time
from typing import List

from zc_lb.cli.lb import build_lb
from zc_lb.cli.parsers import build_parser
from zc_lb.errors import ConfigurationError
from zc_lb.process.service import start_named, wait_for_signal

log = logging.getLogger("zc_lb")


DEMO_CONNECT_TIMEOUT = 10.0  # seconds the demo waits for its workers before saying it is up
WORKER_STOP_TIMEOUT = 10.0  # seconds the demo's workers have to end after SIGTERM


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
        start_named("--listen", front.listen, front.start)  # (in use: say which)
        start_named("--status", status.listen, status.start)
        if not lb.fleet.wait_for_workers(DEMO_CONNECT_TIMEOUT):  # routing settles with all of them
            log.warning("not every demo worker is connected yet")

        def stop() -> bool:
            front.stop(timeout=1)
            status.stop(timeout=1)
            lb.stop()
            return True

        # "Stop with Ctrl-C" once Ctrl-C is handled: a SIGINT that came
        # before ended the demo with a KeyboardInterrupt (exit status 1).
        wait_for_signal({"SIGTERM": stop, "SIGINT": stop}, ready=lambda: _print_demo_help(
            front.address, status.address, addresses))
    finally:
        stop_workers(processes)
    return 0


def stop_workers(processes: List[subprocess.Popen]) -> None:
    """SIGTERM every demo worker, and SIGKILL (saying so, one line each)
    those not ended within WORKER_STOP_TIMEOUT seconds."""
    for process in processes:
        process.terminate()
    deadline = time.monotonic() + WORKER_STOP_TIMEOUT
    for process in processes:
        try:
            process.wait(max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            log.warning("demo worker (pid %d) did not end within %gs of SIGTERM: killed",
                        process.pid, WORKER_STOP_TIMEOUT)
            process.kill()
            process.wait()


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


def _print_demo_help(address, status_address, workers) -> None:
    url = "http://%s:%d" % address
    print("zc-lb demo: LB on %s in front of %d workers (%s)" % (
        url, len(workers), ", ".join(workers)), flush=True)
    print("Try (each Host is a request class; watch it stick to a worker):")
    for host in ("alpha.example", "beta.example", "gamma.example", "www.alpha.example"):
        print("  curl -H 'Host: %s' %s/" % (host, url))
    print('  for i in $(seq 20); do curl -s -H "Host: site$((i %% 6)).example" %s/; done' % url)
    print("Status:  %s status %s:%d" % ((_zc_lb_command(),) + tuple(status_address)))
    print("Status page: http://%s:%d/   metrics: http://%s:%d/metrics" % (
        status_address + status_address))
    print("Stop with Ctrl-C.", flush=True)


def _zc_lb_command() -> str:
    """The command that runs this zc-lb where the demo was started:
    ``zc-lb`` where that is the one on PATH (or the demo runs as
    ``python -m zc_lb.cli``), else the script as it was started (make
    run's ``.venv/bin/zc-lb``, an installed ``/opt/zc-lb/bin/zc-lb``)."""
    script = sys.argv[0]
    found = shutil.which("zc-lb")
    if os.path.basename(script) != "zc-lb" or (found and os.path.samefile(found, script)):
        return "zc-lb"
    return script
