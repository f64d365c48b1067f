"""The bodies a forwarded request moves, and the tally a drain waits on.

``hold_body`` reads a request body from its client before the request
goes to a worker, up to ``--buffer-request`` bytes, into a spool (as
nginx buffers request bodies): a client trickling its upload holds an
LB greenlet, not a worker thread.  ``Upload`` sends a request body to
the worker from a greenlet of its own, so that a worker may answer, and
stream, while it still reads; ``send_body`` sends a body that has all
come in the request's own frame batch instead.  All three hold a body
to ``--max-request-body`` as it comes (a Content-Length over it is
refused before: this is for chunked ones).
``ResponseBody`` takes a response body from the worker into a spool
(lb/spool.py) as fast as it comes, and gives it to the client at the
client's pace.

``InFlight`` counts what a drain waits for: requests a worker has not
finished, buffered responses a client is still being sent, and request
bodies being held before a worker gets them.  A worker
goes back to the pool (``worker_done``) as soon as its part is over,
which may be long before its client has read the response.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Hashable, List, Optional, Set

import gevent  # type: ignore[import-untyped]
import gevent.event  # type: ignore[import-untyped]

from zc_lb.environ import RELAY
from zc_lb.errors import (BadResponse, BufferUnreadable, ClientError, ClientGone,
                          ConnectionClosed, ConnectionLost, RequestTooLarge, ResponseTimeout,
                          ZcLbError)
from zc_lb.lb.spool import Spool, SpoolLimits
from zc_lb.routing.pool import Pool
from zc_lb.wire.connection import Connection
from zc_lb.wire.exchange import Exchange
from zc_lb.wire.frames import Body, End, MAX_BODY, Response

log = logging.getLogger(__name__)

UPLOAD_CHUNK = MAX_BODY  # a request body is read and sent a frame at a time
GRANT_AT_LEAST = 64 * 1024  # credit granted short of what is owed: no less (fewer frames)
# How a worker fails a body it has started (counted toward its ejection, as
# before the start): its connection lost or closed under it, or silent.
WORKER_FAILURES = (ConnectionLost, ConnectionClosed, ResponseTimeout)


class InFlight:
    """Requests in flight on workers, buffered responses still being
    sent to their clients, and request bodies being held from their
    clients (``hold_body``): ``idle`` is set while there are none of
    them, and ``woken`` when one ends an idle spell (``drain``)."""

    def __init__(self, pool: Pool, spool_limits: SpoolLimits) -> None:
        self.pool = pool
        self.spool_limits = spool_limits  # (the responses' spools share them)
        self.requests = 0  # on workers
        self.responses = 0  # buffered, a client still being sent
        self.holding = 0  # request bodies read from their clients, no worker yet
        # Of those, the ones whose worker still sends (the watchdog's: lb/awaiting.py)
        self.streaming: Set[ResponseBody] = set()
        self.idle = gevent.event.Event()
        self.idle.set()
        self.woken = gevent.event.Event()

    def started(self) -> None:
        """A request was given to a worker."""
        self.requests += 1
        if self.requests == 1:
            self.idle.clear()
            self.woken.set()

    def worker_done(self, connection: Hashable) -> None:
        """A request given to worker ``connection`` has ended there."""
        self.requests -= 1
        self._settle()
        self.pool.put(connection)

    def response_started(self) -> None:
        """A buffered response is being sent to its client."""
        self.responses += 1

    def response_sent(self) -> None:
        """A buffered response is all sent (or abandoned)."""
        self.responses -= 1
        self._settle()

    def hold(self, environ: dict, limit: Optional[int] = None) -> None:
        """``hold_body`` for a request with a body (``limit``, its
        ``--max-request-body``), counted while the body is being held: a
        drain waits for it as for a request on a worker, which it is about
        to be."""
        if not self.spool_limits.request or getattr(environ["wsgi.input"], "complete", False):
            return  # (nothing to hold: hold_body would do nothing)
        self.holding += 1
        if self.holding == 1:
            self.idle.clear()
            self.woken.set()
        try:
            hold_body(environ, self.spool_limits, limit)
        finally:
            self.holding -= 1
            self._settle()

    def _settle(self) -> None:
        if not self.requests and not self.responses and not self.holding:
            self.idle.set()

    def drain(self, timeout: float, quiet: float) -> bool:
        """Wait until nothing has been in flight for ``quiet`` seconds (a
        keep-alive client may still send a last request after the front
        stopped accepting new connections), at most ``timeout`` seconds;
        whether it got there."""
        deadline = time.monotonic() + timeout
        while True:
            if not self.idle.wait(max(deadline - time.monotonic(), 0)):
                return False
            self.woken.clear()
            remaining = deadline - time.monotonic()
            if not self.woken.wait(max(min(quiet, remaining), 0)):
                return remaining >= quiet or not self.requests


class Upload:
    """The request body, sent to the worker from a greenlet of its own,
    so that a worker may answer, and stream, while it still reads; past
    ``limit`` bytes (None: none), the request is cancelled and its error
    is RequestTooLarge.  ``moved``: when the body last moved (a piece came
    from the client, or went to the worker); ``reading``: it waits for the
    client, whose pace (bounded by the client timeout) is no worker's
    silence."""

    def __init__(self, exchange: Exchange, wsgi_input, limit: Optional[int] = None) -> None:
        self.exchange = exchange
        self.wsgi_input = wsgi_input
        self.limit = limit
        self.error: Optional[Exception] = None
        self.done = False
        self.moved = time.monotonic()  # when the body last moved (or began)
        self.reading = False  # waiting for the client's next piece
        self.greenlet = gevent.spawn(self._run)

    def _run(self) -> None:
        exchange = self.exchange
        # (The front's input reads a piece as it came: see Input.read1.)
        read = getattr(self.wsgi_input, "read1", self.wsgi_input.read)
        limit = self.limit
        size = 0
        try:
            while True:
                self.reading = True
                data = read(UPLOAD_CHUNK)
                self.reading, self.moved = False, time.monotonic()
                if not data:
                    exchange.send(End(exchange.rno))
                    self.moved, self.done = time.monotonic(), True
                    return
                size += len(data)
                if limit is not None and size > limit:
                    raise RequestTooLarge("request body over the limit of %d bytes" % limit)
                exchange.send_body(data)
                self.moved = time.monotonic()
        except (ClientError, BufferUnreadable) as exc:  # a malformed body, or the client
            self.error = exc  # left; or a held part of it could not be read back
            exchange.cancel()
        except ZcLbError:
            pass  # the request ended on the worker's side; nothing more to send
        except Exception as exc:  # the client's socket failed
            self.error = exc
            exchange.cancel()
        finally:
            if isinstance(self.wsgi_input, HeldBody):  # (its spool's file, if it has one)
                self.wsgi_input.close()

    def failure(self) -> Optional[Exception]:
        """What went wrong on the client's side, as the error to raise."""
        if self.error is None:
            return None
        if isinstance(self.error, (ClientError, BufferUnreadable)):
            return self.error  # a malformed body: answered 400 (500), connection closed
        return ClientGone("client went away during upload: %s" % self.error)

    def stop(self) -> None:
        self.greenlet.kill()


