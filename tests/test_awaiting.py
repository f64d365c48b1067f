"""The LB's side of a response under way (lb/awaiting.py, lb/bodies.py):
a worker that falls silent or is lost mid-body, and the watchdog's own
failures.  In process, on the harness of test_hardening.py: a real
Worker, a real LB and its FrontServer on 127.0.0.1."""

import logging

import pytest

pytestmark = pytest.mark.timeout(20)


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
