"""Shared fixtures: one real ZooKeeper per test session (tests/zkserver.py),
and clients of it for test_zk.py and test_recipes.py; a WSGI app served in
a thread (the status server, for test_status.py and test_asking.py), a
listener that speaks no HTTP and one that never answers."""

import itertools
import os
import socket
import threading
import wsgiref.simple_server

import pytest

import zc_lb
from zkserver import ZooKeeperServer

# A test that watches the pool by replacing one of its methods on the
# instance, which compiled classes do not allow: it runs on the source, as
# make test's second pass does (ZC_LB_PURE=1).
source_only = pytest.mark.skipif(
    zc_lb.build() == "compiled",
    reason="replaces a method of the compiled pool: run with ZC_LB_PURE=1")


def pytest_report_header(config):
    return "zc-lb build: " + zc_lb.build()


TESTS = os.path.dirname(os.path.abspath(__file__))

# The test files that take a second or more, longest first, as measured
# (--durations, make test's compiled and source runs on two cores).  With
# --dist loadfile a worker takes the next file in the order collected
# (make test passes --no-loadscope-reorder so that this order holds): a
# long file handed out last ran alone while the other workers idled, and
# the compiled wheel's build (test_wheel.py), about two minutes of one
# core, goes first so that the rest of the suite runs beside it.  Files
# not named here run after these, in their order; a file's tests keep
# theirs.
LONGEST_FIRST = (
    "test_wheel.py", "test_e2e.py", "test_simulations.py", "test_zk_e2e.py",
    "test_bench.py", "test_hardening.py", "test_http.py", "test_compare.py",
    "test_packaging.py", "test_processes.py", "test_worker.py", "test_compiled.py",
    "test_restart.py", "test_threads.py", "test_slow_clients.py", "test_tls.py",
    "test_workergroup.py", "test_cli.py", "test_front.py", "test_protocol.py",
    "test_connection.py", "test_playback.py", "test_soak.py", "test_relay.py",
    "test_links.py", "test_affinity.py", "test_recipes.py", "test_metrics.py",
    "test_pool.py", "test_accesslog.py", "test_http_corpus.py", "test_zk.py",
    "test_config.py", "test_lb.py", "test_demo.py", "test_typing.py",
    "test_proxyproto.py", "test_relearn.py", "test_classifier.py", "test_deployment.py",
    "test_awaiting.py", "test_loopwatch.py",
)


def misnamed(order=LONGEST_FIRST, directory=TESTS):
    """What is wrong with ``order``'s names of test files in
    ``directory``: those that name no test file there (renamed or
    removed: such a file would drop out of the order without a word),
    and those named twice."""
    wrong = ["%s (no such test file)" % name for name in order
             if not (name.startswith("test_") and name.endswith(".py")
                     and os.path.isfile(os.path.join(directory, name)))]
    wrong += ["%s (named twice)" % name for name in sorted(set(order))
              if order.count(name) > 1]
    return wrong


def pytest_configure(config):
    wrong = misnamed()
    if wrong:
        raise pytest.UsageError(
            "tests/conftest.py: LONGEST_FIRST names %s; name each test file as it is "
            "in tests/, once" % ", ".join(wrong))


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # (stable)


_chroots = itertools.count(1)


@pytest.fixture(scope="session")
def zookeeper(tmp_path_factory):
    """A running ZooKeeperServer, shared by the session; tests that stop it
    need not restart it: ``zk_hosts`` does before each test."""
    server = ZooKeeperServer(tmp_path_factory.mktemp("zookeeper"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def zk_hosts(zookeeper, request):
    """A hosts string ('127.0.0.1:PORT/chroot') with a fresh, empty chroot
    for this test, so tests never see each other's nodes."""
    from kazoo.client import KazooClient

    zookeeper.start()
    chroot = f"/test-{next(_chroots)}-{request.node.name[:40]}"
    chroot = "".join(c if c.isalnum() or c in "/-_" else "_" for c in chroot)
    client = KazooClient(zookeeper.address)
    client.start(timeout=10)
    try:
        client.ensure_path(chroot)
    finally:
        client.stop()
        client.close()
    return zookeeper.address + chroot


@pytest.fixture
def client(zk_hosts):
    """A zc_lb.zookeeper.client client of the test's chroot; closed after the test."""
    from zc_lb.zookeeper import client as zk

    clients = []

    def make():
        c = zk.connect(zk_hosts, timeout=10)
        clients.append(c)
        return c
    yield make()
    for c in clients:
        c.stop()
        c.close()


@pytest.fixture
def other_client(client, zk_hosts):
    """A second client of the same chroot, with a session of its own."""
    from zc_lb.zookeeper import client as zk

    c = zk.connect(zk_hosts, timeout=10)
    yield c
    c.stop()
    c.close()


@pytest.fixture
def procs():
    """Start a testing.Process (returned, started); each is killed after
    the test, the last started first."""
    started = []

    def start(process):
        started.append(process.start())
        return process

    yield start
    for process in reversed(started):
        process.kill()


class _QuietHandler(wsgiref.simple_server.WSGIRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def wsgi_thread():
    """wsgi_thread(app) -> "127.0.0.1:PORT" of a thread serving ``app``
    (wsgiref: blocking clients such as ``fetch`` meet a real HTTP server)."""
    servers = []

    def start(app):
        server = wsgiref.simple_server.make_server(
            "127.0.0.1", 0, app, handler_class=_QuietHandler)
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                                  daemon=True)
        thread.start()
        servers.append((server, thread))
        return "127.0.0.1:%d" % server.server_address[1]

    yield start
    for server, thread in servers:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.fixture
def not_http():
    """not_http(count) -> "127.0.0.1:PORT" where each of ``count``
    connections is answered with a line that is not HTTP (an SSH server's
    greeting), then hung up on."""
    started = []

    def start(count):
        talker = socket.socket()
        talker.bind(("127.0.0.1", 0))
        talker.listen(4)

        def talk():
            for _ in range(count):
                conn = talker.accept()[0]
                conn.recv(1024)
                conn.sendall(b"SSH-2.0-OpenSSH\r\n")
                conn.close()

        thread = threading.Thread(target=talk, daemon=True)
        thread.start()
        started.append((talker, thread))
        return "127.0.0.1:%d" % talker.getsockname()[1]

    yield start
    for talker, thread in started:
        thread.join(5)
        talker.close()


@pytest.fixture
def silent():
    """silent(count=1) -> ``count`` "127.0.0.1:PORT" addresses that take
    connections and requests and never answer (as an LB process stopped
    with SIGSTOP: the kernel accepts, no one reads)."""
    sockets = []

    def start(count=1):
        started = [socket.create_server(("127.0.0.1", 0), backlog=8) for _ in range(count)]
        sockets.extend(started)
        return ["127.0.0.1:%d" % sock.getsockname()[1] for sock in started]

    yield start
    for sock in sockets:
        sock.close()
