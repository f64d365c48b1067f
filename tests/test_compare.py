"""playback/compare.py: a tiny end-to-end run through the three balancers
prints a table of numbers without errors; the templates and the table are
right.  Which balancer wins is not asserted."""

import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from zc_lb import testing  # noqa: E402
from zc_lb.playback import compare  # noqa: E402

HAVE_HAPROXY = shutil.which("haproxy", path="/usr/sbin:/usr/bin")
NUMBER = r"(\d+(?:\.\d+)?)"


def write_log(path: Path, lines: int = 200, seed: int = 7) -> None:
    """A Common Log Format log over a few first-segment classes."""
    rng = random.Random(seed)
    sections = ["images", "shuttle", "history", "software", "icons"]
    with open(path, "w") as log:
        for i in range(lines):
            section = rng.choice(sections)
            log.write('client%d - - [01/Aug/1995:00:%02d:%02d -0400] "GET /%s/page%d.html HTTP/1.0" '
                      "200 %d\n" % (i % 7, i // 60, i % 60, section, rng.randrange(20), 100 + i))


def tiny_run(tmp_path, *options, timeout=60):
    """compare.py on a small log: two workers, 50 entries of warm-up and
    150 measured; its output, once it exited 0."""
    log = tmp_path / "access.log"
    write_log(log)
    done = subprocess.run(
        [sys.executable, str(ROOT / "playback" / "compare.py"), str(log), "--host-from-segment", "1",
         "-w", "2", "-c", "4", "-n", "150", "--warmup", "50", "--history", "10",
         "--log-dir", str(tmp_path / "run"), "--no-progress"] + list(options),
        capture_output=True, text=True, timeout=timeout, cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr + done.stdout
    return done.stdout


@pytest.mark.skipif(not HAVE_HAPROXY, reason="needs haproxy (apt-get install haproxy)")
def test_tiny_run_prints_three_rows_without_errors(tmp_path):
    out = tiny_run(tmp_path, "--cache-size", "20", "--miss-cost", "0.001")
    assert "50 warm-up + 150 measured (5 classes)" in out, out
    for name in compare.BALANCERS:
        row = re.search(r"^%s\s+%s\s+%s\s+%s\s+%s\s+%s%%\s+(\d+)\s+%s\s+%s\s+%s\s+%s%%$" % (
            re.escape(name), NUMBER, NUMBER, NUMBER, NUMBER, NUMBER, NUMBER, NUMBER, NUMBER,
            NUMBER), out, re.M)
        assert row, "no row for %s in:\n%s" % (name, out)
        throughput, p50, p99, loads, overlap, errors = row.groups()[:6]
        assert float(throughput) > 0 and float(p99) >= float(p50)
        assert float(loads) > 0, "the cache app's headers did not come through %s" % name
        assert errors == "0", out
    shares = re.search(r"^time each worker spent loading .*\n((?:  .*\n){3})", out, re.M)
    assert shares, out
    for line in shares.group(1).splitlines():  # two workers each, least to most
        low, high = (float(share) for share in re.findall(NUMBER + "%", line))
        assert 0 <= low <= high, line
    for name in compare.BALANCERS:  # the app servers' CPU time, no database
        cpu = re.search(r"^  %s\s+LB \d+  workers (\d+)  together \d+; "
                        r"the machine's CPUs \d+%% busy$" % re.escape(name), out, re.M)
        assert cpu and int(cpu.group(1)) > 0, out
    assert (tmp_path / "run" / "haproxy-hash.cfg").exists()
    assert (tmp_path / "run" / "zc-lb-lb.log").exists()


@pytest.mark.parametrize("name", ["leastconn", "hash"])
def test_haproxy_templates_fill_in(name):
    text = compare.haproxy_config(compare.HAPROXY_CONFIGS[name], "127.0.0.1:8080",
                                  ["127.0.0.1:9001", "127.0.0.1:9002"])
    assert "$" not in text
    assert "    bind 127.0.0.1:8080\n" in text
    assert "    server w1 127.0.0.1:9001\n    server w2 127.0.0.1:9002" in text
    assert ("balance leastconn" in text) == (name == "leastconn")
    if name == "hash":
        for line in ("balance hdr(host)", "hash-type consistent", "hash-balance-factor 125"):
            assert "    %s\n" % line in text


@pytest.mark.skipif(not HAVE_HAPROXY, reason="needs haproxy")
@pytest.mark.parametrize("name", ["leastconn", "hash"])
def test_haproxy_accepts_the_configs(name, tmp_path):
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(compare.haproxy_config(compare.HAPROXY_CONFIGS[name], "127.0.0.1:8080",
                                          ["127.0.0.1:9001"]))
    done = subprocess.run([HAVE_HAPROXY, "-c", "-f", str(cfg)], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.skipif(not HAVE_HAPROXY, reason="needs haproxy (apt-get install haproxy)")
def test_two_zc_lb_policies_in_one_run_on_a_mixed_fleet(tmp_path):
    log = tmp_path / "access.log"
    write_log(log)
    done = subprocess.run(
        [sys.executable, str(ROOT / "playback" / "compare.py"), str(log), "--host-from-segment", "1",
         "-w", "2", "-c", "4", "-n", "100", "--warmup", "50", "--cache-sizes", "10,30",
         "--speeds", "1,2",
         "--objects-per-request", "3", "--objects-per-class", "20", "--page-objects", "1",
         "--miss-cost", "0.001", "--history", "10", "--log-dir", str(tmp_path / "run"),
         "--balancers", "zc-lb:affinity,zc-lb:published,leastconn", "--no-progress"],
        capture_output=True, text=True, timeout=60, cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr + done.stdout
    for name in ("zc-lb:affinity", "zc-lb:published", "leastconn"):
        row = re.search(r"^%s\s+%s\s+%s\s+%s\s+%s" % (re.escape(name), NUMBER, NUMBER, NUMBER, NUMBER),
                        done.stdout, re.M)
        assert row, "no row for %s in:\n%s" % (name, done.stdout)
        assert float(row.group(4)) > 0
    floor = re.search(r"^floor .*: %s loads/request$" % NUMBER, done.stdout, re.M)
    assert floor and float(floor.group(1)) > 0  # (tiny LRUs: not always the least)
    assert "a mixed fleet: 10 objects and miss 1 ms, 30 objects and miss 0.5 ms" in done.stdout
    # each worker's loads timed at its own miss cost, found by its name
    loading = re.search(r"^time each worker spent loading .*\n((?:  .*\n){3})", done.stdout, re.M)
    assert loading and len(re.findall(NUMBER + "%", loading.group(1))) == 6, done.stdout
    for policy in ("affinity", "published"):  # each its own LB, logged apart
        assert (tmp_path / "run" / ("zc-lb-%s-lb.log" % policy)).exists()
    with pytest.raises(SystemExit):
        compare.main(["x.log", "--balancers", "zc-lb:roundrobin"])


def test_ratios_and_table():
    rows = [{"balancer": "zc-lb", "throughput": 200.0, "p50_ms": 1.0, "p99_ms": 9.0,
             "loads_per_request": 0.5, "overlap": 0.1, "errors": 0, "lb_cpu_us_per_request": 150.0,
             "steal": 0.042},
            {"balancer": "hash", "throughput": 100.0, "p50_ms": 2.0, "p99_ms": 20.0,
             "loads_per_request": 1.5, "overlap": None, "errors": 3, "lb_cpu_us_per_request": 50.0}]
    compare.add_ratios(rows)
    assert rows[0]["throughput_ratio"] == 1.0 and rows[1]["throughput_ratio"] == 0.5
    assert rows[1]["loads_ratio"] == 3.0
    lines = compare.format_table(rows).splitlines()
    assert len(lines) == 4
    assert lines[2].split() == ["zc-lb", "200.0", "1.0", "9.0", "0.500", "10.0%", "0",
                                "1.00", "1.00", "150", "4.2%"]
    assert lines[3].split()[5] == "-"  # unknown overlap
    assert lines[3].split()[-1] == "-"  # unknown steal


def test_cpu_a_response_took_is_said_by_part_and_together():
    cpu = {"lb": 0.5, "workers": 6.0, "database": 1.5}
    row = compare.cpu_row({"responses": 2000}, cpu, database=True)
    assert row == {"workers_cpu_us_per_request": 3000.0, "database_cpu_us_per_request": 750.0,
                   "cpu_us_per_request": 4000.0}
    row["lb_cpu_us_per_request"] = 250.0
    cache = dict(compare.cpu_row({"responses": 2000}, dict(cpu, database=0.0), database=False),
                 lb_cpu_us_per_request=250.0)
    assert cache["database_cpu_us_per_request"] is None and cache["cpu_us_per_request"] == 3250.0
    assert compare.cpu_row({"responses": 0}, cpu, database=True) == {}
    rows = [dict(row, balancer="zc-lb"), dict(cache, balancer="leastconn"),
            {"balancer": "hash"}]  # (no responses: no line)
    rows[0]["cpus_busy"] = 0.973
    assert compare.format_cpu(rows).splitlines() == [
        "CPU time a response took, in microseconds:",
        "  zc-lb      LB 250  workers 3000  database 750  together 4000; "
        "the machine's CPUs 97% busy",
        "  leastconn  LB 250  workers 3000  together 3250"]
    worst = compare.worst_of([dict(rows[0], throughput=1.0),
                              dict(rows[0], throughput=2.0, cpu_us_per_request=5000.0)])
    assert worst["cpu_us_per_request"] == 5000.0
    assert "(each the most of any run)" in compare.format_cpu([worst])


def test_a_servers_cpu_counts_the_processes_it_started():
    # (gunicorn's arbiter starts the worker that serves; the child here
    # computes, then waits)
    parent = subprocess.Popen(["sh", "-c", "(i=0; while [ $i -lt 200000 ]; do i=$((i+1)); done; "
                               "sleep 30) & sleep 30 & wait"])
    try:
        deadline = time.monotonic() + 20
        family = testing.with_children([parent.pid])
        while (len(family) < 3 or sum(testing.cpu_times(family[1:]).values()) < 0.05) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
            family = testing.with_children([parent.pid])
        assert family[0] == parent.pid and len(family) == 3
        assert sum(testing.cpu_times(family[1:]).values()) >= 0.05  # the children's own
    finally:
        subprocess.run(["pkill", "-P", str(parent.pid)])
        parent.kill()
        parent.wait()
    # (ended: not read; the pid is not reused so soon)
    assert parent.pid not in testing.cpu_times([parent.pid])


def test_cpu_used_is_never_less_than_nothing_when_a_process_ends_or_starts():
    before = {1: 10.0, 2: 5.0}
    after = {1: 12.5, 3: 0.75}  # (2 ended; 3 started and used 0.75 s)
    assert testing.cpu_used(before, after) == 2.5 + 0.75
    assert testing.cpu_used(before, {}) == 0.0


def test_steal_and_busy_are_shares_of_the_ticks_between_readings():
    assert compare.stolen((10, 300, 1000), (40, 400, 1600)) == 0.05
    assert compare.busy((10, 300, 1000), (40, 400, 1600)) == 1.0 - 130 / 600
    for share in (compare.stolen, compare.busy):
        assert share(None, (40, 400, 1600)) is None
        assert share((10, 300, 1000), (10, 300, 1000)) is None  # no time passed
    clock = compare.cpu_clock()
    if Path("/proc/stat").exists():
        assert clock is not None and 0 <= clock[0] <= clock[2] and 0 <= clock[1] <= clock[2]


def test_loading_is_each_workers_loads_times_the_miss_cost_over_the_replay():
    report = {"duration": 2.0, "worker_loads": {"a": 50, "b": 150}}
    assert compare.loading(report, {"a": 0.01, "b": 0.01}) == {"a": 0.25, "b": 0.75}
    assert compare.loading(report, {"a": 0.02, "b": 0.01}) == {"a": 0.5, "b": 0.75}
    assert compare.loading({"duration": 2.0}, {"a": 0.01}) == {}  # no cache headers came back
    rows = [{"balancer": "zc-lb", "loading": {"a": 0.75, "b": 0.25}},
            {"balancer": "leastconn", "loading": {}}]
    assert compare.format_loading(rows).splitlines()[1:] == ["  zc-lb       25%  75%"]
    assert compare.format_loading(rows[1:]) == ""


def test_the_floor_names_pages_as_the_workers_app_does():
    """The floor touches the objects the workers' app would: each query a
    page of its own by default, one page for them all with --page-key path
    (which the workers' app is told too)."""
    from zc_lb.playback.logparse import Entry

    entries = [Entry("GET", "/search?q=%d" % n, "a.example", 0.0, 200, "log:%d" % n, None)
               for n in range(8)]
    floors = {}
    for page_key in ("url", "path"):
        parser = compare.make_parser()
        args = parser.parse_args(["x.log", "--objects-per-request", "3", "--objects-per-class",
                                  "20", "--page-objects", "1", "--page-key", page_key])
        compare.check_args(parser, args)
        assert compare.app_env(args)["ZC_LB_CACHEAPP_PAGE_KEY"] == page_key
        floors[page_key] = compare.floor_loads(entries[:2], entries[2:], args)
    assert floors["path"] == 0.0  # (the warm-up loaded the one page and its objects)
    assert floors["url"] >= 1.0  # (a page a query, each loaded once)


def test_the_header_names_the_lbs_options_only_when_there_are_some():
    """The cache app's line ends with the workers' settings; "; LB" and
    the --zc-lb-option values follow only when some were given (a bare
    "; LB" said nothing)."""
    parser = compare.make_parser()
    counts = {"warmup": 1, "measured": 1, "classes": 1}
    header = compare.format_header(parser.parse_args(["x.log"]), {"entries": 2}, counts)
    assert header.splitlines()[1].endswith("zc-lb workers (threads) --history 100")
    args = parser.parse_args(["x.log", "--zc-lb-option=--variance=4"])
    header = compare.format_header(args, {"entries": 2}, counts)
    assert header.splitlines()[1].endswith("--history 100; LB --variance=4")


def test_a_mixed_fleet_gives_each_worker_its_entry_of_the_lists_counted_round():
    """--cache-sizes and --speeds: worker i takes entry i of each list,
    counted round, behind every balancer; the floor caches what they
    cache together."""
    from zc_lb.playback.logparse import Entry

    parser = compare.make_parser()
    args = parser.parse_args(["x.log", "-w", "4", "--miss-cost", "0.010", "--cache-sizes",
                              "150,450", "--speeds", "1,1,2,2", "--objects-per-request", "1",
                              "--objects-per-class", "1000"])
    compare.check_args(parser, args)
    fleet = [(compare.app_env(args, n)["ZC_LB_CACHEAPP_CACHE_SIZE"],
              float(compare.app_env(args, n)["ZC_LB_CACHEAPP_MISS_COST"])) for n in range(1, 5)]
    assert fleet == [("150", 0.010), ("450", 0.010), ("150", 0.005), ("450", 0.005)]
    argv = compare.app_argv(args, 4)
    assert argv[argv.index("--cache-size") + 1] == "450"
    assert float(argv[argv.index("--miss-cost") + 1]) == 0.005
    assert compare.miss_costs(args, ["l1", "l2", "l3", "l4"]) == {
        "l1": 0.010, "l2": 0.010, "l3": 0.005, "l4": 0.005}
    # 1,200 objects of one class, touched once and then again: the four
    # caches hold all of them together (150 + 450 + 150 + 450), no one alone
    entries = [Entry("GET", "/p%d" % (n % 1200), "a.example", 0.0, 200, "log:%d" % n, None)
               for n in range(2400)]
    assert compare.floor_loads(entries[:1200], entries[1200:], args) == 0.0
    header = compare.format_header(args, {"entries": 2400}, {
        "warmup": 1200, "measured": 1200, "classes": 1})
    assert "a mixed fleet: 150 objects and miss 10 ms, 450 objects and miss 10 ms, " \
        "150 objects and miss 5 ms, 450 objects and miss 5 ms" in header


@pytest.mark.parametrize("option, value, said", [
    ("--cache-sizes", "150,x", "not a list of numbers"),
    ("--cache-sizes", "1.5", "not a list of numbers"),
    ("--speeds", "1,0", "want positive numbers"),
    ("--speeds", "nan", "want positive numbers"),
    ("--speeds", ",", "want positive numbers"),
])
def test_a_bad_fleet_list_is_refused_by_name(option, value, said, capsys):
    with pytest.raises(SystemExit):
        compare.main(["x.log", option, value])
    err = capsys.readouterr().err
    assert option in err and said in err, err


def test_a_mixed_fleet_is_the_cache_apps_only(capsys):
    with pytest.raises(SystemExit):
        compare.main(["x.log", "--app", "zodb", "--speeds", "1,2"])
    assert "not --app zodb" in capsys.readouterr().err


def test_ratios_without_zc_lb_are_unknown():
    rows = [{"balancer": "hash", "throughput": 100.0, "loads_per_request": 1.0}]
    compare.add_ratios(rows)
    assert rows[0]["throughput_ratio"] is None and rows[0]["loads_ratio"] is None


def test_bad_balancer_name_is_refused(capsys):
    with pytest.raises(SystemExit):
        compare.main(["x.log", "--balancers", "nginx"])
    assert "--balancers" in capsys.readouterr().err


def test_each_workers_requests_over_a_fair_share_count_an_idle_worker_as_none():
    report = {"workers": {"a": 300, "b": 100}}
    assert compare.served_shares(report, 2) == [0.5, 1.5]
    assert compare.served_shares(report, 4) == [0.0, 0.0, 1.0, 3.0]  # two served nothing
    assert compare.served_shares({"workers": {}}, 2) == []
    rows = [{"balancer": "zc-lb", "report": report}, {"balancer": "hash", "report": {}}]
    assert compare.format_served(rows, 2).splitlines()[1:] == ["  zc-lb  0.50 1.50"]


@pytest.mark.skipif(not HAVE_HAPROXY, reason="needs haproxy (apt-get install haproxy)")
def test_the_zodb_case_runs_each_balancer_on_its_own_zeo_server(tmp_path):
    # A page per path in a ZEO server's database, zc-lb's default workers
    # and gunicorn's threads in front of it; loads counted by the server.
    out = tiny_run(tmp_path, "--app", "zodb", "--balancers", "zc-lb,leastconn", timeout=120)
    assert "ZODB app on ZEO: a page and 10 parts per path" in out, out
    assert "gunicorn -k gthread --threads 16" in out
    for name in ("zc-lb", "leastconn"):
        row = re.search(r"^%s\s+%s\s+%s\s+%s\s+%s\s+-\s+(\d+)" % (
            re.escape(name), NUMBER, NUMBER, NUMBER, NUMBER), out, re.M)
        assert row, "no row for %s in:\n%s" % (name, out)
        loads, errors = float(row.group(4)), row.group(5)
        # (the measured pages were read in the warm-up, some evicted since)
        assert 0 < loads < 11, out
        assert errors == "0", out
    for name in ("zc-lb", "leastconn"):  # the database's CPU time beside the LB's and workers'
        cpu = re.search(r"^  %s\s+LB (\d+)  workers (\d+)  database (\d+)  together (\d+); "
                        r"the machine's CPUs \d+%% busy$" % re.escape(name), out, re.M)
        assert cpu, out
        lb, workers, database, together = (int(n) for n in cpu.groups())
        assert workers > 0 and database > 0 and abs(lb + workers + database - together) <= 2
    assert (tmp_path / "run" / "zeo-zc-lb.log").exists()
    assert not list((tmp_path / "run").glob("*.fs*"))  # (the logs kept, the databases not)
    assert "floor" not in out  # (the cache model's; none for a real database)


def test_a_page_path_is_the_targets_path_as_a_wsgi_server_decodes_it():
    assert compare.page_path("/a%20b/c?x=1") == "/a b/c"
    assert compare.page_path("/caf%C3%A9") == "/caf\xc3\xa9"  # (PEP 3333: bytes as latin-1)


def test_a_zc_lb_row_keeps_what_the_affinity_pool_did():
    report = {"requests": 1, "responses": 1, "throughput": 1.0, "errors": 0, "status": {"200": 1},
              "latency": {"p50": 0.001, "p99": 0.002}}
    status = {"requests": 1, "retries": 0, "errors": {},
              "pool": {"widenings": 2, "spills": 5, "locality_gain": 12.5,
                       "first_visit_gain": 1.1, "variance": 2.0}}
    row = compare.result_row("zc-lb", report, 0.0, [status])
    assert row["lb_status"]["routing"] == {"widenings": 2, "spills": 5, "locality_gain": 12.5,
                                           "first_visit_gain": 1.1}
    # (the published pool counts none of them)
    status["pool"] = {"variance": 2.0}
    assert compare.result_row("zc-lb", report, 0.0, [status])["lb_status"]["routing"] == {}
    assert "lb_status" not in compare.result_row("leastconn", report, 0.0, [])
    # Several LBs: their counts summed, and each one's kept.
    other = dict(status, requests=4, retries=2, pool={"spills": 1})
    several = compare.result_row("zc-lb", report, 0.0, [status, other])["lb_status"]
    assert (several["requests"], several["retries"]) == (5, 2)
    assert [lb["routing"] for lb in several["each"]] == [{}, {"spills": 1}]


@pytest.mark.skipif(not HAVE_HAPROXY, reason="needs haproxy (apt-get install haproxy)")
def test_several_lbs_take_turns_and_zc_lbs_find_each_other_in_zookeeper(tmp_path):
    # --lbs 2 without --zookeeper: compare starts a ZooKeeper in the run
    # directory; two zc-lb LBs find the workers and each other there, and
    # relay keys; two HAProxies balance alone, as do two LBs of the
    # published policy, which counts no LBs.  The clients take turns.
    import json

    out = tiny_run(tmp_path, "--lbs", "2", "--balancers", "zc-lb,zc-lb:published,leastconn",
                   "--json", "--cache-size", "20", "--miss-cost", "0.001", timeout=120)
    result = json.loads(out)
    assert result["settings"]["lbs"] == 2
    zc_lb, published, leastconn = result["results"]
    assert zc_lb["errors"] == published["errors"] == leastconn["errors"] == 0
    assert len(published["lb_status"]["each"]) == 2
    each = zc_lb["lb_status"]["each"]
    assert len(each) == 2 and all(lb["requests"] > 0 for lb in each), each
    assert zc_lb["lb_status"]["requests"] >= 150
    assert zc_lb["backlogs"]["failures"] == 0 and "backlogs" not in leastconn
    run = tmp_path / "run"
    for n in (1, 2):
        assert "keys are relayed between the LBs" in (run / ("zc-lb-lb%d.log" % n)).read_text()
        assert (run / ("haproxy-leastconn%d.cfg" % n)).exists()
    assert (run / "zookeeper" / "zoo.cfg").exists()


def test_a_zookeeper_that_cannot_start_is_said_and_nothing_is_left_running(
        tmp_path, monkeypatch, capsys):
    log = tmp_path / "access.log"
    write_log(log, lines=20)
    monkeypatch.setenv("ZOOKEEPER_CLASSPATH", str(tmp_path / "no-such.jar"))
    assert compare.main([str(log), "--host-from-segment", "1", "-n", "10", "--warmup", "0",
                         "--lbs", "2", "--balancers", "zc-lb", "--log-dir",
                         str(tmp_path / "run"), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "ZooKeeper did not serve" in err and str(tmp_path / "run") in err, err
    assert not list((tmp_path / "run").glob("zc-lb-*.log"))  # (no worker was started)


def test_each_balancers_zookeeper_tree_is_its_own_and_removed_after(zk_hosts):
    from kazoo.client import KazooClient

    client = KazooClient(zk_hosts)
    client.start(timeout=10)
    try:
        with compare.zookeeper_site(zk_hosts) as first, compare.zookeeper_site(zk_hosts) as second:
            assert first != second and first.startswith(zk_hosts + "/zc-lb-compare/")
            for site in (first, second):
                chroot = site[len(zk_hosts):]
                assert sorted(client.get_children(chroot + "/lb")) == sorted(["providers", "workers"])
                assert client.exists(chroot + "/lb/workers/providers")
        assert client.get_children("/zc-lb-compare") == []
    finally:
        client.stop()
        client.close()
    with pytest.raises(compare.CompareError, match="did not answer"):
        with compare.zookeeper_site("127.0.0.1:%d" % compare.free_port(), timeout=1):
            pass
    with pytest.raises(compare.CompareError, match="--zookeeper '127.0.0.1:x'"):
        with compare.zookeeper_site("127.0.0.1:x"):
            pass


def test_several_runs_are_reported_by_the_worst_of_each_column():
    runs = [{"balancer": "zc-lb", "throughput": 3000.0, "p50_ms": 2.0, "p99_ms": 80.0,
             "loads_per_request": 0.087, "errors": 0, "report": "first",
             "cpu_us_per_request": 520.4},
            {"balancer": "zc-lb", "throughput": 2800.0, "p50_ms": 3.0, "p99_ms": 50.0,
             "loads_per_request": 0.098, "errors": 1, "report": "second",
             "cpu_us_per_request": 560.0},
            {"balancer": "zc-lb", "throughput": 3300.0, "p50_ms": 1.0, "p99_ms": 55.0,
             "loads_per_request": 0.090, "errors": 0, "report": "third"}]
    worst = compare.worst_of(runs)
    assert (worst["throughput"], worst["p50_ms"], worst["p99_ms"], worst["loads_per_request"],
            worst["errors"]) == (2800.0, 3.0, 80.0, 0.098, 1)
    assert worst["report"] == "second" and worst["runs"] == runs  # (the run that loaded most)
    assert compare.worst_of(runs[:1]) is runs[0]
    lines = compare.format_runs([worst]).splitlines()
    assert lines[1].split() == ["zc-lb", "3000", "80.0", "0.087", "520", "2800", "50.0", "0.098",
                                "560", "3300", "55.0", "0.090", "-"]
    assert compare.format_runs(runs[:1]) == ""  # (one run: the table says it all)
    # a run in which no request was answered has no p99: its line says "-"
    # (it raised TypeError, after every run, and lost the whole comparison)
    broken = dict(runs[1], throughput=0.0, p99_ms=None, loads_per_request=None)
    assert compare.format_runs([dict(worst, runs=[runs[0], broken])]).splitlines()[1].split()[5:] \
        == ["0", "-", "-", "560"]
    with pytest.raises(SystemExit):
        compare.main(["x.log", "--runs", "0"])
    with pytest.raises(SystemExit):
        compare.main(["x.log", "--lbs", "0"])


def test_a_worker_idle_while_another_has_requests_waiting_is_counted():
    from zc_lb.playback.backlogs import BacklogSampler

    sampler = BacklogSampler([], concurrency=1)
    sampler.samples = [
        {"a": 0, "b": 2, "c": 1},  # idle: "a" has none, "b" one waiting
        {"a": 0, "b": 1, "c": 1},  # not: nothing waits at an app of one
        {"a": 1, "b": 3, "c": 2},  # not: no one idle
        {"a": 0, "b": 0, "c": 0},
    ]
    summary = sampler.summary()
    assert summary["samples"] == 4 and summary["idle"] == 0.25
    # Busy: samples with a request in flight, over the mean (1, 3, 3 of 4).
    assert summary["busy"] == pytest.approx({"a": 3 / 7, "b": 9 / 7, "c": 9 / 7})
    # An app that serves two at once: two in flight is no wait; one with
    # no bound keeps none waiting.
    sampler.serves = 2
    assert sampler.summary()["idle"] == 0.0
    sampler.serves = 0
    assert sampler.summary()["idle"] is None and sampler.summary()["samples"] == 4
    assert BacklogSampler([], concurrency=1).summary() == {
        "samples": 0, "idle": None, "busy": {}, "failures": 0}


def test_idle_is_measured_against_the_apps_bound_where_the_tool_knows_it():
    args = compare.make_parser().parse_args(["log", "--worker-concurrency", "4"])
    assert compare.app_bound(args) == 4
    args = compare.make_parser().parse_args(["log", "--app", "zodb"])
    assert compare.app_bound(args) == 0  # (the ZODB app's threads wait on the database)


def test_classes_by_section_reach_the_log_reader():
    args = compare.make_parser().parse_args(["log", "--host-from-segment", "1"])
    assert args.host_depth == 1
    args = compare.make_parser().parse_args(
        ["log", "--host-from-segment", "1", "--host-depth", "2"])
    assert args.host_depth == 2
    with pytest.raises(SystemExit):
        compare.make_parser().parse_args(["log", "--host-depth", "x"])
    with pytest.raises(SystemExit):  # (a depth of nothing)
        compare.main(["log", "--host-depth", "2"])


def test_how_busy_each_run_was_is_a_line_a_run():
    backlogs = {"samples": 40, "idle": 0.5, "busy": {"a": 1.2, "b": 0.8}, "failures": 0}
    runs = [{"balancer": "zc-lb", "backlogs": backlogs},
            {"balancer": "zc-lb", "backlogs": dict(backlogs, idle=None, failures=2)},
            {"balancer": "zc-lb", "backlogs": {"samples": 0, "idle": None, "busy": {},
                                                "failures": 7}}]
    rows = [dict(runs[0], runs=runs), {"balancer": "leastconn"}]
    lines = compare.format_busy(rows).splitlines()[1:]
    assert lines == ["  zc-lb      idle 50.0% of 40 samples; busy 0.80 1.20",
                     "  zc-lb      idle - of 40 samples; busy 0.80 1.20; 2 status reads failed",
                     "  zc-lb      no samples (7 status reads failed)"]
    assert compare.format_busy([{"balancer": "leastconn"}]) == ""


def test_backlogs_are_summed_over_the_lbs_and_a_status_that_fails_is_counted():
    import http.server
    import json
    import threading

    from zc_lb.playback.backlogs import BacklogSampler

    class Status(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            workers = {w: {"backlog": n, "in_pool": True} for w, n in self.server.backlogs.items()}
            workers["w3"] = {"backlog": 0, "in_pool": False}  # (down: not idle)
            body = json.dumps({"workers": workers})
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args):
            pass

    servers = []
    for backlogs in ({"w1": 0, "w2": 1}, {"w1": 0, "w2": 1}):
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Status)
        server.backlogs = backlogs
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    statuses = ["127.0.0.1:%d" % server.server_address[1] for server in servers]
    with BacklogSampler(statuses, concurrency=1, interval=0.01) as sampler:
        deadline = time.monotonic() + 5.0
        while len(sampler.samples) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    summary = sampler.summary()
    assert summary["samples"] >= 3 and summary["failures"] == 0
    assert summary["idle"] == 1.0  # w2: one from each LB, so one waiting
    assert summary["busy"]["w1"] == 0.0 and "w3" not in summary["busy"]
    servers[1].shutdown()
    servers[1].server_close()
    with BacklogSampler(statuses, concurrency=1, interval=0.01) as sampler:
        deadline = time.monotonic() + 5.0
        while not sampler.failures and time.monotonic() < deadline:
            time.sleep(0.01)
    assert sampler.failures and not sampler.samples  # (a sample of half the LBs is none)
    servers[0].shutdown()
