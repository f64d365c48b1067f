"""``--config FILE``: keys from the options, line numbers in errors, the
command line over the file, and SIGHUP applying a new file to a running LB."""

import http.client
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from zc_lb import config
from zc_lb.worker.server import Worker
from zc_lb.cli.reload import read_config
from zc_lb.cli.parsers import build_parser
from zc_lb.errors import ConfigurationError
from zc_lb.testing import Process, WorkerProcess, free_port, start_all, wait_for

TESTS = os.path.dirname(os.path.abspath(__file__))
ENV = {"PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")}


def parse(tmp_path, text, *argv, command="lb"):
    path = tmp_path / "zc-lb.toml"
    path.write_text(text)
    argv = [command, "--config", str(path)] + list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    return read_config(args)


@pytest.mark.parametrize("command", ["lb", "worker"])
def test_every_option_has_a_key(command):
    parser = build_parser().commands[command]
    keys = config.options(parser)
    for action in parser._actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        if not longs or action.help == "==SUPPRESS==" or longs[0] in ("--help", "--config"):
            continue
        assert longs[0][2:].replace("-", "_") in keys, longs[0]
    assert ("app" in keys) == (command == "worker")


def test_the_file_gives_options_and_the_command_line_overrides_it(tmp_path):
    text = """# an LB
[lb]
listen = "0.0.0.0:8080"
variance = 2            # an integer is a number
single_version = true
worker = ["10.0.0.5:9001", "10.0.0.6:9001"]
access_log_format = '%h "%r" %{class}z'

[worker]
app = "apps:app"
greenlets = true
"""
    args = parse(tmp_path, text)
    assert (args.listen, args.variance, args.single_version) == (["0.0.0.0:8080"], 2.0, True)
    assert args.worker == ["10.0.0.5:9001", "10.0.0.6:9001"]
    assert args.access_log_format == '%h "%r" %{class}z'
    assert args.spread == 1.0  # not in the file: the default
    args = parse(tmp_path, text, "--variance", "3", "--worker", "w:1", "--listen", "l:1")
    assert (args.variance, args.worker, args.listen) == (3.0, ["w:1"], ["l:1"])
    assert args.single_version is True
    worker = parse(tmp_path, text, command="worker")
    assert (worker.app, worker.threads) == ("apps:app", None)  # greenlets
    worker = parse(tmp_path, text, "other:app", "--threads", "4", command="worker")
    assert (worker.app, worker.threads) == ("other:app", 4)


def test_a_setting_on_by_default_is_turned_off_by_file_or_flag(tmp_path):
    # busy_members is on unless a file says false or --no-busy-members
    assert parse(tmp_path, "[lb]\n").busy_members is True
    assert parse(tmp_path, "[lb]\nbusy_members = false\n").busy_members is False
    assert parse(tmp_path, "[lb]\n", "--no-busy-members").busy_members is False
    assert parse(tmp_path, "[lb]\nbusy_members = false\n", "--busy-members").busy_members is True
    with pytest.raises(ConfigurationError, match="busy_members"):
        parse(tmp_path, '[lb]\nbusy_members = "maybe"\n')


@pytest.mark.parametrize("text, line, reason", [
    ('[lb]\nvariance = 2\n\nvarience = 3\n', 4, "unknown key 'varience' in [lb] "
                                                "(did you mean variance?)"),
    ('[lb]\nbacklog_history = 2.5\n', 2, "bad value for backlog_history: 2.5 (not an integer)"),
    ('[lb]\n\nmax_ejected = 2\n', 3, "max_ejected must be at most 1"),
    ('[lb]\npolicy = "fastest"\n', 2, "policy must be one of affinity, published"),
    ('[lb]\nlisten = 8080\n', 2, "listen must be a string"),
    ('[lb]\nsingle_version = "maybe"\n', 2, "single_version must be true or false"),
    ('[lb]\nworker = [1, 2]\n', 2, "worker must be a string or a list of strings"),
    ('[lb]\nvariance = 1\nvariance = 2\n', 3, "Cannot overwrite a value"),
    ('[lb]\naccess_log = "unclosed\n', 2, "Illegal character"),
    ('variance = 2\n[lb]\n', 1, "unknown key 'variance': put the settings in an [lb]"),
    ('[lbb]\nvariance = 2\n', 1, "unknown table 'lbb'"),
])
def test_a_bad_key_or_value_is_refused_with_its_line(tmp_path, text, line, reason):
    with pytest.raises(ConfigurationError) as info:
        parse(tmp_path, text)
    assert str(info.value).startswith("%s:%d: " % (tmp_path / "zc-lb.toml", line)), info.value
    assert reason in str(info.value)


