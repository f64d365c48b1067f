"""zc_lb.zookeeper.recipes: Registration, ProvidersWatch and PropertiesWatch against
the real ZooKeeper of conftest.py, and the pure majority_version."""

import json
import socket
import time

import gevent
import gevent.event
import gevent.socket
import pytest
from kazoo.client import KazooClient, KazooState
from kazoo.handlers.gevent import SequentialGeventHandler

from logevents import LogEvent
from trees import TREE
from zc_lb.zookeeper import recipes
from zc_lb.zookeeper import client as zk
from zc_lb.errors import ConfigurationError


# Helpers ------------------------------------------------------------------


class Recorder:
    """A callback that records what it is given; wait_for waits on it."""

    def __init__(self):
        self.values = []
        self._changed = gevent.event.Event()

    def __call__(self, value):
        self.values.append(value)
        self._changed.set()

    def wait_for(self, predicate, timeout=10.0):
        deadline = time.monotonic() + timeout
        while True:
            self._changed.clear()
            if self.values and predicate(self.values[-1]):
                return self.values[-1]
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._changed.wait(remaining):
                raise AssertionError(f"timed out; reports: {self.values}")


def state_event(client, wanted):
    """An event set when ``client`` next enters state ``wanted``."""
    event = gevent.event.Event()

    def listener(state):
        if state == wanted:
            event.set()
            return True
    client.add_listener(listener)
    return event


def expire_session(client, hosts):
    """Expire ``client``'s session the way the server does: a second client
    takes the session over and closes it."""
    lost = state_event(client, KazooState.LOST)
    other = KazooClient(hosts, client_id=client.client_id,
                        handler=SequentialGeventHandler())
    other.start(timeout=10)
    other.stop()
    other.close()
    assert lost.wait(10), "session did not expire"


class Cuttable:
    """A TCP proxy on loopback to ZooKeeper (``target``, HOST:PORT) that can
    cut its clients off, as a partition does: ``cut()`` drops their
    connections and refuses new ones until ``heal()``."""

    def __init__(self, target):
        from gevent.server import StreamServer

        self.target = target
        self.cut_off = False
        self.sockets = []
        self.server = StreamServer(("127.0.0.1", 0), self._serve)
        self.server.start()
        self.address = "127.0.0.1:%d" % self.server.server_port

    def _serve(self, sock, _):
        if self.cut_off:
            sock.close()
            return
        host, port = self.target.rsplit(":", 1)
        upstream = gevent.socket.create_connection((host, int(port)), 5)
        for end in (sock, upstream):
            end.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sockets += [sock, upstream]
        back = gevent.spawn(self._pump, upstream, sock)
        self._pump(sock, upstream)
        back.join(5)

    @staticmethod
    def _pump(source, sink):
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        for end in (source, sink):
            try:
                end.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self):
        self.cut_off = True
        for end in self.sockets:
            try:
                end.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.sockets = []

    def heal(self):
        self.cut_off = False

    def stop(self):
        self.cut()
        self.server.stop()


# Pure ------------------------------------------------------------------------


def test_majority_version():
    def workers(*versions):
        return {f"h:{i}": {"version": v} for i, v in enumerate(versions)}
    assert recipes.majority_version({}) is None
    assert recipes.majority_version(workers("1", "2", "2")) == "2"
    assert recipes.majority_version(workers("1", "2"), current="1") == "1"
    assert recipes.majority_version(workers("1", "2"), current="2") == "2"
    assert recipes.majority_version(workers("1", "2"), current="3") == "2"
    assert recipes.majority_version(workers("1", "1", "2"), current="2") == "1"
    assert recipes.majority_version({"h:1": {}}) is None
    assert recipes.of_version(workers("1", "2"), "2") == {"h:1": {"version": "2"}}


# Against the real server ------------------------------------------------------ --------------------------------------------------------------------


def test_registration_survives_session_expiry(client, zk_hosts):
    reg = recipes.Registration(client, "/lb/workers/providers/h:1", {"pid": 1})
    reg.start()
    assert reg.wait(10) and reg.registered
    data, stat = client.get("/lb/workers/providers/h:1")
    assert json.loads(data) == {"pid": 1}
    assert stat.ephemeralOwner == client.client_id[0]
    old_session = client.client_id[0]
    expire_session(client, zk_hosts)
    assert reg.wait(10)
    _, stat = client.get("/lb/workers/providers/h:1")
    assert stat.ephemeralOwner == client.client_id[0] != old_session
    reg.stop()
    assert client.exists("/lb/workers/providers/h:1") is None


