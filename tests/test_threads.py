"""The worker's thread pool (threads.py): calls in order, results and
errors to their greenlets, and as many threads taking calls as keep two
computing (concurrency.py decides from what the pool samples)."""

import os
import re
import resource
import sys
import threading as real_threading
import time

import gevent
import pytest

from zc_lb.worker.concurrency import COMPUTING
from zc_lb.worker import threads as threads_module
from zc_lb.worker.threads import Threads


def _compute(seconds):
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass
    return real_threading.get_ident()


def _run_all(threads, calls, timeout=10):
    started = time.monotonic()
    greenlets = [gevent.spawn(threads.apply, call) for call in calls]
    gevent.joinall(greenlets, timeout=timeout, raise_error=True)
    assert all(g.ready() for g in greenlets), "calls still waiting: " + _inside(threads)
    return [g.value for g in greenlets], time.monotonic() - started


def _inside(threads):
    """The pool's state, for a test that finds calls unfinished."""
    sampler = threads._sampler
    return ("process threads %d, active %d, in pool %d, queued %d, results %d, sampling %s, "
            "limit %r, threads (busy, files) %r" % (
                len(os.listdir("/proc/self/task")), threads._active, threads._in_pool,
                threads._calls.qsize(), len(threads._results),
                sampler is not None and sampler.active,
                vars(threads.limit) if hasattr(threads.limit, "__dict__") else threads.limit,
                [(t.busy, t.syscall is not None) for t in threads._threads]))


def _settle(pool):
    """Run computing calls until the pool lets in two threads, and the
    others have parked (a thread that waited for a call when the limit
    fell gives back the first it gets, then parks)."""
    for _ in range(50):  # (the hub samples between, as it does between requests)
        _run_all(pool, [lambda: _compute(0.005)] * 4)
        if pool.status()["taking_requests"] == COMPUTING:
            break
    assert pool.status()["taking_requests"] == COMPUTING
    _run_all(pool, [lambda: None] * 2 * pool.size)


@pytest.fixture
def pool():
    threads = Threads(16)
    yield threads
    threads.stop()


def test_threads_run_calls_concurrently_and_hand_back_results_and_exceptions():
    # (Generous timeouts: in a long pytest process, first in its file, this
    # test saw the hub and some new threads stalled for over 10 s by what
    # an earlier file left running, with a fixed pool as with an adaptive
    # one and with no pool sampling: see the note of 27 November.)
    threads = Threads(4)
    try:
        barrier = real_threading.Barrier(4, timeout=60)

        def call(n):
            barrier.wait()  # (four at once, or none)
            return n * n, real_threading.get_ident()

        results = [gevent.spawn(threads.apply, lambda n=n: call(n)) for n in range(4)]
        gevent.joinall(results, timeout=90, raise_error=True)
        assert all(g.ready() for g in results), _inside(threads)
        assert [g.value[0] for g in results] == [0, 1, 4, 9]
        assert len({g.value[1] for g in results}) == 4  # four threads, not the hub's
        assert real_threading.get_ident() not in {g.value[1] for g in results}

        def fail():
            raise KeyError("from the app")

        with pytest.raises(KeyError, match="from the app"):
            threads.apply(fail)
        # More calls than threads wait their turn, each result to its caller.
        many = [gevent.spawn(threads.apply, lambda n=n: (time.sleep(0.001), n)[1])
                for n in range(40)]
        gevent.joinall(many, timeout=10, raise_error=True)
        assert [g.value for g in many] == list(range(40))
    finally:
        threads.stop()


def test_a_call_whose_greenlet_is_killed_does_not_disturb_the_next():
    threads = Threads(1)
    try:
        release = real_threading.Event()
        waiting = gevent.spawn(threads.apply, lambda: release.wait(5) and "late")
        gevent.sleep(0.05)
        waiting.kill()  # (as a cancelled request's greenlet is)
        release.set()
        assert threads.apply(lambda: "next") == "next"
    finally:
        threads.stop()


def test_computing_calls_run_two_at_a_time(pool):
    assert pool.status() == {"size": 16, "taking_requests": 16, "busy": 0, "waiting": 0,
                             "blocked": 0.0,
                             "stalls": 0, "hung": 0, "ceiling": 16, "adapts": True}
    _settle(pool)
    idents, _ = _run_all(pool, [lambda: _compute(0.005)] * 8)
    assert len(set(idents)) <= COMPUTING  # the others are parked


def test_calls_blocked_in_io_let_in_more_threads(pool):
    _settle(pool)
    # Sixteen waits of 0.3 s: two at a time would take 2.4 s.
    _, elapsed = _run_all(pool, [lambda: time.sleep(0.3)] * 16)
    assert elapsed < 1.2
    assert pool.status()["taking_requests"] > COMPUTING


def test_calls_waiting_on_each_other_are_not_held_back(pool):
    """A call that waits on a lock (here an Event) for one still queued
    is blocked, not computing: the one it waits for gets a thread."""
    _settle(pool)
    ready = real_threading.Event()
    waiting = [lambda: ready.wait(5)] * 3  # (more than the two let in)
    results, elapsed = _run_all(pool, waiting + [ready.set])
    assert results == [True, True, True, None]
    assert elapsed < 2