def test_a_bad_file_exits_2_with_file_and_line(tmp_path):
    path = tmp_path / "lb.toml"
    path.write_text('[lb]\nlisten = "127.0.0.1:0"\n\nspreed = 2\n')
    result = subprocess.run([sys.executable, "-m", "zc_lb.cli", "lb", "--config", str(path)],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert "%s:4: unknown key 'spreed' in [lb] (did you mean spread?)" % path in result.stderr
    result = subprocess.run([sys.executable, "-m", "zc_lb.cli", "worker", "--config",
                             str(tmp_path / "missing.toml")],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "cannot read config file" in result.stderr


class LB(Process):
    command = "lb"


def status(address):
    with urllib.request.urlopen("http://%s/" % address, timeout=5) as response:
        return json.load(response)


def test_sighup_under_load_applies_the_file_and_loses_no_request(tmp_path):
    workers = start_all([WorkerProcess("apps:app", env=ENV) for _ in range(2)])
    status_address = "127.0.0.1:%d" % free_port()
    path = tmp_path / "lb.toml"
    stderr = open(tmp_path / "lb.stderr", "w")

    def write(variance, listen="127.0.0.1:0", workers_listed=1):
        path.write_text('[lb]\nlisten = "%s"\nstatus = "%s"\nvariance = %s\nworker = %s\n' % (
            listen, status_address, variance,
            json.dumps([w.address for w in workers[:workers_listed]])))

    def log():
        stderr.flush()
        return (tmp_path / "lb.stderr").read_text()

    write("1.0")
    lb = LB(["--config", str(path)], stderr=stderr).start()
    results, stop = [], threading.Event()

    def load():  # bounded in time and in count
        deadline = time.monotonic() + 30
        while not stop.is_set() and time.monotonic() < deadline and len(results) < 5000:
            connection = http.client.HTTPConnection(*lb.address.split(":"), timeout=20)
            try:
                connection.request("GET", "/", headers={"Host": "c%d.example" % (
                    len(results) % 4)})
                response = connection.getresponse()
                response.read()
                results.append(response.status)
            except OSError as exc:
                results.append(repr(exc))
            finally:
                connection.close()

    clients = [threading.Thread(target=load) for _ in range(3)]
    try:
        wait_for(lambda: len(status(status_address)["workers"]) == 1, message="1 worker")
        assert status(status_address)["pool"]["variance"] == 1.0
        for client in clients:
            client.start()
        wait_for(lambda: len(results) > 50, message="requests flowing")
        write("2.5", listen="127.0.0.1:1", workers_listed=2)
        os.kill(lb.pid, signal.SIGHUP)
        wait_for(lambda: status(status_address)["pool"]["variance"] == 2.5,
                 message="the new variance")
        wait_for(lambda: len(status(status_address)["workers"]) == 2, message="2 workers")
        wait_for(lambda: "listen changed in %s; restart to apply" % path in log(),
                 message="listen reported")
        assert "variance 1 -> 2.5 (%s)" % path in log()
        # a bad file: logged, the running settings kept
        path.write_text('[lb]\nvariance = -1\n')
        os.kill(lb.pid, signal.SIGHUP)
        wait_for(lambda: "%s:2: variance must be at least" % path in log(),
                 message="the bad file logged")
        assert "keeping the running settings" in log()
        count = len(results)
        wait_for(lambda: len(results) > count + 50, message="more requests")
        stop.set()
        for client in clients:
            client.join(30)
        assert status(status_address)["pool"]["variance"] == 2.5
        assert lb.process.poll() is None
        assert results and set(results) == {200}, [r for r in results if r != 200][:5]
    finally:
        stop.set()
        lb.kill()
        for worker in workers:
            worker.kill()
        stderr.close()



def test_a_bad_worker_list_is_refused_whole_and_lists_are_compared_with_what_runs(tmp_path):
    # SIGHUP with workers 3 -> a list with bad addresses -> 2 -> 3: the
    # bad list changes nothing (it used to empty the pool), and each good
    # one is compared with the list that runs (the second 3 used to be
    # "nothing changed" against the start-up file, leaving 2).
    workers = start_all([WorkerProcess("apps:app", env=ENV) for _ in range(3)])
    status_address = "127.0.0.1:%d" % free_port()
    path = tmp_path / "lb.toml"
    stderr = open(tmp_path / "lb.stderr", "w")

    def write(addresses):
        path.write_text('[lb]\nlisten = "127.0.0.1:0"\nstatus = "%s"\nworker = %s\n' % (
            status_address, json.dumps(addresses)))

    def log():
        stderr.flush()
        return (tmp_path / "lb.stderr").read_text()

    def in_pool():
        return sorted(address for address, worker in status(status_address)["workers"].items()
                      if worker.get("in_pool"))

    addresses = sorted(w.address for w in workers)
    write(addresses)
    lb = LB(["--config", str(path)], stderr=stderr).start()
    try:
        wait_for(lambda: in_pool() == addresses, message="3 workers")
        write(["nohost", "127.0.0.1:99999"] + addresses[:1])
        os.kill(lb.pid, signal.SIGHUP)
        wait_for(lambda: "keeping the running settings" in log(), message="the refusal logged")
        assert "expected HOST:PORT, got 'nohost'" in log()
        assert "port out of range in '127.0.0.1:99999'" in log()
        assert in_pool() == addresses
        write(addresses[:2])
        os.kill(lb.pid, signal.SIGHUP)
        wait_for(lambda: in_pool() == addresses[:2], message="2 workers")
        write(addresses)
        os.kill(lb.pid, signal.SIGHUP)
        wait_for(lambda: in_pool() == addresses, message="3 workers again")
        # A file with no worker list at all (cut short as an editor writes it,
        # the line commented out) keeps the workers; only an empty list empties.
        path.write_text('[lb]\nlisten = "127.0.0.1:0"\nstatus = "%s"\n' % status_address)
        os.kill(lb.pid, signal.SIGHUP)
        wait_for(lambda: "no worker list in" in log(), message="the missing list logged")
        assert in_pool() == addresses
        write([])
        os.kill(lb.pid, signal.SIGHUP)
        wait_for(lambda: in_pool() == [], message="an empty pool")
    finally:
        lb.kill()
        for worker in workers:
            worker.kill()
        stderr.close()


def test_bad_worker_addresses_on_the_command_line_exit_2():
    done = subprocess.run(
        [sys.executable, "-m", "zc_lb.cli", "lb", "--listen", "127.0.0.1:0",
         "--worker", "127.0.0.1:9001", "--worker", "nohost", "--worker", "127.0.0.1:99999"],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "expected HOST:PORT, got 'nohost'" in done.stderr
    assert "port out of range in '127.0.0.1:99999'" in done.stderr


def test_single_version_without_zookeeper_says_it_does_nothing(tmp_path):
    stderr = open(tmp_path / "lb.stderr", "w")
    lb = LB(["--listen", "127.0.0.1:0", "--worker", "127.0.0.1:1", "--single-version"],
            stderr=stderr).start()
    try:
        assert "--single-version does nothing without --zookeeper" in (
            tmp_path / "lb.stderr").read_text()
    finally:
        lb.kill()
        stderr.close()


def test_a_worker_on_a_unix_socket_does_not_register_in_zookeeper(tmp_path):
    # (No LB elsewhere could reach it, and a path is no ZooKeeper node name.)
    done = subprocess.run(
        [sys.executable, "-m", "zc_lb.cli", "worker", "apps:app", "--listen",
         "unix:%s" % (tmp_path / "w.sock"), "--zookeeper", "127.0.0.1:1"],
        capture_output=True, text=True, timeout=60, cwd=TESTS)
    assert done.returncode == 2, done.stderr
    assert "does not register in ZooKeeper" in done.stderr
    assert not (tmp_path / "w.sock").exists()


def _worker_config(tmp_path, lines):
    """A worker's config file of ``lines`` (after its app), and the
    arguments a worker started with it has."""
    path = tmp_path / "zc-lb.toml"
    path.write_text('[worker]\napp = "apps:app"\n' + lines)
    argv = ["worker", "--config", str(path)]
    args = build_parser().parse_args(argv)
    args.argv = argv
    return path, read_config(args)


def test_reload_applies_live_settings_and_names_the_rest(tmp_path, caplog):
    from zc_lb.cli.reload import reload_config

    path, args = _worker_config(tmp_path, 'history = 100\nthreads = 4\n')
    applied = []
    worker = Worker(lambda environ, start_response: [], history=100)  # (not started)

    def apply(live):
        applied.append(live)
        worker.configure(live, str(path))  # which logs each change
    path.write_text('[worker]\napp = "apps:app"\nhistory = 200\nthreads = 8\n')
    with caplog.at_level("INFO", logger="zc_lb"):
        assert reload_config(args, apply) is False
    assert applied == [{"history": 200}] and args.history == 200 == worker.publisher.history
    assert "history 100 -> 200 (%s)" % path in caplog.text
    assert "threads changed in %s; restart to apply (4 stays in force)" % path in caplog.text
    assert args.threads == 4  # reported again at the next SIGHUP
    caplog.clear()
    path.write_text('[worker]\nhistory = 0\n')
    with caplog.at_level("INFO", logger="zc_lb"):
        reload_config(args, apply)
    assert "%s:2: history must be at least 1" % path in caplog.text
    assert len(applied) == 1 and args.history == 200


def test_reload_takes_the_files_log_level_at_once(tmp_path, caplog):
    from zc_lb.cli.reload import reload_config

    path, args = _worker_config(tmp_path, 'log_level = "WARNING"\n')
    root = logging.getLogger()
    before = root.level
    try:
        path.write_text('[worker]\napp = "apps:app"\nlog_level = "DEBUG"\n')
        with caplog.at_level("INFO", logger="zc_lb"):
            reload_config(args, lambda live: None)
        assert root.level == logging.DEBUG and args.log_level == "DEBUG"
        assert "log_level WARNING -> DEBUG (%s)" % path in caplog.text
        assert "nothing changed" not in caplog.text
    finally:
        root.setLevel(before)


def test_a_worker_list_is_checked_whole():
    from zc_lb.sockets import worker_addresses

    assert worker_addresses(["10.0.0.5:9001", "[::1]:9002", "10.0.0.5:9001"]) == [
        "10.0.0.5:9001", "[::1]:9002"]  # (duplicates once)
    assert worker_addresses([]) == []
    with pytest.raises(ConfigurationError) as refused:
        worker_addresses(["nohost", "127.0.0.1:99999", "a:0", "b:x", 7, "ok:1"], "worker")
    message = str(refused.value)
    assert message.startswith("worker: ")
    for part in ("'nohost'", "'127.0.0.1:99999'", "port 0 in 'a:0'", "bad port in 'b:x'", "7"):
        assert part in message


@pytest.mark.parametrize("address", [" 127.0.0.1:8001", "127.0.0.1:8001 ", "127.0.0.1 :8001",
                                     "127.0.0.1:\t8001", "unix:/run/w.sock\n"])
def test_a_worker_address_with_a_space_is_refused(address):
    # It was taken (int() skips spaces), then never resolved: the worker
    # was reported unreachable for ever, with the space hard to see.
    from zc_lb.sockets import worker_addresses

    with pytest.raises(ConfigurationError, match=re.escape("a space in %r" % address)):
        worker_addresses(["127.0.0.1:9000", address], "worker")