def test_registration_recreated_when_deleted(client, other_client):
    reg = recipes.Registration(client, "/p/h:1", {})
    reg.start()
    assert reg.wait(10)
    gone = gevent.event.Event()
    other_client.exists("/p/h:1", watch=lambda e: gone.set())
    other_client.delete("/p/h:1")
    assert gone.wait(5)
    appeared = gevent.event.Event()

    def check(event=None):
        if other_client.exists("/p/h:1", watch=check):
            appeared.set()
    check()
    assert appeared.wait(10)
    reg.stop()


def test_registration_waits_out_another_session(client, other_client):
    other_client.create("/p/h:1", b"{}", ephemeral=True, makepath=True)
    reg = recipes.Registration(client, "/p/h:1", {"pid": 2})
    reg.start()
    assert not reg.wait(0.5)
    other_client.stop()  # its session closes, its node goes
    assert reg.wait(10)
    assert json.loads(client.get("/p/h:1")[0]) == {"pid": 2}
    reg.stop()


def test_registration_blocked_by_a_persistent_node_says_so(client, other_client):
    other_client.create("/p/h:1", b"{}", makepath=True)  # by hand, or an old import
    reg = recipes.Registration(client, "/p/h:1", {"pid": 2})
    with LogEvent("zc_lb.zookeeper.recipes", "/p/h:1 is a persistent node") as logged:
        reg.start()
        assert logged.wait(10)
    assert not reg.registered
    other_client.delete("/p/h:1")
    assert reg.wait(10)
    assert json.loads(client.get("/p/h:1")[0]) == {"pid": 2}
    reg.stop()


def test_registration_follows_links(client):
    zk.import_tree(client, TREE)
    reg = recipes.Registration(client, "/lb/backend/providers/h:1", {})
    reg.start()
    assert reg.wait(10)
    assert client.exists("/lb/workers/providers/h:1")
    reg.stop()


def test_providers_come_and_go(client, other_client):
    zk.import_tree(client, TREE)
    seen = Recorder()
    watch = recipes.ProvidersWatch(client, "/lb/backend/providers", seen)
    watch.start()
    assert seen.wait_for(lambda v: v == {}) == {}
    regs = [recipes.Registration(other_client, f"/lb/workers/providers/h:{i}",
                            {"version": "1", "pid": i}) for i in (1, 2)]
    for reg in regs:
        reg.start()
    seen.wait_for(lambda v: v == {"h:1": {"version": "1", "pid": 1},
                                  "h:2": {"version": "1", "pid": 2}})
    regs[0].stop()
    seen.wait_for(lambda v: set(v) == {"h:2"})
    # A provider replaced under the same address is re-read.
    regs[1].stop()
    other_client.create("/lb/workers/providers/h:2", b'{"version": "2"}',
                        ephemeral=True)
    seen.wait_for(lambda v: v == {"h:2": {"version": "2"}})
    watch.stop()


def test_a_provider_with_data_nested_too_deep_is_one_without_data(client, other_client):
    # json.loads raised RecursionError, no ValueError: every step failed and
    # no worker was added or removed any more.
    deep = b"[" * 100_000 + b"]" * 100_000
    other_client.create("/p/bad:1", deep, makepath=True)
    seen = Recorder()
    watch = recipes.ProvidersWatch(client, "/p", seen)
    watch.start()
    seen.wait_for(lambda v: v == {"bad:1": {}})
    other_client.create("/p/h:1", b'{"pid": 1}', ephemeral=True)
    seen.wait_for(lambda v: v == {"bad:1": {}, "h:1": {"pid": 1}})
    watch.stop()
    with pytest.raises(ValueError, match="nested too deeply"):
        zk.decode(deep)
    with pytest.raises(ConfigurationError, match="not a JSON object"):
        zk.get(client, "/p/bad:1")


