"""The worker server: runs a WSGI application for requests forwarded by LBs.

A worker listens; LBs connect and keep their connections open.  Each
request arrives as an environ (strings only) followed by body frames; the
worker builds a PEP 3333 environ around it, runs the application (in a
greenlet, or in a thread pool with ``threads``), and streams the response
back within the LB's credit.  It never parses HTTP.

Skills: every request's class and elapsed time go into a
``resume.Skills``; every ``history`` requests the résumé is pushed to
every connected LB and saved to the résumé file, and also every
``resume_interval`` seconds while something was served since the last
(so that LBs learn within seconds of light traffic, not after thousands
of requests).  A new LB connection gets the current résumé at once.

Lifecycle: construct (nothing happens), ``start()`` binds, ``run()``
serves until ``stop()``, which tells every LB to send nothing new
(GoAway), waits for requests in flight, then closes.
"""

from __future__ import annotations

import collections
import functools
import io
import logging
import os
import signal
import sys
import time
from bisect import bisect_left
from typing import Any, Callable, ClassVar, Dict, Final, List, Mapping, Optional, Set, Tuple, cast

import gevent  # type: ignore[import-untyped]
import gevent.event  # type: ignore[import-untyped]
import gevent.lock  # type: ignore[import-untyped]
import gevent.hub  # type: ignore[import-untyped]
import gevent.server  # type: ignore[import-untyped]
import greenlet  # type: ignore[import-untyped]
from mypy_extensions import mypyc_attr

from zc_lb.worker import resume as resume_module
from zc_lb.wire.connection import HANDSHAKE_TIMEOUT, Connection, Handler
from zc_lb.wire.exchange import Exchange
from zc_lb.worker.filewrapper import FileWrapper
from zc_lb.errors import (BadResponseHead, ConfigurationError, CorruptResumeFile, RequestCancelled,
                     ZcLbError)
from zc_lb.process.loopwatch import LoopWatch
from zc_lb.front.h1 import start_again
from zc_lb.front.httpparse import HOP_BY_HOP
from zc_lb.wire.protocol import MAX_BODY, WORKER_FEATURES, Body, End, Request
from zc_lb.settings import LATENCY_BUCKETS, WORKER_LIVE, WORKER_SETTINGS, check, log_change
from zc_lb.sockets import Listen, address_text, bound, is_loopback, listener
from zc_lb.worker.threadio import NOT_BYTES, ThreadInput, ThreadOutput
from zc_lb.worker.threads import Threads
from zc_lb.environ import CACHE, REQUEST_CLASS, WORKER

log = logging.getLogger(__name__)

ERROR_500 = b"<html><body><h1>500 Internal Server Error</h1></body></html>"
# Seconds of silence before a worker drops an LB: long, since an LB whose
# loop was blocked (a site's classifier) must not lose every worker, and
# a dead LB costs a worker only the requests it had sent.
LB_SILENCE = 60.0
MAX_HANDSHAKING = 64  # connections in their handshake at once; the oldest makes room
CROWDED_LOG_EVERY = 10.0


def load_app(spec: str) -> Callable:
    """``module:callable`` or a PasteDeploy ``.ini`` file -> WSGI app."""
    if spec.endswith(".ini") or spec.startswith("config:"):
        try:
            from paste.deploy import loadapp  # type: ignore[import-untyped]
        except ImportError:
            raise ConfigurationError("%s needs PasteDeploy, which is not installed" % spec)
        path = spec[len("config:"):] if spec.startswith("config:") else spec
        if not os.path.exists(path):
            raise ConfigurationError("no such file: %s" % path)
        return loadapp("config:" + os.path.abspath(path))
    from zc_lb.routing.classifier import import_object
    app = import_object(spec)
    if not callable(app):
        raise ConfigurationError("application %r is not callable" % spec)
    return app  # type: ignore[return-value]


# -- request input ----------------------------------------------------------


