"""zc_lb.process.asking: how a ``--processes N`` supervisor asks its
children, over gevent's sockets: the same answers and errors as
``fetch``'s (urllib, blocking), every child at once, actions in turn.

The children here are status apps served by wsgiref in a thread (so
that ``fetch``, blocking, can be asked the same), and listening sockets
that never answer (conftest's ``silent``: as a child stopped with
SIGSTOP, the kernel takes the connection and the request, no one reads
them)."""

import time

import gevent
import pytest

from zc_lb.errors import ConfigurationError, ZcLbError
from zc_lb.process.asking import FifoLock, ask, each
from zc_lb.status.document import fetch, status_app

pytestmark = pytest.mark.timeout(30)


def both(*args, **kwargs):
    """What ``fetch`` and ``ask`` make of one question: each's answer, or
    its error's class and message."""
    said = []
    for get in (fetch, ask):
        try:
            said.append(get(*args, **kwargs))
        except ZcLbError as exc:
            said.append((type(exc), str(exc)))
    return said


def test_ask_gets_what_fetch_gets_and_fails_as_it_fails(wsgi_thread):
    # The supervisor asked its children with fetch (urllib, blocking its
    # gevent loop); ask is the same question over gevent's sockets, and
    # its answers, and its errors, must be fetch's.
    from zkserver import free_port

    done = []
    document = {"requests": 3, "workers": {}}
    app = status_app(lambda: document, {"drain": lambda worker: done.append(worker) or {
        "worker": worker, "changed": True}}, token=b"sesame")
    address = wsgi_thread(app)
    cases = [
        ((address,), {}),
        ((address,), {"params": {"skills": "all"}}),
        ((address,), {"action": "drain", "params": {"worker": "w:1"}, "token": b"sesame"}),
        ((address,), {"action": "drain", "params": {"worker": "w:1"}}),  # 401
        ((address,), {"action": "drain", "token": b"sesame"}),  # 400: no worker given
        ((address,), {"action": "shutdown", "token": b"sesame"}),  # 404
        (("127.0.0.1:%d" % free_port(),), {"timeout": 2}),  # nothing there
    ]
    for args, kwargs in cases:
        fetched, asked = both(*args, **kwargs)
        assert fetched == asked, (args, kwargs)
    assert done == ["w:1", "w:1"]
    assert both(address)[1] == document
    assert both(address, action="drain", params={"worker": "w:1"})[1][0] is ConfigurationError

    def not_json(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"<html>"]

    def not_done(environ, start_response):  # (an application's JSON, not an action's)
        start_response("200 OK", [("Content-Type", "application/json")])
        return [b'{"ok": true}']

    def busy(environ, start_response):  # (a supervisor none of whose children answered)
        start_response("503 Service Unavailable", [("Content-Type", "application/json")])
        return [b'{"error": "drain: no answer"}']

    for app in (not_json, not_done, busy):
        fetched, asked = both(wsgi_thread(app), action="drain")
        assert fetched == asked and asked[0] is (ZcLbError if app is busy
                                                 else ConfigurationError), asked


def test_ask_is_not_http_where_fetch_is_not(not_http):
    there = not_http(2)
    fetched, asked = both(there, timeout=2)
    assert fetched == asked == (ConfigurationError, "http://%s/ is not a zc-lb status "
                                "server: BadStatusLine: SSH-2.0-OpenSSH" % there)


def test_a_child_that_never_answers_is_given_up_in_time_while_the_rest_runs(silent):
    # fetch blocked the supervisor's whole loop for its timeout: nothing
    # else ran meanwhile, not even a greenlet due long before.
    ran = []
    address, = silent()
    ticker = gevent.spawn_later(0.1, lambda: ran.append(time.monotonic()))
    started = time.monotonic()
    with pytest.raises(ZcLbError) as info:
        ask(address, timeout=0.5)
    took = time.monotonic() - started
    assert type(info.value) is ZcLbError
    assert str(info.value) == "cannot get status from http://%s/: timed out" % address
    assert 0.45 < took < 1.0
    ticker.join(1)
    assert ran and ran[0] - started < 0.3


def test_every_child_is_asked_at_once(wsgi_thread, silent):
    # One after another, each child that hung added its timeout.
    good = wsgi_thread(status_app(lambda: {"requests": 1}))
    quiet = silent(3)
    started = time.monotonic()
    answers = each([quiet[0], good, quiet[1], quiet[2]],
                   lambda address: ask(address, timeout=0.5))
    took = time.monotonic() - started
    assert took < 1.0  # (not 1.5)
    assert [address for address, _ in answers] == [quiet[0], good, quiet[1], quiet[2]]
    assert answers[1][1] == {"requests": 1}
    assert all(isinstance(answer, ZcLbError) for i, (_, answer) in enumerate(answers) if i != 1)


def test_each_raises_what_is_no_answer():
    def broken(child):
        if child == 2:
            raise KeyError(child)
        return child

    with pytest.raises(KeyError):
        each([1, 2, 3], broken)


def test_the_fifo_lock_is_taken_in_the_order_it_was_asked_for():
    lock, order = FifoLock(), []

    def act(name, hold):
        with lock:
            order.append(name)
            gevent.sleep(hold)

    first = gevent.spawn(act, "first", 0.05)
    gevent.sleep(0)  # (it holds the lock)
    waiting = [gevent.spawn(act, name, 0) for name in ("a", "b", "killed", "c", "d")]
    gevent.sleep(0.01)
    waiting[2].kill()  # (given up while waiting: the rest keep their turns)
    gevent.joinall([first] + waiting, timeout=5)
    assert order == ["first", "a", "b", "c", "d"] and not lock.locked


def test_a_fifo_lock_whose_next_holder_gave_up_goes_to_the_one_after():
    lock, order = FifoLock(), []

    def act(name):
        with lock:
            order.append(name)

    with lock:
        next_one = gevent.spawn(act, "next")
        after = gevent.spawn(act, "after")
        gevent.sleep(0)  # (both wait)
        next_one.kill()
    gevent.joinall([next_one, after], timeout=5)
    assert order == ["after"] and not lock.locked
