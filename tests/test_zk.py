"""zc_lb.zookeeper.client against the real ZooKeeper of conftest.py: import and export
of trees, get/set/ls, links and the ``zc-lb zk`` command.  The tree
format itself is tested in test_tree.py, the recipes in test_recipes.py."""

import io
import json

import pytest

from trees import TREE
from zc_lb.cli import parsers
from zc_lb.zookeeper import recipes, tree
from zc_lb.zookeeper import client as zk
from zc_lb.errors import ConfigurationError

# Commands against the real server -----------------------------------------


def test_connect_unreachable_is_a_clear_error(zookeeper):
    from zkserver import free_port
    with pytest.raises(zk.ZooKeeperUnavailable, match="cannot reach"):
        zk.connect(f"127.0.0.1:{free_port()}", timeout=0.5)



def test_connect_to_a_server_that_never_answers_gives_up_within_the_timeout():
    # A server that takes the connection and says nothing (stopped with
    # SIGSTOP, or swamped): `zc-lb zk --timeout 0.5` took 10 s, kazoo's
    # session timeout, and then said "within 0.5s".
    import socket
    import time
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # (the kernel accepts; nobody answers)
    try:
        began = time.monotonic()
        with pytest.raises(zk.ZooKeeperUnavailable, match="cannot reach"):
            zk.connect("127.0.0.1:%d" % silent.getsockname()[1], timeout=0.5)
        assert time.monotonic() - began < 3
    finally:
        silent.close()

def test_a_missing_chroot_is_created_with_the_nodes_above_it(zk_hosts):
    # An import under it said "the tree kept changing during the import",
    # and a process started before it existed never registered.
    hosts = zk_hosts + "/sites/mysite"
    client = zk.connect(hosts, timeout=5)
    try:
        registration = recipes.Registration(client, "/lb/workers/providers/h:1", {})
        registration.start()
        assert registration.wait(10)
        zk.import_tree(client, TREE)
        assert zk.get(client, "/lb")["variance"] == 4
        registration.stop()
    finally:
        client.stop()
        client.close()
    site = zk.connect(zk_hosts, timeout=5)
    try:
        assert zk.ls(site, "/sites/mysite") == ["lb"]
    finally:
        site.stop()
        site.close()


def test_a_missing_chroot_under_nodes_the_acl_refuses_is_a_clear_error(zk_hosts):
    site = zk.connect(zk_hosts, timeout=5, credentials=("site", "s3cret"))
    site.ensure_path("/sites")
    site.stop()
    site.close()
    with pytest.raises(ConfigurationError, match="ZooKeeper refused"):
        zk.connect(zk_hosts + "/sites/other", timeout=5)


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


def test_import_never_writes_under_providers(client, other_client):
    # A provider named in the file while its worker is down was created
    # persistent: LBs tried it for ever and the worker could never register.
    text = TREE.replace("    /providers\n",
                        "    /providers\n      /127.0.0.1:9999\n        pid = 1\n")
    changes = zk.import_tree(client, text)
    assert ("skip", "/lb/workers/providers/127.0.0.1:9999") in [
        (c.action, c.path) for c in changes]
    assert zk.ls(client, "/lb/workers/providers") == []
    registration = recipes.Registration(
        other_client, "/lb/workers/providers/127.0.0.1:9999", {"pid": 2})
    registration.start()
    assert registration.wait(10)
    registration.stop()
    # Nor does --delete remove what is there, nor an import under it write.
    client.create("/lb/workers/providers/h:1", b"{}")
    assert zk.import_tree(client, TREE, delete=True) == []
    assert zk.import_tree(client, "pid = 1\n", root="/lb/workers/providers/h:2") == [
        tree.Change("skip", "/lb/workers/providers/h:2", None, -1,
                    (tree.PROVIDERS_SKIPPED,))]
    assert zk.ls(client, "/lb/workers/providers") == ["h:1"]


def test_an_import_too_large_for_one_request_commits_in_several(client):
    # One transaction over ZooKeeper's 1 MB made the server drop the
    # connection: "lost ZooKeeper" (exit 69) after 10 s, nothing written.
    text = "/big\n" + "".join(f"  /n{i:04d}\n    description = {'x' * 1000}\n"
                               for i in range(1200))
    assert len(zk.batches(zk.plan_import(client, tree.parse(text)))) == 2
    changes = zk.import_tree(client, text)
    assert len(changes) == 1201
    assert len(zk.ls(client, "/big")) == 1200
    assert zk.import_tree(client, text) == []