class RequestInput(io.RawIOBase):
    """wsgi.input: the request body, read from an exchange as it arrives.

    Bytes are granted back to the LB as the application asks for them, so
    an upload proceeds at the application's pace.
    """

    def __init__(self, exchange: Exchange, ended: bool = False) -> None:
        self._exchange = exchange
        self._buffer = b""
        self._pos = 0  # bytes of the buffer read already (not cut off: no copy)
        self._eof = ended  # the request came whole: it has no body

    def readable(self) -> bool:
        return True

    def _fill(self) -> bool:
        """Get the next chunk into the buffer; False at end of body."""
        if self._eof:
            return False
        if not self._exchange.inbox:
            # The application keeps up (it read all that came): let the
            # body come at full speed, not a window at a time.
            self._exchange.widen()
        message = self._exchange.receive()
        if isinstance(message, End):
            self._eof = True
            return False
        assert isinstance(message, Body)
        if self._pos == len(self._buffer):
            self._buffer, self._pos = message.data, 0
        else:
            self._buffer = self._buffer[self._pos:] + message.data
            self._pos = 0
        # Buffered here only because the application asked for it.
        self._exchange.consumed(len(message.data))
        return True

    @property
    def _buffered(self) -> int:
        return len(self._buffer) - self._pos

    def _take(self, n: int) -> bytes:
        """The next ``n`` buffered bytes (a whole chunk is not copied)."""
        buffer, pos = self._buffer, self._pos
        if pos == 0 and n >= len(buffer):
            data = buffer
        else:
            data = buffer[pos:pos + n]
        self._pos = min(pos + n, len(buffer))
        return data

    def read(self, size: Optional[int] = -1) -> bytes:
        if size is None or size < 0:
            size = -1
        if 0 <= size <= self._buffered:
            return self._take(size)
        # More than is buffered: each chunk taken as it comes, and the
        # pieces joined once (a buffer grown chunk by chunk was copied
        # whole with each one: most of a worker's copies of an upload).
        pieces: List[bytes] = []
        wanted = size
        while True:
            buffered = self._buffered
            if buffered:
                n = buffered if wanted < 0 else min(buffered, wanted)
                pieces.append(self._take(n))
                if wanted >= 0:
                    wanted -= n
                    if not wanted:
                        break
            if not self._fill():
                break
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def read1(self, size: int = -1) -> bytes:
        """Up to ``size`` bytes (any number, if negative): waiting only
        for the first, and more only if they are here already; b"" at the
        end of the body.  (``threadio.ThreadInput``'s pump.)"""
        pieces: List[bytes] = []
        got = 0
        inbox = self._exchange.inbox
        while size < 0 or got < size:
            if not self._buffered and not ((not got or inbox) and self._fill()):
                break
            piece = self._take(self._buffered if size < 0 else size - got)
            pieces.append(piece)
            got += len(piece)
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def readinto(self, b) -> int:  # type: ignore[override]
        data = self.read(len(b))
        b[:len(data)] = data
        return len(data)

    def readline(self, size: Optional[int] = -1) -> bytes:
        while self._buffer.find(b"\n", self._pos) < 0 and (size is None or size < 0
                                                          or self._buffered < size):
            if not self._fill():
                break
        end = (self._buffer.find(b"\n", self._pos) + 1 or len(self._buffer)) - self._pos
        if size is not None and size >= 0:
            end = min(end, size)
        return self._take(end)

    def __iter__(self):
        return iter(self.readline, b"")


# -- response output --------------------------------------------------------




def cache_said(value: object) -> Optional[bool]:
    """What an application's ``zc_lb.cache`` says: True (a hit), False
    (a miss), or None (nothing, or a value it does not know)."""
    if value is True or value is False:
        return value
    if type(value) is str:
        word = value.lower()
        if word == "hit":
            return True
        if word == "miss":
            return False
    return None


