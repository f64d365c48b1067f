"""connection.py: an LB side and a worker side joined in memory."""

import logging
import time

import gevent
import gevent.event
import gevent.socket
import pytest

from zc_lb.wire import encoder, frames
from zc_lb.wire.connection import Connection, Handler
from zc_lb.sockets import send_pieces, unsent
from zc_lb.errors import (AuthenticationError, BadResponse, ConnectionLost, RemoteProtocolError,
                          RequestCancelled, ResponseHeadTooLarge, WorkerLost)
from zc_lb.wire.frames import Body, End
from zc_lb.wire.stream import WINDOW
from zc_lb.testing import connection_pair, read_body, read_response


class Recorder(Handler):
    """Keeps what a connection reports; answers requests with ``respond``."""

    def __init__(self, respond=None):
        self.respond = respond
        self.exchanges = []
        self.resumes = []
        self.resumed = gevent.event.Event()
        self.requested = gevent.event.Event()
        self.lost = gevent.event.AsyncResult()

    def handle_request(self, connection, exchange):
        self.exchanges.append(exchange)
        self.requested.set()
        if self.respond is not None:
            gevent.spawn(self.respond, exchange)

    def handle_resume(self, connection, skills):
        self.resumes.append(skills)
        self.resumed.set()

    def connection_lost(self, connection, error):
        self.lost.set(error)


def echo(exchange):
    """Answer with the request body."""
    exchange.receive()  # the Request
    body = read_body(exchange, None)
    exchange.respond("200 OK", [])
    exchange.send_body(body)
    exchange.send(End(exchange.rno))


@pytest.fixture
def pair():
    made = []

    def make(respond=echo, **kw):
        lb_handler, worker_handler = Recorder(), Recorder(respond)
        lb, worker = connection_pair(lb_handler, worker_handler, **kw)
        made.extend([lb, worker])
        return lb, worker, lb_handler, worker_handler

    yield make
    for connection in made:
        connection.close()


def test_a_request_and_its_response(pair):
    lb, worker, _, _ = pair()
    exchange = lb.open_request({"REQUEST_METHOD": "POST"})
    exchange.send_body(b"hello " * 100000)
    exchange.send(End(exchange.rno))
    start, body = read_response(exchange)
    assert start.status == "200 OK"
    assert body == b"hello " * 100000
    assert not lb.protocol.streams and not worker.protocol.streams


def test_many_requests_share_one_connection(pair):
    lb, worker, _, _ = pair()
    exchanges = [lb.open_request({}, end=False) for _ in range(50)]
    for i, exchange in enumerate(exchanges):
        exchange.send(Body(exchange.rno, b"%d" % i), End(exchange.rno))
    bodies = [read_response(e)[1] for e in exchanges]
    assert bodies == [b"%d" % i for i in range(50)]


def test_a_slow_consumer_stalls_only_its_own_request(pair):
    sent = gevent.event.Event()

    def flood(exchange):
        exchange.receive()
        if exchange.rno == 1:
            exchange.respond("200 OK", [])
            exchange.send_body(b"x" * (4 * WINDOW))  # blocks: nobody consumes
            sent.set()
            exchange.send(End(exchange.rno))
        else:
            echo_after_request(exchange)

    lb, worker, _, worker_handler = pair(flood)
    slow = lb.open_request({}, end=True)
    gevent.sleep(0.2)
    assert not sent.is_set()
    buffered = sum(len(m.data) for m in slow.inbox if isinstance(m, Body))
    assert buffered <= WINDOW
    fast = lb.open_request({})
    fast.send(Body(fast.rno, b"quick"), End(fast.rno))
    assert read_response(fast)[1] == b"quick"
    assert not sent.is_set()
    start, body = read_response(slow)  # consuming grants credit
    assert len(body) == 4 * WINDOW
    assert sent.wait(5)


