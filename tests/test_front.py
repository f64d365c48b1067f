"""The front's client connection (front.py) in process, without a
socket or another process: the request corpus (data/http_requests.json)
fed in chunks, pipelining, split heads, 100-continue, chunked bodies,
HTTP/1.0, HEAD, refused response heads, failing applications, mutated
requests, and idle keep-alive clients that park.  test_http.py runs the
front on real processes; test_http_corpus.py sends the corpus to a real LB.
"""

import http.client
import io
import random
import socket
import time

import pytest

import echo_app
from corpus import CASES, CHUNKINGS, IDS, FileSock, check_answer, chunks, request_bytes
from zc_lb.front.body import SMALL_PIECES
from zc_lb.front.client import ClientConnection
from zc_lb.front.server import _Server
from zc_lb.lb.balancer import _forwarded_environ
from zc_lb.environ import RELAY


# -- the request corpus, in process ---------------------------------------------


class _PieceSocket:
    """A client socket that gives ``pieces`` one read at a time, as a
    socket gives what has arrived, then its end of file, and keeps what
    the server sends."""

    def __init__(self, pieces):
        self.pieces = [bytes(piece) for piece in pieces if piece]
        self.sent = bytearray()

    def recv(self, size):
        if not self.pieces:
            return b""
        piece = self.pieces.pop(0)
        if len(piece) > size:
            self.pieces.insert(0, piece[size:])
        return piece[:size]

    def send(self, data):
        self.sent += data
        return len(data)

    def sendall(self, data):
        self.sent += data

    def settimeout(self, timeout):
        pass

    def setsockopt(self, *args):
        pass

    def shutdown(self, how):
        pass

    def close(self):
        pass


def _forwarding_echo(environ, start_response):
    """echo_app.py behind the LB: it sees what the LB forwards."""
    forwarded = _forwarded_environ(environ, "")
    forwarded["wsgi.input"] = environ["wsgi.input"]
    return echo_app.app(forwarded, start_response)


@pytest.fixture(scope="module")
def front_handler():
    """handle(pieces) -> (status, body, closed) of one request read by a
    ClientConnection (http.py: the head through h1.py, llhttp and
    httpparse.py) in front of _forwarding_echo; ``closed``: the
    connection is ended after its answer."""
    server = _Server(("127.0.0.1", 0), _forwarding_echo, "http")  # never started

    def handle(pieces):
        sock = _PieceSocket(pieces)
        connection = ClientConnection(server, sock, ("127.0.0.1", 40000))
        connection.run()
        response = http.client.HTTPResponse(FileSock(io.BytesIO(bytes(sock.sent))))
        response.begin()
        return response.status, response.read(), connection.close

    return handle



@pytest.mark.parametrize("how", CHUNKINGS)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_corpus_in_process(front_handler, case, how):
    check_answer(case, *front_handler(chunks(request_bytes(case), how, case["name"])))


# -- the front's HTTP/1.1, in process (h1.py and ClientConnection) ----------------


def serve_pieces(app, pieces):
    """(bytes sent back, whether the server chose to close) when a client
    sends ``pieces`` on one connection to a ClientConnection running ``app``."""
    server = _Server(("127.0.0.1", 0), app, "http")  # never started
    sock = _PieceSocket(pieces)
    connection = ClientConnection(server, sock, ("127.0.0.1", 40000))
    connection.run()
    return bytes(sock.sent), connection.close


def responses(data, methods=()):
    """The (status, headers, body) of each response in ``data``, in order."""
    class Unclosed(io.BytesIO):
        def close(self):  # http.client closes what it read to the end
            pass

    stream, found = Unclosed(data), []
    methods = list(methods)
    while stream.tell() < len(data):
        response = http.client.HTTPResponse(FileSock(stream),
                                            method=methods.pop(0) if methods else "GET")
        response.begin()
        found.append((response.status, dict(response.getheaders()), response.read()))
    return found


def path_app(environ, start_response):
    body = environ["PATH_INFO"].encode()
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
    return [body]