class ResponseWriter:
    """Sends one response: status and headers lazily with the first body
    bytes (PEP 3333), body within credit, End at the end."""

    def __init__(self, exchange: Exchange, head: bool,
                 environ: Optional[Dict[str, Any]] = None) -> None:
        self.exchange = exchange
        self.head = head
        self.environ = environ  # (for what the app says of its cache: CACHE)
        self.status: Optional[str] = None
        self.headers: List[Tuple[str, str]] = []
        self.started = False
        self.began: Optional[float] = None  # perf_counter() when the app began
        # In thread mode: the pool's record of the thread running the app
        # while it runs, and the seconds it was seen queued inside the app
        # behind the others (worker/threads.py), which are not the app's time.
        self.thread: Optional[Any] = None
        self.queued = 0.0
        self.refused = False  # its head was too large: a 500 went instead

    def start_response(self, status, headers, exc_info=None):
        start_again(exc_info, self.started, self.status is not None)
        self.status = status
        self.headers = [(k, v) for (k, v) in headers if k.lower() not in HOP_BY_HOP]
        return self.write

    def write(self, data: object) -> None:
        if type(data) is not bytes:
            raise TypeError(NOT_BYTES % type(data).__name__)
        if self.status is None:
            raise AssertionError("write() before start_response()")
        exchange = self.exchange
        if self.refused:
            return
        if not self.started:
            self.started = True
            if self.head or not data:
                self._respond()
                return
            if len(data) <= min(exchange.credit, MAX_BODY):
                self._respond(data)
                return
            if not self._respond():
                return
        if data and not self.head:
            exchange.send_body(data)

    def finish(self, data: object = b"") -> None:
        """End the response, after ``data`` (the whole body, when the
        application returned it in one piece: head, body and End then go
        in one write)."""
        if type(data) is not bytes:
            raise TypeError(NOT_BYTES % type(data).__name__)
        exchange = self.exchange
        if not self.started:
            if self.status is None:
                raise AssertionError("application returned without start_response()")
            if self.head or not data or (  # (``exchange.credit``, without its call)
                    len(data) <= MAX_BODY
                    and len(data) <= exchange.connection.protocol.credit(exchange.rno)):
                self.started = True
                self._respond(b"" if self.head else data, True)
                return
        if data:
            self.write(data)
        if not self.refused:
            exchange.send(End(exchange.rno))

    def send_file(self, fd: int, offset: int, count: int) -> None:
        """The body from an open file, with sendfile(2): the head first,
        if it has not gone; at most the Content-Length the app gave.  A
        file that ends first cuts the response short (cancelled, as an
        application error after the head is)."""
        if self.refused:
            return
        if not self.started:
            self.started = True
            if not self._respond() or self.head:
                return
        elif self.head:
            return
        for name, value in self.headers:
            if name.lower() == "content-length" and value.isdigit():
                count = min(count, int(value))
        if not self.exchange.send_file(fd, offset, count):
            log.error("request %d from %s: the file ended before its response did",
                      self.exchange.rno, self.exchange.connection.peer)
            self.exchange.cancel()
            self.refused = True  # (nothing more goes: no End)

    def _respond(self, body: bytes = b"", end: bool = False) -> bool:
        """Send the head (with ``body``, and End if ``end``); False if it
        was refused as too large for a frame and a 500 went instead (the
        request alone fails: the connection and its other requests go on)."""
        exchange = self.exchange
        # The application's seconds until its response starts: the LB learns
        # from them what a key's cached data buys (``routing/locality.py``).
        began = self.began
        elapsed = None if began is None else time.perf_counter() - began - (
            self.queued if self.thread is None else self.thread.queued)
        environ = self.environ
        said = None if environ is None else environ.get(CACHE)
        cache = None if said is None else cache_said(said)  # (most apps say nothing)
        try:
            exchange.respond(self.status, self.headers, body, end,  # type: ignore[arg-type]
                             elapsed, cache)
            return True
        except BadResponseHead as exc:  # (too large, or one HTTP forbids)
            log.error("request %d from %s: %s; answering 500 instead",
                      exchange.rno, exchange.connection.peer, exc)
        self.refused = True
        self.status = "500 Internal Server Error"
        self.headers = [("Content-Type", "text/html"), ("Content-Length", str(len(ERROR_500)))]
        exchange.respond(self.status, self.headers, ERROR_500, True, elapsed)
        return False


# -- request greenlets ------------------------------------------------------


class Task:
    """One request's call in a Requests greenlet."""

    __slots__ = ("func", "args", "glet", "started", "killed", "done")

    def __init__(self, func: Callable, args: tuple, glet: greenlet.greenlet) -> None:
        self.func = func
        self.args = args
        self.glet = glet
        self.started = self.killed = self.done = False


class Requests:
    """The greenlets serving requests: raw greenlets that, once a request
    is done, wait for the next one.  A new greenlet per request cost a
    fresh Python data stack (an mmap and a munmap, and their page faults)
    and, as gevent's Greenlet in a Group, links and pool bookkeeping;
    handing a request to an idle greenlet is one loop callback.  Enough of
    ``gevent.pool.Group`` for drains, status and tests: ``len``,
    ``join``, ``kill``."""

    MAX_IDLE = 64  # idle greenlets kept; a burst past that ends its extras

    def __init__(self) -> None:
        self._hub: Optional[gevent.hub.Hub] = None  # the one requests run in, once known
        self._running: Dict[greenlet.greenlet, Task] = {}
        self._idle: List[greenlet.greenlet] = []
        self._empty = gevent.event.Event()
        self._empty.set()

    def __len__(self) -> int:
        return len(self._running)

    def __bool__(self) -> bool:
        return bool(self._running)

    def spawn(self, func: Callable, *args) -> Task:
        """Run ``func(*args)`` in a greenlet, from the next loop turn."""
        hub = self._hub or gevent.get_hub()
        self._hub = hub
        glet = self._idle.pop() if self._idle else greenlet.greenlet(self._serve, hub)
        task = Task(func, args, glet)
        self._running[glet] = task
        self._empty.clear()
        hub.loop.run_callback(glet.switch, task)
        return task

    def _serve(self, task: Task) -> None:
        current = greenlet.getcurrent()
        hub = current.parent
        running, idle = self._running, self._idle
        while True:
            task.started = True
            try:
                if not task.killed:
                    task.func(*task.args)
            except gevent.GreenletExit:
                pass
            except BaseException:  # its parent is the hub: nothing may escape
                log.exception("request greenlet failed")
            finally:
                task.done = True
                # Its arguments (the exchange, whose on_cancel holds the
                # task) go now: a cycle left per request for the garbage
                # collector was most of what it collected.
                task.args = ()
                if running.get(current) is task:
                    del running[current]
                if not running:
                    self._empty.set()
            task = None  # type: ignore[assignment]  # not kept alive while idle
            if len(idle) >= self.MAX_IDLE:
                return
            idle.append(current)
            task = hub.switch()  # the next request, from spawn()

    def kill_one(self, task: Task) -> None:
        """Raise GreenletExit in ``task``'s greenlet, from the hub (or, if
        it has not started, make it return as soon as it does)."""
        if task.done:
            return
        if not task.started:
            task.killed = True
            return
        gevent.get_hub().loop.run_callback(self._throw, task)

    def _throw(self, task: Task) -> None:
        if task.started and not task.done:
            task.glet.throw(gevent.GreenletExit)

    def kill(self, block: bool = True, timeout: Optional[float] = None) -> None:
        for task in list(self._running.values()):
            self.kill_one(task)
        if block:
            self.join(timeout)

    def join(self, timeout: Optional[float] = None) -> bool:
        return self._empty.wait(timeout)


