"""playback/: log parsing, pacing, the cache model, and replays against a
real gevent.pywsgi server on loopback (fixtures in tests/data/playback_*)."""

import io
import json
import os
import shutil
import sys
import time
from contextlib import redirect_stdout
from pathlib import Path

import gevent
import gevent.subprocess
import pytest
from gevent.pywsgi import WSGIServer

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from zc_lb.playback import cacheapp  # noqa: E402
from zc_lb.playback.httpclient import Connection, HTTPError  # noqa: E402
from zc_lb.playback.logparse import (  # noqa: E402
    Entry, LogReader, encode_target, host_from_segment, parse_clf_time, read_entries)
from zc_lb.playback.pacing import Pacer  # noqa: E402
from zc_lb.playback.replay import cache_overlap, main, replay, reset_caches  # noqa: E402
from zc_lb.playback.report import Recorder, format_text  # noqa: E402

DATA = Path(__file__).resolve().parent / "data"
COMMON = str(DATA / "playback_common.log")
COMBINED = str(DATA / "playback_combined.log")
VHOST = str(DATA / "playback_vhost.log")
NGINX = str(DATA / "playback_nginx.log")


# -- parsing ------------------------------------------------------------------


def test_common_format_with_nasa_quirks():
    entries, stats = read_entries([COMMON], fmt="common")
    paths = [e.path for e in entries]
    assert stats.lines == 12
    assert paths == [
        "/shuttle/missions/sts-68/news/sts-68-mcc-05.txt",
        "/",
        "/images/ksclogo-medium.gif",
        "/history/apollo/apollo-13/apollo-13-patch-small.gif",  # no HTTP version
        "/shuttle/missions/sts-missions-flown.txt",  # extra spaces before HTTP/1.0
        "/sts-71/launch/",  # no version, size '-'
        "/ksc.html",  # HTTP/V1.0
        "/images/NASA-logosmall.gif",  # HEAD
        "/cgi-bin/imagemap/countdown?107,144",  # query kept
    ]
    assert entries[7].method == "HEAD"
    assert entries[5].status == 404
    assert entries[0].time == parse_clf_time("01/Aug/1995:04:00:01 +0000")
    assert all(e.host is None for e in entries)
    assert stats.skipped_methods == {"POST": 1}
    assert stats.unparsable == 2  # the garbled line and the '-' request
    assert len(stats.examples) == 2
    assert "no format matches" in stats.examples[0] and ":10:" in stats.examples[0]
    assert "bad request line" in stats.examples[1]


def test_combined_format_and_a_cut_off_agent():
    strict, strict_stats = read_entries([COMBINED], fmt="combined", methods=["GET", "HEAD", "OPTIONS"])
    assert strict_stats.unparsable == 1 and "bot.html" in strict_stats.examples[0]
    assert [e.path for e in strict][-1] == "/robots.txt"
    assert "*" in [e.path for e in strict]
    auto, auto_stats = read_entries([COMBINED])  # auto tolerates the cut-off agent
    assert auto_stats.unparsable == 0
    assert auto_stats.skipped_methods == {"OPTIONS": 1}
    assert "/scripts/grok-py-test/configlib.py" in [e.path for e in auto]
    assert auto[4].path == "/blog/tags/puppet?flav=rss20"


def test_vhost_combined_takes_the_host_from_the_log():
    entries, stats = read_entries([VHOST], fmt="vhost_combined")
    assert stats.unparsable == 0
    assert [e.host for e in entries] == ["www.example.com", "shop.example.org", None]
    assert entries[1].path == "/cart?id=7"
    auto, _ = read_entries([VHOST])
    assert [e.host for e in auto] == [e.host for e in entries]


def test_nginx_default_and_main_formats():
    entries, stats = read_entries([NGINX], fmt="nginx")
    assert [e.path for e in entries] == [
        "/api/v1/items?page=2", "/static/app.js", "/search?q=caf%C3%A9%20au%20lait"]
    assert stats.unparsable == 1 and "bad request line" in stats.examples[0]
    assert entries[0].time == parse_clf_time("02/Jan/2024:07:15:42 +0000")


