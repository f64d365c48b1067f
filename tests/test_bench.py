"""`make bench` smoke tests: the bench runs end to end in a tiny mode and
prints its table; wrk's output is read right.  No speed is asserted."""

import contextlib
import re
import shutil
import socket
import subprocess
import sys

import pytest

from benchmarks import bench, floor
from zc_lb.testing import read_until_closed

WRK_OUTPUT = """\
Running 1s test @ http://127.0.0.1:8080/
  1 threads and 4 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency   312.50us  100.00us   2.10ms   90.00%
    Req/Sec    12.00k     1.00k   13.00k    80.00%
  Latency Distribution
     50%  305.00us
     75%  350.00us
     90%  400.00us
     99%    1.20ms
  12345 requests in 1.00s, 1.50MB read
  Socket errors: connect 0, read 2, write 0, timeout 1
  Non-2xx or 3xx responses: 4
Requests/sec:  12345.67
Transfer/sec:      1.50MB
"""


def test_parse_wrk():
    result = bench.parse_wrk(WRK_OUTPUT)
    assert result == {"rps": 12345.67, "requests": 12345, "errors": 7,
                      "p50_ms": pytest.approx(0.305), "p99_ms": pytest.approx(1.2)}


def test_parse_wrk_refuses_garbage():
    with pytest.raises(bench.BenchError):
        bench.parse_wrk("unable to connect to 127.0.0.1:1 Connection refused\n")


def test_hello_app():
    seen = []
    body = bench.hello_app({}, lambda status, headers: seen.append((status, headers)))
    assert b"".join(body) == bench.BODY
    assert seen[0][0] == "200 OK"


def test_format_table_without_haproxy():
    results = [{"target": "zc-lb", "rps": 100.0, "p50_ms": 1.0, "p99_ms": 2.0,
                "lb_cpu_us_per_req": 50.0, "worker_cpu_us_per_req": 40.0, "errors": 0},
               {"target": "direct", "rps": 400.0, "p50_ms": 0.5, "p99_ms": 1.0,
                "lb_cpu_us_per_req": None, "worker_cpu_us_per_req": 30.0, "errors": 0}]
    text = bench.format_table(results)
    assert "zc-lb / HAProxy throughput ratio: -" in text
    assert "zc-lb / direct throughput ratio: 0.250" in text


def test_the_goals_say_met_or_not():
    row = {"target": "zc-lb", "rps": 100.0, "p50_ms": 1.0, "p99_ms": 2.0,
           "lb_cpu_us_per_req": 50.0, "worker_cpu_us_per_req": 40.0, "errors": 0}
    haproxy = dict(row, target="haproxy", rps=90.0, p99_ms=3.0, lb_cpu_us_per_req=30.0)
    lines = bench.goals(row, 100 / 90, 60.0, haproxy)
    assert lines[1:] == ["  LB CPU 50.0 us/req, 1.67x HAProxy's 30.0, goal <= 2.0x: met",
                         "  throughput 1.11x HAProxy's, goal >= 1.0, p99 no worse: met",
                         "  worker overhead 60.0 us/req, goal <= 40: NOT met"]
    costly = bench.goals(dict(row, lb_cpu_us_per_req=61.0), 100 / 90, 10.0, haproxy)
    assert costly[1] == "  LB CPU 61.0 us/req, 2.03x HAProxy's 30.0, goal <= 2.0x: NOT met"
    slower = bench.goals(dict(row, p99_ms=4.0), 100 / 90, 10.0, haproxy)
    assert slower[2].endswith("p99 no worse: NOT met")


HAVE_TOOLS = shutil.which("wrk") and shutil.which("haproxy", path="/usr/sbin:/usr/bin")


