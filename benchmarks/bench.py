"""``make bench``: zc-lb against HAProxy, measured side by side in one run.

Method (see "Performance method" in docs/design.rst): every number is taken in
one process run on one machine, and the ones that matter are ratios, not
absolute times.  The first targets serve the same trivial WSGI app
(``hello_app``, a fixed 13-byte body), one after the other, all on
127.0.0.1:

  zc-lb    ``zc-lb lb`` in front of two ``zc-lb worker`` processes;
  haproxy  HAProxy 2.6 (``etc/haproxy-bench.cfg``: one thread, ``balance
           leastconn``, keep-alive) in front of two gevent.pywsgi servers;
  direct   one gevent.pywsgi server, no balancer: the ceiling;
  lb-1p    ``zc-lb lb`` alone in front of four workers, one process;
  lb-2p    the same with ``--processes 2``: what a second core buys;
  floor    ``benchmarks/floor.py``: a bare proxy of zc-lb's design (gevent,
           httptools, one multiplexed connection to each of two workers)
           doing none of the LB's work: what the design costs in Python
           before any of it, the yardstick for the LB's CPU.

Then the realistic pair: an app that spends 1 ms of CPU on every request
(``cpu_app``, a small view's worth) at one path, so that every request
is one class and one affinity key, under ``wrk -c20``:

  zc-lb-cpu    ``zc-lb lb`` (the chosen policy) in front of two
               ``zc-lb worker`` processes in their default thread mode;
  haproxy-cpu  HAProxy leastconn in front of two gevent.pywsgi servers.

Its ratio says whether the default policy holds its own where locality
buys nothing: a hot key must spread as least backlog would spread it.

Then the paced pair: the first two targets again (``zc-lb-paced``,
``haproxy-paced``), each of ``PACED_CONNECTIONS`` wrk connections waiting
``PACED_DELAY_MS`` after each response before its next request (a wrk
script's ``delay``), some 570 requests a second in all.  A front proxy
spends most of its life at such rates, not flat out, and there a
request pays for its wakeups alone: the loop's turn, the system calls,
caches gone cold in between.  Its line gives each LB's CPU per request
and their ratio, against the same goal as flat out.

Then large bodies (``bodies``): an app (``bodies_app``) that answers a
GET with 20 MB, yielded in 4 KiB or 64 KiB slices of one bytes object
(as an app streaming a file yields its reads; Django's are 4 KiB) or
handed to ``wsgi.file_wrapper`` as an open file, and reads a POST's body
in 4 KiB or 64 KiB reads, answering the byte count (``BODY_CASES``).
It is served directly by gevent.pywsgi; through zc-lb with one worker
in each mode (the default thread worker, ``--greenlets``, and the
thread worker with ``--sendfile on``, which over loopback it does
without by default); through a bare TCP hop (``floor.serve_hop``: what
one more process in the way costs); through zc-lb over TLS; and,
for comparison, through HAProxy in front of the same pywsgi server.  A
plain client on one keep-alive connection to each (TCP_NODELAY, bodies
received with ``recv_into`` into one buffer) checks one download of each
case, then times 5 transfers of each case from each, one transfer at a
time, taking turns between them so that the machine's other work weighs
on each alike; the table gives each one's time over the direct
server's (the goal is zc-lb's, in both worker modes; the hop's and
HAProxy's say what any proxy, and one in C, make of the same two
cores).

Each target gets a short wrk warm-up, then one measured wrk run with the
same settings (``wrk -t1 -cC -dNs --latency``).  Requests per second and
latency percentiles come from wrk; CPU per request is the balancer's (and
the workers') utime+stime from /proc/PID/stat over the measured run,
divided by the requests wrk completed.  A measured run whose figures
would mislead stops the bench with an error: no request completed, more
than 1% of them errors, or a process of the target gone by its end.  The
first line says which build of zc-lb ran (``zc_lb.build()``: compiled,
or the source, which costs some twice the CPU a request).  The pywsgi
servers set TCP_NODELAY on accepted sockets and do not log.

After the table, the pool's own cost: ``get`` and ``put`` of each policy
for the same 60,000 requests (32 classes and 200 paths each, both Zipf,
24 outstanding, six workers pushing résumés), timed in this process;
and its intake of a worker's résumé of 10,000 classes of which 1% have
new scores (the median and the worst of 60, between requests), with the
LB's decoding of such a frame.

``python -m benchmarks.bench in-process [--profile FILE]`` runs a worker, an
LB and its front in one process with client greenlets pipelining
requests, and prints the CPU per request: a steadier measure of the
Python cost than the wrk runs on a busy machine, and a place to profile
it from.

Weak spots: wrk, the balancer and the workers share the machine's cores,
so throughput depends on how many there are; /proc counts CPU in clock
ticks (usually 10 ms), so runs shorter than a few seconds give coarse CPU
figures (the paced pair's LB spends some 20 ticks in a 5-second run).
The last lines say how the run stands against issue 27's goals: LB CPU
per request at most twice HAProxy's in the same run (flat out, and
paced), throughput at least HAProxy's with a p99 no worse, worker
overhead at most 40 us, large bodies within 1.5 times the direct
server's time, the affinity pool's get and put within 3 us.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import select
import shutil
import signal
import socket
import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import zc_lb
from zc_lb.testing import (ProcessError, cpu_times, cpu_used, free_port, stop_process,
                            wait_for_port, with_children)

BODY = b"Hello, world\n"
ROOT = Path(__file__).resolve().parents[1]  # the checkout
HAPROXY_TEMPLATE = ROOT / "etc" / "haproxy-bench.cfg"
SERVE_READY = "zc-lb bench server listening on "
TARGETS = ("zc-lb", "zc-lb-tls", "haproxy", "direct", "lb-1p", "lb-2p", "floor", "zc-lb-cpu",
           "haproxy-cpu", "zc-lb-paced", "haproxy-paced", "bodies", "idle", "slow")
BODIES = "bodies"  # the large-body measure's name in --targets (not a wrk target)
IDLE = "idle"  # and the idle clients' memory measure's
IDLE_CLIENTS = 900  # keep-alive clients held idle
IDLE_BATCH = 100  # of them at once, each batch parked before the next comes
IDLE_SETTLE = 2.5  # seconds idle before the LB is measured (it parks them after 2)
GOAL_IDLE_KB = 8.0  # the LB's memory per idle keep-alive client
SLOW = "slow"  # and the slow clients' measure's
SLOW_CLIENTS = 1000  # clients that stop reading a response
SLOW_KB = 256  # the response each of them asks for
GOAL_SLOW_KB = 64.0  # the LB's memory per slow client
SLOW_P99 = 2.0  # other clients' p99 with them, over without, at most (timing noise)
REALISTIC = ("zc-lb-cpu", "haproxy-cpu")  # measured with CPU_CONNECTIONS
PACED = ("zc-lb-paced", "haproxy-paced")  # measured with PACED_CONNECTIONS
PACED_CONNECTIONS = 24  # each waiting PACED_DELAY_MS after a response:
PACED_DELAY_MS = 40  # at most 24 / 0.04 s = 600 requests a second
SCALE_WORKERS = 4  # workers behind lb-1p and lb-2p: enough that the LB is the limit
GOAL_LB_CPU = 2.0  # the LB's CPU per request over HAProxy's, in the same run
GOAL_WORKER_US = 40  # a worker's CPU per request beyond the app's
GOAL_POOL_US = 3.0  # the affinity pool's get and put
GOAL_INTAKE_MS = 2.0  # the affinity pool's intake of a 10,000-class résumé, 1% changed
GOAL_INTAKE_STRETCH_MS = 20.0  # the longest the loop waits on a résumé of any churn
GOAL_REALISTIC = 0.95  # the realistic pair's throughput, zc-lb over HAProxy
IN_PROCESS_TIMEOUT = 120  # seconds for the in-process measure's requests
WRK_GRACE = 30.0  # seconds a wrk run may take beyond its own before it is killed


class BenchError(ProcessError):
    """The bench cannot run or a target misbehaved; the message says why."""


def hello_app(environ, start_response):
    """The trivial app every target serves: a small fixed body."""
    start_response("200 OK", [("Content-Type", "text/plain"),
                              ("Content-Length", str(len(BODY)))])
    return [BODY]


CPU_SECONDS = 0.001  # the realistic app's CPU per request
CPU_CONNECTIONS = 20  # wrk connections for the realistic pair


def cpu_app(environ, start_response):
    """The realistic app: 1 ms of CPU (this thread's), then a small body."""
    import time

    end = time.thread_time() + CPU_SECONDS
    while time.thread_time() < end:
        pass
    return hello_app(environ, start_response)


MB = 1024 * 1024
BODIES_MB = 20  # the large bodies' size
BODIES_TRANSFERS = 5  # timed transfers each way, after one warm-up
BODIES_CHUNK = 256 * 1024  # the app yields a download in slices this size
BODIES_READ = 64 * 1024  # and reads an upload this much at a time
BODIES_MAX = 1024 * MB  # the largest body the app makes
BODIES_TIMEOUT = 60.0  # seconds for one transfer
GOAL_BODIES = 1.5  # zc-lb's time for a large body over the direct server's, at most


@functools.lru_cache(maxsize=2)
def big_body(size: int) -> bytes:
    """``size`` bytes, made once (per size) for every download."""
    return (bytes(range(256)) * (size // 256 + 1))[:size]


def _query(query: str) -> Dict[str, int]:
    """A bodies request's numbers: ``size`` (BODIES_MB MB without one),
    ``block`` (BODIES_CHUNK) and ``file`` (0)."""
    import urllib.parse

    numbers = {"size": BODIES_MB * MB, "block": BODIES_CHUNK, "file": 0}
    for name, values in urllib.parse.parse_qs(query).items():
        if name in numbers:
            try:
                numbers[name] = int(values[0])
            except ValueError:
                pass
    numbers["size"] = max(0, min(numbers["size"], BODIES_MAX))
    numbers["block"] = max(1, min(numbers["block"], BODIES_MAX))
    return numbers


def _slices(data: bytes, size: int) -> Iterator[bytes]:
    """``data`` in pieces of ``size`` bytes, each a copy, as reads of a
    file would be."""
    for start in range(0, len(data), size):
        yield data[start:start + size]


@functools.lru_cache(maxsize=2)
def big_file(size: int) -> str:
    """The path of a file of ``big_body(size)``, made once (per size) in
    the temporary directory and removed when the process exits."""
    import atexit

    fd, path = tempfile.mkstemp(prefix="zc-lb-bench-body-")
    with os.fdopen(fd, "wb") as f:
        f.write(big_body(size))
    atexit.register(os.unlink, path)
    return path


def _file_blocks(filelike, block_size: int = 8192) -> Iterator[bytes]:
    """What an app iterates when the server offers no wsgi.file_wrapper."""
    with filelike:
        yield from iter(lambda: filelike.read(block_size), b"")


def bodies_app(environ, start_response):
    """Large bodies: a GET gets ``?size=N`` bytes (BODIES_MB MB without
    it), yielded in ``block=B`` slices of one bytes object (BODIES_CHUNK
    without it) with a Content-Length, or with ``file=1`` an open file
    handed to the server's ``wsgi.file_wrapper`` (read in B-byte blocks
    where it offers none, as Django's FileResponse does); a POST's body
    is read in B-byte reads (BODIES_READ), up to its Content-Length, and
    answered with the byte count."""
    numbers = _query(environ.get("QUERY_STRING", ""))
    if environ["REQUEST_METHOD"] == "POST":
        read, count = environ["wsgi.input"].read, 0
        block = numbers["block"] if "block=" in environ.get("QUERY_STRING", "") else BODIES_READ
        remaining = int(environ.get("CONTENT_LENGTH") or 0)
        while remaining > 0:
            data = read(min(block, remaining))
            if not data:
                break
            count, remaining = count + len(data), remaining - len(data)
        answer = b"%d\n" % count
        start_response("200 OK", [("Content-Type", "text/plain"),
                                  ("Content-Length", str(len(answer)))])
        return [answer]
    size = numbers["size"]
    start_response("200 OK", [("Content-Type", "application/octet-stream"),
                              ("Content-Length", str(size))])
    if numbers["file"]:
        wrapper = environ.get("wsgi.file_wrapper", _file_blocks)
        return wrapper(open(big_file(size), "rb"), numbers["block"])
    return _slices(big_body(size), numbers["block"])


APPS = {"hello": hello_app, "cpu": cpu_app, "bodies": bodies_app}


# -- the pywsgi server behind HAProxy and for "direct" ------------------


def serve(address: str, app: str = "hello") -> None:
    """Serve ``hello_app`` (or ``APPS[app]``) with gevent.pywsgi on
    HOST:PORT until SIGTERM."""
    import gevent
    import gevent.pywsgi

    class NoDelayHandler(gevent.pywsgi.WSGIHandler):
        def __init__(self, sock, *args, **kwargs):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            super().__init__(sock, *args, **kwargs)

    host, port = address.rsplit(":", 1)
    server = gevent.pywsgi.WSGIServer((host, int(port)), APPS[app], log=None,
                                      handler_class=NoDelayHandler)
    server.start()
    print(SERVE_READY + "%s:%d" % server.address[:2], flush=True)
    gevent.signal_handler(signal.SIGTERM, server.stop, 1)
    server.serve_forever()


# -- processes ----------------------------------------------------------


def start_process(argv: List[str], ready: str,
                  timeout: float = 30.0) -> Tuple[subprocess.Popen, str]:
    """Start ``argv``, wait for the stdout line starting with ``ready``,
    return (process, the HOST:PORT that ends that line).  The checkout is
    on its path, so a worker finds its application here (``benchmarks.bench:
    hello_app``) from any directory."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True,
                               env=dict(os.environ, PYTHONPATH=path))
    assert process.stdout is not None
    # The line is printed and flushed whole, so once readable it is there.
    readable, _, _ = select.select([process.stdout], [], [], timeout)
    line = process.stdout.readline() if readable else "nothing in %g s" % timeout
    if not line.startswith(ready):
        stop_process(process)
        raise BenchError("%s did not start (said %r)" % (" ".join(argv), line))
    return process, line.split()[-1]


@contextlib.contextmanager
def running(argv: List[str], ready: str) -> Iterator[Tuple[subprocess.Popen, str]]:
    """``start_process`` as a context: the process is stopped on exit."""
    process, address = start_process(argv, ready)
    try:
        yield process, address
    finally:
        stop_process(process)


# -- the three targets ---------------------------------------------------
#
# Each yields (url, balancer pids, worker pids) and stops what it started.


Target = Tuple[str, List[int], List[int]]


@contextlib.contextmanager
def zc_lb_cluster(args: argparse.Namespace, worker_args: List[str], workers: int = 2,
                  lb_args: Tuple[str, ...] = ()
                  ) -> Iterator[Tuple[str, subprocess.Popen, List[subprocess.Popen]]]:
    """``workers`` zc-lb workers (``zc-lb worker`` + ``worker_args``) and
    an LB in front of them: (the LB's address, the LB, the workers)."""
    with contextlib.ExitStack() as stack:
        started = [stack.enter_context(running(
            [sys.executable, "-m", "zc_lb.cli", "--log-level", "WARNING", "worker",
             *worker_args], "zc-lb worker listening on ")) for _ in range(workers)]
        argv = [sys.executable, "-m", "zc_lb.cli", "--log-level", "WARNING", "lb",
                "--listen", "127.0.0.1:0", "--policy", args.policy, *lb_args]
        for _, address in started:
            argv += ["--worker", address]
        lb, address = stack.enter_context(running(argv, "zc-lb lb listening on "))
        yield address, lb, [process for process, _ in started]


@contextlib.contextmanager
def zc_lb_target(args: argparse.Namespace) -> Iterator[Target]:
    # (a cooperative app)
    with zc_lb_cluster(args, ["benchmarks.bench:hello_app", "--greenlets"]) as (address, lb, workers):
        yield "http://%s/" % address, [lb.pid], [p.pid for p in workers]


@contextlib.contextmanager
def zc_lb_tls_target(args: argparse.Namespace) -> Iterator[Target]:
    """``zc-lb``, its LB and workers verifying each other over TLS (tls.py):
    a CA and the two certificates made for the run with openssl."""
    with tempfile.TemporaryDirectory(prefix="zc-lb-bench-pki-") as directory:
        pki = make_pki(directory)
        worker_tls = ["--tls-cert", pki["worker"] + ".pem", "--tls-key", pki["worker"] + ".key",
                      "--tls-ca", pki["ca"]]
        lb_tls = ("--worker-tls-cert", pki["lb"] + ".pem", "--worker-tls-key", pki["lb"] + ".key",
                  "--worker-tls-ca", pki["ca"])
        with zc_lb_cluster(args, ["benchmarks.bench:hello_app", "--greenlets"] + worker_tls,
                           lb_args=lb_tls) as (address, lb, workers):
            yield "http://%s/" % address, [lb.pid], [p.pid for p in workers]


def make_pki(directory: str) -> Dict[str, str]:
    """A CA, and a worker's and an LB's certificates of it for 127.0.0.1
    (openssl, EC P-256): {"ca": its file, "worker"/"lb": path less .pem/.key}."""
    def openssl(*argv: str) -> None:
        subprocess.run(["openssl", *argv], cwd=directory, check=True, capture_output=True,
                       timeout=60)

    curve = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *curve, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
            "-subj", "/CN=bench-ca")
    with open(os.path.join(directory, "san.ext"), "w") as f:
        f.write("subjectAltName=IP:127.0.0.1\n")
    for name in ("worker", "lb"):
        openssl("req", *curve, "-keyout", name + ".key", "-out", name + ".csr",
                "-subj", "/CN=" + name)
        openssl("x509", "-req", "-in", name + ".csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                "-CAcreateserial", "-out", name + ".pem", "-days", "2", "-extfile", "san.ext")
    return {"ca": os.path.join(directory, "ca.pem"), "worker": os.path.join(directory, "worker"),
            "lb": os.path.join(directory, "lb")}


def lb_processes_target(processes: int):
    """The LB alone, as ``--processes N``, in front of SCALE_WORKERS workers."""

    @contextlib.contextmanager
    def target(args: argparse.Namespace) -> Iterator[Target]:
        with zc_lb_cluster(args, ["benchmarks.bench:hello_app", "--greenlets"], SCALE_WORKERS,
                           ("--processes", str(processes))) as (address, lb, workers):
            pids = with_children([lb.pid]) if processes > 1 else [lb.pid]
            yield "http://%s/" % address, pids, [p.pid for p in workers]

    return target


def serve_argv(app: str = "hello") -> List[str]:
    return [sys.executable, "-m", "benchmarks.bench", "serve", "127.0.0.1:0", app]


@contextlib.contextmanager
def zc_lb_cpu_target(args: argparse.Namespace) -> Iterator[Target]:
    """The realistic pair's zc-lb: thread-mode workers running ``cpu_app``."""
    with zc_lb_cluster(args, ["benchmarks.bench:cpu_app"]) as (address, lb, workers):
        yield "http://%s/" % address, [lb.pid], [p.pid for p in workers]


@contextlib.contextmanager
def haproxy_cpu_target(args: argparse.Namespace) -> Iterator[Target]:
    """The realistic pair's HAProxy: pywsgi servers running ``cpu_app``."""
    with haproxy_target(args, "cpu") as target:
        yield target


@contextlib.contextmanager
def haproxy_target(args: argparse.Namespace, app: str = "hello") -> Iterator[Target]:
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(running(serve_argv(app), SERVE_READY))
                   for _ in range(2)]
        listen = "127.0.0.1:%d" % free_port()
        cfg = stack.enter_context(tempfile.NamedTemporaryFile(
            "w", prefix="zc-lb-haproxy-", suffix=".cfg"))
        cfg.write(haproxy_config(args.haproxy_config, listen, [a for _, a in servers]))
        cfg.flush()
        process = subprocess.Popen([args.haproxy, "-f", cfg.name, "-db"],
                                   stdout=subprocess.DEVNULL)
        stack.callback(stop_process, process)
        wait_for_port(listen, process)
        yield "http://%s/" % listen, [process.pid], [p.pid for p, _ in servers]


@contextlib.contextmanager
def haproxy_in_front(args: argparse.Namespace, haproxy: str, server: str) -> Iterator[str]:
    """HAProxy (the bench's config) in front of ``server`` alone: its address."""
    with contextlib.ExitStack() as stack:
        listen = "127.0.0.1:%d" % free_port()
        cfg = stack.enter_context(tempfile.NamedTemporaryFile(
            "w", prefix="zc-lb-haproxy-", suffix=".cfg"))
        cfg.write(haproxy_config(args.haproxy_config, listen, [server, server]))
        cfg.flush()
        process = subprocess.Popen([haproxy, "-f", cfg.name, "-db"], stdout=subprocess.DEVNULL)
        stack.callback(stop_process, process)
        wait_for_port(listen, process)
        yield listen


def haproxy_config(template: str, listen: str, servers: List[str]) -> str:
    """The HAProxy config: ``template`` with its ports filled in."""
    text = Path(template).read_text(encoding="utf-8")
    return string.Template(text).substitute(
        listen=listen, server1=servers[0], server2=servers[1])


@contextlib.contextmanager
def direct_target(args: argparse.Namespace) -> Iterator[Target]:
    with running(serve_argv(), SERVE_READY) as (process, address):
        yield "http://%s/" % address, [], [process.pid]


@contextlib.contextmanager
def floor_target(args: argparse.Namespace) -> Iterator[Target]:
    from . import floor

    with contextlib.ExitStack() as stack:
        workers = [stack.enter_context(running(
            [sys.executable, "-m", "benchmarks.bench", "floor-worker", "127.0.0.1:0"],
            floor.READY)) for _ in range(2)]
        proxy, address = stack.enter_context(running(
            [sys.executable, "-m", "benchmarks.bench", "floor-proxy", "127.0.0.1:0"]
            + [a for _, a in workers], floor.READY))
        yield "http://%s/" % address, [proxy.pid], [p.pid for p, _ in workers]


TARGET_FACTORIES = {"zc-lb": zc_lb_target, "zc-lb-tls": zc_lb_tls_target,
                    "haproxy": haproxy_target, "direct": direct_target,
                    "lb-1p": lb_processes_target(1), "lb-2p": lb_processes_target(2),
                    "floor": floor_target, "zc-lb-cpu": zc_lb_cpu_target,
                    "haproxy-cpu": haproxy_cpu_target, "zc-lb-paced": zc_lb_target,
                    "haproxy-paced": haproxy_target}


# -- measuring -------------------------------------------------------------


UNITS = {"us": 1e-3, "ms": 1.0, "s": 1000.0, "m": 60000.0, "h": 3600000.0}


def _ms(text: str) -> float:
    number, unit = re.fullmatch(r"([\d.]+)(us|ms|s|m|h)", text).groups()  # type: ignore[union-attr]
    return float(number) * UNITS[unit]


def parse_wrk(output: str) -> Dict[str, float]:
    """Requests/sec, requests completed, errors and p50/p99 (ms) from
    ``wrk --latency`` output."""
    rps = re.search(r"^Requests/sec:\s+([\d.]+)", output, re.M)
    requests = re.search(r"^\s*(\d+) requests in", output, re.M)
    p50 = re.search(r"^\s+50%\s+(\S+)", output, re.M)
    p99 = re.search(r"^\s+99%\s+(\S+)", output, re.M)
    if not (rps and requests and p50 and p99):
        raise BenchError("cannot read wrk's output:\n" + output)
    errors = sum(int(n) for n in re.findall(r"(?:connect|read|write|timeout) (\d+)", output))
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", output)
    return {"rps": float(rps.group(1)), "requests": int(requests.group(1)),
            "errors": errors + (int(non2xx.group(1)) if non2xx else 0),
            "p50_ms": _ms(p50.group(1)), "p99_ms": _ms(p99.group(1))}


def run_wrk(wrk: str, url: str, seconds: int, connections: int,
            script: Optional[str] = None, target: str = "") -> str:
    """Run wrk once against ``url``, of ``target`` (with the Lua
    ``script``, if given); its output.  A run past its ``seconds`` by
    WRK_GRACE is killed, a BenchError naming the target."""
    argv = [wrk, "-t1", "-c%d" % connections, "-d%ds" % seconds, "--latency",
            *(["-s", script] if script else []), url]
    try:
        done = subprocess.run(argv, capture_output=True, text=True,
                              timeout=seconds + WRK_GRACE)
    except subprocess.TimeoutExpired:  # (subprocess.run has killed it)
        raise BenchError("%s: wrk against %s did not end within %gs of its %ds run: "
                         "killed" % (target or url, url, WRK_GRACE, seconds)) from None
    if done.returncode != 0:
        raise BenchError("%s failed: %s" % (" ".join(argv), done.stderr.strip()))
    return done.stdout


def check_response(url: str) -> None:
    """One GET before loading a target: a broken setup that answers 502
    quickly must not pass for a fast one."""
    import urllib.request

    try:  # (urllib raises for an error status)
        with urllib.request.urlopen(url, timeout=10) as response:
            body = response.read()
    except OSError as exc:
        raise BenchError("%s: %s" % (url, exc)) from exc
    if response.status != 200 or body != BODY:
        raise BenchError("%s answered %s %r" % (url, response.status, body[:80]))


MAX_ERRORS = 0.01  # a measured run's errors over its requests, for its figures to stand


def has_ended(pid: int) -> bool:
    """Whether process ``pid`` has ended: gone from /proc, or a zombie (a
    child of ours not yet reaped, whose /proc reads no memory and no
    more CPU)."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def check_run(name: str, result: Dict[str, object], ended: List[int]) -> None:
    """BenchError where a measured run's figures would mislead: wrk
    completed no request, more than MAX_ERRORS of them were errors (fast
    failures passing for speed), or processes of the target had
    ``ended`` by its end (their CPU stops counting when they end)."""
    requests = int(result["requests"])  # type: ignore[call-overload]
    errors = int(result["errors"])  # type: ignore[call-overload]
    if requests == 0:
        raise BenchError("%s completed no request in the measured run" % name)
    if errors > MAX_ERRORS * requests:
        raise BenchError("%s: %d errors in %d requests in the measured run" % (
            name, errors, requests))
    if ended:
        raise BenchError("%s: process %s ended during the measured run" % (
            name, ", ".join(str(pid) for pid in ended)))


def measure(name: str, args: argparse.Namespace) -> Dict[str, object]:
    """Start target ``name``, warm it up, measure it, stop it."""
    connections = (CPU_CONNECTIONS if name in REALISTIC else
                   PACED_CONNECTIONS if name in PACED else args.connections)
    with contextlib.ExitStack() as stack:
        script = None
        if name in PACED:
            script = stack.enter_context(tempfile.NamedTemporaryFile(
                "w", prefix="zc-lb-paced-", suffix=".lua"))
            script.write("function delay()\n  return %d\nend\n" % PACED_DELAY_MS)
            script.flush()
        url, lb_pids, worker_pids = stack.enter_context(TARGET_FACTORIES[name](args))
        check_response(url)
        path = script.name if script is not None else None
        if args.warmup:
            run_wrk(args.wrk, url, args.warmup, connections, path, name)
        before = cpu_times(lb_pids), cpu_times(worker_pids)
        result: Dict[str, object] = dict(parse_wrk(
            run_wrk(args.wrk, url, args.seconds, connections, path, name)))
        after = cpu_times(lb_pids), cpu_times(worker_pids)
        ended = [pid for pid in lb_pids + worker_pids if has_ended(pid)]
    check_run(name, result, ended)
    requests = int(result["requests"])  # type: ignore[call-overload]
    result["lb_cpu_us_per_req"] = (cpu_used(before[0], after[0]) * 1e6 / requests
                                   if lb_pids else None)
    result["worker_cpu_us_per_req"] = cpu_used(before[1], after[1]) * 1e6 / requests
    result["target"] = name
    return result


# -- large bodies -----------------------------------------------------------


class BodyClient:
    """A plain HTTP/1.1 client on one keep-alive connection, quick enough
    not to be what a large body waits for: TCP_NODELAY, the upload one
    ``sendall`` of one bytes object, a response received with
    ``recv_into`` into one buffer made beforehand."""

    def __init__(self, address: str, size: int) -> None:
        host, port = address.rsplit(":", 1)
        self.address = address
        self.size = size
        self.sock = socket.create_connection((host, int(port)), timeout=BODIES_TIMEOUT)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buffer = bytearray(size + 65536)  # the body and its head
        self.payload = big_body(size)

    def download(self, query: str = "") -> float:
        """GET the body (``query``: the app's block and file options);
        the seconds it took."""
        started = time.perf_counter()
        self.sock.sendall(b"GET /?size=%d%s HTTP/1.1\r\nHost: %s\r\n\r\n"
                          % (self.size, query.encode(), self.address.encode()))
        self._expect(self.size, started)
        return time.perf_counter() - started

    def upload(self, query: str = "") -> float:
        """POST the body; the seconds until the app's answer came."""
        started = time.perf_counter()
        self.sock.sendall(b"POST /?size=%d%s HTTP/1.1\r\nHost: %s\r\nContent-Type: "
                          b"application/octet-stream\r\nContent-Length: %d\r\n\r\n"
                          % (self.size, query.encode(), self.address.encode(), self.size))
        self.sock.sendall(self.payload)
        length, start = self._expect(None, started)
        answer = bytes(self.buffer[start:start + length])
        if answer != b"%d\n" % self.size:
            raise BenchError("%s counted %r of a %d-byte upload" % (self.address, answer,
                                                                    self.size))
        return time.perf_counter() - started

    def check(self, query: str = "") -> None:
        """One download, its body checked: a target that answers fast
        with the wrong bytes must not pass for a fast one."""
        self.download(query)
        start = self.buffer.find(b"\r\n\r\n") + 4
        if self.buffer[start:start + self.size] != self.payload:
            raise BenchError("%s sent a body other than the app's (%s)" % (self.address,
                                                                          query))

    def _expect(self, length: Optional[int], started: float) -> Tuple[int, int]:
        """Receive a 200 response (of ``length`` body bytes, if given):
        (its body's length, where its body starts in the buffer)."""
        view, got, deadline = memoryview(self.buffer), 0, started + BODIES_TIMEOUT
        end = -1
        while end < 0 and got < 65536:
            got += self._recv(view[got:], deadline)
            end = self.buffer.find(b"\r\n\r\n", 0, got)
        head = bytes(self.buffer[:max(end, 0)]).decode("latin-1")
        found = re.search(r"^content-length:\s*(\d+)", head, re.I | re.M)
        if end < 0 or not head.startswith("HTTP/1.1 200 ") or not found or (
                length is not None and int(found.group(1)) != length):
            raise BenchError("%s answered %r" % (self.address, head[:200]))
        total = end + 4 + int(found.group(1))
        if total > len(self.buffer):
            raise BenchError("%s answered a body of %s bytes" % (self.address, found.group(1)))
        while got < total:
            got += self._recv(view[got:total], deadline)
        return total - end - 4, end + 4

    def _recv(self, view: memoryview, deadline: float) -> int:
        """Receive into ``view``: how many bytes came."""
        if time.perf_counter() > deadline:
            raise BenchError("a transfer from %s took over %gs" % (self.address, BODIES_TIMEOUT))
        received = self.sock.recv_into(view)
        if not received:
            raise BenchError("%s closed the connection" % self.address)
        return received

    def close(self) -> None:
        self.sock.close()


# The cases of the bodies measure: (name, HTTP method's way, the app's query).
BODY_CASES = (
    ("download, 4 KiB blocks", "download", "&block=4096"),
    ("download, 64 KiB blocks", "download", "&block=65536"),
    ("download, wsgi.file_wrapper", "download", "&block=4096&file=1"),
    ("upload, 4 KiB reads", "upload", "&block=4096"),
    ("upload, 64 KiB reads", "upload", "&block=65536"),
)
# The targets' names, in the order measure_bodies makes their addresses.
# ("--sendfile on": what sendfile(2) would make of the file case over
# loopback, where the worker's default does without it.)
BODY_TARGETS = ("direct", "zc-lb", "zc-lb --greenlets", "--sendfile on", "bare TCP hop",
                "zc-lb TLS", "HAProxy")
GOAL_TARGETS = ("zc-lb", "zc-lb --greenlets")  # the ones GOAL_BODIES is for


def time_bodies(addresses: List[str], size: int,
                transfers: int) -> List[Dict[str, float]]:
    """Seconds, for each of ``addresses``, of ``transfers`` transfers of
    ``size`` bytes in each of BODY_CASES, after a checked download of
    each download case.  The transfers go one at a time, taking turns
    between the addresses, so that whatever else the machine does weighs
    on each alike."""
    clients: List[BodyClient] = []
    try:
        clients += [BodyClient(address, size) for address in addresses]
        for client in clients:
            for _, way, query in BODY_CASES:
                if way == "download":
                    client.check(query)
                else:
                    client.upload(query)
        times = [{name: 0.0 for name, _, _ in BODY_CASES} for _ in clients]
        for name, way, query in BODY_CASES:
            for _ in range(transfers):
                for client, spent in zip(clients, times):
                    spent[name] += getattr(client, way)(query)
        return times
    except OSError as exc:
        raise BenchError("large bodies from %s: %s" % (" and ".join(addresses), exc))
    finally:
        for client in clients:
            client.close()


def measure_bodies(args: argparse.Namespace) -> Dict[str, object]:
    """Large bodies (BODY_CASES) through zc-lb with one worker in each
    mode, through a bare TCP hop (``floor.serve_hop``: what one more
    process in the way costs), through zc-lb over TLS and through
    HAProxy if it is installed, against the app served directly: the
    MB/s of each and their times over the direct's."""
    from . import floor

    size, transfers = args.body_mb * MB, args.body_transfers
    haproxy = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/usr/bin")
    with contextlib.ExitStack() as stack:
        _, direct_address = stack.enter_context(running(serve_argv("bodies"), SERVE_READY))
        app = "benchmarks.bench:bodies_app"
        addresses = [direct_address,
                     stack.enter_context(zc_lb_cluster(args, [app], 1))[0],
                     stack.enter_context(zc_lb_cluster(args, [app, "--greenlets"], 1))[0],
                     stack.enter_context(zc_lb_cluster(args, [app, "--sendfile", "on"], 1))[0],
                     stack.enter_context(running([sys.executable, "-m", "benchmarks.bench",
                                                  "hop", "127.0.0.1:0", direct_address],
                                                 floor.READY))[1]]
        # (the same through an LB and worker that verify each other over TLS)
        pki = make_pki(stack.enter_context(tempfile.TemporaryDirectory(prefix="zc-lb-pki-")))
        addresses.append(stack.enter_context(zc_lb_cluster(
            args, [app, "--greenlets", "--tls-cert", pki["worker"] + ".pem",
                   "--tls-key", pki["worker"] + ".key", "--tls-ca", pki["ca"]], 1,
            ("--worker-tls-cert", pki["lb"] + ".pem", "--worker-tls-key", pki["lb"] + ".key",
             "--worker-tls-ca", pki["ca"])))[0])
        if haproxy is not None:
            addresses.append(stack.enter_context(haproxy_in_front(
                args, haproxy, direct_address)))
        times = time_bodies(addresses, size, transfers)
    cases: Dict[str, Dict[str, float]] = {}
    for name, _, _ in BODY_CASES:
        direct = times[0][name]
        numbers = cases[name] = {"direct_mb_s": transfers * size / MB / direct}
        for target, spent in zip(BODY_TARGETS[1:], times[1:]):
            numbers[target] = spent[name] / direct
    missed = ["%s %s" % (target, name) for name, numbers in cases.items()
              for target in GOAL_TARGETS if numbers[target] > GOAL_BODIES]
    return {"mb": args.body_mb, "transfers": transfers, "cases": cases,
            "goal_ratio": GOAL_BODIES, "met": not missed, "missed": missed}


def bodies_lines(result: Dict[str, object]) -> str:
    """The large-body measure's table, with its goal."""
    cases: Dict[str, Dict[str, float]] = result["cases"]  # type: ignore[assignment]
    targets = [target for target in BODY_TARGETS[1:]
               if all(target in numbers for numbers in cases.values())]
    width = max(len(name) for name in cases)
    lines = ["bodies (%s MB, %s transfers each): the app's time through each over its "
             "time served directly" % (result["mb"], result["transfers"]),
             "  %-*s  %11s  %s" % (width, "", "direct MB/s",
                                   "  ".join("%*s" % (max(len(t), 5), t) for t in targets))]
    for name, numbers in cases.items():
        lines.append("  %-*s  %11.0f  %s" % (width, name, numbers["direct_mb_s"], "  ".join(
            "%*s" % (max(len(t), 5), "%.2fx" % numbers[t]) for t in targets)))
    lines.append("  goal: zc-lb's (both worker modes) <= %.1fx: %s" % (
        GOAL_BODIES, "met" if result["met"] else "NOT met (%s)" % ", ".join(
            result["missed"])))  # type: ignore[arg-type]
    return "\n".join(lines)


def rss_kb(pid: int) -> int:
    """A process's resident memory, in KiB (Linux /proc)."""
    with open("/proc/%d/statm" % pid) as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def measure_idle(args: argparse.Namespace, clients: int = IDLE_CLIENTS,
                 batch: int = IDLE_BATCH) -> Dict[str, object]:
    """The LB's memory per idle keep-alive client: ``clients`` connections
    each make one request and stay open and quiet, in batches of
    ``batch`` that each park (``zc_lb.front.client.PARK_AFTER``) before the next comes;
    the LB's resident memory after, less before, over their number.  Then
    the same with all of them at once: a burst's greenlets all live until
    they park, and the allocator keeps that peak."""
    batched = _idle_kb(args, clients, batch)
    burst = _idle_kb(args, clients, clients)
    return {"clients": clients, "batch": batch, "kb_per_client": batched,
            "burst_kb_per_client": burst, "goal_kb": GOAL_IDLE_KB,
            "met": batched <= GOAL_IDLE_KB}


def _idle_kb(args: argparse.Namespace, clients: int, batch: int) -> float:
    request = b"GET / HTTP/1.1\r\nHost: bench\r\n\r\n"
    with zc_lb_cluster(args, ["benchmarks.bench:hello_app", "--greenlets"], 1) as (address, lb, _):
        host, port = address.rsplit(":", 1)
        with contextlib.ExitStack() as stack:
            warm = stack.enter_context(socket.create_connection((host, int(port)), timeout=10))
            for _ in range(200):  # (the LB's own first-request allocations)
                warm.sendall(request)
                read_response(warm)
            time.sleep(IDLE_SETTLE)
            before = rss_kb(lb.pid)
            for start in range(0, clients, batch):
                socks = [stack.enter_context(socket.create_connection((host, int(port)),
                                                                      timeout=10))
                         for _ in range(min(batch, clients - start))]
                for sock in socks:
                    sock.sendall(request)
                for sock in socks:
                    read_response(sock)
                time.sleep(IDLE_SETTLE)
            return (rss_kb(lb.pid) - before) / clients


def measure_slow(args: argparse.Namespace, clients: int = SLOW_CLIENTS,
                 kb: int = SLOW_KB) -> Dict[str, object]:
    """The LB's memory per slow client, and what they do to the others:
    ``clients`` connections ask for ``kb`` KB each and read none of it
    (a 4 KB receive buffer); the workers are freed by the LB's buffers (in
    memory up to ``--buffer-memory-total``, then on disk).  The LB's
    resident memory with them, less before, over their number; another
    client's p99 over sequential small requests, without them and with."""
    request = b"GET /?size=%d HTTP/1.1\r\nHost: bench\r\n\r\n" % (kb * 1024)
    with zc_lb_cluster(args, ["benchmarks.bench:bodies_app", "--greenlets"]) as (address, lb, _):
        host, port = address.rsplit(":", 1)
        before_p99 = _p99_ms(host, int(port))
        time.sleep(IDLE_SETTLE)
        before = rss_kb(lb.pid)
        with contextlib.ExitStack() as stack:
            for _ in range(clients):
                sock = stack.enter_context(socket.socket())
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.settimeout(10)
                sock.connect((host, int(port)))
                sock.sendall(request)
            deadline = time.monotonic() + 60
            settled, last = 0, -1  # until the LB holds what it will hold
            while settled < 4 and time.monotonic() < deadline:
                time.sleep(0.5)
                now = rss_kb(lb.pid)
                settled = settled + 1 if abs(now - last) < 0.005 * now else 0
                last = now
            during = rss_kb(lb.pid)
            during_p99 = _p99_ms(host, int(port))
    kb_each = (during - before) / clients
    return {"clients": clients, "response_kb": kb, "kb_per_client": kb_each,
            "p99_ms_without": before_p99, "p99_ms_with": during_p99, "goal_kb": GOAL_SLOW_KB,
            "met": kb_each <= GOAL_SLOW_KB and during_p99 <= SLOW_P99 * before_p99}


def _p99_ms(host: str, port: int, requests: int = 400) -> float:
    """p99 of sequential small requests on one keep-alive connection, ms."""
    request = b"GET /?size=100 HTTP/1.1\r\nHost: bench\r\n\r\n"
    times = []
    with socket.create_connection((host, port), timeout=10) as sock:
        for _ in range(requests):
            start = time.perf_counter()
            sock.sendall(request)
            read_response(sock)
            times.append(time.perf_counter() - start)
    times.sort()
    return 1000 * times[int(0.99 * len(times))]


def slow_line(result: Dict[str, object]) -> str:
    """The slow clients' line, with its goal."""
    return ("slow clients (%s, %s KB each, reading nothing): %.1f KB of LB memory each; "
            "another client's p99 %.2f ms with them, %.2f without; goal <= %.0f KB, "
            "p99 within %.0fx: %s" % (
                result["clients"], result["response_kb"], result["kb_per_client"],
                result["p99_ms_with"], result["p99_ms_without"], GOAL_SLOW_KB, SLOW_P99,
                verdict(result["met"])))


def read_response(sock: socket.socket) -> str:
    """Read one response framed by its Content-Length, whole; its status
    code.  ConnectionError if the peer closes before it is all there."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("connection closed before a response")
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("connection closed in a body")
        rest += chunk
    return lines[0].split()[1]


def idle_line(result: Dict[str, object]) -> str:
    """The idle clients' memory line, with its goal."""
    return ("idle keep-alive clients (%s): %.1f KB of LB memory each, parked in batches of "
            "%s; %.1f KB when all came at once (the burst's peak, which the allocator keeps); "
            "goal <= %.0f KB: %s" % (
                result["clients"], result["kb_per_client"], result["batch"],
                result["burst_kb_per_client"], GOAL_IDLE_KB,
                verdict(result["met"])))


# -- reporting ------------------------------------------------------------


def ratios(results: List[Dict[str, object]]) -> Dict[str, Optional[float]]:
    """zc-lb's throughput relative to HAProxy and to the direct server."""
    rps = {r["target"]: float(r["rps"]) for r in results}  # type: ignore[arg-type]

    def ratio(other: str) -> Optional[float]:
        if "zc-lb" in rps and rps.get(other):
            return rps["zc-lb"] / rps[other]
        return None

    scaling = (rps["lb-2p"] / rps["lb-1p"]) if rps.get("lb-1p") and "lb-2p" in rps else None
    realistic = (rps["zc-lb-cpu"] / rps["haproxy-cpu"]
                 if rps.get("haproxy-cpu") and "zc-lb-cpu" in rps else None)
    tls = rps["zc-lb-tls"] / rps["zc-lb"] if rps.get("zc-lb") and "zc-lb-tls" in rps else None
    return {"zc-lb / HAProxy": ratio("haproxy"), "zc-lb / direct": ratio("direct"),
            "lb-2p / lb-1p": scaling, "zc-lb-cpu / haproxy-cpu": realistic,
            "zc-lb-tls / zc-lb": tls}


def _cell(value: object, fmt: str) -> str:
    return "-" if value is None else fmt % value


def format_table(results: List[Dict[str, object]]) -> str:
    """The results as a plain-text table followed by the ratios."""
    head = "%-13s %10s %9s %9s %14s %15s %7s" % (
        "target", "req/s", "p50 ms", "p99 ms", "LB CPU us/req", "wkr CPU us/req", "errors")
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append("%-13s %10.0f %9.2f %9.2f %14s %15s %7d" % (
            r["target"], r["rps"], r["p50_ms"], r["p99_ms"],
            _cell(r["lb_cpu_us_per_req"], "%.1f"), _cell(r["worker_cpu_us_per_req"], "%.1f"),
            r["errors"]))
    throughput = ratios(results)
    for label, value in throughput.items():
        lines.append("%s throughput ratio: %s" % (label, _cell(value, "%.3f")))
    lines += floor_lines({r["target"]: r for r in results})
    zc_lb = [r for r in results if r["target"] == "zc-lb"]
    if zc_lb:
        app = app_cpu_us()
        overhead = float(zc_lb[0]["worker_cpu_us_per_req"]) - app  # type: ignore[arg-type]
        lines.append("zc-lb worker overhead: %.1f us/req (worker CPU %.1f minus the app's own "
                     "%.1f)" % (overhead, zc_lb[0]["worker_cpu_us_per_req"], app))
        lines += goals(zc_lb[0], throughput["zc-lb / HAProxy"], overhead,
                       {r["target"]: r for r in results}.get("haproxy"))
    lines += paced_lines({r["target"]: r for r in results})
    realistic = throughput["zc-lb-cpu / haproxy-cpu"]
    if realistic is not None:
        lines.append("realistic (1 ms of CPU, one path, -c%d): zc-lb %.2fx HAProxy's "
                     "throughput, goal >= %.2f: %s" % (
                         CPU_CONNECTIONS, realistic, GOAL_REALISTIC,
                         verdict(realistic >= GOAL_REALISTIC)))
    return "\n".join(lines)


def paced_lines(by_target: Dict[str, Dict[str, object]]) -> List[str]:
    """The paced pair's line: each LB's CPU per request at a moderate rate."""
    ours, theirs = (by_target.get(name) for name in PACED)
    if ours is None or theirs is None or theirs["lb_cpu_us_per_req"] is None:
        return []
    cpu = float(ours["lb_cpu_us_per_req"])  # type: ignore[arg-type]
    other = float(theirs["lb_cpu_us_per_req"])  # type: ignore[arg-type]
    if not other:  # (a short run: HAProxy's CPU under the kernel's tick, 10 ms)
        return ["paced (-c%d, each waiting %d ms after a response): LB CPU %.1f us/req at %.0f "
                "req/s, HAProxy's under one clock tick at %.0f: too short a run for a ratio" % (
                    PACED_CONNECTIONS, PACED_DELAY_MS, cpu, ours["rps"], theirs["rps"])]
    return ["paced (-c%d, each waiting %d ms after a response): LB CPU %.1f us/req at %.0f "
            "req/s, %.2fx HAProxy's %.1f at %.0f, goal <= %.1fx: %s" % (
                PACED_CONNECTIONS, PACED_DELAY_MS, cpu, ours["rps"], cpu / other, other,
                theirs["rps"], GOAL_LB_CPU, verdict(cpu / other <= GOAL_LB_CPU))]


def floor_lines(by_target: Dict[str, Dict[str, object]]) -> List[str]:
    """The LB's and HAProxy's CPU per request against the floor proxy's."""
    floor = by_target.get("floor")
    if floor is None or not floor["lb_cpu_us_per_req"]:
        return []
    base = float(floor["lb_cpu_us_per_req"])  # type: ignore[arg-type]
    lines = []
    for name in ("zc-lb", "haproxy", "lb-1p"):
        row = by_target.get(name)
        if row is not None and row["lb_cpu_us_per_req"] is not None:
            lines.append("%s LB CPU / the floor proxy's: %.2f" % (
                name, float(row["lb_cpu_us_per_req"]) / base))  # type: ignore[arg-type]
    return lines


def verdict(ok: bool) -> str:
    """A goal's word in the bench's lines."""
    return "met" if ok else "NOT met"


def goals(zc_lb: Dict[str, object], throughput: Optional[float], overhead: float,
          haproxy: Optional[Dict[str, object]]) -> List[str]:
    """Lines saying how this run stands against the front end's goals."""
    cpu = zc_lb["lb_cpu_us_per_req"]
    lines = ["goals:"]
    theirs = haproxy["lb_cpu_us_per_req"] if haproxy is not None else None
    if cpu is not None and theirs:
        times = float(cpu) / float(theirs)  # type: ignore[arg-type]
        lines.append("  LB CPU %.1f us/req, %.2fx HAProxy's %.1f, goal <= %.1fx: %s" % (
            cpu, times, theirs, GOAL_LB_CPU, verdict(times <= GOAL_LB_CPU)))
    if throughput is not None and haproxy is not None:
        p99_ok = float(zc_lb["p99_ms"]) <= float(haproxy["p99_ms"])  # type: ignore[arg-type]
        lines.append("  throughput %.2fx HAProxy's, goal >= 1.0, p99 no worse: %s" % (
            throughput, verdict(throughput >= 1.0 and p99_ok)))
    lines.append("  worker overhead %.1f us/req, goal <= %d: %s" % (
        overhead, GOAL_WORKER_US, verdict(overhead <= GOAL_WORKER_US)))
    return lines


def app_cpu_us(calls: int = 20000) -> float:
    """The app's own CPU per request: hello_app called in this process."""
    import time

    def start_response(status, headers):
        pass

    environ = {"REQUEST_METHOD": "GET", "PATH_INFO": "/"}
    started = time.process_time()
    for _ in range(calls):
        for _ in hello_app(environ, start_response):
            pass
    return (time.process_time() - started) * 1e6 / calls


POOL_CLASSES = 32  # the pool bench's classes, Zipf 1
POOL_KEYS = 200  # paths per class, Zipf 1
POOL_WORKERS = 6
POOL_OUTSTANDING = 24  # requests in flight: the issue workload's clients
POOL_RESUME_EVERY = 100  # requests between résumés, from each worker in turn


def pool_workload(requests: int, seed: int = 1) -> List[Tuple[str, str]]:
    """``requests`` (class, path) pairs, the same for every policy."""
    import random

    from itertools import accumulate

    def zipf(n: int) -> List[float]:  # cumulative weights 1, 1/2, 1/3, ...
        return list(accumulate(1.0 / rank for rank in range(1, n + 1)))

    rng = random.Random(seed)
    classes = rng.choices(range(POOL_CLASSES), k=requests, cum_weights=zipf(POOL_CLASSES))
    paths = rng.choices(range(POOL_KEYS), k=requests, cum_weights=zipf(POOL_KEYS))
    return [("c%d.example" % c, "/c%d/p%d" % (c, p)) for c, p in zip(classes, paths)]


def pool_us(policy: str, requests: int = 60000) -> float:
    """CPU microseconds per request of ``policy``'s choice: ``get`` and
    ``put`` for the requests of ``pool_workload``, ``POOL_OUTSTANDING``
    in flight, a worker pushing a résumé of what it served every
    ``POOL_RESUME_EVERY`` requests (which makes the affinity pool work
    out classes' members again, as live)."""
    import collections
    import time

    from zc_lb.routing.policies import make_pool

    workload = pool_workload(requests)
    pool = make_pool(policy, {})
    served: Dict[int, collections.Counter] = {}
    for handle in range(POOL_WORKERS):
        pool.add(handle, {})
        served[handle] = collections.Counter()
    flight: collections.deque = collections.deque()
    started = time.process_time()
    for n, (rclass, path) in enumerate(workload, 1):
        handle = pool.get(rclass, path)
        served[handle][rclass] += 1
        flight.append(handle)
        if len(flight) >= POOL_OUTSTANDING:
            pool.put(flight.popleft())
        if n % POOL_RESUME_EVERY == 0:
            sender = n // POOL_RESUME_EVERY % POOL_WORKERS
            # (scores that differ between workers, as real ones do)
            pool.new_resume(sender, {c: 100.0 + k for c, k in served[sender].items()})
            served[sender].clear()
    return (time.process_time() - started) * 1e6 / requests


def pool_line(costs: Dict[str, float]) -> str:
    """The pool bench's result: each policy's cost, and their ratio."""
    line = "pool choice (get + put, %d workers, %d classes): %s" % (
        POOL_WORKERS, POOL_CLASSES,
        ", ".join("%s %.1f us/req" % item for item in costs.items()))
    if costs.get("published"):
        line += "; affinity / published %.1f" % (costs["affinity"] / costs["published"])
    if "affinity" in costs:
        line += "; goal <= %g us: %s" % (GOAL_POOL_US, verdict(costs["affinity"] <= GOAL_POOL_US))
    return line


INTAKE_CLASSES = 10_000
INTAKE_CHANGED = 0.01


def intake_ms(policy: str = "affinity", resumes: int = 60, seed: int = 1) -> Dict[str, float]:
    """Milliseconds the pool takes in a worker's résumé of ``INTAKE_CLASSES``
    classes of which ``INTAKE_CHANGED`` have a new score (what a busy
    site's worker sends: the idle classes' scores do not move), between
    requests of 200 of the classes: the median and the worst of
    ``resumes``; and the LB's decoding of such a frame."""
    import gc
    import random
    import statistics
    import time

    from zc_lb.routing.policies import make_pool

    gc.freeze()  # (as the LB does once started: see cli/lb.py)
    from zc_lb.wire.decoder import Decoder
    from zc_lb.wire.encoder import encode
    from zc_lb.wire.frames import Resume

    rng = random.Random(seed)
    pool = make_pool(policy, {})
    scores = {}
    for handle in range(POOL_WORKERS):
        scores[handle] = {"c%d.example" % i: 100.0 + rng.random() for i in range(INTAKE_CLASSES)}
        pool.add(handle, dict(scores[handle]))
    names = list(scores[0])
    times = []
    for n in range(resumes):
        for _ in range(200):
            pool.put(pool.get(names[rng.randrange(200)], "/p%d" % rng.randrange(50)))
        resume = scores[n % POOL_WORKERS]
        for rclass in rng.sample(names, int(INTAKE_CLASSES * INTAKE_CHANGED)):
            resume[rclass] = 100.0 + rng.random()
        new = dict(resume)
        started = time.perf_counter()
        pool.new_resume(n % POOL_WORKERS, new)
        times.append((time.perf_counter() - started) * 1e3)
    frame = encode(Resume(scores[0]))
    decoder = Decoder()
    started = time.perf_counter()
    for _ in range(10):
        decoder.receive_data(frame)
        decoder.next_message()
    decode = (time.perf_counter() - started) * 1e3 / 10
    # The worst a flood of Host names makes: every class of every résumé
    # new (10,000 of 78,000 names), taken in steps as the LB takes them,
    # the longest stretch between the pauses where its loop runs on.
    stretches: List[float] = []
    mark = [0.0]

    def pause() -> None:
        now = time.perf_counter()
        stretches.append((now - mark[0]) * 1e3)
        mark[0] = now

    whole = []
    for n in range(resumes // 2):
        churned = {"h%d.example" % rng.randrange(78_000): 1.0 + 500 * rng.random()
                   for _ in range(INTAKE_CLASSES)}
        mark[0] = started = time.perf_counter()
        pool.new_resume(n % POOL_WORKERS, churned, pause)
        pause()
        whole.append((time.perf_counter() - started) * 1e3)
    return {"median": statistics.median(times), "max": max(times), "decode": decode,
            "churned_whole_median": statistics.median(whole),
            "churned_stretch_max": max(stretches)}


def intake_line(intake: Dict[str, float]) -> str:
    return ("résumé intake (%d classes, %d%% changed, %d workers): pool median %.2f ms, "
            "worst %.2f ms; goal <= %g ms: %s; decoding the frame %.2f ms\n"
            "résumé intake, every class new: %.1f ms a résumé (median), taken in steps; the "
            "longest the loop waited %.1f ms (the garbage collector's passes included); "
            "goal <= %g ms: %s" % (
                INTAKE_CLASSES, INTAKE_CHANGED * 100, POOL_WORKERS, intake["median"],
                intake["max"], GOAL_INTAKE_MS,
                verdict(intake["median"] <= GOAL_INTAKE_MS), intake["decode"],
                intake["churned_whole_median"], intake["churned_stretch_max"],
                GOAL_INTAKE_STRETCH_MS,
                verdict(intake["churned_stretch_max"] <= GOAL_INTAKE_STRETCH_MS)))


def find_tool(name: str, package: str) -> str:
    """The path of a required program, or a BenchError saying how to get it."""
    path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin")
    if path is None:
        raise BenchError("%s not found: install it with `apt-get install %s`" % (name, package))
    return path


def run_bench(args: argparse.Namespace) -> int:
    wrk_targets = [name for name in args.targets if name not in (BODIES, IDLE, SLOW)]
    if wrk_targets:
        args.wrk = find_tool("wrk", "wrk")
    if any(target.startswith("haproxy") for target in args.targets):
        args.haproxy = find_tool("haproxy", "haproxy")
    results = [measure(name, args) for name in wrk_targets]
    bodies = measure_bodies(args) if BODIES in args.targets else None
    idle = measure_idle(args) if IDLE in args.targets else None
    slow = measure_slow(args) if SLOW in args.targets else None
    costs = {policy: pool_us(policy) for policy in ("affinity", "published")}
    intake = intake_ms()
    build = zc_lb.build()  # (the LB's and workers' too: they import zc_lb as this does)
    if args.json:
        print(json.dumps({"settings": {"build": build,
                                       "seconds": args.seconds, "connections": args.connections,
                                       "warmup": args.warmup, "policy": args.policy,
                                       "body_mb": args.body_mb,
                                       "body_transfers": args.body_transfers,
                                       "cpus": os.cpu_count()},
                          "results": results, "ratios": ratios(results), "bodies": bodies,
                          "idle": idle, "slow": slow,
                          "pool_us_per_request": costs, "resume_intake_ms": intake},
                         indent=2))
        return 0
    print("zc-lb build: %s" % build)
    if results:
        print("wrk -t1 -c%d -d%ds, %ds warm-up, %s CPUs, zc-lb policy %s" % (
            args.connections, args.seconds, args.warmup, os.cpu_count(), args.policy))
        print(format_table(results))
    if bodies is not None:
        print(bodies_lines(bodies))
    if idle is not None:
        print(idle_line(idle))
    if slow is not None:
        print(slow_line(slow))
    print(pool_line(costs))
    print(intake_line(intake))
    return 0


# -- command line ---------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=int, default=5, help="measured seconds per target")
    parser.add_argument("--warmup", type=int, default=1,
                        help="warm-up seconds per target (0: none)")
    parser.add_argument("--connections", type=int, default=50, help="wrk connections")
    parser.add_argument("--policy", choices=("affinity", "published", "classless"),
                        default="affinity")
    parser.add_argument("--targets", default=",".join(TARGETS),
                        help="comma-separated subset of %s" % ",".join(TARGETS))
    parser.add_argument("--haproxy-config", default=str(HAPROXY_TEMPLATE),
                        help="HAProxy config template ($listen, $server1, $server2)")
    parser.add_argument("--body-mb", type=int, default=BODIES_MB,
                        help="MB of each large body (the bodies target)")
    parser.add_argument("--body-transfers", type=int, default=BODIES_TRANSFERS,
                        help="timed large-body transfers each way")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    return parser


def in_process(requests: int = 20000, batch: int = 8, clients: int = 4,
               profile: Optional[str] = None) -> float:
    """CPU microseconds per request with a worker, an LB and its front in
    this one process, and client greenlets pipelining ``batch`` requests
    at a time: the Python cost of a request end to end (both loopback
    hops' system calls included), free of the scheduling noise of
    separate processes on a busy machine.  ``profile``: write cProfile
    stats there."""
    from zc_lb.routing.policies import make_pool
    from zc_lb.routing.classifier import get_classifier, get_key_function
    from zc_lb.front.server import FrontServer
    from zc_lb.lb.balancer import LB
    from zc_lb.worker.server import Worker

    worker = Worker(hello_app)
    worker.start()
    lb = LB(make_pool("affinity", {}), get_classifier("host"),
            affinity_key=get_key_function("path"))
    lb.fleet.set_workers(["%s:%d" % worker.address[:2]])
    front = FrontServer(("127.0.0.1", 0), lb)
    front.start()
    if not lb.fleet.wait_for_workers(10):
        raise BenchError("the in-process worker did not connect")
    head = b"GET / HTTP/1.1\r\nHost: bench.example\r\n\r\n" * batch
    try:
        in_process_client(front.address, head, batch, batch * 100)  # warm up
        seconds = time_in_process_clients(front.address, head, batch,
                                          requests // clients, clients, profile)
        return seconds * 1e6 / (requests // clients * clients)
    finally:
        front.stop(timeout=1)
        lb.stop()
        worker.stop(timeout=1)


def in_process_client(address: Tuple[str, int], head: bytes, batch: int, n: int) -> None:
    """One in-process client: sends ``head`` (``batch`` pipelined
    requests) and reads the ``batch`` answers, until ``n`` are done."""
    import gevent.socket

    sock = gevent.socket.create_connection(address)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for _ in range(0, n, batch):
        sock.sendall(head)
        received = b""
        while received.count(BODY) < batch:
            data = sock.recv(65536)
            if not data:
                raise BenchError("the in-process LB closed the connection")
            received += data
    sock.close()


def time_in_process_clients(address: Tuple[str, int], head: bytes, batch: int, n: int,
                            clients: int, profile: Optional[str]) -> float:
    """CPU seconds of this process while ``clients`` greenlets each run an
    ``in_process_client`` of ``n`` requests; ``profile``: write cProfile
    stats there."""
    import cProfile

    import gevent

    profiler = cProfile.Profile() if profile else None
    started = time.process_time()
    if profiler is not None:
        profiler.enable()
    greenlets = [gevent.spawn(in_process_client, address, head, batch, n)
                 for _ in range(clients)]
    gevent.joinall(greenlets, timeout=IN_PROCESS_TIMEOUT, raise_error=True)
    if not all(g.successful() for g in greenlets):
        raise BenchError("in-process clients not done within %ds" % IN_PROCESS_TIMEOUT)
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(profile)
    return time.process_time() - started


@contextlib.contextmanager
def exit_on_sigterm() -> Iterator[None]:
    """Within, SIGTERM unwinds this process as Ctrl-C does (as SystemExit,
    status 143), so that what it started (HAProxy, the LB, workers, wrk)
    is stopped and its temporary files removed: SIGTERM's default would
    end it alone and leave them running."""
    def handler(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"] and len(argv) in (2, 3):
        serve(*argv[1:])
        return 0
    if argv[:1] == ["floor-worker"] and len(argv) == 2:
        from . import floor
        floor.serve_worker(argv[1], BODY)
        return 0
    if argv[:1] == ["hop"] and len(argv) == 3:
        from . import floor
        floor.serve_hop(argv[1], argv[2])
        return 0
    if argv[:1] == ["floor-proxy"] and len(argv) >= 3:
        from . import floor
        floor.serve_proxy(argv[1], argv[2:])
        return 0
    if argv[:1] == ["in-process"]:
        profile = argv[2] if argv[1:2] == ["--profile"] and len(argv) == 3 else None
        print("in-process: %.1f us of CPU per request (worker, LB and front in one "
              "process; zc-lb %s)" % (in_process(profile=profile), zc_lb.build()))
        return 0
    args = build_parser().parse_args(argv)
    args.targets = [t for t in args.targets.split(",") if t]
    unknown = set(args.targets) - set(TARGETS)
    if unknown:
        build_parser().error("unknown targets: %s" % ",".join(sorted(unknown)))
    if min(args.seconds, args.connections, args.body_mb, args.body_transfers) < 1 \
            or args.warmup < 0:
        build_parser().error("--seconds, --connections, --body-mb and --body-transfers "
                             "must be at least 1, --warmup 0")
    try:
        with exit_on_sigterm():
            return run_bench(args)
    except ProcessError as exc:
        print("zc-lb bench: error: %s" % exc, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
