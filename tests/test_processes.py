"""``zc-lb lb --processes N``: real LB processes on one address, summed
status, a child restarted, SIGTERM draining every one."""

import concurrent.futures
import contextlib
import http.client
import json
import os
import signal
import urllib.request

import pytest

from zc_lb.process.processes import child_argv, lb_argv
from zc_lb.status.document import merge_status
from zc_lb.testing import LBProcess, WorkerProcess, start_all, wait_for

TESTS = os.path.dirname(os.path.abspath(__file__))
ENV = {"PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")}

pytestmark = pytest.mark.timeout(60)


def test_child_argv_leaves_out_what_the_supervisor_holds():
    argv = lb_argv(["--log-level", "DEBUG", "lb", "--listen", "h:1", "--processes=2",
                    "--status", "h:2", "--worker", "h:3", "--variance", "2"])
    assert child_argv(argv) == ["--worker", "h:3", "--variance", "2"]


def test_merge_status_sums_counters_and_backlogs():
    one = {"requests": 3, "in_flight": 1, "errors": {"502": 1}, "pool": {"variance": 1.0},
           "workers": {"w": {"backlog": 1, "connected": True, "in_pool": True}}, "uptime": 9}
    two = {"requests": 4, "in_flight": 0, "errors": {"502": 2, "503": 1}, "pool": {},
           "workers": {"w": {"backlog": 2, "connected": True, "in_pool": False}}, "uptime": 5}
    merged = merge_status([one, two, {"error": "down"}])
    assert (merged["requests"], merged["in_flight"], merged["uptime"]) == (7, 1, 5)
    assert merged["errors"] == {"502": 3, "503": 1}
    assert merged["pool"] == {"variance": 1.0}
    assert merged["workers"]["w"] == {"backlog": 3, "connected": True, "in_pool": False}
    # (the buffers were the first process's alone; the pids were added up)
    one.update(pid=1000, buffers={"memory": 100, "disk": 0, "spilled": 3, "stalled": 1})
    two.update(pid=2000, buffers={"memory": 50, "disk": 8, "spilled": 4, "stalled": 1})
    merged = merge_status([one, two])
    assert merged["buffers"] == {"memory": 150, "disk": 8, "spilled": 7, "stalled": 2}
    assert merged["pid"] == 1000


def test_merge_status_gives_a_workers_mean_backlog_as_the_childrens_mean():
    # Each child's mean backlog of a worker counts its siblings' requests
    # (routing/siblings.py): summed, two children at a steady 3 each said 6.
    one = {"workers": {"w": {"backlog": 1, "mean_backlog": 3.0},
                       "v": {"backlog": 0, "mean_backlog": 0.5}}}
    two = {"workers": {"w": {"backlog": 2, "mean_backlog": 3.5}}}
    workers = merge_status([one, two])["workers"]
    assert workers["w"] == {"backlog": 3, "mean_backlog": 3.25}
    assert workers["v"] == {"backlog": 0, "mean_backlog": 0.5}


def test_merge_status_leaves_out_the_childrens_view_of_their_siblings_backlog():
    # Each child's siblings_backlog is the others' share of the summed
    # backlog: the first child's beside the sum read as counted twice.
    one = {"workers": {"w": {"backlog": 1, "siblings_backlog": 2}}}
    two = {"workers": {"w": {"backlog": 2, "siblings_backlog": 1}}}
    assert merge_status([one, two])["workers"]["w"] == {"backlog": 3}


def test_merge_status_says_a_worker_pooled_by_another_address_in_some_child_is_so():
    # Each child pools a worker reached by two addresses once, by the
    # address it reached first (lb/fleet.py): after a worker's restart the
    # children's links come back in any order, and may pool it by
    # different ones.  The first child's "twin_of": null beside in_pool
    # false (the other child's) read as "draining".
    from zc_lb.status.document import worker_state

    up = {"connected": True, "drained": False, "standby": False, "ejected": False}
    one = {"workers": {"a": dict(up, in_pool=True, twin_of=None),
                       "b": dict(up, in_pool=False, twin_of="a")}}
    two = {"workers": {"a": dict(up, in_pool=False, twin_of="b"),
                       "b": dict(up, in_pool=True, twin_of=None)}}
    workers = merge_status([one, two])["workers"]
    assert not workers["a"]["in_pool"] and not workers["b"]["in_pool"]
    assert worker_state(workers["a"]) == "pooled as b"
    assert worker_state(workers["b"]) == "pooled as a"
    # Alike in every child: as each says.
    workers = merge_status([one, one])["workers"]
    assert worker_state(workers["a"]) == "in pool" and workers["a"]["twin_of"] is None
    assert worker_state(workers["b"]) == "pooled as a"


def test_merge_status_adds_up_the_pools_counters():
    # The pool was the first process's: zc_lb_pool_spills_total and
    # zc_lb_pool_bounded_total showed a single process's.
    one = {"workers": {}, "pool": {"policy": "AffinityPool", "variance": 1.0,
                                   "spills": 5, "bounded": 7}}
    two = {"workers": {}, "pool": {"policy": "AffinityPool", "variance": 1.0,
                                   "spills": 50, "bounded": 70}}
    merged = merge_status([one, two])
    assert merged["pool"] == {"policy": "AffinityPool", "variance": 1.0,
                              "spills": 55, "bounded": 77}
    assert one["pool"]["spills"] == 5  # (the children's documents as they were)
    assert merge_status([{"workers": {}, "pool": {"policy": "Pool"}}])["pool"] == {
        "policy": "Pool"}


def test_merge_status_sums_the_pools_backlog_and_merges_its_other_gauges_by_their_meaning():
    # The pool's gauges were the first process's: its backlog one child's
    # requests in flight, not the LB's.
    one = {"workers": {}, "pool": {
        "policy": "AffinityPool", "lbs": 1, "locality_gain": 2.5, "keys_relayed": False,
        "backlog": 3, "mean_backlog": 4.0, "starting": 1, "widened": 2,
        "explored": 7, "widenings": 5, "narrowings": 1, "skill_resets": 1}}
    two = {"workers": {}, "pool": {
        "policy": "AffinityPool", "lbs": 1, "locality_gain": 3.0, "keys_relayed": True,
        "backlog": 5, "mean_backlog": 5.0, "starting": 2, "widened": 1,
        "explored": 3, "widenings": 6, "narrowings": 0, "skill_resets": 1}}
    assert merge_status([one, two])["pool"] == {
        "policy": "AffinityPool", "lbs": 1, "locality_gain": 2.5, "keys_relayed": False,
        "backlog": 8,  # (each child's own requests in flight)
        "mean_backlog": 4.5,  # (each child's counts its siblings' requests already)
        "starting": 2, "widened": 2,  # (one worker, one class, counted once)
        "explored": 10, "widenings": 11, "narrowings": 1, "skill_resets": 2}


def test_merge_status_keeps_the_busiest_classes_as_an_lb_counts_them(monkeypatch):
    from zc_lb.status import document

    monkeypatch.setattr(document, "MAX_COUNTED_CLASSES", 2)

    def histogram(n):
        return {"buckets": [1.0], "counts": [n, 0], "sum": 0.0}

    one = {"workers": {}, "classes": {"a": 5, "b": 1},
           "class_latency": {"a": histogram(5), "b": histogram(1)}}
    two = {"workers": {}, "classes": {"c": 4, "d": 2, "other": 1},
           "class_latency": {"c": histogram(4), "d": histogram(2)}}
    merged = merge_status([one, two])
    assert merged["classes"] == {"a": 5, "c": 4, "other": 4}
    assert merged["class_latency"] == {"a": histogram(5), "c": histogram(4),
                                       "other": histogram(3)}