@pytest.mark.skipif(not HAVE_TOOLS, reason="needs wrk and haproxy (apt-get install wrk haproxy)")
def test_bench_tiny_run_prints_table():
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench", "--seconds", "1", "--warmup", "0",
         "--connections", "4", "--targets",
         "zc-lb,haproxy,direct,floor,zc-lb-paced,haproxy-paced"],
        capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for target in ("zc-lb", "haproxy", "direct", "floor"):
        row = re.search(r"^%s\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+(\S+)\s+([\d.]+)\s+(\d+)$"
                        % re.escape(target), out, re.M)
        assert row, "no row for %s in:\n%s" % (target, out)
        assert float(row.group(1)) > 0
        assert row.group(6) == "0", "errors against %s:\n%s" % (target, out)
    for label in ("zc-lb / HAProxy", "zc-lb / direct"):
        ratio = re.search(r"^%s throughput ratio: ([\d.]+)$" % re.escape(label), out, re.M)
        assert ratio and float(ratio.group(1)) > 0, out
    assert re.search(r"^zc-lb LB CPU / the floor proxy's: [\d.]+$", out, re.M), out
    # (HAProxy's CPU in a second at 600 requests, about 20 ms, may read as no
    # clock tick at all: then the line says so, and gives no ratio)
    paced = re.search(r"^paced \(-c24, each waiting 40 ms after a response\): LB CPU [\d.]+ "
                      r"us/req at (\d+) req/s, (?:[\d.]+x HAProxy's [\d.]+ at (\d+), "
                      r"goal <= 2.0x: (NOT )?met|HAProxy's under one clock tick at (\d+): "
                      r"too short a run for a ratio)$", out, re.M)
    assert paced, out
    # (paced: 24 connections each waiting 40 ms make 600 a second at most, give or take
    # a second's rounding; unpaced, thousands)
    theirs = paced.group(2) or paced.group(4)
    assert 0 < int(paced.group(1)) <= 700 and 0 < int(theirs) <= 700, out
    assert re.search(r"^pool choice \(get \+ put, 6 workers, 32 classes\): affinity [\d.]+ us/req, "
                     r"published [\d.]+ us/req; affinity / published [\d.]+; "
                     r"goal <= 3 us: (NOT )?met$", out, re.M), out
    assert re.search(r"^  LB CPU [\d.]+ us/req, [\d.]+x HAProxy's [\d.]+, goal <= 2.0x: "
                     r"(NOT )?met$", out, re.M), out


def test_bench_without_wrk_says_how_to_get_it(monkeypatch, capsys):
    monkeypatch.setattr(bench.shutil, "which", lambda *a, **k: None)
    assert bench.main(["--seconds", "1"]) == 1
    assert "apt-get install wrk" in capsys.readouterr().err


def test_the_pool_bench_times_every_policy_on_the_same_requests():
    assert bench.pool_workload(500) == bench.pool_workload(500)
    assert len({rclass for rclass, _ in bench.pool_workload(5000)}) > 20
    for policy in ("affinity", "published"):
        assert 0 < bench.pool_us(policy, requests=2000) < 100000
    assert bench.pool_line({"affinity": 12.0, "published": 3.0}).endswith(
        "affinity 12.0 us/req, published 3.0 us/req; affinity / published 4.0; "
        "goal <= 3 us: NOT met")
    assert bench.pool_line({"affinity": 2.5, "published": 1.0}).endswith("goal <= 3 us: met")


def test_the_resume_intake_measure_times_the_pool_and_the_decoder():
    intake = bench.intake_ms(resumes=4)
    assert 0 < intake["median"] <= intake["max"] and intake["decode"] > 0
    assert 0 < intake["churned_stretch_max"] <= intake["churned_whole_median"] * 2
    churned = {"churned_whole_median": 15.0, "churned_stretch_max": 12.5}
    line = bench.intake_line(dict(churned, median=1.5, max=2.5, decode=3.0))
    assert "pool median 1.50 ms, worst 2.50 ms; goal <= 2 ms: met" in line
    assert "every class new: 15.0 ms a résumé (median), taken in steps; the longest the " \
        "loop waited 12.5 ms" in line and "goal <= 20 ms: met" in line
    assert "NOT met" in bench.intake_line(dict(churned, median=2.5, max=2.5, decode=3.0))
    assert "NOT met" in bench.intake_line(dict(churned, churned_stretch_max=25.0, median=1.5,
                                               max=2.5, decode=3.0))


def test_the_in_process_measure_serves_every_request_and_gives_a_cost():
    cost = bench.in_process(requests=400, batch=4, clients=2)
    assert 0 < cost < 100000  # CPU microseconds per request, whatever this machine gives


