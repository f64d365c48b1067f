"""ZooKeeper mode end to end: real ZooKeeper, real worker and LB processes."""

import json
import os
import signal
import time
import urllib.request

import pytest
from kazoo.client import KazooClient

from zc_lb.testing import LBProcess, WorkerProcess, http_get, wait_for

TESTS = os.path.dirname(os.path.abspath(__file__))
ENV = {"PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")}
TREE = """\
/lb
  variance = 2
  /providers
  /workers
    history = 3
    /providers
"""


@pytest.fixture
def site(zk_hosts):
    """A tree in a fresh chroot, a kazoo client on it, and process makers."""
    client = KazooClient(zk_hosts)
    client.start(timeout=10)
    from zc_lb.zookeeper import client as zk
    zk.import_tree(client, TREE)
    started = []

    def worker(*args):
        process = WorkerProcess("apps:app", "--zookeeper", zk_hosts, "--path", "/lb/workers",
                                *args, env=ENV).start()
        started.append(process)
        return process

    def lb(*args):
        process = LBProcess([], "--zookeeper", zk_hosts, "--path", "/lb",
                            "--status", "127.0.0.1:0", *args).start()
        process.status_address = process.said("zc-lb status on ")
        started.append(process)
        return process

    class Site:
        pass

    s = Site()
    s.client, s.worker, s.lb, s.hosts = client, worker, lb, zk_hosts
    yield s
    for process in reversed(started):
        if process.process.poll() is None:
            os.kill(process.pid, signal.SIGCONT)
        process.kill()
    client.stop()
    client.close()


def status(lb):
    with urllib.request.urlopen("http://%s/" % lb.status_address, timeout=5) as response:
        return json.load(response)


def in_pool(lb):
    return sorted(a for a, w in status(lb)["workers"].items() if w.get("in_pool"))


def get(lb, host="a.example", path="/"):
    return http_get(lb.address, path, host)


def providers(client, path="/lb/workers/providers"):
    return sorted(client.get_children(path))


def test_workers_register_and_lbs_discover_them(site):
    w1 = site.worker("--version", "1.0", "--description", "first")
    w2 = site.worker("--version", "1.0")
    # A worker says it listens when it serves; it registers right after.
    wait_for(lambda: providers(site.client) == sorted([w1.address, w2.address]))
    data = json.loads(site.client.get("/lb/workers/providers/" + w1.address)[0])
    assert data == {"pid": w1.pid, "version": "1.0", "description": "first"}
    lb = site.lb()
    wait_for(lambda: in_pool(lb) == sorted([w1.address, w2.address]))
    assert get(lb)[0] == 200
    lb_node = json.loads(site.client.get("/lb/providers/" + lb.address)[0])
    assert lb_node["status"] == lb.status_address and lb_node["pid"] == lb.pid
    assert w2.terminate() == 0  # deregisters, then drains
    assert providers(site.client) == [w1.address]
    wait_for(lambda: in_pool(lb) == [w1.address])


def test_settings_change_live(site):
    w1 = site.worker()
    lb = site.lb()
    wait_for(lambda: in_pool(lb) == [w1.address])
    assert status(lb)["pool"]["variance"] == 2
    site.client.set("/lb", json.dumps({"variance": 5.5, "backlog_history": 4}).encode())
    wait_for(lambda: status(lb)["pool"]["variance"] == 5.5)
    assert status(lb)["pool"]["backlog_history"] == 4
    site.client.set("/lb", json.dumps({"variance": -1}).encode())  # refused, kept
    time.sleep(0.3)
    assert status(lb)["pool"]["variance"] == 5.5
    # history = 3 in the tree: a résumé after every 3 requests
    for _ in range(3):
        get(lb, host="live.example")
    wait_for(lambda: "live.example" in status(lb)["workers"][w1.address]["skills"])