def test_short_calls_are_not_held_behind_long_computing_ones(pool):
    _settle(pool)
    done = []

    def call(name, seconds):
        _compute(seconds)
        done.append(name)

    calls = [lambda: call("long", 1.5)] * 2 + [lambda: call("short", 0.001)] * 5
    _run_all(pool, calls)
    assert done == ["short"] * 5 + ["long"] * 2  # (one more thread a stall, 0.5 s)


def test_threads_that_cannot_read_their_states_all_take_calls(monkeypatch):
    real_open = os.open

    def refuse(path, *args):
        if path.startswith("/proc/thread-self/"):
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, *args)

    monkeypatch.setattr(os, "open", refuse)
    threads = Threads(4)
    try:
        _run_all(threads, [lambda: _compute(0.005)] * 8)
        gevent.sleep(0.05)  # (a sample)
        assert not threads.status()["adapts"]
        for _ in range(3):
            _run_all(threads, [lambda: _compute(0.005)] * 8)
            assert threads.status()["taking_requests"] == 4
    finally:
        threads.stop()


def test_stopped_threads_close_their_proc_files():
    def proc_files():  # (this process's open files of its threads' states)
        names = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                names.add(os.readlink("/proc/self/fd/" + fd))
            except OSError:
                pass  # (the listing's own descriptor)
        return {name for name in names if name.endswith(("/syscall", "/schedstat"))}

    def wait_for(condition):
        deadline = time.monotonic() + 5
        while not condition() and time.monotonic() < deadline:
            gevent.sleep(0.01)
        return condition()

    # Counted by this pool's threads' own files (their paths name each
    # thread), whatever threads earlier tests in this process still run.
    before = proc_files()
    threads = Threads(4)
    _run_all(threads, [lambda: _compute(0.001)] * 8)
    assert wait_for(lambda: len(proc_files() - before) == 8)  # (two a thread, as each starts)
    ours = proc_files() - before
    threads.stop()
    assert wait_for(lambda: not proc_files() & ours)


@pytest.mark.parametrize("why", ["--threads-fixed", "no interpreter lock"])
def test_a_pool_that_does_not_adapt_lets_all_its_threads_take_calls(why, monkeypatch):
    if why == "no interpreter lock":  # (a free-threaded build)
        monkeypatch.setattr(sys, "_is_gil_enabled", lambda: False, raising=False)
    threads = Threads(4, fixed=why == "--threads-fixed")
    try:
        _run_all(threads, [lambda: _compute(0.005)] * 20)
        assert threads.status()["taking_requests"] == 4
        assert not threads.status()["adapts"]
    finally:
        threads.stop()


def test_calls_queued_on_the_apps_lock_are_kept_out_and_their_wait_measured(pool):
    """An application behind one lock (one database connection): the
    threads let in past the one holding it only queue inside the app.
    The pool finds that the app serves one at a time and lets in one; the
    time a call was seen queued is not counted as its own."""
    app_lock = real_threading.Lock()
    queued = []

    def call():
        with app_lock:
            time.sleep(0.02)  # (its database load)
        queued.append(pool.current().queued)

    _run_all(pool, [call] * 16)  # (all sixteen let in, before the first sample)
    assert max(queued) > 0.1  # the last waited behind some 15 x 20 ms
    assert pool.status()["ceiling"] == 1
    del queued[:]
    _, elapsed = _run_all(pool, [call] * 20)
    assert elapsed < 20 * 0.02 * 1.5  # one at a time, as fast as the app goes
    assert pool.status()["ceiling"] <= 2  # (a probe: one more, until seen queued)
    assert sum(queued) < 0.1


class _GateLettingTheThreadRunFirst:
    """A gate whose release lets the thread it wakes run before the hub goes
    on, as when the hub loses the interpreter lock at that moment."""

    def __init__(self, lock):
        self.lock = lock

    def locked(self):
        return self.lock.locked()

    def acquire(self):
        return self.lock.acquire()

    def release(self):
        self.lock.release()
        time.sleep(0.02)  # (drops the interpreter lock: the woken thread runs)


def test_a_thread_let_in_again_takes_calls_whenever_it_wakes():
    pool = Threads(3, fixed=True)  # (no sampler: the limit set by hand)
    try:
        pool._let_in(1)
        _run_all(pool, [lambda: None] * 6)  # (threads 1 and 2 give their call back, park)
        time.sleep(0.1)
        for thread in pool._threads[1:]:
            thread.gate = _GateLettingTheThreadRunFirst(thread.gate)
        pool._let_in(3)
        barrier = real_threading.Barrier(3, timeout=3)
        results, _ = _run_all(pool, [lambda: barrier.wait() >= 0] * 3)
        assert results == [True] * 3  # (three threads took calls at once)
    finally:
        pool.stop()


