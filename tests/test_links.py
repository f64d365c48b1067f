"""zc_lb.lb.links: a WorkerLink against a real in-process Worker on
127.0.0.1, telling a recording LinkEvents what happens; and
close_when_idle on its own.

Every wait is on a gevent event, with a timeout: the recorder's, a
Connection's ``idle``, the app's ``started``/``release`` gates, or a log
line's.  Nothing sleeps and then asserts.
"""

import logging
import time

import gevent
import gevent.event
import pytest

from logevents import LogEvent
from zc_lb.errors import WorkerClosed
from zc_lb.lb.links import LinkConfig, LinkEvents, WorkerLink, close_when_idle
from zc_lb.testing import read_response
from zc_lb.wire.encoder import encode
from zc_lb.wire.frames import HEADER, RESUME_LIMIT, WORKER_FEATURES, Resume
from zc_lb.wire.intake import ResumeRefused
from zc_lb.worker.server import Worker

pytestmark = pytest.mark.timeout(20)

WAIT = 5.0  # seconds any one awaited event may take


# -- harness ------------------------------------------------------------------


class Recording(LinkEvents):
    """LinkEvents that records each call as (name, connection, *args)."""

    def __init__(self):
        self.calls = []
        self._changed = gevent.event.Event()

    def _record(self, *call):
        self.calls.append(call)
        self._changed.set()

    def worker_up(self, connection):
        self._record("up", connection)

    def worker_resume(self, connection, skills):
        self._record("resume", connection, skills)

    def worker_silent(self, connection, seconds):
        self._record("silent", connection)

    def worker_heard(self, connection):
        self._record("heard", connection)

    def worker_down(self, connection):
        self._record("down", connection)

    def named(self, name):
        return [call for call in self.calls if call[0] == name]

    def wait_for(self, name, count=1, timeout=WAIT):
        """The ``count``-th call of ``name``, once it has happened."""
        deadline = time.monotonic() + timeout
        while len(self.named(name)) < count:
            self._changed.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._changed.wait(remaining):
                raise AssertionError("no %d %r calls in %gs; calls: %s"
                                     % (count, name, timeout, self.calls))
        return self.named(name)[count - 1]


class Gate:
    """A WSGI app that says when a request started and answers when released."""

    def __init__(self):
        self.started = gevent.event.Event()
        self.release = gevent.event.Event()

    def __call__(self, environ, start_response):
        self.started.set()
        self.release.wait(WAIT * 2)
        start_response("200 OK", [("Content-Length", "2")])
        return [b"ok"]


def ok_app(environ, start_response):
    start_response("200 OK", [("Content-Length", "2")])
    return [b"ok"]


def address_of(worker):
    return "%s:%d" % worker.address


@pytest.fixture
def workers():
    """workers(app, **kw) -> a started Worker on 127.0.0.1, stopped after the test."""
    started = []

    def start(app=ok_app, worker_class=Worker, **kw):
        worker = worker_class(app, **kw)
        worker.start()
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop(timeout=0.5)
        worker.requests.kill(block=False)


@pytest.fixture
def links():
    """links(address, config=None) -> (started WorkerLink, its Recording); stopped after."""
    made = []

    def start(address, config=None):
        events = Recording()
        link = WorkerLink(address, config or LinkConfig(), events)
        link.start()
        made.append(link)
        return link, events

    yield start
    for link in made:
        link.stop()


def request(connection, path="/"):
    """Open a bodiless GET on ``connection`` (the LB side)."""
    return connection.open_request({"REQUEST_METHOD": "GET", "PATH_INFO": path}, end=True)


def response(exchange):
    """(status, body) of the whole response to ``exchange``."""
    head, body = read_response(exchange, WAIT)
    return head.status, body


# -- coming up ------------------------------------------------------------------


def test_a_link_tells_when_its_worker_is_up_and_passes_on_its_resumes(workers, links):
    worker = workers()
    link, events = links(address_of(worker))
    _, connection = events.wait_for("up")
    assert link.connection is connection and not connection.closed
    assert events.wait_for("resume") == ("resume", connection, {})  # sent on accept
    worker.publisher.publish({"a.example": 2.5})
    assert events.wait_for("resume", 2) == ("resume", connection, {"a.example": 2.5})
    assert link.resume == {"a.example": 2.5}  # kept for a readmission
    assert response(request(connection)) == ("200 OK", b"ok")
    assert events.named("down") == []


