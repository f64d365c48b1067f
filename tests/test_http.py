"""The HTTP front on real processes: head size limits against the frame
limit, the header timeout and the connection cap (slowloris), TLS
settings and failures, SIGHUP, and a worker that will not listen openly
without a secret, forwarding headers and the PROXY protocol.  The
front's client connection in process is test_front.py's.
"""

import http.client
import json
import os
import select
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from zc_lb.front.httpparse import MAX_FIELD_LINE, MAX_HEAD
from zc_lb.testing import LBProcess, WorkerProcess, free_port, wait_for

TESTS = os.path.dirname(os.path.abspath(__file__))
ENV = {"PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")}

pytestmark = pytest.mark.timeout(40)


@pytest.fixture
def procs():
    """Start processes; all are killed after the test."""
    started = []

    def start(process):
        started.append(process)
        return process.start()

    yield start
    for process in reversed(started):
        process.kill()


def lb_with_worker(procs, *lb_args, app="apps:app", stderr=None):
    worker = procs(WorkerProcess(app, env=ENV))
    lb = procs(LBProcess([worker.address], *lb_args, env=ENV, stderr=stderr))
    wait_for(lambda: get(lb.address)[0] == 200, message="LB serving")
    return lb, worker


def in_flight(status_address):
    with urllib.request.urlopen("http://%s/" % status_address, timeout=5) as response:
        return json.load(response)["in_flight"]


def lb_with_status(procs, *lb_args, stderr=None):
    """An LB (with a status server) in front of one apps:app worker."""
    lb, worker = lb_with_worker(procs, "--status", "127.0.0.1:0", *lb_args, stderr=stderr)
    lb.status_address = lb.said("zc-lb status on ")  # (its own port: none to race for)
    return lb, worker


def address(text):
    host, port = text.rsplit(":", 1)
    return host, int(port)


