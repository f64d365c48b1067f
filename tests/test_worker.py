"""worker.py in process: PEP 3333 conformance, threads, app loading."""

import io
import math
import sys
import threading
import time
import wsgiref.validate

import gevent
import gevent.event
import gevent.socket
import pytest

from conftest import source_only
from zc_lb.wire.connection import Connection, Handler
from zc_lb.errors import ConfigurationError, RequestCancelled
from zc_lb.wire.decoder import head_fields
from zc_lb.wire.frames import End, LB_FEATURES
from zc_lb.wire.intake import ResumeIntake
from zc_lb.sockets import parse_address
from zc_lb.testing import read_body, read_response
from zc_lb.worker.server import Worker, load_app


class LBSide(Handler):
    def __init__(self):
        self.resumes = []
        self.keys = []
        self.goaway = gevent.event.Event()

    def handle_resume(self, connection, skills):
        self.resumes.append(skills)

    def handle_keys(self, connection, keys):
        self.keys.append(keys)

    def handle_goaway(self, connection, reason):
        self.goaway.set()


@pytest.fixture
def serve():
    started = []

    def make(app, **kw):
        worker = Worker(app, **kw)
        worker.start()
        sock = gevent.socket.create_connection(worker.address)
        handler = LBSide()
        # (every résumé as it comes: the LB's own bounds are wire/intake.py's)
        connection = Connection(sock, "lb", handler, peer="worker", intake=ResumeIntake(rate=math.inf))
        connection.handshake()
        connection.start()
        started.append((worker, connection))
        return worker, connection, handler

    yield make
    for worker, connection in started:
        connection.close()
        worker.stop(timeout=1)


def test_the_keys_an_lb_sent_go_to_the_other_lbs(serve):
    # frames.Keys: the worker relays them as they are, to every other LB.
    worker, first, first_side = serve(reader_app)
    others = []
    for _ in range(2):
        sock = gevent.socket.create_connection(worker.address)
        side = LBSide()
        connection = Connection(sock, "lb", side, peer="worker")
        connection.handshake()
        connection.start()
        others.append((connection, side))
    first.close()
    sock = gevent.socket.create_connection(worker.address)
    first = Connection(sock, "lb", first_side, peer="worker")
    first.handshake()
    first.start()
    keys = {"a.example": [1, 2**64 - 1], "b.example": [7]}
    first.send_keys(keys)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not all(side.keys for _, side in others):
        gevent.sleep(0.01)
    assert [side.keys for _, side in others] == [[keys], [keys]]
    assert first_side.keys == []
    for connection, _ in others:
        connection.close()
    first.close()


def stuck_lb(worker, lbs):
    """An LB's connection to ``worker`` that reads nothing until started
    (a 4 KB receive buffer), once the worker counts ``lbs`` LBs: it, its
    side, its address as the worker names it, and the worker's
    connection toward it (a 4 KB send buffer: no autotuning)."""
    import socket

    sock = gevent.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(worker.address)
    side = LBSide()
    stuck = Connection(sock, "lb", side, peer="worker", intake=ResumeIntake(rate=math.inf))
    stuck.handshake()
    deadline = time.monotonic() + 5
    while len(worker.lbs.connections) < lbs and time.monotonic() < deadline:
        gevent.sleep(0.01)
    local = "%s:%s" % sock.getsockname()[:2]
    [toward] = [c for c in worker.lbs.connections if c.peer == local]
    toward.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    return stuck, side, local, toward


def test_keys_skip_an_lb_that_takes_nothing_in_and_it_costs_the_worker_a_bounded_queue(
        serve, caplog):
    # An LB stuck with its connection open (its loop blocked, a SIGSTOP)
    # reads nothing for up to LB_SILENCE: the keys the other LBs send
    # every 50 ms queued for it all that while, without bound.
    import logging

    from zc_lb.worker.lbs import RELAY_BACKLOG

    worker, first, _ = serve(reader_app)
    sock = gevent.socket.create_connection(worker.address)
    side = LBSide()
    awake = Connection(sock, "lb", side, peer="worker")
    awake.handshake()
    awake.start()
    stuck, _, local, toward = stuck_lb(worker, 3)  # (never started: it reads nothing)
    keys = {"c": [2**64 - 1 - i for i in range(6000)]}  # (a frame of 126 KB)
    frames = 3 * RELAY_BACKLOG // 126000
    with caplog.at_level(logging.INFO, logger="zc_lb.worker.lbs"):
        for _ in range(frames):
            first.send_keys(keys)
            gevent.sleep(0)
        deadline = time.monotonic() + 10
        while len(side.keys) < frames and time.monotonic() < deadline:
            gevent.sleep(0.01)
        assert len(side.keys) == frames  # (an LB that reads gets every one)
        unsent = sum(len(piece) for piece in toward._writer._outgoing)
        assert unsent <= RELAY_BACKLOG + 130000
        lines = [r.getMessage() for r in caplog.records if "takes nothing in" in r.getMessage()]
        assert len(lines) == 1 and local in lines[0]
    awake.close()
    stuck.close()


def test_resumes_for_an_lb_that_takes_nothing_in_wait_the_newest_replacing_the_older(
        serve, caplog):
    # Each résumé queued for a stuck LB until its silence dropped it (60 s):
    # some hundreds of KB each, every few seconds, without bound.  Now one
    # waits, the newest, and goes once the LB reads again.
    import logging

    from zc_lb.worker.lbs import RELAY_BACKLOG

    worker, first, first_side = serve(reader_app)
    stuck, stuck_side, local, toward = stuck_lb(worker, 2)  # (not started yet: reads nothing)
    big = {"c%06d.example/some/path" % i: 1.5 for i in range(5000)}  # (~170 KB a frame)
    count = 3 * RELAY_BACKLOG // 170000
    with caplog.at_level(logging.INFO, logger="zc_lb.worker.lbs"):
        for n in range(count):
            worker.lbs.send_resume(dict(big, n=float(n + 1)))
            gevent.sleep(0)
        deadline = time.monotonic() + 10
        while len(first_side.resumes) < count + 1 and time.monotonic() < deadline:
            gevent.sleep(0.01)
        assert len(first_side.resumes) == count + 1  # (its greeting, then every one)
        unsent = sum(len(piece) for piece in toward._writer._outgoing)
        assert unsent <= RELAY_BACKLOG + 200000
        lines = [r.getMessage() for r in caplog.records if "takes nothing in" in r.getMessage()]
        assert len(lines) == 1 and local in lines[0] and "résumé" in lines[0]
        stuck.start()  # it reads again: the newest résumé comes, last
        deadline = time.monotonic() + 10
        while not (stuck_side.resumes and stuck_side.resumes[-1].get("n") == count) and (
                time.monotonic() < deadline):
            gevent.sleep(0.01)
        assert stuck_side.resumes[-1]["n"] == count
        assert len(stuck_side.resumes) < count
    stuck.close()


def call(connection, environ, body=b"", timeout=10):
    environ = dict({"REQUEST_METHOD": "GET", "PATH_INFO": "/", "SERVER_NAME": "x",
                    "SERVER_PORT": "80", "SERVER_PROTOCOL": "HTTP/1.1",
                    "wsgi.url_scheme": "http"}, **environ)
    exchange = connection.open_request(environ, end=not body)
    if body:
        exchange.send_body(body)
        exchange.send(End(exchange.rno))
    return read_response(exchange, timeout)


def reader_app(environ, start_response):
    """Uses every wsgi.input method, and streams its answer."""
    stream = environ["wsgi.input"]
    first = stream.readline()
    rest = stream.read(5)
    lines = stream.readlines()
    remaining = b"".join(stream)
    body = [b"class=" + environ["zc_lb.request_class"].encode() + b"\n", first, rest] + lines
    body.append(remaining)
    start_response("200 OK", [("Content-Type", "text/plain")])
    return iter(body)


@pytest.mark.filterwarnings("error::wsgiref.validate.WSGIWarning")
def test_the_app_runs_under_the_pep3333_validator(serve):
    worker, connection, _ = serve(wsgiref.validate.validator(reader_app))
    body = b"line one\nline two\nline three\n"
    start, data = call(connection, {"REQUEST_METHOD": "POST", "CONTENT_LENGTH": str(len(body)),
                                    "CONTENT_TYPE": "text/plain",
                                    "zc_lb.request_class": "v.example"}, body)
    assert start.status == "200 OK"
    assert data == b"class=v.example\n" + body


def test_a_head_response_has_no_body(serve):
    worker, connection, _ = serve(lambda e, s: (s("200 OK", [("Content-Length", "5")]), [b"hello"])[1])
    start, data = call(connection, {"REQUEST_METHOD": "HEAD"})
    assert ("Content-Length", "5") in head_fields(start.head) and data == b""