def test_an_upload_waiting_for_credit_and_its_owner_waiting_for_the_answer_both_wake(pair):
    # The LB's case: one greenlet sends a body (waiting for credit) while
    # the request's own greenlet waits for the response; each wake must
    # reach both, or a large upload stalls.
    def echo_slowly(exchange):
        exchange.receive()
        body = read_body(exchange, None)
        exchange.respond("200 OK", [], body[:5], end=True)

    lb, worker, _, _ = pair(echo_slowly)
    exchange = lb.open_request({"REQUEST_METHOD": "POST"}, end=False)

    def upload():
        exchange.send_body(b"u" * (8 * WINDOW))
        exchange.send(End(exchange.rno))

    uploader = gevent.spawn(upload)
    answer = gevent.spawn(read_response, exchange)
    uploader.join(10)
    assert uploader.successful()
    start, body = answer.get(timeout=10)
    assert (start.status, body) == ("200 OK", b"uuuuu")


def test_a_wait_for_the_answer_times_out_and_leaves_the_exchange_usable(pair):
    released = gevent.event.Event()

    def answer_when_released(exchange):
        exchange.receive()
        released.wait()
        exchange.respond("200 OK", [], end=True)

    lb, worker, _, _ = pair(answer_when_released)
    exchange = lb.open_request({})
    with pytest.raises(gevent.Timeout):
        exchange.receive(timeout=0.05)
    released.set()
    assert exchange.receive(timeout=5).status == "200 OK"


def echo_after_request(exchange):
    body = read_body(exchange, None)
    exchange.respond("200 OK", [], body, end=True)


def test_cancel_reaches_the_other_side(pair):
    cancelled = gevent.event.Event()

    def wait_forever(exchange):
        exchange.on_cancel = cancelled.set
        exchange.receive()
        with pytest.raises(RequestCancelled):
            exchange.receive()

    lb, worker, _, worker_handler = pair(wait_forever)
    exchange = lb.open_request({})
    assert worker_handler.requested.wait(5)
    exchange.cancel()
    assert cancelled.wait(5)
    with pytest.raises(RequestCancelled):
        exchange.receive()


def test_resume_reaches_the_lb(pair):
    lb, worker, lb_handler, _ = pair()
    worker.send_resume({"a.example": 12.5})
    assert lb_handler.resumed.wait(5)
    assert lb_handler.resumes == [{"a.example": 12.5}]


def test_a_resume_held_for_the_rate_is_taken_when_due_with_nothing_more_coming(pair):
    # The intake holds a résumé that comes sooner than its rate allows
    # (wire/intake.py); when its time comes it is taken, not when the
    # worker next sends something (a ping a keepalive interval later, or
    # never for one that stopped).
    lb, worker, lb_handler, _ = pair(keepalive_interval=30.0, keepalive_timeout=60.0)
    skills = {"c%05d.example" % i: 1.5 for i in range(5000)}  # some 100 KB: 0.1 s at the rate
    for value in (1.5, 2.5, 3.5):
        worker.send_resume(dict(skills, last=value))
    began = time.monotonic()
    while not (lb_handler.resumes and lb_handler.resumes[-1]["last"] == 3.5):
        lb_handler.resumed.clear()
        assert lb_handler.resumed.wait(2.0), "the newest résumé stayed held: %s" % [
            resume["last"] for resume in lb_handler.resumes]
    assert time.monotonic() - began < 1.0  # (its 0.1 s, and the two before decoded)
    assert [resume["last"] for resume in lb_handler.resumes] == [1.5, 3.5]
    assert not lb.closed


def test_a_silent_peer_is_declared_lost(pair, caplog):
    lb, worker, lb_handler, _ = pair(keepalive_interval=0.05, keepalive_timeout=0.3)
    exchange = lb.open_request({}, end=True)
    for greenlet in worker._greenlets:  # the worker hangs: it stops reading and pinging
        greenlet.kill()
    with caplog.at_level(logging.WARNING, logger="zc_lb.wire.connection"):
        error = lb_handler.lost.get(timeout=3)
    assert isinstance(error, WorkerLost)
    assert "no keepalive for" in str(error) and lb.peer in str(error)
    # (said once, by the owner, as "lost worker ...": the connection said it first)
    assert not [r for r in caplog.records if r.name == "zc_lb.wire.connection"]
    with pytest.raises(WorkerLost):
        exchange.receive(1)