def test_the_floor_reads_frames_whole_and_keeps_a_partial_one():
    frame = floor.FRAME.pack
    buffer = bytearray(frame(1, 3) + b"abc" + frame(2, 0) + frame(3, 5) + b"xy")
    assert list(floor.frames(buffer)) == [(1, b"abc"), (2, b"")]
    assert buffer == frame(3, 5) + b"xy"
    buffer += b"z!!"
    assert list(floor.frames(buffer)) == [(3, b"xyz!!")] and not buffer


def test_the_floor_proxy_answers_pipelined_requests_and_refuses_a_body():
    # Real processes, as the bench runs them.
    with contextlib.ExitStack() as stack:
        workers = [stack.enter_context(bench.running(
            [sys.executable, "-m", "benchmarks.bench", "floor-worker", "127.0.0.1:0"],
            floor.READY)) for _ in range(2)]
        _, address = stack.enter_context(bench.running(
            [sys.executable, "-m", "benchmarks.bench", "floor-proxy", "127.0.0.1:0"]
            + [a for _, a in workers], floor.READY))
        host, port = address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n" * 3)
            received = b""
            while received.count(bench.BODY) < 3:
                data = sock.recv(65536)
                assert data, received
                received += data
            assert received.count(b"HTTP/1.1 200 OK\r\n") == 3
            sock.sendall(b"POST /b HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi")
            assert read_until_closed(sock).startswith(b"HTTP/1.1 501 ")


def test_the_paced_line_sets_the_lb_against_haproxy_at_the_same_pace():
    row = {"target": "zc-lb-paced", "rps": 560.0, "p50_ms": 1.0, "p99_ms": 2.0,
           "lb_cpu_us_per_req": 90.0, "worker_cpu_us_per_req": 40.0, "errors": 0}
    haproxy = dict(row, target="haproxy-paced", rps=580.0, lb_cpu_us_per_req=50.0)
    text = bench.format_table([row, haproxy])
    assert ("paced (-c24, each waiting 40 ms after a response): LB CPU 90.0 us/req at 560 "
            "req/s, 1.80x HAProxy's 50.0 at 580, goal <= 2.0x: met") in text.splitlines()
    costly = bench.format_table([dict(row, lb_cpu_us_per_req=101.0), haproxy])
    assert "2.02x HAProxy's 50.0 at 580, goal <= 2.0x: NOT met" in costly
    assert "paced (" not in bench.format_table([row])  # (not without HAProxy's)


def test_the_table_sets_the_lb_against_the_floor():
    row = {"target": "zc-lb", "rps": 100.0, "p50_ms": 1.0, "p99_ms": 2.0,
           "lb_cpu_us_per_req": 120.0, "worker_cpu_us_per_req": 40.0, "errors": 0}
    text = bench.format_table([row, dict(row, target="floor", lb_cpu_us_per_req=40.0)])
    assert "zc-lb LB CPU / the floor proxy's: 3.00" in text


def test_the_bodies_app_sends_and_counts_large_bodies(tmp_path):
    import io

    seen = []
    body = bench.bodies_app({"REQUEST_METHOD": "GET", "QUERY_STRING": "size=600000"},
                            lambda status, headers: seen.append(headers))
    data = b"".join(body)
    assert len(data) == 600000 and data == bench.big_body(600000)
    assert ("Content-Length", "600000") in seen[0]
    # In the blocks asked for; and from a file, through the server's
    # file wrapper where it offers one, else in those blocks.
    blocks = list(bench.bodies_app({"REQUEST_METHOD": "GET",
                                    "QUERY_STRING": "size=10000&block=4096"},
                                   lambda status, headers: None))
    assert [len(block) for block in blocks] == [4096, 4096, 1808]
    wrapped = []
    body = bench.bodies_app({"REQUEST_METHOD": "GET", "QUERY_STRING": "size=10000&file=1",
                             "wsgi.file_wrapper": lambda f, size: wrapped.append(size) or f},
                            lambda status, headers: None)
    assert body.read() == bench.big_body(10000) and wrapped == [bench.BODIES_CHUNK]
    body.close()
    blocks = list(bench.bodies_app({"REQUEST_METHOD": "GET",
                                    "QUERY_STRING": "size=10000&file=1&block=4096"},
                                   lambda status, headers: None))
    assert b"".join(blocks) == bench.big_body(10000) and len(blocks) == 3
    reads = []

    class Input(io.BytesIO):
        def read(self, size=-1):
            reads.append(size)
            return super().read(size)

    answer = bench.bodies_app({"REQUEST_METHOD": "POST", "CONTENT_LENGTH": "150000",
                               "wsgi.input": Input(b"x" * 150001)},
                              lambda status, headers: None)
    assert answer == [b"150000\n"] and reads[0] == bench.BODIES_READ
    reads.clear()
    answer = bench.bodies_app({"REQUEST_METHOD": "POST", "CONTENT_LENGTH": "10000",
                               "QUERY_STRING": "block=4096", "wsgi.input": Input(b"x" * 10000)},
                              lambda status, headers: None)
    assert answer == [b"10000\n"] and reads == [4096, 4096, 1808]