class ReadyForwarder:
    """A Forwarder (front/forwarder.py) answering with a head ready for
    the client, as the LB does with a worker's."""

    def __init__(self):
        self.seen = []

    def forward(self, environ, responder):
        relay = environ[RELAY]
        self.seen.append((relay.head.path, responder.sock is not None, sorted(environ)))
        body = b"ready"
        responder.start_ready("200 OK", b"HTTP/1.1 200 OK\r\nX-Ready: 1\r\n"
                              b"Content-Length: 5\r\nDate: x\r\n", len(body))
        return [body]


def test_a_forwarder_gets_the_relayed_head_and_answers_through_the_connection():
    forwarder = ReadyForwarder()
    sent, _ = serve_pieces(forwarder, [b"GET /a?b HTTP/1.1\r\nHost: a\r\n\r\n"])
    [(status, headers, body)] = responses(sent)
    assert (status, headers["X-Ready"], body) == (200, "1", b"ready")
    [(path, watched, keys)] = forwarder.seen
    assert path == "/a?b" and watched
    assert "PATH_INFO" not in keys  # (made by the Relay when asked, not before)


def test_a_plain_wsgi_application_gets_a_whole_environ_and_no_relay():
    seen = []

    def app(environ, start_response):
        seen.append(environ)
        return path_app(environ, start_response)

    sent, _ = serve_pieces(app, [b"GET /a HTTP/1.1\r\nHost: a\r\n\r\n"])
    assert responses(sent)[0][2] == b"/a"
    assert RELAY not in seen[0] and seen[0]["PATH_INFO"] == "/a"


def test_pipelined_requests_are_answered_in_order_on_one_connection():
    data = b"".join(b"GET /%d HTTP/1.1\r\nHost: a\r\n\r\n" % i for i in range(3))
    sent, _ = serve_pieces(path_app, [data])
    assert [body for _, _, body in responses(sent)] == [b"/0", b"/1", b"/2"]


def test_a_request_split_anywhere_is_read_the_same():
    data = b"GET /split HTTP/1.1\r\nHost: a\r\n\r\nGET /two HTTP/1.1\r\nHost: a\r\n\r\n"
    for cut in range(1, len(data)):
        sent, _ = serve_pieces(path_app, [data[:cut], data[cut:]])
        assert [body for _, _, body in responses(sent)] == [b"/split", b"/two"], cut


def body_app(environ, start_response):
    body = environ["wsgi.input"].read()
    start_response("200 OK", [("Content-Length", str(len(body)))])
    return [body]


def test_expect_100_continue_is_answered_when_the_app_reads_the_body():
    head = (b"POST /up HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\n"
            b"Content-Length: 5\r\n\r\n")
    sent, _ = serve_pieces(body_app, [head, b"hello"])
    assert sent.startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
    [(status, _, body)] = responses(sent[len(b"HTTP/1.1 100 Continue\r\n\r\n"):])
    assert (status, body) == (200, b"hello")


def test_a_request_without_a_body_reads_nothing_and_one_with_a_body_reads_it():
    def lines_app(environ, start_response):
        body = environ["wsgi.input"]
        read = [body.read(), body.read(3), body.readline(), body.readlines(), list(body)]
        answer = repr((read, body.complete, body.buffered)).encode()
        start_response("200 OK", [("Content-Length", str(len(answer)))])
        return [answer]
    sent, _ = serve_pieces(lines_app, [b"GET /a HTTP/1.1\r\nHost: a\r\n\r\n"
                                       b"POST /b HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n"
                                       b"\r\nab\ncd"])
    [(_, _, empty), (_, _, posted)] = responses(sent)
    assert empty == repr(([b"", b"", b"", [], []], True, 0)).encode()
    assert posted == repr(([b"ab\ncd", b"", b"", [], []], True, 0)).encode()


def test_no_100_continue_when_the_app_answers_without_the_body():
    head = (b"POST /up HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\n"
            b"Content-Length: 5\r\n\r\n")
    sent, _ = serve_pieces(path_app, [head])
    assert b"100 Continue" not in sent
    [(status, headers, body)] = responses(sent)
    assert (status, body) == (200, b"/up")


