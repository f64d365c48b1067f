"""Mutual TLS between LBs and workers (tls.py), end to end: real worker
and LB processes on loopback, certificates made here with openssl."""

import json
import os
import socket
import subprocess
import urllib.request

import pytest

from zc_lb.errors import ConfigurationError
from zc_lb.testing import LBProcess, WorkerProcess, http_get, read_until_closed, wait_for
from zc_lb.tls import lb_context, worker_context

TESTS = os.path.dirname(os.path.abspath(__file__))
ENV = {"PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")}


def openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_ca(directory, name):
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-keyout", name + ".key", "-out", name + ".pem", "-days", "2",
            "-subj", "/CN=" + name, cwd=directory)
    return os.path.join(directory, name)


def make_cert(directory, ca, name):
    """A certificate for 127.0.0.1 (and localhost) signed by ``ca``."""
    ext = os.path.join(directory, name + ".ext")
    with open(ext, "w") as f:
        f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", name + ".key", "-out", name + ".csr", "-subj", "/CN=" + name,
            cwd=directory)
    openssl("x509", "-req", "-in", name + ".csr", "-CA", ca + ".pem", "-CAkey", ca + ".key",
            "-CAcreateserial", "-out", name + ".pem", "-days", "2", "-extfile", ext,
            cwd=directory)
    return os.path.join(directory, name)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("pki"))
    site, other = make_ca(directory, "site-ca"), make_ca(directory, "other-ca")
    return {"ca": site + ".pem", "worker": make_cert(directory, site, "worker"),
            "lb": make_cert(directory, site, "lb"),
            "stranger": make_cert(directory, other, "stranger")}


def worker_tls(pki, name="worker"):
    return ["--tls-cert", pki[name] + ".pem", "--tls-key", pki[name] + ".key",
            "--tls-ca", pki["ca"]]


def lb_tls(pki):
    return ["--worker-tls-cert", pki["lb"] + ".pem", "--worker-tls-key", pki["lb"] + ".key",
            "--worker-tls-ca", pki["ca"]]


def link(lb, address):
    with urllib.request.urlopen("http://%s/" % lb.status_address, timeout=5) as response:
        return json.load(response)["workers"].get(address, {})


def lb_with(procs, worker, *args):
    lb = procs(LBProcess([worker.address], "--status", "127.0.0.1:0", *args))
    lb.status_address = lb.said("zc-lb status on ")
    return lb


def test_an_lb_and_a_worker_that_verify_each_other_serve(procs, pki):
    worker = procs(WorkerProcess("apps:app", *worker_tls(pki), env=ENV))
    lb = lb_with(procs, worker, *lb_tls(pki))
    wait_for(lambda: link(lb, worker.address).get("in_pool"), message="the worker in the pool")
    for _ in range(20):
        assert http_get(lb.address, "/")[0] == 200
    status, body = http_get(lb.address, "/big?1")  # (a body of many TLS records)
    assert status == 200 and len(body) == 1024 * 1024


def test_a_worker_with_a_certificate_from_another_ca_is_refused(procs, pki):
    worker = procs(WorkerProcess("apps:app", *worker_tls(pki, "stranger"), env=ENV))
    lb = lb_with(procs, worker, *lb_tls(pki))
    wait_for(lambda: "certificate verify failed" in (link(lb, worker.address).get(
        "last_error") or ""), message="the refusal")
    assert not link(lb, worker.address).get("in_pool")
    assert http_get(lb.address, "/", timeout=30)[0] == 503


def test_a_cleartext_lb_meets_a_tls_worker_with_a_clear_error(procs, pki, tmp_path):
    with open(tmp_path / "worker.log", "w") as log:
        worker = procs(WorkerProcess("apps:app", *worker_tls(pki), env=ENV, stderr=log))
    lb = lb_with(procs, worker)  # (no TLS)
    wait_for(lambda: "TLS handshake" in (tmp_path / "worker.log").read_text(),
             message="the worker saying why")
    wait_for(lambda: "if the worker takes TLS only, give the LB --worker-tls-cert" in (
        link(lb, worker.address).get("last_error") or ""), message="the LB saying why")
    assert not link(lb, worker.address).get("in_pool")


def test_a_tls_lb_meets_a_cleartext_worker_with_a_clear_error(procs, pki, tmp_path):
    with open(tmp_path / "worker.log", "w") as log:
        worker = procs(WorkerProcess("apps:app", env=ENV, stderr=log))
    lb = lb_with(procs, worker, *lb_tls(pki))
    wait_for(lambda: "speaks TLS and this side does not" in (tmp_path / "worker.log").read_text(),
             message="the worker saying why")
    wait_for(lambda: "does the worker have --tls-cert?" in (link(lb, worker.address).get(
        "last_error") or ""), message="the LB saying why")


