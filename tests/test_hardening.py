"""Hardening: HTTP framing, flow control, drains and leaks, each test
born of a bug a review found (and fixed).

Most run in process (a real Worker, a real LB and its FrontServer on
127.0.0.1, all on one gevent hub); the client is a raw gevent socket read
through http.client's parser, so extra or missing bytes on a keep-alive
connection show up as a parse error on the next response.  A few run real
processes, like test_e2e.py.  Every wait is bounded.
"""

import http.client
import json
import logging
import os
import signal
import socket
import time
from pathlib import Path

import gevent
import gevent.event
import gevent.socket
import pytest

from corpus import KeepOpen
from zc_lb import errors
from zc_lb.wire import decoder, encoder, frames
from zc_lb.wire.stream import WIDE_WINDOW
from zc_lb.routing.classifier import host_classifier
from zc_lb.wire.connection import Connection, Handler
from zc_lb.front.server import FrontServer
from zc_lb.lb.balancer import LB
from zc_lb.routing.pool import Pool
from zc_lb.wire.frames import Body, End, GoAway, Response
from zc_lb.lb.spool import SpoolLimits
from zc_lb.settings import LB_SETTINGS
from zc_lb.testing import LBProcess, WorkerProcess, connection_pair
from zc_lb.worker.server import Worker

TESTS = os.path.dirname(os.path.abspath(__file__))
ENV = {"PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")}

pytestmark = pytest.mark.timeout(20)


# -- harness ------------------------------------------------------------------


def poll(predicate, timeout=5.0, message="condition"):
    """gevent-friendly wait_for."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for %s" % message)
        gevent.sleep(0.01)


class _FakeSock:
    def __init__(self, f):
        self._f = f

    def makefile(self, mode):
        return self._f


class Client:
    """One keep-alive HTTP/1.1 connection from a gevent socket."""

    def __init__(self, address, timeout=5.0):
        self.sock = gevent.socket.create_connection(address, timeout=timeout)
        self.file = KeepOpen(self.sock.makefile("rb"))

    def send(self, data):
        self.sock.sendall(data)

    def request(self, method="GET", path="/", host="a.example", body=b"", headers=()):
        head = "%s %s HTTP/1.1\r\nHost: %s\r\n" % (method, path, host)
        for name, value in headers:
            head += "%s: %s\r\n" % (name, value)
        if body:
            head += "Content-Length: %d\r\n" % len(body)
        self.send(head.encode() + b"\r\n" + body)
        return self.response(method)

    def response(self, method="GET"):
        """(status, headers dict lower-cased, body) of the next response."""
        response = http.client.HTTPResponse(_FakeSock(self.file), method=method)
        response.begin()
        body = response.read()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, body

    def closed_by_server(self, timeout):
        """True if the server closes the connection within ``timeout``."""
        self.sock.settimeout(timeout)
        try:
            while True:
                data = self.sock.recv(65536)
                if not data:
                    return True
        except (socket.timeout, OSError):
            return False

    def close(self):
        self.file._f.close()  # the socket stays open while its file does
        self.sock.close()


class Stack:
    """A Worker, an LB connected to it, and the LB's FrontServer, in process."""

    def __init__(self, app, n_workers=1, worker_kw=None, worker_class=None, wsgi=False,
                 **lb_kw):
        self.workers = []
        for _ in range(n_workers):
            worker = (worker_class or Worker)(app, **(worker_kw or {}))
            worker.start()
            self.workers.append(worker)
        lb_kw.setdefault("no_worker_timeout", 2.0)
        self.lb = LB(Pool(), host_classifier, **lb_kw)
        self.lb.fleet.set_workers(["127.0.0.1:%d" % w.address[1] for w in self.workers])
        poll(lambda: len(self.lb.pool) == n_workers, message="LB connected")
        # With ``wsgi``, the front runs the LB as a plain WSGI application
        # (LB.__call__), which sends workers JSON environs, not heads.
        self.front = FrontServer(("127.0.0.1", 0), self.lb if not wsgi else (
            lambda environ, start_response: self.lb(environ, start_response)))
        self.front.start()

    @property
    def address(self):
        return self.front.address

    @property
    def worker(self):
        return self.workers[0]

    def client(self, timeout=5.0):
        return Client(self.address, timeout)

    def backlog(self):
        return sum(w.backlog for w in self.lb.pool.workers.values())

    def streams(self):
        return sum(len(link.connection.protocol.streams) for link in self.lb.fleet.links.values()
                   if link.connection is not None)

    def close(self):
        self.front.stop(timeout=0.5)
        self.lb.stop()
        for worker in self.workers:
            worker.stop(timeout=0.5)
            worker.requests.kill(block=False)  # a hung app must not outlive its test