class HeldBody:
    """wsgi.input of a request whose body the LB read from its client
    before it chose a worker (``hold_body``): the bytes held, then any
    rest from the client as it comes.  ``complete``: all of it has come;
    ``buffered``: the bytes that have come and are not read yet, those
    held and those the client sent past them (-1: not known).  ``close``
    drops what is held (its spool's file too); reading to the end closes
    it."""

    def __init__(self, wsgi_input, spool: Spool, size: int, whole: bool) -> None:
        self.wsgi_input = wsgi_input
        self.spool = spool
        self.held = size  # bytes held and not read yet
        self.whole = whole  # the client's body ended within what is held
        self._rest = b""  # taken from the spool past what a read asked for

    @property
    def complete(self) -> bool:
        return self.whole or bool(getattr(self.wsgi_input, "complete", False))

    @property
    def buffered(self) -> int:
        if self.whole:
            return self.held
        # (The rest of a body may have come while the held part did: all
        # of it is sent, not the held part alone as if it were the body.)
        more = getattr(self.wsgi_input, "buffered", -1)
        return -1 if more < 0 else self.held + more

    def read1(self, size: int = -1) -> bytes:
        """Up to ``size`` bytes (-1: a piece): held ones first."""
        data = self._rest or self.spool.take()
        if not data:
            self.close()
            if self.whole:
                return b""
            return getattr(self.wsgi_input, "read1", self.wsgi_input.read)(size)
        if 0 <= size < len(data):
            data, self._rest = data[:size], data[size:]
        else:
            self._rest = b""
        self.held -= len(data)
        return data

    def read(self, size: int = -1) -> bytes:
        pieces, got = [], 0
        while size < 0 or got < size:
            data = self.read1(-1 if size < 0 else size - got)
            if not data:
                break
            pieces.append(data)
            got += len(data)
        return b"".join(pieces)

    def close(self) -> None:
        self.spool.close()  # (once closed, a no-op)
        self._rest = b""
        self.held = 0