def test_a_peer_that_closes_fails_the_requests_in_flight_at_once(pair):
    # The end of file closes the protocol's side; the requests still open
    # there must reach their owners, not wait for an answer forever.
    lb, worker, lb_handler, _ = pair(respond=None)
    exchanges = [lb.open_request({}, end=True) for _ in range(3)]
    waiting = [gevent.spawn(exchange.receive) for exchange in exchanges]
    gevent.sleep(0.05)  # the worker has them, and their owners wait
    worker.close()  # (its end of file, not a reset)
    gevent.joinall(waiting, timeout=3)
    assert [type(glet.exception) for glet in waiting] == [WorkerLost] * 3
    assert isinstance(lb_handler.lost.get(timeout=3), WorkerLost)
    assert lb.idle.is_set() and not lb.protocol.streams


def test_a_protocol_violation_drops_the_connection(pair):
    lb, worker, lb_handler, worker_handler = pair()
    lb.write(b"\x00\x00\x00\x07\x63\x00\x00\x00\x00")  # an unknown frame type
    error = worker_handler.lost.get(timeout=3)
    assert isinstance(error, ConnectionLost)
    assert "unknown frame type" in str(error)
    assert isinstance(lb_handler.lost.get(timeout=3), WorkerLost)


def test_body_past_the_credit_is_a_protocol_violation(pair):
    lb, worker, _, worker_handler = pair(respond=None)
    exchange = lb.open_request({})
    lb.write(encoder.encode(Body(exchange.rno, b"x" * frames.MAX_BODY)) * 2)
    error = worker_handler.lost.get(timeout=3)
    assert "past the credit" in str(error)


@pytest.mark.parametrize("frame, error", [
    # A head that would end early and pass its body as a second response.
    (lambda rno: encoder.ready_frame(rno, b"HTTP/1.1 200 OK\r\n\r\nHTTP/1.1 200 OK\r\n",
                                      None, None, b"", True), "malformed ready response head"),
    # A response head as JSON, which releases before ready heads sent.
    (lambda rno: frames.HEADER.pack(rno, frames.JSON_RESPONSE, 14) + b'["200 OK", []]',
     "frame type 13, a response head as JSON, is not taken"),
])
def test_a_frame_that_breaks_the_protocol_fails_its_request_as_a_bad_response(
        pair, caplog, frame, error):
    # The connection drops, saying why in the log, but that request must
    # not be retried elsewhere (BadResponse), while the others were
    # merely lost with it.
    lb, worker, lb_handler, _ = pair(respond=None)
    culprit, bystander = lb.open_request({}, end=True), lb.open_request({}, end=True)
    worker.write(frame(culprit.rno))
    with pytest.raises(BadResponse, match="broke the protocol answering it: " + error):
        culprit.receive(timeout=3)
    with pytest.raises(WorkerLost):
        bystander.receive(timeout=3)
    [line] = [r.getMessage() for r in caplog.records if "protocol error" in r.getMessage()]
    assert line.startswith("protocol error from worker worker, disconnecting: " + error)


def test_a_response_head_too_large_for_a_frame_is_refused_before_anything_is_sent(pair):
    lb, worker, _, worker_handler = pair(respond=None)
    exchange = lb.open_request({}, end=True)
    worker_handler.requested.wait(3)
    on_worker = worker_handler.exchanges[0]
    with pytest.raises(ResponseHeadTooLarge):
        on_worker.respond("200 OK", [("X-Big", "b" * frames.MAX_MESSAGE)], b"", True)
    on_worker.respond("500 Internal Server Error", [], b"", True)  # the stream is untouched
    assert read_response(exchange)[0].status.startswith("500")
    assert not lb.closed and not worker.closed


def test_shared_secret_handshake(pair):
    lb, worker, _, _ = pair(secret=b"s3cret")
    exchange = lb.open_request({}, end=False)
    exchange.send(End(exchange.rno))
    assert read_response(exchange)[0].status == "200 OK"


@pytest.mark.parametrize("lb_secret,worker_secret", [(b"one", b"two"), (b"one", None), (None, b"x")])
def test_secret_mismatch_fails_the_handshake(lb_secret, worker_secret):
    a, b = gevent.socket.socketpair()
    lb = Connection(a, "lb", Recorder(), secret=lb_secret)
    worker = Connection(b, "worker", Recorder(), secret=worker_secret)
    jobs = [gevent.spawn(lb.handshake, 2), gevent.spawn(worker.handshake, 2)]
    gevent.joinall(jobs)
    errors = [job.exception for job in jobs]
    assert any(isinstance(e, AuthenticationError) for e in errors), errors
    lb.close()
    worker.close()


