"""zc-lb worker -w N (workergroup.py): N processes on consecutive ports,
started again when one ends (--max-requests), all drained on SIGTERM."""

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from zc_lb.errors import ConfigurationError
from zc_lb.testing import LBProcess, http_get, wait_for, write_text_app
from test_processes import kill_left, slow_launches
from zc_lb.process.workergroup import child_argv, offset

TESTS = os.path.dirname(os.path.abspath(__file__))
ENV = dict(os.environ, PYTHONPATH=TESTS + os.pathsep + os.environ.get("PYTHONPATH", ""))


def consecutive_ports(n):
    """A port P with P..P+n-1 free now, below the kernel's ephemeral
    range: a port in it may be taken any moment as another test's
    client end."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    for _ in range(50):
        first = random.randrange(10000, low - n)
        sockets = []
        try:
            for port in range(first, first + n):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise AssertionError("no %d consecutive free ports" % n)


def test_each_child_gets_its_own_addresses_and_files():
    argv = ["apps:app", "-w", "3", "--listen", "10.0.0.5:9001", "--status=10.0.0.5:9101",
            "--resume-file", "/var/lib/r.json", "--pid-file", "/run/w.pid", "--threads", "8"]
    assert child_argv(argv, 2, "10.0.0.5:9001", "10.0.0.5:9101", "/var/lib/r.json") == [
        "apps:app", "--threads", "8", "--listen", "10.0.0.5:9003", "--workers", "1",
        "--pid-file=", "--status", "10.0.0.5:9103", "--resume-file", "/var/lib/r.json.2"]
    # (-w3 as one argument too: a child that got it would start a group of its own;
    # and whatever a --config file or an abbreviation says, it has -w 1 and no pid file)
    assert child_argv(["apps:app", "-w3", "--threads=8"], 0, "127.0.0.1:0", None, None) == [
        "apps:app", "--threads=8", "--listen", "127.0.0.1:0", "--workers", "1", "--pid-file="]
    assert offset("127.0.0.1:0", 4) == "127.0.0.1:0"  # (ephemeral stays ephemeral)
    assert offset("[::1]:80", 1) == "[::1]:81"
    with pytest.raises(ConfigurationError, match="past the last port"):
        offset("127.0.0.1:65535", 1)
    # (a Unix socket: a path each, as --resume-file's)
    assert offset("unix:/run/app.sock", 2) == "unix:/run/app.sock.2"
    with pytest.raises(ConfigurationError, match="unix:PATH"):
        offset("unix:", 0)


def start_group(*args, app="apps:app", env=None):
    """The supervisor of ``zc-lb worker APP ARGS``; its log (and its
    children's) goes to a file, ``log()``, which a full pipe could not
    stop and a failed assertion can show."""
    log = tempfile.TemporaryFile("w+")
    process = subprocess.Popen([sys.executable, "-m", "zc_lb.cli", "worker", app, *args],
                               stdout=subprocess.PIPE, stderr=log, text=True,
                               env=dict(ENV, **(env or {})))
    process.log = lambda: (log.seek(0), log.read())[1]
    return process


def children(pid):
    with open("/proc/%d/task/%d/children" % (pid, pid)) as f:
        return [int(child) for child in f.read().split()]


def stop(group, lb=None):
    """SIGTERM the group (each child drains) and wait; kill ``lb``."""
    if lb is not None:
        lb.kill()
    group.send_signal(signal.SIGTERM)
    group.communicate(timeout=60)


def read_addresses(process, n):
    addresses = []
    while len(addresses) < n:
        line = process.stdout.readline()
        assert line, process.log()
        if line.startswith("zc-lb worker listening on "):
            addresses.append(line.split()[-1])
    return sorted(addresses)


def test_three_processes_on_consecutive_ports_serve_and_drain_on_sigterm(tmp_path):
    port = consecutive_ports(3)
    pid_file = tmp_path / "w.pid"
    group = start_group("-w", "3", "--listen", "127.0.0.1:%d" % port, "--pid-file",
                        str(pid_file))
    lb = None
    try:
        addresses = read_addresses(group, 3)
        assert addresses == ["127.0.0.1:%d" % p for p in range(port, port + 3)]
        wait_for(lambda: pid_file.exists(), message="the supervisor's pid file")
        assert pid_file.read_text() == "%d\n" % group.pid
        lb = LBProcess(addresses, "--policy", "classless").start()
        served = {http_get(lb.address, "/")[1].split()[0] for _ in range(30)}
        assert served == set(addresses)  # (apps:app says which worker served)
    finally:
        stop(group, lb)
    assert group.returncode == 0 and not pid_file.exists()


def test_a_process_past_max_requests_drains_and_is_started_again():
    port = consecutive_ports(2)
    group = start_group("-w", "2", "--listen", "127.0.0.1:%d" % port, "--max-requests", "5",
                        "--max-requests-jitter", "2")
    lb = None
    try:
        addresses = read_addresses(group, 2)
        lb = LBProcess(addresses, "--policy", "classless").start()
        statuses = []
        deadline = time.monotonic() + 30
        while len(statuses) < 60 and time.monotonic() < deadline:
            statuses.append(http_get(lb.address, "/")[0])
        assert statuses == [200] * 60, group.log()  # (drains lose nothing)
        restarted = read_addresses(group, 2)  # (the same ports, said again)
        assert set(restarted) <= set(addresses)
    finally:
        stop(group, lb)
    assert group.returncode == 0, group.log()


def test_a_process_started_again_after_its_config_file_went_bad_starts_as_the_last_good(
        tmp_path):
    # A recycled child (--max-requests, or a crash) read a --config file
    # broken since the supervisor read it, exited 2, and was retried for
    # ever: the group ran one worker short.  It starts now with the copy
    # the supervisor last read well (at start, or at a SIGHUP finding the
    # file good); the file's error is said once, by the supervisor.
    config = tmp_path / "worker.toml"
    config.write_text("[worker]\nhistory = 100\n")
    port = consecutive_ports(2)
    copies = tmp_path / "tmp"
    copies.mkdir()
    group = start_group("-w", "2", "--listen", "127.0.0.1:%d" % port, "--config", str(config),
                        env={"TMPDIR": str(copies)})
    try:
        addresses = read_addresses(group, 2)
        assert len(list(copies.iterdir())) == 1  # (the supervisor's copy)
        config.write_text("[worker]\nhistory = 200\n")
        group.send_signal(signal.SIGHUP)  # (good: the supervisor's copy is this one now)
        wait_for(lambda: group.log().count("history 100 -> 200") == 2, message="both reloaded")
        config.write_text("[worker]\nhistory = 'many'\n")
        group.send_signal(signal.SIGHUP)  # (bad: refused, the copy stays)
        wait_for(lambda: "those started from now on start with the copy" in group.log(),
                 message="the supervisor refusing the file")
        killed = children(group.pid)
        for child in killed:
            os.kill(child, signal.SIGKILL)
        assert read_addresses(group, 2) == addresses, group.log()
        log = group.log()
        assert log.count("%s:2:" % config) == 1, log
        lb = LBProcess(addresses, "--policy", "classless").start()
        try:
            assert http_get(lb.address, "/")[0] == 200
        finally:
            lb.kill()
    finally:
        stop(group)
    assert group.returncode == 0, group.log()
    assert not list(copies.iterdir())  # (no copy left behind)


def test_a_process_started_again_after_a_sighup_its_app_cannot_load_from_starts_as_before(
        tmp_path):
    # A file that reads well but whose application does not import was
    # kept as the copy children start with: one started again exited 2 at
    # every try, and the group ran one worker short.
    config = tmp_path / "worker.toml"
    config.write_text('[worker]\napp = "apps:app"\n')
    port = consecutive_ports(2)
    group = start_group("-w", "2", "--listen", "127.0.0.1:%d" % port, app="--config=%s" % config,
                        env={"TMPDIR": str(tmp_path)})
    try:
        addresses = read_addresses(group, 2)
        config.write_text('[worker]\napp = "nosuchmod:app"\n')
        group.send_signal(signal.SIGHUP)
        wait_for(lambda: group.log().count("app changed in") == 2, message="both children")
        os.kill(children(group.pid)[0], signal.SIGKILL)
        assert read_addresses(group, 1)[0] in addresses, group.log()
        log = group.log()
        assert log.count("could not start with %s as the last SIGHUP read it" % config) == 1, log
        assert log.count("No module named 'nosuchmod'") == 1, log  # (the child's, once)
    finally:
        stop(group)
    assert group.returncode == 0, group.log()

def test_a_group_warns_of_its_secret_file_once_not_once_a_process(tmp_path):
    # (each child warned of the file's mode at start, and of a change at
    # each SIGHUP: -w 8 said it eight times)
    secret = tmp_path / "secret"
    secret.write_bytes(b"s3cret\n")
    secret.chmod(0o604)
    port = consecutive_ports(2)
    group = start_group("-w", "2", "--listen", "127.0.0.1:%d" % port,
                        "--secret-file", str(secret))
    try:
        read_addresses(group, 2)
        assert group.log().count("secret file %s can be read by others" % secret) == 1, \
            group.log()
        secret.write_bytes(b"n3w\n")
        group.send_signal(signal.SIGHUP)
        wait_for(lambda: group.log().count("SIGHUP ignored") == 2, message="both children")
        assert group.log().count("secret file %s changed: restart to apply" % secret) == 1, \
            group.log()
    finally:
        stop(group)
    assert group.returncode == 0, group.log()


def test_a_group_with_a_secret_file_it_cannot_read_is_refused_at_start(tmp_path):
    port = consecutive_ports(2)
    group = start_group("-w", "2", "--listen", "127.0.0.1:%d" % port,
                        "--secret-file", str(tmp_path / "missing"))
    try:
        group.communicate(timeout=30)
    finally:
        group.kill()  # (a supervisor that retries its children for ever must not outlive it)
    assert group.returncode == 2, group.log()
    assert group.log().count("cannot read secret file %s" % (tmp_path / "missing")) == 1


def test_a_pid_file_that_cannot_be_written_is_one_error_and_starts_no_process(tmp_path):
    # It was written once the children had started, out of the clean stop:
    # they were ended by PDEATHSIG alone, and the --config copy was left.
    config = tmp_path / "worker.toml"
    config.write_text("[worker]\nhistory = 100\n")
    copies = tmp_path / "tmp"
    copies.mkdir()
    port = consecutive_ports(2)
    group = start_group("-w", "2", "--listen", "127.0.0.1:%d" % port, "--config", str(config),
                        "--pid-file", str(tmp_path / "missing" / "w.pid"),
                        env={"TMPDIR": str(copies)})
    out, _ = group.communicate(timeout=30)
    assert group.returncode == 2, group.log()
    assert group.log().count("--pid-file %s" % (tmp_path / "missing" / "w.pid")) == 1
    assert "listening" not in out and "worker processes" not in group.log(), group.log()
    assert not list(copies.iterdir())  # (no copy left behind)


def test_a_process_killed_leaves_its_port_held_for_the_next():
    """The supervisor holds each child's socket: while a killed child is
    started again, an LB connecting is queued, not refused, and the next
    process takes that very connection."""
    port = consecutive_ports(2)
    group = start_group("-w", "2", "--listen", "127.0.0.1:%d" % port)
    try:
        addresses = read_addresses(group, 2)
        killed = children(group.pid)
        for child in killed:
            os.kill(child, signal.SIGKILL)
        wait_for(lambda: not set(killed) & set(children(group.pid)), message="the children gone")
        with socket.create_connection(("127.0.0.1", port), timeout=5) as queued:
            assert read_addresses(group, 2) == addresses  # (started again on them)
            queued.settimeout(30)
            assert queued.recv(1)  # (the next process took it: a worker speaks first)
    finally:
        stop(group)
    assert group.returncode == 0, group.log()


@pytest.mark.parametrize("option", ["--listen", "--status"])
def test_an_address_in_use_is_refused_before_any_process_starts(option):
    # (--status: it ran one worker short, that child failing at every start)
    port = consecutive_ports(2)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port + 1))
        taken.listen()
        group = start_group("-w", "2", option, "127.0.0.1:%d" % port)
        out, _ = group.communicate(timeout=60)
    assert group.returncode == 1  # (the environment's, not the configuration's)
    assert "%s 127.0.0.1:%d (-w process 1): Address already in use" % (option, port + 1) \
        in group.log()
    assert "listening" not in out


def test_reload_in_a_group_ends_each_process_for_its_supervisor_to_start_again(tmp_path):
    # A -w child's socket is its supervisor's: started again by exec, as a
    # single worker is, it would have lost it.
    app = tmp_path / "devapp.py"
    write_text_app(app, "first")
    port = consecutive_ports(2)
    group = start_group("-w", "2", "--listen", "127.0.0.1:%d" % port, "--reload",
                        "--chdir", str(tmp_path), app="devapp:app")
    lb = None
    try:
        addresses = read_addresses(group, 2)
        lb = LBProcess(addresses, "--policy", "classless").start()
        wait_for(lambda: http_get(lb.address, "/")[1] == "first", timeout=20,
                 message="the first version served")
        write_text_app(app, "second")
        assert read_addresses(group, 2) == addresses, group.log()  # (each started again)
        # (not by an exec that failed, then by the supervisor)
        assert "zc-lb worker: error" not in group.log()
        wait_for(lambda: {http_get(lb.address, "/", timeout=5)[1] for _ in range(10)}
                 == {"second"}, timeout=30, message="the second version served by both")
    finally:
        stop(group, lb)
    assert group.returncode == 0, group.log()


def test_a_group_takes_sigusr1_and_usr2_and_no_worker_outlives_its_killed_supervisor(
        tmp_path):
    # SIGUSR1 (a log rotation's, to every process of the unit) killed each
    # worker at once: a worker had no handler.  Workers outlived a
    # supervisor killed with SIGKILL, holding its ports.  A relative
    # --chdir meant sub/sub to the workers; a --config file saying
    # workers = 2 made each one a group of its own.
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "group.toml").write_text("[worker]\nworkers = 2\n")
    port = consecutive_ports(2)
    log = tempfile.TemporaryFile("w+")
    group = subprocess.Popen(
        [sys.executable, "-m", "zc_lb.cli", "worker", "apps:app", "-w", "2", "--chdir", "sub",
         "--config", "sub/group.toml", "--listen", "127.0.0.1:%d" % port],
        stdout=subprocess.PIPE, stderr=log, text=True, env=dict(ENV, TMPDIR=str(tmp_path)),
        cwd=str(tmp_path))  # (its supervisor killed: what it keeps in TMPDIR stays)
    group.log = lambda: (log.seek(0), log.read())[1]
    workers = []
    try:
        assert read_addresses(group, 2) == ["127.0.0.1:%d" % p for p in (port, port + 1)]
        workers = children(group.pid)
        assert len(workers) == 2
        for signum in (signal.SIGUSR1, signal.SIGUSR2):
            group.send_signal(signum)
        time.sleep(0.5)
        assert children(group.pid) == workers, group.log()
        assert "exited" not in group.log()
        group.kill()
        group.wait(10)
        wait_for(lambda: not any(os.path.exists("/proc/%d" % pid) and
                                 open("/proc/%d/stat" % pid).read().split(")")[1].split()[0]
                                 != "Z" for pid in workers),
                 timeout=15, message="the workers end with their supervisor")
    finally:
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if group.poll() is None:
            stop(group)


STARTING_WORKER = """
import signal, sys, time
time.sleep(0.3)  # (importing, loading the application: SIGHUP kills it, or is ignored)
signal.signal(signal.SIGHUP, lambda *_: print("SIGHUP", file=open(sys.argv[1], "a")))
print("zc-lb worker listening on 127.0.0.1:1", flush=True)
time.sleep(30)
"""


def started_group(script, path):
    """A WorkerGroup of one child running ``script`` (given ``path``),
    started: (the group, its child)."""
    from zc_lb.process.workergroup import WorkerGroup

    group = WorkerGroup([[]])
    (child,) = group.children
    child.command = [sys.executable, "-c", script, str(path)]
    group.start()
    return group, child


def test_a_sighup_that_comes_while_a_process_starts_reaches_it_once_it_serves(tmp_path):
    # With --max-requests, processes start all the time: a SIGHUP passed on
    # while one started (loaded its application) killed it, or was ignored
    # by it, which had read --config before the change.
    got = tmp_path / "got"
    group, child = started_group(STARTING_WORKER, got)
    try:
        group.signal_all(signal.SIGHUP)  # (it is starting)
        # (open() makes the file before print writes the line: wait for the line)
        wait_for(lambda: got.exists() and got.read_text(), timeout=10,
                 message="the SIGHUP passed on once it serves")
        assert got.read_text() == "SIGHUP\n" and child.process.poll() is None
        group.signal_all(signal.SIGHUP)  # (it serves: at once)
        wait_for(lambda: got.read_text() == "SIGHUP\n" * 2, timeout=10)
    finally:
        group.stop(timeout=5)
    assert child.process.returncode == -signal.SIGTERM


def test_a_stop_while_a_process_is_started_again_stops_it_too(tmp_path, monkeypatch):
    # A stop that came while the watcher started a child again sent the new
    # process no SIGTERM (it found the old one, gone), nor waited for it.
    import threading

    group, child = started_group(STARTING_WORKER, tmp_path / "got")
    first = child.process
    launching = slow_launches(monkeypatch, subprocess, threading.Event(), time.sleep)
    watcher = threading.Thread(target=group.watch, daemon=True)
    watcher.start()
    try:
        first.kill()
        assert launching.wait(10)
        group.stop(timeout=5)
        assert child.process is not first
        assert child.process.poll() == -signal.SIGTERM  # (stopped, and reaped)
    finally:
        group.stopping.set()
        watcher.join(5)
        kill_left(first, child.process)


COUNTING_WORKER = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: print("SIGTERM", file=open(sys.argv[1], "a")))
print("zc-lb worker listening on 127.0.0.1:1", flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.01)
time.sleep(1)  # (draining)
"""


def test_a_process_started_again_gets_one_sigterm_when_the_group_stops(tmp_path):
    # The watcher thread started it again, and a child's parent-death
    # signal follows the thread that started it: the watcher, returning
    # on stop, sent it a second SIGTERM as it drained.
    import threading

    got = tmp_path / "got"
    group, child = started_group(COUNTING_WORKER, got)
    first = child.process
    watcher = threading.Thread(target=group.watch, daemon=True)
    watcher.start()
    try:
        first.kill()
        wait_for(lambda: child.process is not first and child.ready, timeout=10,
                 message="the process started again")
        group.stop(timeout=5)
        assert child.process.returncode == 0
        assert got.read_text() == "SIGTERM\n"
        watcher.join(5)
        assert not watcher.is_alive()
    finally:
        group.stopping.set()
        kill_left(first, child.process)