def test_the_supervisor_sums_a_silent_child_as_it_last_was_and_acts_on_every_child(
        monkeypatch):
    # A child that missed one scrape was left out of the sum: the summed
    # counters went back (Prometheus reads a reset).  An action stopped at
    # the first child that failed, and the rest never got it.
    from zc_lb.errors import ConfigurationError
    from zc_lb.process import processes
    from zc_lb.process.processes import Supervisor

    answers = {"c0": [{"requests": 5, "workers": {}}, {"requests": 6, "workers": {}}],
               "c1": [{"requests": 7, "workers": {}}, ConfigurationError("timed out")]}
    done = []

    def fetch(address, timeout=5.0, action=None, params=None, token=None):
        if action is not None:
            if address == "c0":
                raise ConfigurationError("timed out")
            done.append(address)
            return {"done": action}
        answer = answers[address].pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(processes, "ask", fetch)
    supervisor = Supervisor(2, ["lb"], ("127.0.0.1", 0))
    supervisor.children = [processes.Child(i, [], -1, "INFO", None, None) for i in range(2)]
    for i, child in enumerate(supervisor.children):
        serving(child, "c%d" % i)
    assert supervisor.status()["requests"] == 12
    summed = supervisor.status()
    assert summed["requests"] == 13 and summed["pid"] == os.getpid()
    assert [p["stale"] for p in summed["processes"]] == [False, True]
    with pytest.raises(ConfigurationError, match="enable failed in process 0: timed out"):
        supervisor.action("enable")(worker="w")
    assert done == ["c1"]


def test_the_classes_of_children_that_ended_stay_as_many_as_one_document_holds():
    # Each ended child's classes were kept, every one: children that end
    # again and again, each with its own busiest classes (a classifier by
    # path), grew the supervisor's memory without bound.
    from zc_lb.lb.stats import MAX_COUNTED_CLASSES, OTHER_CLASS
    from zc_lb.process.retired import Retired

    retired = Retired()
    histogram = {"buckets": [0.1], "counts": [1, 0], "sum": 0.01}
    for child in range(5):
        names = ["c%d-%d" % (child, i) for i in range(MAX_COUNTED_CLASSES)]
        retired.add({"workers": {}, "classes": {name: 1 for name in names},
                     "class_latency": {name: dict(histogram) for name in names}})
    assert len(retired.counts["classes"]) <= MAX_COUNTED_CLASSES + 1
    assert sum(retired.counts["classes"].values()) == 5 * MAX_COUNTED_CLASSES
    assert set(retired.class_latency) == set(retired.counts["classes"])
    assert sum(h["counts"][0] for h in retired.class_latency.values()) == 5 * MAX_COUNTED_CLASSES
    assert retired.counts["classes"][OTHER_CLASS] > 3 * MAX_COUNTED_CLASSES


def test_a_child_started_again_leaves_its_counters_in_the_sum_not_its_gauges(monkeypatch):
    # A child started again counts from nothing under a new status address,
    # and the supervisor dropped the last document of the one that died:
    # the summed counters went back by all it had counted (Prometheus read
    # a reset of the sum, and its rate counted the other children's totals
    # again), or on to its pid again if the new one got its port.
    from zc_lb.process import processes
    from zc_lb.process.processes import Supervisor

    def doc(pid, requests, in_flight, worker="w1", latency=1):
        return {"pid": pid, "requests": requests, "in_flight": in_flight, "clients": in_flight,
                "errors": {"502": 1}, "classes": {"a": requests},
                "latency": {"buckets": [0.1, 1.0], "counts": [latency, 0, 0], "sum": 0.01},
                "buffers": {"memory": 100, "disk": 0, "spilled": 1, "stalled": 0},
                "pool": {"policy": "AffinityPool", "backlog": in_flight, "spills": 2,
                         "widenings": requests},
                "workers": {worker: {"backlog": in_flight, "streams": in_flight,
                                     "connected": True, "in_pool": True,
                                     "counts": {"requests": requests, "2xx": requests}}}}

    answers = {"c0": doc(10, 5, 2, "w0", 5), "c1": doc(11, 7, 1), "c2": doc(12, 1, 0)}
    monkeypatch.setattr(processes, "ask", lambda address, **_: answers[address])
    supervisor = Supervisor(2, ["lb"], ("127.0.0.1", 0))
    supervisor.children = [processes.Child(i, [], -1, "INFO", None, None) for i in range(2)]
    for i, child in enumerate(supervisor.children):
        serving(child, "c%d" % i)
    assert supervisor.status()["requests"] == 12
    supervisor.children[0].status = None  # (died; started again, not serving yet)
    assert supervisor.status(full=False)["requests"] == 12
    serving(supervisor.children[0], "c2")
    for full in (True, False, True):
        summed = supervisor.status(full=full)
        assert summed["requests"] == 13, full
        assert (summed["in_flight"], summed["clients"]) == (1, 1)
        assert summed["errors"] == {"502": 3} and summed["classes"] == {"a": 13}
        assert summed["latency"]["counts"] == [7, 0, 0]
        assert summed["buffers"] == {"memory": 200, "disk": 0, "spilled": 3, "stalled": 0}
        assert summed["pool"]["spills"] == 6 and summed["pool"]["widenings"] == 13
        assert summed["pool"]["backlog"] == 1  # (the ended child's in flight ended with it)
        assert summed["workers"]["w1"]["counts"] == {"requests": 8, "2xx": 8}
        assert summed["workers"]["w1"]["backlog"] == 1
        assert "w0" not in summed["workers"]  # (no child knows it now)
        assert summed["retired_workers"] == {"requests": 5, "2xx": 5}
    answers["c2"] = doc(13, 2, 0)  # (c2 died too, and the new one got its port)
    assert supervisor.status()["requests"] == 5 + 7 + 1 + 2


def test_a_supervisors_retried_enable_succeeds_and_says_whether_it_changed_anything(
        monkeypatch):
    # A retry after one child had failed asked the children that had taken
    # it again, and each refused ("neither drained nor ejected"): enable is
    # idempotent now, and the answer says whether any child had something
    # to undo.
    from zc_lb.process import processes
    from zc_lb.process.processes import Supervisor

    drained = {"c0": True, "c1": False}

    def fetch(address, timeout=5.0, action=None, params=None, token=None):
        changed, drained[address] = drained[address], False
        return {"worker": params["worker"], "changed": changed, "done": action}

    monkeypatch.setattr(processes, "ask", fetch)
    supervisor = Supervisor(2, ["lb"], ("127.0.0.1", 0))
    supervisor.children = [processes.Child(i, [], -1, "INFO", None, None) for i in range(2)]
    for i, child in enumerate(supervisor.children):
        serving(child, "c%d" % i)
    assert supervisor.action("enable")(worker="w") == {"worker": "w", "changed": True}
    assert supervisor.action("enable")(worker="w") == {"worker": "w", "changed": False}


def supervisor_of(monkeypatch, documents):
    """A Supervisor of children whose status addresses (the keys of
    ``documents``) answer as an LB's status address serving each
    document (a function giving it) does, to the query the supervisor asks."""
    import urllib.parse

    from zc_lb.process import processes
    from zc_lb.process.processes import Supervisor
    from zc_lb.status.document import status_app

    def fetch(address, timeout=5.0, action=None, params=None, token=None):
        environ = {"REQUEST_METHOD": "GET", "PATH_INFO": "/", "SERVER_NAME": "x",
                   "SERVER_PORT": "80", "wsgi.url_scheme": "http",
                   "QUERY_STRING": urllib.parse.urlencode(params or {})}
        app = status_app(documents[address])
        return json.loads(b"".join(app(environ, lambda status, headers: None)))

    monkeypatch.setattr(processes, "ask", fetch)
    supervisor = Supervisor(len(documents), ["lb"], ("127.0.0.1", 0))
    supervisor.children = [processes.Child(i, [], -1, "INFO", None, None)
                           for i in range(len(documents))]
    for child, address in zip(supervisor.children, documents):
        serving(child, address)
    return supervisor


class Running:
    """A stand-in for a child's process that runs."""

    pid = 0

    def poll(self):
        return None


def serving(child, status):
    """``child`` as it is once started: running, its status address said."""
    child.process, child.status, child.ready = Running(), status, True