def test_custom_regex_with_time_format(tmp_path):
    log = tmp_path / "custom.log"
    log.write_text(
        "2024-01-02 08:00:00 shop.example GET /a?x=1 200\n"
        "2024-01-02 08:00:01 blog.example HEAD /b 404\n"
        "not a line\n")
    pattern = r"(?P<time>\S+ \S+) (?P<host>\S+) (?P<method>\S+) (?P<path>\S+) (?P<status>\d+)"
    entries, stats = read_entries([str(log)], regex=pattern, time_format="%Y-%m-%d %H:%M:%S")
    assert [(e.method, e.host, e.path, e.status) for e in entries] == [
        ("GET", "shop.example", "/a?x=1", 200), ("HEAD", "blog.example", "/b", 404)]
    assert entries[1].time - entries[0].time == 1.0
    assert stats.unparsable == 1
    with pytest.raises(ValueError):
        LogReader([str(log)], regex=r"(?P<nothing>.*)")


def test_host_from_segment_rule():
    assert host_from_segment("/shuttle/missions/x.html", 1) == "shuttle.example"
    assert host_from_segment("/shuttle/missions/x.html", 2) == "missions.example"
    assert host_from_segment("/ksc.html?a=b/c", 1) == "ksc-html.example"
    assert host_from_segment("/", 1) == "root.example"
    assert host_from_segment("/a", 2, ".test") == "root.test"
    assert host_from_segment("/Some_Dir/", 1) == "some-dir.example"


def test_host_from_segment_to_a_depth_takes_the_directories_only():
    assert host_from_segment("/shuttle/missions/x.html", 1, depth=2) == "shuttle-missions.example"
    assert host_from_segment("/shuttle/missions/", 1, depth=2) == "shuttle-missions.example"
    assert host_from_segment("/images/x.gif", 1, depth=2) == "images.example"  # (a file)
    assert host_from_segment("/a/b/c/d.html?q=/e/f", 1, depth=3) == "a-b-c.example"
    assert host_from_segment("/a/b/c/d.html", 2, depth=2) == "b-c.example"
    assert host_from_segment("/ksc.html", 1, depth=2) == "ksc-html.example"
    assert host_from_segment("/", 1, depth=2) == "root.example"
    entries, _ = read_entries([COMMON], segment=1, depth=2)
    assert [e.host for e in entries[:4]] == ["shuttle-missions.example", "root.example",
                                             "images.example", "history-apollo.example"]


def test_host_depth_must_be_a_whole_number_of_one_or_more(capsys):
    with pytest.raises(SystemExit) as exc:
        main([COMMON, "--target", "http://127.0.0.1:1", "--host-from-segment", "1",
              "--host-depth", "0"])
    assert exc.value.code == 2
    assert "--host-depth: '0' is not a whole number of 1 or more" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # (a depth of nothing)
        main([COMMON, "--target", "http://127.0.0.1:1", "--host-depth", "2"])
    assert exc.value.code == 2
    assert "--host-depth needs --host-from-segment" in capsys.readouterr().err


def test_host_precedence():
    by_segment, _ = read_entries([VHOST], segment=1, host="fixed.example")
    assert [e.host for e in by_segment] == ["apache-pb-gif.example", "cart.example", "nohost.example"]
    fixed, _ = read_entries([VHOST], host="fixed.example")
    assert {e.host for e in fixed} == {"fixed.example"}


def test_encode_target():
    assert encode_target("/a b") == "/a%20b"
    assert encode_target("/caf\\xc3\\xa9") == "/caf%C3%A9"
    assert encode_target('/x"<y>') == "/x%22%3Cy%3E"
    assert encode_target("/ok/%20?a=1&b=2") == "/ok/%20?a=1&b=2"
    # the log's own escapes of a quote and a backslash are undone too, in one
    # pass: an escaped backslash before "x41" is no byte 0x41
    assert encode_target('/x\\"y') == "/x%22y"
    assert encode_target("/a\\\\b") == "/a%5Cb"
    assert encode_target("/a\\\\x41") == "/a%5Cx41"


def test_clf_time():
    assert parse_clf_time("01/Jan/1970:00:00:00 +0000") == 0.0
    assert parse_clf_time("01/Jan/1970:01:00:00 +0100") == 0.0
    assert parse_clf_time("01/Jan/1970:00:00:00 -0400") == 4 * 3600.0
    assert parse_clf_time("32/Foo/1970:00:00:00 +0000") is None
    assert parse_clf_time("01/Aug/99999999999999999999:00:00:01 -0400") is None  # (overflow)


