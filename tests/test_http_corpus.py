"""The front's request corpus (tests/data/http_requests.json), replayed
against a real LB process in front of a worker that echoes its environ.

Each request is sent whole, one byte at a time, and split at seeded
random points (as gunicorn's parser tests do), on a new connection.  A
valid request must reach the worker as the corpus says; an invalid one
must get its status and a closed connection, and never reach the worker.
Only bytes on the wire are tested, so the corpus outlives the front's
parser.  The same cases drive the front handler in process in
test_http.py; corpus.py reads them for both.
"""

import http.client
import json
import os
import select
import socket

import pytest

from corpus import (CASES, CHUNKINGS, IDS, FileSock, KeepOpen, check_answer, chunks,
                    request_bytes)
from zc_lb.testing import LBProcess, WorkerProcess, wait_for

TESTS = os.path.dirname(os.path.abspath(__file__))
ENV = {"PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")}

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(scope="module")
def front():
    """host, port of an LB in front of one echoing worker."""
    worker = WorkerProcess("echo_app:app", env=ENV).start()
    lb = LBProcess([worker.address], "--header-timeout", "5", env=ENV).start()
    host, port = lb.address.split(":")
    wait_for(lambda: _served((host, int(port))), message="LB connected to the worker")
    yield host, int(port)
    lb.terminate(10)
    worker.terminate(10)


def _served(address):
    try:
        status, _, _ = exchange(address, [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"])
    except OSError:
        return False
    return status == 200


def exchange(address, pieces, timeout=5.0, wait_close=False):
    """(status, body, closed) for a request sent in ``pieces``; with
    ``wait_close``, ``closed`` says whether the server closed the
    connection after its response (within ``timeout``)."""
    with socket.create_connection(address, timeout=timeout) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for piece in pieces:
            if select.select([sock], [], [], 0)[0]:
                break  # answered already: the rest would only meet a reset
            try:
                sock.sendall(piece)
            except OSError:
                break
        reader = sock.makefile("rb")
        response = http.client.HTTPResponse(FileSock(reader))
        response.begin()
        body = response.read()
        closed = None
        if wait_close:
            try:  # the response had a length: nothing is left in the reader
                closed = sock.recv(1) == b""
            except socket.timeout:
                closed = False
        reader.close()
        return response.status, body, closed



@pytest.mark.parametrize("how", CHUNKINGS)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_corpus(front, case, how):
    pieces = chunks(request_bytes(case), how, case["name"])
    check_answer(case, *exchange(front, pieces, wait_close=case["status"] != 200))


def test_a_request_pipelined_behind_a_proxy_connection_close_is_served(front):
    # llhttp read "Proxy-Connection: close" as the end of the connection
    # the front kept open: the request behind it got a 400.
    first = (b"POST / HTTP/1.1\r\nHost: a.example\r\nProxy-Connection: close\r\n"
             b"Transfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n")
    second = b"GET /next HTTP/1.1\r\nHost: a.example\r\nConnection: close\r\n\r\n"
    with socket.create_connection(front, timeout=5) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(first + second)
        reader = sock.makefile("rb")
        kept = KeepOpen(reader)  # (http.client closes it after each response)
        bodies = []
        for _ in range(2):
            response = http.client.HTTPResponse(FileSock(kept))
            response.begin()
            assert response.status == 200
            bodies.append(json.loads(response.read()))
        reader.close()
    assert [(b["PATH_INFO"], b["body"]) for b in bodies] == [("/", "hi"), ("/next", "")]


def test_corpus_names_are_unique_and_cover_both_kinds():
    names = [case["name"] for case in CASES]
    assert len(names) == len(set(names))
    assert sum(case["status"] == 200 for case in CASES) >= 30
    assert sum(case["status"] != 200 for case in CASES) >= 60