def test_half_configured_tls_is_refused(pki):
    with pytest.raises(ConfigurationError, match="CA"):
        worker_context(pki["worker"] + ".pem", pki["worker"] + ".key", None)
    with pytest.raises(ConfigurationError, match="go with --worker-tls-cert"):
        lb_context(None, None, pki["ca"])
    with pytest.raises(ConfigurationError, match="cannot use certificate"):
        lb_context(pki["ca"], pki["worker"] + ".key", pki["ca"])  # (a key of another)
    assert worker_context(None, None, None) is None


@pytest.mark.parametrize("close_notify", [False, True])
def test_an_https_client_that_hangs_up_has_its_request_cancelled(tmp_path, close_notify):
    # (the watch for a hang-up peeked with flags an SSL socket refuses; and
    # took the close_notify a client sends as it closes, which Go's and
    # OpenSSL's do, for a request pipelined after this one)
    import gevent
    import gevent.socket
    import gevent.ssl
    from test_hardening import poll, routes
    from zc_lb.front.server import FrontServer, tls_context
    from zc_lb.lb.balancer import LB
    from zc_lb.routing.classifier import host_classifier
    from zc_lb.routing.pool import Pool
    from zc_lb.worker.server import Worker

    def hang(environ, start_response):
        gevent.sleep(3600)

    ca = make_ca(str(tmp_path), "ca")
    cert = make_cert(str(tmp_path), ca, "front")
    worker = Worker(routes({"/hang": hang}))
    worker.start()
    lb = LB(Pool(), host_classifier)
    lb.fleet.set_workers(["127.0.0.1:%d" % worker.address[1]])
    poll(lambda: len(lb.pool) == 1)
    front = FrontServer(("127.0.0.1", 0), lb, tls=tls_context(cert + ".pem", cert + ".key"))
    front.start()
    try:
        context = gevent.ssl.SSLContext(gevent.ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname, context.verify_mode = False, gevent.ssl.CERT_NONE
        sock = context.wrap_socket(gevent.socket.create_connection(front.address))
        sock.sendall(b"GET /hang HTTP/1.1\r\nHost: a.example\r\n\r\n")
        poll(lambda: lb.in_flight == 1)
        if close_notify:
            sock.settimeout(0.1)  # (it waits for the LB's close_notify: none comes)
            with pytest.raises(OSError):
                sock.unwrap()
        sock.close()
        poll(lambda: lb.in_flight == 0 and not worker.requests, timeout=4,
             message="the abandoned request cancelled")
    finally:
        front.stop(timeout=0.5)
        lb.stop()
        worker.stop(timeout=0.5)
        worker.requests.kill(block=False)


def test_an_https_head_evicted_past_max_connections_gets_408(tmp_path):
    # (the eviction shut the TLS socket down through gevent's SSLSocket,
    # which drops the session: a traceback, and no 408)
    import gevent
    import gevent.socket
    import gevent.ssl
    from zc_lb.front.server import FrontServer, tls_context

    def app(environ, start_response):
        start_response("200 OK", [("Content-Length", "2")])
        return [b"ok"]

    def connect(address):
        context = gevent.ssl.SSLContext(gevent.ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname, context.verify_mode = False, gevent.ssl.CERT_NONE
        return context.wrap_socket(gevent.socket.create_connection(address, timeout=5))

    ca = make_ca(str(tmp_path), "ca")
    cert = make_cert(str(tmp_path), ca, "front")
    errors = []
    hub = gevent.get_hub()
    handle_error = hub.handle_error
    hub.handle_error = lambda *error: (errors.append(error[2]), handle_error(*error))
    front = FrontServer(("127.0.0.1", 0), app, max_connections=1,
                        tls=tls_context(cert + ".pem", cert + ".key"))
    front.start()
    try:
        slow = connect(front.address)
        slow.sendall(b"GET / HTTP/1.1\r\nHost: a\r\n")  # a head begun, not ended
        gevent.sleep(0.7)  # past EVICT_AFTER
        newcomer = connect(front.address)
        newcomer.sendall(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n")
        assert newcomer.recv(65536).startswith(b"HTTP/1.1 200")
        assert slow.recv(65536).startswith(b"HTTP/1.1 408")
        assert not errors, errors
    finally:
        hub.handle_error = handle_error
        front.stop(timeout=0.5)


def _https_front(tmp_path, **options):
    """A FrontServer on HTTPS (started) answering 200 "ok"."""
    from zc_lb.front.server import FrontServer, tls_context

    def app(environ, start_response):
        start_response("200 OK", [("Content-Length", "2")])
        return [b"ok"]

    cert = make_cert(str(tmp_path), make_ca(str(tmp_path), "ca"), "front")
    front = FrontServer(("127.0.0.1", 0), app, tls=tls_context(cert + ".pem", cert + ".key"),
                        **options)
    front.start()
    return front


def _client_hello():
    """The first bytes a TLS client sends."""
    import ssl
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    client = context.wrap_bio(incoming, outgoing)
    with pytest.raises(ssl.SSLWantReadError):
        client.do_handshake()
    return outgoing.read()


def trickled_until_closed(address, data, pace=0.25, within=4.0):
    """Send ``data`` a byte every ``pace`` seconds; the seconds until the
    server closed the connection, or None if it had not within ``within``."""
    import time
    import gevent.socket
    sock = gevent.socket.create_connection(address)
    sock.settimeout(pace)
    started = time.monotonic()
    try:
        for byte in data:
            if time.monotonic() - started > within:
                return None
            try:
                sock.sendall(bytes([byte]))
                if not sock.recv(65536):
                    return time.monotonic() - started
            except socket.timeout:
                continue
            except OSError:
                return time.monotonic() - started
        return None
    finally:
        sock.close()


def test_a_tls_handshake_trickling_in_is_cut_at_the_header_timeout(tmp_path):
    # (each read had the timeout, not the handshake: a byte a second kept it open)
    front = _https_front(tmp_path, header_timeout=1.0)
    try:
        closed = trickled_until_closed(front.address, _client_hello())
        assert closed is not None and closed < 2.0, closed
    finally:
        front.stop(timeout=0.5)


def test_the_first_head_after_a_slow_tls_handshake_is_due_at_the_header_timeout(tmp_path):
    # (after the handshake the head had a header timeout of its own: from
    # the accept, twice the header timeout)
    import time
    import gevent
    import gevent.socket
    import gevent.ssl
    front = _https_front(tmp_path, header_timeout=1.0)
    try:
        started = time.monotonic()
        sock = gevent.socket.create_connection(front.address, timeout=5)
        gevent.sleep(0.6)
        context = gevent.ssl.SSLContext(gevent.ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname, context.verify_mode = False, gevent.ssl.CERT_NONE
        client = context.wrap_socket(sock)
        client.sendall(b"GET / HTTP/1.1\r\n")  # (and no more)
        answer = read_until_closed(client)
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert time.monotonic() - started < 1.4
        client.close()
    finally:
        front.stop(timeout=0.5)


def test_silent_connections_in_their_tls_handshake_make_room_past_max_connections(tmp_path):
    # (only connections waiting for a head were evicted: two silent TCP
    # connections to the HTTPS port kept every TLS client out)
    import gevent
    import gevent.socket
    import gevent.ssl
    front = _https_front(tmp_path, max_connections=2)
    try:
        silent = [gevent.socket.create_connection(front.address) for _ in range(2)]
        gevent.sleep(0.7)  # past EVICT_AFTER
        context = gevent.ssl.SSLContext(gevent.ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname, context.verify_mode = False, gevent.ssl.CERT_NONE
        for _ in range(2):
            newcomer = context.wrap_socket(gevent.socket.create_connection(front.address,
                                                                           timeout=5))
            newcomer.sendall(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n")
            assert newcomer.recv(65536).startswith(b"HTTP/1.1 200")
        assert all(sock.recv(1) == b"" for sock in silent)  # (ended to make room)
    finally:
        front.stop(timeout=0.5)


def test_idle_connections_in_their_tls_handshake_cannot_crowd_out_an_lb(pki):
    # The TLS handshake (10 s allowed) ran before the bound on connections
    # in their handshake: every idle TCP connection held a descriptor and
    # a greenlet, and at the descriptor limit an LB could not connect.
    # They count among the MAX_HANDSHAKING, the oldest closed for newer.
    import gevent
    import gevent.socket
    from test_hardening import poll
    from test_worker import LBSide
    from zc_lb.wire.connection import Connection
    from zc_lb.worker.lbs import MAX_HANDSHAKING
    from zc_lb.worker.server import Worker

    def closed(sock):
        try:
            return sock.recv(1) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    worker = Worker(lambda environ, start_response: [], tls=worker_context(
        pki["worker"] + ".pem", pki["worker"] + ".key", pki["ca"]))
    worker.start()
    held = []
    try:
        for _ in range(MAX_HANDSHAKING + 36):
            sock = gevent.socket.create_connection(worker.address)
            sock.setblocking(False)
            held.append(sock)
        poll(lambda: sum(closed(sock) for sock in held) >= 36, timeout=3,
             message="the oldest idle connections closed")
        assert not any(closed(sock) for sock in held[-MAX_HANDSHAKING:])
        context = lb_context(pki["lb"] + ".pem", pki["lb"] + ".key", pki["ca"])
        sock = context.wrap_socket(gevent.socket.create_connection(worker.address),
                                   server_hostname="127.0.0.1")
        lb = Connection(sock, "lb", LBSide(), peer="worker")
        lb.handshake(5)
        lb.start()
        poll(lambda: len(worker.lbs.connections) == 1, message="the LB kept")
        lb.close()
    finally:
        for sock in held:
            sock.close()
        worker.stop(timeout=0.5)