def hold_body(environ: dict, limits: SpoolLimits, limit: Optional[int] = None) -> None:
    """Read the body of a request from its client before the request
    goes to a worker, unless it has all come (or ``limits.request`` is
    0): all of it if it ends within ``limits.request`` bytes and the
    room the spools' bounds leave, else that much of it (the rest goes
    on to the worker as it comes); ``environ``'s wsgi.input is then a
    HeldBody.  Past ``limit`` bytes (None: none) RequestTooLarge; a
    client that fails or leaves meanwhile is ClientGone, or its own
    ClientError (a malformed body)."""
    wsgi_input = environ["wsgi.input"]
    if limits.request and not getattr(wsgi_input, "complete", False):
        environ["wsgi.input"] = _held(wsgi_input, limits, limit)


def drop_held_body(environ: dict) -> None:
    """Drop what is held of the request's body (a request that ended
    before it was sent: its spool's memory, and file, given back)."""
    held = environ.get("wsgi.input")
    if isinstance(held, HeldBody):
        held.close()


def _held(wsgi_input, limits: SpoolLimits, limit: Optional[int]) -> HeldBody:
    spool = Spool(limits)
    read = getattr(wsgi_input, "read1", wsgi_input.read)
    size, most = 0, limits.request
    try:
        while size < most:
            room = spool.room
            if room is not None and room <= 0:
                break  # every buffer is full: the rest goes on as it comes
            data = read(min(UPLOAD_CHUNK, most - size))
            if not data:
                return HeldBody(wsgi_input, spool, size, True)
            size += len(data)
            if limit is not None and size > limit:
                raise RequestTooLarge("request body over the limit of %d bytes" % limit)
            spool.put(data)
    except BaseException as exc:  # (what is held given back, whatever ended it)
        spool.close()
        if isinstance(exc, Exception) and not isinstance(exc, ZcLbError):
            # the client's socket failed, or timed out
            raise ClientGone("client went away during upload: %s" % exc) from exc
        raise
    return HeldBody(wsgi_input, spool, size, False)