def test_worker_settings_change_live(site):
    w1 = site.worker()
    lb = site.lb()
    wait_for(lambda: in_pool(lb) == [w1.address])
    for _ in range(3):  # history = 3: a résumé after every 3 requests
        get(lb, host="old.example")
    site.client.set("/lb/workers", json.dumps(
        {"history": 3, "max_skill_age": 10**6, "max_classes": 1}).encode())

    def resume_of_one_class():
        for _ in range(3):
            get(lb, host="new.example")
        return set(status(lb)["workers"][w1.address]["skills"]) == {"new.example"}
    wait_for(resume_of_one_class, message="a résumé of the one class max_classes keeps")


def test_two_lbs_share_the_workers_and_both_get_resumes(site):
    site.worker(), site.worker()
    lb1, lb2 = site.lb(), site.lb()
    for lb in (lb1, lb2):
        wait_for(lambda: len(in_pool(lb)) == 2)
    for _ in range(6):  # whoever serves them, some worker sends a résumé
        assert get(lb1, host="shared.example")[0] == 200
    for lb in (lb1, lb2):
        wait_for(lambda: any("shared.example" in w.get("skills", {})
                             for w in status(lb)["workers"].values()),
                 message="résumé at every LB")
    assert sorted(site.client.get_children("/lb/providers")) == sorted([lb1.address, lb2.address])


def test_two_lbs_hear_each_others_keys_until_an_operator_keeps_books_separate(site):
    # frames.Keys: with two LBs counted and every worker relaying, each
    # LB books where the other sent keys and routes as one LB would;
    # separate_books, set live, turns it off.
    site.worker(), site.worker()
    lb1, lb2 = site.lb(), site.lb()
    for lb in (lb1, lb2):
        wait_for(lambda: len(in_pool(lb)) == 2)
        wait_for(lambda: status(lb)["pool"]["keys_relayed"], message="keys relayed")
    for i in range(20):
        assert get(lb1, host="shared.example", path="/page/%d" % i)[0] == 200
        assert get(lb2, host="shared.example", path="/page/%d" % i)[0] == 200
    site.client.set("/lb", json.dumps({"separate_books": True}).encode())
    for lb in (lb1, lb2):
        wait_for(lambda: not status(lb)["pool"]["keys_relayed"], message="books separate")
        assert status(lb)["pool"]["separate_books"] is True
    assert get(lb2, host="shared.example", path="/page/1")[0] == 200


def test_zookeeper_down_requests_flow_and_new_workers_found_after(site, zookeeper):
    w1 = site.worker()
    lb = site.lb()
    wait_for(lambda: in_pool(lb) == [w1.address])
    zookeeper.stop()
    try:
        for _ in range(10):
            assert get(lb)[0] == 200
        time.sleep(1)
        assert in_pool(lb) == [w1.address]
        assert get(lb)[0] == 200
    finally:
        zookeeper.start()
    w2 = site.worker()
    wait_for(lambda: in_pool(lb) == sorted([w1.address, w2.address]), timeout=20)


def test_session_expiry_ends_with_everyone_registered_again(site):
    w1 = site.worker()
    lb = site.lb()
    wait_for(lambda: in_pool(lb) == [w1.address])
    for process in (w1, lb):  # frozen past the session timeout: the session expires
        os.kill(process.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: providers(site.client) == [], timeout=20, message="worker node gone")
        wait_for(lambda: site.client.get_children("/lb/providers") == [], timeout=20)
    finally:
        for process in (w1, lb):
            os.kill(process.pid, signal.SIGCONT)
    wait_for(lambda: providers(site.client) == [w1.address], timeout=20)
    wait_for(lambda: site.client.get_children("/lb/providers") == [lb.address], timeout=20)
    wait_for(lambda: in_pool(lb) == [w1.address], timeout=20)
    assert get(lb)[0] == 200


def test_a_dead_worker_is_dropped_and_its_node_goes(site):
    w1, w2 = site.worker(), site.worker()
    lb = site.lb()
    wait_for(lambda: len(in_pool(lb)) == 2)
    w2.kill()
    wait_for(lambda: in_pool(lb) == [w1.address], timeout=10)
    wait_for(lambda: providers(site.client) == [w1.address], timeout=20)
    wait_for(lambda: w2.address not in status(lb)["workers"], timeout=10)
    assert get(lb)[0] == 200