def line(time_text="01/Aug/1995:00:00:01 -0400", path="/a/b", extra=""):
    return '1.2.3.4 - - [%s] "GET %s HTTP/1.0" 200 10 "-" "ua"%s' % (time_text, path, extra)


@pytest.mark.parametrize("text", ["01/Aug/99999999999999999999:00:00:01 -0400",
                                  "inf", "nan", "1e400", "-inf"])
def test_a_garbled_or_endless_time_is_a_bad_time(text):
    # A year of twenty digits raised OverflowError out of every tool; "inf"
    # put a paced replay's clock past its end, which stopped it silently.
    reader = LogReader([])
    entry = reader.parse_line(line(text), "x:1")
    assert entry is not None and entry.time is None and reader.stats.bad_times == 1


@pytest.mark.parametrize("pair", ['host="evil\\x0d\\x0aX-Injected: 1"',
                                  'host="a.example" class="c\\x0d\\x0aX-Injected: 1"'])
def test_a_logged_host_or_class_that_is_no_name_is_a_bad_line(pair):
    # Sent as the replayed request's Host, a CR LF in it was another header.
    reader = LogReader([])
    assert reader.parse_line(line(extra=" " + pair), "x:1") is None
    assert reader.stats.unparsable == 1


def test_a_bad_lines_example_shows_no_control_character(tmp_path):
    # The examples are printed as they are: a garbled or hostile log's escape
    # sequences reached the operator's terminal.
    path = tmp_path / "hostile.log"
    path.write_bytes(b"\x1b]0;owned\x07\x1b[2J garbage \x00\x85\n")
    reader = LogReader([str(path)])
    assert list(reader) == []
    assert reader.stats.unparsable == 1
    assert reader.stats.examples == [
        "%s:1: no format matches: \\x1b]0;owned\\x07\\x1b[2J garbage \\x00\\x85" % path]


def test_a_status_of_other_digits_than_ascii_is_none():
    # (read as latin-1, bytes B2 B3 B9 are digits to isdigit, not to int)
    entry = LogReader([], regex=r"(?P<path>\S+) (?P<status>\S+)").parse_line("/a \xb2\xb3\xb9")
    assert entry is not None and entry.status is None