STARTING_CHILD = """
import signal, sys, time
time.sleep(0.3)  # (importing: SIGHUP's default action kills it)
signal.signal(signal.SIGHUP, lambda *_: print("SIGHUP", file=open(sys.argv[1], "a")))
print("zc-lb status on 127.0.0.1:1", flush=True)
time.sleep(30)
"""


def test_a_child_started_again_gets_the_signals_and_drains_that_came_meanwhile(
        monkeypatch, tmp_path):
    # A SIGHUP passed on while a child started again (after a crash) killed
    # it, or was ignored by it, which read the file before the change; a
    # drain left it out (and one before its crash was forgotten): the
    # worker drained had new requests from it.
    import sys

    import gevent

    from zc_lb.process import processes

    asked = []
    monkeypatch.setattr(processes, "ask", lambda address, action=None, params=None,
                        token=None, **_: asked.append((action, params["worker"])) or {
                            "done": action})
    monkeypatch.setattr(processes, "RESTART_MIN", 0.0)
    supervisor = processes.Supervisor(1, ["lb"], ("127.0.0.1", 0))
    child = processes.Child(0, [], -1, "INFO")
    child.argv, child.fds = [sys.executable, "-c", STARTING_CHILD, str(tmp_path / "got")], ()
    supervisor.children = [child]
    child.start()
    first = child.process
    watcher = gevent.spawn(supervisor._watch, child)
    try:
        supervisor.action("drain")(worker="10.0.0.1:9001")
        first.kill()
        for _ in range(500):
            if child.process is not first:
                break
            gevent.sleep(0.01)
        supervisor.send_signal(signal.SIGHUP)  # (it is starting)
        supervisor.action("drain")(worker="10.0.0.2:9001")  # (not asked: no error)
        supervisor.action("drain")(worker="10.0.0.3:9001")
        supervisor.action("enable")(worker="10.0.0.3:9001")
        for _ in range(500):  # (open() makes the file before print writes the line)
            if (tmp_path / "got").exists() and (tmp_path / "got").read_text():
                break
            gevent.sleep(0.01)
        assert (tmp_path / "got").read_text() == "SIGHUP\n"
        assert child.process.poll() is None and child.process is not first
        assert asked == [("drain", "10.0.0.1:9001"),  # then, started again:
                         ("drain", "10.0.0.1:9001"), ("drain", "10.0.0.2:9001")]
    finally:
        supervisor.stopping = True
        watcher.kill()
        for process in (first, child.process):
            process.kill()
            process.wait()


def one_child(script, *args):
    """A Supervisor of one child running ``script`` (Python) with ``args``,
    started (not watched yet)."""
    import sys

    from zc_lb.process import processes

    supervisor = processes.Supervisor(1, ["lb"], ("127.0.0.1", 0))
    child = processes.Child(0, [], -1, "INFO")
    child.argv, child.fds = [sys.executable, "-c", script, *map(str, args)], ()
    supervisor.children = [child]
    child.start()
    return supervisor, child


def wait_until(condition, timeout=10.0):
    import gevent

    for _ in range(int(timeout / 0.01)):
        if condition():
            return
        gevent.sleep(0.01)
    raise AssertionError("timed out")


def test_a_child_is_started_again_at_once_after_a_good_run_else_after_a_growing_pause():
    from zc_lb.process.processes import HEALTHY_RUN, RESTART_MAX, RESTART_MIN, Backoff

    backoff = Backoff()
    pauses = [backoff.after_exit(0.5, 2) for _ in range(12)]
    assert pauses[:3] == [RESTART_MIN, RESTART_MIN * 2, RESTART_MIN * 4]
    assert pauses[-1] == RESTART_MAX and pauses == sorted(pauses)
    assert backoff.after_exit(HEALTHY_RUN, 1) == 0.0  # (it served for a while)
    assert backoff.after_exit(0.5, 2) == RESTART_MIN
    assert backoff.after_exit(0.5, 0) == 0.0  # (it ended well: --max-requests)
    assert backoff.failed() == RESTART_MIN and backoff.failed() == RESTART_MIN * 2


FAILING_CHILD = "import sys; sys.exit(2)"


def test_a_child_failing_at_start_is_tried_again_less_and_less_often(monkeypatch, caplog):
    # It was started again once a second for ever, two lines logged each
    # time (its exit, and that it "did not start").
    from zc_lb.process import processes

    monkeypatch.setattr(processes, "RESTART_MIN", 0.01, raising=False)
    caplog.set_level("INFO", logger=processes.__name__)
    supervisor, child = one_child(STARTING_CHILD, "/dev/null")
    child.argv[2] = FAILING_CHILD
    child.process.kill()
    lines = watch_until_said(supervisor, child, caplog, 4)
    assert all(" exited with status " in line for line in lines), lines  # (one line a time)
    assert [line.rsplit(" ", 1)[1] for line in lines[:4]] == [
        "0.01s", "0.02s", "0.04s", "0.08s"], lines
    assert all("before it served" in line for line in lines[1:]), lines


def said(caplog):
    """What the supervisor logged."""
    return [record.getMessage() for record in caplog.records
            if record.name == "zc_lb.process.processes"]


def test_a_child_that_hangs_at_start_is_killed_in_time(monkeypatch):
    # START_TIMEOUT was never used: the supervisor waited for ever (at its
    # start, or the child, started again, was "starting" for good).
    import sys

    from zc_lb.errors import ConfigurationError
    from zc_lb.process import processes

    monkeypatch.setattr(processes, "START_TIMEOUT", 0.3)
    child = processes.Child(0, [], -1, "INFO")
    child.argv, child.fds = [sys.executable, "-c", "import time; time.sleep(5)"], ()
    try:
        with pytest.raises(ConfigurationError, match="did not start within 0.3s: killed"):
            child.start()
        assert child.process.returncode == -signal.SIGKILL and not child.ready
    finally:
        child.process.kill()
        child.process.wait()


def test_a_child_killed_for_hanging_at_start_is_tried_again_less_and_less_often(
        monkeypatch, caplog):
    # However long it took, a start that never served is a failed start.
    import gevent

    from zc_lb.process import processes

    caplog.set_level("INFO", logger=processes.__name__)
    supervisor, child = one_child(STARTING_CHILD, "/dev/null")
    for name, value in (("START_TIMEOUT", 0.3), ("HEALTHY_RUN", 0.1), ("RESTART_MIN", 0.01)):
        monkeypatch.setattr(processes, name, value)
    child.argv[2] = "import time; time.sleep(5)"
    gevent.sleep(0.2)  # (it served for a while)
    child.process.kill()
    try:
        lines = watch_until_said(supervisor, child, caplog, 3)
    finally:
        kill_left(child.process)
    assert lines[0].endswith("; starting it again"), lines  # (at once)
    assert [line.rsplit(" ", 1)[1] for line in lines[1:3]] == ["0.01s", "0.02s"], lines


def test_a_stop_while_a_child_starts_again_is_no_error(caplog):
    # The child, ended by the stop, was logged "did not start".
    import gevent

    supervisor, child = one_child(STARTING_CHILD, "/dev/null")
    first = child.process
    watcher = gevent.spawn(supervisor._watch, child)
    try:
        first.kill()
        wait_until(lambda: child.process is not first)  # (it is starting)
        supervisor.stop(timeout=5)
        watcher.join(5)
        assert watcher.dead and child.process.poll() is not None
        assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
    finally:
        watcher.kill()
        kill_left(first, child.process)


