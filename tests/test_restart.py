"""Hitless restart (SIGUSR2), end to end: real worker and LB processes.

While a client opens a new connection for every request, the LB is told
to restart: a new LB takes over the listening sockets, the old one
drains, and no request is refused or fails.
"""

import http.client
import json
import os
import signal
import threading
import time
import urllib.request

import pytest

from zc_lb.testing import LBProcess, Process, WorkerProcess, free_port, http_get, wait_for

TESTS = os.path.dirname(os.path.abspath(__file__))
ENV = {"PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")}

pytestmark = pytest.mark.timeout(90)


def status(address):
    with urllib.request.urlopen("http://%s/" % address, timeout=5) as response:
        return json.load(response)


class Clients:
    """A client loop: a new connection for each GET, until stopped."""

    def __init__(self, address):
        self.host, port = address.split(":")
        self.port = int(port)
        self.outcomes = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        deadline = time.monotonic() + 60
        while not self.stopped.is_set() and time.monotonic() < deadline:
            connection = http.client.HTTPConnection(self.host, self.port, timeout=10)
            try:
                connection.request("GET", "/", headers={"Host": "a.example"})
                response = connection.getresponse()
                response.read()
                self.outcomes.append(response.status)
            except (OSError, http.client.HTTPException) as exc:
                self.outcomes.append(repr(exc))
            finally:
                connection.close()

    def stop(self):
        self.stopped.set()
        self.thread.join(15)
        return self.outcomes


@pytest.fixture
def worker():
    process = WorkerProcess("apps:app", env=ENV).start()
    yield process
    process.kill()


def kill_pid(pid):
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


@pytest.mark.parametrize("processes", [1, 2])
def test_sigusr2_hands_the_sockets_to_a_new_lb_and_no_request_fails(worker, tmp_path, processes):
    # A restart refused connections for about 1.2 s, and SIGUSR2 killed the LB.
    # (A relative --config and --chdir: the new LB, and each of --processes,
    # starts where the first did, or it would look for lb.toml in "sub".)
    status_address = "127.0.0.1:%d" % free_port()
    log_path = tmp_path / "lb.log"
    (tmp_path / "sub").mkdir()
    (tmp_path / "lb.toml").write_text('[lb]\nworker = ["%s"]\n' % worker.address)
    with open(log_path, "w") as log:
        lb = LBProcess([], "--status", status_address, "--config", "lb.toml", "--chdir", "sub",
                       "--processes", str(processes), env=dict(ENV, TMPDIR=str(tmp_path)),
                       stderr=log,
                       cwd=str(tmp_path)).start()
    new_pid = None
    try:
        wait_for(lambda: status(status_address)["requests"] >= 0)
        old_pid = lb.pid
        clients = Clients(lb.address)
        wait_for(lambda: len(clients.outcomes) > 20, message="the clients going")
        os.kill(old_pid, signal.SIGUSR2)
        assert lb.process.wait(40) == 0  # the old one drained and exited
        served = len(clients.outcomes)
        wait_for(lambda: len(clients.outcomes) > served + 20, message="served by the new one")
        outcomes = clients.stop()
        doc = status(status_address)
        new_pid = doc["pid"] if processes == 1 else None
        assert set(outcomes) == {200}, [o for o in outcomes if o != 200][:5]
        text = log_path.read_text()
        assert "this one (pid %d) stops accepting and drains" % old_pid in text
        if processes == 1:
            assert new_pid != old_pid
    finally:
        lb.kill()
        for line in log_path.read_text().splitlines():
            if "the new LB (pid " in line:
                kill_pid(int(line.split("the new LB (pid ")[1].split(")")[0]))


def new_lb_pids(log_path):
    """The pids of the new LBs the old one named in its log."""
    return sorted({int(line.split("the new LB (pid ")[1].split(")")[0])
                   for line in log_path.read_text().splitlines() if "the new LB (pid " in line})


class ConfiguredLB(Process):
    """``zc-lb lb ARGS...``: its addresses from its --config alone."""

    command = "lb"