def test_single_version_follows_the_majority(site):
    old = [site.worker("--version", "1"), site.worker("--version", "1")]
    new = [site.worker("--version", "2")]
    lb = site.lb("--single-version")
    wait_for(lambda: in_pool(lb) == sorted(w.address for w in old))
    # The other version's worker is shown idle, with its version (it
    # disappeared from the page, the JSON and the CLI).
    idle = status(lb)["workers"][new[0].address]
    assert (idle["standby"], idle["version"], idle["in_pool"]) == (True, "2", False)
    new += [site.worker("--version", "2"), site.worker("--version", "2")]
    wait_for(lambda: in_pool(lb) == sorted(w.address for w in new), timeout=15)
    text = get(lb)[1]
    assert text.split()[0] in {w.address for w in new}
    doc = status(lb)["workers"]
    assert all(doc[w.address]["standby"] and doc[w.address]["version"] == "1" for w in old)


def test_reset_skills_through_zookeeper_resets_lbs_and_workers(site):
    # After a classifier change an operator runs `zc-lb reset-skills`:
    # every LB forgets its skills and every worker sends an empty résumé.
    site.worker()
    lb1, lb2 = site.lb(), site.lb()
    for lb in (lb1, lb2):
        wait_for(lambda: len(in_pool(lb)) == 1)
        wait_for(lambda: status(lb)["pool"]["lbs"] == 2, message="LBs counted")
    for _ in range(6):
        assert get(lb1, host="old.example")[0] == 200

    def skilled(lb):
        return {c for w in status(lb)["workers"].values() for c in w.get("skills", {})}
    wait_for(lambda: "old.example" in skilled(lb2), message="résumé at the LBs")
    from zc_lb import cli
    assert cli.main(["reset-skills", "--zookeeper", site.hosts, "--path", "/lb"]) == 0
    for lb in (lb1, lb2):
        wait_for(lambda: status(lb)["pool"]["skill_resets"] == 1, message="LB reset")
        wait_for(lambda: "old.example" not in skilled(lb), message="worker reset")
    assert get(lb1, host="new.example")[0] == 200


def test_a_worker_stopped_during_a_reset_forgets_its_skills_when_it_starts(site, tmp_path):
    # It kept them in its résumé file and brought them back at start; the
    # reset it missed is now told from the token the file keeps.
    resume_file = tmp_path / "resume.json"
    worker = site.worker("--resume-file", str(resume_file))
    lb = site.lb()
    wait_for(lambda: in_pool(lb) == [worker.address])
    for _ in range(3):  # history = 3: a résumé (and the file) after 3 requests
        assert get(lb, host="old.example")[0] == 200
    wait_for(lambda: "old.example" in json.loads(resume_file.read_text())["skills"])
    assert worker.terminate() == 0
    from zc_lb import cli
    assert cli.main(["reset-skills", "--zookeeper", site.hosts, "--path", "/lb"]) == 0
    token = json.loads(site.client.get("/lb/workers")[0])["reset_skills"]
    worker = site.worker("--resume-file", str(resume_file))
    wait_for(lambda: in_pool(lb) == [worker.address])
    saved = json.loads(resume_file.read_text())
    assert saved["skills"] == {} and saved["reset_skills"] == token
    assert "old.example" not in status(lb)["workers"][worker.address].get("skills", {})
    # Started again with no reset since: its skills stay.
    for _ in range(3):
        assert get(lb, host="new.example")[0] == 200
    wait_for(lambda: "new.example" in json.loads(resume_file.read_text())["skills"])
    assert worker.terminate() == 0
    worker = site.worker("--resume-file", str(resume_file))
    wait_for(lambda: in_pool(lb) == [worker.address])
    wait_for(lambda: "new.example" in status(lb)["workers"][worker.address].get("skills", {}))


