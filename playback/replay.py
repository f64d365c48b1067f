"""Replay access logs against a live URL and report what happened.

Usage (from the repository root)::

    python playback/replay.py LOG... --target http://127.0.0.1:8080 [options]

Library use (what compare.py calls)::

    from zc_lb.playback.logparse import read_entries   # playback.logparse in a checkout
    from zc_lb.playback.replay import replay
    entries, parse_stats = read_entries(["access.log"], segment=1)
    report = replay(entries, "http://127.0.0.1:8080", concurrency=16,
                    max_requests=2000, parse_stats=parse_stats,
                    stats_urls=["http://127.0.0.1:9001/_cacheapp/stats"])

Theory of operation
-------------------

One dispatcher (the calling greenlet) walks the entries and puts them on a
queue of size C; C client greenlets, each with its own keep-alive
connection, take them and send them. As fast as possible (no ``speed``),
the clients are the only limit: a closed loop of C users. Paced (``speed``
given), the dispatcher waits until each entry is due (``pacing.Pacer``)
before queueing it; when all C clients are busy the entry leaves late, and
the lag is recorded rather than hidden. The dispatcher stops after
``max_requests`` entries, at ``max_seconds`` or when the log ends; then
the requests in flight finish (each within ``timeout``). Every failure of
a request is counted in the report by kind; nothing stops the replay but
the bounds.

Against several targets (several balancers of one site), client n sends
to target n modulo their number, and the entries still go to whichever
client is free: a balancer that answers faster is sent more.

The request class is the Host sent: the entry's host, else the target's.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and not __package__:  # run as playback/replay.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import playback  # noqa: F401  (the package of the relative imports below)
    __package__ = "playback"

import argparse
import re
import time
from typing import Iterable, List, Optional, Sequence, Tuple, Union

import gevent
import gevent.queue
import gevent.ssl

from . import cacheapp
from .httpclient import Connection, HTTPError, get_json, parse_url
from .logparse import (DEFAULT_HOST_SUFFIX, FORMATS, Entry, LogReader, ParseStats,
                       check_host_depth, positive_int, positive_number)
from .pacing import Pacer
from .report import Recorder, format_text, to_json

_STOP = object()


class Replay:
    """One replay of entries against a target; ``run()`` returns the report dict."""

    def __init__(self, entries: Iterable[Entry], target: Union[str, Sequence[str]],
                 concurrency: int = 10,
                 speed: Optional[float] = None, tolerance: float = 60.0,
                 max_gap: Optional[float] = None, max_requests: Optional[int] = None,
                 max_seconds: Optional[float] = None, timeout: float = 30.0, top: int = 10,
                 progress=None, insecure: bool = False):
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.entries = entries
        targets = [target] if isinstance(target, str) else list(target)
        if not targets:
            raise ValueError("no target to replay against")
        self.target = ",".join(targets)
        self.targets = [parse_url(url) for url in targets]  # (scheme, host, port, prefix)
        self.concurrency = concurrency
        self.pacer = Pacer(speed, tolerance, max_gap) if speed else None
        self.max_requests = max_requests
        self.max_seconds = max_seconds
        self.timeout = timeout
        self.top = top
        self.progress = progress  # a text stream to draw a progress bar on, or None
        self.ssl_context = None
        if any(scheme == "https" for scheme, _, _, _ in self.targets):
            self.ssl_context = gevent.ssl.create_default_context()
            if insecure:
                self.ssl_context.check_hostname = False
                self.ssl_context.verify_mode = gevent.ssl.CERT_NONE
        self.recorder = Recorder()
        self.start = 0.0
        self.deadline = float("inf")

    def __repr__(self) -> str:
        return "<Replay %s x%d %r>" % (self.target, self.concurrency, self.recorder)

    def run(self) -> dict:
        """Replay until a bound or the end of the entries; the report dict."""
        queue = gevent.queue.Queue(maxsize=self.concurrency)
        self.start = time.perf_counter()
        if self.max_seconds is not None:
            self.deadline = self.start + self.max_seconds
        clients = [gevent.spawn(self._client, queue, self.targets[n % len(self.targets)])
                   for n in range(self.concurrency)]
        bar = gevent.spawn(self._progress) if self.progress is not None else None
        interrupted = False
        try:
            self._dispatch(queue)
            for _ in clients:
                queue.put(_STOP)
            gevent.joinall(clients, timeout=self.timeout + 5.0)
        except KeyboardInterrupt:  # Ctrl-C: stop now, and report what was done
            interrupted = True
        finally:
            gevent.killall(clients)
            if bar is not None:
                bar.kill()
                self.progress.write("\r\x1b[K")
                self.progress.flush()
        duration = time.perf_counter() - self.start
        return self.recorder.report(duration, self.top, interrupted=interrupted, **self._settings())

    def _settings(self) -> dict:
        settings: dict = {"target": self.target, "mode": "paced" if self.pacer else "fast",
                    "concurrency": self.concurrency, "max_requests": self.max_requests,
                    "max_seconds": self.max_seconds}
        if self.pacer is not None:
            settings["pacing"] = dict(self.pacer.as_dict(), late=self.recorder.late,
                                      max_lag=self.recorder.max_lag)
        return settings

    def _dispatch(self, queue: gevent.queue.Queue) -> None:
        if self.max_requests is not None and self.max_requests <= 0:
            return
        count = 0
        for entry in self.entries:
            due = None
            if self.pacer is not None:
                due = self.start + self.pacer.offset(entry.time)
                if due >= self.deadline:
                    return
                delay = due - time.perf_counter()
                if delay > 0:
                    gevent.sleep(delay)
            try:
                queue.put((entry, due), timeout=self._remaining())
            except gevent.queue.Full:
                return  # the deadline passed while every client was busy
            count += 1
            if count == self.max_requests or time.perf_counter() >= self.deadline:
                return

    def _remaining(self) -> Optional[float]:
        if self.deadline == float("inf"):
            return None
        return max(0.0, self.deadline - time.perf_counter())

    def _client(self, queue: gevent.queue.Queue, target: Tuple[str, str, int, str]) -> None:
        """Send what the queue holds to ``target``, on one keep-alive connection."""
        scheme, address, port, prefix = target
        default_port = 443 if scheme == "https" else 80
        default_host = address if port == default_port else "%s:%d" % (address, port)
        conn = Connection(address, port, self.timeout,
                          self.ssl_context if scheme == "https" else None)
        recorder = self.recorder
        clock = time.perf_counter
        try:
            while True:
                item = queue.get()
                if item is _STOP:
                    return
                entry, due = item
                now = clock()
                if now >= self.deadline:
                    continue
                if due is not None:
                    recorder.record_lag(now - due)
                host = entry.host or default_host
                recorder.sent += 1
                try:
                    response = conn.request(entry.method, prefix + entry.path, host)
                except HTTPError as exc:
                    recorder.record_error(host, exc.kind, "%s %s (%s): %s" % (
                        entry.method, entry.path[:80], entry.source, exc))
                except Exception as exc:  # a bad entry must not stop the replay
                    conn.close()
                    recorder.record_error(host, "client", "%s %s (%s): %r" % (
                        entry.method, entry.path[:80], entry.source, exc))
                else:
                    recorder.record(host, clock() - now, response.status, response.headers)
        finally:
            conn.close()

    def _progress(self) -> None:
        while True:
            self.progress.write("\r\x1b[K" + self.progress_line())
            self.progress.flush()
            gevent.sleep(0.25)

    def progress_line(self) -> str:
        """One line: a bar when a bound is known, counts and rate."""
        rec = self.recorder
        elapsed = time.perf_counter() - self.start
        fractions = []
        if self.max_requests:
            fractions.append(rec.sent / self.max_requests)
        if self.max_seconds:
            fractions.append(elapsed / self.max_seconds)
        bar = ""
        if fractions:
            done = min(1.0, max(fractions))
            filled = int(done * 30)
            bar = "[%s%s] %3d%% " % ("#" * filled, "." * (30 - filled), done * 100)
        errors = sum(rec.errors.values())
        rate = rec.responses / elapsed if elapsed > 0 else 0.0
        return "%s%d sent %d ok %d err %.0f req/s %.1fs" % (
            bar, rec.sent, rec.responses, errors, rate, elapsed)


def replay(entries: Iterable[Entry], target: Union[str, Sequence[str]],
           parse_stats: Optional[ParseStats] = None, stats_urls: Sequence[str] = (),
           **options) -> dict:
    """Replay ``entries`` against ``target``; the report as a dict.

    ``target`` is a URL, or several: the clients take turns between them
    (client n sends to URL n modulo their number), as a site's users are
    spread over several balancers.

    ``options`` are Replay's: concurrency, speed (None: as fast as
    possible), tolerance, max_gap, max_requests, max_seconds, timeout, top,
    progress (a stream or None), insecure. ``parse_stats`` (from
    ``read_entries`` or a LogReader) goes into the report as ``parse``;
    ``stats_urls`` (cacheapp stats URLs, one per worker) are read after the
    replay into ``overlap``.
    """
    report = Replay(entries, target, **options).run()
    if parse_stats is not None:
        report["parse"] = parse_stats.as_dict()
    if stats_urls:
        report["overlap"] = cache_overlap(stats_urls)
    return report


def cache_overlap(sources: Sequence[Union[str, dict]], timeout: float = 10.0) -> dict:
    """Overlap of cached objects between workers, from stats URLs or stats dicts.

    Unreachable URLs are listed under ``errors`` and left out of the sums.
    """
    docs: List[dict] = []
    errors: List[str] = []
    for source in sources:
        if isinstance(source, dict):
            docs.append(source)
            continue
        try:
            docs.append(get_json(source, timeout))
        except (HTTPError, ValueError) as exc:
            errors.append("%s: %s" % (source, exc))
    result = cacheapp.overlap(docs)
    result["per_worker"] = {d.get("worker", "?"): {"requests": d.get("requests"), "hits": d.get("hits"),
                                                   "misses": d.get("misses"),
                                                   "cached": len(d.get("objects", ()))}
                            for d in docs}
    result["errors"] = errors
    return result


def reset_caches(stats_urls: Sequence[str], timeout: float = 10.0) -> List[str]:
    """Empty the caches of the workers behind these stats URLs; errors as text."""
    errors = []
    for url in stats_urls:
        reset = url.replace(cacheapp.STATS_PATH, cacheapp.RESET_PATH)
        scheme, host, port, _ = parse_url(reset)
        conn = Connection(host, port, timeout)
        try:
            target = reset.split("://", 1)[1]
            target = target[target.find("/"):] if "/" in target else "/"
            response = conn.request("GET", target, host)
            if response.status != 200:
                errors.append("%s: status %d" % (reset, response.status))
        except HTTPError as exc:
            errors.append("%s: %s" % (reset, exc))
        finally:
            conn.close()
    return errors


# -- command line ------------------------------------------------------------


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zc-lb replay", description="Replay access logs against a live URL.")
    parser.add_argument("logs", nargs="+", metavar="LOG", help="log files ('-': stdin, .gz ok)")
    parser.add_argument("--target", required=True, action="append", metavar="URL",
                        help="base URL, e.g. http://127.0.0.1:8080; repeat for a site's "
                        "several balancers, which the clients then take turns between")
    log = parser.add_argument_group("log")
    log.add_argument("--format", default="auto", choices=sorted(FORMATS),
                     help="log format (default: auto, any of them line by line)")
    log.add_argument("--regex", help="custom regular expression with groups request or "
                     "path [method]; optional time, host, status")
    log.add_argument("--time-format", help="strptime format of the time group "
                     "(default: CLF, ISO 8601 or Unix seconds)")
    log.add_argument("--methods", default="GET,HEAD",
                     help="methods to replay, comma-separated (default %(default)s)")
    host = log.add_mutually_exclusive_group()
    host.add_argument("--host", help="send this Host with every request")
    host.add_argument("--host-from-segment", type=positive_int, metavar="N",
                      help="Host = path segment N (1-based) + --host-suffix")
    log.add_argument("--host-suffix", default=DEFAULT_HOST_SUFFIX,
                     help="suffix for --host-from-segment (default %(default)s)")
    log.add_argument("--host-depth", type=positive_int, default=1, metavar="D",
                     help="with --host-from-segment: Host = the section D directories deep "
                     "(segment N and the directories after it, joined by '-'; default "
                     "%(default)s)")
    run = parser.add_argument_group("replay")
    run.add_argument("-c", "--concurrency", type=positive_int, default=10,
                     help="concurrent clients (default %(default)s)")
    run.add_argument("--speed", type=positive_number,
                     help="paced mode: follow the log's timestamps, this many times faster; "
                     "without it, as fast as possible")
    run.add_argument("--tolerance", type=float, default=60.0,
                     help="paced: timestamps up to this many seconds back are sent at once "
                     "(default %(default)s)")
    run.add_argument("--max-gap", type=float,
                     help="paced: wait at most this many log seconds between entries")
    run.add_argument("-n", "--max-requests", type=int, help="stop after this many requests")
    run.add_argument("-t", "--max-seconds", type=float, help="stop sending after this many seconds")
    run.add_argument("--timeout", type=float, default=30.0,
                     help="seconds per request (default %(default)s)")
    run.add_argument("--insecure", action="store_true", help="https: do not verify certificates")
    out = parser.add_argument_group("report")
    out.add_argument("--json", nargs="?", const="-", metavar="FILE",
                     help="write the report as JSON (to FILE, or stdout instead of text)")
    out.add_argument("--top", type=int, default=10, help="classes to list (default %(default)s)")
    out.add_argument("--stats-url", action="append", default=[], metavar="URL",
                     help="a cacheapp worker's stats URL, for overlap; repeat per worker")
    out.add_argument("--reset-caches", action="store_true",
                     help="empty the caches behind --stats-url before replaying")
    out.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                     help="progress bar on stderr (default: when stderr is a terminal)")
    return parser


def main(argv=None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    check_host_depth(parser, args)
    try:
        reader = LogReader(args.logs, fmt=args.format, regex=args.regex,
                           time_format=args.time_format,
                           methods=[m.strip() for m in args.methods.split(",") if m.strip()],
                           host=args.host, segment=args.host_from_segment,
                           host_suffix=args.host_suffix, depth=args.host_depth)
        for target in args.target:  # a bad URL is refused before the log is read
            parse_url(target)
    except (ValueError, OSError, re.error) as exc:  # (re.error: a bad --regex)
        print("replay.py: %s" % exc, file=sys.stderr)
        return 2
    progress = args.progress if args.progress is not None else sys.stderr.isatty()
    if args.reset_caches:
        for error in reset_caches(args.stats_url):
            print("replay.py: reset: %s" % error, file=sys.stderr)
    try:
        report = replay(
            reader, args.target, stats_urls=args.stats_url, concurrency=args.concurrency,
            speed=args.speed, tolerance=args.tolerance, max_gap=args.max_gap,
            max_requests=args.max_requests, max_seconds=args.max_seconds,
            timeout=args.timeout, top=args.top, insecure=args.insecure,
            progress=sys.stderr if progress else None)
    except OSError as exc:  # a log that cannot be read
        print("replay.py: %s" % exc, file=sys.stderr)
        return 2
    report["parse"] = reader.stats.as_dict()
    if args.json is None:
        print(format_text(report))
    elif args.json == "-":
        print(to_json(report))
    else:
        with open(args.json, "w") as stream:
            stream.write(to_json(report) + "\n")
        print(format_text(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