def test_a_resume_past_what_an_lb_takes_is_dropped_in_a_line_of_the_log_the_worker_kept(
        workers, links, caplog):
    # A worker of a release before the bound, or a buggy one, sends what
    # it likes up to the frame cap (64 MiB): 50 MB ones back to back
    # stopped the LB's loop half a second each.  Now each is skipped as
    # it comes, logged (once a minute at most), and the worker kept.
    worker = workers()
    link, events = links(address_of(worker))
    _, connection = events.wait_for("up")
    events.wait_for("resume")  # (its first, on accept)
    big = {"c%07d.example/%s" % (i, "x" * 40): 1.5 for i in range(RESUME_LIMIT // 50)}
    with caplog.at_level(logging.WARNING, logger="zc_lb.lb.links"), \
            LogEvent("zc_lb.lb.links", "sent a résumé of") as refused:
        worker.publisher.publish(big)
        assert refused.wait(WAIT)
        worker.publisher.publish({"a.example": 2.5})
        assert events.wait_for("resume", 2) == ("resume", connection, {"a.example": 2.5})
        for _ in range(3):  # more, within the minute: counted, not logged
            link.handle_resume_refused(connection, ResumeRefused(10**7, None, "over"))
    lines = [r.getMessage() for r in caplog.records if "sent a résumé of" in r.getMessage()]
    size = len(encode(Resume(big))) - HEADER.size
    assert lines == ["worker %s sent a résumé of %d bytes, over the %d bytes an LB takes: "
                     "dropped, its skills kept" % (address_of(worker), size, RESUME_LIMIT)]
    assert link.resumes_refused == 4 and link.resume == {"a.example": 2.5}
    assert not connection.closed and link.connection is connection
    assert events.named("down") == [] and len(events.named("resume")) == 2
    assert response(request(connection)) == ("200 OK", b"ok")


def test_a_link_to_an_address_nobody_listens_on_keeps_trying(workers, links):
    probe = workers()  # find a free port, then free it
    address, listen = address_of(probe), probe.address
    probe.stop(timeout=0.5)
    with LogEvent("zc_lb.lb.links", "cannot connect to worker %s (1 tries)" % address) as failed:
        link, events = links(address)
        assert failed.wait(WAIT)
    assert link.failures >= 1 and link.last_error and link.connection is None
    assert events.calls == []
    workers(listen=listen)  # the worker comes, the link finds it
    events.wait_for("up")
    assert (link.failures, link.last_error) == (0, None)



@pytest.mark.parametrize("host", ["a" * 64, "a..example"])
def test_a_link_to_a_host_name_no_resolver_takes_says_so_and_keeps_trying(links, host):
    # Anyone may register such a name in ZooKeeper; the resolver's
    # UnicodeError (IDNA: a label over 63 characters, or empty) killed the
    # link's greenlet with a traceback and it never tried again.
    address = "%s:80" % host
    with LogEvent("zc_lb.lb.links", "cannot connect to worker %s (1 tries)" % address) as failed:
        link, events = links(address)
        assert failed.wait(WAIT)
    assert "label" in link.last_error and link.connection is None
    deadline = time.monotonic() + WAIT  # after a backoff, it tries again
    while link.failures < 2 and time.monotonic() < deadline:
        gevent.sleep(0.05)
    assert link.failures >= 2

def test_a_link_with_the_wrong_secret_never_comes_up(workers, links):
    worker = workers(secret=b"right")
    with LogEvent("zc_lb.lb.links", "cannot connect to worker") as failed:
        link, events = links(address_of(worker), LinkConfig(secret=b"wrong"))
        assert failed.wait(WAIT)
    assert link.last_error.startswith("handshake: ") and link.connection is None
    assert events.named("up") == [] and events.named("resume") == []
    link, events = links(address_of(worker), LinkConfig(secret=b"right"))
    events.wait_for("up")


def test_a_failed_handshake_is_no_worker_down_and_no_lost_worker(workers, links, caplog):
    worker = workers(secret=b"right")
    with LogEvent("zc_lb.lb.links", "cannot connect to worker") as failed:
        link, events = links(address_of(worker), LinkConfig(secret=b"wrong"))
        assert failed.wait(WAIT)
    assert events.calls == []  # the link never told of a connection: nothing went down
    assert "lost worker" not in caplog.text


@pytest.mark.parametrize("feature", WORKER_FEATURES)
def test_a_worker_of_an_older_release_is_refused_in_one_line_of_the_log(
        workers, links, caplog, feature):
    # A worker whose Hello lacks a feature of its role (one of a release
    # before it) never comes up, and the log says why and what to do.
    class Older(Worker):
        protocol_features = tuple(name for name in WORKER_FEATURES if name != feature)

    worker = workers(worker_class=Older)
    with caplog.at_level(logging.WARNING, logger="zc_lb.lb.links"), \
            LogEvent("zc_lb.lb.links", "cannot connect to worker") as failed:
        link, events = links(address_of(worker))
        assert failed.wait(WAIT)
    record = [r for r in caplog.records if r.name == "zc_lb.lb.links"][0]
    assert record.getMessage() == (
        "cannot connect to worker %s (1 tries): handshake: the worker lacks the "
        "protocol features %s: it is of an older zc-lb release and must be upgraded "
        "(docs/howto/upgrade.rst)" % (address_of(worker), feature))
    assert record.exc_info is None
    assert link.connection is None and events.calls == []


def test_a_worker_that_refuses_our_hello_is_never_said_to_be_connected(
        workers, links, caplog, monkeypatch):
    # Without a secret the LB takes the connection for open at the
    # worker's Hello, before the worker has read ours: one that refused it
    # (an LB of an older release) had every try say "connected to worker"
    # at INFO, each followed by the refusal.
    import functools

    from zc_lb.lb import links as links_module
    from zc_lb.wire.frames import LB_FEATURES

    older = functools.partial(links_module.Connection, features=LB_FEATURES[1:])
    monkeypatch.setattr(links_module, "Connection", older)
    worker = workers()
    with caplog.at_level(logging.INFO, logger="zc_lb.lb.links"):
        link, events = links(address_of(worker))
        events.wait_for("down", 3)  # (three tries, each up, refused, down)
    said = [r.getMessage() for r in caplog.records if r.name == "zc_lb.lb.links"]
    assert [line for line in said if line.startswith("connected")] == []
    assert said[0].startswith("cannot connect to worker %s (refused 1 times): %s refused "
                              "this LB at its Hello: the LB lacks the protocol features %s"
                              % (address_of(worker), address_of(worker), LB_FEATURES[0])), said


def test_a_worker_that_takes_us_is_said_to_be_connected_once(workers, links, caplog):
    worker = workers()
    with caplog.at_level(logging.INFO, logger="zc_lb.lb.links"), \
            LogEvent("zc_lb.lb.links", "connected to worker") as said:
        link, events = links(address_of(worker))
        assert said.wait(WAIT)
        assert response(request(link.connection)) == ("200 OK", b"ok")
    assert [r.getMessage() for r in caplog.records if r.name == "zc_lb.lb.links"
            and r.levelno >= logging.INFO] == ["connected to worker %s" % address_of(worker)]


@pytest.mark.parametrize("sender", ["worker", "lb"])
def test_a_frame_that_breaks_the_protocol_is_one_line_of_the_log(
        workers, links, caplog, sender):
    # The connection said "protocol error from ..., disconnecting", then
    # the LB "lost worker ...: protocol error: ..." (the worker "LB
    # connection from ... ended: ... protocol error ...") of the same frame.
    from zc_lb.wire.frames import HEADER

    worker = workers()
    with caplog.at_level(logging.INFO):
        link, events = links(address_of(worker))
        _, connection = events.wait_for("up")
        on_worker, = worker.lbs.connections
        (on_worker if sender == "worker" else connection).write(HEADER.pack(0, 250, 3) + b"xyz")
        events.wait_for("down")
        assert worker.lbs.wait_gone(WAIT)
    said = [r.getMessage() for r in caplog.records if "frame type 250" in r.getMessage()]
    peer = address_of(worker) if sender == "worker" else on_worker.peer
    assert said == ["protocol error from %s %s, disconnecting: unknown frame type 250" % (
        "worker" if sender == "worker" else "LB", peer)]


# -- going and coming back ------------------------------------------------------------


def test_a_lost_connection_is_down_then_reconnected(workers, links, caplog):
    worker = workers()
    link, events = links(address_of(worker))
    _, first = events.wait_for("up")
    with caplog.at_level(logging.WARNING, logger="zc_lb.lb.links"):
        for connection in list(worker.lbs.connections):  # as if the worker crashed
            connection.close("crash")
        assert events.wait_for("down") == ("down", first)
        _, second = events.wait_for("up", 2)
    assert second is not first and first.closed and link.connection is second
    assert "lost worker %s" % address_of(worker) in caplog.text
    assert response(request(second)) == ("200 OK", b"ok")


def test_a_worker_that_drops_each_connection_at_once_is_tried_ever_less_often(workers, links):
    worker = workers()
    link, events = links(address_of(worker))
    started = time.monotonic()
    while time.monotonic() - started < 1.6:  # (as a worker that dies as it starts)
        for connection in list(worker.lbs.connections):
            connection.close("crash")
        gevent.sleep(0.01)
    # backoffs of 0.1, 0.2, 0.4, 0.8 s at most (each a random half to all of it),
    # where a backoff back at 0.1 s after every connection made 10 or more
    assert 2 <= len(events.named("up")) <= 6


def test_a_restarted_worker_drains_without_a_warning_and_is_reconnected(
        workers, links, caplog):
    worker = workers()
    link, events = links(address_of(worker))
    _, first = events.wait_for("up")
    with caplog.at_level(logging.INFO, logger="zc_lb.lb.links"):
        worker.stop(timeout=WAIT)  # GoAway: the link closes, the worker returns
        assert events.wait_for("down") == ("down", first) and first.closed
        assert worker.drain(0) and link.draining is None
        workers(listen=worker.address)  # the same address, a new process
        _, second = events.wait_for("up", 2)
    assert second is not first and link.connection is second
    assert "worker %s drained and closed" % address_of(worker) in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert response(request(second)) == ("200 OK", b"ok")


def _link_with_a_request_in_flight(workers, links):
    """A link up to a worker whose app holds a request until the gate opens."""
    gate = Gate()
    worker = workers(gate)
    link, events = links(address_of(worker))
    _, connection = events.wait_for("up")
    exchange = request(connection)
    assert gate.started.wait(WAIT)
    return gate, worker, link, events, connection, exchange


def test_a_draining_worker_is_down_at_once_but_closed_only_when_idle(workers, links):
    gate, worker, link, events, connection, exchange = _link_with_a_request_in_flight(
        workers, links)
    stopping = gevent.spawn(worker.stop, WAIT)  # sends GoAway, waits for the LB
    assert events.wait_for("down") == ("down", connection)  # out of the pool at once
    assert link.draining is connection and not connection.closed
    assert not connection.idle.is_set()
    gate.release.set()
    assert response(exchange) == ("200 OK", b"ok")  # the request in flight is whole
    assert connection.idle.wait(WAIT)
    events.wait_for("down", 2)  # connection_lost, once closed
    assert connection.closed and link.draining is None
    stopping.get(timeout=WAIT)


def test_a_goaway_said_again_and_again_drains_once(workers, links, monkeypatch):
    # Each frame spawned a drain greenlet held up to drain_timeout, and
    # logged, and took the worker down again: a peer's 20 bytes apiece.
    from zc_lb.lb import links as links_module
    from zc_lb.wire import encoder
    from zc_lb.wire.frames import GoAway

    drains = []
    real = links_module.close_when_idle
    monkeypatch.setattr(links_module, "close_when_idle",
                        lambda *args: (drains.append(args), real(*args)))
    gate, worker, link, events, connection, exchange = _link_with_a_request_in_flight(
        workers, links)
    peer = next(iter(worker.lbs.connections))
    peer.write(encoder.encode(GoAway("draining")) * 500)
    events.wait_for("down")
    gevent.sleep(0.3)
    assert len(drains) == 1 and len(events.named("down")) == 1
    gate.release.set()
    assert response(exchange) == ("200 OK", b"ok")


def test_a_connection_out_of_request_numbers_is_followed_at_once(workers, links):
    # The next connection opened only once the old one had drained: with
    # one long request in flight, the worker was out of the pool meanwhile.
    from zc_lb.wire.protocol import RECYCLE_RNO

    gate, worker, link, events, connection, exchange = _link_with_a_request_in_flight(
        workers, links)
    connection.protocol.last_rno = RECYCLE_RNO  # (as after some 4.29e9 requests)
    second = request(connection)  # goes on the old one, which now drains
    assert events.wait_for("down") == ("down", connection)
    _, successor = events.wait_for("up", 2)
    assert successor is not connection and link.connection is successor
    assert not connection.closed  # its requests go on
    gate.release.set()
    assert response(exchange) == response(second) == ("200 OK", b"ok")
    assert connection.idle.wait(WAIT)
    events.wait_for("down", 2)  # the old one, closed
    assert response(request(successor)) == ("200 OK", b"ok")
    gevent.sleep(0.3)
    assert link.connection is successor and len(events.named("up")) == 2  # no third


# -- stopping ---------------------------------------------------------------------


def test_stop_without_a_drain_timeout_closes_at_once_and_for_good(workers, links):
    worker = workers()
    link, events = links(address_of(worker))
    _, connection = events.wait_for("up")
    link.stop()
    assert connection.closed and events.named("down") == [("down", connection)] * 2
    assert worker.lbs.wait_gone(WAIT)  # the worker saw the LB go
    assert link.connection is None and link.stopped
    gevent.joinall([link._greenlet], timeout=WAIT)
    assert link._greenlet.dead and len(events.named("up")) == 1  # no reconnection


def test_stop_with_a_drain_timeout_closes_once_the_connection_is_idle(workers, links):
    gate, worker, link, events, connection, exchange = _link_with_a_request_in_flight(
        workers, links)
    link.stop(drain_timeout=WAIT * 2)  # the worker was removed from ZooKeeper
    assert events.named("down") == [("down", connection)]  # out of the pool at once
    assert not connection.closed and not connection.idle.is_set()
    gate.release.set()
    assert response(exchange) == ("200 OK", b"ok")
    assert connection.idle.wait(WAIT)
    events.wait_for("down", 2)
    assert connection.closed and link.connection is None
    assert worker.lbs.wait_gone(WAIT) and len(events.named("up")) == 1


def test_stop_with_a_drain_timeout_closes_at_the_timeout_if_never_idle(workers, links):
    gate = Gate()  # never released: the app hangs
    worker = workers(gate)
    link, events = links(address_of(worker))
    _, connection = events.wait_for("up")
    exchange = request(connection)
    assert gate.started.wait(WAIT)
    stopped = time.monotonic()
    link.stop(drain_timeout=0.3)
    events.wait_for("down", 2)
    assert 0.3 <= time.monotonic() - stopped < WAIT
    assert connection.closed and not gate.release.is_set()
    with pytest.raises(WorkerClosed):
        exchange.receive(WAIT)
    assert worker.lbs.wait_gone(WAIT)
    gate.release.set()  # the app may end now; its answer goes nowhere


# -- close_when_idle alone ---------------------------------------------------------------


class FakeConnection:
    def __init__(self):
        self.idle = gevent.event.Event()
        self.closed = gevent.event.Event()
        self.how = None

    def close(self, reason, flush_timeout=0.0):
        self.how = (reason, flush_timeout)
        self.closed.set()


def test_close_when_idle_waits_for_the_idle_event():
    connection = FakeConnection()
    closer = gevent.spawn(close_when_idle, connection, WAIT * 2, "worker removed")
    gevent.idle()  # let the closer wait
    assert not connection.closed.is_set() and not closer.dead
    connection.idle.set()
    assert connection.closed.wait(WAIT)
    assert connection.how == ("worker removed", 1.0)  # what is queued still goes


def test_close_when_idle_gives_up_waiting_at_the_timeout():
    connection = FakeConnection()
    started = time.monotonic()
    close_when_idle(connection, 0.2, "worker draining")
    assert 0.2 <= time.monotonic() - started < WAIT
    assert connection.how == ("worker draining", 1.0) and not connection.idle.is_set()
