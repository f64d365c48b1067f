"""The access log: its format, reading it back with playback/logparse.py
(classes included), replaying it, and reopening it on SIGUSR1."""

import logging
import os
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest

from zc_lb.playback.logparse import FORMATS, LogReader, parse_pairs, read_entries
from zc_lb.front.accesslog import COMBINED, LogFormat, quote
from zc_lb.errors import ConfigurationError
from zc_lb.testing import (LBProcess, WorkerProcess, http_get, read_until_closed, start_all,
                           wait_for)

TESTS = os.path.dirname(os.path.abspath(__file__))
ENV = {"PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")}


def handler(environ, **kw):
    values = dict(client_address=("10.0.0.1", 5555), requestline="GET /a?b=1 HTTP/1.1",
                  status="200 OK", response_length=12,
                  time_start=1e9, time_finish=1e9 + 0.25, environ=environ)
    values.update(kw)
    return SimpleNamespace(**values)


def test_default_format_is_combined_plus_the_lbs_fields():
    environ = {"HTTP_HOST": "Alpha.example", "HTTP_USER_AGENT": 'say "hi"',
               "zc_lb.class": "alpha.example", "zc_lb.worker": "127.0.0.1:9001",
               "zc_lb.upstream_time": 0.125, "zc_lb.retries": 1}
    line = LogFormat().format(handler(environ))
    assert line.startswith('10.0.0.1 - - [')
    assert line.endswith('] "GET /a?b=1 HTTP/1.1" 200 12 "-" "say \\"hi\\"" '
                         'host="Alpha.example" class="alpha.example" worker=127.0.0.1:9001 '
                         'upstream=0.125000 time=0.250000 retries=1 error=- request_id="-"')
    assert LogFormat(COMBINED).format(handler(environ)).endswith('200 12 "-" "say \\"hi\\""')


def test_a_request_refused_before_the_lb_saw_it():
    line = LogFormat().format(handler(None, requestline="", status="400",
                                      response_length=0, error="BadRequest"))
    assert '"-" 400 - "-" "-" host="-" class="-" worker=- upstream=- ' in line
    assert line.endswith('retries=0 error=BadRequest request_id="-"')


def test_custom_format_fields():
    environ = {"REQUEST_METHOD": "GET", "PATH_INFO": "/a", "QUERY_STRING": "b=1",
               "SERVER_PROTOCOL": "HTTP/1.1", "CONTENT_TYPE": "text/plain",
               "zc_lb.class": None}
    fmt = LogFormat("%m %U%q %H %s %B %D %T %{Content-Type}i %{class}z 100%%")
    assert fmt.format(handler(environ)) == "GET /a?b=1 HTTP/1.1 200 12 250000 0 text/plain - 100%"


@pytest.mark.parametrize("text", ["%h %Q", "%{foo}z", "%{}i", "%{Host}", "trailing %"])
def test_unknown_field_refused(text):
    with pytest.raises(ConfigurationError, match="unknown access log field"):
        LogFormat(text)