def test_hop_by_hop_headers_are_dropped(serve):
    def app(environ, start_response):
        start_response("200 OK", [("Connection", "close"), ("X-Kept", "1")])
        return [b"x"]

    worker, connection, _ = serve(app)
    start, _ = call(connection, {})
    assert [field for field in head_fields(start.head) if field[0] != "Date"] == [("X-Kept", "1")]


def test_an_exception_before_the_response_is_a_500(serve, caplog):
    def app(environ, start_response):
        raise ValueError("on purpose")

    worker, connection, _ = serve(app)
    start, data = call(connection, {})
    assert start.status.startswith("500")
    assert "on purpose" in caplog.text
    start, data = call(connection, {})  # still serving
    assert start.status.startswith("500")


@pytest.mark.parametrize("threads", [None, 2])
@pytest.mark.parametrize("exit", [SystemExit(3), KeyboardInterrupt()])
@pytest.mark.parametrize("where", ["call", "body"])
def test_an_application_that_raises_systemexit_gets_a_500_logged_where_it_was_raised(
        serve, caplog, threads, exit, where):
    # sys.exit() in a view (code shared with a command-line script) went
    # past the worker's handler: the LB got the request cancelled (a 502)
    # and, in thread mode, the log's traceback ended in gevent, not where
    # the application raised it.
    def raising(environ, start_response):
        if environ["PATH_INFO"] == "/ok":
            start_response("200 OK", [])
            return [b"ok"]
        if where == "call":
            raise exit
        start_response("200 OK", [])
        yield b"x"
        raise exit

    worker, connection, _ = serve(raising, threads=threads)
    if where == "call":
        start, data = call(connection, {})
        assert start.status.startswith("500")
    else:  # (a response cut short, as for any exception there)
        with pytest.raises(RequestCancelled):
            call(connection, {})
    assert "application error for /" in caplog.text
    assert "in raising" in caplog.text  # (the application's frame)
    assert "request greenlet failed" not in caplog.text
    start, data = call(connection, {"PATH_INFO": "/ok"})  # still serving
    assert start.status.startswith("200")


@pytest.mark.parametrize("threads", [None, 2])
@pytest.mark.parametrize("body", [["text"], [None], [bytearray(b"x")], [memoryview(b"x")]])
def test_a_body_that_is_not_bytes_is_the_applications_500(serve, caplog, threads, body):
    # PEP 3333 bodies are bytes.  A str once went down to the protocol,
    # broke the response half-made and came out as a 502 blaming the
    # worker; a bytearray went through from the source and failed compiled.
    def app(environ, start_response):
        if environ["PATH_INFO"] == "/write":
            start_response("200 OK", [])(body[0])
            return []
        start_response("200 OK", [])
        return body

    worker, connection, _ = serve(app, threads=threads)
    for path in ("/", "/write"):
        start, data = call(connection, {"PATH_INFO": path})
        assert start.status.startswith("500")
    assert "response body must be bytes, not %s" % type(body[0]).__name__ in caplog.text
    start, data = call(connection, {})  # still serving
    assert start.status.startswith("500")


@pytest.mark.parametrize("threads", [None, 2])
@pytest.mark.parametrize("status", [b"200 OK", None, 200])
def test_a_status_that_is_not_a_str_is_the_applications_500_said_alike_in_both_builds(
        serve, caplog, threads, status):
    # Compiled, the writer's typed attribute refused it with "str or None
    # object expected"; from the source it passed, and None passed for no
    # start_response at all.
    def app(environ, start_response):
        start_response(status, [])
        return [b"x"]

    worker, connection, _ = serve(app, threads=threads)
    start, data = call(connection, {})
    assert start.status.startswith("500")
    assert "status must be a str, not %s" % type(status).__name__ in caplog.text
    start, data = call(connection, {})  # still serving
    assert start.status.startswith("500")


class _CloseRaises:
    """A response whose close() raises (PEP 3333 calls it at the end)."""

    def __init__(self, blocks):
        self.blocks = blocks

    def __iter__(self):
        return iter(self.blocks)

    def close(self):
        raise RuntimeError("close failed on purpose")


@pytest.mark.parametrize("threads", [None, 2])
@pytest.mark.parametrize("blocks", [[b"whole"], [b"who", b"le"]])
def test_a_close_that_raises_is_the_applications_error_and_its_response_stands(
        serve, caplog, threads, blocks):
    # close() raising went past the application's handler: in thread mode
    # the whole response was cancelled (the client got a 502, or a
    # chunked body cut short), in greenlet mode it went, and both logged
    # "request greenlet failed", the worker's own failure.  gunicorn and
    # the front's own server log it and let the response stand.
    def app(environ, start_response):
        headers = [("Content-Length", "5")] if len(blocks) == 1 else []
        start_response("200 OK", headers)
        return _CloseRaises(blocks)

    worker, connection, _ = serve(app, threads=threads)
    start, data = call(connection, {})
    assert start.status == "200 OK" and data == b"whole"
    assert "application error closing the response to /" in caplog.text
    assert "close failed on purpose" in caplog.text
    assert "request greenlet failed" not in caplog.text
    start, data = call(connection, {})  # still serving
    assert start.status == "200 OK" and data == b"whole"


@pytest.mark.parametrize("threads", [None, 2])
@pytest.mark.parametrize("body", [b"x", b"xyz"])
def test_two_different_content_lengths_are_a_500_said_once_for_what_they_are(
        serve, caplog, threads, body):
    # The body was held to the last field's length and said in the log to
    # miss the first's ("ended 1 bytes short of its Content-Length of 1"),
    # before the head was refused for the two.
    def app(environ, start_response):
        start_response("200 OK", [("Content-Length", "1"), ("Content-Length", "2")])
        return [body]

    worker, connection, _ = serve(app, threads=threads)
    start, data = call(connection, {})
    assert start.status.startswith("500")
    said = [r.getMessage() for r in caplog.records if r.name.startswith("zc_lb.worker")]
    assert len(said) == 1 and "invalid Content-Length '2'" in said[0], said


def test_threads_run_blocking_apps_concurrently(serve):
    def blocking(environ, start_response):
        time.sleep(0.5)  # not gevent-aware: only threads help
        data = environ["wsgi.input"].read()
        start_response("200 OK", [])
        return [b"slept " + data]

    worker, connection, _ = serve(blocking, threads=4)
    started = time.monotonic()
    jobs = [gevent.spawn(call, connection, {"CONTENT_LENGTH": "1"}, b"%d" % i) for i in range(4)]
    gevent.joinall(jobs, raise_error=True)
    assert time.monotonic() - started < 1.5
    assert sorted(job.value[1] for job in jobs) == [b"slept %d" % i for i in range(4)]


def test_resume_is_sent_on_connect_and_every_history_requests(serve, tmp_path):
    resume_file = tmp_path / "resume.json"
    resume_file.write_text('{"old.example": 3.0}')
    app = lambda e, s: (s("200 OK", []), [b"ok"])[1]
    worker, connection, handler = serve(app, history=3, resume_file=str(resume_file))
    for _ in range(3):
        call(connection, {"zc_lb.request_class": "new.example"})
    gevent.sleep(0.05)
    assert handler.resumes[0] == {"old.example": 3.0}
    assert set(handler.resumes[-1]) == {"old.example", "new.example"}
    assert "new.example" in resume_file.read_text()


def test_resume_goes_out_on_a_timer_after_light_traffic_and_not_when_idle(serve):
    # With the default history of 9999, a lightly used worker sent no
    # résumé for minutes: the LBs knew no skill of it.
    app = lambda e, s: (s("200 OK", []), [b"ok"])[1]
    worker, connection, handler = serve(app, resume_interval=0.2)
    gevent.sleep(0.05)
    assert handler.resumes == [{}]  # on connect
    for _ in range(2):
        call(connection, {"zc_lb.request_class": "light.example"})
    deadline = time.monotonic() + 3
    while len(handler.resumes) < 2 and time.monotonic() < deadline:
        gevent.sleep(0.02)
    assert set(handler.resumes[-1]) == {"light.example"}
    gevent.sleep(0.7)  # nothing served since: nothing more to say
    assert len(handler.resumes) == 2
    worker.configure({"resume_interval": 0})  # live: only every history requests
    call(connection, {"zc_lb.request_class": "other.example"})
    gevent.sleep(0.5)
    assert len(handler.resumes) == 2
    with pytest.raises(ConfigurationError):
        worker.configure({"resume_interval": -1, "history": 5})
    assert (worker.publisher.resume_interval, worker.publisher.history) == (0, 9999)  # nothing changed


def test_load_app_spec_forms(tmp_path):
    assert load_app("zc_lb.demo:app") is not None
    ini = tmp_path / "app.ini"
    ini.write_text("[app:main]\nuse = egg:zc-lb#demo\ncache_sites = 2\n")
    assert load_app(str(ini)).cache_sites == 2
    for bad in ("nosuchmodule:app", "zc_lb.demo:nothing", "zc_lb.demo:CACHE_SITES",
                str(tmp_path / "missing.ini")):
        with pytest.raises(ConfigurationError):
            load_app(bad)


