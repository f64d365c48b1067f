"""Serving one request on a worker (``Serving``): its environ made, the
application run, its response sent, and what it took counted.

Rules:

- In greenlet mode (no ``threads``) the application runs in the
  request's greenlet, known to the loop watch as serving it
  (process/loopwatch.py), with at most ``concurrency`` at once if that
  is set.  In thread mode it runs in a thread of the pool
  (worker/threads.py), its bodies crossing to the hub in bulk
  (worker/threadio.py).
- The application's time leaves out the worker's queue (the wait for a
  slot or a thread) and, in thread mode, the waits inside the
  application behind its other requests that the pool saw: a résumé
  that counted them would call a busy worker unskilled.
- An application that raises is logged and answered 500, or its
  response cut short once its head is out; one whose result's
  ``close()`` raises is logged, and the response it ended stands.  An
  LB that went away or cancelled ends the request early.  A failure of
  the worker's own cancels the request at once, so that the LB does not
  wait out its response timeout.
- A failure (no response, a 5xx, a cancel) teaches nothing: it is
  counted in ``failed`` and kept out of the résumé, and a 5xx tells
  the LB neither the application's time nor what its cache did
  (worker/wsgi.py).  A request served is
  counted with its time, by latency bucket, and recorded in the résumé;
  the ``max_requests``-th makes the process drain and exit, as on
  SIGTERM.
- A HEAD the LB cancels once its head went out is served, not failed:
  the client has all a HEAD gets, and the LB ends a HEAD so once it has
  the head, unless the End came with it (lb/bodies.py), as it does not
  when the application answers through write() and works on.  Its time
  runs to the cancel: the application is stopped there (in thread mode
  its thread is left to finish, as for any cancel, unwatched), and a
  HEAD is timed to its response whole, which is its head (its body is
  never drawn: ``_send_blocks``).
"""

from __future__ import annotations

import functools
import logging
import time
from bisect import bisect_left
from typing import Callable, Dict, Iterable, List, Optional, Union, cast

import gevent  # type: ignore[import-untyped]
import gevent.lock  # type: ignore[import-untyped]

from zc_lb.environ import REQUEST_CLASS
from zc_lb.errors import PeerCancelled, RequestCancelled, ZcLbError
from zc_lb.process.loopwatch import LoopWatch
from zc_lb.process.pending import act_as_on
from zc_lb.settings import LATENCY_BUCKETS
from zc_lb.wire.exchange import Exchange
from zc_lb.wire.frames import Request
from zc_lb.worker.filewrapper import FileWrapper
from zc_lb.worker.publisher import ResumePublisher
from zc_lb.worker.threadio import ThreadInput, ThreadOutput
from zc_lb.worker.threads import Threads
from zc_lb.worker.wsgi import ResponseWriter, fixed_environ, make_environ

log = logging.getLogger(__name__)

# What an application raises that is its own failure: a 500, logged
# with its traceback.  sys.exit() in a view (code shared with a script)
# is one: it ends the request, not the worker.  (GreenletExit is not: it
# is how a cancelled request is stopped.)
APPLICATION_ERRORS = (Exception, SystemExit, KeyboardInterrupt)