def test_the_bodies_lines_give_each_case_and_the_goal():
    cases = {name: {"direct_mb_s": 1000.0, "zc-lb": 1.2, "zc-lb --greenlets": 1.1,
                    "--sendfile on": 1.3, "bare TCP hop": 1.05, "zc-lb TLS": 2.0}
             for name, _, _ in bench.BODY_CASES}
    result = {"mb": 20, "transfers": 5, "cases": cases, "met": True, "missed": []}
    text = bench.bodies_lines(result)
    lines = text.splitlines()
    assert lines[0] == ("bodies (20 MB, 5 transfers each): the app's time through each over "
                        "its time served directly")
    assert lines[1].split() == ["direct", "MB/s", "zc-lb", "zc-lb", "--greenlets",
                                "--sendfile", "on", "bare", "TCP", "hop", "zc-lb",
                                "TLS"]  # (no HAProxy: not measured)
    assert lines[2].split() == ["download,", "4", "KiB", "blocks", "1000", "1.20x", "1.10x",
                                "1.30x", "1.05x", "2.00x"]
    assert len(lines) == 2 + len(bench.BODY_CASES) + 1
    assert lines[-1] == "  goal: zc-lb's (both worker modes) <= 1.5x: met"
    result.update(met=False, missed=["zc-lb upload, 4 KiB reads"])
    assert bench.bodies_lines(result).splitlines()[-1] == (
        "  goal: zc-lb's (both worker modes) <= 1.5x: NOT met (zc-lb upload, 4 KiB reads)")


def test_bench_bodies_tiny_run_prints_its_line():
    # No wrk needed: the bodies measure has a client of its own.
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench", "--targets", "bodies", "--body-mb", "1",
         "--body-transfers", "1"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    start = lines.index("bodies (1 MB, 1 transfers each): the app's time through each over "
                        "its time served directly")
    assert lines[start + 1].split()[:2] == ["direct", "MB/s"]
    assert "HAProxy" in lines[start + 1]
    for (name, _, _), line in zip(bench.BODY_CASES, lines[start + 2:]):
        assert line.startswith("  " + name)
        assert re.fullmatch(r"\s*\d+(\s+[\d.]+x){6}", line[len(name) + 2:]), line
    assert re.fullmatch(r"  goal: zc-lb's \(both worker modes\) <= 1\.5x: (NOT )?met.*",
                        lines[start + 2 + len(bench.BODY_CASES)])


def test_the_idle_measure_holds_clients_open_and_weighs_the_lb():
    args = bench.build_parser().parse_args([])
    result = bench.measure_idle(args, clients=40, batch=20)
    assert (result["clients"], result["batch"]) == (40, 20)
    assert result["kb_per_client"] > 0 and result["burst_kb_per_client"] > 0
    assert result["met"] == (result["kb_per_client"] <= bench.GOAL_IDLE_KB)
    assert re.match(r"idle keep-alive clients \(40\): [\d.]+ KB of LB memory each, parked in "
                    r"batches of 20; [\d.]+ KB when all came at once \(the burst's peak, which "
                    r"the allocator keeps\); goal <= 8 KB: (NOT )?met$", bench.idle_line(result))