def test_a_pool_whose_proc_files_would_crowd_out_connections_does_not_adapt(monkeypatch, caplog):
    """Each thread keeps two /proc files open: at ``ulimit -n`` 1,024, 600
    threads took every descriptor and the worker accepted no LB.  A pool
    whose files would take more than half of them lets all its threads
    take calls, opens none, and says why."""
    monkeypatch.setattr(resource, "getrlimit", lambda which: (64, 4096))
    threads = Threads(17)  # (34 files, of 64)
    try:
        _run_all(threads, [lambda: _compute(0.005)] * 20)
        assert not threads.status()["adapts"]
        assert threads.status()["taking_requests"] == 17
        assert all(thread.syscall is None for thread in threads._threads)
        assert "17 threads would keep 34 of the 64 file descriptors" in caplog.text
        assert "raise the limit to 68 or more" in caplog.text
    finally:
        threads.stop()
    fits = Threads(16)  # (32 of 64: half)
    try:
        assert fits.status()["adapts"]
    finally:
        fits.stop()


@pytest.mark.parametrize("fixed", [False, True])
def test_a_pool_whose_every_thread_hangs_says_so_with_what_they_run(fixed, monkeypatch, caplog):
    """An application deadlocked, or waiting on what never answers: the
    calls wait, and the log and status say why (once), with the requests
    the threads run; and again when calls finish."""
    monkeypatch.setattr(threads_module, "HUNG", 0.3)
    monkeypatch.setattr(threads_module, "WATCH", 0.05)
    threads = Threads(2, fixed=fixed)
    release = real_threading.Event()
    try:
        calls = [gevent.spawn(threads.apply, lambda: release.wait(10),
                              {"REQUEST_METHOD": "GET", "PATH_INFO": "/hang/%d" % n})
                 for n in range(3)]
        deadline = time.monotonic() + 5
        while "is the application stuck?" not in caplog.text and time.monotonic() < deadline:
            gevent.sleep(0.05)
        assert re.search(r"no request has finished for \d+ s and 1 wait for a thread; 2 "
                         r"threads run one \(GET /hang/0 for \d+ s, GET /hang/1 for \d+ s\)",
                         caplog.text)
        assert threads.status()["busy"] == 2 and threads.status()["waiting"] == 1
        gevent.sleep(0.3)
        assert caplog.text.count("is the application stuck?") == 1  # (once)
        release.set()
        gevent.joinall(calls, timeout=5, raise_error=True)
        assert [call.value for call in calls] == [True] * 3
        assert re.search(r"the application's threads finish requests again, after \d+ s",
                         caplog.text)
        assert threads.status()["busy"] == threads.status()["waiting"] == 0
    finally:
        release.set()
        threads.stop()


def test_after_a_slow_call_under_steady_load_the_pool_goes_back_to_its_ceiling(pool):
    # An application behind one lock, requests always waiting for a thread:
    # one holds the lock for 0.8 s, and the threads let in for that stall
    # only queue on the lock.  Once it is over, the pool takes calls at
    # the application's ceiling again, though the queue is never empty.
    lock = real_threading.Lock()

    def locked(seconds):
        with lock:
            time.sleep(seconds)

    for _ in range(10):  # (until seen queued: the ceiling is found)
        _run_all(pool, [lambda: locked(0.04)] * 6)
        if pool.status()["ceiling"] == 1:
            break
    assert pool.status()["ceiling"] == 1
    long_done = []
    seen = []

    def watch():
        while not long_done:
            gevent.sleep(0.01)
        gevent.sleep(0.1)
        while pool.status()["waiting"] > 5:
            seen.append(pool.status()["taking_requests"])
            gevent.sleep(0.01)

    watcher = gevent.spawn(watch)
    running = real_threading.Event()
    slow = gevent.spawn(pool.apply, lambda: (running.set(), locked(0.8), long_done.append(1)))
    while not running.is_set():
        gevent.sleep(0.005)
    _run_all(pool, [lambda: locked(0.04)] * 20)
    slow.join(5)
    watcher.join(5)
    # (Now and then one more is let in, as the ceiling is probed: seen
    # queued, it goes at once.  Kept, the stall's would be every sample.)
    assert len(seen) > 15 and seen.count(1) > 0.7 * len(seen), seen


def test_calls_hung_on_a_lock_hold_their_threads_and_no_more(pool):
    """Two requests deadlocked (a lock nobody releases) beside others
    that work: they are no queue behind those, and the pool keeps
    letting in threads for the rest.  (The ceiling fell to the one
    working beside them and stayed there: the worker served one request
    at a time for as long as they hung.)"""
    deadlock = real_threading.Lock()
    deadlock.acquire()
    hung = [gevent.spawn(pool.apply, lambda: (deadlock.acquire(), deadlock.release()))
            for _ in range(2)]
    try:
        deadline = time.monotonic() + 1.5  # (past HELD_AFTER: seen hung)
        while time.monotonic() < deadline:
            _run_all(pool, [lambda: _compute(0.002)] * 4)
        assert pool.status()["hung"] == 2
        _, elapsed = _run_all(pool, [lambda: time.sleep(0.1)] * 8)
        # (one at a time, or one more each stall: 0.8 s and more)
        assert elapsed < 0.5, _inside(pool)
    finally:
        deadlock.release()
        gevent.joinall(hung, timeout=5)