def test_a_stop_while_a_child_is_launched_again_stops_it_too(monkeypatch):
    # Popen yields (gevent's waits for the exec): a stop that came then sent
    # the new process no SIGTERM, and did not wait for it; it ran on until
    # the supervisor had exited (PDEATHSIG).
    import gevent
    import gevent.event
    import gevent.subprocess

    supervisor, child = one_child(STARTING_CHILD, "/dev/null")
    first = child.process
    launching = slow_launches(monkeypatch, gevent.subprocess, gevent.event.Event(), gevent.sleep)
    watcher = gevent.spawn(supervisor._watch, child)
    try:
        first.kill()
        assert launching.wait(10)
        supervisor.stop(timeout=5)
        assert child.process is not first
        assert child.process.poll() == -signal.SIGTERM  # (stopped, and reaped)
    finally:
        supervisor.stopping = True
        watcher.join(5)
        watcher.kill()
        kill_left(first, child.process)


@contextlib.contextmanager
def watched_child(monkeypatch, fetch):
    """A supervisor of one child (``STARTING_CHILD``), watched (started
    again at once when it ends, drains asked again every 10 ms), whose
    status actions go to ``fetch``; stopped after."""
    import gevent

    from zc_lb.process import drains, processes

    monkeypatch.setattr(processes, "ask", fetch)
    monkeypatch.setattr(processes, "RESTART_MIN", 0.0, raising=False)
    monkeypatch.setattr(drains, "DRAIN_RETRY", 0.01)
    supervisor, child = one_child(STARTING_CHILD, "/dev/null")
    first = child.process
    watcher = gevent.spawn(supervisor._watch, child)
    try:
        yield supervisor, child
    finally:
        supervisor.stopping = True
        watcher.kill()
        kill_left(first, child.process)


def test_a_drain_a_child_started_again_refuses_is_asked_again_until_it_takes_it(
        monkeypatch, caplog):
    # In ZooKeeper mode a child started again knows no worker that was not
    # registered then (away for maintenance, or named to it late): the drain
    # was logged as an error, never asked again, and once the worker came
    # that child alone sent it requests.
    import gevent

    from zc_lb.errors import ConfigurationError

    known = {"10.0.0.1:9001", "10.0.0.2:9001"}
    asked = []

    def fetch(address, action=None, params=None, token=None, **_):
        worker = params["worker"]
        asked.append((worker, worker in known))
        if worker not in known:
            raise ConfigurationError("answered 400: drain: no worker %s" % worker)
        return {"done": action}

    with watched_child(monkeypatch, fetch) as (supervisor, child):
        first = child.process
        for worker in sorted(known):
            supervisor.action("drain")(worker=worker)
        known.discard("10.0.0.1:9001")  # (the child started again does not know it)
        first.kill()
        wait_until(lambda: ("10.0.0.1:9001", False) in asked)
        wait_until(lambda: asked.count(("10.0.0.1:9001", False)) >= 3)  # (asked again)
        known.add("10.0.0.1:9001")  # (ZooKeeper names it)
        wait_until(lambda: asked[-1] == ("10.0.0.1:9001", True))
        gevent.sleep(0.1)
        assert asked[-1] == ("10.0.0.1:9001", True)  # (then no more)
        assert asked.count(("10.0.0.2:9001", True)) == 2
        assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text


def test_an_enable_is_taken_though_a_child_started_again_never_took_the_drain(
        monkeypatch):
    # The child started again did not know the worker, so never took its
    # drain (asked again every DRAIN_RETRY): an enable then failed there
    # ("no worker"), told as a failure though nothing was left drained.
    import gevent

    from zc_lb.errors import ConfigurationError
    from zc_lb.process import drains

    worker, known, asked = "10.0.0.1:9001", {True}, []

    def fetch(address, action=None, params=None, token=None, **_):
        asked.append(action)
        if not known:
            raise ConfigurationError("answered 400: %s: no worker %s" % (action, worker))
        return {"worker": worker, "changed": action == "enable", "done": action}

    with watched_child(monkeypatch, fetch) as (supervisor, child):
        first = child.process
        supervisor.action("drain")(worker=worker)
        known.clear()  # (the child started again does not know it)
        first.kill()
        wait_until(lambda: asked.count("drain") >= 3)  # (asked again)
        # (the children are asked at once, which yields: a retry that ran
        # before the child was asked had forgotten the worker there, and
        # the enable asked it, and failed)
        each = drains.each
        monkeypatch.setattr(drains, "each", lambda *args: (gevent.sleep(0.05), each(*args))[1])
        assert supervisor.action("enable")(worker=worker) == {"worker": worker,
                                                              "changed": False}
        gevent.sleep(0.1)
        assert worker not in supervisor.drains.drained and asked[-1] == "drain"  # (no more asks)


def test_a_worker_enabled_while_its_drain_went_to_a_child_ends_enabled_there(monkeypatch):
    # A drain given to a child started again could reach it after the
    # operator's enable, which that child had taken first: it stayed
    # drained there alone.
    from zc_lb.process import processes
    from zc_lb.process.processes import Supervisor

    worker, drained_there = "10.0.0.1:9001", set()
    supervisor = Supervisor(1, ["lb"], ("127.0.0.1", 0))

    def fetch(address, action=None, params=None, token=None, **_):
        if action == "drain" and not fetch.enabled:  # the enable overtakes it
            fetch.enabled = True
            supervisor.action("enable")(worker=worker)
        (drained_there.add if action == "drain" else drained_there.discard)(worker)
        return {"worker": worker, "changed": True, "done": action}

    fetch.enabled = False
    monkeypatch.setattr(processes, "ask", fetch)
    supervisor.children = [processes.Child(0, [], -1, "INFO", None, None)]
    serving(supervisor.children[0], "c0")
    supervisor.drains.drained.add(worker)
    assert supervisor.drains.drain_in(supervisor.children[0], [worker]) == {}
    assert fetch.enabled and drained_there == set() and supervisor.drains.drained == set()


def test_a_drain_some_children_took_is_held_for_the_others_until_they_know_the_worker(
        monkeypatch):
    # In ZooKeeper mode each child learns a worker on its own: a drain of
    # one just registered failed (400) where one child did not know it
    # yet, while the others took it, and the supervisor forgot it: that
    # child alone sent the worker requests once it knew it.
    import gevent

    from zc_lb.errors import ConfigurationError
    from zc_lb.process import drains, processes

    worker = "10.0.0.1:9001"
    knows = {"c0": True, "c1": False}
    drained_in, asked = set(), []

    def fetch(address, action=None, params=None, token=None, **_):
        asked.append((address, action))
        if not knows[address]:
            raise ConfigurationError("answered 400: %s: no worker %s" % (action, worker))
        (drained_in.add if action == "drain" else drained_in.discard)(address)
        return {"worker": worker, "changed": True, "done": action}

    monkeypatch.setattr(processes, "ask", fetch)
    monkeypatch.setattr(drains, "DRAIN_RETRY", 0.01)
    supervisor = processes.Supervisor(2, ["lb"], ("127.0.0.1", 0))
    supervisor.children = [processes.Child(i, [], -1, "INFO") for i in (0, 1)]
    for child, status in zip(supervisor.children, ("c0", "c1")):
        serving(child, status)
    supervisor.action("drain")(worker=worker)  # (no failure raised)
    assert worker in supervisor.drains.drained and drained_in == {"c0"}
    wait_until(lambda: asked.count(("c1", "drain")) >= 3)  # (asked again)
    knows["c1"] = True  # (ZooKeeper names it to that child too)
    wait_until(lambda: drained_in == {"c0", "c1"})
    gevent.sleep(0.05)
    assert asked[-1] == ("c1", "drain") and supervisor.children[1].refused == set()
    # nobody knows it: the drain fails, and nothing is held
    knows.update(c0=False, c1=False)
    with pytest.raises(ConfigurationError, match="process 0: .*process 1: "):
        supervisor.action("drain")(worker="10.0.0.9:9001")
    assert "10.0.0.9:9001" not in supervisor.drains.drained