def test_the_slow_measure_holds_clients_that_read_nothing_and_times_another():
    args = bench.build_parser().parse_args([])
    result = bench.measure_slow(args, clients=20, kb=64)
    assert (result["clients"], result["response_kb"]) == (20, 64)
    assert result["p99_ms_without"] > 0 and result["p99_ms_with"] > 0
    assert result["met"] == (result["kb_per_client"] <= bench.GOAL_SLOW_KB
                             and result["p99_ms_with"] <= 2 * result["p99_ms_without"])
    assert re.match(r"slow clients \(20, 64 KB each, reading nothing\): -?[\d.]+ KB of LB "
                    r"memory each; another client's p99 [\d.]+ ms with them, [\d.]+ without; "
                    r"goal <= 64 KB, p99 within 2x: (NOT )?met$", bench.slow_line(result))


def _measure_with(monkeypatch, wrk_output, readings, pids=None):
    """``bench.measure`` of a stand-in target (``pids``: its LB's and its
    worker's, this process's by default) whose wrk run printed
    ``wrk_output`` and whose CPU readings are ``readings`` (before, then
    after, for the LB and then the worker)."""
    import os

    lb, worker = pids or (os.getpid(), os.getpid())

    @contextlib.contextmanager
    def target(args):
        yield "http://127.0.0.1:1/", [lb], [worker]

    monkeypatch.setitem(bench.TARGET_FACTORIES, "zc-lb", target)
    monkeypatch.setattr(bench, "check_response", lambda url: None)
    monkeypatch.setattr(bench, "run_wrk", lambda *args: wrk_output)
    readings = iter({pid: seconds} for pid, seconds in zip((lb, worker) * 2, readings))
    monkeypatch.setattr(bench, "cpu_times", lambda pids: next(readings))
    args = bench.build_parser().parse_args(["--warmup", "0"])
    args.wrk = "wrk"
    return bench.measure("zc-lb", args)


CLEAN_WRK = WRK_OUTPUT.replace("read 2, write 0, timeout 1", "read 0, write 0, timeout 0") \
    .replace("  Non-2xx or 3xx responses: 4\n", "")


def test_a_clean_run_gives_cpu_per_request(monkeypatch):
    result = _measure_with(monkeypatch, CLEAN_WRK, [1.0, 1.0, 2.2345, 3.469])
    assert result["lb_cpu_us_per_req"] == pytest.approx(100.0)
    assert result["worker_cpu_us_per_req"] == pytest.approx(200.0)


def test_a_target_process_that_ended_in_the_run_is_an_error(monkeypatch):
    # (a child that ended, not yet reaped: its CPU stopped counting, and
    # one reaped counts none at all: 0 us a request, the goal "met")
    import os

    zombie = subprocess.Popen([sys.executable, "-c", ""])
    try:
        _wait_for_state(zombie.pid, "Z")
        with pytest.raises(bench.BenchError,
                           match="zc-lb: process %d ended during the measured run" % zombie.pid):
            _measure_with(monkeypatch, CLEAN_WRK, [1.0, 1.0, 2.0, 2.0],
                          (zombie.pid, os.getpid()))
    finally:
        zombie.wait()
    with pytest.raises(bench.BenchError, match="process %d ended" % zombie.pid):
        _measure_with(monkeypatch, CLEAN_WRK, [1.0, 1.0, 2.0, 2.0], (os.getpid(), zombie.pid))


def _wait_for_state(pid, state):
    from zc_lb.testing import wait_for

    def now():
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0]

    wait_for(lambda: now() == state)


def test_a_run_that_completed_nothing_or_mostly_errors_is_an_error(monkeypatch):
    nothing = CLEAN_WRK.replace("12345 requests in", "0 requests in").replace(
        "Requests/sec:  12345.67", "Requests/sec:      0.00")
    with pytest.raises(bench.BenchError, match="zc-lb completed no request"):
        _measure_with(monkeypatch, nothing, [1.0, 1.0, 2.0, 2.0])
    failing = CLEAN_WRK.replace(
        "Requests/sec:", "  Non-2xx or 3xx responses: 12000\nRequests/sec:")
    with pytest.raises(bench.BenchError, match="zc-lb: 12000 errors in 12345 requests"):
        _measure_with(monkeypatch, failing, [1.0, 1.0, 2.0, 2.0])
    # (a few, as a busy machine makes, leave the figures standing)
    few = WRK_OUTPUT  # 7 errors in 12345
    assert _measure_with(monkeypatch, few, [1.0, 1.0, 2.0, 2.0])["errors"] == 7