def test_pieces_left_after_a_partial_vectored_send_are_the_unsent_bytes():
    pieces = [b"head", b"body bytes", b"end"]
    for sent in range(len(b"".join(pieces)) + 1):
        assert b"".join(bytes(p) for p in unsent(list(pieces), sent)) == b"headbody bytesend"[sent:]
    taken = []

    def sendmsg(buffers):  # a socket that takes 6 bytes at a time
        data = b"".join(bytes(b) for b in buffers)[:6]
        taken.append(data)
        return len(data)
    rest = list(pieces)
    while rest:
        rest = send_pieces(None, sendmsg, rest)
    assert b"".join(taken) == b"headbody bytesend"
    rest = send_pieces(lambda data: 2, None, [b"ab", b"cd"])  # no sendmsg: joined
    assert [bytes(piece) for piece in rest] == [b"cd"]


def test_is_loopback_knows_this_machines_addresses_and_nothing_else():
    from zc_lb.sockets import is_loopback

    assert all(is_loopback(host) for host in ("127.0.0.1", "127.8.9.1", "::1", "localhost",
                                              "::1%lo"))
    assert not any(is_loopback(host) for host in ("10.0.0.1", "0.0.0.0", "::", "example.com",
                                                  "", None, "192.168.1.1%eth0"))


def test_send_file_sends_a_files_bytes_and_says_when_it_ended_first(tmp_path):
    # (sockets.send_file: sendfile(2) from a gevent socket, waiting while
    # the socket is full; fewer bytes only if the file ended.)
    import gevent.socket
    from zc_lb.sockets import send_file

    data = bytes(range(256)) * 8192  # 2 MiB: more than a socket buffer holds
    path = tmp_path / "f"
    path.write_bytes(data)
    left, right = gevent.socket.socketpair()
    received = []

    def receive():
        while sum(map(len, received)) < len(data) - 10:
            received.append(right.recv(65536))

    reader = gevent.spawn(receive)
    with open(path, "rb") as f:
        assert send_file(left, f.fileno(), 10, len(data) - 10) == len(data) - 10
        reader.join(5)
        assert b"".join(received) == data[10:]
        assert send_file(left, f.fileno(), len(data) - 5, 100) == 5  # (the file ended)
    assert right.recv(100) == data[-5:]
    left.close()
    right.close()


def test_addresses_are_host_and_port_or_a_unix_sockets_path(tmp_path):
    import errno
    import socket

    from zc_lb.errors import ConfigurationError
    from zc_lb.sockets import address_text, parse_listen, unix_listener, worker_addresses

    assert parse_listen("127.0.0.1:80") == ("127.0.0.1", 80)
    assert parse_listen("[::1]:80") == ("::1", 80)
    assert parse_listen("unix:/run/zc-lb.sock") == "/run/zc-lb.sock"
    assert parse_listen("unix:relative.sock") == "relative.sock"
    with pytest.raises(ConfigurationError, match="unix:PATH"):
        parse_listen("unix:")
    assert address_text(("::1", 80)) == "[::1]:80"
    assert address_text(("10.0.0.1", 80, 0, 0)) == "10.0.0.1:80"
    assert address_text("/run/zc-lb.sock") == "unix:/run/zc-lb.sock"
    assert worker_addresses(["unix:/a.sock", "h:1", "unix:/a.sock"]) == ["unix:/a.sock", "h:1"]
    with pytest.raises(ConfigurationError, match="--worker: expected unix:PATH"):
        worker_addresses(["unix:"])
    # A socket file nobody accepts on is taken over; one in use is refused.
    path = str(tmp_path / "s.sock")
    first = unix_listener(path)
    with pytest.raises(OSError) as refused:
        unix_listener(path)
    assert refused.value.errno == errno.EADDRINUSE
    first.close()  # (its file stays: a process that ended)
    second = unix_listener(path)
    client = socket.socket(socket.AF_UNIX)
    client.connect(path)
    client.close()
    second.close()


# -- liveness: floods of Pings, our own stalls ---------------------------------


