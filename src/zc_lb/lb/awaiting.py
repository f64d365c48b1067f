"""Requests sent to workers that await the start of their response, or
the rest of it.

One watchdog greenlet, not a timer per request, looks at them every
``WATCHDOG_INTERVAL``: a response that has not started within the
``response_timeout`` fails its request (ResponseTimeout: 504; a request
whose body is still on its way counts from the body's last move, and not
while the body waits for its client: the client timeout's business); one
whose worker, free to send, sent nothing more of its body for as long
(``ResponseBody.silent_for``: not while the LB holds the worker back for
a slow client) is cut off (``ResponseBody.time_out``); and the
client of one slower than ``WATCH_CLIENT_AFTER`` is watched for a
hang-up, which cancels the request on its worker (once its upload, which
reads the same socket, is over).  A worker that falls silent has its
requests that may be retried moved elsewhere at once (``fail_silent``).
The same greenlet runs the LB's other periodic chores (``tick``).  A turn
that fails is logged with its traceback once, then at most once a minute
while it fails on (``Failing``).
"""

from __future__ import annotations

import logging
import select
import socket
import time
from typing import Any, Callable, Dict, Optional, Tuple

import gevent  # type: ignore[import-untyped]
import gevent.socket  # type: ignore[import-untyped]
from gevent.monkey import get_original  # type: ignore[import-untyped]

from zc_lb.errors import (BadResponse, ClientGone, RequestCancelled, ResponseTimeout,
                          WorkerSilent)
from zc_lb.lb.bodies import InFlight, Upload
from zc_lb.wire.connection import Connection
from zc_lb.wire.exchange import Exchange
from zc_lb.wire.frames import Response

log = logging.getLogger(__name__)

WATCH_CLIENT_AFTER = 1.0  # seconds without a response before watching for a hang-up
WATCHDOG_INTERVAL = 0.25
SAY_FAILURES_EVERY = 60.0  # seconds: a turn that fails on and on is said at most this often

_Waiting = Tuple[float, Any, Optional[Upload], bool]
"""A request waiting for its response to start: when it was sent, its
client's socket (None: not watched), its upload if it has a body, and
whether it may be retried (a GET or HEAD without a body).  A tuple: an
object of a class of its own cost a call of its ``__init__`` on every
request."""


class Awaiting:
    """The requests awaiting their responses, and their watchdog."""

    def __init__(self, response_timeout: Optional[float],
                 tick: Callable[[float], None], flight: Optional[InFlight] = None) -> None:
        self.response_timeout = response_timeout
        self.tick = tick  # called with the time at every look
        self.flight = flight  # (its ``streaming`` bodies are watched too)
        self.waiting: Dict[Exchange, _Waiting] = {}
        # Of those, the ones whose client is watched for a hang-up (``_watch``).
        self.watchers: Dict[Exchange, gevent.Greenlet] = {}
        self.watchdog: Optional[gevent.Greenlet] = None
        self.chores_failing = Failing("the LB's chores")
        self.turns_failing = Failing("the response watchdog")

    def receive(self, exchange: Exchange, upload: Optional[Upload], sock: Any,
                retryable: bool, sent: float) -> Response:
        """The response's start, from the worker (the request ``sent`` then,
        by ``time.monotonic``)."""
        waiting = self.waiting
        waiting[exchange] = (sent, sock, upload, retryable)
        if self.watchdog is None:
            self.start()
        try:
            response = exchange.receive()
        except RequestCancelled:
            failure = upload.failure() if upload is not None else None
            if failure is not None:
                raise failure
            raise
        finally:
            waiting.pop(exchange, None)
            if self.watchers:
                watcher = self.watchers.pop(exchange, None)
                if watcher is not None:
                    watcher.kill(block=False)
        if not isinstance(response, Response):
            raise BadResponse("worker sent %s before a response" % type(response).__name__)
        if exchange.error is not None and not response.end:
            # (failed in the loop turn in which its head came: the rest of it will
            # not come, so one outcome, not a head and half a body)
            raise exchange.error
        return response

    def fail_silent(self, connection: Connection, seconds: float) -> int:
        """A worker fell silent: its GETs and HEADs that have no answer yet
        move to other workers now; how many."""
        moved = 0
        for exchange, entry in list(self.waiting.items()):
            # (retryable, and not answered in the loop turn its owner has yet to run)
            if exchange.connection is connection and entry[3] and not exchange.inbox:
                exchange.fail(WorkerSilent("%s silent for %.1fs" % (connection.peer, seconds)))
                moved += 1
        return moved

    def start(self) -> None:
        """Start the watchdog, and with it the LB's chores, unless it runs:
        at the first request awaiting a response, or sooner if a chore is
        due (an ejection to end)."""
        if self.watchdog is None:
            self.watchdog = gevent.spawn(self._watch_slow_responses)

    def stop(self) -> None:
        if self.watchdog is not None:
            self.watchdog.kill(block=False)

    def _watch_slow_responses(self) -> None:
        while True:
            gevent.sleep(WATCHDOG_INTERVAL)
            now = time.monotonic()
            try:
                self._look(now)
            except Exception as exc:  # (a bug here must not end the timeouts for good)
                self.turns_failing.failed(now, exc)
            else:
                self.turns_failing.worked()

    def _look(self, now: float) -> None:
        """One turn of the watchdog: the LB's chores, then the requests
        (whatever became of the chores)."""
        try:
            self.tick(now)
        except Exception as exc:  # (a chore that fails every turn must not stop the timeouts)
            self.chores_failing.failed(now, exc)
        else:
            self.chores_failing.worked()
        timeout = self.response_timeout
        for exchange, (started, sock, upload, _) in list(self.waiting.items()):
            if exchange.inbox:  # (its response came: its owner has yet to run)
                continue
            # (a body on its way counts from its last move: the client's pace is not
            # the worker's, but a worker that takes none of it is as one that answers none;
            # a client that stops sending it is the client timeout's, and no failure of
            # the worker's: it was 504 and counted toward the worker's ejection)
            if upload is not None and upload.reading:
                continue
            age = now - (started if upload is None else max(started, upload.moved))
            if timeout is not None and age > timeout:
                exchange.fail(ResponseTimeout("no response within %gs" % timeout))
            elif age > WATCH_CLIENT_AFTER and exchange not in self.watchers:
                self._watch(exchange, sock, upload)
        if timeout is not None and self.flight is not None and self.flight.streaming:
            self._look_at_bodies(now, timeout, self.flight)

    def _look_at_bodies(self, now: float, timeout: float, flight: InFlight) -> None:
        """Cut off the responses whose worker fell silent mid-body."""
        for body in list(flight.streaming):
            if body.silent_for(now) > timeout:
                body.time_out(timeout)

    def _watch(self, exchange: Exchange, sock: Any, upload: Optional[Upload]) -> None:
        """Cancel the exchange if the client hangs up (once the upload,
        which reads the same socket, is over)."""
        if sock is not None and (upload is None or upload.done):
            self.watchers[exchange] = gevent.spawn(watch_client, sock, exchange)