def refused(address):
    import socket

    try:
        socket.create_connection(address.split(":"), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


@pytest.mark.parametrize("processes", [1, 2])
def test_a_hitless_restart_moves_the_addresses_the_file_changed_and_closes_the_old(
        worker, tmp_path, processes):
    # The new LB served on the old sockets whatever its --listen said, and
    # kept the old status socket it did not use open: a changed address
    # that "a hitless restart applies" never moved, and connections to
    # one taken out of the file were taken, and never answered.
    before, status_before, after = ("127.0.0.1:%d" % free_port() for _ in range(3))
    config = tmp_path / "lb.toml"
    config.write_text('[lb]\nworker = ["%s"]\nlisten = ["%s"]\nstatus = "%s"\nprocesses = %d\n'
                      % (worker.address, before, status_before, processes))
    log_path = tmp_path / "lb.log"
    with open(log_path, "w") as log:
        lb = ConfiguredLB(["--config", str(config)], env=dict(ENV, TMPDIR=str(tmp_path)),
                          stderr=log).start()
    try:
        assert lb.address == before and status(status_before)["requests"] >= 0
        config.write_text('[lb]\nworker = ["%s"]\nlisten = ["%s"]\nprocesses = %d\n'
                          % (worker.address, after, processes))
        os.kill(lb.pid, signal.SIGUSR2)
        assert lb.process.wait(40) == 0
        assert http_get(after)[0] == 200
        assert refused(before) and refused(status_before)
    finally:
        lb.kill()
        for pid in new_lb_pids(log_path):
            kill_pid(pid)


def test_a_new_lb_that_cannot_start_leaves_the_old_one_serving(worker, tmp_path):
    config = tmp_path / "lb.toml"
    config.write_text('[lb]\nworker = ["%s"]\n' % worker.address)
    log_path = tmp_path / "lb.log"
    with open(log_path, "w") as log:
        lb = LBProcess([], "--config", str(config), env=ENV, stderr=log).start()
    try:
        connection = http.client.HTTPConnection(*lb.address.split(":"), timeout=10)
        connection.request("GET", "/", headers={"Host": "a.example"})
        assert connection.getresponse().status == 200  # (serving: its signals are set)
        config.write_text("[lb]\nvariance = 'not a number'\n")  # the new one refuses it
        os.kill(lb.pid, signal.SIGUSR2)
        wait_for(lambda: "before it was ready; this one goes on serving" in log_path.read_text(),
                 timeout=30, message="the failure said")
        assert lb.process.poll() is None
        connection = http.client.HTTPConnection(*lb.address.split(":"), timeout=10)
        connection.request("GET", "/", headers={"Host": "a.example"})
        assert connection.getresponse().status == 200
    finally:
        lb.kill()


def test_a_new_lb_that_dies_before_it_serves_leaves_the_pid_file_naming_the_old_one(
        worker, tmp_path):
    # The new LB writes the pid file once it handles signals, and says it
    # serves only once its workers are connected: one that died between
    # the two left the file naming a dead process while the old LB served.
    config = tmp_path / "lb.toml"
    config.write_text('[lb]\nworker = ["%s"]\n' % worker.address)
    pid_file = tmp_path / "lb.pid"
    lb = LBProcess([], "--config", str(config), "--pid-file", str(pid_file), env=ENV).start()
    try:
        wait_for(lambda: pid_file.exists(), timeout=10, message="the pid file")
        assert pid_file.read_text() == "%d\n" % lb.pid
        config.write_text('[lb]\nworker = ["127.0.0.1:%d"]\n' % free_port())  # (never ready)
        os.kill(lb.pid, signal.SIGUSR2)
        wait_for(lambda: pid_file.read_text() != "%d\n" % lb.pid, timeout=30,
                 message="the new LB's pid")
        kill_pid(int(pid_file.read_text()))  # (SIGKILL: it removes nothing)
        wait_for(lambda: pid_file.exists() and pid_file.read_text() == "%d\n" % lb.pid,
                 timeout=30, message="the pid file naming the old LB again")
        assert lb.process.poll() is None and http_get(lb.address)[0] == 200
    finally:
        lb.kill()


def test_systemd_hears_ready_reloading_and_the_new_main_pid(worker, tmp_path):
    # etc/systemd/zc-lb.service: Type=notify, NotifyAccess=all, and
    # ExecReload=/bin/kill -USR2 $MAINPID.
    import socket

    path = str(tmp_path / "notify")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(path)
    notify.settimeout(20)
    lb = LBProcess([worker.address], env=dict(ENV, NOTIFY_SOCKET=path)).start()
    new_pid = None
    try:
        assert notify.recv(1024).decode() == "READY=1\nMAINPID=%d" % lb.pid
        os.kill(lb.pid, signal.SIGUSR2)
        assert notify.recv(1024) == b"RELOADING=1"
        said = notify.recv(1024).decode()
        assert said.startswith("READY=1\nMAINPID=")
        new_pid = int(said.split("=")[-1])
        assert new_pid != lb.pid
        assert lb.process.wait(40) == 0
    finally:
        lb.kill()
        notify.close()
        if new_pid:
            kill_pid(new_pid)


def test_a_successor_that_cannot_be_run_leaves_this_lb_serving(tmp_path, caplog):
    # (Popen's OSError, a start directory a deploy removed, left the
    # signal loop: the serving LB exited at once, without a drain)
    import socket

    from zc_lb.process.restart import Successor

    gone = tmp_path / "release-1"
    sock = socket.socket()
    try:
        assert not Successor(["lb"], {"front0": sock}, cwd=str(gone)).start(timeout=5)
    finally:
        sock.close()
    assert "cannot start a new LB" in caplog.text and "this one goes on serving" in caplog.text


def test_a_new_lb_takes_each_socket_by_its_address_and_closes_those_it_does_not_take(
        monkeypatch):
    # (by name alone, front0 of a reordered --listen took front1's socket)
    import json
    import socket

    from zc_lb.process import restart

    sockets = [socket.socket() for _ in range(3)]
    fds = [sock.detach() for sock in sockets]
    for name in ("_inherited", "_addresses", "_ready_fd"):  # (read from the environment)
        monkeypatch.setattr(restart, name, None)
    monkeypatch.setenv(restart.INHERIT_ENV, "front0=%d,front1=%d,status=%d" % tuple(fds))
    monkeypatch.setenv(restart.ADDRESSES_ENV, json.dumps(
        {"front0": "a:1", "front1": "b:2", "status": "c:3"}))
    taken = restart.inherited("front0", "b:2")
    try:
        assert taken.fileno() == fds[1]
        assert restart.inherited("front1", "a:9") is None  # (moved: bound anew)
        assert restart.inherited("status", "a:1") is None  # (a front's, not a status's)
        restart.close_unclaimed()
        for fd in (fds[0], fds[2]):
            with pytest.raises(OSError):
                os.fstat(fd)
    finally:
        taken.close()


def test_a_new_lb_takes_the_sockets_of_an_old_release_by_name(monkeypatch):
    # (an LB of the release before names no addresses)
    import socket

    from zc_lb.process import restart

    fd = socket.socket().detach()
    for name in ("_inherited", "_addresses", "_ready_fd"):  # (read from the environment)
        monkeypatch.setattr(restart, name, None)
    monkeypatch.setenv(restart.INHERIT_ENV, "front0=%d" % fd)
    monkeypatch.delenv(restart.ADDRESSES_ENV, raising=False)
    taken = restart.inherited("front0", "anything:1")
    assert taken.fileno() == fd
    taken.close()


def gone(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # (exited, not yet reaped)
    except OSError:
        return True


def test_a_sigterm_or_sighup_that_comes_while_the_new_lb_starts_is_passed_on_to_it(tmp_path):
    # A SIGTERM sent while the new LB started was "not acted on by this
    # process, which is ending": the old one drained, and the new one
    # served on, the stop lost; a SIGHUP for a file changed meanwhile, too.
    log_path = tmp_path / "lb.log"
    nowhere = "127.0.0.1:%d" % free_port()  # (the new LB waits for it: a slow start)
    with open(log_path, "w") as log:
        lb = LBProcess([nowhere], env=ENV, stderr=log).start()
    try:
        os.kill(lb.pid, signal.SIGUSR2)
        wait_for(lambda: "starting a new LB" in log_path.read_text(), message="the start")
        os.kill(lb.pid, signal.SIGHUP)
        os.kill(lb.pid, signal.SIGTERM)
        assert lb.process.wait(40) == 0
        new_pid, = new_lb_pids(log_path)
        text = log_path.read_text()
        for name in ("SIGHUP", "SIGTERM"):
            assert "%s came while the new LB (pid %d) started: passed on to it" % (
                name, new_pid) in text, text
        wait_for(lambda: gone(new_pid), timeout=20, message="the new LB stopping")
    finally:
        lb.kill()
        for pid in new_lb_pids(log_path):
            kill_pid(pid)