class ResponseBody:
    """The response body as a WSGI iterable, buffered (lb/spool.py).

    A greenlet of its own takes the body from the worker as fast as it
    comes, and gives the worker back to the pool as soon as the worker's
    part is over (its End, or a cancel or loss); the client reads at its
    own pace from the spool.  Credit for what the spool kept is granted
    while the spool has room, else once the client has taken some, so a
    slow client holds memory or disk, never a worker thread (and, past
    the spool's bounds, the worker waits, as flow control makes it, while
    the pump still takes what the worker may send unasked: a body's last
    bytes and its End are not left waiting for the client).  The worker
    is held to its Content-Length: bytes past it are dropped, and a body
    that ends short, or a worker lost mid-body, raises once the client
    has what came (the front server then closes the connection, so a
    truncated body never looks complete).  A worker silent mid-body while
    it is free to send (``silent_for``) is cut off (``time_out``) by the
    watchdog (lb/awaiting.py).  A body past or short of its length is
    the application's (a worker sends what the application gave, within
    its length), logged as such, and no failure of the worker's.  A
    worker that fails the body (``WORKER_FAILURES``) is told to
    ``outcome`` (``Fleet.outcome``), once, for outlier detection
    (lb/outlier.py); the request is not retried: bytes of it went out."""

    def __init__(self, flight: InFlight, connection: Connection, exchange: Exchange,
                 upload: Optional[Upload], length: Optional[int], response: Response,
                 outcome: Optional[Callable[[Connection, bool], None]] = None,
                 environ: Optional[dict] = None) -> None:
        self.flight = flight
        self.outcome = outcome
        self.environ = environ  # (the request's, for the log)
        self.connection = connection
        self.exchange = exchange
        self.upload = upload
        self.remaining = length
        self.spool = Spool(flight.spool_limits)
        self.ended = False  # all of the body is here, or all that will come
        self.error: Optional[ZcLbError] = None  # raised once the spool is read
        self._released = False  # the worker is back in the pool
        self._arrived = gevent.event.Event()  # the pump kept something, or ended
        self._owed = 0  # body bytes kept and not yet granted back to the worker
        self._stalled = False  # credit held back: the spool is full
        self._pump: Optional[gevent.Greenlet] = None
        self._closed = False
        self.moved = time.monotonic()  # when the worker last sent some (or was let send)
        flight.response_started()  # (a drain waits for the client to have it all)
        if self._keep(response.body):
            if response.end:
                self._end()
            else:
                flight.streaming.add(self)
                self._pump = gevent.spawn(self._take_body, len(response.body))

    def _take_body(self, owed: int) -> None:
        """The pump: receive the body and keep it, granting credit for what
        it kept while there is room (``owed``: bytes kept and not yet
        granted back; ``_grant``)."""
        exchange, spool = self.exchange, self.spool
        self._owed = owed
        try:
            while True:
                self._grant()
                if not spool:
                    # The client keeps up (it took all so far): let the
                    # body come at full speed.  If it stops reading, what
                    # comes unasked stays within WIDE_WINDOW (flow control
                    # holds the worker).
                    exchange.widen()
                message = exchange.receive()
                self.moved = time.monotonic()
                if type(message) is End:
                    self._end()
                    return
                data = message.data  # type: ignore[union-attr]
                if not self._keep(data):
                    return
                self._owed += len(data)
        except ZcLbError as exc:  # the worker lost, or the request cancelled
            failure = self.upload.failure() if self.upload is not None else None
            # (the cause, if it was the upload's: a body too large, say)
            self.error = failure if isinstance(failure, ZcLbError) else exc
            self._release()  # (its part is over: the client still reads what came)
            self._arrived.set()
            if isinstance(exc, WORKER_FAILURES) and self.outcome is not None:
                self.outcome(self.connection, False)

    def _grant(self) -> None:
        """Grant the worker credit for the bytes kept, as far as the spool
        has room (at least GRANT_AT_LEAST, or all that is owed): short of
        it, the worker waits until the client has taken some (from
        ``__iter__``), counted once a stall."""
        owed = self._owed
        if not owed:
            return
        room = self.spool.room
        grant = owed if room is None else min(owed, room)
        if grant < min(owed, GRANT_AT_LEAST):
            if not self._stalled:
                self._stalled = True
                self.flight.spool_limits.stalled += 1
            return
        if self._stalled:  # (held back until now: its silence counts from here)
            self.moved = time.monotonic()
        self._owed, self._stalled = owed - grant, False
        self.exchange.consumed(grant)

    def silent_for(self, now: float) -> float:
        """Seconds the worker has sent nothing of the body while free to
        send: 0 while the LB holds it back (its spool full: the client's
        stall) or while what it sent waits for the pump.  A request body
        still on its way counts from its last move, as before the start,
        and not while it waits for the client (``Upload.reading``)."""
        if self._stalled or self.exchange.inbox:
            return 0.0
        upload = self.upload
        if upload is not None and upload.reading:
            return 0.0
        return now - (self.moved if upload is None else max(self.moved, upload.moved))

    def time_out(self, timeout: float) -> None:
        """The worker was silent mid-body for ``timeout`` seconds: cancel the
        request there, as a client's hang-up does.  The pump ends: the
        worker is back in the pool, counted failed (``outcome``), and the
        client, once it has what came, has its connection closed."""
        exchange = self.exchange
        exchange.fail(ResponseTimeout(
            "worker %s sent nothing more of the response for %gs (response_timeout)"
            % (self.connection.peer, timeout)))
        exchange.cancel()  # (the error stays the timeout's)

    def _keep(self, data: bytes) -> bool:
        """Spool ``data``; False (and the body over) if it goes past the
        Content-Length, whose bytes would read as the next response on a
        keep-alive connection."""
        remaining = self.remaining
        if remaining is not None and len(data) > remaining:
            log.warning("the response to %s from worker %s ran past the length its head "
                        "gives (the application's body, as the worker sent it): cut there",
                        self._request(), self.connection.peer)
            data, self.remaining = data[:remaining], 0
            if data:
                self.spool.put(data)
            self.exchange.cancel()
            self._end()
            return False
        if remaining is not None:
            self.remaining = remaining - len(data)
        if data:
            self.spool.put(data)
            self._arrived.set()
        return True

    def _end(self) -> None:
        if self.remaining:
            self.error = BadResponse(
                "the application's body from worker %s ended %d bytes short of its "
                "Content-Length" % (self.connection.peer, self.remaining))
        self.ended = True
        self._release()
        self._arrived.set()

    def _request(self) -> str:
        """The request, for the log: its method and path."""
        environ = self.environ
        if environ is None:
            return "request %d" % self.exchange.rno
        return "%s %s" % (environ.get("REQUEST_METHOD"), request_path(environ))

    def _release(self) -> None:
        self._owed = 0  # (the worker's part is over: no credit to grant)
        if not self._released:
            self._released = True
            self.flight.streaming.discard(self)
            self.flight.worker_done(self.connection)

    def __iter__(self):
        spool, arrived = self.spool, self._arrived
        while True:
            data = spool.take()
            if data:
                if self._owed:
                    self._grant()
                yield data
            elif self.error is not None:
                raise self.error
            elif self.ended:
                return
            else:
                arrived.clear()  # (no switch since the checks: no wake-up lost)
                arrived.wait()

    def close(self) -> None:
        if self._pump is not None:
            self._pump.kill(block=False)
        self.spool.close()
        if self.upload is not None:
            self.upload.stop()
        self.exchange.cancel()  # a no-op once both directions have ended
        self._release()
        if not self._closed:
            self._closed = True
            self.flight.response_sent()