def test_single_version_still_follows_after_a_zookeeper_blip(site, zookeeper, tmp_path):
    # kazoo calls the provider data watches with path=None when the
    # connection drops; that raised TypeError and the watches stopped for
    # good, so version changes after a blip went unnoticed.
    log_path = tmp_path / "lb.log"
    workers = [site.worker("--version", "1"), site.worker("--version", "1")]
    with open(log_path, "w") as log:
        lb = LBProcess([], "--zookeeper", site.hosts, "--path", "/lb", "--single-version",
                       "--status", "127.0.0.1:0", stderr=log).start()
    lb.status_address = lb.said("zc-lb status on ")
    try:
        wait_for(lambda: in_pool(lb) == sorted(w.address for w in workers))
        zookeeper.stop()
        time.sleep(3)
        zookeeper.start()
        wait_for(lambda: "Zookeeper connection established" in log_path.read_text()
                 and log_path.read_text().count("connection established") >= 2,
                 timeout=20, message="LB reconnected")
        for worker in workers:  # the same nodes, a new version: only data watches see it
            node = "/lb/workers/providers/" + worker.address
            data = json.loads(site.client.retry(site.client.get, node)[0])
            site.client.retry(site.client.set, node, json.dumps(dict(data, version="2")).encode())
        wait_for(lambda: "serving worker version '2'" in log_path.read_text(), timeout=15,
                 message="the LB followed the version change")
        assert "TypeError" not in log_path.read_text()
    finally:
        lb.kill()


def test_a_worker_started_while_zookeeper_is_down_serves_and_registers_later(
        site, zookeeper, tmp_path):
    # It used to wait with only kazoo's retry lines, or exit with status 2.
    zookeeper.stop()
    log_path = tmp_path / "worker.log"
    try:
        with open(log_path, "w") as log:
            worker = WorkerProcess("apps:app", "--zookeeper", site.hosts, "--path",
                                   "/lb/workers", env=ENV, stderr=log).start(timeout=10)
        lb = LBProcess([worker.address]).start()  # an LB that knows it statically
        try:
            assert get(lb)[0] == 200
            wait_for(lambda: "serving the LBs that connect directly" in log_path.read_text(),
                     timeout=20, message="the waiting is logged")
        finally:
            lb.kill()
    finally:
        zookeeper.start()
    def registered():
        try:  # our own client may still be reconnecting to the restarted server
            return worker.address in site.client.retry(
                site.client.get_children, "/lb/workers/providers")
        except Exception:
            return False
    try:
        wait_for(registered, timeout=40, message="registered once ZooKeeper answers")
        # The node can show before the worker, back from creating it, logs it.
        wait_for(lambda: "registered in /lb/workers" in log_path.read_text(), timeout=10,
                 message="the registration is logged")
    finally:
        worker.kill()


def test_a_site_with_credentials_runs_and_nobody_else_can_register_or_change_it(
        zk_hosts, tmp_path):
    # The tree made with the site's credentials (ACL: theirs alone), an LB
    # and a worker given them: the worker registers, the LB finds it and
    # serves.  A client without them cannot add a worker or set a setting.
    from kazoo.exceptions import NoAuthError

    from zc_lb.zookeeper import client as zk

    auth = tmp_path / "zk-auth"
    auth.write_text("site:s3cret\n")
    owner = zk.connect(zk_hosts, credentials=("site", "s3cret"))
    anonymous = KazooClient(zk_hosts)
    anonymous.start(timeout=10)
    started = []
    try:
        zk.import_tree(owner, TREE)
        worker = WorkerProcess("apps:app", "--zookeeper", zk_hosts, "--path", "/lb/workers",
                               "--zookeeper-auth-file", str(auth), env=ENV).start()
        started.append(worker)
        lb = LBProcess([], "--zookeeper", zk_hosts, "--path", "/lb", "--status", "127.0.0.1:0",
                       "--zookeeper-auth-file", str(auth)).start()
        started.append(lb)
        lb.status_address = lb.said("zc-lb status on ")
        wait_for(lambda: in_pool(lb) == [worker.address], message="the worker in the pool")
        assert get(lb)[0] == 200
        assert [a.id.scheme for a in owner.get_acls(
            "/lb/workers/providers/" + worker.address)[0]] == ["digest"]
        for attempt in (
                lambda: anonymous.create("/lb/workers/providers/10.6.6.6:80", b"{}"),
                lambda: anonymous.set("/lb", json.dumps({"variance": 99}).encode()),
                lambda: anonymous.get("/lb")):
            with pytest.raises(NoAuthError):
                attempt()
        assert status(lb)["pool"]["variance"] == 2
    finally:
        for process in reversed(started):
            process.kill()
        for client in (owner, anonymous):
            client.stop()
            client.close()