@pytest.mark.parametrize("when", ["after", "during"])
def test_a_child_started_again_while_its_drain_was_asked_again_is_not_left_refusing(
        monkeypatch, when):
    # The greenlet asking a child again for a drain it refused went on
    # writing the old process's refusals after the child was started again
    # (its launch had cleared them, ``when`` its Popen was done or still
    # under way), and then left: no one asked the new process again, and
    # an enable skipped it as one that never took the drain, though it had
    # taken it once it served: the worker stayed drained there alone.
    import gevent
    import gevent.event
    import gevent.subprocess

    from zc_lb.errors import ConfigurationError
    from zc_lb.process import drains, processes

    worker, asked = "10.0.0.1:9001", []
    popen_done = gevent.event.Event()

    def popen(*args, **kwargs):
        if when == "during":
            popen_done.wait(5)
        return Running()

    def relaunch():
        child.launch()
        serving(child, "c0")  # (it serves, and takes the drain: its catch-up)

    def fetch(address, action=None, params=None, token=None, **_):
        asked.append(action)
        if action == "drain" and asked.count("drain") == 1:  # the process ends meanwhile
            relaunching = gevent.spawn(relaunch)
            gevent.sleep(0)  # (the launch, under way: its Popen yields)
            if when == "after":
                popen_done.set()
                relaunching.join()
            raise ConfigurationError("cannot reach LB process 0")
        return {"worker": worker, "changed": True, "done": action}

    monkeypatch.setattr(processes, "ask", fetch)
    monkeypatch.setattr(drains, "DRAIN_RETRY", 0.01)
    monkeypatch.setattr(gevent.subprocess, "Popen", popen)
    supervisor = processes.Supervisor(1, ["lb"], ("127.0.0.1", 0))
    child = processes.Child(0, [], -1, "INFO")
    supervisor.children = [child]
    serving(child, "c0")
    supervisor.drains.drained.add(worker)
    child.refused = {worker}  # (refused: held, and asked again)
    retry = gevent.spawn(supervisor.drains.ask_again, child, child.process)
    wait_until(lambda: asked)
    popen_done.set()
    retry.join(5)
    assert child.refused == set()
    assert supervisor.action("enable")(worker=worker) == {"worker": worker, "changed": True}
    assert asked[-1] == "enable"


def test_a_child_that_starts_serving_while_a_drain_is_asked_is_given_it(monkeypatch):
    # The drain was held only once every child had been asked: a child
    # that started serving meanwhile was caught up without it, and not
    # asked either, so it alone went on sending the worker requests.
    from zc_lb.process import processes

    worker, drained_in = "10.0.0.1:9001", set()
    supervisor = processes.Supervisor(2, ["lb"], ("127.0.0.1", 0))
    starting, first = supervisor.children = [processes.Child(i, [], -1, "INFO") for i in (0, 1)]
    serving(first, "c1")

    def fetch(address, action=None, params=None, token=None, **_):
        if address == "c1" and not starting.serving:  # (it serves now: caught up)
            serving(starting, "c0")
            supervisor._catch_up(starting)
        drained_in.add(address)
        return {"worker": worker, "changed": True, "done": action}

    monkeypatch.setattr(processes, "ask", fetch)
    supervisor.action("drain")(worker=worker)
    assert drained_in == {"c0", "c1"} and worker in supervisor.drains.drained