def test_parse_address():
    assert parse_address("127.0.0.1:80") == ("127.0.0.1", 80)
    assert parse_address(":81") == ("127.0.0.1", 81)
    assert parse_address("[::1]:82") == ("::1", 82)
    for bad in ("nohost", "h:port", "h:70000"):
        with pytest.raises(ConfigurationError):
            parse_address(bad)


def test_failures_teach_the_resume_nothing(serve):
    # A worker answering 500 at once learned a huge score and won traffic.
    def app(environ, start_response):
        if environ["PATH_INFO"] == "/fail":
            start_response("503 Service Unavailable", [("Content-Length", "0")])
            return [b""]
        if environ["PATH_INFO"] == "/raise":
            raise RuntimeError("boom")
        start_response("200 OK", [("Content-Length", "2")])
        return [b"ok"]
    worker, connection, handler = serve(app, history=1)
    for path in ("/fail", "/raise", "/fail"):
        call(connection, {"PATH_INFO": path, "zc_lb.request_class": "bad"})
    call(connection, {"PATH_INFO": "/", "zc_lb.request_class": "good"})
    assert "bad" not in worker.publisher.resume() and "good" in worker.publisher.resume()
    assert worker.status()["failed"] == 3 and worker.status()["served"] == 1


@pytest.mark.parametrize("mode", [dict(), dict(threads=1)])
def test_a_request_the_lb_cancels_while_the_app_runs_counts_as_failed(serve, mode):
    # zc_lb_app_requests_total's failed counts "a 5xx, an exception or a
    # cancel": a cancel (the LB's response timeout, its client gone)
    # counted as neither served nor failed.
    def app(environ, start_response):
        (time.sleep if mode else gevent.sleep)(0.5)
        start_response("200 OK", [("Content-Length", "2")])
        return [b"ok"]

    worker, connection, _ = serve(app, **mode)
    exchange = connection.open_request(dict(REQUEST, PATH_INFO="/"), end=True)
    gevent.sleep(0.2)
    exchange.cancel()
    _wait_until(lambda: worker.status()["failed"] == 1)
    gevent.sleep(0.5)  # (the thread's app done too)
    assert worker.status()["served"] == 0 and worker.status()["failed"] == 1


@pytest.mark.parametrize("mode", [dict(), dict(threads=1)], ids=["greenlets", "threads"])
@pytest.mark.parametrize("method,status,served", [
    ("HEAD", "200 OK", True), ("GET", "200 OK", False), ("HEAD", "503 Busy", False)])
def test_a_head_the_lb_cancels_once_its_head_is_out_is_served(serve, caplog, mode, method,
                                                               status, served):
    # The LB cancels a HEAD's request once it has the head (unless the End
    # came with it): the client has all a HEAD gets.  Its worker counted it
    # as failed, kept it out of its résumé and logged that it "ended
    # early".  A GET cancelled once its head is out was cut short, and a
    # 5xx teaches nothing: failed.
    def app(environ, start_response):
        write = start_response(status, [("Content-Length", "7")])
        write(b"written")
        environ["wsgi.input"].read()  # (a body that never comes: the LB cancels first)
        return []

    import logging

    worker, connection, _ = serve(app, **mode)
    exchange = connection.open_request(
        dict(REQUEST, REQUEST_METHOD=method, PATH_INFO="/", CONTENT_LENGTH="5",
             **{"zc_lb.request_class": "c"}))
    with caplog.at_level(logging.DEBUG, logger="zc_lb.worker"):
        start = exchange.receive(5)
        assert (start.status, start.end) == (status, False)
        exchange.cancel()
        _wait_until(lambda: worker.status()["served"] + worker.status()["failed"] == 1)
    said = [r.getMessage() for r in caplog.records if "ended early" in r.getMessage()]
    if not served:
        assert (worker.status()["served"], worker.status()["failed"]) == (0, 1)
        assert "c" not in worker.publisher.resume()
        return
    assert (worker.status()["served"], worker.status()["failed"]) == (1, 0)
    assert "c" in worker.publisher.resume() and sum(worker.status()["latency"]["counts"]) == 1
    assert said == []


def _slow_app(environ, start_response):
    gevent.sleep(float(environ.get("QUERY_STRING") or 0))
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"done"]


def test_drain_serves_what_is_in_flight_and_ends_when_the_lb_hangs_up(serve):
    worker, connection, handler = serve(_slow_app, threads=None)
    exchange = connection.open_request({"REQUEST_METHOD": "GET", "PATH_INFO": "/",
                                        "QUERY_STRING": "0.3"}, end=True)
    drain = gevent.spawn(worker.drain, 10)
    assert handler.goaway.wait(5), "the worker said GoAway"
    response, body = read_response(exchange)
    assert (response.status, body) == ("200 OK", b"done")  # in flight: served whole
    assert connection.idle.wait(5)
    assert not drain.ready()  # the LB still holds the connection
    connection.close("drained")  # as an LB closes a drained connection
    assert drain.get(timeout=5) is True


def test_drain_gives_up_at_its_timeout(serve):
    worker, connection, handler = serve(_slow_app, threads=None)
    started = time.monotonic()
    assert worker.drain(0.3) is False  # the LB never hangs up
    assert 0.25 < time.monotonic() - started < 3


@pytest.mark.parametrize("threads", [2, None])
def test_a_stop_that_cuts_off_requests_at_the_drain_timeout_says_what_they_were(
        serve, caplog, threads):
    release, started = threading.Event(), threading.Event()

    def hanging_app(environ, start_response):
        started.set()
        if threads:
            release.wait(10)
        else:
            while not release.is_set():
                gevent.sleep(0.01)
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"late"]

    worker, connection, handler = serve(hanging_app, threads=threads)
    try:
        connection.open_request({"REQUEST_METHOD": "GET", "PATH_INFO": "/hang",
                                 "QUERY_STRING": ""}, end=True)
        deadline = time.monotonic() + 5
        while not started.is_set() and time.monotonic() < deadline:
            gevent.sleep(0.01)
        worker.stop(timeout=0.3)
        assert "1 requests still in flight after the drain timeout (0.3 s) are cut off: " \
               "the application runs GET /hang" in caplog.text
    finally:
        release.set()


def _napping_app(environ, start_response):
    gevent.sleep(0.2)  # cooperates: other greenlets run meanwhile
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"done"]


def test_greenlets_under_a_bound_wait_their_turn_and_the_wait_is_not_the_apps_time(serve):
    # Greenlet mode, at most one request at once: three arrive together,
    # run one after another, and each one's skill is its own 0.2 s.
    worker, connection, _ = serve(_napping_app, threads=None, concurrency=1)
    recorded = []
    record = worker.publisher.skills.record
    worker.publisher.skills.record = lambda rclass, elapsed: (recorded.append(elapsed),
                                                    record(rclass, elapsed))[1]
    started = time.monotonic()
    calls = [gevent.spawn(call, connection, {}) for _ in range(3)]
    gevent.joinall(calls, timeout=10, raise_error=True)
    assert time.monotonic() - started > 0.55  # one at a time, not three at once
    deadline = time.monotonic() + 5
    while len(recorded) < 3 and time.monotonic() < deadline:
        gevent.sleep(0.01)
    assert len(recorded) == 3
    # Counting the wait, they would read 0.2, 0.4 and 0.6 s.
    assert all(0.15 < elapsed < 0.35 for elapsed in recorded), recorded


def test_greenlets_without_a_bound_run_together(serve):
    worker, connection, _ = serve(_napping_app, threads=None)
    started = time.monotonic()
    calls = [gevent.spawn(call, connection, {}) for _ in range(3)]
    gevent.joinall(calls, timeout=10, raise_error=True)
    assert time.monotonic() - started < 0.5


def recorded_times(worker, connection, requests):
    """Send ``requests`` at once; the seconds the worker recorded in its
    résumé for each (after its response is out)."""
    recorded = []
    record = worker.publisher.skills.record
    worker.publisher.skills.record = lambda rclass, elapsed: (recorded.append(elapsed),
                                                    record(rclass, elapsed))[1]
    calls = [gevent.spawn(call, connection, {}) for _ in range(requests)]
    gevent.joinall(calls, timeout=10, raise_error=True)
    deadline = time.monotonic() + 5  # a skill is recorded after its response is out
    while len(recorded) < requests and time.monotonic() < deadline:
        gevent.sleep(0.01)
    assert len(recorded) == requests
    return recorded


def _blocking_app(environ, start_response):
    time.sleep(0.2)  # not gevent-aware: holds its thread
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"done"]


def test_the_wait_for_a_thread_is_not_counted_as_the_apps_time(serve):
    # One thread, three requests at once: the third waits 0.4 s for the
    # thread, but its skill is measured over the 0.2 s the app took.
    worker, connection, _ = serve(_blocking_app, threads=1)
    recorded = recorded_times(worker, connection, 3)
    # Counting the wait, they would read 0.2, 0.4 and 0.6 s.
    assert all(0.15 < elapsed < 0.5 for elapsed in recorded), recorded