def test_pings_a_second_are_judged_however_their_bursts_are_spaced():
    # The count was judged from its last reset: a burst coming a second
    # after it was forgiven whole, so thousands a second went on for good.
    from zc_lb.errors import RemoteProtocolError
    from zc_lb.wire.keepalive import MAX_PINGS, Keepalive

    keepalive = Keepalive(1.0, 5.0, now=0.0)
    for second in range(1, 20):  # a live peer's Ping a second, and a few more
        keepalive.count_pings(second * 3, now=float(second))
    keepalive.count_pings(57 + MAX_PINGS, now=20.0)  # a burst of the whole allowance
    keepalive.count_pings(57 + MAX_PINGS + 32, now=20.5)  # half a second's more
    with pytest.raises(RemoteProtocolError, match="a flood of Pings"):
        keepalive.count_pings(57 + MAX_PINGS + 32 + 5000, now=22.0)  # a burst, later


def test_a_ping_flood_in_bursts_a_second_apart_loses_its_link(pair):
    lb, worker, lb_handler, _ = pair()
    for _ in range(3):
        gevent.sleep(1.1)
        worker.write(encoder.encode(frames.Ping()) * 2000)
        gevent.sleep(0.1)
        if lb_handler.lost.ready():
            break
    assert "a flood of Pings" in str(lb_handler.lost.get(timeout=1))


def test_our_own_stall_is_taken_off_the_peers_silence():
    # A stall of 2 to 3.5 s got a live worker suspected: its Pings waited
    # unread in the socket, and only stalls past half the timeout were ours.
    from zc_lb.wire.keepalive import Keepalive

    keepalive = Keepalive(1.0, 5.0, now=0.0)
    keepalive.last_received = 9.8  # heard just before the loop stalled
    assert keepalive.stalled(slept=10.0, now=12.9) == pytest.approx(1.9)
    assert not keepalive.suspicion_changed(12.9 - keepalive.last_received)  # 1.2 s, not 3.1
    assert keepalive.stalled(slept=12.9, now=13.95) == 0.0  # a tick on time forgives nothing
    # A peer silent all along is suspected all the same, only later.
    assert keepalive.suspicion_changed(14.0 - keepalive.last_received)


def test_a_lost_lb_connection_stops_the_application_its_requests_run():
    # Only a peer's Cancel did: an LB that crashed or dropped the link left
    # a hung application running, holding its --concurrency slot.
    from zc_lb.worker.server import Worker

    def hang(environ, start_response):
        gevent.sleep(3600)

    worker = Worker(hang, concurrency=1)
    worker.start()
    lb = None
    try:
        lb = Connection(gevent.socket.create_connection(worker.address), "lb", Recorder(),
                        peer="worker")
        lb.handshake()
        lb.start()
        lb.open_request({"REQUEST_METHOD": "GET", "PATH_INFO": "/", "SERVER_NAME": "x",
                         "SERVER_PORT": "80", "SERVER_PROTOCOL": "HTTP/1.1",
                         "wsgi.url_scheme": "http"}, end=True)
        with gevent.Timeout(3):
            while len(worker.requests) != 1:
                gevent.sleep(0.02)
        lb.close("the LB went away")
        with gevent.Timeout(3):
            while len(worker.requests):
                gevent.sleep(0.02)
    finally:
        if lb is not None:
            lb.close()
        worker.stop(timeout=0.5)


def test_a_hello_no_lb_would_take_is_refused_at_start():
    # A --version of a kilobyte made every LB refuse every connection, for good.
    from zc_lb.errors import ConfigurationError
    from zc_lb.worker.server import Worker

    with pytest.raises(ConfigurationError, match="--version is too long"):
        Worker(lambda environ, start_response: [b""], version="v" * 1000)
    Worker(lambda environ, start_response: [b""], version="v" * 500)


def stranger_pair(role, answer=None, hold=False):
    """A connection of ``role`` to a socket peer that is no zc-lb peer:
    it reads the Hello, sends ``answer`` (if any), and closes (unless
    ``hold``)."""
    import socket

    ours, theirs = socket.socketpair()
    ours, theirs = gevent.socket.socket(fileno=ours.detach()), gevent.socket.socket(
        fileno=theirs.detach())

    def peer():
        theirs.recv(4096)
        if answer:
            theirs.sendall(answer)
        if not hold:
            theirs.close()
    gevent.spawn(peer)
    return Connection(ours, role, Recorder(), peer="peer"), theirs