def test_a_compressed_log_cut_short_is_an_oserror_naming_it(tmp_path):
    import gzip

    data = gzip.compress("".join(line(path="/p%d" % i) + "\n" for i in range(4000)).encode())
    path = tmp_path / "cut.log.gz"
    path.write_bytes(data[:len(data) // 2])  # (a log still being copied)
    with pytest.raises(OSError, match="cut.log.gz is cut short or corrupt after"):
        read_entries([str(path)])
    assert main([str(path), "--target", "http://127.0.0.1:1", "--timeout", "1"]) == 2


@pytest.mark.parametrize("argv", [["--regex", "(?P<path>"], ["--host-from-segment", "0"],
                                  ["--host-from-segment", "-1"], ["-c", "0"],
                                  ["--speed", "-1"], ["--speed", "inf"]])
def test_bad_replay_options_are_refused_with_exit_2(argv, capsys):
    try:
        code = main([COMMON, "--target", "http://127.0.0.1:1"] + argv)
    except SystemExit as exc:  # (argparse's refusals)
        code = exc.code
    assert code == 2
    assert "Traceback" not in capsys.readouterr().err


# -- pacing -------------------------------------------------------------------


def test_pacing_tolerates_small_backward_steps():
    pacer = Pacer(speed=2.0, tolerance=60.0)
    offsets = [pacer.offset(t) for t in (100.0, 110.0, 80.0, 51.0, 120.0, None)]
    assert offsets == [0.0, 5.0, 5.0, 5.0, 10.0, 10.0]
    assert pacer.backward_steps == 2 and pacer.resets == 0


def test_pacing_resets_on_a_large_backward_step_and_caps_gaps():
    pacer = Pacer(speed=1.0, tolerance=10.0, max_gap=5.0)
    offsets = [pacer.offset(t) for t in (1000.0, 1002.0, 500.0, 501.0, 9999.0)]
    assert offsets == [0.0, 2.0, 2.0, 3.0, 8.0]
    assert pacer.resets == 1
    with pytest.raises(ValueError):
        Pacer(speed=0)


# -- the cache model ----------------------------------------------------------


def test_objects_are_deterministic_and_disjoint_between_classes():
    a = cacheapp.objects_for("a.example", "/x", 10, 100)
    assert a == cacheapp.objects_for("a.example", "/x", 10, 100)
    assert len(set(a)) == 10
    assert a != cacheapp.objects_for("a.example", "/y", 10, 100)
    b = cacheapp.objects_for("b.example", "/x", 10, 100)
    assert not set(a) & set(b)
    skewed = cacheapp.objects_for("a.example", "/x", 10, 100, skew=2.0)
    assert 0 < len(set(skewed)) <= 10


def test_cache_model_lru():
    model = cacheapp.CacheModel(3)
    assert model.touch(["a", "b", "c"]) == (0, 3)
    assert model.touch(["a", "d"]) == (1, 1)  # d evicts b, the least recently used
    assert model.touch(["b"]) == (0, 1)
    assert list(model.cache) == ["a", "d", "b"]
    assert (model.requests, model.hits, model.misses) == (3, 1, 5)


def test_page_objects_are_a_urls_own():
    app = cacheapp.app_from_environment({
        "ZC_LB_CACHEAPP_MISS_COST": "0", "ZC_LB_CACHEAPP_OBJECTS_PER_REQUEST": "3",
        "ZC_LB_CACHEAPP_OBJECTS_PER_CLASS": "20", "ZC_LB_CACHEAPP_PAGE_OBJECTS": "1"})

    def get(path):
        environ = {"REQUEST_METHOD": "GET", "PATH_INFO": path, "HTTP_HOST": "a.example"}
        app(environ, lambda status, headers: None)
    get("/x")
    get("/y")
    pages = [o for o in app.model.cache if "|" in o]
    assert pages == ["a.example|/x|0", "a.example|/y|0"]
    assert len(app.model.cache) <= 2 + 6 and app.model.misses >= 2


@pytest.mark.parametrize("page_key, pages", [
    ("url", ["a.example|/s?q=1|0", "a.example|/s?q=2|0"]),
    ("path", ["a.example|/s|0"]),
])
def test_a_page_is_named_by_its_url_or_by_its_path_alone(page_key, pages):
    """By default each query is a page of its own; with page_key "path"
    the query names nothing the app caches, as the ZODB app's pages."""
    app = cacheapp.app_from_environment({
        "ZC_LB_CACHEAPP_MISS_COST": "0", "ZC_LB_CACHEAPP_OBJECTS_PER_REQUEST": "3",
        "ZC_LB_CACHEAPP_OBJECTS_PER_CLASS": "20", "ZC_LB_CACHEAPP_PAGE_OBJECTS": "1",
        "ZC_LB_CACHEAPP_PAGE_KEY": page_key})
    misses = []
    for query in ("q=1", "q=2"):
        environ = {"REQUEST_METHOD": "GET", "PATH_INFO": "/s", "QUERY_STRING": query,
                   "HTTP_HOST": "a.example"}
        app(environ, lambda status, headers: misses.append(dict(headers)["X-Cache-Misses"]))
    assert [o for o in app.model.cache if "|" in o] == pages
    assert misses[0] == "4" and (misses[1] == "0") == (page_key == "path")
    assert cacheapp.page_name("/s?q=1", page_key) == pages[0].split("|")[1]


def test_an_unknown_page_key_is_refused():
    with pytest.raises(ValueError, match="page_key must be one of url, path"):
        cacheapp.make_app(page_key="query")


def test_request_class():
    assert cacheapp.request_class({"HTTP_HOST": "WWW.Shop.Example:8080"}) == "shop.example"
    assert cacheapp.request_class({"HTTP_HOST": "x", "zc_lb.request_class": "c1"}) == "c1"
    assert cacheapp.request_class({"SERVER_NAME": "srv"}) == "srv"


def test_app_from_environment():
    app = cacheapp.app_from_environment({
        "ZC_LB_CACHEAPP_CACHE_SIZE": "7", "ZC_LB_CACHEAPP_WORKER_ID": "w9",
        "ZC_LB_CACHEAPP_MISS_COST": "0"})
    assert app.model.cache_size == 7
    assert app.stats()["worker"] == "w9"


@pytest.mark.parametrize("concurrency, serial", [(1, True), (0, False)])
def test_concurrency_bounds_the_requests_served_at_once(concurrency, serial):
    """With concurrency 1 a process's loads are its own time: two requests
    that miss take two loads' time; unbounded, they overlap."""
    app = cacheapp.app_from_environment({
        "ZC_LB_CACHEAPP_MISS_COST": "0.2", "ZC_LB_CACHEAPP_OBJECTS_PER_REQUEST": "1",
        "ZC_LB_CACHEAPP_CONCURRENCY": str(concurrency)})
    environs = [{"PATH_INFO": "/%d" % n, "REQUEST_METHOD": "GET", "HTTP_HOST": "a"}
                for n in range(2)]
    start = time.monotonic()
    with gevent.Timeout(10):
        gevent.joinall([gevent.spawn(app, env, lambda *a: None) for env in environs], raise_error=True)
    elapsed = time.monotonic() - start
    assert app.model.misses == 2
    assert (elapsed >= 0.4) if serial else (elapsed < 0.39)


def test_concurrency_must_not_be_negative():
    with pytest.raises(ValueError, match="concurrency"):
        cacheapp.make_app(concurrency=-1)


def test_side_stats_server():
    app = cacheapp.app_from_environment({
        "ZC_LB_CACHEAPP_WORKER_ID": "side", "ZC_LB_CACHEAPP_STATS_LISTEN": "127.0.0.1:0"})
    server = app.stats_server
    try:
        with gevent.Timeout(10):
            result = cache_overlap(["http://127.0.0.1:%d%s" % (server.server_port, cacheapp.STATS_PATH),
                                    "http://127.0.0.1:%d/elsewhere" % server.server_port])
    finally:
        server.stop(timeout=1)
    assert list(result["per_worker"]) == ["side"]
    assert len(result["errors"]) == 1 and "404" in result["errors"][0]


def test_overlap():
    stats = [{"worker": "1", "objects": ["a", "b", "c"]},
             {"worker": "2", "objects": ["c", "d"]},
             {"worker": "3", "objects": ["c", "d", "e", "f"]}]
    result = cacheapp.overlap(stats)
    assert result["distinct"] == 6 and result["shared"] == 2
    assert result["overlap"] == pytest.approx(2 / 6)
    assert result["duplication"] == pytest.approx(9 / 6)
    assert cacheapp.overlap([])["overlap"] == 0.0
    assert cache_overlap(stats)["overlap"] == pytest.approx(2 / 6)


# -- against a live server ----------------------------------------------------

OBJECTS = 4


@pytest.fixture
def servers():
    """Two cacheapp workers (separate caches) on free loopback ports."""
    started = []
    for n in range(2):
        app = cacheapp.make_app(cache_size=50, miss_cost=0.0005, objects_per_request=OBJECTS,
                                objects_per_class=30, worker_id="w%d" % n)
        server = WSGIServer(("127.0.0.1", 0), app, log=None)
        server.start()
        started.append(server)
    yield started
    for server in started:
        server.stop(timeout=1)


def _url(server, path=""):
    return "http://127.0.0.1:%d%s" % (server.server_port, path)


def _many(entries, n):
    return [entries[i % len(entries)] for i in range(n)]


def test_replay_end_to_end_numbers_agree(servers):
    entries, stats = read_entries([COMMON], segment=1)
    stats_urls = [_url(s, cacheapp.STATS_PATH) for s in servers]
    with gevent.Timeout(20):
        report = replay(_many(entries, 200), _url(servers[0]), concurrency=4, max_requests=150,
                        parse_stats=stats, stats_urls=stats_urls, top=3)
    assert report["requests"] == report["responses"] == 150
    assert report["errors"] == 0
    assert sum(report["status"].values()) == 150 and report["status"] == {"200": 150}
    cache = report["cache"]
    assert cache["responses"] == 150
    assert cache["hits"] + cache["misses"] == 150 * OBJECTS
    assert cache["loads_per_request"] == pytest.approx(cache["misses"] / 150)
    assert report["workers"] == {"w0": 150}
    assert report["worker_loads"] == {"w0": cache["misses"]}
    assert "w0: 150 (%d loads)" % cache["misses"] in format_text(report)
    classes = report["classes"]
    assert classes["count"] == 7 and len(classes["top"]) == 3
    assert classes["top"][0]["requests"] >= classes["top"][1]["requests"]
    lat = report["latency"]
    assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"]
    assert report["parse"]["unparsable"] == 2
    overlap = report["overlap"]
    assert overlap["workers"] == 2 and overlap["errors"] == []
    assert overlap["per_worker"]["w0"]["misses"] == cache["misses"]
    assert overlap["per_worker"]["w1"]["requests"] == 0
    assert overlap["overlap"] == 0.0  # one worker holds everything
    assert reset_caches(stats_urls) == []
    assert servers[0].application.model.requests == 0


def test_a_class_whose_responses_say_nothing_of_the_cache_shows_no_loads():
    recorder = Recorder()
    recorder.record("plain.example", 0.01, 200, {})  # an app without the cache model
    recorder.record("model.example", 0.01, 200, {"x-cache-hits": "1", "x-cache-misses": "1"})
    recorder.record("model.example", 0.01, 200, {"x-cache-hits": "2", "x-cache-misses": "0"})
    report = recorder.report(1.0)
    rows = {row["class"]: row for row in report["classes"]["top"]}
    assert rows["plain.example"]["loads_per_request"] is None
    assert rows["model.example"]["loads_per_request"] == 0.5
    lines = {line.split()[0]: line for line in format_text(report).splitlines()
             if ".example" in line}
    assert "loads/req" not in lines["plain.example"]
    assert "0.50 loads/req" in lines["model.example"]


def test_overlap_between_two_live_workers(servers):
    entries = [Entry("GET", "/p%d" % i, "a.example", None) for i in range(5)]
    with gevent.Timeout(20):
        for server in servers:
            replay(entries, _url(server), concurrency=2)
        result = cache_overlap([_url(s, cacheapp.STATS_PATH) for s in servers])
    assert result["overlap"] == 1.0  # the same URLs, the same objects, on both
    assert result["duplication"] == 2.0


def test_paced_replay_with_backward_timestamps(servers):
    # Log seconds: 0, 2, 1 (back 1: at once), 3, -30 (back 33: a reset), -29.
    times = (0.0, 2.0, 1.0, 3.0, -30.0, -29.0)
    entries = [Entry("GET", "/a", "a.example", t) for t in times]
    entries.append(Entry("HEAD", "/b", "a.example", None))
    with gevent.Timeout(20):
        report = replay(entries, _url(servers[0]), concurrency=2, speed=10.0, tolerance=2.0)
    assert report["mode"] == "paced" and report["errors"] == 0
    assert report["responses"] == 7
    pacing = report["pacing"]
    assert pacing["backward_steps"] == 1 and pacing["clock_resets"] == 1
    assert pacing["log_seconds"] == 4.0
    assert 0.38 <= report["duration"] < 3  # 4 log seconds at x10


def test_max_seconds_bounds_a_replay(servers):
    entries = [Entry("GET", "/a", "a.example", float(t)) for t in range(100)]
    with gevent.Timeout(20):
        report = replay(entries, _url(servers[0]), concurrency=2, speed=10.0, max_seconds=0.5)
    assert 0 < report["responses"] < 10
    assert report["duration"] < 3


def test_connection_errors_are_counted(servers):
    port = servers[1].server_port
    servers[1].stop(timeout=1)
    entries = [Entry("GET", "/a", None, None)] * 5
    with gevent.Timeout(20):
        report = replay(entries, "http://127.0.0.1:%d" % port, concurrency=2)
    assert report["requests"] == 5 and report["responses"] == 0
    assert report["error_kinds"] == {"connect": 5}
    assert len(report["error_examples"]) == 5
    assert report["classes"]["top"][0]["class"] == "127.0.0.1:%d" % port


def test_client_reads_chunked_and_head_responses():
    def app(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/plain")])  # no length: chunked
        return [] if environ["REQUEST_METHOD"] == "HEAD" else iter([b"hello ", b"world"])

    server = WSGIServer(("127.0.0.1", 0), app, log=None)
    server.start()
    try:
        with gevent.Timeout(10):
            conn = Connection("127.0.0.1", server.server_port, timeout=5)
            conn.keep_body = True
            response = conn.request("GET", "/", "x")
            assert response.headers["transfer-encoding"] == "chunked"
            assert response.length == 11 and conn.body == b"hello world"
            assert conn.request("HEAD", "/", "x").length == 0
            assert conn.request("GET", "/", "x").status == 200
            assert conn.connects == 1  # kept alive throughout
            conn.close()
    finally:
        server.stop(timeout=1)
    with pytest.raises(HTTPError) as info:
        Connection("127.0.0.1", server.server_port, timeout=5).request("GET", "/", "x")
    assert info.value.kind == "connect"


def test_clients_take_turns_between_several_targets(servers):
    # A site's several balancers: client n sends to target n mod 2, on its
    # own connection, so each target is sent a share of the entries.
    entries, _ = read_entries([COMMON], segment=1)
    with gevent.Timeout(20):
        report = replay(_many(entries, 200), [_url(s) for s in servers], concurrency=4,
                        max_requests=120)
    assert report["responses"] == 120 and report["errors"] == 0
    assert set(report["workers"]) == {"w0", "w1"}
    assert min(report["workers"].values()) >= 10, report["workers"]
    assert report["target"] == ",".join(_url(s) for s in servers)
    out = io.StringIO()
    with gevent.Timeout(20), redirect_stdout(out):
        assert main([COMMON, "--target", _url(servers[0]), "--target", _url(servers[1]),
                     "-n", "40", "-c", "2", "--json", "--no-progress"]) == 0
    assert set(json.loads(out.getvalue())["workers"]) == {"w0", "w1"}
    with redirect_stdout(io.StringIO()):
        assert main([COMMON, "--target", _url(servers[0]), "--target", "ftp://x"]) == 2


def test_command_line_json_and_text(servers):
    out = io.StringIO()
    with gevent.Timeout(20), redirect_stdout(out):
        assert main([COMMON, COMBINED, "--target", _url(servers[0]), "-n", "12", "-c", "3",
                     "--host-from-segment", "1", "--json", "--no-progress"]) == 0
    report = json.loads(out.getvalue())
    assert report["requests"] == 12 and report["errors"] == 0
    assert report["parse"]["unparsable"] == 2  # both in the common log, read first
    out = io.StringIO()
    with gevent.Timeout(20), redirect_stdout(out):
        main([COMMON, "--target", _url(servers[0]), "--host", "nasa.example", "--no-progress",
              "--stats-url", _url(servers[0], cacheapp.STATS_PATH)])
    text = out.getvalue()
    assert "9 entries, 2 unparsable" in text
    assert "unparsable  " in text and "garbled" in text
    assert "database loads/request" in text and "nasa.example" in text and "overlap" in text


def test_script_runs_from_the_repository_root(servers):
    with gevent.Timeout(30):
        result = gevent.subprocess.run(
            [sys.executable, "playback/replay.py", COMMON, "--target", _url(servers[0]),
             "-n", "5", "--json"], cwd=str(ROOT), stdout=gevent.subprocess.PIPE,
            stderr=gevent.subprocess.PIPE, timeout=25)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["responses"] == 5


LOCUST = shutil.which("locust", path=os.path.dirname(sys.executable))
needs_locust = pytest.mark.skipif(LOCUST is None, reason="locust not installed")


def _locust(server, *options: str) -> tuple[int, str]:
    """Run the locustfile headless against ``server`` on the common log:
    its exit status and its output."""
    with gevent.Timeout(30):
        result = gevent.subprocess.run(
            [LOCUST, "-f", "playback/locustfile.py", "--headless", "--host", _url(server),
             "--log-file", COMMON, "--only-summary", *options],
            cwd=str(ROOT), stdout=gevent.subprocess.PIPE, stderr=gevent.subprocess.STDOUT,
            timeout=25)
    return result.returncode, result.stdout.decode()


@needs_locust
def test_locustfile_headless(servers):
    returncode, output = _locust(servers[0], "-u", "2", "-r", "2", "-t", "10s",
                                 "--host-from-segment", "1")
    assert returncode == 0, output
    assert "log replayed: stopping" in output
    assert "9 entries, 2 unparsable" in output
    assert "shuttle.example" in output
    assert servers[0].application.model.requests == 9


@needs_locust
def test_locustfile_refuses_host_depth_without_a_segment(servers):
    # As compare and replay refuse it, not ignored: nothing would be sent.
    returncode, output = _locust(servers[0], "-u", "1", "-r", "1", "-t", "5s",
                                 "--host-depth", "2")
    assert returncode != 0, output
    assert "locustfile: --host-depth needs --host-from-segment" in output
    assert servers[0].application.model.requests == 0