def _chunked_reader_app(environ, start_response):
    """Reads its body in uneven pieces, lines and reads mixed."""
    stream = environ["wsgi.input"]
    parts = [stream.read(3), stream.readline(), stream.read(300000), stream.readline(5),
             stream.readline(), stream.read()]
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"|".join(parts)]


def test_reads_across_the_bodys_frames_give_its_bytes_in_order(serve):
    # The body comes in frames of at most credit bytes; reads, lines and
    # whole-frame takes must neither drop nor repeat a byte at their edges.
    worker, connection, _ = serve(_chunked_reader_app)
    body = b"abcdef\n" + b"x" * 600000 + b"\nline\nlast line\ntail"  # (three frames)
    start, data = call(connection, {"REQUEST_METHOD": "POST",
                                    "CONTENT_LENGTH": str(len(body))}, body)
    assert data.split(b"|") == [b"abc", b"def\n", b"x" * 300000, b"x" * 5,
                                b"x" * (600000 - 300005) + b"\n", b"line\nlast line\ntail"]


def _leftover_garbage(make_requests):
    """The objects the cyclic garbage collector finds after ``make_requests``:
    what was freed only by it, not by reference counting."""
    import gc

    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        make_requests()
        gc.collect()
        return list(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


@pytest.mark.parametrize("threads", [None, 2])
def test_a_served_request_leaves_no_garbage_cycle(serve, threads):
    # Each request once left a cycle (its exchange, the task that served
    # it and the exchange's cancel callback) for the garbage collector.
    def app(environ, start_response):
        start_response("200 OK", [("Content-Length", "2")])
        return [b"ok"]

    worker, connection, handler = serve(app, threads=threads)
    call(connection, {})  # (the first request's one-time state)

    def requests():
        for _ in range(50):
            assert call(connection, {})[0].status == "200 OK"

    from zc_lb.wire.exchange import Exchange
    leftover = _leftover_garbage(requests)
    assert not [o for o in leftover if isinstance(o, Exchange)]



class _Chunks:
    """An exchange that hands out body chunks, then End."""

    def __init__(self, *chunks):
        from zc_lb.wire.frames import Body, End

        self.inbox = [Body(1, chunk) for chunk in chunks] + [End(1)]
        self.consumed_bytes = 0

    def receive(self):
        return self.inbox.pop(0)

    def widen(self):
        pass

    def consumed(self, n):
        self.consumed_bytes += n


@source_only  # (compiled, RequestInput takes a real Exchange; make test runs it on the source)
def test_request_input_reads_across_chunks_as_asked():
    from zc_lb.worker.wsgi import RequestInput

    chunks = [b"ab", b"cde", b"f", b"ghij", b"klmnop"]
    body = RequestInput(_Chunks(*chunks))
    assert body.read(0) == b""
    first = body.read(2)
    assert first == b"ab" and first is chunks[0]  # (a whole chunk is not copied)
    assert body.read(4) == b"cdef"
    assert body.read(3) == b"ghi"
    assert body.readline() == b"jklmnop"
    assert body.read() == b"" and body.read(5) == b""
    body = RequestInput(_Chunks(*chunks))
    assert body.read(1) == b"a" and body.read() == b"bcdefghijklmnop"
    exchange = _Chunks(*chunks)
    body = RequestInput(exchange)
    assert body.read(100) == b"".join(chunks) and exchange.consumed_bytes == 16


class _Read1:
    """A source of body chunks for ``threadio.ThreadInput``'s pump."""

    def __init__(self, *chunks):
        self.chunks = list(chunks)

    def read1(self, size):
        return self.chunks.pop(0) if self.chunks else b""


def _thread_input(*chunks):
    from zc_lb.worker.threadio import ThreadInput

    return ThreadInput(gevent.get_hub(), _Read1(*chunks))


@source_only  # (compiled, RequestInput takes a real Exchange; make test runs it on the source)
@pytest.mark.parametrize("threads", [False, True])
def test_a_long_line_of_the_body_is_read_in_one_pass(threads):
    # readline() copied and searched the whole line so far with each
    # chunk: a line of 32 MiB in 16 KiB chunks took 5 to 30 seconds.
    from zc_lb.worker.wsgi import RequestInput

    chunks = [b"x" * 16384] * 2048 + [b"\nnext\nlast"]
    body = _thread_input(*chunks) if threads else RequestInput(_Chunks(*chunks))

    def read():
        started = time.perf_counter()
        return body.readline(), time.perf_counter() - started, body.readlines()

    line, took, rest = gevent.get_hub().threadpool.apply(read) if threads else read()
    assert line == b"x" * (16384 * 2048) + b"\n" and rest == [b"next\n", b"last"]
    assert took < 0.5, took
    body = _thread_input(*chunks) if threads else RequestInput(_Chunks(*chunks))
    read = body.readline if not threads else (
        lambda size: gevent.get_hub().threadpool.apply(body.readline, (size,)))
    assert [len(read(size)) for size in (5, 16384, 16384 * 1024, -1)] == [
        5, 16384, 16384 * 1024, 16384 * 1023 - 5 + 1]


def _one_connection_app(environ, start_response):
    """An ordinary app with one database connection: one request at a
    time, the others waiting inside it for the lock."""
    with _DATABASE:
        time.sleep(0.05)
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"done"]


_DATABASE = threading.Lock()


def test_a_wait_on_the_apps_own_lock_is_not_counted_as_the_apps_time(serve):
    # Eight requests at once in the default thread mode: all are let in
    # before the pool's first sample, and seven wait inside the app, up to
    # 0.35 s.  What the pool sees of those waits is taken off their time.
    worker, connection, _ = serve(_one_connection_app, threads=16)
    recorded = recorded_times(worker, connection, 8)
    # Counting the wait, they would read 0.05, 0.1, ... 0.4 s.
    assert max(recorded) < 0.15, recorded
    assert worker.status()["queued_seconds"] > 0.5
    assert worker.status()["threads"]["ceiling"] == 1  # the app serves one at a time


class _Word(str):
    """A str of the app's own kind (a template library's, a framework's)."""


@pytest.mark.parametrize("said, cache", [("hit", True), ("MISS", False), (True, True),
                                         (False, False), ("maybe", None), (None, None),
                                         (_Word("hit"), True)])
def test_what_the_app_says_of_its_cache_goes_to_the_lb(serve, said, cache):
    def app(environ, start_response):
        if said is not None:
            environ["zc_lb.cache"] = said
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]

    worker, _, _ = serve(app)
    sock = gevent.socket.create_connection(worker.address)
    connection = Connection(sock, "lb", LBSide(), peer="worker")
    connection.handshake()
    connection.start()
    try:
        response, _ = call(connection, {})
    finally:
        connection.close()
    assert response.cache is cache


def _cache_lines(caplog):
    return [r.getMessage() for r in caplog.records if "zc_lb.cache" in r.getMessage()]


@pytest.fixture
def cache_log(caplog):
    """The worker's lines about ``zc_lb.cache``, said once a process: said
    again for this test."""
    import logging

    from zc_lb.worker import wsgi

    wsgi.SAID_ONCE.clear()
    with caplog.at_level(logging.WARNING, logger="zc_lb.worker.wsgi"):
        yield lambda: _cache_lines(caplog)
    wsgi.SAID_ONCE.clear()


@pytest.mark.parametrize("threads", [None, 2])
def test_a_cache_value_the_worker_does_not_know_is_said_once_in_the_log(serve, cache_log,
                                                                        threads):
    # b"hit", 1, "yes": the LB was told nothing, and nobody was told why.
    values = [b"hit", 1, "yes", "h" * 10 ** 6, b"hit"]

    def app(environ, start_response):
        environ["zc_lb.cache"] = values[int(environ["QUERY_STRING"])]
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]

    worker, connection, _ = serve(app, threads=threads)
    for n in range(len(values)):
        response, _ = call(connection, {"QUERY_STRING": str(n)})
        assert response.status == "200 OK" and response.cache is None
    [line] = cache_log()
    assert "b'hit'" in line and '"hit" or True, "miss" or False' in line, line