def body_in_hand(flight: InFlight, connection: Connection, exchange: Exchange,
                 upload: Optional[Upload], length: Optional[int], response: Response,
                 head: bool) -> Optional[List[bytes]]:
    """The body of a response whose start came, if the client has all of
    it with that start, the worker then done with the request (``flight``);
    None if more is to come from the worker (``ResponseBody``).  So it is
    when the whole response came in one piece (the front sends it in one
    write), and when it answers a HEAD (``head``): all of that is in its
    head, and the request ends on its worker with a Cancel (unless its End
    came), as a client's hang-up ends one.  (A worker of the release before
    draws the application's body on for a HEAD, and sends End once it
    ends: for an endless one, never.)"""
    if head:
        if upload is not None:
            upload.stop()
        exchange.cancel()  # (a no-op once both directions have ended)
        flight.worker_done(connection)
        return [b""]
    if response.end and upload is None and (length is None or length == len(response.body)):
        flight.worker_done(connection)
        return [response.body]
    return None


def send_body(exchange: Exchange, wsgi_input, limit: Optional[int] = None) -> Optional[Upload]:
    """Send the request body: at once, in the same frame batch as the
    request, if it has all come and fits the worker's credit; else from an
    Upload greenlet, as it arrives, while the worker may answer.  A body
    over ``limit`` bytes (None: no limit) is RequestTooLarge: at once if
    it has all come, else from the Upload's ``failure``."""
    size = getattr(wsgi_input, "buffered", -1)
    if getattr(wsgi_input, "complete", False) and 0 <= size <= min(exchange.credit, MAX_BODY):
        if limit is not None and size > limit:
            raise RequestTooLarge("request body of %d bytes is over the limit of %d"
                                  % (size, limit))
        exchange.send(Body(exchange.rno, wsgi_input.read(size)), End(exchange.rno))
        if isinstance(wsgi_input, HeldBody):
            wsgi_input.close()
        return None
    return Upload(exchange, wsgi_input, limit)


def request_path(environ: dict) -> str:
    """The request's path, without its query (a relayed request's environ
    has no PATH_INFO until completed: its head has the target)."""
    path = environ.get("PATH_INFO")
    if path is None:
        relay = environ.get(RELAY)
        target = relay.head.path if relay is not None else "/"
        path = target.partition("?")[0]
    return path or "/"
