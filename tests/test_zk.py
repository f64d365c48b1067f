"""zc_lb.tree (pure) and zc_lb.zk against the real ZooKeeper of conftest.py."""

import io
import json
import logging
import os
import time

import gevent
import gevent.event
import pytest
from kazoo.client import KazooClient, KazooState
from kazoo.handlers.gevent import SequentialGeventHandler

from zc_lb import cli, recipes, tree, zk
from zc_lb.errors import ConfigurationError

HERE = os.path.dirname(os.path.abspath(__file__))
SAMPLE = os.path.join(HERE, os.pardir, "etc", "tree.txt")

TREE = """\
# a site
/lb
  variance = 4
  backlog_history = 9
  name = main site
  quoted = "1.0"
  /providers
  /workers
    history = 9999
    max_skill_age = 99990
    /providers
  backend -> /lb/workers
"""


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


class LogEvent(logging.Handler):
    """An event set when a logger logs a message containing ``text``."""

    def __init__(self, name, text):
        super().__init__()
        self.logger, self.text = logging.getLogger(name), text
        self.event = gevent.event.Event()

    def emit(self, record):
        if self.text in record.getMessage():
            self.event.set()

    def __enter__(self):
        self.logger.addHandler(self)
        return self.event

    def __exit__(self, *exc):
        self.logger.removeHandler(self)


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


@pytest.fixture
def client(zk_hosts):
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
    c = zk.connect(zk_hosts, timeout=10)
    yield c
    c.stop()
    c.close()


# Tree text format (pure) --------------------------------------------------


def test_tree_parse():
    root = tree.parse(TREE)
    lb = root.children["lb"]
    assert lb.properties == {"variance": 4, "backlog_history": 9,
                             "name": "main site", "quoted": "1.0"}
    assert lb.links == {"backend": "/lb/workers"}
    assert lb.children["workers"].properties["history"] == 9999
    assert lb.children["workers"].children["providers"] == tree.Node()


@pytest.mark.parametrize("text", [TREE, open(SAMPLE).read()])
def test_tree_round_trip(text):
    t = tree.parse(text)
    assert tree.parse(tree.format(t)) == t


@pytest.mark.parametrize("value", [
    4, 4.0, -1.5, True, None, "", "x", "1.0", "true", "null", " padded ",
    "two\nlines", "a # b", "a -> b", "é", [1, "a"], {"k": [None]}, '"q',
])
def test_value_round_trip(value):
    root = tree.Node(properties={"k": value})
    assert tree.parse(tree.format(root)).properties == {"k": value}
    assert type(tree.parse_value(tree.format_value(value))) is type(value)


def test_parse_assignment():
    assert tree.parse_assignment("a=4") == ("a", 4)
    assert tree.parse_assignment("a = x=y") == ("a", "x=y")
    assert tree.parse_assignment('v="2"') == ("v", "2")
    with pytest.raises(ConfigurationError):
        tree.parse_assignment("novalue")


@pytest.mark.parametrize("text, line", [
    ("/a\n  x = 1\n    y = 2\n", 3),
    ("/a\nx = 1\n", 2),
    ("/a\n\t/b\n", 2),
    ("# c\n\njunk\n", 3),
    ("/a\n  /b\n  /b\n", 3),
    ("/a\n  k = 1\n  k = 2\n", 3),
    ("/a/b\n", 1),
    ("/a\n  l ->\n", 2),
    ("/a\n  /b\n  b -> /c\n", 3),
])
def test_parse_errors_name_the_line(text, line):
    with pytest.raises(ConfigurationError) as info:
        tree.parse(text)
    bad = text.splitlines()[line - 1].strip()
    assert str(info.value).startswith(f"line {line}: ")
    assert repr(bad) in str(info.value)


class DictReader:
    def __init__(self, nodes):  # path -> Stored
        self.nodes = nodes

    def node(self, path):
        return self.nodes.get(path)

    def children(self, path):
        prefix = path.rstrip("/") + "/"
        return [p[len(prefix):] for p in self.nodes
                if p.startswith(prefix) and p != prefix
                and "/" not in p[len(prefix):]]