def test_bad_provider_data_is_logged_with_its_node_and_what_is_wrong(client, other_client):
    # It said "provider bad:2: data is not a JSON object", bytes that are
    # no UTF-8 too, and named no node.
    seen = Recorder()
    watch = recipes.ProvidersWatch(client, "/p", seen)
    watch.start()
    seen.wait_for(lambda v: v == {})
    with LogEvent("zc_lb.zookeeper.recipes",
                  "/p/bad:2: bad provider data ('utf-8' codec can't decode") as logged:
        other_client.create("/p/bad:2", b"\xff\xfe", ephemeral=True, makepath=True)
        assert logged.wait(10)
    seen.wait_for(lambda v: v == {"bad:2": {}})
    watch.stop()


def test_providers_missing_path_then_created(client):
    seen = Recorder()
    watch = recipes.ProvidersWatch(client, "/later/providers", seen)
    watch.start()
    seen.wait_for(lambda v: v == {})
    client.create("/later/providers/h:1", b"{}", makepath=True)
    seen.wait_for(lambda v: set(v) == {"h:1"})
    watch.stop()


def _watching_one_provider(client, other_client):
    """A provider h:1 registered by one client, watched by the other."""
    reg = recipes.Registration(other_client, "/w/providers/h:1", {})
    reg.start()
    assert reg.wait(10)
    seen = Recorder()
    watch = recipes.ProvidersWatch(client, "/w/providers", seen)
    watch.start()
    seen.wait_for(lambda v: set(v) == {"h:1"})
    return reg, watch, seen


def test_providers_kept_while_zookeeper_down(zookeeper, client, other_client):
    reg, watch, seen = _watching_one_provider(client, other_client)
    suspended = state_event(client, KazooState.SUSPENDED)
    zookeeper.stop()
    assert suspended.wait(10)
    # A worker started while ZooKeeper is down registers when it is back.
    late = recipes.Registration(other_client, "/w/providers/h:2", {})
    late.start()
    zookeeper.start()
    seen.wait_for(lambda v: set(v) == {"h:1", "h:2"}, timeout=15)
    assert [set(v) for v in seen.values] == [{"h:1"}, {"h:1", "h:2"}]
    watch.stop()


def test_providers_after_session_expiry(client, other_client, zk_hosts):
    reg, watch, seen = _watching_one_provider(client, other_client)
    expire_session(client, zk_hosts)
    reg2 = recipes.Registration(other_client, "/w/providers/h:2", {})
    reg2.start()
    seen.wait_for(lambda v: set(v) == {"h:1", "h:2"})
    # The watcher's own expiry reported nothing spurious.
    assert [set(v) for v in seen.values] == [{"h:1"}, {"h:1", "h:2"}]
    expire_session(other_client, zk_hosts)  # workers re-register
    assert reg.wait(10) and reg2.wait(10)
    reg.stop()
    seen.wait_for(lambda v: set(v) == {"h:2"})
    watch.stop()


def test_providers_lost_with_our_session_are_kept_while_they_register_again(
        zk_hosts, other_client):
    # Cut off from ZooKeeper past our session, as the providers were: back
    # first, we found none registered and dropped every one (an LB, its
    # every worker), to take them back one by one as they came.
    server, chroot = zk_hosts.split("/", 1)
    proxy = Cuttable(server)
    watcher = zk.connect("%s/%s" % (proxy.address, chroot))
    try:
        for name in ("h:1", "h:2"):
            other_client.create("/w/providers/" + name, b"{}", ephemeral=True, makepath=True)
        seen = Recorder()
        watch = recipes.ProvidersWatch(watcher, "/w/providers", seen)
        watch.grace = 2.0
        watch.start()
        seen.wait_for(lambda v: set(v) == {"h:1", "h:2"})
        suspended = state_event(watcher, KazooState.SUSPENDED)
        session = watcher.client_id  # (None once cut off)
        proxy.cut()
        assert suspended.wait(10)
        for name in ("h:1", "h:2"):  # their sessions ended
            other_client.delete("/w/providers/" + name)
        thief = KazooClient(zk_hosts, client_id=session,
                            handler=SequentialGeventHandler())
        thief.start(timeout=10)  # (takes our session over, and ends it)
        thief.stop()
        thief.close()
        lost = state_event(watcher, KazooState.LOST)
        with LogEvent("zc_lb.zookeeper.recipes", "keeping 2 providers") as kept:
            proxy.heal()
            assert lost.wait(10)
            assert kept.wait(10), seen.values  # (not: [..., {}], every provider dropped)
        other_client.create("/w/providers/h:1", b"{}", ephemeral=True)  # back in time
        seen.wait_for(lambda v: set(v) == {"h:1"}, timeout=10)  # h:2, never back, goes
        assert [set(v) for v in seen.values] == [{"h:1", "h:2"}, {"h:1"}]
        watch.stop()
    finally:
        watcher.stop()
        watcher.close()
        proxy.stop()