@pytest.mark.parametrize("threads", [None, 2])
def test_a_cache_said_after_the_response_started_is_said_once_in_the_log(serve, cache_log,
                                                                         threads):
    # Set once the head was out (by the app's generator, or a middleware
    # wrapping it): the LB never got it, the log said nothing, and in
    # thread mode it got there or not as the hub's timing went.
    def app(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/plain")])
        yield b"first"
        environ["zc_lb.cache"] = "hit"
        yield b"second"

    worker, connection, _ = serve(app, threads=threads)
    for _ in range(3):
        response, body = call(connection, {})
        assert (response.cache, body) == (None, b"firstsecond")
    [line] = cache_log()
    assert "after the response to / started" in line, line


@pytest.mark.parametrize("threads", [None, 2])
@pytest.mark.parametrize("path", ["/raise", "/503"])
def test_a_failed_request_tells_the_lb_neither_time_nor_cache(serve, threads, path):
    # A failure teaches nothing, in the résumé and in the LB's measure of
    # what a key's data buys (routing/locality.py): a 500 that came fast
    # (the database down) read as a fast miss, a slow one as a slow hit.
    def app(environ, start_response):
        environ["zc_lb.cache"] = "miss"
        if environ["PATH_INFO"] == "/raise":
            raise RuntimeError("on purpose")
        status = "503 Service Unavailable" if environ["PATH_INFO"] == "/503" else "200 OK"
        start_response(status, [("Content-Type", "text/plain")])
        return [b"down"]

    worker, connection, _ = serve(app, threads=threads)
    response, _ = call(connection, {"PATH_INFO": path})
    assert response.status[:1] == "5"
    assert (response.elapsed, response.cache) == (None, None)
    response, _ = call(connection, {"PATH_INFO": "/ok"})
    assert response.elapsed is not None and response.cache is False


@pytest.mark.parametrize("feature", LB_FEATURES)
def test_an_lb_of_an_older_release_is_refused_in_one_line_of_the_log(serve, caplog, feature):
    # An LB whose Hello lacks a feature of its role (one of a release
    # before it): the worker says why it refuses it, and hangs up.
    import logging

    from logevents import LogEvent

    worker, _, _ = serve(reader_app)
    sock = gevent.socket.create_connection(worker.address)
    older = Connection(sock, "lb", LBSide(), peer="worker",
                       features=tuple(name for name in LB_FEATURES if name != feature))
    with caplog.at_level(logging.WARNING, logger="zc_lb.worker.lbs"), \
            LogEvent("zc_lb.worker.lbs", "rejected connection") as rejected:
        older.handshake()  # (the worker's Hello offers all an LB of before takes)
        assert rejected.wait(5)
    [record] = [r for r in caplog.records if "rejected" in r.getMessage()]
    assert record.getMessage().endswith(
        ": the LB lacks the protocol features %s: it is of an older zc-lb release "
        "and must be upgraded (docs/howto/upgrade.rst)" % feature)
    assert record.exc_info is None and "\n" not in record.getMessage()
    with gevent.Timeout(5):
        assert sock.recv(100) == b""  # hung up
    older.close()
    assert len(worker.lbs.connections) == 1  # (the fixture's LB alone)


def test_a_flood_of_refused_connections_is_a_line_or_two_in_the_log(serve, caplog):
    # Junk on the worker's port (a scan, a stray client): each connection
    # is refused in its handshake, but the log says so once, then counts.
    import logging
    import socket

    worker, _, _ = serve(reader_app)
    with caplog.at_level(logging.WARNING, logger="zc_lb.worker.lbs"):
        for _ in range(50):
            sock = socket.create_connection(worker.address)
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 4)
            sock.close()
        deadline = time.monotonic() + 5
        while worker.lbs._rejected + sum("rejected" in r.getMessage() for r in caplog.records) < 50 \
                and time.monotonic() < deadline:
            gevent.sleep(0.02)
    lines = [r.getMessage() for r in caplog.records if "rejected" in r.getMessage()]
    assert 1 <= len(lines) <= 2, lines
    assert worker.lbs._rejected >= 49 - len(lines)  # (counted, for the next line)


@pytest.mark.parametrize("threads", [None, 16])
def test_a_file_like_object_handed_to_the_file_wrapper_goes_out_whole_in_large_reads(
        serve, threads):
    # Django's FileResponse and Flask's send_file give the file to
    # wsgi.file_wrapper when the server offers one, else iterate it in
    # small blocks (Django's 4 KiB).  One without a descriptor (here in
    # memory) is read in BLOCK reads, whatever the app asked for.
    from zc_lb.worker.filewrapper import BLOCK

    data = bytes(range(256)) * 4096 * 3  # 3 MiB
    reads, closed = [], []
    File = _recording(io.BytesIO, reads, closed)

    def app(environ, start_response):
        start_response("200 OK", [("Content-Length", str(len(data)))])
        return environ["wsgi.file_wrapper"](File(data), 4096)

    worker, connection, _ = serve(app, threads=threads)
    response, body = call(connection, {})
    assert body == data
    assert reads and min(reads) >= BLOCK  # (not the app's 4 KiB)
    _wait_until(lambda: closed)


def _recording(base, reads, closed):
    """A file class of ``base`` that notes each read's size, and its close."""
    class File(base):
        def read(self, size=-1):
            reads.append(size)
            return super().read(size)

        def close(self):
            closed.append(True)
            super().close()

    return File


def _wait_until(predicate, timeout=5):
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        gevent.sleep(0.01)  # (the hub runs here)
    assert predicate()


@pytest.mark.parametrize("threads", [None, 16])
def test_a_file_handed_to_the_file_wrapper_goes_out_with_sendfile(serve, tmp_path, threads,
                                                                  monkeypatch):
    # A regular file: the kernel moves its bytes (sendfile), from where
    # the app left it standing, up to its Content-Length; the worker
    # reads none of them, and closes the file once they went.
    import os

    data = bytes(range(256)) * 4096 * 3 + b"tail"  # 3 MiB and a bit
    path = tmp_path / "file.bin"
    path.write_bytes(data)
    sendfiles, reads, closed = [], [], []
    real = os.sendfile
    monkeypatch.setattr(os, "sendfile", lambda *args: sendfiles.append(args[3]) or real(*args))
    File = _recording(io.FileIO, reads, closed)

    def app(environ, start_response):
        f = File(str(path))
        f.seek(100)
        length = environ.get("HTTP_X_LENGTH", str(len(data) - 100))
        start_response("200 OK", [("Content-Length", length)])
        return environ["wsgi.file_wrapper"](f, 4096)

    worker, connection, _ = serve(app, threads=threads, sendfile="on")
    response, body = call(connection, {})
    assert body == data[100:]
    assert sendfiles and not reads
    _wait_until(lambda: closed)
    response, body = call(connection, {"HTTP_X_LENGTH": "1000"})
    assert body == data[100:1100]
    response, body = call(connection, {"REQUEST_METHOD": "HEAD"})
    assert response.status == "200 OK" and body == b""
    _wait_until(lambda: len(closed) == 3)
    # By default ("auto"), not to an LB on this machine: over loopback
    # the kernel copies the bytes either way, and reads cost less.
    del sendfiles[:]
    worker, connection, _ = serve(app, threads=threads)
    assert call(connection, {})[1] == data[100:]
    assert reads and not sendfiles


@pytest.mark.parametrize("threads", [None, 2])
@pytest.mark.parametrize("sendfile", ["on", "off"])
def test_a_file_wrappers_part_up_to_its_content_length_goes_without_a_warning(
        serve, tmp_path, threads, sendfile, caplog):
    # A file left standing at a range's start, with the range's length as
    # its Content-Length (WSGI's way to send part of a file): each such
    # response logged "ran past its Content-Length", as a broken body does.
    import logging

    data = bytes(range(256)) * 64
    path = tmp_path / "file.bin"
    path.write_bytes(data)

    def app(environ, start_response):
        f = open(path, "rb")
        f.seek(100)
        start_response("206 Partial Content", [("Content-Length", "1000")])
        return environ["wsgi.file_wrapper"](f, 256)

    worker, connection, _ = serve(app, threads=threads, sendfile=sendfile)
    with caplog.at_level(logging.WARNING, logger="zc_lb.worker.wsgi"):
        for _ in range(2):
            response, body = call(connection, {})
            assert response.status == "206 Partial Content" and body == data[100:1100]
    assert _warnings(caplog) == []


@pytest.mark.parametrize("threads", [None, 16])
def test_a_file_that_ends_before_its_region_cuts_the_response_and_spares_the_connection(
        serve, tmp_path, threads, monkeypatch, caplog):
    # The file shrank after the worker measured it: the frame is made
    # whole with zeros, and the response cancelled (a truncated body
    # must not look complete); the connection's other requests go on.
    from zc_lb.errors import RequestCancelled
    from zc_lb.worker.filewrapper import FileWrapper

    path = tmp_path / "file.bin"
    path.write_bytes(b"z" * 100000)
    monkeypatch.setattr(FileWrapper, "region",
                        lambda self: (self.filelike.fileno(), 0, 300000))

    def app(environ, start_response):
        if environ["PATH_INFO"] == "/next":
            start_response("200 OK", [])
            return [b"next"]
        start_response("200 OK", [])
        return environ["wsgi.file_wrapper"](open(path, "rb"))

    worker, connection, _ = serve(app, threads=threads, sendfile="on")
    with pytest.raises(RequestCancelled):
        call(connection, {})
    assert "the file ended before its response did" in caplog.text
    assert call(connection, {"PATH_INFO": "/next"})[1] == b"next"