def test_plan_is_pure_and_spares_ephemerals():
    reader = DictReader({
        "/": tree.Stored({}, 0, False),
        "/lb": tree.Stored({"variance": 1, "old": 2}, 7, False),
        "/lb/gone": tree.Stored({}, 0, False),
        "/lb/live": tree.Stored({}, 0, False),
        "/lb/live/h:1": tree.Stored({}, 0, True),
        "/lb/h:2": tree.Stored({}, 0, True),
    })
    desired = tree.parse("/lb\n  variance = 4\n  /new\n    a = 1\n")
    changes = tree.plan(reader, desired, "/", delete=True)
    assert [(c.action, c.path) for c in changes] == [
        ("set", "/lb"), ("create", "/lb/new"), ("delete", "/lb/gone"),
        ("skip", "/lb/live")]
    assert changes[0].data == {"variance": 4} and changes[0].version == 7
    assert str(changes[0]) == "set /lb\n  variance = 4 (was 1)\n  remove old = 2"
    without_delete = tree.plan(reader, desired, "/")
    assert without_delete[0].data == {"variance": 4, "old": 2}


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


# Commands against the real server -----------------------------------------


def test_connect_unreachable_is_a_clear_error(zookeeper):
    from zkserver import free_port
    with pytest.raises(zk.ZooKeeperUnavailable, match="cannot reach"):
        zk.connect(f"127.0.0.1:{free_port()}", timeout=0.5)


def test_import_export_idempotent(client):
    changes = zk.import_tree(client, TREE)
    assert [c.action for c in changes] == ["create"] * 4
    assert zk.import_tree(client, TREE) == []
    exported = zk.export_tree(client, "/lb")
    assert tree.parse(exported) == tree.parse(TREE)
    assert tree.parse(zk.export_tree(client, "/")) == tree.parse(TREE)
    assert zk.get(client, "/lb")["backend ->"] == "/lb/workers"


def test_dry_run_changes_nothing(client):
    zk.import_tree(client, TREE)
    before = zk.export_tree(client, "/")
    out = io.StringIO()
    changed = TREE.replace("variance = 4", "variance = 2") + "/extra\n"
    changes = zk.import_tree(client, changed, dry_run=True, out=out)
    assert out.getvalue() == "set /lb\n  variance = 2 (was 4)\ncreate /extra\n"
    assert len(changes) == 2
    assert zk.export_tree(client, "/") == before
    zk.import_tree(client, changed)
    assert zk.get(client, "/lb")["variance"] == 2


def test_malformed_file_changes_nothing(client):
    zk.import_tree(client, TREE)
    before = zk.export_tree(client, "/")
    with pytest.raises(ConfigurationError, match="line 3"):
        zk.import_tree(client, "/lb\n  variance = 1\n oops\n")
    assert zk.export_tree(client, "/") == before


def test_import_keeps_or_deletes_and_spares_ephemerals(client):
    zk.import_tree(client, TREE)
    zk.set_properties(client, "/lb", ["extra=1"])
    client.create("/lb/workers/providers/h:1", b"{}", ephemeral=True)
    client.create("/lb/old/providers/h:2", b"{}", ephemeral=True,
                  makepath=True)
    client.ensure_path("/lb/stale/child")
    assert zk.import_tree(client, TREE) == []  # absent things are kept
    changes = zk.import_tree(client, TREE, delete=True)
    assert [(c.action, c.path) for c in changes] == [
        ("set", "/lb"), ("skip", "/lb/old"),
        ("delete", "/lb/stale/child"), ("delete", "/lb/stale")]
    assert "extra" not in zk.get(client, "/lb")
    assert zk.ls(client, "/lb") == ["old", "providers", "workers"]
    assert zk.ls(client, "/lb/workers/providers") == ["h:1"]
    # Naming an ephemeral node in the file does not touch it either.
    changes = zk.import_tree(client, TREE.replace(
        "    /providers\n", "    /providers\n      /h:1\n        pid = 3\n"))
    assert [(c.action, c.path) for c in changes] == [
        ("skip", "/lb/workers/providers/h:1")]
    assert zk.get(client, "/lb/workers/providers/h:1") == {}


def test_import_under_a_root(client):
    out = io.StringIO()
    zk.import_tree(client, "top = 1\n/a\n", root="/x/y", out=out)
    assert out.getvalue() == "create /x\ncreate /x/y\n  top = 1\ncreate /x/y/a\n"
    assert zk.get(client, "/x/y") == {"top": 1}