@pytest.fixture
def stack():
    made = []

    def make(app, **kw):
        s = Stack(app, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def ok_app(environ, start_response):
    body = b"ok " + environ.get("PATH_INFO", "").encode()
    start_response("200 OK", [("Content-Type", "text/plain"),
                              ("Content-Length", str(len(body)))])
    return [body]


def routes(table):
    """A WSGI app dispatching on PATH_INFO to ``table``, else ok_app."""
    def app(environ, start_response):
        return table.get(environ["PATH_INFO"], ok_app)(environ, start_response)
    return app


# -- the LB turns a response the front server rejects into a leak -------------


def _bad_header_app(environ, start_response):
    # The worker forwards any string; pywsgi's start_response refuses a
    # newline in a header value (response splitting) by raising ValueError.
    start_response("200 OK", [("X-Bad", "a\nb"), ("Content-Length", "2")])
    return [b"hi"]


def test_response_rejected_by_start_response_does_not_leak_in_flight(stack):
    s = stack(routes({"/bad": _bad_header_app}))
    client = s.client()
    status, _, _ = client.request(path="/bad")
    assert status >= 500  # pywsgi's 500 today; 502 would be better
    # the request is over for the client; the LB must have forgotten it
    poll(lambda: s.lb.in_flight == 0 and s.backlog() == 0 and s.streams() == 0,
         timeout=2, message="in_flight, backlog and streams back to 0")


def _bad_length_app(environ, start_response):
    start_response("200 OK", [("Content-Length", "2, 2")])
    return [b"hi"]


def test_an_invalid_content_length_from_the_app_is_a_500_from_its_worker(stack):
    # The worker makes the head ready for the client and checks it there:
    # a Content-Length that is not one number never reaches the client.
    s = stack(routes({"/bad": _bad_length_app}))
    client = s.client()
    status, headers, body = client.request(path="/bad")
    assert status == 500 and "2, 2" not in str(headers)
    assert client.request(path="/next")[:3:2] == (200, b"ok /next")  # still in sync
    poll(lambda: s.lb.in_flight == 0 and s.backlog() == 0 and s.streams() == 0,
         timeout=2, message="in_flight, backlog and streams back to 0")


def _interim_status_app(environ, start_response):
    start_response("103 Early Hints", [("Link", "</a.css>; rel=preload")])
    return []


def test_a_final_1xx_status_from_the_app_is_a_500_from_its_worker(stack):
    # A 1xx is interim: a client sent one as the response would wait on,
    # and take the next response on the connection for this one's.
    s = stack(routes({"/interim": _interim_status_app}))
    client = s.client()
    assert client.request(path="/interim")[0] == 500
    assert client.request(path="/next")[:3:2] == (200, b"ok /next")  # still in sync


def _weird_status_app(environ, start_response):
    start_response("999 Weird", [("Content-Length", "5")])
    return [b"weird"]


def test_a_status_past_599_from_the_app_is_a_500_from_its_worker(stack, caplog):
    # It went to the client as it was, which (RFC 9110 15) takes it as a
    # 5xx; the LB counted it a success, and in no class of its counts.
    s = stack(routes({"/weird": _weird_status_app}))
    client = s.client()
    with caplog.at_level(logging.ERROR, logger="zc_lb.worker"):
        assert client.request(path="/weird")[0] == 500
    assert client.request(path="/next")[:3:2] == (200, b"ok /next")  # still in sync
    assert "'999 Weird'" in caplog.text


def _big_stream_app(environ, start_response):
    start_response("200 OK", [("Content-Length", str(64 * 256 * 1024))])
    return (b"x" * (256 * 1024) for _ in range(64))


def test_what_waits_for_a_client_that_stopped_reading_stays_within_the_window(stack):
    # A body the client keeps up with is let come a wide window ahead (it
    # took what came first, here into its socket's buffers); when it
    # stops reading and its spool is full, what waits in the LB for room
    # stays within that window: the worker is held by flow control.
    s = stack(routes({"/big": _big_stream_app}),
              spool_limits=SpoolLimits(memory=64 * 1024, disk=0))
    client = s.client()
    client.send(b"GET /big HTTP/1.1\r\nHost: a.example\r\n\r\n")
    poll(lambda: s.lb.flight.spool_limits.stalled > 0, message="the spool full")
    gevent.sleep(0.2)
    [link] = s.lb.fleet.links.values()
    [stream] = link.connection.protocol.streams.values()
    waiting = sum(len(m.data) for m in stream.owner.inbox if isinstance(m, Body))
    assert stream.window + waiting <= WIDE_WINDOW


def _not_modified_app(environ, start_response):
    # RFC 9110 8.6: a 304 MAY carry the Content-Length a 200 would have had.
    start_response("304 Not Modified", [("ETag", '"v1"'), ("Content-Length", "1234")])
    return []


def test_304_with_content_length_reaches_the_client(stack):
    s = stack(routes({"/cached": _not_modified_app}))
    client = s.client()
    status, headers, body = client.request(path="/cached",
                                           headers=[("If-None-Match", '"v1"')])
    assert status == 304 and body == b""
    assert client.request(path="/again")[0] == 200  # still in sync
    assert s.lb.in_flight == 0


# -- framing of the response to the client --------------------------------------


def _too_long_app(environ, start_response):
    start_response("200 OK", [("Content-Length", "5")])
    return [b"hello", b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\nsmuggled"]


def test_body_longer_than_content_length_does_not_desync_keepalive(stack):
    s = stack(routes({"/long": _too_long_app}))
    client = s.client()
    status, _, body = client.request(path="/long")
    assert (status, body) == (200, b"hello")
    status, _, body = client.request(path="/next")
    assert (status, body) == (200, b"ok /next"), "the next response is the smuggled one"


def _too_short_app(environ, start_response):
    start_response("200 OK", [("Content-Length", "100")])
    return [b"only ten.."]


def test_body_shorter_than_content_length_closes_the_client_connection(stack):
    s = stack(routes({"/short": _too_short_app}))
    client = s.client()
    client.send(b"GET /short HTTP/1.1\r\nHost: a.example\r\n\r\n")
    # a truncated body must not look complete: the LB must close
    assert client.closed_by_server(2.0)


def _unframed_app(environ, start_response):
    # Bodies that are not what their heads say.
    path = environ["PATH_INFO"]
    if path == "/204":
        start_response("204 No Content", [])
        return [b"body"]
    start_response("200 OK", [("Content-Length", "10")])
    return {"/long": [b"x" * 20], "/long2": [b"x" * 5, b"y" * 15], "/short": [b"x" * 5]}[path]


def _said(caplog, prefix):
    return [r.getMessage() for r in caplog.records
            if r.name.startswith(prefix) and r.levelno >= logging.WARNING]


@pytest.mark.parametrize("threads", [None, 2])
def test_an_apps_body_unlike_its_head_is_said_by_its_worker_and_not_blamed_on_it(
        stack, caplog, threads):
    # The client got the right bytes, but the worker logged nothing and
    # the LB logged "worker ADDR sent a body longer than its
    # Content-Length" once a request: a broken worker, to an operator.
    s = stack(routes({"/long": _unframed_app, "/long2": _unframed_app, "/204": _unframed_app,
                      "/short": _unframed_app}), worker_kw={"threads": threads})
    with caplog.at_level(logging.WARNING):
        client = s.client()
        assert client.request(path="/long")[::2] == (200, b"x" * 10)
        assert client.request(path="/long2")[::2] == (200, b"x" * 5 + b"y" * 5)
        assert client.request(path="/204")[::2] == (204, b"")
        assert client.request(path="/next")[::2] == (200, b"ok /next")  # (still in sync)
        client.send(b"GET /short HTTP/1.1\r\nHost: a.example\r\n\r\n")
        assert client.closed_by_server(2.0)
    assert _said(caplog, "zc_lb.worker") == [
        "the application's response to GET /long ran past its Content-Length of 10: cut there",
        "the application's response to GET /long2 ran past its Content-Length of 10: cut there",
        "the application's 204 response to GET /204 has a body: dropped (a 204 response has "
        "none)",
        "the application's response to GET /short ended 5 bytes short of its Content-Length "
        "of 10 (the LB closes the client's connection after it)"]
    assert _said(caplog, "zc_lb.lb") == []
    assert _said(caplog, "zc_lb.front") == [
        "closing client connection (GET /short): the application's body from worker "
        "127.0.0.1:%d ended 5 bytes short of its Content-Length" % s.worker.address[1]]
    assert s.lb.fleet.worker_failures == 0


class _UnframedWorker(Worker):
    """A worker that sends the body the application gave, whatever its
    head said, as one of an earlier release did."""

    def handle_request(self, connection, exchange):
        gevent.spawn(self._answer, exchange)

    def _answer(self, exchange):
        path = exchange.receive().environ.get("PATH_INFO")
        if path == "/short":
            exchange.respond("200 OK", [("Content-Length", "10")], b"x" * 5, True)
        else:
            exchange.respond("200 OK", [("Content-Length", "10")], b"x" * 5)
            exchange.send_body(b"y" * 15)
            exchange.send(End(exchange.rno))


def test_a_body_unlike_its_head_from_a_worker_is_said_as_the_applications_not_a_failure(
        stack, caplog):
    # The LB's lines read as a broken worker ("worker ADDR sent a body
    # longer than its Content-Length", "worker's body ended 5 bytes
    # short"); and such responses must not count toward its ejection.
    s = stack(ok_app, worker_class=_UnframedWorker)
    port = s.worker.address[1]
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            client = s.client()
            assert client.request(path="/long")[::2] == (200, b"x" * 5 + b"y" * 5)
            client.send(b"GET /short HTTP/1.1\r\nHost: a.example\r\n\r\n")
            assert client.closed_by_server(2.0)
    assert set(_said(caplog, "zc_lb.lb")) == {
        "the response to GET /long from worker 127.0.0.1:%d ran past the length its head "
        "gives (the application's body, as the worker sent it): cut there" % port}
    assert set(_said(caplog, "zc_lb.front")) == {
        "closing client connection (GET /short): the application's body from worker "
        "127.0.0.1:%d ended 5 bytes short of its Content-Length" % port}
    assert s.lb.fleet.worker_failures == 0 and len(s.lb.pool) == 1
    assert not s.lb.fleet.ejector.ejected("127.0.0.1:%d" % port)


class _PastStatusWorker(Worker):
    """A worker that passes on an application's status past 599, as one
    of the release before did (the protocol is the same)."""

    def handle_request(self, connection, exchange):
        gevent.spawn(self._answer, connection, exchange)

    def _answer(self, connection, exchange):
        weird = exchange.receive().environ.get("PATH_INFO") == "/weird"
        frame = connection.protocol.respond(exchange.rno, "200 Beyond",
                                            [("Content-Length", "5")], b"weird", True)
        connection.write(frame.replace(b"HTTP/1.1 200 ", b"HTTP/1.1 600 ", 1) if weird
                         else frame)


@pytest.mark.parametrize("wsgi", [False, True], ids=["standalone", "embedded"])
def test_a_status_past_599_from_an_older_worker_reaches_a_host_server_that_takes_it(
        stack, caplog, wsgi):
    # Run as a plain WSGI application under a server that refuses such a
    # status, the LB answered 502 saying "worker sent a response head HTTP
    # forbids": which worker, and that the status was the application's,
    # went unsaid.  Standalone, it goes on as the worker sent it.
    s = stack(ok_app, worker_class=_PastStatusWorker, wsgi=wsgi)
    port = s.worker.address[1]
    client = s.client()
    with caplog.at_level(logging.WARNING):
        status, _, body = client.request(path="/weird")
    if not wsgi:
        assert (status, body) == (600, b"weird")
        assert _said(caplog, "zc_lb") == []
        return
    assert status == 502
    assert _said(caplog, "zc_lb") == [
        "502 for GET /weird: worker 127.0.0.1:%d's response head (status '600 Beyond') was "
        "refused by the WSGI server running the LB: invalid status '600 Beyond'" % port]
    assert client.request(path="/next")[0] == 200  # (the connection goes on)


def _head_streaming_app(environ, start_response):
    start_response("200 OK", [("Content-Type", "text/plain")])  # no Content-Length
    return iter([b"streamed"])


def test_head_without_content_length_sends_no_body(stack):
    s = stack(routes({"/stream": _head_streaming_app}))
    client = s.client()
    status, _, body = client.request("HEAD", "/stream")
    assert status == 200 and body == b""
    status, _, body = client.request(path="/next")
    assert (status, body) == (200, b"ok /next")


class _EndlessHeadWorker(Worker):
    """A worker of the release before, which drew on the endless body of
    a HEAD and sent End only once it ended: its head, then nothing more,
    or (``chunks``) body bytes, until the LB cancels (``cancelled``)."""

    chunks = False

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.cancelled = gevent.event.Event()

    def handle_request(self, connection, exchange):
        self.requests.spawn(self._answer, exchange)  # (killed as the stack closes)

    def _answer(self, exchange):
        if exchange.receive().environ.get("REQUEST_METHOD") != "HEAD":
            exchange.respond("200 OK", [("Content-Length", "2")], b"ok", True)
            return
        exchange.respond("200 OK", [("Content-Type", "application/octet-stream")])
        try:
            for _ in range(2000 if self.chunks else 1):  # (bounded: 2 MiB, or 5 s)
                if self.chunks:
                    exchange.send_body(b"e" * 1024)
                    gevent.sleep(0.001)
                else:
                    exchange.receive(timeout=5)  # (only a Cancel can come now)
        except errors.RequestCancelled:
            self.cancelled.set()
        except (errors.ZcLbError, gevent.Timeout):
            pass  # (the LB went, or never cancelled: the test failed already)


@pytest.mark.parametrize("chunks", [False, True], ids=["silent", "chunks"])
@pytest.mark.parametrize("wsgi", [False, True], ids=["standalone", "embedded"])
def test_a_head_an_older_worker_draws_on_is_ended_by_the_lb_with_its_head(
        stack, caplog, chunks, wsgi):
    # A worker of the release before sends a HEAD's End only once the
    # application's body ends: for an endless one, the client had no head
    # and its connection no next response until response_timeout (a
    # 504), and the request held its worker; with body bytes, the LB
    # cut them as a body "past the length its head gives".
    s = stack(ok_app, worker_class=_EndlessHeadWorker, wsgi=wsgi)
    s.worker.chunks = chunks
    client = s.client(timeout=2.0)
    with caplog.at_level(logging.WARNING):
        status, headers, body = client.request("HEAD", "/endless")
        assert (status, headers["content-type"], body) == (200, "application/octet-stream", b"")
        assert s.worker.cancelled.wait(2.0), "the LB left the worker on the HEAD"
        assert client.request(path="/next")[::2] == (200, b"ok")  # (the connection goes on)
        poll(lambda: s.lb.in_flight == 0 and s.backlog() == 0 and s.streams() == 0,
             timeout=2, message="in_flight, backlog and streams back to 0")
    assert _said(caplog, "zc_lb") == []
    assert s.lb.fleet.worker_failures == 0


def _head_written_app(environ, start_response):
    # The legacy write(): the head goes out with it (a HEAD's at once, its
    # body going nowhere), and the application works on before it returns.
    write = start_response("200 OK", [("Content-Type", "text/plain"),
                                      ("Content-Length", "7")])
    write(b"written")
    (time.sleep if environ["wsgi.multithread"] else gevent.sleep)(0.05)
    return []


@pytest.mark.parametrize("threads", [None, 2], ids=["greenlets", "threads"])
def test_a_head_the_lb_ends_once_its_head_came_is_served_on_its_worker(
        stack, caplog, threads):
    # The LB cancels a HEAD's request on its worker once it has the head,
    # unless its End came with it.  An application that answers through
    # write() and works on sends the head before the End: its worker
    # counted each such HEAD as failed, left it out of its résumé and
    # logged that it "ended early", though the client had all a HEAD gets.
    s = stack(routes({"/written": _head_written_app}), worker_kw={"threads": threads})
    client = s.client(timeout=2.0)
    serving = s.worker.serving
    with caplog.at_level(logging.DEBUG):
        for n in range(1, 4):
            assert client.request("HEAD", "/written")[::2] == (200, b"")
            poll(lambda: serving.served + serving.failed == n, timeout=2,
                 message="HEAD %d counted on the worker" % n)
        assert client.request(path="/next")[::2] == (200, b"ok /next")  # (still in sync)
        poll(lambda: serving.served + serving.failed == 4, timeout=2, message="GET counted")
    status = s.worker.status()
    assert (status["served"], status["failed"]) == (4, 0)
    assert sum(status["latency"]["counts"]) == 4
    assert "a.example" in status["resume"]
    assert [r.getMessage() for r in caplog.records if r.name.startswith("zc_lb.worker")
            and r.levelno >= logging.INFO and "ended early" in r.getMessage()] == []


# -- request bodies -------------------------------------------------------------


def test_413_closes_the_connection_instead_of_reading_the_body(stack):
    s = stack(ok_app, max_request_body=1000)
    client = s.client()
    client.send(b"POST /up HTTP/1.1\r\nHost: a.example\r\nContent-Length: 10000000000\r\n"
                b"\r\n" + b"x" * 10000)
    status, headers, _ = client.response("POST")
    assert status == 413
    assert client.closed_by_server(2.0), "the LB waits for 10 GB it already refused"


def _body_length_app(environ, start_response):
    body = b"%d" % len(environ["wsgi.input"].read())
    start_response("200 OK", [("Content-Length", str(len(body)))])
    return [body]


def test_a_chunked_body_is_held_to_max_request_body_as_it_comes(stack):
    # (only a Content-Length was checked: any chunked body went through)
    s = stack(routes({"/len": _body_length_app, "/echo": _line_echo_app}),
              max_request_body=10)
    head = b"POST /%s HTTP/1.1\r\nHost: a.example\r\nTransfer-Encoding: chunked\r\n\r\n"
    client = s.client()
    client.send(head % b"len" + b"a\r\n0123456789\r\n0\r\n\r\n")
    assert client.response("POST")[::2] == (200, b"10")  # (at the limit)
    client.send(head % b"len" + b"b\r\n0123456789a\r\n0\r\n\r\n")  # all come at once
    assert client.response("POST")[0] == 413 and client.closed_by_server(2.0)
    client = s.client()
    client.send(head % b"len" + b"6\r\n012345\r\n")  # coming, then over the limit
    gevent.sleep(0.1)
    client.send(b"6\r\n6789ab\r\n")
    assert client.response("POST")[0] == 413 and client.closed_by_server(2.0)
    client = s.client()
    client.send(head % b"echo" + b"6\r\nline1\n\r\n")  # the response under way
    gevent.sleep(0.1)
    client.send(b"6\r\nline2\n\r\n")
    assert client.closed_by_server(2.0)
    poll(lambda: s.lb.in_flight == 0, timeout=2, message="the request ended on its worker")


def test_malformed_chunked_upload_gets_400(stack):
    s = stack(ok_app)
    client = s.client(timeout=3)
    client.send(b"POST /up HTTP/1.1\r\nHost: a.example\r\nTransfer-Encoding: chunked\r\n\r\n"
                b"5\r\nabcdeXX")  # no CRLF after the chunk data
    try:
        status, _, _ = client.response("POST")
    except (socket.timeout, OSError, http.client.HTTPException) as exc:
        pytest.fail("no response to a malformed chunked body: %r" % exc)
    assert status == 400


def test_a_clients_bad_or_too_large_body_is_said_at_info_not_as_a_warning(stack, caplog):
    # A body refused for what the client sent (a bad chunk: 400; over
    # --max-request-body: 413) was a WARNING from the balancer, while a
    # refused head is one INFO line (docs/reference/http.rst): any client
    # could fill an operator's warnings.
    s = stack(ok_app, max_request_body=10)
    with caplog.at_level(logging.INFO, logger="zc_lb"):
        client = s.client(timeout=3)
        client.send(b"POST /bad HTTP/1.1\r\nHost: a.example\r\nTransfer-Encoding: chunked\r\n"
                    b"\r\n5\r\nabcdeXX")
        assert client.response("POST")[0] == 400
        client = s.client(timeout=3)
        client.send(b"POST /big HTTP/1.1\r\nHost: a.example\r\nContent-Length: 11\r\n\r\n")
        assert client.response("POST")[0] == 413
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "zc_lb.lb.balancer"]
    assert [text.split(":")[0] for _, text in said] == ["400 for POST /bad", "413 for POST /big"]
    assert {level for level, _ in said} == {logging.INFO}


def _line_echo_app(environ, start_response):
    # A streaming (full-duplex) app: one output line per input line.
    start_response("200 OK", [("Content-Type", "text/plain")])
    return (line.upper() for line in environ["wsgi.input"])


def test_streaming_app_that_answers_while_reading_gets_the_whole_body(stack):
    s = stack(routes({"/echo": _line_echo_app}))
    lines = b"".join(b"line %06d\n" % i for i in range(30000))  # 360 kB > one upload chunk
    client = s.client(timeout=4)
    try:
        status, _, body = client.request("POST", "/echo", body=lines)
    except (socket.timeout, OSError, http.client.HTTPException) as exc:
        pytest.fail("hung: %r (LB in_flight=%d)" % (exc, s.lb.in_flight))
    assert status == 200 and body == lines.upper()


def test_transfer_encoding_not_ending_in_chunked_is_refused(stack):
    s = stack(ok_app)
    client = s.client(timeout=2)
    inner = b"GET /smuggled HTTP/1.1\r\nHost: a.example\r\n\r\n"
    client.send(b"POST /outer HTTP/1.1\r\nHost: a.example\r\n"
                b"Transfer-Encoding: gzip, chunked\r\n\r\n"
                + b"%x\r\n" % len(inner) + inner + b"\r\n0\r\n\r\n")
    status, _, body = client.response("POST")
    assert status in (400, 501), (status, body)


def test_conflicting_content_lengths_are_refused(stack):
    s = stack(ok_app)
    client = s.client(timeout=2)
    client.send(b"POST /outer HTTP/1.1\r\nHost: a.example\r\nContent-Length: 0\r\n"
                b"Content-Length: 44\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: a.example\r\n\r\n")
    status, _, body = client.response("POST")
    assert status == 400, (status, body)


# -- worker lifecycle and the LB <-> worker connection --------------------------


def _raw_lb(worker_address, rcvbuf=None):
    """An LB-side Connection, handshaken but not started: the test reads
    its socket itself."""
    sock = gevent.socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(5)
    sock.connect(worker_address)
    connection = Connection(sock, "lb", Handler(), peer="worker")
    connection.handshake(5)
    return connection


def _read_until_eof(connection, timeout=5.0):
    """Every message the worker sends until it closes."""
    messages = []
    deadline = time.monotonic() + timeout
    proto, sock = connection.protocol, connection.sock
    while time.monotonic() < deadline:
        while True:
            message = proto.next_event()
            if message is decoder.NEED_DATA:
                break
            messages.append(message)
        try:
            data = sock.recv(65536)
        except (ConnectionResetError, socket.timeout):
            break
        if not data:
            break
        proto.receive_data(data)
    return messages


def test_worker_stop_serves_a_request_sent_before_the_goaway_was_read():
    worker = Worker(ok_app)
    worker.start()
    try:
        connection = _raw_lb(worker.address)
        poll(lambda: len(worker.lbs.connections) == 1)
        environ = {"REQUEST_METHOD": "POST", "PATH_INFO": "/in-transit"}
        connection.sock.sendall(connection.protocol.start_request(environ, end=True)[1])
        worker.stop(timeout=2)  # SIGTERM is handled before the reader saw the bytes
        messages = _read_until_eof(connection)
        assert any(isinstance(m, GoAway) for m in messages)
        assert any(isinstance(m, Response) and m.rno == 1 for m in messages), messages
    finally:
        worker.stop(timeout=0.1)


def _big_app(environ, start_response):
    body = b"b" * 200000  # within one window of credit: queued at once
    start_response("200 OK", [("Content-Length", str(len(body)))])
    return [body]


def test_worker_stop_delivers_finished_responses_whole():
    worker = Worker(_big_app)
    worker.start()
    try:
        connection = _raw_lb(worker.address, rcvbuf=4096)  # a busy LB: reads slowly
        poll(lambda: len(worker.lbs.connections) == 1)
        n = 40  # 8 MB of finished responses: more than the kernel buffers hold
        connection.sock.sendall(b"".join(
            connection.protocol.start_request({"PATH_INFO": "/big"}, end=True)[1]
            for _ in range(n)))
        poll(lambda: worker.serving.served == n, message="the apps finished")
        stopper = gevent.spawn(worker.stop, 2)
        messages = _read_until_eof(connection)
        stopper.join(3)
        # A response comes whole (one frame) or in parts: count both ways.
        received = sum(len(m.data) if isinstance(m, Body) else len(m.body)
                       for m in messages if isinstance(m, (Body, Response)))
        ended = sum(1 for m in messages if isinstance(m, End) or getattr(m, "end", False))
        assert (received, ended) == (n * 200000, n)
    finally:
        worker.stop(timeout=0.1)


def _slow_app(environ, start_response):
    gevent.sleep(float(environ.get("QUERY_STRING") or 0.5))
    data = environ["wsgi.input"].read()
    body = b"slept, read %d" % len(data)
    start_response("200 OK", [("Content-Length", str(len(body)))])
    return [body]


def test_removing_a_worker_lets_its_requests_in_flight_finish(stack):
    s = stack(routes({"/slow": _slow_app}))
    client = s.client()
    job = gevent.spawn(client.request, "POST", "/slow", body=b"payload")
    poll(lambda: s.lb.in_flight == 1)
    gevent.sleep(0.1)  # the worker is running the app
    s.lb.fleet.set_workers([])  # what LBMembership does when the worker deregisters
    status, _, body = job.get(timeout=5)
    assert (status, body) == (200, b"slept, read 7")


def test_request_numbers_running_out_recycle_the_connection(stack):
    s = stack(ok_app)
    link = next(iter(s.lb.fleet.links.values()))
    link.connection.protocol.last_rno = frames.MAX_RNO  # as after 2**32 - 1 requests
    client = s.client()
    status, _, body = client.request(path="/after")
    assert (status, body) == (200, b"ok /after")
    assert s.streams() == 0


def test_decoder_buffer_stays_bounded_while_streaming():
    frame = encoder.encode(Body(1, b"d" * 1000))
    reader = decoder.Decoder()
    reader.receive_data(frame[:500])  # reads that always end mid-frame
    tail = frame[500:]
    peak = 0
    for _ in range(10000):  # 10 MB through the decoder
        reader.receive_data(tail + frame[:500])
        while reader.next_message() is not decoder.NEED_DATA:
            pass
        peak = max(peak, len(reader._buffer))
    assert peak < 1024 * 1024, "decoder holds %d bytes for a 500-byte partial frame" % peak


def _hang_app(environ, start_response):
    gevent.sleep(3600)
    start_response("200 OK", [])
    return [b"late"]


def test_client_leaving_a_hung_request_frees_it(stack):
    s = stack(routes({"/hang": _hang_app}))
    client = s.client()
    client.send(b"GET /hang HTTP/1.1\r\nHost: a.example\r\n\r\n")
    poll(lambda: s.lb.in_flight == 1)
    client.close()
    poll(lambda: s.lb.in_flight == 0 and s.backlog() == 0 and not s.worker.requests,
         timeout=3, message="the abandoned request to be cancelled")



def test_a_client_that_pipelined_a_request_then_hung_up_has_its_request_cancelled(stack):
    # (bytes behind the slow request, as a TLS client's close_notify is, were
    # taken for a client still there, and its hang-up behind them never seen)
    s = stack(routes({"/hang": _hang_app}))
    client = s.client()
    client.send(b"GET /hang HTTP/1.1\r\nHost: a.example\r\n\r\n")
    poll(lambda: s.lb.awaiting.watchers, message="the client watched")
    client.send(b"GET /next HTTP/1.1\r\nHost: a.example\r\n\r\n")
    client.close()
    poll(lambda: s.lb.in_flight == 0 and s.backlog() == 0 and not s.worker.requests,
         timeout=3, message="the abandoned request to be cancelled")


def _read_content_length_app(environ, start_response):
    # The idiom of countless apps (and of cgi/multipart parsers): one read
    # of CONTENT_LENGTH bytes.  pywsgi, gunicorn, waitress and mod_wsgi all
    # return the whole body here.
    data = environ["wsgi.input"].read(int(environ["CONTENT_LENGTH"]))
    body = b"%d" % len(data)
    start_response("200 OK", [("Content-Length", str(len(body)))])
    return [body]


def test_wsgi_input_read_of_content_length_returns_the_whole_body(stack):
    s = stack(routes({"/upload": _read_content_length_app}))
    status, _, body = s.client().request("POST", "/upload", body=b"x" * 600000)
    assert (status, body) == (200, b"600000")


def _write_callable_app(environ, start_response):
    write = start_response("200 OK", [("Content-Length", "600000")])
    write(b"w" * 300000)  # PEP 3333's write(), from the pool thread
    write(b"w" * 300000)
    return []


def test_threaded_worker_supports_the_write_callable(stack):
    s = stack(routes({"/write": _write_callable_app}), worker_kw={"threads": 2})
    client = s.client(timeout=4)
    try:
        status, _, body = client.request(path="/write")
    except (OSError, http.client.HTTPException) as exc:
        pytest.fail("truncated: %r" % exc)
    assert status == 200 and body == b"w" * 600000


# -- real processes -------------------------------------------------------------


def test_lb_sigterm_tells_keepalive_clients_to_close():
    worker = WorkerProcess("apps:app", env=ENV).start()
    lb = LBProcess([worker.address], "--drain-timeout", "3").start()
    try:
        host, port = lb.address.split(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=5)
        deadline = time.monotonic() + 5
        while True:  # wait for the LB to reach the worker
            connection.request("GET", "/", headers={"Host": "k.example"})
            response = connection.getresponse()
            response.read()
            if response.status == 200 or time.monotonic() > deadline:
                break
        assert response.status == 200
        signalled = time.monotonic()
        lb.process.send_signal(signal.SIGTERM)
        outcome = None
        while outcome is None and time.monotonic() - signalled < 5:
            try:  # a busy keep-alive client (a proxy's pooled connection, say)
                connection.request("GET", "/slow?0.2", headers={"Host": "k.example"})
                response = connection.getresponse()
                response.read()
            except (OSError, http.client.HTTPException) as exc:
                outcome = "request failed after %.1fs: %r" % (time.monotonic() - signalled, exc)
                break
            if (response.getheader("Connection") or "").lower() == "close":
                outcome = "close"
        assert outcome == "close", outcome
        assert lb.process.wait(3) == 0
    finally:
        lb.kill()
        worker.kill()


# -- requests as heads, or as JSON environs ----------------------------------------


def _mixed_app(environ, start_response):
    path = environ["PATH_INFO"]
    if path == "/stream":
        start_response("200 OK", [])
        return (b"chunk %d\n" % i for i in range(3))
    if path == "/echo":
        body = environ["wsgi.input"].read()
        start_response("200 OK", [("Content-Length", str(len(body)))])
        return [body]
    if path == "/empty":
        start_response("204 No Content", [])
        return []
    return ok_app(environ, start_response)


@pytest.mark.parametrize("wsgi", [False, True], ids=["heads", "environs"])
def test_every_kind_of_response_gets_through(stack, wsgi):
    s = stack(_mixed_app, wsgi=wsgi)
    assert (s.front.server.forwarder is None) == wsgi  # (no Relay: no head to send)
    client = s.client()
    assert client.request(path="/page")[::2] == (200, b"ok /page")
    assert client.request("HEAD", "/page")[::2] == (200, b"")
    assert client.request(path="/stream")[::2] == (200, b"chunk 0\nchunk 1\nchunk 2\n")
    assert client.request("POST", "/echo", body=b"x" * 100000)[::2] == (200, b"x" * 100000)
    assert client.request(path="/empty")[::2] == (204, b"")
    poll(lambda: s.lb.in_flight == 0 and s.backlog() == 0 and s.streams() == 0,
         timeout=2, message="every request over")


def _environ_app(environ, start_response):
    """The environ's strings, as JSON (less what differs by connection)."""
    seen = {k: v for k, v in environ.items()
            if type(v) is str and k not in ("REMOTE_PORT", "SERVER_PORT", "zc_lb.worker")}
    seen["wsgi.input"] = type(environ["wsgi.input"]).__name__
    seen["wsgi.version"] = environ["wsgi.version"]
    seen["wsgi.body"] = environ["wsgi.input"].read().decode()
    body = json.dumps(seen, sort_keys=True).encode()
    start_response("200 OK", [("Content-Length", str(len(body)))])
    return [body]


def test_a_worker_builds_from_a_head_the_environ_a_json_one_gives(stack):
    # A request relayed as its head (relay.py) gives the application the
    # environ that the LB run as a plain WSGI application sends as JSON.
    requests = [
        ("GET", "/a%20b?x=1", "a.example", b"", ()),
        ("GET", "/", "www.b.example:8080", b"", (("Accept", "*/*"), ("Cookie", "a=1"),
                                                  ("Cookie", "b=2"))),
        ("GET", "/hop", "a.example", b"", (("Connection", "X-Private, keep-alive"),
                                           ("X-Private", "p"), ("Keep-Alive", "5"),
                                           ("X-Forwarded-For", "1.2.3.4"))),
        ("POST", "/form", "a.example", b"a=1&b=2", (("Content-Type", "text/plain"),)),
        ("HEAD", "/h", "a.example", b"", (("X_Underscore", "dropped"),)),
    ]
    seen = {}
    for wsgi in (False, True):
        s = stack(_environ_app, wsgi=wsgi)
        client = s.client()
        seen[wsgi] = [client.request(*request)[::2] for request in requests]
    assert seen[False] == seen[True]
    environs = [json.loads(body) for status, body in seen[False] if body]
    assert [e["PATH_INFO"] for e in environs] == ["/a b", "/", "/hop", "/form"]
    assert environs[1]["HTTP_COOKIE"] == "a=1,b=2" and environs[0]["wsgi.version"] == [1, 0]
    assert "HTTP_X_PRIVATE" not in environs[2] and "HTTP_KEEP_ALIVE" not in environs[2]
    assert environs[3]["wsgi.body"] == "a=1&b=2" and environs[3]["CONTENT_LENGTH"] == "7"


def test_a_peer_that_floods_pings_loses_its_link_and_stalls_no_one(tmp_path):
    """A peer on a worker address (a buggy or compromised worker, or
    anything that answers there without --secret-file) completes the
    handshake and floods Pings.  Its link alone breaks, and requests to
    the good worker meanwhile wait no more than half a second."""
    import subprocess
    import sys

    from zc_lb.testing import LBProcess, WorkerProcess, http_get

    flooder = subprocess.Popen([sys.executable, str(Path(__file__).parent / "ping_flooder.py")],
                               stdout=subprocess.PIPE, text=True)
    good = WorkerProcess("apps:app", env={"PYTHONPATH": str(Path(__file__).parent)}).start()
    stderr = open(tmp_path / "lb.stderr", "w")
    lb = None
    try:
        flood_address = flooder.stdout.readline().split()[-1]
        lb = LBProcess([good.address, flood_address], stderr=stderr).start()
        worst, deadline = 0.0, time.monotonic() + 3
        count = 0
        while time.monotonic() < deadline and count < 2000:  # (bounded in time and count)
            started = time.monotonic()
            status, _ = http_get(lb.address, "/")
            assert status == 200
            worst = max(worst, time.monotonic() - started)
            count += 1
        assert worst < 0.5, worst
        sent = flooder.stdout.readline()  # (the flood ends when the LB hangs up)
        assert sent.startswith("sent "), sent
        stderr.flush()
        log = (tmp_path / "lb.stderr").read_text()
        assert "a flood of Pings" in log, log[-2000:]
    finally:
        if lb is not None:
            lb.kill()
        good.kill()
        flooder.kill()
        flooder.wait()
        stderr.close()


# -- the fleet under failure: health checks, readmission, removal -------------


def _held(gate):
    def app(environ, start_response):
        gate.wait(20)
        start_response("200 OK", [("Content-Length", "2")])
        return [b"ok"]
    return app


BIG_PAGE = b"x" * (300 * 1024)  # (over a stream's window of credit)


def _big_page(environ, start_response):
    start_response("200 OK", [("Content-Length", str(len(BIG_PAGE)))])
    return [BIG_PAGE]


def test_a_health_page_larger_than_the_window_passes_and_leaves_nothing_open(stack):
    s = stack(routes({"/health": _big_page}), outlier={"max_share": 1.0})
    fleet = s.lb.fleet
    fleet.start_health_checks("/health", interval=0.05, timeout=0.5)
    poll(lambda: fleet.health_checks >= 8, message="eight checks")
    assert fleet.worker_failures == 0
    poll(lambda: s.streams() == 0, message="every check's stream ended")


def test_a_health_check_that_times_out_is_cancelled_at_the_worker(stack):
    gate = gevent.event.Event()
    s = stack(routes({"/health": _held(gate)}), outlier={"max_share": 1.0})
    fleet = s.lb.fleet
    fleet.start_health_checks("/health", interval=0.05, timeout=0.1)
    poll(lambda: fleet.health_checks >= 5, message="five checks")
    assert fleet.worker_failures >= 5
    assert s.streams() <= 2  # (at most the checks under way, not one more each time)
    gate.set()


def _draining(s, gate):
    """A request held on the first worker, which is then stopped (GoAway):
    its link and connection, draining."""
    link = s.lb.fleet.links["127.0.0.1:%d" % s.worker.address[1]]
    connection = link.connection
    gevent.spawn(s.client().request, "GET", "/hold")
    poll(lambda: s.worker.requests and len(s.worker.requests) == 1, message="held")
    gevent.spawn(s.worker.stop, 10)
    poll(lambda: link.draining is connection, message="draining")
    return link, connection


def test_a_draining_worker_is_not_health_checked_into_ejection(stack):
    gate = gevent.event.Event()
    s = stack(routes({"/hold": _held(gate)}), outlier={"max_share": 1.0})
    link, connection = _draining(s, gate)
    s.lb.fleet.start_health_checks("/", interval=0.05, timeout=0.5)
    gevent.sleep(0.5)
    assert s.lb.fleet.worker_failures == 0
    assert not s.lb.fleet.ejector.ejected(connection.peer)
    gate.set()


def test_an_ejection_ending_while_its_worker_drains_does_not_readmit_it(stack):
    gate = gevent.event.Event()
    s = stack(routes({"/hold": _held(gate)}), n_workers=2, outlier={"max_share": 1.0})
    fleet = s.lb.fleet
    link = fleet.links["127.0.0.1:%d" % s.worker.address[1]]
    connection = link.connection
    other = [address for address in fleet.links if address != connection.peer][0]
    fleet.drain_worker(other)  # (so that the held request goes to the first)
    _draining(s, gate)  # (a request on it, then the operator restarts it)
    fleet.enable_worker(other)
    for _ in range(5):  # (it had failed: ejected)
        fleet.outcome(connection, ok=False)
    assert fleet.ejector.ejected(connection.peer) and connection not in s.lb.pool
    fleet.readmit(time.monotonic() + 3600)  # its ejection time is up
    assert connection not in s.lb.pool
    fleet.outcome(connection, ok=False)  # (on probation: ejected again)
    fleet.enable_worker(connection.peer)  # nor by an operator's word
    assert connection not in s.lb.pool
    assert s.client().request("POST", "/x", body=b"data")[0] == 200  # (the other worker)
    gate.set()


def test_a_request_none_of_which_was_sent_goes_to_another_worker_whatever_its_method(stack):
    s = stack(ok_app, n_workers=2)
    lb = s.lb
    first = next(iter(lb.pool.order()))  # (the worker the pool chooses next)
    first.protocol.peer_goes_away = True  # (its GoAway on its way: the pool has not heard)
    statuses = [s.client().request("POST", "/x", body=b"data")[0] for _ in range(3)]
    assert statuses == [200] * 3
    assert lb.counters.retries == 1 and first not in lb.pool
    assert lb.fleet.worker_failures == 0  # (its worker failed nothing)


def test_response_timeouts_count_toward_ejecting_their_worker(stack):
    gate = gevent.event.Event()
    s = stack(routes({"/hung": _held(gate)}), n_workers=2, response_timeout=0.1,
              outlier={"max_share": 1.0})
    statuses = [s.client().request("GET", "/hung")[0] for _ in range(6)]
    assert statuses == [504] * 6
    assert s.lb.fleet.worker_failures == 6
    assert s.lb.fleet.ejector.total_ejections >= 1
    gate.set()


def test_a_removed_workers_ejection_does_not_hold_back_another(stack):
    s = stack(ok_app, n_workers=3)  # (max_ejected: half of them, one)
    fleet = s.lb.fleet
    a, b, c = (fleet.links[address].connection for address in sorted(fleet.links))
    for _ in range(5):
        fleet.outcome(a, ok=False)
    assert fleet.ejector.ejected(a.peer)
    fleet.set_workers([b.peer, c.peer])  # (a deregistered)
    for _ in range(5):
        fleet.outcome(b, ok=False)
    assert fleet.ejector.ejected(b.peer)


def test_a_removed_workers_requests_ending_after_it_went_leave_no_ejection(stack):
    gate = gevent.event.Event()
    s = stack(routes({"/hold": _held(gate)}), n_workers=3)  # (max_ejected: half, one)
    fleet, ejector = s.lb.fleet, s.lb.fleet.ejector
    held = gevent.spawn(s.client().request, "GET", "/hold")
    poll(lambda: s.lb.in_flight == 1, message="held")
    connections = [link.connection for link in fleet.links.values()]
    a = next(connection for connection in connections if connection.protocol.streams)
    b, c = (connection for connection in connections if connection is not a)
    fleet.set_workers([b.peer, c.peer])  # (a deregistered, its request still in flight)
    gate.set()
    assert held.get(timeout=5)[0] == 200  # (it ends well after a went)
    assert a.peer not in ejector.records
    for _ in range(5):  # (others fail as its connection closes)
        fleet.outcome(a, ok=False)
    assert a.peer not in ejector.records  # (nothing left of it, nor counted in the share)
    for _ in range(5):
        fleet.outcome(b, ok=False)
    assert ejector.ejected(b.peer)


def test_workers_ejected_before_any_request_are_readmitted_in_time(stack):
    # (ejected by health checks, say, with no request forwarded yet: the
    # LB's chores, which readmit, must run all the same)
    s = stack(ok_app, n_workers=2, outlier={"max_share": 1.0, "base_time": 0.1})
    fleet = s.lb.fleet
    connections = [link.connection for link in fleet.links.values()]
    for connection in connections:
        for _ in range(5):
            fleet.outcome(connection, ok=False)
    assert not len(s.lb.pool)
    poll(lambda: len(s.lb.pool) == 2, timeout=2, message="readmitted")


def test_a_worker_back_in_the_pool_counts_its_requests_still_in_flight(stack):
    gate = gevent.event.Event()
    s = stack(routes({"/hold": _held(gate)}))
    fleet, pool = s.lb.fleet, s.lb.pool
    connection = next(iter(fleet.links.values())).connection
    held = [gevent.spawn(s.client().request, "POST", "/hold", body=b"x") for _ in range(3)]
    poll(lambda: s.lb.in_flight == 3, message="three in flight")
    fleet.drain_worker(connection.peer)  # (or silent, then heard)
    fleet.enable_worker(connection.peer)
    assert pool.workers[connection].backlog == 3
    gate.set()
    gevent.joinall(held, timeout=5)
    assert pool.workers[connection].backlog == 0 and pool.backlog == 0


def test_a_failure_on_an_old_connection_ejects_the_workers_current_one_too(stack):
    s = stack(ok_app, n_workers=2, outlier={"max_share": 1.0})
    fleet = s.lb.fleet
    link = fleet.links["127.0.0.1:%d" % s.worker.address[1]]
    current = link.connection
    old, other = connection_pair(Handler(), Handler())  # (an earlier connection, ending)
    old.peer = current.peer
    try:
        for _ in range(5):  # (its requests in flight failed: the address is ejected)
            fleet.outcome(old, ok=False)
        assert fleet.ejector.ejected(current.peer) and current not in s.lb.pool
    finally:
        old.close()
        other.close()


def _read_all(environ, start_response):
    body = b"%d" % len(environ["wsgi.input"].read())
    start_response("200 OK", [("Content-Length", str(len(body)))])
    return [body]


def test_a_slow_upload_that_moves_is_no_response_timeout(stack):
    s = stack(routes({"/up": _read_all}), response_timeout=0.4)
    client = s.client()
    client.send(b"POST /up HTTP/1.1\r\nHost: a.example\r\nContent-Length: 10\r\n\r\n")
    for _ in range(10):  # (a byte every 0.1 s: a second in all)
        client.send(b"x")
        gevent.sleep(0.1)
    assert client.response("POST")[::2] == (200, b"10")
    assert s.lb.fleet.worker_failures == 0


def _refuse(environ, start_response):
    start_response("413 Content Too Large", [("Content-Length", "9")])
    return [b"too large"]


def test_an_answer_before_the_body_came_says_the_connection_closes(stack):
    s = stack(routes({"/up": _refuse}))
    client = s.client()
    client.send(b"POST /up HTTP/1.1\r\nHost: a.example\r\nContent-Length: 5000000\r\n\r\n")
    # (past what the LB holds before it sends the request on: --buffer-request)
    client.send(b"x" * (LB_SETTINGS["buffer_request"].default + 100_000))
    status, headers, _ = client.response("POST")
    assert status == 413 and headers.get("connection", "").lower() == "close"
    assert client.closed_by_server(2.0)


def test_no_body_is_asked_for_when_no_worker_can_take_it(stack):
    # A client that waits to be asked (Expect: 100-continue) was told to
    # send its body, which the LB read before it found no worker: up to
    # --buffer-request sent for a 503.  Now the 503 comes first.
    s = stack(ok_app, no_worker_timeout=0.3)
    s.lb.fleet.set_workers([])  # (the only worker deregistered)
    client = s.client()
    client.send(b"POST /up HTTP/1.1\r\nHost: a.example\r\nExpect: 100-continue\r\n"
                b"Content-Length: 100000\r\n\r\n")
    status, headers, _ = client.response("POST")
    assert status == 503 and headers.get("connection", "").lower() == "close"


def _count(environ, start_response):
    body = b"%d" % len(environ["wsgi.input"].read())
    start_response("200 OK", [("Content-Length", str(len(body)))])
    return [body]


def test_a_held_body_the_disk_cannot_give_back_is_a_500_not_a_wait(stack, monkeypatch):
    # A body held on disk before its request went on (--buffer-request)
    # whose file failed a read: the upload stopped without a word, and the
    # worker waited for the rest of the body until the response timeout.
    import zc_lb.lb.spool

    s = stack(routes({"/count": _count}), response_timeout=3.0,
              spool_limits=SpoolLimits(memory=4096, disk=10**6))
    client = s.client()
    assert client.request("POST", "/count", body=b"y" * 9000)[2] == b"9000"  # (it works)
    client = s.client()
    client.send(b"POST /count HTTP/1.1\r\nHost: a.example\r\nContent-Length: 400000\r\n\r\n")
    client.send(b"x" * 100_000)
    poll(lambda: s.lb.flight.spool_limits.in_memory, message="the first part held")
    failing = monkeypatch.setattr(zc_lb.lb.spool.os, "pread", _failing_pread)
    client.send(b"x" * 300_000)  # (on disk, past the 4 KiB of memory; sent in frames)
    started = time.monotonic()
    status, headers, _ = client.response("POST")
    assert status == 500, failing  # (the body had all come: the connection goes on)
    assert time.monotonic() - started < 2.0
    poll(lambda: s.lb.flight.spool_limits.on_disk == 0 and s.backlog() == 0,
         message="the held body given back, the worker's request ended")


def _failing_pread(fd, size, offset):
    raise OSError(5, "Input/output error")


class _HeadThenBody(Handler):
    """A worker side that sends a response's head at once and its body never."""

    def handle_request(self, connection, exchange):
        gevent.spawn(self.answer, exchange)

    def answer(self, exchange):
        exchange.receive()
        exchange.respond("200 OK", [("Content-Length", "100")])


def test_a_head_that_came_in_the_turn_its_request_timed_out_is_not_half_sent():
    from zc_lb.errors import ResponseTimeout
    from zc_lb.lb.awaiting import WATCHDOG_INTERVAL, Awaiting

    lb, worker = connection_pair(Handler(), _HeadThenBody())
    awaiting = Awaiting(0.1, lambda now: None)
    try:
        # The watchdog passes over a request whose head has come, however old.
        exchange = lb.open_request({}, end=True)
        poll(lambda: exchange.inbox, message="the head")
        awaiting.waiting[exchange] = (time.monotonic() - 10, None, None, False)
        awaiting.watchdog = gevent.spawn(awaiting._watch_slow_responses)
        gevent.sleep(WATCHDOG_INTERVAL * 1.5)
        assert exchange.error is None
        # One failed in the loop turn its head came: the failure, not the head.
        late = lb.open_request({}, end=True)
        poll(lambda: late.inbox, message="the head")
        late.fail(ResponseTimeout("no response within 0.1s"))
        with pytest.raises(ResponseTimeout):
            awaiting.receive(late, None, None, False, time.monotonic())
    finally:
        awaiting.stop()
        lb.close()
        worker.close()


def test_a_chore_that_fails_does_not_end_the_response_watchdog(caplog):
    from zc_lb.lb.awaiting import WATCHDOG_INTERVAL, Awaiting

    turns = []

    def tick(now):
        turns.append(now)
        if len(turns) == 1:
            raise RuntimeError("a bug in a chore")

    awaiting = Awaiting(1.0, tick)
    awaiting.watchdog = gevent.spawn(awaiting._watch_slow_responses)
    try:
        gevent.sleep(WATCHDOG_INTERVAL * 2.5)
        assert len(turns) >= 2 and "the LB's chores failed a turn" in caplog.text
    finally:
        awaiting.stop()


class _NoAnswer(Handler):
    """A worker side that takes requests and answers none."""

    def handle_request(self, connection, exchange):
        pass


def test_a_chore_failing_every_turn_does_not_stop_the_response_timeouts(caplog):
    from zc_lb.errors import ResponseTimeout
    from zc_lb.lb.awaiting import Awaiting

    def tick(now):
        raise RuntimeError("a bug in a chore, every time")

    lb, worker = connection_pair(Handler(), _NoAnswer())
    awaiting = Awaiting(0.1, tick)
    try:
        exchange = lb.open_request({}, end=True)
        with pytest.raises(ResponseTimeout):
            with gevent.Timeout(2):
                awaiting.receive(exchange, None, None, False, time.monotonic())
        assert "chores failed" in caplog.text
    finally:
        awaiting.stop()
        lb.close()
        worker.close()


def test_an_ejected_worker_comes_back_when_the_others_go_rather_than_no_worker_at_all(
        stack):
    # With one of two ejected (max_ejected: half) and the other gone, the
    # pool was empty until the ejection ended (30 s, up to 300): every
    # request waited for a 503 while a connected worker could serve.
    s = stack(ok_app, n_workers=2)
    fleet = s.lb.fleet
    ejected, other = (fleet.links["127.0.0.1:%d" % w.address[1]].connection
                      for w in s.workers)
    for _ in range(5):
        fleet.outcome(ejected, ok=False)
    assert fleet.ejector.ejected(ejected.peer) and ejected not in s.lb.pool
    s.workers[1].stop(timeout=0)  # (it goes: GoAway, then its connection)
    poll(lambda: other not in s.lb.pool, message="the other worker gone")
    assert ejected in s.lb.pool and not fleet.ejector.ejected(ejected.peer)
    assert fleet.ejector.records[ejected.peer].probation
    started = time.monotonic()
    assert s.client().request("GET", "/x")[0] == 200
    assert time.monotonic() - started < 1


def test_a_worker_is_not_ejected_when_the_others_are_down(stack):
    # Half of the workers known, but of none that could serve.
    s = stack(ok_app, n_workers=2)
    fleet = s.lb.fleet
    left, gone = (fleet.links["127.0.0.1:%d" % w.address[1]].connection for w in s.workers)
    s.workers[1].stop(timeout=0)
    poll(lambda: gone not in s.lb.pool, message="one worker gone")
    for _ in range(5):
        fleet.outcome(left, ok=False)
    assert not fleet.ejector.ejected(left.peer) and left in s.lb.pool


def test_a_pause_under_many_gets_is_one_failure_toward_ejection_not_one_a_get(stack):
    # Each GET moved off a worker fallen silent counted as a failure: a
    # two-second pause under six GETs ejected for 30 s a worker that spoke
    # again a moment later.
    gate = gevent.event.Event()
    s = stack(routes({"/hold": _held(gate)}), n_workers=2)
    fleet = s.lb.fleet
    paused, other = (fleet.links["127.0.0.1:%d" % w.address[1]].connection
                     for w in s.workers)
    fleet.drain_worker(other.peer)  # (so that the GETs go to the first)
    held = [gevent.spawn(s.client().request, "GET", "/hold") for _ in range(6)]
    poll(lambda: s.lb.in_flight == 6, message="six GETs held")
    fleet.enable_worker(other.peer)
    fleet.worker_silent(paused, 2.0)  # (as its keepalive tells after 2 s of silence)
    poll(lambda: s.lb.counters.retries == 6, message="the GETs moved")
    gate.set()
    assert [g.get(timeout=5)[0] for g in held] == [200] * 6
    assert not fleet.ejector.ejected(paused.peer)
    assert fleet.ejector.records[paused.peer].failures == 1
    fleet.worker_heard(paused)
    assert paused in s.lb.pool