# -- thread mode: bodies cross to the hub in bulk (threadio.py) ---------------


def _frames(exchange, timeout=10):
    """(Response, [each Body's data], whether End came) of an exchange."""
    from zc_lb.wire.frames import Body, Response

    start = exchange.receive(timeout)
    assert isinstance(start, Response), start
    datas = [start.body] if start.body else []
    if start.body:
        exchange.consumed(len(start.body))
    ended = start.end
    while not ended:
        message = exchange.receive(timeout)
        if isinstance(message, Body):
            datas.append(message.data)
            exchange.consumed(len(message.data))
        else:
            ended = isinstance(message, End)
            assert ended, message
    return start, datas, ended


def test_a_thread_apps_small_blocks_go_to_the_lb_in_large_frames(serve):
    # Django iterates a file in 4 KiB blocks: each was a handoff to the
    # hub and a frame.  They cross in bulk now, in order.
    blocks = [bytes([i % 251]) * 4096 for i in range(1024)]  # 4 MiB

    def app(environ, start_response):
        start_response("200 OK", [("Content-Length", str(4096 * len(blocks)))])
        return iter(blocks)

    worker, connection, _ = serve(app, threads=2)
    exchange = connection.open_request(dict(REQUEST, PATH_INFO="/"), end=True)
    start, datas, ended = _frames(exchange)
    assert start.status == "200 OK" and ended
    assert b"".join(datas) == b"".join(blocks)
    assert len(datas) < 100  # (1,024 before)


def test_a_thread_apps_large_blocks_reach_the_lb_whole_in_order_in_frames_of_max_body(serve):
    # A thread's blocks cross to the hub in bulk: sizes that straddle
    # frames and credit come out whole and in order.
    from zc_lb.wire.frames import MAX_BODY

    sizes = [65536, 70001, 1, 300000, 65536, 16384, 99999] * 12
    blocks = [bytes([i % 251]) * size for i, size in enumerate(sizes)]

    def app(environ, start_response):
        start_response("200 OK", [("Content-Length", str(sum(sizes)))])
        return iter(blocks)

    worker, connection, _ = serve(app, threads=2)
    for _ in range(2):
        exchange = connection.open_request(dict(REQUEST, PATH_INFO="/"), end=True)
        start, datas, ended = _frames(exchange)
        assert start.status == "200 OK" and ended
        assert b"".join(datas) == b"".join(blocks)
        assert max(map(len, datas)) <= MAX_BODY


@pytest.mark.parametrize("extra", [0, -65436])
def test_a_thread_apps_large_blocks_are_held_to_its_content_length(serve, caplog, extra):
    # Large blocks that cross to the hub in bulk count against the head's
    # length: past it, cut there and said once; up to it, nothing said.
    import logging

    blocks = [bytes([i]) * 65536 for i in range(8)]
    length = 8 * 65536 + extra

    def app(environ, start_response):
        start_response("200 OK", [("Content-Length", str(length))])
        return iter(blocks)

    worker, connection, _ = serve(app, threads=2)
    with caplog.at_level(logging.WARNING, logger="zc_lb.worker.wsgi"):
        exchange = connection.open_request(dict(REQUEST, PATH_INFO="/big"), end=True)
        start, datas, ended = _frames(exchange)
    assert start.status == "200 OK" and ended
    assert b"".join(datas) == b"".join(blocks)[:length]
    assert _warnings(caplog) == ([] if not extra else [
        "the application's response to GET /big ran past its Content-Length of %d: "
        "cut there" % length])


REQUEST = {"REQUEST_METHOD": "GET", "SERVER_NAME": "x", "SERVER_PORT": "80",
           "SERVER_PROTOCOL": "HTTP/1.1", "wsgi.url_scheme": "http"}


def test_a_thread_apps_first_block_goes_before_its_next_is_made(serve):
    # Blocks go in bulk, but none waits for the next: a streaming app's
    # (server-sent events, progress) reach the client as it yields them.
    got_first = threading.Event()

    def app(environ, start_response):
        start_response("200 OK", [])
        yield b"first;"
        yield b"then:%s" % (b"seen" if got_first.wait(5) else b"late")

    worker, connection, _ = serve(app, threads=2)
    exchange = connection.open_request(dict(REQUEST, PATH_INFO="/"), end=True)
    start = exchange.receive(5)
    data = start.body
    while data != b"first;":
        data += exchange.receive(5).data
    got_first.set()
    _, rest = read_response_rest(exchange)
    assert rest == b"then:seen"


def read_response_rest(exchange):
    from zc_lb.testing import read_body

    return None, read_body(exchange, 5)


def counted_waits(monkeypatch):
    """A list that grows by one each time a thread waits for the hub (on
    a threading.Condition, which threadio looks up at each request,
    compiled or not)."""
    import threading as threading_module

    waits = []

    class Condition(threading_module.Condition):
        def wait(self, timeout=None):
            waits.append(1)
            return super().wait(timeout)

    monkeypatch.setattr(threading_module, "Condition", Condition)
    return waits


def test_a_thread_app_that_reads_in_small_blocks_waits_for_the_hub_seldom(serve, monkeypatch):
    # wsgi.input in a thread: each read was a handoff to the hub; now a
    # pump in the hub hands the body over as it comes, in chunks.
    waits = counted_waits(monkeypatch)

    def app(environ, start_response):
        read, pieces = environ["wsgi.input"].read, []
        while True:
            data = read(4096)
            if not data:
                break
            assert len(data) == 4096 or not read(1)
            pieces.append(data)
        body = b"".join(pieces)
        start_response("200 OK", [])
        return [b"%d %d" % (len(body), sum(body) % 1000003)]

    worker, connection, _ = serve(app, threads=2)
    body = bytes(range(256)) * 16384  # 4 MiB
    for _ in range(2):
        start, data = call(connection, {"REQUEST_METHOD": "POST",
                                        "CONTENT_LENGTH": str(len(body))}, body)
        assert data == b"%d %d" % (len(body), sum(body) % 1000003)
    assert 0 < len(waits) < 200  # (2,048 reads; the first of each waited)


def test_a_thread_reading_a_large_body_is_woken_for_gather_bytes_not_each_piece(
        serve, monkeypatch):
    # A thread that has read all that came waits for the hub; woken for
    # each piece the connection brought (a quarter megabyte at most), it
    # cost the worker a quarter of its CPU in thread switches.  It
    # is woken once GATHER bytes came, or the end (or LINGER seconds
    # after the first of them: long here, so that only those count).
    from zc_lb.worker import threadio

    waits = counted_waits(monkeypatch)
    monkeypatch.setattr(threadio, "LINGER", 60.0, raising=False)

    def app(environ, start_response):
        read, size = environ["wsgi.input"].read, 0
        while True:
            data = read(65536)
            if not data:
                break
            size += len(data)
        start_response("200 OK", [])
        return [b"%d" % size]

    worker, connection, _ = serve(app, threads=2)
    body = b"u" * (8 * 1024 * 1024)
    start, data = call(connection, {"REQUEST_METHOD": "POST",
                                    "CONTENT_LENGTH": str(len(body))}, body)
    assert data == b"%d" % len(body)
    assert 0 < len(waits) <= len(body) // threadio.GATHER + 1, len(waits)


def test_a_thread_is_handed_a_body_that_trickles_as_it_comes(serve):
    # Less than GATHER bytes came and no more for now: the waiting
    # thread has them after LINGER seconds, not when the rest comes.
    got = []

    def app(environ, start_response):
        stream = environ["wsgi.input"]
        got.append(stream.read(10))
        got.append(stream.read())
        start_response("200 OK", [])
        return [b"".join(got)]

    worker, connection, _ = serve(app, threads=2)
    exchange = connection.open_request(dict(REQUEST, REQUEST_METHOD="POST",
                                            CONTENT_LENGTH="20"), end=False)
    exchange.send_body(b"a" * 10)
    _wait_until(lambda: got)  # (the rest has not been sent)
    assert got == [b"a" * 10]
    exchange.send_body(b"b" * 10)
    exchange.send(End(exchange.rno))
    assert read_response(exchange, 10)[1] == b"a" * 10 + b"b" * 10


def test_a_thread_app_that_leaves_its_body_unread_leaves_no_pump_behind(serve):
    # The pump stops at READ_AHEAD bytes ahead of the app; an app that
    # answers without reading the rest must not leave it waiting.
    import gc

    def app(environ, start_response):
        environ["wsgi.input"].read(10)
        start_response("413 Too Large", [])
        return [b"no"]

    def pumps():
        return [g for g in gc.get_objects() if isinstance(g, gevent.Greenlet)
                and getattr(g, "_run", None) is not None
                and getattr(g._run, "__name__", "") == "_pump" and not g.dead]

    worker, connection, _ = serve(app, threads=2)
    body = b"x" * (4 * 1024 * 1024)
    exchange = connection.open_request(dict(REQUEST, REQUEST_METHOD="POST",
                                            CONTENT_LENGTH=str(len(body))))
    sender = gevent.spawn(exchange.send_body, body)
    start = exchange.receive(5)
    assert start.status.startswith("413")
    sender.kill()
    _wait_until(lambda: not pumps())
    assert call(connection, {})[0].status.startswith("413")  # (still serving)