class Failing:
    """What a turn of the watchdog that keeps failing says: its first
    failure, with the traceback; then, while it fails on, at most one line
    every SAY_FAILURES_EVERY seconds saying how many turns failed since
    (and the latest error); and that it works again.  Not a traceback
    four times a second for as long as a bug lasts."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.turns = 0  # failed in a row
        self.unsaid = 0  # of those, failed since the last line said
        self.said = 0.0  # when that line was said

    def failed(self, now: float, error: Exception) -> None:
        """A turn failed with ``error`` (call it from the ``except`` that
        caught it: the first is logged with its traceback)."""
        self.turns += 1
        if self.turns == 1:
            log.exception("%s failed a turn", self.what)
            self.said = now
        elif now - self.said >= SAY_FAILURES_EVERY:
            log.error("%s failed %d more turns in %.0fs (%d in a row), the latest with "
                      "%s: %s", self.what, self.unsaid + 1, now - self.said, self.turns,
                      type(error).__name__, error)
            self.said, self.unsaid = now, 0
        else:
            self.unsaid += 1

    def worked(self) -> None:
        """A turn worked: if turns failed before it, say they are over."""
        if self.turns:
            log.warning("%s ran again, after %d failed turns", self.what, self.turns)
            self.turns = self.unsaid = 0


def watch_client(sock: Any, exchange: Exchange) -> None:
    """Cancel ``exchange`` if the client closes its connection."""
    # (the socket under TLS too: an SSL socket takes no flags, and the end of
    # the connection shows there; a TLS record that came is not taken for one)
    raw = getattr(sock, "_sock", sock)
    try:
        gevent.socket.wait_read(sock.fileno())
        if raw.recv(1, socket.MSG_PEEK):
            # Bytes came: a pipelined request, or under TLS the close_notify
            # a client sends as it closes.  The end behind them shows only
            # to a poll for the peer's hang-up (POLLRDHUP).
            _wait_hang_up(raw.fileno())
    except OSError:
        pass
    exchange.cancel(ClientGone("client went away while the worker worked"))


_poll = get_original("select", "poll")  # (the real one, even where an application patched it)


def _wait_hang_up(fd: int) -> None:
    """Return once the peer of socket ``fd`` has closed its end (or the
    socket failed), looking every ``WATCHDOG_INTERVAL``."""
    poller = _poll()
    poller.register(fd, select.POLLRDHUP)
    while not poller.poll(0):
        gevent.sleep(WATCHDOG_INTERVAL)
