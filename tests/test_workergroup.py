"""zc-lb worker -w N (workergroup.py): N processes on consecutive ports,
started again when one ends (--max-requests), all drained on SIGTERM."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from zc_lb.errors import ConfigurationError
from zc_lb.testing import LBProcess, http_get, wait_for
from zc_lb.process.workergroup import child_argv, offset

TESTS = os.path.dirname(os.path.abspath(__file__))
ENV = dict(os.environ, PYTHONPATH=TESTS + os.pathsep + os.environ.get("PYTHONPATH", ""))


def consecutive_ports(n):
    """A port P with P..P+n-1 free now."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = probe.getsockname()[1]
        if first + n > 65535:
            continue
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
        "apps:app", "--threads", "8", "--listen", "10.0.0.5:9003", "--status", "10.0.0.5:9103",
        "--resume-file", "/var/lib/r.json.2"]
    # (-w3 as one argument too: a child that got it would start a group of its own)
    assert child_argv(["apps:app", "-w3", "--threads=8"], 0, "127.0.0.1:0", None, None) == [
        "apps:app", "--threads=8", "--listen", "127.0.0.1:0"]
    assert offset("127.0.0.1:0", 4) == "127.0.0.1:0"  # (ephemeral stays ephemeral)
    assert offset("[::1]:80", 1) == "[::1]:81"
    with pytest.raises(ConfigurationError, match="past the last port"):
        offset("127.0.0.1:65535", 1)
    # (a Unix socket: a path each, as --resume-file's)
    assert offset("unix:/run/app.sock", 2) == "unix:/run/app.sock.2"
    with pytest.raises(ConfigurationError, match="unix:PATH"):
        offset("unix:", 0)


def start_group(*args):
    process = subprocess.Popen([sys.executable, "-m", "zc_lb.cli", "worker", "apps:app", *args],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    return process


def read_addresses(process, n):
    addresses = []
    while len(addresses) < n:
        line = process.stdout.readline()
        assert line, process.stderr.read()
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
        if lb is not None:
            lb.kill()
        group.send_signal(signal.SIGTERM)
        group.communicate(timeout=60)
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
        assert statuses == [200] * 60  # (drains lose nothing)
        restarted = read_addresses(group, 2)  # (the same ports, said again)
        assert set(restarted) <= set(addresses)
    finally:
        if lb is not None:
            lb.kill()
        group.send_signal(signal.SIGTERM)
        group.communicate(timeout=60)
    assert group.returncode == 0