@pytest.mark.parametrize("role, answer, said", [
    ("lb", b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n",
     "expected a zc-lb worker's Hello, received b'HTTP/1.1 400 Bad Request\\r\\n"
     "Content-Length'...: an HTTP server, not a zc-lb worker's port"),
    ("worker", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
     "expected a zc-lb LB's Hello, received b'GET / HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n': "
     "an HTTP client on a zc-lb worker's port, which takes LBs only"),
    ("lb", b"\x1b[31m" + b"x" * 100, "expected a zc-lb worker's Hello, received b'\\x1b[31m"
     + "x" * 35 + "'..."),
    ("lb", None, "peer closed during handshake, before its Hello: nothing received "
     "(is it a zc-lb worker's port?)"),
    ("worker", b"\x00\x00", "peer closed during handshake, before its Hello: "
     "received b'\\x00\\x00'"),
])
def test_a_peer_that_is_not_zc_lb_is_said_to_be_with_what_it_sent(role, answer, said):
    # Its first bytes, shown escaped and cut short, and what they look
    # like, not "unknown frame type 47" nor a bare closed connection.
    connection, _ = stranger_pair(role, answer)
    with pytest.raises((RemoteProtocolError, ConnectionLost, WorkerLost)) as raised:
        connection.handshake(timeout=5)
    assert str(raised.value) == said
    connection.close()


def test_a_peer_that_sends_no_hello_in_time_is_said_to_have_sent_nothing():
    connection, theirs = stranger_pair("lb", hold=True)
    with pytest.raises(RemoteProtocolError) as raised:
        connection.handshake(timeout=0.2)
    assert str(raised.value) == ("handshake timed out: no Hello from peer in 0.2s, nothing "
                                 "received (is it a zc-lb worker's port?)")
    connection.close()
    theirs.close()


def test_a_peer_that_closes_after_its_hello_refused_ours():
    # An LB of a release before a feature, refused by the worker, which
    # says why in its log: this side says it was refused, and where to look.
    a, b = gevent.socket.socketpair()
    older = Connection(a, "lb", Recorder(), peer="worker", secret=b"s",
                       features=tuple(f for f in frames.LB_FEATURES if f != "ready"))
    worker = Connection(b, "worker", Recorder(), peer="lb", secret=b"s")

    def refuse():
        try:
            worker.handshake(5)
        finally:
            worker.close()
    refusing = gevent.spawn(refuse)
    with pytest.raises(WorkerLost) as raised:
        older.handshake(5)
    assert str(raised.value) == ("worker closed during handshake, after its Hello: it "
                                 "refused this LB (its log says why)")
    assert "lacks the protocol features ready" in str(refusing.exception)
    older.close()


@pytest.mark.parametrize("refused", ["lb", "worker"])
def test_a_peer_refused_without_a_secret_is_told_why_and_takes_the_connection_for_lost(refused):
    # Without a secret the refused side waits for no Auth: it took the
    # connection for open, put the worker in its pool and sent it
    # requests, then logged a bare "closed the connection" (and an LB
    # answered 502) over and over, its log never saying why.
    a, b = gevent.socket.socketpair()
    older_features = {"lb": tuple(f for f in frames.LB_FEATURES if f != "cache"),
                      "worker": tuple(f for f in frames.WORKER_FEATURES if f != "keys")}
    other = "worker" if refused == "lb" else "lb"
    handler = Recorder()
    older = Connection(a, refused, handler, peer=other, features=older_features[refused])
    newer = Connection(b, other, Recorder(), peer=refused)
    refusing = gevent.spawn(newer.handshake, 5)
    older.handshake(5)  # (it cannot tell yet)
    older.start()
    refusing.join(5)
    newer.close()
    error = handler.lost.get(timeout=5)
    lacking = {"lb": "the LB lacks the protocol features cache",
               "worker": "the worker lacks the protocol features keys"}[refused]
    assert lacking in str(refusing.exception)
    assert str(error).startswith("%s refused this %s at its Hello: %s: " % (
        other, "LB" if refused == "lb" else "worker", lacking)), error
    assert isinstance(error, WorkerLost if refused == "lb" else ConnectionLost)
    assert older.refused
    older.close()