def test_chunked_upload_and_chunked_response():
    def app(environ, start_response):
        body = environ["wsgi.input"].read()
        start_response("200 OK", [("Content-Type", "text/plain")])
        return iter([body[:3], body[3:]])  # no length: chunked

    request = (b"POST /up HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"3\r\nhel\r\n2\r\nlo\r\n0\r\n\r\n")
    sent, _ = serve_pieces(app, [request])
    [(status, headers, body)] = responses(sent)
    assert headers["Transfer-Encoding"] == "chunked" and body == b"hello"
    assert sent.endswith(b"0\r\n\r\n")


def test_a_trailer_section_over_the_head_limit_is_431_and_the_connection_closes():
    request = (b"POST /up HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"3\r\nhel\r\n0\r\nX-T: ")
    sent, closed = serve_pieces(body_app, [request] + [b"v" * 16384] * 16 + [b"\r\n\r\n"])
    [(status, _, _)] = responses(sent)
    assert status == 431 and closed


def test_an_empty_write_sends_nothing_not_the_last_chunk():
    def app(environ, start_response):
        write = start_response("200 OK", [("Content-Type", "text/plain")])
        write(b"")
        write(b"first ")
        write(b"")
        return [b"", b"second"]

    sent, _ = serve_pieces(app, [b"GET / HTTP/1.1\r\nHost: a\r\n\r\n"
                                 b"GET /next HTTP/1.1\r\nHost: a\r\n\r\n"])
    [(_, headers, body), (_, _, again)] = responses(sent)
    assert headers["Transfer-Encoding"] == "chunked" and body == again == b"first second"


def test_the_connection_field_is_the_fronts_and_said_once():
    def app(environ, start_response):
        connection = environ["PATH_INFO"][1:]
        start_response("200 OK", [("Content-Length", "2"), ("Connection", connection)])
        return [b"ok"]

    for request, said in [(b"GET /close HTTP/1.1\r\nHost: a\r\n\r\n", b"close"),
                          (b"GET /keep-alive HTTP/1.0\r\n\r\n", b"close"),
                          (b"GET /keep-alive HTTP/1.1\r\nHost: a\r\n\r\n", None)]:
        sent, closed = serve_pieces(app, [request])
        fields = [line for line in sent.split(b"\r\n") if line.lower().startswith(b"connection:")]
        assert fields == ([b"Connection: " + said] if said else []) and closed == bool(said)


def test_http_1_0_keep_alive_and_close():
    request = b"GET /a HTTP/1.0\r\nConnection: keep-alive\r\n\r\nGET /b HTTP/1.0\r\n\r\n"
    sent, closed = serve_pieces(path_app, [request])
    (_, first, a), (_, second, b) = responses(sent)
    assert (a, first["Connection"], b, second["Connection"]) == (
        b"/a", "keep-alive", b"/b", "close")
    assert closed


def test_head_responses_have_no_body():
    sent, _ = serve_pieces(path_app, [b"HEAD /x HTTP/1.1\r\nHost: a\r\n\r\n"
                                      b"GET /y HTTP/1.1\r\nHost: a\r\n\r\n"])
    (_, head_headers, head_body), (_, _, body) = responses(sent, ["HEAD", "GET"])
    assert head_headers["Content-Length"] == "2" and head_body == b"" and body == b"/y"


@pytest.mark.parametrize("status, headers", [
    ("200 OK", [("X-Evil", "a\r\nSet-Cookie: stolen=1")]),
    ("200 OK\r\nSet-Cookie: stolen=1", []),
    ("200 OK", [("X Evil", "a")]),
    ("2000 OK", []),
])
def test_a_response_head_that_would_split_is_refused_with_500(status, headers):
    def app(environ, start_response):
        start_response(status, headers)
        return [b"body"]

    sent, closed = serve_pieces(app, [b"GET / HTTP/1.1\r\nHost: a\r\n\r\n"])
    assert sent.startswith(b"HTTP/1.1 500 ") and b"stolen" not in sent and closed


@pytest.mark.parametrize("status", ["100 Continue", "101 Switching Protocols", "199 X"])
def test_a_final_1xx_status_is_refused_with_500(status):
    def app(environ, start_response):
        start_response(status, [("Upgrade", "websocket")])
        return []

    for version in (b"1.1", b"1.0"):
        sent, closed = serve_pieces(app, [b"GET / HTTP/%s\r\nHost: a\r\n\r\n" % version])
        assert sent.startswith(b"HTTP/1.1 500 ") and b" 1" not in sent[:12] and closed


def test_an_app_failing_before_or_during_its_body():
    def before(environ, start_response):
        raise RuntimeError("boom")

    def during(environ, start_response):
        start_response("200 OK", [])
        yield b"part"
        raise RuntimeError("boom")

    sent, closed = serve_pieces(before, [b"GET / HTTP/1.1\r\nHost: a\r\n\r\n"])
    assert sent.startswith(b"HTTP/1.1 500 ") and closed
    sent, closed = serve_pieces(during, [b"GET / HTTP/1.1\r\nHost: a\r\n\r\n"
                                         b"GET /next HTTP/1.1\r\nHost: a\r\n\r\n"])
    assert sent.startswith(b"HTTP/1.1 200 ") and not sent.endswith(b"0\r\n\r\n") and closed
    assert b"/next" not in sent


def test_mutated_requests_get_an_answer_or_a_close_never_a_crash():
    """Seeded fuzzing: corpus requests with bytes flipped, cut, repeated
    or inserted; whatever comes in, run() returns and what went out is
    whole HTTP/1.1 responses."""
    rng = random.Random(20261123)
    for _ in range(400):
        data = bytearray(request_bytes(rng.choice(CASES)))
        for _ in range(rng.randint(1, 4)):
            where = rng.randrange(len(data) + 1)
            what = rng.randrange(4)
            if what == 0 and where < len(data):
                data[where] = rng.randrange(256)
            elif what == 1:
                data[where:where] = bytes(rng.choice(b"\r\n :\t\x00\x7f0aZ") for _ in range(3))
            elif what == 2:
                del data[where:where + rng.randint(1, 8)]
            else:
                data += data[:where]  # a second, partial, pipelined request
        pieces = chunks(bytes(data), rng.choice(CHUNKINGS), rng.random())
        sent, _ = serve_pieces(_forwarding_echo, pieces)
        for status, _, _ in responses(sent) if sent else ():
            assert 200 <= status < 600


# -- idle keep-alive clients park: no greenlet while they idle ---------------------


@pytest.fixture
def parking_front(monkeypatch):
    """A FrontServer in process, serving path_app, whose keep-alive clients
    park after 0.2 s idle; yields (front, connect)."""
    import gevent.socket
    from zc_lb.front import server as front_http

    monkeypatch.setattr(front_http._Server, "park_after", 0.2)
    front = front_http.FrontServer(("127.0.0.1", 0), path_app, client_timeout=1.5,
                                   max_connections=3)
    front.start()
    opened = []

    def connect():
        sock = gevent.socket.create_connection(front.address, timeout=5)
        opened.append(sock)
        return sock

    yield front, connect
    for sock in opened:
        sock.close()
    front.stop(timeout=1)


def _ask(sock, path):
    sock.sendall(b"GET %s HTTP/1.1\r\nHost: a\r\n\r\n" % path)
    data = b""
    while not data.endswith(path):
        chunk = sock.recv(4096)
        if not chunk:
            return data + b"(closed)"
        data += chunk
    return data


def _parked(server):
    """Client connections parked (they wait for a request, as in ``waiting``)."""
    return sum(1 for connection in server.waiting if connection.transport.parked)


def _until(predicate, message, timeout=5.0):
    """wait_for, yielding to the hub (the front runs in this process)."""
    import gevent
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting for " + message
        gevent.sleep(0.02)


def _closed(sock):
    import gevent.socket
    try:
        return gevent.socket.wait_read(sock.fileno(), 0.3) is None and sock.recv(100) == b""
    except socket.timeout:
        return False


def test_an_idle_keepalive_client_parks_and_is_served_when_it_asks_again(parking_front):
    import gevent
    front, connect = parking_front
    sock = connect()
    assert _ask(sock, b"/one").endswith(b"/one")
    gevent.sleep(0.5)  # past park_after: its greenlet is gone
    assert front.server.connections == 1 and _parked(front.server) == 1
    assert _ask(sock, b"/two").endswith(b"/two")  # resumed in a new greenlet
    assert _parked(front.server) == 0
    gevent.sleep(0.5)
    assert _ask(sock, b"/three").endswith(b"/three")  # parked and resumed again


def test_a_parked_client_is_closed_at_the_client_timeout_and_counted_out(parking_front):
    import gevent
    front, connect = parking_front
    sock = connect()
    _ask(sock, b"/one")
    gevent.sleep(0.5)
    assert _parked(front.server) == 1
    started = time.monotonic()
    assert sock.recv(100) == b""  # closed, quietly
    assert 0.8 < time.monotonic() - started + 0.5 < 2.5  # at the client timeout
    _until(lambda: front.server.connections == 0, message="the closed one counted out")
    assert not front.server.waiting


def test_a_parked_client_is_evicted_for_a_new_one_past_the_cap(parking_front):
    import gevent
    front, connect = parking_front
    idle = [connect() for _ in range(3)]  # the cap
    for n, sock in enumerate(idle):
        _ask(sock, b"/%d" % n)
    gevent.sleep(0.7)  # all parked, and past the eviction's grace
    newcomer = connect()
    assert _ask(newcomer, b"/new").endswith(b"/new")
    assert [_closed(sock) for sock in idle] == [True, False, False]  # the oldest made room
    _until(lambda: front.server.connections == 3, message="the evicted one counted out")


def test_a_client_hanging_up_while_parked_is_counted_out(parking_front):
    import gevent
    front, connect = parking_front
    sock = connect()
    _ask(sock, b"/one")
    gevent.sleep(0.5)
    sock.close()
    _until(lambda: front.server.connections == 0, message="counted out")
    assert not front.server.waiting


def test_read1_gives_a_piece_as_it_came_and_at_most_what_is_asked():
    def pieces_app(environ, start_response):
        body, pieces = environ["wsgi.input"], []
        pieces.append(body.read1(2))  # (a piece cut to what is asked)
        while True:
            piece = body.read1()
            if not piece:
                break
            pieces.append(piece)
        answer = repr((pieces, body.read1(), body.complete)).encode()
        start_response("200 OK", [("Content-Length", str(len(answer)))])
        return [answer]
    head = b"POST /b HTTP/1.1\r\nHost: a\r\nContent-Length: 11\r\n\r\n"
    sent, _ = serve_pieces(pieces_app, [head + b"abcd", b"efg", b"hijk"])
    [(_, _, answer)] = responses(sent)
    pieces, after, complete = eval(answer)
    assert pieces[0] == b"ab" and b"".join(pieces) == b"abcdefghijk"
    assert len(pieces) >= 3 and after == b"" and complete  # (not joined into one)
    sent, _ = serve_pieces(pieces_app, [b"GET / HTTP/1.1\r\nHost: a\r\n\r\n"])
    assert responses(sent)[0][2] == repr(([b""], b"", True)).encode()


def test_read1_joins_small_pieces_that_came_together():
    # (a body sent in 1-byte chunks went on a byte a frame)
    def sizes_app(environ, start_response):
        body, sizes = environ["wsgi.input"], []
        while True:
            piece = body.read1(65536)
            if not piece:
                break
            sizes.append(len(piece))
        answer = repr(sizes).encode()
        start_response("200 OK", [("Content-Length", str(len(answer)))])
        return [answer]
    large = b"%x\r\n" % SMALL_PIECES + b"b" * SMALL_PIECES + b"\r\n"
    sent, _ = serve_pieces(sizes_app, [
        b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"1\r\na\r\n" * 20000 + large + b"0\r\n\r\n"])
    sizes = eval(responses(sent)[0][2])
    assert sum(sizes) == 20000 + SMALL_PIECES and max(sizes) <= SMALL_PIECES
    assert len(sizes) < 10 and SMALL_PIECES in sizes  # (the large piece as it came)


def test_a_response_in_flight_when_a_drain_begins_says_connection_close():
    # The drain (SIGTERM, a restart) began after the request's head was
    # read and before its response: the response closes the connection,
    # as docs/reference/processes.rst ("Signals") says, rather than invite
    # the next request.
    server = _Server(("127.0.0.1", 0), None, "http")  # never started

    def app(environ, start_response):
        server.draining = True  # (what LBFront.drain does, mid-request)
        start_response("200 OK", [("Content-Length", "2")])
        return [b"ok"]

    server.application = app
    sock = _PieceSocket([b"GET / HTTP/1.1\r\nHost: a\r\n\r\n"])
    connection = ClientConnection(server, sock, ("127.0.0.1", 40000))
    connection.run()
    head = bytes(sock.sent).split(b"\r\n\r\n")[0]
    assert b"\r\nConnection: close" in head and connection.close


def test_a_client_turned_away_that_sends_without_end_is_not_waited_for():
    # Past --max-connections, a refused client's request is read after
    # its 503 so that closing does not reset the connection before it
    # reads the answer: read until it stopped sending, so a client that
    # sent without end kept its place (and a descriptor) for as long as
    # it liked, and 50 such had every later client closed unanswered.
    import gevent
    import gevent.socket
    from zc_lb.front.server import TURN_AWAY_LINGER, FrontServer

    def slow_app(environ, start_response):
        gevent.sleep(5)
        start_response("200 OK", [("Content-Length", "2")])
        return [b"ok"]

    front = FrontServer(("127.0.0.1", 0), slow_app, max_connections=1)
    front.start()
    busy = gevent.socket.create_connection(front.address, timeout=5)
    sock = gevent.socket.create_connection(front.address, timeout=5)
    try:
        busy.sendall(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n")  # (in flight: none to evict)
        _until(lambda: front.connections == 1, "the first request in flight")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 100000000\r\n\r\n")
        started, closed = time.monotonic(), False
        while not closed and time.monotonic() - started < 3 * TURN_AWAY_LINGER + 1:
            try:
                sock.sendall(b"x" * 1000)
            except OSError:
                closed = True
            gevent.sleep(0.01)
        assert closed, "the turned away client is still read"
        assert front.server.turning_away == 0
    finally:
        busy.close()
        sock.close()
        front.stop(timeout=1)


@pytest.mark.parametrize("limits, connections, fitted, soft", [
    ((150, 300), 100, 100, 300),  # the default cap: half the hard limit less 100
    ((1024, 100000), 5000, 5000, 10100),
    ((150, 250), 100, 100, 250),  # room for the connections, not all their files
    ((150, 180), 100, 80, 180),  # not even for the connections: the cap is lowered
])
def test_the_open_file_limit_is_raised_for_each_connection_and_its_buffer_file(
        monkeypatch, limits, connections, fitted, soft):
    # The default cap is half the hard limit less 100, since a connection
    # may hold a buffer file too; the soft limit was raised to the cap and
    # 100 only, so 100 slow downloads (cap 100, hard limit 300) ran the LB
    # out of descriptors at 200, for accepts and buffer files alike.
    import resource
    from zc_lb.front.server import default_max_connections, fit_open_files

    now = list(limits)
    monkeypatch.setattr(resource, "getrlimit", lambda which: tuple(now))
    monkeypatch.setattr(resource, "setrlimit", lambda which, pair: now.__setitem__(
        slice(None), pair))
    if limits == (150, 300):
        assert default_max_connections() == connections
    assert fit_open_files(connections) == fitted
    assert now == [soft, limits[1]]
