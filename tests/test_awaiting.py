"""The LB's side of a response under way (lb/awaiting.py, lb/bodies.py):
a worker that falls silent or is lost mid-body, and the watchdog's own
failures.  In process, on the harness of test_hardening.py: a real
Worker, a real LB and its FrontServer on 127.0.0.1."""

import logging
import socket
import time

import gevent
import pytest

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