def connect(text, timeout=5.0):
    sock = socket.create_connection(address(text), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def get(lb_address, path="/", timeout=10.0, headers=None):
    """(status, body) of a GET on a new connection; (None, error) if it failed."""
    connection = http.client.HTTPConnection(*address(lb_address), timeout=timeout)
    try:
        connection.request("GET", path, headers=dict({"Host": "a.example"}, **(headers or {})))
        response = connection.getresponse()
        return response.status, response.read()
    except (OSError, http.client.HTTPException) as exc:
        return None, repr(exc)
    finally:
        connection.close()


def raw(lb_address, data, timeout=5.0):
    """Everything the server sends back to ``data`` until it closes."""
    with connect(lb_address, timeout) as sock:
        try:
            sock.sendall(data)
        except OSError:
            pass
        received = b""
        try:
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    return received
                received += chunk
        except (socket.timeout, ConnectionResetError):
            return received


def log_text(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def status_doc(status_address):
    with urllib.request.urlopen("http://%s/" % status_address, timeout=5) as response:
        return json.load(response)


def test_the_status_document_counts_the_client_connections_open(procs):
    lb, _ = lb_with_status(procs)
    wait_for(lambda: status_doc(lb.status_address)["clients"] == 0, message="none open")
    with connect(lb.address) as first, connect(lb.address) as second:
        for sock in (first, second):
            sock.sendall(b"GET / HTTP/1.1\r\nHost: a.example\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        assert status_doc(lb.status_address)["clients"] == 2
    wait_for(lambda: status_doc(lb.status_address)["clients"] == 0, message="both closed")


def test_every_answer_the_front_gives_itself_is_counted_by_status_and_cause(procs, tmp_path):
    # 400, 408, 431 and 501 were counted nowhere: not in requests, errors,
    # recent_errors or /metrics (a 413 or a 503 was).
    access = tmp_path / "access.log"
    lb, _ = lb_with_status(procs, "--header-timeout", "0.5", "--access-log", str(access))
    before = status_doc(lb.status_address)
    assert raw(lb.address, b"GET / HTTP/1.1\r\nHost: a\r\nBad Header: x\r\n\r\n")[:12] \
        == b"HTTP/1.1 400"
    assert raw(lb.address, b"GET / HTTP/1.1\r\nHost: a\r\n")[:12] == b"HTTP/1.1 408"
    assert raw(lb.address, b"GET / HTTP/1.1\r\nHost: a\r\nX: " + b"y" * 70000
               + b"\r\n\r\n")[:12] == b"HTTP/1.1 431"
    assert raw(lb.address, b"GET / HTTP/1.1\r\nHost: a\r\nUpgrade: h2c\r\n"
               b"Connection: upgrade\r\n\r\n")[:12] == b"HTTP/1.1 501"
    doc = status_doc(lb.status_address)
    assert doc["requests"] - before["requests"] == 4
    assert {k: v for k, v in doc["errors"].items() if k in ("400", "408", "431", "501")} == {
        "400": 1, "408": 1, "431": 1, "501": 1}
    assert doc["error_causes"] == {"BadRequest": 3, "HeadTimeout": 1}
    assert sorted(e["status"] for e in doc["recent_errors"]) == [400, 408, 431, 501]
    with urllib.request.urlopen("http://%s/metrics" % lb.status_address, timeout=5) as r:
        metrics = r.read().decode()
    assert 'zc_lb_errors_total{status="408"} 1.0' in metrics
    assert 'zc_lb_error_causes_total{cause="BadRequest"} 3.0' in metrics
    wait_for(lambda: log_text(access).count(" error=BadRequest") == 3
             and " 408 " in log_text(access) and "error=HeadTimeout" in log_text(access),
             message="the access log's error fields")


# -- item 8: the front's head limit agrees with the Request frame limit --------


def _head(fill_to, value_byte=b"\xe9"):
    """A GET head of exactly ``fill_to`` bytes, its field values made of
    ``value_byte`` (obs-text: two bytes each in the JSON of the frame)."""
    head = b"GET / HTTP/1.1\r\nHost: a.example\r\n"
    n = 0
    while len(head) + 2 < fill_to:
        name = b"X-%03d: " % n
        room = min(MAX_FIELD_LINE, fill_to - 2 - len(head)) - len(name) - 2
        head += name + value_byte * max(room, 0) + b"\r\n"
        n += 1
    return head + b"\r\n"


def test_the_largest_head_accepted_fits_one_request_frame(procs):
    lb, _ = lb_with_worker(procs)
    largest = _head(MAX_HEAD)
    assert len(largest) == MAX_HEAD
    assert raw(lb.address, largest).startswith(b"HTTP/1.1 200")  # raw waits for the close
    assert raw(lb.address, _head(MAX_HEAD + 1)).startswith(b"HTTP/1.1 431")


def test_an_oversized_head_is_431_and_spares_the_requests_sharing_its_link(procs):
    lb, _ = lb_with_status(procs)
    slow = []
    thread = threading.Thread(target=lambda: slow.append(get(lb.address, "/slow?1")))
    thread.start()
    wait_for(lambda: in_flight(lb.status_address) == 1, message="the slow request in flight")
    # 40 fields of 8 kB: 320 kB of head, a Request frame over 256 kB
    huge = b"GET / HTTP/1.1\r\nHost: a.example\r\n" + b"".join(
        b"X-%02d: %s\r\n" % (i, b"v" * 8000) for i in range(40)) + b"\r\n"
    reply = raw(lb.address, huge)
    thread.join(15)
    assert reply.startswith(b"HTTP/1.1 431"), reply[:80]
    assert slow and slow[0][0] == 200, slow


# -- item 10: slowloris ---------------------------------------------------------


def test_a_head_trickling_in_is_cut_at_the_header_timeout(procs):
    lb, _ = lb_with_worker(procs, "--header-timeout", "0.5")
    with connect(lb.address) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: a.example\r\n")
        started, reply = time.monotonic(), b""
        while time.monotonic() - started < 4 and not reply:
            try:
                sock.sendall(b"X-Slow: 1\r\n")  # each line well within --client-timeout
            except OSError:
                break
            if select.select([sock], [], [], 0.2)[0]:
                reply = sock.recv(1000)
        assert reply.startswith(b"HTTP/1.1 408"), reply
        assert time.monotonic() - started < 3


def test_heads_trickling_past_the_deadline_get_408_and_one_log_line_each(procs, tmp_path):
    # A read that ends just after the head's deadline left a negative
    # timeout for the next: ValueError, a traceback, and no answer (200
    # such connections: 173 tracebacks, 54 clients told nothing).
    stderr = open(tmp_path / "lb.log", "w")
    lb, _ = lb_with_worker(procs, "--header-timeout", "0.5", stderr=stderr)
    replies = []

    def trickle():
        with connect(lb.address) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: a.example\r\n")
            started, reply = time.monotonic(), b""
            while time.monotonic() - started < 4 and not reply:
                try:
                    sock.sendall(b"X: 1\r\n")
                except OSError:
                    break
                # A line each 15 ms or more: about 33 before the deadline.
                # (Each 5 ms, a quiet machine reached MAX_FIELDS, 100,
                # first, and its answer was 431.)
                if select.select([sock], [], [], 0.015)[0]:
                    reply = sock.recv(100) or b"(closed)"
            replies.append(reply[:12])

    threads = [threading.Thread(target=trickle) for _ in range(100)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert replies == [b"HTTP/1.1 408"] * 100
    wait_for(lambda: (tmp_path / "lb.log").read_text().count("408 for") == 100,
             message="every 408 logged")
    log = (tmp_path / "lb.log").read_text()
    assert "Traceback" not in log and "ValueError" not in log
    assert log.count("408 for") == 100  # one line each


def test_a_connection_that_sends_nothing_is_closed_at_the_header_timeout(procs):
    lb, _ = lb_with_worker(procs, "--header-timeout", "0.5")
    with connect(lb.address) as sock:
        started = time.monotonic()
        assert sock.recv(100) == b""  # closed without a word: it asked nothing
        assert time.monotonic() - started < 3


def test_an_idle_keepalive_connection_is_not_cut_by_the_header_timeout(procs):
    lb, _ = lb_with_worker(procs, "--header-timeout", "0.3")
    connection = http.client.HTTPConnection(*address(lb.address), timeout=5)
    for _ in range(2):
        connection.request("GET", "/", headers={"Host": "a.example"})
        response = connection.getresponse()
        assert response.status == 200
        response.read()
        time.sleep(0.6)  # idle between requests: the client timeout's business
    connection.close()


def test_connections_past_the_cap_get_503_when_none_waits_for_a_head(procs, tmp_path):
    # with the operator's 503 page, as the LB's own 503s (front/pages.py:
    # the front answered in plain text of its own)
    page = tmp_path / "sorry.html"
    page.write_text("<p>Back soon.</p>")
    lb, _ = lb_with_worker(procs, "--max-connections", "3", "--header-timeout", "60",
                           "--error-page", str(page))
    busy = []  # three connections with a request in flight: none to evict
    try:
        for _ in range(3):
            sock = connect(lb.address, timeout=20)
            sock.sendall(b"GET /slow?3 HTTP/1.1\r\nHost: a\r\n\r\n")
            busy.append(sock)
        wait_for(lambda: raw(lb.address, b"GET / HTTP/1.1\r\nHost: a\r\n\r\n")
                 .startswith(b"HTTP/1.1 503"), timeout=10, message="503 past the cap")
        reply = raw(lb.address, b"GET / HTTP/1.1\r\nHost: a\r\n\r\n")
        assert b"Connection: close" in reply and b"Retry-After: 1" in reply, reply
        assert reply.endswith(b"\r\n\r\n<p>Back soon.</p>"), reply
        for sock in busy:  # the requests in flight were not disturbed
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
    finally:
        for sock in busy:
            sock.close()
    wait_for(lambda: get(lb.address)[0] == 200, timeout=15, message="served again")


def test_slow_heads_make_room_for_a_client_that_sends_its_head_promptly(procs):
    # --max-connections 1000 with a 10 s head deadline let 1,000 slow
    # connections deny new clients (44% got 503).
    lb, _ = lb_with_worker(procs, "--max-connections", "20", "--header-timeout", "60")
    attack = Slowloris(lb.address, 20)
    try:
        time.sleep(1)  # past EVICT_AFTER: the slow ones have waited longest
        outcomes = [get(lb.address, timeout=5)[0] for _ in range(10)]
        assert outcomes == [200] * 10, outcomes
        # (one made room; the prompt clients then took turns in its place)
        wait_for(lambda: len(attack.open) < len(attack.socks), message="a slow head evicted")
    finally:
        attack.close()


def _start_lb_with_open_files(limit, worker, *args, stderr=None):
    """An LB process whose open-file limit (soft and hard) is ``limit``."""
    process = subprocess.Popen(
        ["prlimit", "--nofile=%d:%d" % (limit, limit), sys.executable, "-m", "zc_lb.cli",
         "lb", "--listen", "127.0.0.1:0", "--worker", worker] + list(args),
        stdout=subprocess.PIPE, stderr=stderr, text=True, env=dict(os.environ, **ENV))
    line = process.stdout.readline()
    assert line.startswith("zc-lb lb listening on "), line
    return process, line.split()[-1]


class Slowloris:
    """``n`` connections that each send a request head one line at a time,
    forever; counts those the server ends."""

    def __init__(self, lb_address, n):
        self.socks = []
        for _ in range(n):
            try:
                sock = socket.create_connection(address(lb_address), timeout=2)
            except OSError:
                continue  # refused or timed out: the server is full
            sock.setblocking(False)
            self.socks.append(sock)
        self.open = set(self.socks)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        for sock in list(self.open):
            self._send(sock, b"GET / HTTP/1.1\r\nHost: slow.example\r\n")
        while not self.stop.wait(0.2):
            for sock in list(self.open):
                self._send(sock, b"X-Slow: 1\r\n")

    def _send(self, sock, data):
        try:
            if select.select([sock], [], [], 0)[0]:  # a 408, a 503 or EOF:
                raise ConnectionResetError  # the server ended it
            sock.send(data)
        except OSError:
            self.open.discard(sock)

    def close(self):
        self.stop.set()
        self.thread.join(5)
        for sock in self.socks:
            sock.close()


def test_normal_requests_are_served_while_slow_clients_are_cut(procs, tmp_path):
    worker = procs(WorkerProcess("apps:app", env=ENV))
    # 200 descriptors: --max-connections 1000 must shrink to fit
    stderr = open(tmp_path / "lb.log", "w")
    process, lb_address = _start_lb_with_open_files(
        200, worker.address, "--header-timeout", "1", "--max-connections", "1000",
        stderr=stderr)
    try:
        wait_for(lambda: get(lb_address)[0] == 200, message="LB serving")
        attack = Slowloris(lb_address, 250)  # more than the LB has descriptors
        results = []
        started = time.monotonic()
        while time.monotonic() - started < 4:
            status, body = get(lb_address, timeout=3)
            results.append((time.monotonic() - started, status or body))
            time.sleep(0.1)
        still_open = len(attack.open)
        attack.close()
        late = [status for when, status in results if when > 2.5]
        assert late and all(status == 200 for status in late), results
        # in the flood: served, 503, or (past 50 pending 503s) closed unanswered;
        # never left waiting
        def answered(outcome):
            return outcome in (200, 503) or (
                isinstance(outcome, str) and ("Disconnected" in outcome or "Reset" in outcome))
        assert all(answered(outcome) for _, outcome in results), results
        assert still_open == 0, "%d slow clients still connected after 4 s" % still_open
        text = log_text(tmp_path / "lb.log")
        assert "allows 100 client connections" in text
        assert "Traceback" not in text, text[-3000:]
    finally:
        process.kill()
        process.wait(10)
        process.stdout.close()
        stderr.close()


# -- item 5: TLS ----------------------------------------------------------------


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """cert.pem and key.pem for 127.0.0.1, and other-key.pem that does not match."""
    directory = tmp_path_factory.mktemp("certs")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-keyout", str(directory / "key.pem"),
                    "-out", str(directory / "cert.pem")], check=True, capture_output=True)
    subprocess.run(["openssl", "genrsa", "-out", str(directory / "other-key.pem"), "2048"],
                   check=True, capture_output=True)
    return directory


def _lb_start_failure(*args):
    """(exit status, stdout, stderr) of an LB that should not start."""
    process = subprocess.run(
        [sys.executable, "-m", "zc_lb.cli", "lb", "--listen", "127.0.0.1:0"] + list(args),
        capture_output=True, text=True, timeout=20)
    return process.returncode, process.stdout, process.stderr


@pytest.mark.parametrize("problem", ["missing", "mismatched", "swapped", "ciphers"])
def test_a_bad_certificate_or_key_stops_the_lb_at_start(certs, problem):
    cert, key = str(certs / "cert.pem"), str(certs / "key.pem")
    args = {"missing": ["--certfile", str(certs / "nope.pem"), "--keyfile", key],
            "mismatched": ["--certfile", cert, "--keyfile", str(certs / "other-key.pem")],
            "swapped": ["--certfile", key, "--keyfile", cert],
            "ciphers": ["--certfile", cert, "--keyfile", key, "--tls-ciphers", "NO-SUCH"],
            }[problem]
    status, out, err = _lb_start_failure(*args)
    assert status == 2 and "listening" not in out, (status, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zc-lb lb: error: "), err


def _tls_client(cafile, maximum=None):
    context = ssl.create_default_context(cafile=cafile)
    context.check_hostname = False  # a CN-only test certificate; the chain is checked
    if maximum is not None:
        context.maximum_version = maximum
    return context


def test_failed_handshakes_are_one_line_each_and_https_still_works(procs, certs, tmp_path):
    log = tmp_path / "lb.log"
    with open(log, "w") as stderr:
        worker = procs(WorkerProcess("apps:app", env=ENV))
        lb = procs(LBProcess([worker.address], "--certfile", str(certs / "cert.pem"),
                             "--keyfile", str(certs / "key.pem"),
                             "--tls-min-version", "TLSv1.3", env=ENV, stderr=stderr))
    cafile = str(certs / "cert.pem")
    # plain HTTP on the TLS port
    assert not raw(lb.address, b"GET / HTTP/1.1\r\nHost: a\r\n\r\n").startswith(b"HTTP/1.1 200")
    # a TLS 1.2 client, below --tls-min-version
    with pytest.raises(ssl.SSLError):
        with connect(lb.address) as sock:
            _tls_client(cafile, ssl.TLSVersion.TLSv1_2).wrap_socket(
                sock, server_hostname="127.0.0.1")
    # a client that does not trust the certificate
    with pytest.raises(ssl.SSLError):
        with connect(lb.address) as sock:
            ssl.create_default_context().wrap_socket(sock, server_hostname="127.0.0.1")

    def https_ok():
        connection = http.client.HTTPSConnection(*address(lb.address), timeout=5,
                                                 context=_tls_client(cafile))
        try:
            connection.request("GET", "/", headers={"Host": "a.example"})
            return connection.getresponse().status == 200
        finally:
            connection.close()

    wait_for(https_ok, message="HTTPS served")
    wait_for(lambda: log_text(log).count("TLS handshake with") >= 3,
             message="three handshake failures logged")
    text = log_text(log)
    assert "Traceback" not in text, text
    assert text.count("TLS handshake with") == 3, text


# -- item 6: SIGHUP ---------------------------------------------------------------


def _certificate(directory, name):
    """A self-signed certificate and key for 127.0.0.1, as NAME.pem and NAME-key.pem."""
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1/O=%s" % name, "-keyout",
                    str(directory / ("%s-key.pem" % name)), "-out",
                    str(directory / ("%s.pem" % name))], check=True, capture_output=True)


def _served_certificate(lb_address):
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    with connect(lb_address) as sock:
        with context.wrap_socket(sock, server_hostname="127.0.0.1") as tls:
            return tls.getpeercert(binary_form=True)


def test_http_and_https_in_one_lb_with_a_redirect_and_certificates_reloaded_on_sighup(
        procs, tmp_path):
    # --listen took one address: HTTP and HTTPS needed two LBs, with no
    # redirect between them, and a new certificate needed a restart.
    for name in ("one", "two"):
        _certificate(tmp_path, name)
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_bytes((tmp_path / "one.pem").read_bytes())
    key.write_bytes((tmp_path / "one-key.pem").read_bytes())
    plain, secure = "127.0.0.1:%d" % free_port(), "127.0.0.1:%d" % free_port()
    log = tmp_path / "lb.log"
    with open(log, "w") as stderr:
        worker = procs(WorkerProcess("apps:app", env=ENV))
        lb = procs(LBProcess([worker.address], "--listen", "http://" + plain, "--listen",
                             "https://" + secure, "--redirect-https", "--certfile", str(cert),
                             "--keyfile", str(key), env=ENV, stderr=stderr))
    reply = raw(plain, b"GET /a/b?c=1 HTTP/1.1\r\nHost: www.example:8080\r\n"
                       b"Connection: close\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 301"), reply
    # (to the first HTTPS listener: LBProcess's own --listen 127.0.0.1:0, bare, so HTTPS)
    assert b"\r\nLocation: https://www.example:%d/a/b?c=1\r\n" % address(lb.address)[1] \
        in reply
    assert raw(plain, b"POST /f HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n"
               b"Connection: close\r\n\r\n").startswith(b"HTTP/1.1 308")
    connection = http.client.HTTPSConnection(*address(secure), timeout=5,
                                             context=_tls_client(str(cert)))
    connection.request("GET", "/", headers={"Host": "a.example"})
    assert connection.getresponse().status == 200
    first = _served_certificate(secure)
    cert.write_bytes((tmp_path / "two.pem").read_bytes())
    key.write_bytes((tmp_path / "two-key.pem").read_bytes())
    lb.process.send_signal(signal.SIGHUP)
    wait_for(lambda: _served_certificate(secure) != first, message="the new certificate")
    key.write_text("not a key")  # a broken pair is logged; the last good one stays
    lb.process.send_signal(signal.SIGHUP)
    wait_for(lambda: "still serving the certificate loaded before" in log_text(log))
    assert _served_certificate(secure) != first


@pytest.mark.parametrize("argv, said", [
    (["--listen", "https://127.0.0.1:0"], "needs --certfile"),
    (["--listen", "ftp://127.0.0.1:0"], "the scheme is http:// or https://"),
    (["--redirect-https"], "needs an HTTPS --listen"),
    (["--listen", "127.0.0.1:0", "--listen", "127.0.0.1:0", "--processes", "2"],
     "takes one --listen"),
])
def test_listeners_that_cannot_work_stop_the_lb_at_start(argv, said):
    result = subprocess.run([sys.executable, "-m", "zc_lb.cli", "lb"] + argv,
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and said in result.stderr, result.stderr


def test_sighup_is_logged_and_ignored_by_the_lb_and_the_worker(procs, tmp_path):
    log = tmp_path / "lb.log"
    with open(log, "w") as stderr:
        worker = procs(WorkerProcess("apps:app", env=ENV, stderr=stderr))
        lb = procs(LBProcess([worker.address], "--status", "127.0.0.1:0", env=ENV,
                             stderr=stderr))
    status = lb.said("zc-lb status on ")
    wait_for(lambda: get(lb.address)[0] == 200, message="LB serving")
    slow = []
    thread = threading.Thread(target=lambda: slow.append(get(lb.address, "/slow?1")))
    thread.start()
    wait_for(lambda: in_flight(status) == 1, message="the slow request in flight")
    lb.process.send_signal(signal.SIGHUP)
    worker.process.send_signal(signal.SIGHUP)
    thread.join(15)
    assert slow and slow[0][0] == 200, slow
    assert get(lb.address)[0] == 200
    assert lb.process.poll() is None and worker.process.poll() is None
    wait_for(lambda: log_text(log).count("SIGHUP ignored") == 2, message="two log lines")


# -- item 5: a worker open to the network needs a secret ------------------------------


def test_a_worker_on_a_public_address_without_a_secret_refuses_to_start():
    process = subprocess.run(
        [sys.executable, "-m", "zc_lb.cli", "worker", "apps:app", "--listen", "0.0.0.0:0"],
        capture_output=True, text=True, timeout=20, env=dict(os.environ, **ENV))
    assert process.returncode == 2 and "listening" not in process.stdout, process
    assert "--secret-file" in process.stderr and "--insecure" in process.stderr
    assert "Traceback" not in process.stderr


def test_loopback_a_secret_or_insecure_lets_a_worker_listen():
    from zc_lb.cli.worker import _check_exposure
    from zc_lb.errors import ConfigurationError

    for host in ("127.0.0.1", "::1", "localhost", "127.1.2.3"):
        _check_exposure((host, 0), None, False)
    _check_exposure(("0.0.0.0", 0), b"secret", False)
    _check_exposure(("10.1.2.3", 0), None, True)
    for host in ("0.0.0.0", "", "10.1.2.3", "worker.example"):
        with pytest.raises(ConfigurationError):
            _check_exposure((host, 0), None, False)


# -- forwarding headers ------------------------------------------------------

FORGED = {"X-Forwarded-For": "6.6.6.6", "X-Forwarded-Proto": "https",
          "X-Forwarded-Host": "evil.example"}


def forwarded(lb, headers):
    status, body = get(lb.address, "/headers", headers=headers)
    assert status == 200, body
    return json.loads(body)


def test_forwarding_headers_tell_the_app_the_client_not_a_forgery(procs):
    # A client's X-Forwarded-For reached the app untouched, and the LB
    # added nothing: an app trusting the last value believed the forgery.
    lb, _ = lb_with_worker(procs)
    seen = forwarded(lb, FORGED)
    assert seen["HTTP_X_FORWARDED_FOR"] == "6.6.6.6, 127.0.0.1"
    assert seen["HTTP_X_FORWARDED_PROTO"] == "http"
    assert seen["HTTP_X_FORWARDED_HOST"] == "a.example"
    assert len(seen["HTTP_X_REQUEST_ID"]) == 32
    assert forwarded(lb, {"X-Request-ID": "abc-1"})["HTTP_X_REQUEST_ID"] == "abc-1"


def test_the_app_sees_the_clients_address_as_remote_addr_not_the_lbs(procs):
    # The docs said REMOTE_ADDR was the LB's (to be read from
    # X-Forwarded-For): the client here is 127.0.0.2, the LB's connection
    # to its worker comes from 127.0.0.1.
    lb, _ = lb_with_worker(procs)
    connection = http.client.HTTPConnection(*address(lb.address), timeout=10,
                                            source_address=("127.0.0.2", 0))
    try:
        connection.request("GET", "/headers", headers={"Host": "a.example"})
        seen = json.loads(connection.getresponse().read())
    finally:
        connection.close()
    assert (seen["REMOTE_ADDR"], seen["HTTP_X_FORWARDED_FOR"]) == ("127.0.0.2", "127.0.0.2")


def test_a_trusted_proxy_keeps_its_proto_and_host_and_none_sets_nothing(procs):
    lb, _ = lb_with_worker(procs, "--trusted-proxies", "127.0.0.0/8,::1")
    seen = forwarded(lb, FORGED)
    assert (seen["HTTP_X_FORWARDED_PROTO"], seen["HTTP_X_FORWARDED_HOST"]) == (
        "https", "evil.example")
    assert seen["HTTP_X_FORWARDED_FOR"] == "6.6.6.6, 127.0.0.1"
    plain, _ = lb_with_worker(procs, "--forwarded", "none")
    assert forwarded(plain, FORGED) == dict(
        REMOTE_ADDR="127.0.0.1", HTTP_X_FORWARDED_FOR="6.6.6.6", HTTP_X_FORWARDED_PROTO="https",
        HTTP_X_FORWARDED_HOST="evil.example", HTTP_X_REQUEST_ID=None)


def test_a_flask_app_behind_proxyfix_sees_the_real_client(procs, tmp_path):
    access = tmp_path / "access.log"
    lb, _ = lb_with_worker(procs, "--access-log", str(access), app="flask_app:app")
    status, body = get(lb.address, "/whoami", headers=FORGED)
    assert status == 200, body
    seen = json.loads(body)
    assert (seen["remote_addr"], seen["scheme"], seen["host"]) == (
        "127.0.0.1", "http", "a.example")
    wait_for(lambda: 'request_id="%s"' % seen["request_id"] in log_text(access),
             message="the request id in the access log")


@pytest.mark.parametrize("argv", [["--forwarded", "for,via"], ["--trusted-proxies", "10.0.0/8"]])
def test_bad_forwarding_options_stop_the_lb_at_start(argv):
    result = subprocess.run([sys.executable, "-m", "zc_lb.cli", "lb", "--listen", "127.0.0.1:0"]
                            + argv, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert result.stderr.count("\n") <= 2 and argv[0] in result.stderr


def test_the_proxy_protocol_names_the_client_behind_a_tcp_proxy(procs, tmp_path):
    # An LB behind a TCP load balancer saw only that balancer's address.
    import struct

    lb, _ = lb_with_worker_raw(procs, "--proxy-protocol")
    request_bytes = b"GET /headers HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"

    def seen(header):
        reply = raw(lb.address, header + request_bytes)
        assert reply.startswith(b"HTTP/1.1 200"), reply
        return json.loads(reply.split(b"\r\n\r\n", 1)[1])
    v1 = seen(b"PROXY TCP4 203.0.113.7 198.51.100.1 56324 80\r\n")
    assert (v1["REMOTE_ADDR"], v1["HTTP_X_FORWARDED_FOR"]) == ("203.0.113.7", "203.0.113.7")
    body = (socket.inet_aton("192.0.2.9") + socket.inet_aton("198.51.100.1")
            + struct.pack("!HH", 1234, 80))
    v2 = seen(b"\r\n\r\n\x00\r\nQUIT\n\x21\x11" + struct.pack("!H", len(body)) + body)
    assert v2["REMOTE_ADDR"] == "192.0.2.9"
    assert seen(b"PROXY UNKNOWN\r\n")["REMOTE_ADDR"] == "127.0.0.1"
    # No header, or a bad one: closed without an answer (its address would be a claim).
    assert raw(lb.address, request_bytes) == b""
    assert raw(lb.address, b"PROXY TCP4 nonsense\r\n" + request_bytes) == b""


def test_the_proxy_protocol_is_taken_from_trusted_proxies_only(procs):
    lb, _ = lb_with_worker_raw(procs, "--proxy-protocol", "--trusted-proxies", "10.0.0.0/8")
    reply = raw(lb.address, b"PROXY TCP4 203.0.113.7 198.51.100.1 1 80\r\n"
                b"GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
    assert reply == b""  # 127.0.0.1 is not 10.0.0.0/8


def lb_with_worker_raw(procs, *lb_args):
    """An LB in front of one apps:app worker, started without a plain GET
    (which the PROXY protocol would refuse)."""
    worker = procs(WorkerProcess("apps:app", env=ENV))
    lb = procs(LBProcess([worker.address], *lb_args, env=ENV))
    return lb, worker