def test_set_get_ls(client):
    zk.import_tree(client, TREE)
    new = zk.set_properties(client, "/lb", ["variance=2.5", "name=other site",
                                            'tag="7"', "flags=[1,2]"])
    assert new == zk.get(client, "/lb")
    assert new["variance"] == 2.5 and new["name"] == "other site"
    assert new["tag"] == "7" and new["flags"] == [1, 2]
    assert new["backlog_history"] == 9  # kept
    assert zk.ls(client, "/lb") == ["providers", "workers"]
    with pytest.raises(ConfigurationError, match="no such node"):
        zk.get(client, "/nope")
    with pytest.raises(ConfigurationError, match="no such node"):
        zk.set_properties(client, "/nope", ["a=1"])


def test_links_resolved(client):
    zk.import_tree(client, TREE + "/site\n  lb -> /lb\n  w -> lb/backend\n")
    assert zk.resolve(client, "/lb/backend") == "/lb/workers"
    assert zk.resolve(client, "/site/lb/backend/providers") == \
        "/lb/workers/providers"
    assert zk.resolve(client, "/site/w") == "/lb/workers"
    assert zk.resolve(client, "/site/lb/new/x") == "/lb/new/x"
    assert zk.get(client, "/site/w")["history"] == 9999
    assert zk.ls(client, "/site/lb") == ["providers", "workers"]
    zk.import_tree(client, "/loop\n  a -> /loop/b\n  b -> /loop/a\n")
    with pytest.raises(ConfigurationError, match="too many links"):
        zk.resolve(client, "/loop/a")


def test_cli(client, zk_hosts, tmp_path, capsys):
    parser = cli.build_parser()
    path = tmp_path / "tree.txt"
    path.write_text(TREE)

    def run(*argv):
        out = io.StringIO()
        args = parser.parse_args(["zk", "--zookeeper", zk_hosts, *argv])
        assert zk.run_zk_command(args, out) == 0
        return out.getvalue()
    # TREE has properties that are no settings (name, quoted): --force
    assert run("import", str(path), "--dry-run", "--force").startswith("create /lb\n")
    assert run("ls", "/") == ""  # the dry run wrote nothing
    assert run("import", str(path), "--force").startswith("create /lb\n")
    assert run("import", str(path), "--force") == "no changes\n"
    run("set", "/lb", "variance=3")
    assert json.loads(run("get", "/lb"))["variance"] == 3
    assert run("ls", "/lb") == "providers\nworkers\n"
    assert tree.parse(run("export", "/lb"))
    path.write_text("/lb\n bad\n")
    with pytest.raises(ConfigurationError, match="line 2"):
        run("import", str(path))


def test_cli_refuses_bad_and_unknown_settings(client, zk_hosts, tmp_path):
    parser = cli.build_parser()

    def run(*argv):
        args = parser.parse_args(["zk", "--zookeeper", zk_hosts, *argv])
        return zk.run_zk_command(args, io.StringIO())
    client.ensure_path("/lb/workers")
    for assignment, message in (("variance=abc", "bad value for variance"),
                                ("variance=nan", "finite"),
                                ("backlog_history=2.7", "bad value for backlog_history"),
                                ("varience=5", "unknown setting 'varience'"),
                                ("history=5", "a setting of the workers node")):
        with pytest.raises(ConfigurationError, match=message):
            run("set", "/lb", assignment, "unskilled_score=2")
    assert zk.get(client, "/lb") == {}  # nothing written, not even the good one
    run("set", "/lb", "variance=2", "description=the main site")
    run("set", "/lb/workers", "history=50")
    run("set", "/lb", "anything=1", "--force")
    assert zk.get(client, "/lb") == {"variance": 2, "description": "the main site",
                                      "anything": 1}
    path = tmp_path / "tree.txt"
    path.write_text("/lb\n  variance = 2\n  /workers\n    max_skil_age = 5\n")
    with pytest.raises(ConfigurationError, match=r"line 4: unknown setting 'max_skil_age'"):
        run("import", str(path))
    path.write_text("/other\n")
    with pytest.raises(ConfigurationError, match="--delete-at-root"):
        run("import", str(path), "--delete")
    assert client.exists("/lb")  # nothing deleted
    run("import", str(path), "/", "--delete", "--delete-at-root")
    assert not client.exists("/lb")


# Recipes --------------------------------------------------------------------


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
    with LogEvent("zc_lb.recipes", "bad properties") as logged:
        client.set("/lb", b"{not json")
        assert logged.wait(10)
    assert watch.properties["variance"] == 2  # the last good kept
    client.set("/lb", json.dumps({"variance": 3}).encode())
    seen.wait_for(lambda v: v == {"variance": 3})
    assert len(seen.values) == count + 1
    watch.stop()


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