def test_the_zookeeper_leader_killed_under_load_fails_no_request(tmp_path):
    # A 3-server ensemble on loopback, an LB and two workers on it, a
    # client sending requests; the leader is killed: no request fails,
    # a new leader is elected, and a setting changed after applies.
    import threading

    from zkserver import Ensemble

    from zc_lb.zookeeper import client as zk

    ensemble = Ensemble(str(tmp_path / "ensemble"))
    started, results, stop = [], [], threading.Event()
    client = None
    try:
        ensemble.start()
        client = zk.connect(ensemble.hosts)
        zk.import_tree(client, TREE)
        for _ in range(2):
            started.append(WorkerProcess("apps:app", "--zookeeper", ensemble.hosts, "--path",
                                         "/lb/workers", env=ENV).start())
        lb = LBProcess([], "--zookeeper", ensemble.hosts, "--path", "/lb",
                       "--status", "127.0.0.1:0").start()
        started.append(lb)
        lb.status_address = lb.said("zc-lb status on ")
        wait_for(lambda: len(in_pool(lb)) == 2, timeout=30, message="both workers in the pool")

        def load():  # bounded in time and in count
            deadline = time.monotonic() + 40
            while not stop.is_set() and time.monotonic() < deadline and len(results) < 20000:
                try:
                    results.append(http_get(lb.address, "/", host="c%d.example" % (
                        len(results) % 5), timeout=10)[0])
                except OSError as exc:
                    results.append(repr(exc))

        clients = [threading.Thread(target=load) for _ in range(2)]
        for thread in clients:
            thread.start()
        wait_for(lambda: len(results) > 100, message="requests flowing")
        leader = ensemble.leader()
        leader.process.kill()  # (SIGKILL: no goodbye)
        leader.process.wait()
        leader.process = None
        ensemble.wait_for_quorum(2)
        assert ensemble.leader() is not leader
        count = len(results)
        wait_for(lambda: len(results) > count + 100, message="requests after the election")
        zk.set_properties(client, "/lb", ["variance=7"])
        wait_for(lambda: status(lb)["pool"]["variance"] == 7, timeout=30,
                 message="the setting changed after the election applied")
        stop.set()
        for thread in clients:
            thread.join(30)
        assert len(results) > 200 and set(results) == {200}, [
            r for r in results if r != 200][:5]
    finally:
        stop.set()
        for process in reversed(started):
            process.kill()
        if client is not None:
            client.stop()
            client.close()
        ensemble.stop()


def test_an_lb_on_a_unix_socket_registers_and_serves_the_sites_workers(site, tmp_path):
    # Behind a proxy on its machine: its node's name has no slashes.
    import socket

    from zc_lb.testing import Process

    class UnixLB(Process):
        command = "lb"

    path = str(tmp_path / "lb.sock")
    worker = site.worker()
    lb = UnixLB(["--listen", "unix:" + path, "--zookeeper", site.hosts, "--path", "/lb",
                 "--status", "127.0.0.1:0"]).start()
    try:
        assert lb.address == "unix:" + path
        wait_for(lambda: providers(site.client, "/lb/providers") == [
            "unix:%s@%s" % (path.replace("/", "%2F"), socket.gethostname())])
        status_address = lb.said("zc-lb status on ")
        wait_for(lambda: any(w.get("in_pool") for w in json.load(urllib.request.urlopen(
            "http://%s/" % status_address, timeout=5))["workers"].values()))
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10)
        sock.connect(path)
        sock.sendall(b"GET / HTTP/1.1\r\nHost: a.example\r\nConnection: close\r\n\r\n")
        with sock, sock.makefile("rb") as answer:
            head, _, body = answer.read().partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and body.split()[0].decode() == worker.address
    finally:
        lb.kill()