def test_unknown_field_refused_at_startup():
    result = subprocess.run([sys.executable, "-m", "zc_lb.cli", "lb",
                             "--access-log-format", '%h "%r" %{clas}z'],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert "unknown access log field '%{clas}z'" in result.stderr
    assert "%{class}z" in result.stderr  # and what would do


def test_quote_escapes_what_would_break_a_line():
    assert quote('a"b\\c\nd\x7f') == 'a\\"b\\\\c\\x0ad\\x7f'
    assert quote("") == quote(None) == "-"
    # C1's NEL and the line separator break lines for str.splitlines and
    # many readers; what Python prints stays as it is
    assert quote("a\x85b\x9bc\u2028d") == "a\\x85b\\x9bc\\u2028d"
    # and past ASCII, as Apache does: a header's text is its bytes read as
    # latin-1 (PEP 3333), so \xNN is the byte the client sent
    assert quote("caf\xe9 \u00a0 \u0101") == "caf\\xe9 \\xa0 \\u0101"


def test_logparse_reads_the_default_format_with_its_class():
    environ = {"HTTP_HOST": "www.Beta.example:8080", "HTTP_USER_AGENT": "ua",
               "zc_lb.class": 'we"ird cl\\ass', "zc_lb.worker": "w:1",
               "zc_lb.upstream_time": 0.001}
    line = LogFormat().format(handler(environ))
    for fmt in ("auto", "zc-lb"):
        reader = LogReader([], fmt=fmt)
        entry = reader.parse_line(line, "x:1")
        assert entry is not None, (fmt, reader.stats)
        assert entry.rclass == entry.host == 'we"ird cl\\ass'
        assert (entry.method, entry.path, entry.status) == ("GET", "/a?b=1", 200)
    # no class: the Host the client sent
    line = LogFormat().format(handler(dict(environ, **{"zc_lb.class": None})))
    entry = LogReader([]).parse_line(line)
    assert entry.rclass is None and entry.host == "www.beta.example"
    # a fixed host or a path segment still wins, as for other logs
    assert LogReader([], host="h.example").parse_line(line).host == "h.example"
    assert "zc-lb" in FORMATS
    assert parse_pairs(' a=1 b="x \\"y\\"" c=') == {"a": "1", "b": 'x "y"', "c": ""}


def test_a_clients_bytes_past_ascii_are_read_back_as_the_lb_had_them():
    # Written as UTF-8, a header's latin-1 text (the client's bytes) came
    # out encoded twice, and the replay read another class than the LB's,
    # or refused the line ("no name": a C1 character of the double encoding).
    environ = {"HTTP_HOST": "h", "HTTP_USER_AGENT": "caf\xc3\xa9", "HTTP_REFERER": "\xff",
               "zc_lb.class": "r\xc3\xa9", "zc_lb.worker": "w:1"}
    line = LogFormat().format(handler(environ))
    assert line.isascii()
    assert '"\\xff" "caf\\xc3\\xa9" host="h" class="r\\xc3\\xa9"' in line
    reader = LogReader([])
    entry = reader.parse_line(line, "x:1")
    assert entry is not None, reader.stats
    assert entry.rclass == entry.host == "r\xc3\xa9"
    # A class past latin-1 (a classifier's own text) is no Host a replay can
    # send: a bad line, said so, not another class.
    line = LogFormat().format(handler(dict(environ, **{"zc_lb.class": "b\u0101"})))
    assert 'class="b\\u0101"' in line
    assert reader.parse_line(line, "x:2") is None
    assert "a host or class that is no name" in reader.stats.examples[-1]


def _workers(n):
    return start_all([WorkerProcess("apps:app", env=ENV) for _ in range(n)])


def _get(address, host, path="/"):
    return http_get(address, path, host)


def test_a_replay_of_an_lb_log_keeps_every_requests_class(tmp_path):
    import gevent

    from zc_lb.playback.replay import replay

    first, second = tmp_path / "first.log", tmp_path / "second.log"
    workers = _workers(2)
    try:
        sent = []
        with LBProcess([w.address for w in workers], "--access-log", str(first),
                       "--max-retries", "0") as lb:
            for i in range(24):
                host = ("Alpha.example", "www.beta.example:8080", "gamma.example")[i % 3]
                status, body = _get(lb.address, host, "/p%d?i=%d" % (i % 5, i))
                assert status == 200
                sent.append(body)
        entries, stats = read_entries([str(first)])
        assert stats.entries == 24 and stats.unparsable == 0
        # Lines are written as requests end, which need not be the order they came in.
        entries.sort(key=lambda e: int(e.path.rpartition("i=")[2]))
        classes = [e.rclass for e in entries]
        assert classes == ["alpha.example", "beta.example", "gamma.example"] * 8
        assert [e.host for e in entries] == classes
        with LBProcess([w.address for w in workers], "--access-log", str(second)) as lb:
            with gevent.Timeout(30):
                report = replay(entries, "http://" + lb.address, concurrency=3)
            assert report["responses"] == 24 and report["errors"] == 0
        replayed, _ = read_entries([str(second)])
        assert sorted((e.path, e.rclass) for e in replayed) == sorted(
            (e.path, e.rclass) for e in entries)
    finally:
        for worker in workers:
            worker.kill()


def test_a_class_from_a_utf8_path_is_read_back_as_the_lb_counted_it(tmp_path):
    import json
    import socket
    import urllib.request

    log = tmp_path / "access.log"
    workers = _workers(1)
    try:
        with LBProcess([workers[0].address], "--access-log", str(log), "--status",
                       "127.0.0.1:0", "--classifier",
                       "re:PATH_INFO:^/(?P<class>[^/]*)") as lb:
            status = lb.said("zc-lb status on ")
            host, port = lb.address.rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=10) as sock:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.sendall(b"GET /caf%C3%A9/x HTTP/1.1\r\nHost: h\r\n"
                             b"User-Agent: caf\xc3\xa9\r\nConnection: close\r\n\r\n")
                assert read_until_closed(sock).startswith(b"HTTP/1.1 200")
            with urllib.request.urlopen("http://%s/status.json" % status, timeout=10) as r:
                counted = set(json.load(r)["classes"]) - {""}
            wait_for(lambda: log.exists() and "/caf" in log.read_text(),
                     message="the line written")
        data = log.read_bytes()
        assert data.isascii() and b'"caf\\xc3\\xa9" host="h" class="caf\\xc3\\xa9"' in data
        entries, stats = read_entries([str(log)])
        assert stats.unparsable == 0, stats.examples
        assert [entry.rclass for entry in entries] == sorted(counted) == ["caf\xc3\xa9"]
    finally:
        workers[0].kill()


