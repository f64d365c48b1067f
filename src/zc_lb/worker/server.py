"""The worker server: runs a WSGI application for requests forwarded by LBs.

A worker listens; LBs connect and keep their connections open.  Each
request arrives as an environ (strings only) followed by body frames; the
worker builds a PEP 3333 environ around it, runs the application (in a
greenlet, or in a thread pool with ``threads``), and streams the response
back within the LB's credit.  It never parses HTTP.

Skills: every request's class and elapsed time go into the worker's
résumé, which goes to every LB on a schedule (worker/publisher.py).

Lifecycle: construct (nothing happens), ``start()`` binds, ``run()``
serves until ``stop()``, which tells every LB to send nothing new
(GoAway), waits for requests in flight, then closes.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import time
from bisect import bisect_left
from typing import Any, Callable, ClassVar, Dict, List, Mapping, Optional, Tuple, cast

import gevent  # type: ignore[import-untyped]
import gevent.event  # type: ignore[import-untyped]
import gevent.lock  # type: ignore[import-untyped]
import gevent.server  # type: ignore[import-untyped]
from mypy_extensions import mypyc_attr

from zc_lb.worker import resume as resume_module
from zc_lb.wire.connection import Connection, Exchange, Handler
from zc_lb.worker.filewrapper import FileWrapper
from zc_lb.worker.greenlets import Requests
from zc_lb.worker.lbs import LBConnections
from zc_lb.worker.publisher import ResumePublisher
from zc_lb.errors import ConfigurationError, RequestCancelled, ZcLbError
from zc_lb.process.loopwatch import LoopWatch
from zc_lb.wire.protocol import WORKER_FEATURES, Request
from zc_lb.settings import LATENCY_BUCKETS, WORKER_SETTINGS, check
from zc_lb.sockets import Listen, address_text, bound, listener
from zc_lb.worker.threadio import ThreadInput, ThreadOutput
from zc_lb.worker.threads import Threads
from zc_lb.worker.wsgi import ResponseWriter, fixed_environ, make_environ
from zc_lb.environ import REQUEST_CLASS

log = logging.getLogger(__name__)


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
        self.listen = listen
        self.lbs = LBConnections(self, self.protocol_features, secret, version, tls,
                                 check(WORKER_SETTINGS, "sendfile", sendfile))
        self.threads = threads
        self.threads_fixed = threads_fixed  # (all of them take requests: worker/threads.py)
        # Greenlet mode's bound: requests past it wait for a slot (thread
        # mode's bound is its pool).
        self.slots = gevent.lock.Semaphore(concurrency) if concurrency else None
        self.publisher = ResumePublisher(self.lbs, history, max_skill_age, max_classes,
                                         resume_interval, resume_file)
        self.server: Optional[gevent.server.StreamServer] = None
        self.requests = Requests()
        self.environ_fixed: Dict[str, object] = {}  # (wsgi.fixed_environ, once bound)
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
        self.publisher.start()
        if self.threads:
            self.threadpool = Threads(self.threads, fixed=self.threads_fixed)
        else:  # greenlet mode: say so when the application blocks the loop
            self.loopwatch = LoopWatch()
            self.loopwatch.start()
        self.server = gevent.server.StreamServer(listener(self.listen), self._accept)
        self.server.start()
        self.environ_fixed = fixed_environ(bool(self.threads), address_text(self.address))
        log.info("worker listening on %s", address_text(self.address))

    def run(self) -> None:
        """Serve until stop()."""
        self._stopped.wait()

    def drain(self, timeout: float = 30.0) -> bool:
        """Tell every LB to send nothing new, serve what they sent before
        they heard it, and wait until they hang up (an LB closes a
        draining connection once nothing is in flight on it) and the
        requests are done, at most ``timeout`` seconds; whether it got there."""
        deadline = time.monotonic() + timeout
        self.lbs.send_goaway("worker stopping")
        self.lbs.wait_gone(timeout)
        self.requests.join(timeout=max(deadline - time.monotonic(), 0))
        return not self.lbs.connections and not self.requests

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
        self.lbs.close("worker stopped", deadline)
        if self.loopwatch is not None:
            self.loopwatch.stop()
        if self.threadpool is not None:
            self.threadpool.stop()
        self.publisher.stop()
        self._stopped.set()

    def configure(self, changes: Mapping[str, Any], source: str = "") -> None:
        """Apply live settings (``ResumePublisher.configure``: they are all
        the résumé's) from any source: the command line's file read again,
        ZooKeeper."""
        self.publisher.configure(changes, source)

    def settings(self) -> Dict[str, Any]:
        """The live settings' values now, by name."""
        return self.publisher.settings()

    def reset_skills(self) -> None:
        """Forget every skill and tell the LBs (an operator's reset)."""
        self.publisher.reset()

    # -- connections --------------------------------------------------

    def _accept(self, sock, address) -> None:
        """An LB connected: admitted (or refused), told our résumé at once,
        then heard until it goes."""
        connection = self.lbs.admit(sock, address)
        if connection is None:
            return
        if self.stopping:
            connection.close("worker stopping")
            return
        self.lbs.add(connection)
        self.publisher.greet(connection)
        connection.join()

    def connection_lost(self, connection: Connection, error: ZcLbError) -> None:
        self.lbs.lost(connection, error)

    def handle_keys(self, connection: Connection, keys: Dict[str, List[int]]) -> None:
        self.lbs.relay_keys(connection, keys)

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
        environ = make_environ(request.environ, exchange, request.end, self.environ_fixed)
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
        self.publisher.record(rclass, elapsed)

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
            writer.fail()
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
                output.close()
            except ZcLbError:
                raise
            except Exception:
                log.exception("application error for %s", environ.get("PATH_INFO"))
                writer.fail()
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

    def status(self) -> dict:
        """A JSON-able picture of this worker."""
        return {
            "address": address_text(self.address) if self.server else None,
            "pid": os.getpid(),
            "lbs": sorted(c.peer for c in self.lbs.connections),
            "in_flight": len(self.requests),
            "served": self.served,
            "failed": self.failed,
            "app_seconds": round(self.app_seconds, 6),
            "queued_seconds": round(self.queued_seconds, 6),
            "latency": {"buckets": list(LATENCY_BUCKETS), "counts": list(self.latency),
                        "sum": round(self.app_seconds, 6)},
            "resume": self.publisher.resume(),
            "threads": self.threadpool.status() if self.threadpool else None,
        }

    def __repr__(self) -> str:
        where = address_text(self.address) if self.server else "unstarted"
        return "<Worker %s lbs=%d in_flight=%d>" % (
            where, len(self.lbs.connections), len(self.requests))
