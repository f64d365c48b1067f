"""The LB's side of a response under way (lb/awaiting.py, lb/bodies.py):
a worker that falls silent or is lost mid-body, and the watchdog's own
failures.  In process, on the harness of test_hardening.py: a real
Worker, a real LB and its FrontServer on 127.0.0.1."""

import logging
import socket
import time

import gevent
import pytest

from zc_lb.lb.spool import SpoolLimits
from apps import count_body
from test_hardening import poll, routes, stack  # noqa: F401 (stack: a fixture)

pytestmark = pytest.mark.timeout(20)

STALL_AFTER = b"x" * 10


def _stalls_mid_body(environ, start_response):
    start_response("200 OK", [("Content-Length", "1000")])
    yield STALL_AFTER
    gevent.sleep(3600)  # (cancelled at the worker, or cut off as the test ends)
    yield b"y" * 990


def _raw_get(s, path, rcvbuf=None):
    """A client socket that sent ``GET path`` (``rcvbuf``: its receive buffer)."""
    sock = gevent.socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(5)
    sock.connect(s.address)
    sock.sendall(b"GET %s HTTP/1.1\r\nHost: a.example\r\n\r\n" % path.encode())
    return sock


def _read_to_eof(sock, timeout):
    """What comes on ``sock`` until the server closes it; None if it is still
    open after ``timeout`` seconds."""
    got = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sock.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            data = sock.recv(65536)
        except socket.timeout:
            break
        if not data:
            return got
        got += data
    return None


def test_a_worker_silent_mid_body_is_cut_off_counted_and_its_slot_freed(stack, caplog):
    s = stack(routes({"/stall": _stalls_mid_body}), response_timeout=0.3,
              outlier={"consecutive": 1, "max_share": 1.0})
    peer = next(iter(s.lb.fleet.links))
    started = time.monotonic()
    got = _read_to_eof(_raw_get(s, "/stall"), timeout=2.0)
    assert got is not None, "the client's connection is left open for ever"
    assert got.startswith(b"HTTP/1.1 200 OK") and got.endswith(STALL_AFTER)
    assert time.monotonic() - started < 1.5
    poll(lambda: s.lb.in_flight == 0 and s.backlog() == 0, timeout=2, message="slot freed")
    poll(lambda: not s.worker.requests, timeout=2, message="cancelled at the worker")
    assert s.lb.fleet.worker_failures == 1
    assert s.lb.fleet.ejector.ejected(peer)
    [said] = [r for r in caplog.records if "/stall" in r.getMessage()]
    assert said.levelno == logging.WARNING and peer in said.getMessage()


def _big_stream(environ, start_response):
    start_response("200 OK", [("Content-Length", str(256 * 64 * 1024))])
    return (b"x" * (64 * 1024) for _ in range(256))


def test_a_worker_held_back_for_a_slow_client_is_not_timed_out(stack):
    # The spool is full and the client reads nothing for longer than the
    # response timeout: the LB holds the worker back, which is the client's
    # stall (client_timeout's), not the worker's.
    size = 256 * 64 * 1024
    s = stack(routes({"/big": _big_stream}), response_timeout=0.3,
              spool_limits=SpoolLimits(memory=64 * 1024, disk=0))
    sock = _raw_get(s, "/big", rcvbuf=16 * 1024)
    poll(lambda: s.lb.flight.spool_limits.stalled > 0, message="the spool full")
    gevent.sleep(0.7)  # (the client reads nothing: past the response timeout)
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1 << 20)
    got = len(head.partition(b"\r\n\r\n")[2])
    while got < size:  # (counted, not kept: a copy of all each time would stall the loop)
        data = sock.recv(1 << 20)
        assert data, "the connection closed after %d bytes of the body" % got
        got += len(data)
    assert head.startswith(b"HTTP/1.1 200 OK") and got == size
    assert s.lb.fleet.worker_failures == 0


