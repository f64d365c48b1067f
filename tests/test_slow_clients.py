"""Slow clients, end to end: real worker and LB processes on loopback.

A client that reads slowly but steadily must get its whole response, and
one that stops reading is cut after the client timeout (without progress),
never after the head's deadline.  Clients read through a small receive
buffer, so the kernel cannot take the response for them.
"""

import os
import socket
import time

import pytest

from zc_lb.testing import LBProcess, WorkerProcess, wait_for

TESTS = os.path.dirname(os.path.abspath(__file__))
ENV = {"PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")}
MIB = 1024 * 1024

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def procs():
    started = []

    def start(process):
        started.append(process.start())
        return process

    yield start
    for process in reversed(started):
        process.kill()


def slow_socket(address, rcvbuf=8192, timeout=10.0):
    host, port = address.split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(timeout)
    sock.connect((host, int(port)))
    return sock


def read_response(sock, pause=0.0, limit=None):
    """(head, body bytes received, whether the server closed), reading in
    64 KiB steps with ``pause`` seconds between them; at most ``limit``
    body bytes (then the connection is left open, unread)."""
    data, received, head = b"", 0, None
    while limit is None or received < limit:
        chunk = sock.recv(65536)
        if not chunk:
            return head, received, True
        if head is None:
            data += chunk
            if b"\r\n\r\n" in data:
                head, _, rest = data.partition(b"\r\n\r\n")
                received = len(rest)
        else:
            received += len(chunk)
        if pause:
            time.sleep(pause)
    return head, received, False


def test_a_download_longer_than_the_header_timeout_is_not_cut(procs):
    worker = procs(WorkerProcess("apps:app", env=ENV))
    lb = procs(LBProcess([worker.address], "--header-timeout", "1", "--client-timeout", "5",
                         env=ENV))
    sock = slow_socket(lb.address)
    try:
        sock.sendall(b"GET /big?4 HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
        started = time.monotonic()
        # About 800 KB/s: the LB's send buffer frees a third of itself (when
        # gevent wakes a blocked send) in more than the header timeout.
        head, received, _ = read_response(sock, pause=0.02)
        took = time.monotonic() - started
    finally:
        sock.close()
    assert head.startswith(b"HTTP/1.1 200")
    assert took > 1.5, "the download must outlast the header timeout to test anything"
    assert received == 4 * MIB


def test_a_client_that_stops_reading_is_cut_after_the_client_timeout(procs, tmp_path):
    log_path = tmp_path / "lb.log"
    worker = procs(WorkerProcess("apps:app", env=ENV))
    with open(log_path, "w") as log:
        lb = procs(LBProcess([worker.address], "--header-timeout", "10",
                             "--client-timeout", "1", env=ENV, stderr=log))
    sock = slow_socket(lb.address, timeout=15)
    try:
        sock.sendall(b"GET /big?24 HTTP/1.1\r\nHost: a\r\n\r\n")
        started = time.monotonic()
        head, received, _ = read_response(sock, limit=MIB)
        wait_for(lambda: "made no progress for 1s" in log_path.read_text(), timeout=8,
                 message="the cut logged")
        took = time.monotonic() - started  # the client timeout, not the head's 10 s
        rest = read_response(sock)  # what the LB had sent, then its close
    finally:
        sock.close()
    assert head.startswith(b"HTTP/1.1 200")
    assert 0.9 < took < 8, took
    assert rest[2] and received + rest[1] < 24 * MIB