# -- the server -------------------------------------------------------------


@mypyc_attr(allow_interpreted_subclasses=True)  # (one of an older version, in tests)
class Worker(Handler):
    """A worker process's server: accepts LB connections, runs the app."""

    protocol_features: ClassVar[Tuple[str, ...]] = WORKER_FEATURES  # what we offer LBs beyond version 1

    def __init__(
        self,
        app: Callable,
        listen: Listen = ("127.0.0.1", 0),
        history: int = resume_module.DEFAULT_HISTORY,
        max_skill_age: Optional[int] = None,
        max_classes: int = resume_module.MAX_CLASSES,
        resume_interval: float = WORKER_SETTINGS["resume_interval"].default,
        resume_file: Optional[str] = None,
        threads: Optional[int] = None,
        threads_fixed: bool = False,
        secret: Optional[bytes] = None,
        version: Optional[str] = None,
        concurrency: int = 0,
        tls: Any = None,
        sendfile: str = WORKER_SETTINGS["sendfile"].default,
    ) -> None:
        self.app = app
        self.sendfile = check(WORKER_SETTINGS, "sendfile", sendfile)
        self.tls = tls  # the server SSLContext (tls.worker_context), or None: cleartext
        self.listen = listen
        self.resume_file = resume_file
        self.threads = threads
        self.threads_fixed = threads_fixed  # (all of them take requests: worker/threads.py)
        # Greenlet mode's bound: requests past it wait for a slot (thread
        # mode's bound is its pool).
        self.slots = gevent.lock.Semaphore(concurrency) if concurrency else None
        self.secret = secret
        self.version = version  # the application's, told to every LB in our Hello
        self.history = history
        self.max_skill_age = max_skill_age
        self.max_classes = max_classes
        self.resume_interval = check(WORKER_SETTINGS, "resume_interval", resume_interval)
        self.skills: Optional[resume_module.Skills] = None
        self._published_at = time.monotonic()
        self._published_generation = 0  # the skills' generation the last résumé had
        self._timer_changed = gevent.event.Event()  # resume_interval set anew
        self._timer: Optional[gevent.Greenlet] = None
        self.connections: Set[Connection] = set()
        # Connections not yet through their handshake, oldest first: at most
        # MAX_HANDSHAKING (an LB's takes milliseconds; held ones cost memory).
        self._handshaking: "collections.OrderedDict[Connection, None]" = (
            collections.OrderedDict())
        self._crowded = 0
        self._crowded_logged = -CROWDED_LOG_EVERY
        self._rejected = 0  # connections refused in their handshake since the last line
        self._rejected_logged = -CROWDED_LOG_EVERY
        self._no_lbs = gevent.event.Event()  # set while no LB is connected
        self._no_lbs.set()
        self.server: Optional[gevent.server.StreamServer] = None
        self.requests = Requests()
        self._environ_fixed: Dict[str, object] = {}
        self.threadpool: Optional[Threads] = None
        self.loopwatch: Optional[LoopWatch] = None
        self.stopping = False
        self._stopped = gevent.event.Event()
        self.served = 0
        self.failed = 0  # requests answered 5xx or cut short: not in the résumé
        self.app_seconds = 0.0  # the application's time on served requests
        self.queued_seconds = 0.0  # its threads' waits inside it behind others (worker/threads.py)
        self.max_requests = 0  # served, then it drains and exits (--max-requests; 0: never)
        self.latency = [0] * (len(LATENCY_BUCKETS) + 1)  # served requests by app seconds

    @property
    def address(self) -> Listen:
        """The address actually bound (after start()): (host, port), or a
        Unix socket's path."""
        assert self.server is not None, "not started"
        return bound(self.server.address)

    def start(self) -> None:
        """Load the résumé file, bind, and start accepting LB connections."""
        initial = {}
        if self.resume_file:
            initial = self._load_resume(self.resume_file)
        self.skills = resume_module.Skills(self.history, self.max_skill_age, initial,
                                           self.max_classes)
        if self.threads:
            self.threadpool = Threads(self.threads, fixed=self.threads_fixed)
        else:  # greenlet mode: say so when the application blocks the loop
            self.loopwatch = LoopWatch()
            self.loopwatch.start()
        self.server = gevent.server.StreamServer(listener(self.listen), self._accept)
        self.server.start()
        self._timer = gevent.spawn(self._publish_on_time)
        log.info("worker listening on %s", address_text(self.address))

    @staticmethod
    def _load_resume(path: str) -> Dict[str, float]:
        """The skills in the résumé file at ``path``.  The file is a cache:
        a corrupt one (empty, cut short, garbled) is moved aside to
        ``path.corrupt`` and the worker starts with no skills, rather than
        not at all (a unit that does not restart after exit status 2
        would stay down).  One that cannot be read is a configuration
        error, as it could not be written either."""
        try:
            return resume_module.load_resume(path)
        except CorruptResumeFile as exc:
            aside = path + ".corrupt"
            try:
                os.replace(path, aside)
            except OSError as move:
                log.error("%s; starting with no skills (cannot move it aside: %s)", exc, move)
            else:
                log.error("%s; moved it to %s, starting with no skills", exc, aside)
            return {}

    def run(self) -> None:
        """Serve until stop()."""
        self._stopped.wait()

    def drain(self, timeout: float = 30.0) -> bool:
        """Tell every LB to send nothing new, serve what they sent before
        they heard it, and wait until they hang up (an LB closes a
        draining connection once nothing is in flight on it) and the
        requests are done, at most ``timeout`` seconds; whether it got there."""
        deadline = time.monotonic() + timeout
        for connection in list(self.connections):
            try:
                connection.send_goaway("worker stopping")
            except ZcLbError:
                pass
        self._no_lbs.wait(timeout)
        self.requests.join(timeout=max(deadline - time.monotonic(), 0))
        return not self.connections and not self.requests

    def stop(self, timeout: float = 30.0) -> None:
        """Stop listening, drain (at most ``timeout`` seconds), then close
        what is left, with every finished response sent whole."""
        if self.stopping:
            return
        self.stopping = True
        deadline = time.monotonic() + timeout
        if self.server is not None:
            self.server.close()
        self.drain(timeout)
        for connection in list(self.connections):
            connection.close("worker stopped", flush_timeout=max(deadline - time.monotonic(), 1))
        if self.loopwatch is not None:
            self.loopwatch.stop()
        if self.threadpool is not None:
            self.threadpool.stop()
        if self._timer is not None:
            self._timer.kill()
        self._stopped.set()

    LIVE = WORKER_LIVE  # (the settings table says which)

    def configure(self, changes: Mapping[str, Any], source: str = "") -> None:
        """Apply live settings from any source (the command line's file
        read again, ZooKeeper): those of ``changes`` named in ``LIVE``,
        each checked against the settings table first (ConfigurationError,
        and nothing changed, if one is bad), and each change logged as
        "name old -> new (source)".  A ``max_skill_age`` of None is its
        default, 10 x ``history``."""
        checked = {name: check(WORKER_SETTINGS, name, changes[name])
                   for name in self.LIVE if name in changes}
        if self.skills is not None:
            merged = {name: getattr(self, name) for name in self.LIVE}
            merged.update(checked)
            self.skills.configure(merged["history"], merged["max_skill_age"],
                                  merged["max_classes"])
        for name, value in checked.items():
            old = getattr(self, name)
            if value != old:
                log_change(name, old, value, source)
                setattr(self, name, value)
        self._timer_changed.set()

    def _publish_on_time(self) -> None:
        """Send the résumé ``resume_interval`` seconds after the last one
        went out, if something was served since; else look again an
        interval later.  (0: only every ``history`` requests.)"""
        changed = self._timer_changed
        while True:
            interval = self.resume_interval
            due = self._published_at + interval - time.monotonic()
            if not interval or due > 0:
                changed.wait(due if interval else None)
                changed.clear()
                continue
            assert self.skills is not None
            if self.skills.generation != self._published_generation:
                self.publish()
            else:
                self._published_at = time.monotonic()

    # -- connections --------------------------------------------------

    def _accept(self, sock, address) -> None:
        peer = "%s:%s" % address[:2] if isinstance(address, tuple) else "a local process"
        if self.tls is not None:
            try:  # (bounded: a peer that stalls it holds nothing for long)
                with gevent.Timeout(HANDSHAKE_TIMEOUT):
                    sock = self.tls.wrap_socket(sock, server_side=True)
            except (OSError, gevent.Timeout) as exc:  # (ssl.SSLError too)
                sock.close()
                self._say_rejected(peer, "TLS handshake: %s%s" % (
                    exc or "timed out", " (a cleartext LB? give it --worker-tls-cert)"
                    if "WRONG_VERSION" in str(exc) or "HTTP_REQUEST" in str(exc) else ""))
                return
        connection = Connection(sock, "worker", self, peer=peer, secret=self.secret,
                                app_version=self.version, features=self.protocol_features,
                                keepalive_timeout=LB_SILENCE)
        if self.sendfile == "off" or (self.sendfile == "auto" and (
                not isinstance(address, tuple) or is_loopback(address[0]))):
            connection.sendfile = False  # (its bytes are copied either way: see settings)
        handshaking = self._handshaking
        if len(handshaking) >= MAX_HANDSHAKING:  # unauthenticated, and held: make room
            oldest, _ = handshaking.popitem(last=False)
            oldest.close("too many connections in their handshake")
            self._say_crowded(peer)
        handshaking[connection] = None
        try:
            connection.handshake()
        except (ZcLbError, OSError) as exc:
            if not connection.closed:  # (closed: it made room for a newer one)
                self._say_rejected(peer, exc)
                connection.close("handshake failed")
            return
        finally:
            handshaking.pop(connection, None)
        if self.stopping:
            connection.close("worker stopping")
            return
        self.connections.add(connection)
        self._no_lbs.clear()
        connection.start()
        log.info("LB connected from %s", peer)
        assert self.skills is not None
        try:
            connection.send_resume(self.skills.resume())
        except ZcLbError:
            pass
        connection.join()

    def _say_crowded(self, peer: str) -> None:
        """Log connections crowding the handshake, at most every 10 s."""
        now = time.monotonic()
        self._crowded += 1
        if now - self._crowded_logged >= CROWDED_LOG_EVERY:
            log.warning("%d connections closed in their handshake to make room for "
                        "newer ones (more than %d at once; the latest from %s)",
                        self._crowded, MAX_HANDSHAKING, peer)
            self._crowded, self._crowded_logged = 0, now

    def _say_rejected(self, peer: str, error: object) -> None:
        """Log a connection refused in its handshake (no secret, a wrong
        one, junk): each at once, but in a flood one line every 10 s
        with the count (a port scanned must not fill the log)."""
        now = time.monotonic()
        self._rejected += 1
        if now - self._rejected_logged >= CROWDED_LOG_EVERY:
            if self._rejected == 1:
                log.warning("rejected connection from %s: %s", peer, error)
            else:
                log.warning("rejected %d connections in their handshake in %.0fs (the "
                            "latest from %s: %s)", self._rejected,
                            now - self._rejected_logged, peer, error)
            self._rejected, self._rejected_logged = 0, now

    def connection_lost(self, connection: Connection, error: ZcLbError) -> None:
        if connection in self.connections:
            self.connections.discard(connection)
            if not self.connections:
                self._no_lbs.set()
            log.info("LB connection from %s ended: %s", connection.peer, error)

    def handle_keys(self, connection: Connection, keys: Dict[str, List[int]]) -> None:
        """An LB sent the keys it sent us: relay them to our other LBs
        (``frames.Keys``), so that each knows where every key's data is."""
        for other in list(self.connections):
            if other is not connection:
                try:
                    other.send_keys(keys)
                except ZcLbError:
                    pass

    def handle_request(self, connection: Connection, exchange: Exchange) -> None:
        task = self.requests.spawn(self._serve, exchange)
        exchange.on_cancel = lambda: self.requests.kill_one(task)

    # -- requests -----------------------------------------------------

    def _serve(self, exchange: Exchange) -> None:
        try:
            self._serve_request(exchange)
        except BaseException:
            # (A failure of the worker's own: the LB must not wait out its
            # response timeout for an answer that will never come.)
            exchange.cancel()
            raise

    def _serve_request(self, exchange: Exchange) -> None:
        if exchange.error is not None:  # cancelled before it started
            return
        request = cast(Request, exchange.receive())  # (an exchange's first message)
        environ = self._environ(request.environ, exchange, request.end)
        rclass = environ.get(REQUEST_CLASS, "")
        writer = ResponseWriter(exchange, environ["REQUEST_METHOD"] == "HEAD", environ)
        try:
            if self.threadpool is not None:
                self._run_in_thread(environ, writer)
            else:
                self._run_watched(environ, writer)
        except ZcLbError as exc:  # the LB went away or cancelled
            log.info("request %d from %s ended early: %s",
                     exchange.rno, exchange.connection.peer, exc)
            exchange.cancel()
            return
        except gevent.GreenletExit:
            exchange.cancel()
            return
        if (writer.status is None or writer.status[:1] == "5"
                or isinstance(exchange.error, RequestCancelled)):  # (``exchange.cancelled``)
            # A failure teaches nothing: answering 500 fast is no skill.
            self.failed += 1
            return
        assert writer.began is not None  # (the application ran)
        elapsed = time.perf_counter() - writer.began - writer.queued
        self.served += 1
        if self.served == self.max_requests:  # (--max-requests: drain and exit, as on SIGTERM)
            log.info("served %d requests: draining to be started again", self.served)
            os.kill(os.getpid(), signal.SIGTERM)
        self.app_seconds += elapsed
        self.queued_seconds += writer.queued
        self.latency[bisect_left(LATENCY_BUCKETS, elapsed)] += 1
        assert self.skills is not None
        new = self.skills.record(rclass, elapsed)
        if new is not None:
            self.publish(new)

    def _run_app(self, environ: Dict, writer: ResponseWriter,
                 output: Optional[ThreadOutput] = None) -> None:
        """Run the app and send its response: through ``writer`` in this
        greenlet, or through ``output`` from a pool thread."""
        try:
            result = self.app(environ, writer.start_response if output is None
                              else output.start_response)
        except ZcLbError:
            raise
        except Exception:
            log.exception("application error for %s", environ.get("PATH_INFO"))
            self._fail(writer, output)
            return
        try:
            if type(result) in (list, tuple) and len(result) <= 1:
                # The common case, [body]: head, body and End in one write.
                (output or writer).finish(result[0] if result else b"")
            elif type(result) is FileWrapper and writer.exchange.connection.sendfile and (
                    region := result.region()) is not None:  # type: ignore[union-attr]
                if output is None:
                    writer.send_file(*region)
                    writer.finish()
                else:  # (the hub sends it, then closes the file: not this thread)
                    output.send_file(result, region)  # type: ignore[arg-type]
                    result = None
            else:
                sink = output or writer
                for data in result:
                    if data:
                        sink.write(data)
                sink.finish()
        except ZcLbError:
            raise
        except Exception:
            log.exception("application error for %s", environ.get("PATH_INFO"))
            self._fail(writer, output)
        finally:
            close = getattr(result, "close", None)
            if close is not None:
                close()

    def _fail(self, writer: ResponseWriter, output: Optional[ThreadOutput]) -> None:
        """The application failed: a 500, or a response cut short (in the
        hub, once a thread's output is sent)."""
        if output is None:
            self._error_500(writer)
        else:
            output.fail()

    def _run_watched(self, environ: Dict, writer: ResponseWriter) -> None:
        """Greenlet mode: run the application in this greenlet, known to
        the loop watch as serving this request (``writer.began``: when it
        started).  Under
        ``concurrency`` the wait for a slot comes first and, like the wait
        for a thread, is the worker's queue, not the app's time."""
        assert self.loopwatch is not None
        slots = self.slots
        if slots is not None:
            slots.acquire()
        writer.began = time.perf_counter()
        # (``loopwatch.serving`` and ``done``, without two calls a request)
        serving, current = self.loopwatch.requests, gevent.getcurrent()
        serving[current] = environ["REQUEST_METHOD"] + " " + environ["PATH_INFO"]
        try:
            self._run_app(environ, writer)
        finally:
            serving.pop(current, None)
            if slots is not None:
                slots.release()

    def _run_in_thread(self, environ: Dict, writer: ResponseWriter) -> None:
        """Run the app in a thread of the pool (``writer.began``: when it
        started there).
        The wait for a free thread is the worker's queue, not the app's
        time: a résumé that counted it would call a busy worker unskilled
        (and the LB would move its keys away just as it is most useful).
        Nor is a wait inside the app behind its other requests (its lock,
        its connection pool), as far as the pool saw it (``writer.queued``,
        worker/threads.py)."""
        hub = gevent.get_hub()
        stream = environ["wsgi.input"] = ThreadInput(hub, environ["wsgi.input"])
        output = ThreadOutput(hub, writer)
        assert self.threadpool is not None
        try:
            error = self.threadpool.apply(functools.partial(
                self._in_thread, environ, writer, output, stream))
            if error is not None:
                raise error
            try:  # back in the hub: what the thread queued, then the end
                output.close(self._error_500)
            except ZcLbError:
                raise
            except Exception:
                log.exception("application error for %s", environ.get("PATH_INFO"))
                self._error_500(writer)
        finally:
            stream.stop()

    def _in_thread(self, environ: Dict, writer: ResponseWriter, output: ThreadOutput,
                   stream: ThreadInput) -> Optional[ZcLbError]:
        """In a pool thread: run the application; the error that ended it
        early if the LB went away (raised in the hub, not here)."""
        writer.began = time.perf_counter()
        thread = self.threadpool.current()  # type: ignore[union-attr]
        writer.thread = output.thread = stream.thread = thread
        try:
            self._run_app(environ, writer, output)
        except ZcLbError as exc:  # the LB went away: raised here, not printed there
            return exc
        finally:
            if thread is not None:
                writer.queued, writer.thread = thread.queued, None
        return None

    @staticmethod
    def _error_500(writer: ResponseWriter) -> None:
        if writer.started:
            # Headers are out: a truncated body must not look complete.
            writer.exchange.cancel()
            return
        writer.status = None
        writer.start_response("500 Internal Server Error", [
            ("Content-Type", "text/html"), ("Content-Length", str(len(ERROR_500)))])
        writer.write(ERROR_500)
        writer.finish()

    ENVIRON_DEFAULTS: ClassVar[Dict[str, object]] = {
        "REQUEST_METHOD": "GET", "SCRIPT_NAME": "", "PATH_INFO": "/", "QUERY_STRING": "",
        "SERVER_NAME": "localhost", "SERVER_PORT": "80", "SERVER_PROTOCOL": "HTTP/1.1",
        "wsgi.url_scheme": "http", REQUEST_CLASS: "",
    }

    def _environ(self, forwarded: Dict[str, str], exchange: Exchange,
                 ended: bool = False) -> Dict:
        """PEP 3333's environ: what the LB forwarded, defaults for what it
        did not, then what only the worker may say."""
        fixed = self._environ_fixed
        if not fixed:
            fixed.update({
                "wsgi.version": (1, 0),
                "wsgi.multithread": bool(self.threads),
                "wsgi.multiprocess": True,
                "wsgi.run_once": False,
                "wsgi.input_terminated": True,
                "wsgi.file_wrapper": FileWrapper,
                WORKER: address_text(self.address),
            })
        # The forwarded dict was decoded for this request alone: it becomes
        # the environ, which costs a lookup per default, not a store per
        # forwarded variable into a copy of the defaults.
        environ = cast(Dict[str, object], forwarded)
        if "wsgi.input" not in environ:  # (a head request's has all, and room: relay.ROOM)
            for key, value in self.ENVIRON_DEFAULTS.items():
                if key not in environ:
                    environ[key] = value
        environ.update(fixed)
        environ["wsgi.input"] = RequestInput(exchange, ended)
        environ["wsgi.errors"] = sys.stderr
        return environ

    def publish(self, skills: Optional[Dict[str, float]] = None) -> None:
        """Send the résumé to every LB and save it."""
        assert self.skills is not None
        skills = self.skills.resume() if skills is None else skills
        self._published_at = time.monotonic()
        self._published_generation = self.skills.generation
        for connection in list(self.connections):
            try:
                connection.send_resume(skills)
            except ZcLbError:
                pass
        if self.resume_file:
            try:
                resume_module.save_resume(self.resume_file, skills)
            except OSError as exc:
                log.error("cannot save résumé to %s: %s", self.resume_file, exc)

    def reset_skills(self) -> None:
        """Forget every skill and tell the LBs (an operator's reset)."""
        if self.skills is not None:
            self.skills.reset()
            self.publish()

    def status(self) -> dict:
        """A JSON-able picture of this worker."""
        return {
            "address": address_text(self.address) if self.server else None,
            "pid": os.getpid(),
            "lbs": sorted(c.peer for c in self.connections),
            "in_flight": len(self.requests),
            "served": self.served,
            "failed": self.failed,
            "app_seconds": round(self.app_seconds, 6),
            "queued_seconds": round(self.queued_seconds, 6),
            "latency": {"buckets": list(LATENCY_BUCKETS), "counts": list(self.latency),
                        "sum": round(self.app_seconds, 6)},
            "resume": self.skills.resume() if self.skills else {},
            "threads": self.threadpool.status() if self.threadpool else None,
        }

    def __repr__(self) -> str:
        where = address_text(self.address) if self.server else "unstarted"
        return "<Worker %s lbs=%d in_flight=%d>" % (
            where, len(self.connections), len(self.requests))