def samples(collector):
    """{(name, label values): value} of ``collector``'s exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    from zc_lb.status.metrics import exposition

    return {(sample.name, tuple(sample.labels.values())): sample.value
            for family in text_string_to_metric_families(exposition(collector).decode())
            for sample in family.samples}


def test_the_summed_metrics_count_every_skill_of_a_worker(monkeypatch):
    # The supervisor read each child's document with at most 100 skills a
    # worker: zc_lb_worker_skills stopped at 100, its own document said
    # skills_count 100, and a class past a worker's best 100 did not
    # count it in zc_lb_class_workers.
    from zc_lb.status.document import status_app
    from zc_lb.status.metrics import LBCollector

    skills = {"c%03d" % i: 1.0 + i for i in range(150)}
    child = {"pool": {}, "requests": 1, "classes": {"c000": 5},
             "workers": {"w:1": {"connected": True, "in_pool": True, "skills": skills}}}
    supervisor = supervisor_of(monkeypatch, {"c0": lambda: child, "c1": lambda: child})
    metrics = samples(LBCollector(supervisor.status))
    assert metrics["zc_lb_worker_skills", ("w:1",)] == 150
    assert metrics["zc_lb_class_workers", ("c000",)] == 1
    environ = {"REQUEST_METHOD": "GET", "PATH_INFO": "/status.json", "SERVER_NAME": "x",
               "SERVER_PORT": "80", "wsgi.url_scheme": "http", "QUERY_STRING": ""}
    served = json.loads(b"".join(status_app(supervisor.status)(environ, lambda *args: None)))
    assert served["workers"]["w:1"]["skills_count"] == 150
    assert len(served["workers"]["w:1"]["skills"]) == 100


def test_a_summed_class_counter_never_goes_back(monkeypatch):
    # The supervisor summed each child's 100 busiest classes: a class
    # leaving one child's 100 took that child's share of it into "other",
    # and its summed series went back.
    from zc_lb.lb.balancer import LB
    from zc_lb.routing.affinity import AffinityPool
    from zc_lb.routing.classifier import get_classifier
    from zc_lb.status.metrics import LBCollector

    a, b = (LB(AffinityPool(), get_classifier("host"), no_worker_timeout=0) for _ in range(2))

    def hit(lb, host, n=1):
        environ = {"REQUEST_METHOD": "GET", "PATH_INFO": "/", "QUERY_STRING": "",
                   "HTTP_HOST": host, "SERVER_NAME": "x", "SERVER_PORT": "80"}
        for _ in range(n):
            b"".join(lb(dict(environ), lambda status, headers: None))

    for i in range(100):
        hit(a, "a%03d" % i, 3)
    hit(a, "x", 4)  # among a's 100 busiest
    hit(b, "x", 200)
    supervisor = supervisor_of(monkeypatch, {"c0": a.status, "c1": b.status})
    collector = LBCollector(supervisor.status)
    assert samples(collector)["zc_lb_class_requests_total", ("x",)] == 204
    for i in range(100):  # a's other classes pass x
        hit(a, "a%03d" % i, 2)
    metrics = samples(collector)
    assert metrics["zc_lb_class_requests_total", ("x",)] == 204
    assert metrics["zc_lb_classes", ()] == 101  # (the document's busiest 100, and the rest)
    assert len(supervisor.status()["classes"]) == 101  # (every class counted, as an LB's)


def test_the_supervisors_health_checks_ask_its_children_for_the_bounded_document(
        monkeypatch):
    # /healthz and the request rate's samples (often, and only totals and
    # workers' states) asked every child for every skill and class, as a
    # scrape does; nor may their documents stand in for a full one.
    from zc_lb.process import processes
    from zc_lb.process.processes import Supervisor

    asked = []

    def fetch(address, timeout=5.0, action=None, params=None, token=None):
        asked.append(params)
        return {"requests": 1, "workers": {}, "full": bool(params)}

    monkeypatch.setattr(processes, "ask", fetch)
    supervisor = Supervisor(1, ["lb"], ("127.0.0.1", 0))
    supervisor.children = [processes.Child(0, [], -1, "INFO", None, None)]
    supervisor.children[0].status = "c0"
    supervisor.status()
    supervisor.status(full=False)
    assert asked == [processes.CHILD_QUERY, None]
    assert supervisor._last["c0"]["full"]


def status(address):
    with urllib.request.urlopen("http://%s/" % address, timeout=5) as response:
        return json.load(response)


def get(address, path="/"):
    host, port = address.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        connection.request("GET", path, headers={"Host": "a.example"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


@pytest.fixture
def processes_lb():
    workers = start_all([WorkerProcess("apps:app", env=ENV) for _ in range(2)])
    lb = LBProcess([w.address for w in workers], "--processes", "2",
                   "--status", "127.0.0.1:0", env=ENV).start()
    # (port 0: a port picked here and bound there was once taken in between)
    status_address = lb.status_address = lb.said("zc-lb status on ")
    wait_for(lambda: len(status(status_address)["processes"]) == 2
             and all(w["connected"] for w in status(status_address)["workers"].values()),
             message="both processes connected to both workers")
    yield lb
    lb.kill()
    for worker in workers:
        worker.kill()


def test_two_processes_serve_one_address_and_sum_their_status(processes_lb):
    lb = processes_lb
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: get(lb.address), range(80)))
    assert {status for status, _ in results} == {200}
    doc = status(lb.status_address)
    pids = {p["pid"] for p in doc["processes"]}
    assert len(pids) == 2 and lb.pid not in pids
    # Each request counted once, by the process that served it (readiness
    # checks by the fixture may add a few).
    assert doc["requests"] == sum(p["requests"] for p in doc["processes"]) >= 80
    assert all(p["requests"] > 0 for p in doc["processes"]), doc["processes"]
    # /metrics of the supervisor: the children's counters and histograms summed
    summed = metrics(lb.status_address)
    assert summed["zc_lb_requests_total"] >= 80
    assert summed["zc_lb_response_seconds_count"] == summed["zc_lb_requests_total"]


def metrics(address):
    """The unlabelled samples of the /metrics at ``address``, by name."""
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen("http://%s/metrics" % address, timeout=5) as response:
        return {sample.name: sample.value for family in text_string_to_metric_families(
            response.read().decode()) for sample in family.samples if not sample.labels}


def test_a_child_that_dies_is_started_again(processes_lb):
    lb = processes_lb
    assert all(get(lb.address)[0] == 200 for _ in range(10))
    counted = status(lb.status_address)
    before = counted["processes"][0]["pid"]
    os.kill(before, signal.SIGKILL)
    wait_for(lambda: status(lb.status_address)["processes"][0]["pid"] not in (before, None),
             timeout=20, message="the child restarted")
    assert all(get(lb.address)[0] == 200 for _ in range(10))
    # (what the child counted stays in the sum: counters never go back)
    assert status(lb.status_address)["requests"] >= counted["requests"] + 10


def test_a_child_started_again_with_its_config_file_gone_bad_starts_as_the_last_good(
        tmp_path):
    # It exited 2 at each restart, and the LB ran one process short.
    config = tmp_path / "lb.toml"
    config.write_text("[lb]\nvariance = 3.0\n")
    stderr = open(tmp_path / "lb.log", "w")
    lb = LBProcess([], "--processes", "2", "--status", "127.0.0.1:0", "--config", str(config),
                   env=dict(ENV, TMPDIR=str(tmp_path)), stderr=stderr).start()  # (killed)
    try:
        address = lb.said("zc-lb status on ")
        config.write_text("[lb]\nvariance = 'wide'\n")
        before = status(address)["processes"][0]

        def restarted():
            now = status(address)["processes"][0]
            return (now["pid"] != before["pid"] and now["status"] not in (before["status"], None)
                    and now["requests"] is not None)

        os.kill(before["pid"], signal.SIGKILL)
        wait_for(restarted, timeout=20, message="the child restarted")
        assert status(address)["pool"]["variance"] == 3.0  # (the first child's)
        assert "%s:2:" % config not in (tmp_path / "lb.log").read_text()  # (the copy read)
    finally:
        lb.kill()
        stderr.close()


def test_a_child_started_again_after_a_sighup_the_lb_cannot_build_starts_as_before(tmp_path):
    # A file that reads well but that no LB can be built from (a classifier
    # that does not import) was kept as the copy children start with: the
    # running children kept their settings, but one started again (a crash,
    # --max-requests) exited 2 at every try, and the LB ran one short.
    worker = WorkerProcess("apps:app", env=ENV).start()
    config = tmp_path / "lb.toml"

    def write(text):
        config.write_text('[lb]\nworker = ["%s"]\n%s\n' % (worker.address, text))

    write("variance = 3.0")
    stderr = open(tmp_path / "lb.log", "w")
    lb = LBProcess([], "--processes", "2", "--status", "127.0.0.1:0", "--config", str(config),
                   env=dict(ENV, TMPDIR=str(tmp_path)), stderr=stderr).start()  # (killed)
    log = (tmp_path / "lb.log").read_text
    address = lb.said("zc-lb status on ")

    def start_again(index):
        before = status(address)["processes"][index]
        os.kill(before["pid"], signal.SIGKILL)
        wait_for(lambda: status(address)["processes"][index]["pid"] not in (before["pid"], None)
                 and status(address)["processes"][index]["requests"] is not None,
                 timeout=10, message="the child started again")
        return status(status(address)["processes"][index]["status"])

    try:
        write('variance = 3.0\nclassifier = "nosuchmod:x"')
        os.kill(lb.process.pid, signal.SIGHUP)
        wait_for(lambda: log().count("classifier changed in") == 2, message="both children")
        assert start_again(0)["pool"]["variance"] == 3.0
        assert all(get(lb.address)[0] == 200 for _ in range(10))
        said = "could not start with %s as the last SIGHUP read it" % config
        assert log().count(said) == 1, log()
        assert log().count("No module named 'nosuchmod'") == 1, log()  # (the child's, once)
        write("variance = 4.0")  # (fixed: taken by a child started from now on)
        os.kill(lb.process.pid, signal.SIGHUP)
        wait_for(lambda: log().count("variance 3 -> 4") == 2, message="both children")
        assert start_again(1)["pool"]["variance"] == 4.0
        assert start_again(1)["pool"]["variance"] == 4.0  # (a good copy now)
        assert log().count(said) == 1, log()
    finally:
        lb.kill()
        worker.kill()
        stderr.close()


def test_the_supervisor_warns_of_a_secret_file_once_not_once_a_process(tmp_path):
    # (each child said it: the mode at start, and a change at each SIGHUP)
    secret, token = tmp_path / "secret", tmp_path / "token"
    for path in (secret, token):
        path.write_bytes(b"s3cret\n")
        path.chmod(0o604)
    stderr = open(tmp_path / "lb.log", "w")
    lb = LBProcess([], "--processes", "2", "--status", "127.0.0.1:0", "--secret-file",
                   str(secret), "--admin-token-file", str(token), env=ENV,
                   stderr=stderr).start()
    log = (tmp_path / "lb.log").read_text
    try:
        address = lb.said("zc-lb status on ")
        wait_for(lambda: len(status(address)["processes"]) == 2, message="both processes")
        for path in (secret, token):
            assert log().count("secret file %s can be read by others" % path) == 1, log()
        secret.write_bytes(b"n3w\n")
        os.kill(lb.process.pid, signal.SIGHUP)
        wait_for(lambda: log().count("got SIGHUP") == 3, message="the children's SIGHUP")
        assert log().count("secret file %s changed: restart to apply" % secret) == 1, log()
    finally:
        lb.kill()
        stderr.close()


def test_sigterm_drains_every_process(processes_lb):
    lb = processes_lb
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        slow = [pool.submit(get, lb.address, "/slow?1.0") for _ in range(4)]
        wait_for(lambda: status(lb.status_address)["in_flight"] == 4,
                 message="four slow requests in flight")
        assert lb.terminate(timeout=20) == 0
        assert [f.result()[0] for f in slow] == [200] * 4  # none cut


def test_children_that_cannot_start_make_the_lb_exit_with_status_2():
    import subprocess
    import sys

    # A classifier that cannot load: every child exits at once with status 2.
    done = subprocess.run(
        [sys.executable, "-m", "zc_lb.cli", "lb", "--listen", "127.0.0.1:0", "--processes", "2",
         "--classifier", "no_such_module:classify"],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "did not start" in done.stderr


def test_a_pid_file_that_cannot_be_written_stops_the_children_and_leaves_nothing(tmp_path):
    # The error left the children to end by PDEATHSIG once the supervisor
    # had exited, and the --config copy behind.
    import subprocess
    import sys

    config = tmp_path / "lb.toml"
    config.write_text("[lb]\nvariance = 3.0\n")
    copies = tmp_path / "tmp"
    copies.mkdir()
    pid_file = tmp_path / "missing" / "lb.pid"
    done = subprocess.run(
        [sys.executable, "-m", "zc_lb.cli", "lb", "--listen", "127.0.0.1:0", "--processes", "2",
         "--config", str(config), "--pid-file", str(pid_file)],
        capture_output=True, text=True, timeout=60, env=dict(os.environ, TMPDIR=str(copies)))
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("--pid-file %s" % pid_file) == 1, done.stderr
    assert not list(copies.iterdir()), done.stderr  # (no copy left behind)


@pytest.mark.parametrize("option", ["--listen", "--status"])
def test_an_address_in_use_is_named_by_its_option(option):
    import socket
    import subprocess
    import sys

    # A taken address was a raw "[Errno 98] Address already in use" (with
    # --status, once every child had started).
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    address = "127.0.0.1:%d" % taken.getsockname()[1]
    addresses = {"--listen": "127.0.0.1:0", "--status": "127.0.0.1:0", option: address}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "zc_lb.cli", "lb", "--processes", "2",
             "--listen", addresses["--listen"], "--status", addresses["--status"]],
            capture_output=True, text=True, timeout=60)
    finally:
        taken.close()
    assert done.returncode == 1, done.stderr
    assert "zc-lb lb: error: %s %s: Address already in use\n" % (option, address) in done.stderr


def test_no_lb_process_outlives_a_killed_supervisor(processes_lb):
    lb = processes_lb
    pids = [p["pid"] for p in status(lb.status_address)["processes"]]
    lb.kill()  # SIGKILL: the supervisor cannot pass anything on

    def gone(pid):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        with open("/proc/%d/stat" % pid) as f:  # a zombie not yet reaped is gone too
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    wait_for(lambda: all(gone(pid) for pid in pids), timeout=15,
             message="the children exited with their supervisor")


def test_the_processes_see_each_others_requests_in_flight(processes_lb):
    """Each child counts its siblings' requests into its workers' backlogs
    (siblings.py): with slow requests in flight, every child's own count
    plus the siblings' it took in is the whole LB's, on every worker."""
    lb = processes_lb
    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        slow: list = []
        # The kernel hands each new connection to either child: on a busy
        # machine one child may take all of a batch, so batches go until
        # both serve some (the precondition, not what is tested).
        for _ in range(3):
            slow += [pool.submit(get, lb.address, "/slow?1.5") for _ in range(8)]
            wait_for(lambda: status(lb.status_address)["in_flight"] == len(slow),
                     message="%d slow requests in flight" % len(slow))
            children = [status(p["status"]) for p in status(lb.status_address)["processes"]]
            if all(child["in_flight"] for child in children):
                break
        assert all(child["in_flight"] for child in children), "both children serve some"

        def seen_alike():  # (the children exchange their counts every 0.25 s at most)
            children = [status(p["status"]) for p in status(lb.status_address)["processes"]]
            own = {name: sum(child["workers"][name]["backlog"] for child in children)
                   for name in children[0]["workers"]}
            return all(w["backlog"] + w["siblings_backlog"] == own[name]
                       for child in children for name, w in child["workers"].items())
        wait_for(seen_alike, timeout=5, message="each child sees the others' requests")
        # The supervisor's pool backlog is every child's, as its in_flight
        # is (it was the first child's alone)
        summed = status(lb.status_address)
        assert summed["pool"]["backlog"] == summed["in_flight"] == len(slow), summed["pool"]
        assert metrics(lb.status_address)["zc_lb_pool_backlog"] == len(slow)
        assert [f.result()[0] for f in slow] == [200] * len(slow)


def kill_left(*processes):
    """Kill and reap those of ``processes`` a test left running."""
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait()


def slow_launches(monkeypatch, module, launching, sleep):
    """Make ``module.Popen`` set ``launching``, then take 0.3 s (with
    ``sleep``) before it launches: a stop can come meanwhile.  ``launching``."""
    popen = module.Popen

    def slow_popen(*args, **kwargs):
        launching.set()
        sleep(0.3)
        return popen(*args, **kwargs)

    monkeypatch.setattr(module, "Popen", slow_popen)
    return launching


def watch_until_said(supervisor, child, caplog, count):
    """Let ``supervisor`` watch ``child`` until it has said ``count`` lines
    of its exits (``said``), then stop it: the lines."""
    import gevent

    watcher = gevent.spawn(supervisor._watch, child)
    try:
        wait_until(lambda: len(said(caplog)) >= count)
    finally:
        supervisor.stopping = True
        watcher.kill()
    return said(caplog)


def test_an_enable_while_a_child_started_again_catches_up_on_its_drain_is_taken(
        monkeypatch):
    # A child started again is given the drains (catch_up): an operator's
    # enable that came while that drain was on its way, or once the child
    # had refused it but before it was asked again, asked the child, which
    # did not know the worker yet, and answered 400 ("enable failed in
    # process 0: ... no worker"), though the child had nothing to undo.
    from zc_lb.errors import ConfigurationError
    from zc_lb.process import drains, processes
    from zc_lb.process.processes import Supervisor

    one, two = "10.0.0.1:9001", "10.0.0.2:9001"
    supervisor = Supervisor(1, ["lb"], ("127.0.0.1", 0))
    answers = []

    def fetch(address, action=None, params=None, token=None, **_):
        worker = params["worker"]
        if action == "drain" and worker == two:  # (one refused, two on its way)
            for enabled in (one, two):
                try:
                    answers.append(supervisor.action("enable")(worker=enabled))
                except ConfigurationError as exc:
                    answers.append(exc)
        raise ConfigurationError("answered 400: %s: no worker %s" % (action, worker))

    monkeypatch.setattr(processes, "ask", fetch)
    monkeypatch.setattr(drains, "DRAIN_RETRY", 0.01)
    supervisor.children = [processes.Child(0, [], -1, "INFO", None, None)]
    child = supervisor.children[0]
    serving(child, "c0")
    supervisor.drains.drained.update({one, two})
    supervisor.drains.catch_up(child)
    assert answers == [{"worker": one, "changed": False}, {"worker": two, "changed": False}]
    # Refused, and not yet asked again: nothing to undo there either.
    supervisor.drains.drained.add(one)
    supervisor.drains.catch_up(child)
    assert supervisor.action("enable")(worker=one) == {"worker": one, "changed": False}
    assert supervisor.drains.drained == set()
    wait_until(lambda: not child.refused)


@pytest.fixture
def supervised(monkeypatch):
    """A Supervisor, in this process, of two real LB processes and their
    one worker (both connected); its children given 0.5 s to answer for
    their status, 1 s for an action.  Every child is resumed (SIGCONT)
    and stopped after."""
    from zc_lb.process import processes

    monkeypatch.setattr(processes, "STATUS_TIMEOUT", 0.5)
    monkeypatch.setattr(processes, "ACTION_TIMEOUT", 1.0)
    worker = WorkerProcess("apps:app", env=ENV).start()
    supervisor = processes.Supervisor(2, ["--worker", worker.address], ("127.0.0.1", 0))
    try:
        supervisor.start()
        wait_until(lambda: [w.get("connected") for w in supervisor.status()["workers"].values()]
                   == [True])
        yield supervisor, worker.address
    finally:
        for child in supervisor.children:
            if child.process is not None and child.process.poll() is None:
                os.kill(child.process.pid, signal.SIGCONT)
        supervisor.stop(timeout=5)
        worker.kill()


def test_a_stopped_child_holds_up_neither_the_supervisors_status_nor_its_signals(supervised):
    # The supervisor asked its children one after another with urllib,
    # blocking: a child stopped (SIGSTOP) or stuck held its whole loop for
    # the timeout, each status request after another, and a signal waited.
    import threading
    import time

    import gevent

    supervisor, _ = supervised
    stopped = supervisor.children[0]
    os.kill(stopped.process.pid, signal.SIGSTOP)
    handled = []
    watcher = gevent.signal_handler(signal.SIGUSR2, lambda: handled.append(time.monotonic()))
    try:
        started = time.monotonic()
        threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGUSR2)).start()
        asking = [gevent.spawn(supervisor.status) for _ in range(2)]
        asking.append(gevent.spawn(supervisor.status, full=False))
        gevent.joinall(asking, timeout=10)
        took = time.monotonic() - started
        assert handled and handled[0] - started < 0.4, handled
    finally:
        watcher.cancel()
    assert took < 0.9, took  # (one child's timeout, 0.5 s: not three, nor six)
    for greenlet in asking:
        assert [p["stale"] for p in greenlet.get()["processes"]] == [True, False]


def test_an_action_no_child_answers_is_a_503_naming_the_processes(supervised):
    # It was a ConfigurationError, answered 400, "your request is wrong",
    # though asking again later is all the operator can do.
    import time

    from zc_lb.errors import ChildUnavailable
    from zc_lb.status.document import status_app

    supervisor, worker = supervised
    for child in supervisor.children:
        os.kill(child.process.pid, signal.SIGSTOP)
    started = time.monotonic()
    with pytest.raises(ChildUnavailable, match=r"drain failed: no answer from LB processes "
                                               r"0, 1 \(try again\): process 0: .*timed out"):
        supervisor.action("drain")(worker=worker)
    assert time.monotonic() - started < 1.5  # (asked at once: one timeout, not two)
    assert worker not in supervisor.drains.drained  # (nobody took it: not held)
    app = status_app(supervisor.status, {"enable": supervisor.action("enable")})
    environ = {"REQUEST_METHOD": "POST", "PATH_INFO": "/enable", "REMOTE_ADDR": "127.0.0.1",
               "QUERY_STRING": "worker=" + worker}
    said = []
    body = b"".join(app(environ, lambda status, headers: said.append(status)))
    assert said == ["503 Service Unavailable"]
    assert json.loads(body)["error"].startswith(
        "enable: enable failed: no answer from LB processes 0, 1 (try again): ")


def test_an_enable_reaches_a_child_whose_drain_went_unanswered(supervised):
    # A drain one child did not answer in time was held for it as one it
    # refused: an enable then asked that child nothing ("nothing to undo
    # there"), and said it was done; the child, resumed, took the drain it
    # had been sent, and alone sent the worker nothing, for good.
    import gevent

    from zc_lb.errors import ChildUnavailable
    from zc_lb.status.document import fetch

    supervisor, worker = supervised
    late = supervisor.children[0]
    os.kill(late.process.pid, signal.SIGSTOP)
    supervisor.action("drain")(worker=worker)  # (the other took it: held for this one)
    try:
        supervisor.action("enable")(worker=worker)
        told_to_retry = False
    except ChildUnavailable:  # (that child did not answer the enable either)
        told_to_retry = True
    os.kill(late.process.pid, signal.SIGCONT)
    gevent.sleep(0.3)  # (it reads what it was sent meanwhile)
    if told_to_retry:
        supervisor.action("enable")(worker=worker)  # (the operator asks again, as told)
    for child in supervisor.children:
        document = fetch(child.status, timeout=5)
        assert not document["workers"][worker].get("drained"), child
    assert told_to_retry


class Built(Exception):
    """``Supervisor.start`` stopped: the supervisor ``run`` built, not started."""


def test_a_child_is_given_the_time_the_options_say_to_answer(monkeypatch):
    # A child had 2 s to answer for its status and 5 s for an action,
    # constants: an operator whose children are slow (a large pool, a
    # loaded box) could not give them longer, nor shorter.
    import socket
    import time

    from zc_lb.cli.parsers import build_parser
    from zc_lb.errors import ChildUnavailable
    from zc_lb.process import processes, service

    argv = ["lb", "--processes", "2", "--listen", "127.0.0.1:0",
            "--child-status-timeout", "0.2", "--child-action-timeout", "1"]
    built = []

    def start(supervisor):
        built.append(supervisor)
        raise Built()

    monkeypatch.setattr(processes.Supervisor, "start", start)
    monkeypatch.setenv(service.SECRETS_WATCHED, "[]")  # (what ``run`` names to children)
    monkeypatch.setattr(service, "_watched", service._watched)
    with pytest.raises(Built):
        processes.run(build_parser().parse_args(argv), argv)
    supervisor, = built
    silent = socket.create_server(("127.0.0.1", 0))  # takes a request, never answers
    try:
        supervisor.children = [processes.Child(0, [], -1, "INFO")]
        serving(supervisor.children[0], "127.0.0.1:%d" % silent.getsockname()[1])
        started = time.monotonic()
        assert [p["stale"] for p in supervisor.status()["processes"]] == [True]
        took = time.monotonic() - started
        assert 0.15 < took < 0.7, took
        started = time.monotonic()
        with pytest.raises(ChildUnavailable, match="no answer from LB process 0 .*timed out"):
            supervisor.action("drain")(worker="10.0.0.1:9001")
        took = time.monotonic() - started
        assert 0.9 < took < 1.5, took
    finally:
        silent.close()


def test_a_supervisor_refuses_a_childs_timeout_that_is_no_positive_number():
    from zc_lb.errors import ConfigurationError
    from zc_lb.process.processes import Supervisor

    for timeouts in ({"status_timeout": 0}, {"action_timeout": -1.0}, {"status_timeout": "2"}):
        with pytest.raises(ConfigurationError, match="child_(status|action)_timeout must be"):
            Supervisor(2, ["lb"], ("127.0.0.1", 0), **timeouts)


def test_two_actions_reach_each_child_in_the_order_they_came(monkeypatch):
    # Actions ran side by side: an enable that came while a drain was on
    # its way to a slow child reached that child first, and the worker
    # ended drained there.
    import gevent

    from zc_lb.process import processes

    worker, seen = "10.0.0.1:9001", {"c0": [], "c1": []}

    def ask(address, action=None, params=None, token=None, **_):
        if address == "c0" and action == "drain":
            gevent.sleep(0.2)  # (slow to get there)
        seen[address].append(action)
        return {"worker": worker, "changed": True, "done": action}

    monkeypatch.setattr(processes, "ask", ask)
    supervisor = processes.Supervisor(2, ["lb"], ("127.0.0.1", 0))
    supervisor.children = [processes.Child(i, [], -1, "INFO") for i in (0, 1)]
    for child, status in zip(supervisor.children, ("c0", "c1")):
        serving(child, status)
    actions = [gevent.spawn(supervisor.action(name), worker=worker)
               for name in ("drain", "enable", "drain", "reset-skills")]
    gevent.joinall(actions, timeout=5, raise_error=True)
    assert seen == {"c0": ["drain", "enable", "drain", "reset-skills"],
                    "c1": ["drain", "enable", "drain", "reset-skills"]}
    assert worker in supervisor.drains.drained


def test_a_worker_enabled_while_a_child_did_not_answer_its_drain_is_enabled_there(monkeypatch):
    # A child started again is given the drains (catch_up); an enable that
    # came meanwhile left that child to the catch-up, which, the drain
    # unanswered (the child may take it late), asked the child nothing more.
    from zc_lb.errors import ZcLbError
    from zc_lb.process import processes

    worker, asked = "10.0.0.1:9001", []
    supervisor = processes.Supervisor(1, ["lb"], ("127.0.0.1", 0))

    def ask(address, action=None, params=None, token=None, **_):
        asked.append(action)
        if action == "drain":
            supervisor.action("enable")(worker=worker)  # (while the drain is on its way)
            raise ZcLbError("cannot get status from c0: timed out")
        return {"worker": worker, "changed": True, "done": action}

    monkeypatch.setattr(processes, "ask", ask)
    supervisor.children = [processes.Child(0, [], -1, "INFO", None, None)]
    child = supervisor.children[0]
    serving(child, "c0")
    supervisor.drains.drained.add(worker)
    supervisor.drains.catch_up(child)
    assert asked == ["drain", "enable"] and child.unanswered == set()
    assert supervisor.drains.drained == set() and child.refused == set()
