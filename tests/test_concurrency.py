"""The thread-mode worker's limit: which threads are blocked, and how
many threads take requests (concurrency.py; threads.py samples)."""

import pytest

from zc_lb.worker import concurrency
from zc_lb.worker.concurrency import (BLOCKED, COMPUTES, COMPUTING, HELD, HELD_AFTER, LOCK_TURNS,
                                PROBE, QUEUED, RUNNING, STALL, Limit, state, syscall, turns)

FUTEX = 202


def test_the_kernels_syscall_line_is_read_as_a_number_or_running():
    assert syscall(b"running\n") == RUNNING
    assert syscall(b"202 0x7f 0x80 0x0 0x0 0x0 0x0 0x7ffd 0x7f\n") == 202
    assert syscall(b"7 0x1 0x2 0x3 0x0 0x0 0x0 0x7ffd 0x7f") == 7
    assert syscall(b"-1 0x7ffd 0x7f\n") == -1  # (blocked in no system call: in the kernel)
    assert syscall(b"") is None
    assert syscall(b"garbage") is None


def test_a_thread_is_blocked_in_io_or_on_a_lock_it_waits_long_for():
    turn = LOCK_TURNS
    assert state(RUNNING, FUTEX, 10.0, turn) == COMPUTES
    assert state(None, FUTEX, 10.0, turn) == COMPUTES  # (the kernel did not say)
    assert state(7, FUTEX, 0.0, turn) == BLOCKED  # poll: a socket, a database
    assert state(230, FUTEX, 0.0, turn) == BLOCKED  # clock_nanosleep
    # A lock wait with CPU time lately is a turn at the interpreter lock...
    assert state(FUTEX, FUTEX, turn / 2, turn) == COMPUTES
    # ...and a longer one the application's lock (queued), or the hub.
    assert state(FUTEX, FUTEX, turn * 2, turn) == QUEUED


def test_a_turn_at_the_interpreter_lock_takes_longer_the_more_threads_want_it():
    assert turns(1, 0.005) == LOCK_TURNS
    assert turns(16, 0.005) == pytest.approx(0.16)  # 16 threads, 5 ms each, twice


def test_the_limit_keeps_two_computing_and_lets_in_two_for_each_blocked():
    limit = Limit(16)
    assert limit.value == 16  # all, until a sample says otherwise
    assert limit.update(0) == COMPUTING == 2
    assert limit.update(5) == 12  # let in at once
    assert limit.update(30) == 16  # never past the pool
    limit = Limit(1)
    assert limit.update(0) == 1  # (a pool of one: that one)


def test_threads_park_as_the_average_blocked_count_falls():
    limit = Limit(16)
    for _ in range(100):  # five blocked, for a second of samples
        limit.update(5)
    assert limit.value == 12
    values = [limit.update(0) for _ in range(60)]
    assert values[0] > 8  # not at once: the next request may block again
    assert values == sorted(values, reverse=True)
    assert values[-1] == COMPUTING
    # Some 0.1 s of samples to halve.
    half = next(i for i, value in enumerate(values) if value <= 2 + 2 * 2.5)
    assert 0.05 <= half * concurrency.SAMPLE <= 0.2


