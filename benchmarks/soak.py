"""``make soak``: hours of traffic in minutes, watching for leaks.

Method: an LB and two workers on 127.0.0.1 (the workers in their default
thread mode, serving ``soak_app``); a short unpaced burst measures what
they can do; then the soak holds half of that for ``--duration`` seconds
(default 600) with a mix of requests: keep-alive GETs, GETs on a new
connection each (``Connection: close``) and keep-alive POSTs with a
body, spread over a few classes and many paths.  Every ``--every``
seconds (30) it samples the LB's and each worker's resident memory and
open file descriptors from /proc, and prints them as a series.  At the
end it says whether they stayed flat: less than 5% growth from the first
sample after warm-up (a minute, or a fifth of the run) to the last, for
memory; for descriptors, at most a few more than then.  A run with no
sample after that first one is "too short to tell", not flat.

The client is this process, gevent and raw sockets, paced by a token
clock; it counts answers by status and errors (no answer, a bad one).

Weak spots: the client shares the machine's two cores with what it
measures, so "capacity" is the whole machine's; RSS grows with Python's
allocator arenas before it levels, which is why the warm-up is skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import random
import sys
import time
from typing import Dict, Iterator, List, Tuple

from zc_lb.testing import ProcessError

from .bench import exit_on_sigterm, has_ended, read_response, rss_kb, running

FLAT = 0.05  # memory may grow this much after warm-up and still be flat
FD_SLACK = 8  # descriptors a busy process may hold more at one moment
BODY = b"x" * 4096


def soak_app(environ, start_response):
    """Reads the body, answers its length and the path."""
    length = 0
    read = environ["wsgi.input"].read
    while True:
        data = read(65536)
        if not data:
            break
        length += len(data)
    body = ("%s %d\n" % (environ.get("PATH_INFO"), length)).encode()
    start_response("200 OK", [("Content-Type", "text/plain"),
                              ("Content-Length", str(len(body)))])
    return [body]


# -- the client ---------------------------------------------------------------


class Client:
    """Closed-loop greenlets sending the mix, optionally paced."""

    def __init__(self, address: Tuple[str, int], seed: int = 1) -> None:
        self.address = address
        self.rng = random.Random(seed)
        self.counts: Dict[str, int] = {}
        self.done = 0

    def _count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def run(self, seconds: float, connections: int, rate: float = 0.0) -> float:
        """Send for ``seconds``; requests per second achieved."""
        import gevent

        deadline = time.monotonic() + seconds
        ticket = itertools.count()
        start = time.monotonic()
        before = self.done

        def loop() -> None:
            sock = None
            while time.monotonic() < deadline:
                if rate:  # the n-th request may go at start + n / rate
                    due = start + next(ticket) / rate
                    if due > time.monotonic():
                        gevent.sleep(due - time.monotonic())
                sock = self._one(sock)
        gevent.joinall([gevent.spawn(loop) for _ in range(connections)],
                       timeout=seconds + 30)
        return (self.done - before) / (time.monotonic() - start)

    def _one(self, sock):
        """One request of the mix on ``sock`` (or a new one); the socket
        to use next, or None."""
        import gevent.socket

        kind = self.rng.random()
        path = "/p%d" % self.rng.randrange(500)
        host = "c%d.example" % self.rng.randrange(8)
        close = kind < 0.2
        head = ("%s %s HTTP/1.1\r\nHost: %s\r\n" % ("POST" if kind > 0.8 else "GET", path, host))
        body = b""
        if kind > 0.8:
            head += "Content-Length: %d\r\n" % len(BODY)
            body = BODY
        if close:
            head += "Connection: close\r\n"
        try:
            if sock is None or close:
                if sock is not None:
                    sock.close()
                sock = gevent.socket.create_connection(self.address, timeout=30)
                sock.setsockopt(gevent.socket.IPPROTO_TCP, gevent.socket.TCP_NODELAY, 1)
            sock.sendall(head.encode() + b"\r\n" + body)
            status = read_response(sock)
            self._count(status)
            self.done += 1
        except (OSError, ValueError) as exc:
            self._count("error: %s" % type(exc).__name__)
            if sock is not None:
                sock.close()
            return None
        if close:
            sock.close()
            return None
        return sock


# -- watching the processes ---------------------------------------------------


def sample(pid: int) -> Tuple[int, int]:
    """(RSS in KiB, open file descriptors) of ``pid``; ProcessError if it
    has ended (a child of ours not yet reaped reads as 0 and 0, which
    would pass for memory given back)."""
    if not has_ended(pid):
        with contextlib.suppress(OSError):  # (unless it ends now)
            return rss_kb(pid), len(os.listdir("/proc/%d/fd" % pid))
    raise ProcessError("pid %d has ended" % pid)


TOO_SHORT = "too short to tell"


def verdict(series: List[Tuple[int, int]], warm: int) -> str:
    """"flat", "growing ..." or TOO_SHORT for one process's samples after ``warm``."""
    if len(series) <= warm + 1:
        return TOO_SHORT
    (rss0, fd0), (rss1, fd1) = series[warm], series[-1]
    growth = (rss1 - rss0) / rss0
    if growth < FLAT and fd1 <= fd0 + FD_SLACK:
        return "flat (RSS %+.1f%%, fds %+d)" % (100 * growth, fd1 - fd0)
    return "GROWING (RSS %+.1f%%, fds %+d)" % (100 * growth, fd1 - fd0)