class Serving:
    """How a worker serves each request: ``serve(exchange)``, in the
    request's greenlet, once ``start()`` made its threads or loop watch."""

    def __init__(self, app: Callable, publisher: ResumePublisher,
                 threads: Optional[int] = None, threads_fixed: bool = False,
                 concurrency: int = 0, max_requests: int = 0) -> None:
        self.app = app
        self.publisher = publisher  # (what each request served teaches)
        self.threads = threads
        self.threads_fixed = threads_fixed  # (all of them take requests: worker/threads.py)
        # Greenlet mode's bound: requests past it wait for a slot (thread
        # mode's bound is its pool).
        self.slots = gevent.lock.Semaphore(concurrency) if concurrency else None
        self.threadpool: Optional[Threads] = None
        self.loopwatch: Optional[LoopWatch] = None
        self.environ_fixed: Dict[str, object] = {}  # (wsgi.fixed_environ, once started)
        self.served = 0
        self.failed = 0  # requests answered 5xx or cut short: not in the résumé
        self.app_seconds = 0.0  # the application's time on served requests
        self.queued_seconds = 0.0  # its threads' waits inside it behind others (worker/threads.py)
        self.max_requests = max_requests  # served, then it drains and exits (0: never)
        self.latency = [0] * (len(LATENCY_BUCKETS) + 1)  # served requests by app seconds

    def start(self, worker: str) -> None:
        """Make the thread pool, or in greenlet mode the loop watch; the
        worker's address is ``worker``, as text (its environs say it)."""
        if self.threads:
            self.threadpool = Threads(self.threads, fixed=self.threads_fixed)
        else:  # greenlet mode: say so when the application blocks the loop
            self.loopwatch = LoopWatch()
            self.loopwatch.start()
        self.environ_fixed = fixed_environ(bool(self.threads), worker)

    def stop(self) -> None:
        if self.loopwatch is not None:
            self.loopwatch.stop()
        if self.threadpool is not None:
            self.threadpool.stop()

    def running(self) -> List[str]:
        """What the application runs now, for the log: the longest first
        in thread mode ("GET /path for 12 s")."""
        if self.threadpool is not None:
            return self.threadpool.running()
        if self.loopwatch is not None:
            return list(self.loopwatch.requests.values())
        return []

    def serve(self, exchange: Exchange) -> None:
        """Serve the request of ``exchange`` (in its greenlet)."""
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
        except (ZcLbError, gevent.GreenletExit) as exc:  # the LB went away or cancelled
            if _head_out(writer, exchange):
                self._count(writer, rclass)  # (the LB's end of a HEAD it has whole)
                return
            if isinstance(exc, ZcLbError):
                log.info("request %d from %s ended early: %s",
                         exchange.rno, exchange.connection.peer, exc)
            self.failed += 1
            exchange.cancel()
            return
        if (writer.status is None or writer.status[:1] == "5" or (
                isinstance(exchange.error, RequestCancelled) and not writer.ended)):
            # A failure teaches nothing: answering 500 fast is no skill.
            self.failed += 1
            return
        self._count(writer, rclass)

    def _count(self, writer: ResponseWriter, rclass: str) -> None:
        """A request served: counted with the application's time so far
        (to its return, unless the LB ended a HEAD before it: to then)."""
        assert writer.began is not None  # (the application ran)
        elapsed = writer.app_seconds()
        thread = writer.thread  # (thread mode, the app still running: its waits so far)
        queued = writer.queued if thread is None else thread.queued
        self.served += 1
        if self.served == self.max_requests:  # (--max-requests: drain and exit, as on SIGTERM)
            act_as_on("SIGTERM", "served %d requests (--max-requests %d): draining to be "
                      "started again" % (self.served, self.max_requests))
        self.app_seconds += elapsed
        self.queued_seconds += queued
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
        except APPLICATION_ERRORS:
            log.exception("application error for %s", environ.get("PATH_INFO"))
            self._fail(writer, output)
            return
        try:
            writer.from_file = type(result) is FileWrapper
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
                _send_blocks(result, writer, output or writer)
        except ZcLbError:
            raise
        except APPLICATION_ERRORS:
            log.exception("application error for %s", environ.get("PATH_INFO"))
            self._fail(writer, output)
        finally:
            close = getattr(result, "close", None)
            if close is not None:
                _close(close, environ)

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
        worker/threads.py), nor one on the LB (for the request's body, for
        room for the response), nor the hub's sending of the response once
        the app returned (``writer.app_seconds``)."""
        hub = gevent.get_hub()
        stream = environ["wsgi.input"] = ThreadInput(hub, environ["wsgi.input"])
        output = ThreadOutput(hub, writer)
        assert self.threadpool is not None
        try:
            try:
                error = self.threadpool.apply(functools.partial(
                    self._in_thread, environ, writer, output, stream), environ)
            except BaseException:  # (killed: cancelled, or its LB gone, the thread running on)
                output.abandon()
                raise
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
        early if the LB went away (raised in the hub, not here).  A request
        cancelled (or whose LB went) while it waited for a thread is not
        run: nobody waits for its response."""
        error = writer.exchange.error
        if error is not None:
            return error
        writer.began = time.perf_counter()
        thread = self.threadpool.current()  # type: ignore[union-attr]
        writer.thread = output.thread = stream.thread = thread
        try:
            self._run_app(environ, writer, output)
        except ZcLbError as exc:  # the LB went away: raised here, not printed there
            return exc
        finally:
            if thread is None:
                writer.took = time.perf_counter() - writer.began
            else:  # (``took`` before ``thread`` goes: the hub may be reading them)
                writer.queued = thread.queued
                writer.took = writer.app_seconds()
                writer.thread = None
        return None


def _close(close: Callable[[], object], environ: Dict) -> None:
    """Call the application's ``close()`` (PEP 3333).  One that raises is
    the application's error, logged; the response it ended stands, as in
    gunicorn and the front's own server: it is whole, and cancelling it
    now would give the client a 502 or a body cut short for it."""
    try:
        close()
    except ZcLbError:
        raise
    except APPLICATION_ERRORS:
        log.exception("application error closing the response to %s",
                      environ.get("PATH_INFO"))


def _head_out(writer: ResponseWriter, exchange: Exchange) -> bool:
    """Whether ``exchange``, stopped by its LB, answered a HEAD whose head
    had gone out (not a 500 in its place, nor a 5xx): served, by the
    module's rule."""
    status = writer.status
    return (writer.head and writer.started and not writer.refused and status is not None
            and status[:1] != "5" and isinstance(exchange.error, PeerCancelled))


def _send_blocks(result: Iterable, writer: ResponseWriter,
                 sink: Union[ThreadOutput, ResponseWriter]) -> None:
    """The application's body, block by block, through ``sink`` (its
    ``writer``, or a pool thread's output), then its end.  None of it is
    drawn once it went past its Content-Length (the writer's ``limit``
    -1), or once its head was refused (a 500 went instead, whole), nor,
    for a HEAD, once the application called start_response (before its
    first block, or in it): the rest would go nowhere, and an endless one
    would run on."""
    head = writer.head
    if head and writer.status is not None:
        sink.finish()  # (the head and End, at once)
        return
    for data in result:
        if head and writer.status is not None:
            break
        if data:
            sink.write(data)
            if writer.limit == -1 or writer.refused:
                break
    sink.finish()