def test_a_thread_app_writing_faster_than_the_lb_takes_waits_holding_at_most_high(serve):
    # Flow control reaches the app: the LB grants no credit, so the
    # thread stops once threadio.HIGH bytes wait for the hub (plus the
    # first window), and goes on as the LB takes them.
    from zc_lb.wire.stream import WIDE_WINDOW
    from zc_lb.worker.threadio import HIGH

    made = []

    def app(environ, start_response):
        start_response("200 OK", [])
        for _ in range(256):
            made.append(65536)
            yield b"x" * 65536  # 16 MiB in all

    worker, connection, _ = serve(app, threads=2)
    exchange = connection.open_request(dict(REQUEST, PATH_INFO="/"), end=True)
    gevent.sleep(0.5)  # taking nothing: no credit granted back
    held = sum(made)
    assert held <= HIGH + WIDE_WINDOW + 2 * 65536, held
    start, datas, ended = _frames(exchange)
    assert ended and sum(map(len, datas)) == 256 * 65536 == sum(made)


def test_a_thread_app_stops_at_its_next_block_when_the_lb_cancels(serve):
    # The LB went away (or its client did): the error is raised in the
    # thread at its next write, which ends the app's iteration (close).
    closed = threading.Event()

    def app(environ, start_response):
        start_response("200 OK", [])
        if environ["PATH_INFO"] == "/next":
            return [b"next"]
        return endless()

    def endless():
        try:
            for _ in range(100000):
                yield b"y" * 65536
                time.sleep(0.001)
        finally:
            closed.set()

    worker, connection, _ = serve(app, threads=2)
    exchange = connection.open_request(dict(REQUEST, PATH_INFO="/"), end=True)
    exchange.receive(5)
    exchange.cancel()
    deadline = time.monotonic() + 5
    while not closed.is_set() and time.monotonic() < deadline:
        gevent.sleep(0.01)  # (the hub runs here: no blocking wait)
    assert closed.is_set()
    assert call(connection, {"PATH_INFO": "/next"})[1] == b"next"  # (the thread is free)


def test_a_failure_of_the_workers_own_cancels_the_request_at_once(serve, caplog):
    # A bug in the worker (not the app) once left the LB waiting out its
    # response timeout (300 s) for an answer that would never come.
    def broken(call):
        raise RuntimeError("the worker's own bug")

    worker = Worker(lambda e, s: [b"never"], threads=1)
    worker.start()
    worker.serving.threadpool.apply = broken  # (the worker's own part, not the app)
    sock = gevent.socket.create_connection(worker.address)
    connection = Connection(sock, "lb", LBSide(), peer="worker")
    connection.handshake()
    connection.start()
    try:
        from zc_lb.errors import RequestCancelled

        started = time.monotonic()
        with pytest.raises(RequestCancelled):
            call(connection, {}, timeout=10)
        assert time.monotonic() - started < 5
        assert "request greenlet failed" in caplog.text
    finally:
        connection.close()
        worker.stop(timeout=1)


def test_a_thread_reading_a_body_the_lb_cancelled_gets_a_cancel_not_a_greenlet_exit(serve):
    # The LB gave up on the request mid-upload: the app's read raises a
    # RequestCancelled it may catch as the request's end, in its thread.
    from zc_lb.errors import RequestCancelled

    raised = []

    def app(environ, start_response):
        try:
            while environ["wsgi.input"].read(4096):
                time.sleep(0.001)
        except BaseException as exc:
            raised.append(exc)
            raise
        start_response("200 OK", [])
        return [b"read it all"]

    worker, connection, _ = serve(app, threads=2)
    exchange = connection.open_request(dict(REQUEST, REQUEST_METHOD="POST",
                                            CONTENT_LENGTH=str(64 * 1024 * 1024)))
    sender = gevent.spawn(exchange.send_body, b"x" * (2 * 1024 * 1024))
    gevent.sleep(0.2)  # (the app holds a chunk, the pump waits for room)
    sender.kill()
    exchange.cancel()
    _wait_until(lambda: raised)
    assert isinstance(raised[0], RequestCancelled), raised


# -- thread mode: requests the LB gave up on ----------------------------------


@pytest.mark.parametrize("mode", [dict(threads=1), dict(threads=None, concurrency=1)])
def test_a_request_cancelled_while_it_waits_for_a_thread_never_runs_the_app(serve, mode):
    ran = []

    def app(environ, start_response):
        ran.append(environ["PATH_INFO"])
        if environ["PATH_INFO"] == "/slow":
            (time.sleep if mode["threads"] else gevent.sleep)(0.3)
        start_response("200 OK", [])
        return [b"ok"]

    worker, connection, _ = serve(app, **mode)
    slow = connection.open_request(dict(REQUEST, PATH_INFO="/slow"), end=True)
    _wait_until(lambda: ran == ["/slow"])
    waiting = connection.open_request(dict(REQUEST, PATH_INFO="/cancelled"), end=True)
    gevent.sleep(0.05)
    waiting.cancel()  # (its client went away while it waited)
    slow.receive(5)
    assert call(connection, {"PATH_INFO": "/next"})[1] == b"ok"
    assert ran == ["/slow", "/next"]


def test_a_file_wrapper_is_closed_when_the_lb_cancels_while_its_thread_runs(serve, tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 100_000)
    reads, closed = [], []
    File = _recording(io.FileIO, reads, closed)
    go = threading.Event()

    def app(environ, start_response):
        if environ["PATH_INFO"] == "/next":
            start_response("200 OK", [])
            return [b"next"]
        go.wait(5)  # (the app is busy in its thread when the LB cancels)
        start_response("200 OK", [("Content-Length", "100000")])
        return environ["wsgi.file_wrapper"](File(str(path)))

    worker, connection, _ = serve(app, threads=2, sendfile="on")
    exchange = connection.open_request(dict(REQUEST, PATH_INFO="/"), end=True)
    gevent.sleep(0.1)
    exchange.cancel()
    gevent.sleep(0.05)
    go.set()
    assert call(connection, {"PATH_INFO": "/next"})[1] == b"next"
    _wait_until(lambda: closed)  # (PEP 3333: close() is called)


@pytest.mark.parametrize("threads", [None, 2])
def test_start_response_with_exc_info_after_a_block_raises_again(serve, threads):
    # PEP 3333: once a block was written the head counts as sent, in a thread
    # too, where the hub may not have sent it yet.
    raised = []

    def app(environ, start_response):
        start_response("200 OK", [("Content-Length", "20")])

        def body():
            yield b"first half"
            try:
                raise ValueError("mid-body")
            except ValueError:
                try:
                    start_response("500 Internal Server Error", [("Content-Length", "5")],
                                   sys.exc_info())
                except ValueError:
                    raised.append(True)
                    raise
                yield b"oops!"
        return body()

    worker, connection, _ = serve(app, threads=threads)
    exchange = connection.open_request(dict(REQUEST, PATH_INFO="/"), end=True)
    try:
        start, datas, ended = _frames(exchange)
    except RequestCancelled:  # (the 200 went, then the response was cut short)
        start = None
    assert raised == [True]
    assert start is None or start.status.startswith("200")


def test_a_cancel_after_the_whole_response_lets_the_apps_close_run(serve):
    # (the LB ends a request whose body the app did not read: ResponseBody.close)
    closed = gevent.event.Event()

    class Result:
        def __iter__(self):
            yield b"too large"

        def close(self):  # (a transaction's abort, a connection back to its pool)
            gevent.sleep(0.2)
            closed.set()

    def app(environ, start_response):  # answers at once, reads no body
        start_response("413 Content Too Large", [("Content-Type", "text/plain")])
        return Result()

    worker, connection, _ = serve(app)
    exchange = connection.open_request(dict(REQUEST, REQUEST_METHOD="POST"))
    head, body = read_response(exchange)
    assert head.status.startswith("413") and body == b"too large"
    exchange.cancel()
    assert closed.wait(2), "the app's close() was cut short"
    _wait_until(lambda: worker.serving.served + worker.serving.failed == 1)
    assert worker.serving.served == 1  # (a whole response: served)


def _skills_recorded(worker):
    """The seconds the worker records in its résumé from now on, as a list."""
    recorded = []
    record = worker.publisher.skills.record
    worker.publisher.skills.record = lambda rclass, elapsed: (recorded.append(elapsed),
                                                    record(rclass, elapsed))[1]
    return recorded


def _first_recorded(recorded):
    _wait_until(lambda: recorded)  # (a skill is recorded after its response is out)
    return recorded[0]