def summary(verdicts: Dict[str, str], counts: Dict[str, int]) -> Tuple[str, int]:
    """The last line and the exit status, from each process's verdict and
    the answers by status: 0 only where every process was judged flat
    and every answer was a 2xx."""
    bad = [name for name, said in verdicts.items() if said.startswith("GROWING")]
    short = any(said == TOO_SHORT for said in verdicts.values())
    errors = sum(n for kind, n in counts.items() if not kind.startswith("2"))
    state = "growing: " + ", ".join(bad) if bad else TOO_SHORT if short else "flat"
    return ("verdict: %s; %d answers not 2xx" % (state, errors),
            1 if bad or short or errors else 0)


@contextlib.contextmanager
def deployment() -> Iterator[Tuple[Tuple[str, int], Dict[str, int]]]:
    """An LB and two workers; (LB address, {name: pid})."""
    zc_lb = [sys.executable, "-m", "zc_lb.cli", "--log-level", "WARNING"]
    with contextlib.ExitStack() as stack:
        workers = [stack.enter_context(running(
            zc_lb + ["worker", "benchmarks.soak:soak_app"], "zc-lb worker listening on "))
            for _ in range(2)]
        argv = zc_lb + ["lb", "--listen", "127.0.0.1:0"]
        for _, address in workers:
            argv += ["--worker", address]
        lb, address = stack.enter_context(running(argv, "zc-lb lb listening on "))
        host, _, port = address.rpartition(":")
        pids = {"lb": lb.pid}
        pids.update(("worker%d" % i, w.pid) for i, (w, _) in enumerate(workers, 1))
        time.sleep(0.5)  # the LB connects to its workers
        yield (host, int(port)), pids


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds (default 600)")
    parser.add_argument("--every", type=float, default=30.0, help="seconds between samples")
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--share", type=float, default=0.5, help="of capacity (default 0.5)")
    args = parser.parse_args(argv)
    if min(args.duration, args.every, args.share) <= 0 or args.connections < 1:
        parser.error("--duration, --every and --share must be over 0, --connections at least 1")

    with exit_on_sigterm(), deployment() as (address, pids):
        client = Client(address)
        capacity = client.run(min(5.0, args.duration / 4), args.connections)
        if not capacity:  # (a rate of 0 would soak unpaced)
            print("zc-lb soak: error: no request answered in the capacity run (%s)" % ", ".join(
                "%s %d" % kv for kv in sorted(client.counts.items())), file=sys.stderr)
            return 1
        rate = capacity * args.share
        print("capacity %.0f req/s; soaking at %.0f req/s for %gs, sampling every %gs"
              % (capacity, rate, args.duration, args.every), flush=True)
        names = sorted(pids)
        print("%8s  %s" % ("t (s)", "  ".join("%-18s" % ("%s RSS KiB/fds" % n) for n in names)))
        series: Dict[str, List[Tuple[int, int]]] = {n: [] for n in names}
        started = time.monotonic()
        client.counts.clear()
        while time.monotonic() - started < args.duration:
            left = args.duration - (time.monotonic() - started)
            client.run(min(args.every, left), args.connections, rate)
            row = []
            for name in names:
                try:
                    rss, fds = sample(pids[name])
                except ProcessError:
                    print("zc-lb soak: error: %s (pid %d) ended during the soak" % (
                        name, pids[name]), file=sys.stderr)
                    return 1
                series[name].append((rss, fds))
                row.append("%-18s" % ("%d/%d" % (rss, fds)))
            print("%8.0f  %s" % (time.monotonic() - started, "  ".join(row)), flush=True)
        warm = max(1, int(min(60.0, args.duration / 5) // args.every))
        print("answers: %s" % ", ".join("%s %d" % kv for kv in sorted(client.counts.items())))
        verdicts = {name: verdict(series[name], min(warm, len(series[name]) - 1))
                    for name in names}
        for name in names:
            print("%s: %s" % (name, verdicts[name]))
        line, status = summary(verdicts, client.counts)
        print(line)
        return status


if __name__ == "__main__":
    sys.exit(main())