def test_properties_live(client):
    seen = Recorder()
    watch = recipes.PropertiesWatch(client, "/lb", seen)
    watch.start()
    seen.wait_for(lambda v: v == {})  # no node: defaults
    zk.import_tree(client, TREE)
    seen.wait_for(lambda v: v.get("variance") == 4)
    assert "backend ->" not in seen.values[-1]  # links are not settings
    zk.set_properties(client, "/lb", ["variance=2"])
    seen.wait_for(lambda v: v.get("variance") == 2)
    count = len(seen.values)
    with LogEvent("zc_lb.zookeeper.recipes", "bad properties") as logged:
        client.set("/lb", b"{not json")
        assert logged.wait(10)
    assert watch.properties["variance"] == 2  # the last good kept
    client.set("/lb", json.dumps({"variance": 3}).encode())
    seen.wait_for(lambda v: v == {"variance": 3})
    assert len(seen.values) == count + 1
    watch.stop()


def test_a_watch_the_acl_refuses_says_so_in_one_line_and_retries_slowly(
        zk_hosts, client, caplog):
    site = zk.connect(zk_hosts, credentials=("site", "s3cret"))
    try:
        site.create("/lb", b'{"variance": 2}')
        watch = recipes.PropertiesWatch(client, "/lb", Recorder())
        with LogEvent("zc_lb.zookeeper.recipes", "ZooKeeper refused") as logged:
            watch.start()
            assert logged.wait(10)
        gevent.sleep(1.5)  # (a second later, another error was logged)
        watch.stop()
    finally:
        site.stop()
        site.close()
    logged = [r for r in caplog.records if r.name == "zc_lb.zookeeper.recipes"]
    assert len(logged) == 1 and logged[0].exc_info is None


def test_registration_stop_is_bounded_when_zookeeper_is_down(
        zookeeper, client):
    reg = recipes.Registration(client, "/p/h:1", {})
    reg.start()
    assert reg.wait(10)
    suspended = state_event(client, KazooState.SUSPENDED)
    zookeeper.stop()
    assert suspended.wait(10)
    started = time.monotonic()
    reg.stop(timeout=0.5)  # a worker's SIGTERM must not hang on ZooKeeper
    assert time.monotonic() - started < 2
    assert not reg.registered


def test_a_provider_held_through_sessions_that_expire_again_keeps_its_first_time(monkeypatch):
    # Each expiry held every provider reported, those held already among
    # them, for ``grace`` seconds from then: sessions that expired again
    # and again kept a provider gone for good.
    class Handler:
        def spawn(self, *args):
            pass

    watch = recipes.ProvidersWatch.__new__(recipes.ProvidersWatch)
    watch.client, watch._held, watch.grace = type("C", (), {"handler": Handler()})(), {}, 10.0
    watch.path = "/w/providers"
    now = [100.0]
    monkeypatch.setattr(recipes.time, "monotonic", lambda: now[0])
    watch.providers = {"gone:1": {}, "back:2": {}}
    watch._session_lost()
    assert watch._with_held({}) == {"gone:1": {}, "back:2": {}}  # (back at 100: kept to 110)
    now[0] = 106.0
    watch.providers = watch._with_held({"back:2": {}})
    watch._session_lost()  # (again: "back:2" is held afresh, "gone:1" still to 110)
    now[0] = 108.0
    assert watch._with_held({}) == {"gone:1": {}, "back:2": {}}
    now[0] = 111.0
    assert watch._with_held({}) == {"back:2": {}}  # (held to 118)
    now[0] = 118.0
    assert watch._with_held({}) == {}