@pytest.mark.parametrize("threads", [2, None])
def test_a_slow_upload_is_not_counted_as_the_apps_time(serve, threads):
    # A client uploading slowly keeps the app waiting in wsgi.input: that
    # is the LB's time, not the app's, and must not lower the worker's
    # skill at the class (the request took 0.3 s; the app, none of it).
    def app(environ, start_response):
        body = environ["wsgi.input"].read()
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"%d" % len(body)]

    worker, connection, _ = serve(app, threads=threads)
    recorded = _skills_recorded(worker)
    exchange = connection.open_request(dict(REQUEST, REQUEST_METHOD="POST", PATH_INFO="/",
                                            CONTENT_LENGTH="20"), end=False)
    exchange.send_body(b"x" * 10)
    gevent.sleep(0.3)  # the client's upload stalls
    exchange.send_body(b"y" * 10)
    exchange.send(End(exchange.rno))
    assert read_response(exchange, 10)[1] == b"20"
    assert _first_recorded(recorded) < 0.15, recorded


@pytest.mark.parametrize("threads", [2, None])
@pytest.mark.parametrize("streamed", [True, False])
def test_a_slow_reader_is_not_counted_as_the_apps_time(serve, threads, streamed):
    # A response larger than the LB's credit waits for the LB to take it
    # (flow control: a full spool, a slow client): the LB's time too, in
    # the app's writes, or, for a thread, in the hub's sending after it.
    blocks = [b"z" * 65536] * 64  # 4 MiB

    def app(environ, start_response):
        start_response("200 OK", [("Content-Length", str(65536 * len(blocks)))])
        return iter(blocks) if streamed else [b"".join(blocks)]

    worker, connection, _ = serve(app, threads=threads)
    recorded = _skills_recorded(worker)
    exchange = connection.open_request(dict(REQUEST, PATH_INFO="/"), end=True)
    start = exchange.receive(5)
    gevent.sleep(0.3)  # no credit back meanwhile
    if start.body:
        exchange.consumed(len(start.body))
    assert len(start.body + read_body(exchange, 10)) == 65536 * len(blocks)
    assert _first_recorded(recorded) < 0.15, recorded


def test_a_worker_past_max_requests_says_so_once_and_drains_as_on_sigterm(serve, caplog):
    # It sent itself a SIGTERM, and its log said "got SIGTERM" as though
    # someone had stopped it.
    import logging
    import signal

    from zc_lb.process.service import wait_for_signal

    worker, connection, _ = serve(reader_app, threads=None, max_requests=2)
    stops = []

    def requests():
        for _ in range(2):
            assert call(connection, {})[0].status == "200 OK"

    previous = signal.getsignal(signal.SIGTERM)
    client = gevent.spawn(requests)
    try:
        with caplog.at_level(logging.INFO, logger="zc_lb"), gevent.Timeout(5):
            wait_for_signal({"SIGTERM": lambda: stops.append(1) or True})
    finally:
        signal.signal(signal.SIGTERM, previous)
    client.get(timeout=5)
    said = [r.getMessage() for r in caplog.records if r.name.startswith("zc_lb")]
    assert stops == [1]
    assert "got SIGTERM" not in said, said
    assert said.count("served 2 requests (--max-requests 2): draining to be started "
                      "again") == 1, said


def _length_app(environ, start_response):
    """Responses whose bodies are not what their heads say (tests/test_worker.py)."""
    path = environ["PATH_INFO"]
    if path == "/204":
        start_response("204 No Content", [])
        return [b"body"]
    if path == "/304":
        start_response("304 Not Modified", [("Content-Length", "1234")])
        return iter([b"two", b" pieces"])
    start_response("200 OK", [("Content-Length", "10")])
    return {"/long": [b"x" * 20], "/long2": [b"x" * 5, b"y" * 15],
            "/long3": iter([b"x" * 10, b"y", b"z"]), "/short": [b"x" * 5],
            "/short2": iter([b"x" * 3, b"y" * 2]), "/head": [b"x" * 20],
            "/right": iter([b"x" * 4, b"y" * 6])}[path]


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records
            if r.name == "zc_lb.worker.wsgi" and r.levelname == "WARNING"]


def _endless(drawn, closed):
    """An endless body (20 MB, for a test's bound) of 1 KiB blocks: each
    drawn counted in ``drawn``, its close() in ``closed``."""
    try:
        for _ in range(20000):
            drawn.append(1)
            yield b"x" * 1024
    finally:
        closed.append(True)


def _said(connection, caplog, path):
    """GET ``path``: (its Response, its body, whether End came, the
    worker's warnings about it)."""
    caplog.clear()
    start, datas, ended = _frames(
        connection.open_request(dict(REQUEST, PATH_INFO=path), end=True))
    return start, b"".join(datas), ended, _warnings(caplog)


@pytest.mark.parametrize("threads", [None, 2])
def test_an_application_body_past_its_content_length_is_cut_at_the_worker_and_said_once(
        serve, caplog, threads):
    # The worker sent it all, and said nothing; the LB cut it and logged
    # "worker ... sent a body longer than its Content-Length", which reads
    # as a broken worker.  The fault is the application's: said where it runs.
    import logging

    worker, connection, _ = serve(_length_app, threads=threads)
    with caplog.at_level(logging.WARNING, logger="zc_lb.worker.wsgi"):
        for path, body in [("/long", b"x" * 10), ("/long2", b"x" * 5 + b"y" * 5),
                           ("/long3", b"x" * 10)]:
            start, data, ended, warnings = _said(connection, caplog, path)
            assert start.status == "200 OK" and ended
            assert data == body, path  # (no more than its length left the worker)
            assert warnings == [
                "the application's response to GET %s ran past its Content-Length of 10: "
                "cut there" % path]
        caplog.clear()
        assert call(connection, {"PATH_INFO": "/right"})[1] == b"x" * 4 + b"y" * 6
        assert call(connection, {"PATH_INFO": "/head", "REQUEST_METHOD": "HEAD"})[1] == b""
        assert _warnings(caplog) == []  # (a HEAD's body is dropped, as WSGI apps give one)


@pytest.mark.parametrize("threads", [None, 2])
def test_an_application_body_short_of_its_content_length_is_said_at_the_worker(
        serve, caplog, threads):
    import logging

    worker, connection, _ = serve(_length_app, threads=threads)
    with caplog.at_level(logging.WARNING, logger="zc_lb.worker.wsgi"):
        for path in ["/short", "/short2"]:
            start, data, ended, warnings = _said(connection, caplog, path)
            assert data == b"x" * 5 or data == b"xxxyy"
            assert warnings == [
                "the application's response to GET %s ended 5 bytes short of its "
                "Content-Length of 10 (the LB closes the client's connection after it)" % path]


@pytest.mark.parametrize("threads", [None, 2])
def test_a_body_on_a_204_or_304_is_dropped_at_the_worker_and_said_once(
        serve, caplog, threads):
    import logging

    worker, connection, _ = serve(_length_app, threads=threads)
    with caplog.at_level(logging.WARNING, logger="zc_lb.worker.wsgi"):
        for code in ["204", "304"]:
            start, data, ended, warnings = _said(connection, caplog, "/" + code)
            assert start.status.startswith(code) and ended and data == b""
            assert warnings == [
                "the application's %s response to GET /%s has a body: dropped (a %s "
                "response has none)" % (code, code, code)]


@pytest.mark.parametrize("threads", [None, 2])
def test_an_endless_body_past_its_content_length_is_not_drawn_on(serve, threads):
    # The LB cancelled such a response, which stopped the application;
    # with the worker cutting it, nothing did: an endless generator ran on.
    drawn, closed = [], []

    def app(environ, start_response):
        start_response("200 OK", [("Content-Length", "10")])
        return _endless(drawn, closed)

    worker, connection, _ = serve(app, threads=threads)
    assert call(connection, {})[1] == b"x" * 10
    _wait_until(lambda: closed)
    assert len(drawn) < 2000  # (thread mode: what went before the hub saw it, some 1 MiB)


@pytest.mark.parametrize("threads", [None, 2])
@pytest.mark.parametrize("status", ["600 Beyond", "200 OK"])
def test_an_endless_body_under_a_refused_head_is_not_drawn_on(serve, threads, status):
    # A head the worker refused (a status past 599, a bad header) went as
    # its 500, whole: the LB cancels nothing, and the worker drew the
    # application's body on for nothing, an endless one for ever.
    drawn, closed = [], []

    def app(environ, start_response):
        start_response(status, [("X-Bad", "a\r\nb")] if status == "200 OK" else [])
        return _endless(drawn, closed)

    worker, connection, _ = serve(app, threads=threads)
    response, _ = call(connection, {})
    assert response.status.startswith("500")
    _wait_until(lambda: closed)
    assert len(drawn) < 2000  # (thread mode: what went before the hub saw it, some 1 MiB)