def test_a_worker_lost_mid_body_counts_once_toward_its_ejection(stack):
    s = stack(routes({"/stall": _stalls_mid_body}),
              outlier={"consecutive": 1, "max_share": 1.0})
    [(peer, link)] = s.lb.fleet.links.items()
    sock = _raw_get(s, "/stall")
    got = b""
    while not got.endswith(STALL_AFTER):
        data = sock.recv(65536)
        assert data
        got += data
    link.connection.sock.shutdown(socket.SHUT_RDWR)  # (as a worker's host that went)
    assert _read_to_eof(sock, timeout=2.0) is not None  # (a truncated body: closed)
    poll(lambda: s.lb.in_flight == 0, timeout=2, message="the request ended")
    assert s.lb.fleet.worker_failures == 1 and s.lb.counters.retries == 0
    assert s.lb.fleet.ejector.total_ejections == 1


def test_a_chore_failing_every_turn_is_said_once_a_minute_and_its_recovery_said(caplog):
    from zc_lb.lb.awaiting import WATCHDOG_INTERVAL, Awaiting

    failing = [True]

    def tick(now):
        if failing[0]:
            raise RuntimeError("a bug in a chore, every time")

    awaiting = Awaiting(1.0, tick)
    turns = int(150 / WATCHDOG_INTERVAL)  # (two and a half minutes of turns)
    with caplog.at_level(logging.INFO, logger="zc_lb.lb.awaiting"):
        for turn in range(turns):
            awaiting._look(1000.0 + turn * WATCHDOG_INTERVAL)
        failing[0] = False
        awaiting._look(1000.0 + turns * WATCHDOG_INTERVAL)
        awaiting._look(1000.0 + (turns + 1) * WATCHDOG_INTERVAL)
    said = [r for r in caplog.records if r.name == "zc_lb.lb.awaiting"]
    assert [bool(r.exc_info) for r in said] == [True, False, False, False]
    assert "the LB's chores failed a turn" in said[0].getMessage()
    assert "%d" % (60 / WATCHDOG_INTERVAL) in said[1].getMessage()
    assert "again" in said[-1].getMessage() and "%d" % turns in said[-1].getMessage()


def _count_body(environ, start_response):
    body = str(count_body(environ)).encode()
    start_response("200 OK", [("Content-Length", str(len(body)))])
    return [body]


def _answers_then_counts(environ, start_response):
    start_response("200 OK", [])
    yield b"counting "
    yield _count_body(environ, lambda *args: None)[0]


@pytest.mark.parametrize("path", ["/count", "/stream"])
def test_a_client_that_pauses_its_upload_is_no_worker_timing_out(stack, path):
    # A client that sent part of its body and paused past the response
    # timeout was answered 504 "no response within", and its worker, which
    # waited for the body, was counted failed (ejected, at the ejection's
    # threshold): a few such clients ejected healthy workers.  The body's
    # pace is the client's, bounded by the client timeout; the worker is
    # timed while the body waits for it, not for the client.  So mid-body
    # too (a response that streams while its body still comes).  (The LB
    # holds no body first here: it goes on as it comes, as one past
    # --buffer-request does.)
    s = stack(routes({"/count": _count_body, "/stream": _answers_then_counts}),
              response_timeout=0.3, outlier={"consecutive": 1, "max_share": 1.0},
              spool_limits=SpoolLimits(request=0))
    sock = gevent.socket.create_connection(s.address, timeout=5)
    sock.sendall(b"POST %s HTTP/1.1\r\nHost: a.example\r\nContent-Length: 20\r\n\r\n"
                 % path.encode() + b"0123456789")
    gevent.sleep(1.0)  # (the client pauses: past the response timeout)
    sock.sendall(b"0123456789")
    got = _read_to_eof(sock, timeout=3.0) if path == "/stream" else sock.recv(65536)
    sock.close()
    assert got is not None and got.startswith(b"HTTP/1.1 200 OK"), got
    if path == "/count":
        assert got.endswith(b"\r\n\r\n20"), got
    else:  # (chunked, and closed: the response began before the body had all come)
        assert got.endswith(b"9\r\ncounting \r\n2\r\n20\r\n0\r\n\r\n"), got
    assert s.lb.fleet.worker_failures == 0