def test_a_steady_share_of_blocked_threads_settles_the_limit_between():
    limit = Limit(16)
    for _ in range(100):  # a third of the threads let in are blocked, each sample
        limit.update(limit.value // 3)
    assert 5 <= limit.value <= 7  # two computing, and twice the two blocked


def test_requests_waiting_behind_a_stall_get_one_more_thread_each_stall():
    limit = Limit(16)
    assert limit.update(0, waiting=True, since_finished=0.1) == 2
    assert limit.update(0, waiting=True, since_finished=0.6, stuck=2) == 3
    assert limit.update(0, waiting=True, since_finished=0.9, stuck=2) == 3  # (one a stall)
    assert limit.update(0, waiting=True, since_finished=1.1, stuck=2) == 4
    # Kept while the calls that made the stall run, though others finish.
    assert limit.update(0, waiting=True, since_finished=0.0, stuck=2) == 4
    assert limit.update(0, waiting=False, stuck=2) == 2  # the queue is empty: back to the rule


def test_a_stall_ends_with_the_calls_that_made_it_though_requests_still_wait():
    # An application behind one lock, under steady load (requests always
    # wait for a thread): one request held the lock for a second.  The
    # threads let in for it only queue on the lock; once it is over they
    # must not stay let in for as long as the load lasts.
    limit = Limit(16)
    assert limit.update(1, waiting=True, queued=3, working=1) == 1
    assert limit.update(1, waiting=True, since_finished=0.6, stuck=1) == 2
    assert limit.update(1, waiting=True, since_finished=1.1, stuck=2) == 3
    assert limit.update(1, waiting=True, since_finished=0.0, stuck=1) == 2  # the first is over
    assert limit.update(1, waiting=True, since_finished=0.0, stuck=0) == 1
    assert limit.stalls == 0


def test_a_hang_lets_in_every_thread_and_counts_no_stall_past_them():
    # Nothing finishes for a minute (a database that does not answer):
    # every thread is let in, and ``stalls`` (the status's) says the
    # threads let in for it, not one a half second for as long as it lasts.
    limit = Limit(4)
    for sample in range(6000):  # (each call let in runs on: ``stuck`` STALL after)
        limit.update(0, waiting=True, since_finished=sample * concurrency.SAMPLE,
                     stuck=min(4, int(sample * concurrency.SAMPLE / STALL)))
    assert limit.value == 4
    assert limit.stalls == 3
    assert limit.update(0, waiting=True, since_finished=0.0, stuck=4) == 4  # while they hang
    assert limit.update(0, waiting=True, since_finished=0.0, stuck=0) == COMPUTING


def test_a_long_lock_wait_is_a_queued_thread_io_is_blocked():
    turn = LOCK_TURNS
    assert state(RUNNING, FUTEX, 10.0, turn) == COMPUTES
    assert state(FUTEX, FUTEX, turn / 2, turn) == COMPUTES  # a turn at the interpreter lock
    assert state(FUTEX, FUTEX, turn * 2, turn) == QUEUED
    assert state(230, FUTEX, 0.0, turn) == BLOCKED  # clock_nanosleep: a database, a sleep
    assert state(None, FUTEX, 10.0, turn) == COMPUTES


def test_threads_queued_behind_the_others_bring_the_ceiling_down_to_those_working():
    # An application behind one lock: one thread holds it and waits on its
    # database, three wait for the lock.  Two for the blocked one would
    # let in four; the ceiling is the one that works.
    limit = Limit(16)
    assert limit.update(1, waiting=True, queued=3, working=1) == 1
    # With it alone inside, nothing is seen queued: the ceiling holds.
    for _ in range(PROBE - 1):
        assert limit.update(1, waiting=True) == 1
    # Requests still wait: after PROBE samples, one more is tried...
    assert limit.update(1, waiting=True) == 2
    # ...and seen queued behind the first: back to one.
    assert limit.update(1, waiting=True, queued=1, working=1) == 1
    # A pool of four database connections: four work, two wait.
    limit = Limit(16)
    assert limit.update(4, waiting=True, queued=2, working=4) == 4


def probed(limit):
    """The ceiling after each of four probes, requests waiting, calm."""
    seen = []
    for _ in range(5 * PROBE):
        limit.update(0, waiting=True)
        seen.append(limit.ceiling)
    return [seen[n * PROBE - 1] for n in range(1, 5)]


def test_after_a_hold_up_the_ceiling_doubles_back_to_where_it_fell_from():
    # A database failover held every thread behind one for a moment: the
    # ceiling fell to one.  Rising one a second, an application that
    # overlaps 16 waits ran below its bound for 15 s after it.
    limit = Limit(16)
    limit.update(0, waiting=True, queued=15, working=1)
    assert limit.ceiling == 1
    assert probed(limit) == [2, 4, 8, 16]
    # Past the ceiling it fell from, one at a time, as an application
    # whose bound is that ceiling is probed at steady state.
    limit = Limit(16)
    limit.update(4, waiting=True, queued=2, working=4)  # (a pool of four)
    limit.update(4, waiting=True, working=4)  # (found: four work, none queued)
    limit.update(0, waiting=True, queued=3, working=1)  # (a reconnect under a lock)
    rises = []
    for _ in range(3 * PROBE):
        limit.update(0, waiting=True)
        rises.append(limit.ceiling)
    assert [rises[n * PROBE - 1] for n in range(1, 4)] == [2, 4, 5]


def test_the_ceiling_rises_only_while_requests_wait_and_stalls_pass_it():
    limit = Limit(16)
    limit.update(1, queued=1, working=1)
    for _ in range(3 * PROBE):
        limit.update(1, waiting=False)
    assert limit.ceiling == 1  # no request waited: nothing to find out
    # A request that holds the only thread for seconds: one more each stall.
    assert limit.update(1, waiting=True, since_finished=0.6, stuck=1) == 2
    assert limit.update(1, waiting=True, since_finished=1.1, stuck=2) == 3


def test_an_application_that_never_queues_its_threads_has_no_ceiling():
    limit = Limit(16)
    for _ in range(3 * PROBE):
        limit.update(5, waiting=True)
    assert limit.ceiling == 16
    assert limit.value == 12


def test_a_hold_up_over_many_samples_is_one_fall():
    # A two-second failover: every thread queued behind one, sample after
    # sample.  The ceiling doubles back to where it was before it, not to
    # where the hold-up's second sample found it (one: one a second, 15 s).
    limit = Limit(16)
    for _ in range(200):
        limit.update(0, waiting=True, queued=15, working=1)
    assert limit.ceiling == 1
    assert probed(limit) == [2, 4, 8, 16]


def test_a_lock_wait_long_past_its_turns_is_a_hung_thread():
    turn = LOCK_TURNS
    assert state(FUTEX, FUTEX, turn + HELD_AFTER / 2, turn) == QUEUED
    assert state(FUTEX, FUTEX, turn + HELD_AFTER * 2, turn) == HELD
    turn = turns(256, 0.005)  # (many threads: a turn longer than HELD_AFTER)
    assert state(FUTEX, FUTEX, turn * 1.1, turn) == QUEUED


def test_hung_threads_are_let_in_on_top_and_bring_no_ceiling_down():
    # Two requests deadlocked beside requests that compute: the two hold
    # their threads, the others are let in as if they were not there.
    limit = Limit(16)
    for _ in range(3 * PROBE):
        value = limit.update(0, waiting=True, working=2, held=2)
    assert limit.ceiling == 16
    assert value == COMPUTING + 2
    assert limit.update(3, waiting=True, working=5, held=2) == COMPUTING + 6 + 2


def test_threads_found_hung_undo_the_fall_they_made_while_they_looked_queued():
    # Before HELD_AFTER they are queued threads, and the ceiling falls to
    # the one working beside them; once held, it went on one request at a
    # time until the probes climbed back (a second each: 0.8 s for 8
    # sleeps of 0.1 s in test_threads, on a loaded machine).
    limit = Limit(16)
    for _ in range(10):
        limit.update(0, waiting=True, queued=2, working=1)
    assert limit.ceiling == 1 and limit.fell_from == 16
    limit.update(0, waiting=True, working=1, held=2)
    assert limit.ceiling == 16
    assert limit.update(4, waiting=True, working=5, held=2) == COMPUTING + 8 + 2


def test_a_held_thread_that_ended_between_two_counts_takes_no_thread_away():
    # threads.py counts the calls running long, less the held ones, apart
    # from the held ones: one that ended between the two made it -1, and
    # one thread fewer was let in, the status saying "stalls": -1.
    limit = Limit(16)
    limit.update(0, waiting=True, stuck=0)
    value = limit.update(0, waiting=True, stuck=-1)
    assert limit.stalls == 0
    assert value == limit.update(0, waiting=True, stuck=0)