def test_a_node_too_large_for_zookeeper_is_refused_by_name(client):
    zk.import_tree(client, TREE)
    before = zk.export_tree(client, "/")
    huge = "x" * 1_100_000
    for dry_run in (True, False):
        with pytest.raises(ConfigurationError, match="^/lb/big: its data would be 1,100,"):
            zk.import_tree(client, TREE + f"  /big\n    description = {huge}\n",
                           dry_run=dry_run)
    with pytest.raises(ConfigurationError, match="^/lb: its data would be"):
        zk.set_properties(client, "/lb", [f"description={huge}"])
    assert zk.export_tree(client, "/") == before


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
    parser = parsers.build_parser()
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
    parser = parsers.build_parser()

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



def test_a_tree_file_that_is_not_utf8_is_refused_by_name_before_connecting(tmp_path):
    # It escaped as a UnicodeDecodeError: a traceback and exit status 1.
    path = tmp_path / "tree.txt"
    path.write_bytes(b"/lb\n  description = caf\xe9\n")
    args = parsers.build_parser().parse_args(
        ["zk", "--zookeeper", "127.0.0.1:1", "import", str(path)])
    with pytest.raises(ConfigurationError, match=r"tree.txt is not UTF-8 text: byte 0xe9"):
        zk.run_zk_command(args, io.StringIO())

# Credentials and ACLs ---------------------------------------------------------


def test_credentials_are_one_line_user_colon_password(tmp_path):
    good = tmp_path / "zk-auth"
    good.write_text("site:s3cr:et\n")
    assert zk.read_credentials(str(good)) == ("site", "s3cr:et")
    for text in ("", "nocolon\n", ":pw\n", "user:\n", "a:b\nc:d\n"):
        good.write_text(text)
        with pytest.raises(ConfigurationError) as refused:
            zk.read_credentials(str(good))
        # (what is wrong, never what the file holds)
        assert str(refused.value) == ("%s must hold one line, USER:PASSWORD (the ZooKeeper "
                                      "credentials)" % good)
    with pytest.raises(ConfigurationError, match="cannot read"):
        zk.read_credentials(str(tmp_path / "missing"))


def test_only_the_sites_credentials_read_or_change_what_they_created(zk_hosts, tmp_path):
    from kazoo.exceptions import NoAuthError

    auth = tmp_path / "zk-auth"
    auth.write_text("site:s3cret\n")
    other = tmp_path / "other-auth"
    other.write_text("site:guess\n")
    parser = parsers.build_parser()

    def run(*argv, auth_file=None):
        out = io.StringIO()
        extra = ["--zookeeper-auth-file", str(auth_file)] if auth_file else []
        args = parser.parse_args(["zk", "--zookeeper", zk_hosts, *extra, *argv])
        zk.run_zk_command(args, out)
        return out.getvalue()

    # A process with them registers: nobody else may touch what it made.
    site = zk.connect(zk_hosts, credentials=("site", "s3cret"))
    anonymous = zk.connect(zk_hosts)
    try:
        site.ensure_path("/lb/workers")
        run("set", "/lb", "variance=3", auth_file=auth)
        assert json.loads(run("get", "/lb", auth_file=auth))["variance"] == 3
        for auth_file in (None, other):  # no credentials, or the wrong ones
            with pytest.raises(ConfigurationError, match="ZooKeeper refused"):
                run("set", "/lb", "variance=9", auth_file=auth_file)
            with pytest.raises(ConfigurationError, match="ZooKeeper refused"):
                run("get", "/lb", auth_file=auth_file)
        site.create("/lb/workers/127.0.0.1:9001", b"{}", ephemeral=True)
        acl, _ = site.get_acls("/lb/workers/127.0.0.1:9001")
        assert [entry.id.scheme for entry in acl] == ["digest"]
        for attempt in (lambda: anonymous.set("/lb/workers/127.0.0.1:9001", b"{}"),
                        lambda: anonymous.delete("/lb/workers/127.0.0.1:9001"),
                        lambda: anonymous.create("/lb/workers/10.6.6.6:80", b"{}")):
            with pytest.raises(NoAuthError):
                attempt()
        assert json.loads(run("get", "/lb", auth_file=auth))["variance"] == 3
    finally:
        for client in (site, anonymous):
            client.stop()
            client.close()