def test_sigusr1_reopens_the_access_log(tmp_path):
    log = tmp_path / "access.log"
    workers = _workers(1)
    try:
        with LBProcess([workers[0].address], "--access-log", str(log)) as lb:
            assert _get(lb.address, "one.example", "/before")[0] == 200
            wait_for(lambda: log.exists() and "/before" in log.read_text(),
                     message="the first line written")
            os.rename(log, tmp_path / "access.log.1")  # what logrotate does
            os.kill(lb.pid, signal.SIGUSR1)
            wait_for(lambda: log.exists(), message="the log reopened")
            assert _get(lb.address, "two.example", "/after")[0] == 200
            wait_for(lambda: "/after" in log.read_text(), message="the line in the new file")
            assert lb.process.poll() is None
        old = (tmp_path / "access.log.1").read_text()
        assert "/before" in old and "/after" not in old
        assert "/before" not in log.read_text()
    finally:
        workers[0].kill()


def test_a_line_is_written_within_a_tenth_of_a_second_and_a_burst_in_one_write():
    import io

    import gevent

    from zc_lb.front.accesslog import FLUSH_DELAY, AccessLog

    writes = []

    class Stream(io.StringIO):
        def write(self, text):
            writes.append(text)
            return super().write(text)

    stream = Stream()
    log = AccessLog(stream)
    log.start()
    for n in range(3):
        log.write("line %d\n" % n)
    assert stream.getvalue() == ""  # (held: requests never wait on the disk)
    gevent.sleep(FLUSH_DELAY * 2)
    assert stream.getvalue() == "line 0\nline 1\nline 2\n" and len(writes) == 1
    log.write("again\n")
    gevent.sleep(FLUSH_DELAY * 2)
    assert stream.getvalue().endswith("again\n")
    log.close()


FULL_DISK = r'''
import resource, signal, sys
from zc_lb.front.accesslog import AccessLog
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
log = AccessLog.open(sys.argv[1])
resource.setrlimit(resource.RLIMIT_FSIZE, (100, hard))  # the disk is full
for i in range(400):
    log.write("line %04d %s\n" % (i, "x" * 30))
log.flush()
log.write("held\n")
log.flush()
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))  # room again
log.write("after\n")
log.flush()
log.close()
'''


def test_a_full_disk_neither_loses_nor_garbles_access_log_lines(tmp_path):
    # A failed write dropped its whole batch, and left a line cut short
    # that the next batch was glued to.
    import subprocess
    import sys

    path = tmp_path / "access.log"
    result = subprocess.run([sys.executable, "-c", FULL_DISK, str(path)], capture_output=True,
                            text=True, timeout=60)
    assert result.stderr.count("cannot write the access log") == 1, result.stderr
    assert "the access log is written again" in result.stderr
    lines = path.read_text().splitlines()
    assert lines == ["line %04d %s" % (i, "x" * 30) for i in range(400)] + ["held", "after"]


def test_lines_a_stream_refused_are_written_once_it_takes_them(monkeypatch, caplog):
    import io

    from zc_lb.front import accesslog
    from zc_lb.front.accesslog import AccessLog

    class Full(io.StringIO):
        full = True

        def write(self, text):
            if self.full:
                raise OSError(28, "No space left on device")
            return super().write(text)

    stream = Full()
    log = AccessLog(stream)
    log.write("first\n")
    log.flush()
    stream.full = False
    log.write("second\n")
    log.flush()
    assert stream.getvalue() == "first\nsecond\n"
    # Past the bytes it may hold, new lines are dropped, and counted.
    monkeypatch.setattr(accesslog, "UNWRITTEN_LIMIT", 10)
    stream.full = True
    for line in ("third\n", "fourth\n", "fifth\n"):
        log.write(line)
        log.flush()
    stream.full = False
    log.write("sixth\n")
    with caplog.at_level(logging.WARNING, logger="zc_lb.front.accesslog"):
        log.flush()
    assert stream.getvalue() == "first\nsecond\nthird\nsixth\n"
    assert "2 lines were dropped meanwhile" in caplog.text
