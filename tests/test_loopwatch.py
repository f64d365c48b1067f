"""LoopWatch: a blocked event loop is logged with the request that blocks it."""

import logging
import time

import gevent
import greenlet

from zc_lb.process.loopwatch import LoopWatch


def test_a_stall_names_the_request_and_the_line_that_block(caplog):
    watch = LoopWatch(threshold=0.2, interval=0.02)
    watch.start()
    try:
        assert greenlet.gettrace() is None  # nothing runs on every switch

        def blocking():
            watch.serving("GET /block")
            gevent.sleep(0.05)  # the other request runs meanwhile
            time.sleep(0.5)  # the application blocks the loop
            watch.done()

        def waiting():
            watch.serving("GET /waits")
            gevent.sleep(1.0)
            watch.done()

        with caplog.at_level(logging.INFO, logger="zc_lb.process.loopwatch"):
            gevent.joinall([gevent.spawn(waiting), gevent.spawn(blocking)])
            gevent.sleep(0.1)  # the loop runs again: the watch says so
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and watch.stalls == 1
        assert "by GET /block at test_loopwatch.py:" in errors[0]
        assert "in blocking" in errors[0] and "/waits" not in errors[0]
        assert any("ran again after" in r.getMessage() for r in caplog.records)
    finally:
        watch.stop()


def test_a_stall_outside_any_request_names_none():
    watch = LoopWatch(threshold=0.2, interval=0.02)
    watch._loop_thread = None  # as before start(): no frame to report
    assert watch.running() == "no request (gevent or the app's own greenlet)"


def test_a_late_wake_with_no_cpu_spent_is_the_whole_process_stopped():
    watch = LoopWatch(threshold=1.0)
    assert watch.paused(late=3.0, cpu=0.01)  # SIGSTOP: nothing ran
    assert not watch.paused(late=3.0, cpu=2.9)  # the loop held the GIL, burning CPU
    assert not watch.paused(late=0.5, cpu=0.0)  # late, within the threshold
