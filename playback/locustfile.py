"""The access-log replay under Locust.

    locust -f playback/locustfile.py --host http://127.0.0.1:8080 \\
        --log-file access.log --host-from-segment 1            # web UI
    locust -f playback/locustfile.py --headless -u 16 -r 16 -t 60s \\
        --host http://127.0.0.1:8080 --log-file access.log --host-header example.com

The users take the log's entries in order, one after the other, from one
shared position (so N users replay the log once, N requests at a time, as
``replay.py -c N`` does), without waiting between requests. When the log
is exhausted the test stops, unless ``--log-loop``. Requests are named by
their class (the Host sent), so Locust's table is the per-class report.
Responses of the cache-model app are summed, and the database loads per
request are logged when the test stops.

Options (also settable in the web UI): ``--log-file`` (comma-separated
for several), ``--log-format``, ``--log-regex``, ``--log-methods``,
``--host-header``, ``--host-from-segment``, ``--host-suffix``,
``--host-depth``, ``--log-loop``. In distributed mode every worker process replays the
whole log.

Locust's fast client does not set TCP_NODELAY; this file makes its
connection pool set it on every socket (the hook geventhttpclient offers
for socket options), else delayed ACKs add 40 ms stalls.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from typing import Iterator, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gevent  # noqa: E402
import geventhttpclient.connectionpool  # noqa: E402
from locust import FastHttpUser, constant, events, task  # noqa: E402
from locust.exception import StopUser  # noqa: E402

try:  # installed (pip install zc-lb[playback])
    from zc_lb.playback.logparse import (DEFAULT_HOST_SUFFIX, FORMATS, Entry,  # noqa: E402
                                         LogReader, host_depth_error, positive_int)
except ImportError:  # a checkout: the path above
    from playback.logparse import (DEFAULT_HOST_SUFFIX, FORMATS, Entry,  # noqa: E402
                                   LogReader, host_depth_error, positive_int)

log = logging.getLogger("playback.locustfile")


def _create_tcp_socket(self, family, socktype, protocol):
    sock = geventhttpclient.connectionpool.gevent.socket.socket(family, socktype, protocol)
    if family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


geventhttpclient.connectionpool.ConnectionPool._create_tcp_socket = _create_tcp_socket  # type: ignore[method-assign]


class _Feed:
    """The shared position in the log, and the cache-model sums."""

    def __init__(self) -> None:
        self.reader: Optional[LogReader] = None
        self.iterator: Optional[Iterator[Entry]] = None
        self.loop = False
        self.stopping = False
        self.responses = self.hits = self.misses = 0

    def start(self, options) -> None:
        paths = [p for p in (options.log_file or "").split(",") if p]
        if not paths:
            raise SystemExit("locustfile: --log-file is required")
        error = host_depth_error(options)  # (refused as compare and replay refuse it)
        if error is not None:
            raise SystemExit("locustfile: " + error)
        self.reader = LogReader(
            paths, fmt=options.log_format, regex=options.log_regex or None,
            methods=[m for m in options.log_methods.split(",") if m],
            host=options.host_header or None, segment=options.host_from_segment or None,
            host_suffix=options.host_suffix, depth=options.host_depth)
        self.iterator = iter(self.reader)
        self.stopping = False
        self.loop = options.log_loop
        self.responses = self.hits = self.misses = 0

    def next(self):
        """The next entry, or None when the log is done."""
        if self.iterator is None:
            return None
        for _ in range(2):
            entry = next(self.iterator, None)
            if entry is not None:
                return entry
            if not self.loop or not self.reader.stats.entries:
                break
            self.iterator = iter(self.reader)
        self.iterator = None
        return None

    def count(self, headers) -> None:
        misses = headers.get("X-Cache-Misses")
        if misses is not None:
            self.responses += 1
            self.hits += int(headers.get("X-Cache-Hits") or 0)
            self.misses += int(misses)

    def summary(self) -> str:
        stats = self.reader.stats if self.reader else None
        text = "log: %s lines, %s entries, %s unparsable" % (
            getattr(stats, "lines", 0), getattr(stats, "entries", 0), getattr(stats, "unparsable", 0))
        if stats is not None and stats.examples:
            text += "; e.g. " + stats.examples[0]
        if self.responses:
            text += "; cache: %.3f database loads/request (%d hits, %d misses, %d responses)" % (
                self.misses / self.responses, self.hits, self.misses, self.responses)
        return text


feed = _Feed()


@events.init_command_line_parser.add_listener
def _add_options(parser):
    parser.add_argument("--log-file", default="", help="access log(s) to replay, comma-separated")
    parser.add_argument("--log-format", default="auto", choices=sorted(FORMATS), help="log format")
    parser.add_argument("--log-regex", default="", help="custom log regular expression")
    parser.add_argument("--log-methods", default="GET,HEAD", help="methods to replay")
    parser.add_argument("--host-header", default="", help="send this Host with every request")
    parser.add_argument("--host-from-segment", type=int, default=0,
                        help="Host = path segment N + --host-suffix (0: off)")
    parser.add_argument("--host-suffix", default=DEFAULT_HOST_SUFFIX, help="see --host-from-segment")
    parser.add_argument("--host-depth", type=positive_int, default=1,
                        help="with --host-from-segment: Host = the section this many "
                        "directories deep")
    parser.add_argument("--log-loop", action="store_true", default=False,
                        help="start the log again when it ends")


@events.test_start.add_listener
def _on_test_start(environment, **kwargs):
    if environment.parsed_options is not None and not _is_master(environment):
        feed.start(environment.parsed_options)


@events.test_stop.add_listener
def _on_test_stop(environment, **kwargs):
    if not _is_master(environment):
        log.info(feed.summary())


def _is_master(environment) -> bool:
    return type(environment.runner).__name__ == "MasterRunner"


class LogReplayUser(FastHttpUser):
    """Sends the log's next entry, again and again, with no think time."""

    wait_time = constant(0)

    @task
    def replay_next(self):
        entry = feed.next()
        if entry is None:
            runner = self.environment.runner
            if runner is not None and feed.reader is not None and not feed.stopping:
                feed.stopping = True
                log.info("log replayed: stopping")
                # Headless: end the run. Web UI: stop, and keep the UI up.
                # Not from this user's greenlet, which stopping kills.
                gevent.spawn(runner.stop if self.environment.web_ui else runner.quit)
            if runner is not None:
                gevent.sleep(60)  # until quit stops this user: a user that ends alone upsets it
            raise StopUser()
        headers = {"Host": entry.host} if entry.host else None
        name = entry.host or "(target host)"
        try:
            with self.client.request(entry.method, entry.path, headers=headers, name=name,
                                     catch_response=True) as response:
                feed.count(response.headers or {})
                if response.status_code and response.status_code < 500:
                    response.success()  # a 404 the log recorded is a faithful replay
        except ValueError as exc:  # a target Locust's client refuses, e.g. '//favicon.ico'
            self.environment.events.request.fire(
                request_type=entry.method, name=name, response_time=0, response_length=0,
                response=None, context={}, exception=exc)