def test_a_target_that_answers_an_error_first_is_a_bench_error():
    # (urllib raises its own error for a 502: the bench's clear message,
    # not a traceback)
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(502)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with pytest.raises(bench.BenchError, match="502"):
            bench.check_response("http://127.0.0.1:%d/" % server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(bench.BenchError, match="127.0.0.1:1/"):
        bench.check_response("http://127.0.0.1:1/")  # (nothing listens)


STOPPED_BENCH = """
import sys, time
from benchmarks import bench

def run_bench(args):  # (a server started, then a long measure)
    with bench.running(bench.serve_argv(), bench.SERVE_READY) as (process, _):
        print(process.pid, flush=True)
        time.sleep(30)
    return 0

bench.run_bench = run_bench
sys.exit(bench.main(["--targets", ""]))
"""


def test_a_bench_stopped_by_sigterm_stops_what_it_started():
    import os
    import signal

    done = subprocess.Popen([sys.executable, "-c", STOPPED_BENCH], stdout=subprocess.PIPE,
                            text=True)
    server = None
    try:
        server = int(done.stdout.readline())
        done.send_signal(signal.SIGTERM)
        status = done.wait(10)
        with pytest.raises(ProcessLookupError):
            os.kill(server, 0)
        assert status == 128 + signal.SIGTERM
    finally:
        done.kill()
        done.wait()
        done.stdout.close()
        if server is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(server, signal.SIGKILL)


def test_the_bench_says_which_build_it_measured(monkeypatch, capsys):
    # (the source costs some twice the CPU a request of the compiled
    # build: a run must not leave a reader to guess which it was)
    import json

    import zc_lb

    monkeypatch.setattr(bench, "pool_us", lambda policy: 1.0)
    monkeypatch.setattr(bench, "intake_ms", lambda: dict.fromkeys(
        ("median", "max", "decode", "churned_whole_median", "churned_stretch_max"), 1.0))
    assert bench.main(["--targets", ""]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "zc-lb build: " + zc_lb.build()
    assert bench.main(["--targets", "", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["settings"]["build"] == zc_lb.build()


def test_a_wrk_run_past_its_time_is_a_bench_error_naming_the_target(monkeypatch, tmp_path):
    # It ended the bench in subprocess.TimeoutExpired's traceback.
    wrk = tmp_path / "wrk"
    wrk.write_text("#!/bin/sh\nexec sleep 60\n")  # (exec: the kill reaches the sleep)
    wrk.chmod(0o755)
    stopped = []

    @contextlib.contextmanager
    def target(args):
        try:
            yield "http://127.0.0.1:1/", [], []
        finally:
            stopped.append(True)

    monkeypatch.setitem(bench.TARGET_FACTORIES, "zc-lb", target)
    monkeypatch.setattr(bench, "check_response", lambda url: None)
    monkeypatch.setattr(bench, "WRK_GRACE", 0.3, raising=False)
    args = bench.build_parser().parse_args(["--warmup", "0", "--seconds", "1"])
    args.wrk = str(wrk)
    with pytest.raises(bench.BenchError) as info:
        bench.measure("zc-lb", args)
    assert str(info.value) == ("zc-lb: wrk against http://127.0.0.1:1/ did not end within "
                               "0.3s of its 1s run: killed")
    assert stopped == [True]  # (the target's clean-up done)


def test_a_paced_run_too_short_to_read_haproxys_cpu_says_so_and_gives_no_ratio():
    # (the line was left out, and a one-second bench lost it in silence)
    rows = {"zc-lb-paced": {"lb_cpu_us_per_req": 90.0, "rps": 575.0},
            "haproxy-paced": {"lb_cpu_us_per_req": 0.0, "rps": 590.0}}
    assert bench.paced_lines(rows) == [
        "paced (-c24, each waiting 40 ms after a response): LB CPU 90.0 us/req at 575 req/s, "
        "HAProxy's under one clock tick at 590: too short a run for a ratio"]
    rows["haproxy-paced"]["lb_cpu_us_per_req"] = 45.0
    assert bench.paced_lines(rows)[0].endswith("2.00x HAProxy's 45.0 at 590, goal <= 2.0x: met")
