"""Tests for zc_lb.cli: the parser, exit statuses and messages, --config and SIGHUP reloads."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import types

import pytest

from zc_lb import cli, settings
from zc_lb.cli import main, reload, tools
from zc_lb.cli.admin import run_reset_skills, run_status, run_worker_state, run_zk
from zc_lb.cli.demo import run_demo
from zc_lb.cli.lb import run_lb
from zc_lb.cli.parsers import build_parser
from zc_lb.cli.reload import read_config, reload_config
from zc_lb.cli.worker import run_worker
from zc_lb.process import service
from zc_lb.status import document as status
from zc_lb.errors import ConfigurationError
from zc_lb.settings import CLI, LIVE, ZOOKEEPER

COMMANDS = {"lb", "worker", "status", "zk", "drain", "enable", "reset-skills", "demo",
            "replay", "compare", "simulate"}
NO_SUCH_MODULE = "no_such_module_for_zc_lb_cli_tests"


@pytest.fixture
def in_process(monkeypatch):
    """Run ``main`` here: put back what its commands change in the process
    (signal dispositions, sys.path)."""
    saved = {name: signal.getsignal(getattr(signal, name))
             for name in ("SIGHUP", "SIGUSR1", "SIGUSR2")}
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield
    for name, handler in saved.items():
        signal.signal(getattr(signal, name), handler)


def error_line(capsys, command: str) -> str:
    """What main printed for an error: one line on stderr, nothing on stdout."""
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err, (out, err)
    lines = err.splitlines()
    assert len(lines) == 1, err
    prefix = "zc-lb %s: error: " % command
    assert lines[0].startswith(prefix), lines[0]
    return lines[0][len(prefix):]


def parsed(tmp_path, text: str, *argv: str, command: str = "lb"):
    """The arguments of ``zc-lb COMMAND --config FILE ARGV...``, FILE holding ``text``."""
    path = tmp_path / "zc-lb.toml"
    path.write_text(text)
    argv = [command, "--config", str(path)] + list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    return read_config(args), path


# -- the parser --------------------------------------------------------------


def test_the_parser_knows_every_subcommand_and_what_runs_it():
    parser = build_parser()
    assert set(parser.commands) == COMMANDS == set(cli.COMMANDS)
    runs = {
        ("lb",): run_lb,
        ("worker", "app:app"): run_worker,
        ("status", "127.0.0.1:1"): run_status,
        ("zk", "ls"): run_zk,
        ("reset-skills",): run_reset_skills,
        ("demo",): run_demo,
        ("drain", "127.0.0.1:1", "10.0.0.1:9001"): run_worker_state,
        ("enable", "127.0.0.1:1", "10.0.0.1:9001"): run_worker_state,
    }
    for argv, run in runs.items():
        args = parser.parse_args(list(argv))
        assert args.command == argv[0] and cli.COMMANDS[args.command] is run, argv
    assert parser.parse_args(["drain", "a:1", "w:2"]).action == "drain"
    assert parser.parse_args(["enable", "a:1", "w:2"]).action == "enable"
    for name in ("replay", "compare", "simulate"):
        args, rest = parser.parse_known_args([name, "x"])
        assert cli.COMMANDS[args.command] is tools.run_pass_through and rest == ["x"]


@pytest.mark.parametrize("argv", [
    [name] for name in sorted(COMMANDS - set(tools.PASS_THROUGH))
] + [["zk", sub] for sub in ("import", "export", "get", "set", "ls")])
def test_help_of_every_own_subcommand_exits_0_with_its_usage(argv, capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(argv + ["--help"])
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith("usage: zc-lb %s " % " ".join(argv))


def _help_entries(text: str) -> dict:
    """Option -> its help, from argparse's --help output."""
    entries: dict = {}
    current = None
    for line in text.splitlines():
        match = re.match(r"^  (-\S+)", line)
        if match:
            current = entries.setdefault(match.group(1).rstrip(","), [])
            current.append(line)
        elif current is not None and line.startswith("   "):
            current.append(line)
        else:
            current = None
    return {option: "".join("".join(lines).split()) for option, lines in entries.items()}


@pytest.mark.parametrize("argv, table", [(["lb"], settings.LB_SETTINGS),
                                         (["worker", "app:app"], settings.WORKER_SETTINGS)])
def test_every_setting_is_in_help_with_its_default_and_whether_it_is_live(argv, table, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv + ["--help"])
    entries = _help_entries(capsys.readouterr().out)
    shown = settings.given_in(table, CLI)
    assert shown
    for name, setting in shown.items():
        text = entries[setting.option]  # (whitespace removed: argparse wraps lines)
        assert "".join(setting.help.split()) in text, name
        if setting.default not in (None, "") and setting.type is not bool:
            assert "(default%s)" % settings._format(setting.default) in text, name
        assert "(default)" not in text, name  # (an empty default shown as nothing)
        if ZOOKEEPER in setting.where:
            assert "[ZooKeeper:%s%s]" % (name, ",live" if LIVE in setting.where else "") \
                in text, name
        else:
            assert "[ZooKeeper" not in text and "live]" not in text, name


# -- main's exit statuses --------------------------------------------------------


def test_a_bad_option_value_exits_2_with_one_error_line_and_no_traceback():
    result = subprocess.run([sys.executable, "-m", "zc_lb.cli", "lb", "--variance", "0"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and result.stdout == ""
    assert "Traceback" not in result.stderr
    assert [line for line in result.stderr.splitlines() if "error:" in line] == [
        "zc-lb lb: error: argument --variance: variance must be at least 1e-09, got '0'"]


@pytest.mark.parametrize("name", ["child_status_timeout", "child_action_timeout"])
@pytest.mark.parametrize("value, said", [
    ("0", "%s must be at least 0.01, got '0'"), ("-2", "%s must be at least 0.01, got '-2'"),
    ("soon", "bad value for %s: 'soon' (not a number)"),
    ("nan", "bad value for %s: 'nan' (not a finite number)")])
def test_a_childs_timeout_that_is_no_positive_number_exits_2_naming_it(
        name, value, said, tmp_path, in_process, capsys):
    option = "--" + name.replace("_", "-")
    with pytest.raises(SystemExit) as info:
        main(["lb", "--processes", "2", option, value])
    assert info.value.code == 2  # (after argparse's usage: its one error line)
    assert capsys.readouterr().err.splitlines()[-1] == "zc-lb lb: error: argument %s: %s" % (
        option, said % name)
    config = tmp_path / "zc-lb.toml"  # (in a --config file: the same, with its line)
    config.write_text("[lb]\nprocesses = 2\n%s = %s\n" % (
        name, value if value[-1].isdigit() else '"%s"' % value))
    assert main(["lb", "--config", str(config)]) == 2
    assert error_line(capsys, "lb").startswith("%s:3: %s" % (config, said.split("'")[0] % name))


@pytest.mark.parametrize("name, value, said", [
    # (a worker starts all its threads at once: 1e10 took all the memory there
    # was, and it never served)
    ("threads", "10000000000", "threads must be at most 10000, got '10000000000'"),
    # (a gevent semaphore's count, a C int: an OverflowError, a traceback and exit 1)
    ("concurrency", "10000000000", "concurrency must be at most 1e+06, got '10000000000'")])
def test_a_workers_count_past_its_maximum_exits_2_naming_it(name, value, said, tmp_path,
                                                            capsys):
    option, mode = "--" + name, ["--greenlets"] if name == "concurrency" else []
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["worker", "app:app", option, value] + mode)
    assert info.value.code == 2  # (after argparse's usage: its one error line)
    assert capsys.readouterr().err.splitlines()[-1] == (
        "zc-lb worker: error: argument %s: %s" % (option, said))
    with pytest.raises(ConfigurationError) as info:  # (a --config file: the same, and its line)
        parsed(tmp_path, "[worker]\n%s = %s\n" % (name, value), "app:app", *mode,
               command="worker")
    assert str(info.value).startswith("%s:2: %s" % (tmp_path / "zc-lb.toml", said.split("'")[0]))


def test_a_workers_greatest_concurrency_is_one_its_semaphore_takes():
    import gevent.lock

    most = build_parser().parse_args(["worker", "app:app", "--greenlets", "--concurrency",
                                      str(settings.MAX_CONCURRENCY)]).concurrency
    assert gevent.lock.Semaphore(most).counter == most


@pytest.mark.parametrize("argv", [["worker", "app:app", "-w"], ["lb", "--processes"],
                                  ["demo", "--workers"]])
@pytest.mark.parametrize("value, said", [
    # (worker -w listed its children until the memory ran out, lb --processes
    # sized their shared memory: 1e30 was an OverflowError, a traceback)
    ("10000000000", "must be at most 1024"), (str(10 ** 30), "must be at most 1024"),
    ("0", "must be at least 1"), ("1e10", "not an integer: '1e10'")])
def test_a_count_of_processes_out_of_range_exits_2_naming_it(argv, value, said, capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(argv + [value])
    assert info.value.code == 2  # (after argparse's usage: its one error line)
    option = "-w/--workers" if argv[-1] == "-w" else argv[-1]
    assert capsys.readouterr().err.splitlines()[-1] == (
        "zc-lb %s: error: argument %s: %s" % (argv[0], option, said))


@pytest.mark.parametrize("command, key", [("worker", "workers"), ("lb", "processes")])
def test_a_count_of_processes_out_of_range_in_a_config_file_is_refused(command, key, tmp_path):
    app = ["app:app"] if command == "worker" else []
    with pytest.raises(ConfigurationError) as info:
        parsed(tmp_path, "[%s]\n%s = 10000000000\n" % (command, key), *app, command=command)
    assert str(info.value) == "%s:2: bad value for %s: 10000000000 (must be at most 1024)" % (
        tmp_path / "zc-lb.toml", key)


@pytest.mark.parametrize("argv", [["status", "127.0.0.1:1"],
                                  ["drain", "127.0.0.1:1", "10.0.0.1:9001"],
                                  ["enable", "127.0.0.1:1", "10.0.0.1:9001"],
                                  ["reset-skills", "--status", "127.0.0.1:1"]])
@pytest.mark.parametrize("value, said", [
    ("0", "timeout must be at least 0.01, got '0'"),
    ("-1", "timeout must be at least 0.01, got '-1'"),
    ("soon", "bad value for timeout: 'soon' (not a number)"),
    ("inf", "bad value for timeout: 'inf' (not a finite number)"),
    # (past what a socket takes: Python's OverflowError, a traceback and exit 1)
    ("1e10", "timeout must be at most 1e+06, got '1e10'")])
def test_an_admin_commands_timeout_that_is_no_positive_number_exits_2_naming_it(
        argv, value, said, capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(argv + ["--timeout", value])
    assert info.value.code == 2  # (after argparse's usage: its one error line)
    assert capsys.readouterr().err.splitlines()[-1] == (
        "zc-lb %s: error: argument --timeout: %s" % (argv[0], said))


def test_the_admin_commands_wait_5_s_unless_told():
    parser = build_parser()
    assert parser.parse_args(["status", "a:1"]).timeout == 5.0
    assert parser.parse_args(["drain", "a:1", "w:2", "--timeout", "12.5"]).timeout == 12.5
    longest = parser.parse_args(["status", "a:1", "--timeout", "1e6"]).timeout
    with socket.socket() as sock:
        sock.settimeout(longest)  # (the longest it takes is one a socket takes)


@pytest.mark.parametrize("before", [True, False], ids=["before ZKCOMMAND", "after"])
@pytest.mark.parametrize("value, said", [
    ("0", "timeout must be at least 0.01, got '0'"),
    ("-1", "timeout must be at least 0.01, got '-1'"),
    # (each waited for a dead ZooKeeper for good)
    ("nan", "bad value for timeout: 'nan' (not a finite number)"),
    ("1e10", "timeout must be at most 1e+06, got '1e10'")])
def test_a_zk_timeout_that_is_no_positive_number_exits_2_naming_it(before, value, said, capsys):
    argv = ["zk", "--timeout", value, "ls", "/"] if before else [
        "zk", "ls", "/", "--timeout", value]
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(argv)
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == "zc-lb %s: error: argument --timeout: %s" % (
        "zk" if before else "zk ls", said)
    assert build_parser().parse_args(["zk", "ls", "/"]).timeout == 10.0
    assert build_parser().parse_args(["zk", "ls", "/", "--timeout", "0.5"]).timeout == 0.5


def test_a_report_whose_reader_went_away_ends_quietly():
    # ``zc-lb status ... | head`` printed "error: [Errno 32] Broken pipe"
    # (or Python's "Exception ignored" at the exit).
    child = subprocess.Popen([sys.executable, "-m", "zc_lb.cli", "simulate", "--list"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    child.stdout.close()  # (the reader goes before the report is written)
    stderr = child.stderr.read().decode()
    assert child.wait(timeout=30) == 1
    assert stderr == ""


# Each command below would fail another way (an application that does not
# import, a --listen that does not parse, a résumé file that cannot be
# read) were its error not caught first: a regression fails at once
# instead of serving here.
APP = "%s:app" % NO_SUCH_MODULE
NOWHERE = ["--listen", "nowhere"]


@pytest.mark.parametrize("argv, said", [
    (["worker"], "no application: give module:callable"),
    (["worker", APP, "--listen", "nowhere"], "expected HOST:PORT, got 'nowhere'"),
    (["worker", APP, "--listen", "127.0.0.1:70000"], "port out of range in"),
    (["worker", APP], "cannot load the application %s: cannot import %r" % (APP, NO_SUCH_MODULE)),
    (["worker", "zc_lb.cli.parsers:LOG_LEVELS", "--resume-file", "/"],  # (a directory: unreadable)
     "cannot load the application zc_lb.cli.parsers:LOG_LEVELS: it is not callable"),
    (["lb"] + NOWHERE, "expected HOST:PORT, got 'nowhere'"),
    (["lb", "--keyfile", "key.pem"] + NOWHERE, "--keyfile needs --certfile"),
    (["lb", "--error-page", "/nonexistent/sorry.html"] + NOWHERE,
     "cannot read error page /nonexistent/sorry.html"),
    (["lb", "--buffer-dir", "/nonexistent/spool"] + NOWHERE,
     "--buffer-dir /nonexistent/spool is not a directory"),
    (["reset-skills"], "give --zookeeper or --status"),
])
def test_a_configuration_error_exits_2_with_one_line_naming_it(argv, said, in_process, capsys):
    assert main(argv) == 2
    assert said in error_line(capsys, argv[0])


@pytest.mark.parametrize("command", ["lb", "worker"])
def test_an_unreadable_or_empty_secret_file_exits_2(command, tmp_path, in_process, capsys):
    argv = [command] + ([APP] if command == "worker" else NOWHERE)
    missing = tmp_path / "missing"
    assert main(argv + ["--secret-file", str(missing)]) == 2
    assert error_line(capsys, command).startswith("cannot read secret file %s: " % missing)
    empty = tmp_path / "empty"
    empty.write_text("\n  \n")
    assert main(argv + ["--secret-file", str(empty)]) == 2
    assert error_line(capsys, command) == "secret file %s is empty" % empty


@pytest.mark.parametrize("command", ["lb", "worker"])
def test_an_address_in_use_exits_1(command):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        argv = [command] + (["zc_lb.demo:app"] if command == "worker" else [])
        result = subprocess.run(
            [sys.executable, "-m", "zc_lb.cli"] + argv + ["--listen", "127.0.0.1:%d" % port],
            capture_output=True, text=True, timeout=30)
    assert result.returncode == 1 and "listening" not in result.stdout, result
    assert result.stderr.startswith("zc-lb %s: error: " % command), result.stderr
    assert "Traceback" not in result.stderr


def test_a_pass_through_tool_gets_every_argument_after_its_name_and_gives_the_status(
        monkeypatch, in_process):
    calls = []
    tool = types.ModuleType("fake_simulate_tool")
    tool.main = lambda argv: calls.append(argv) or (3 if "--fail" in argv else None)
    monkeypatch.setitem(sys.modules, tool.__name__, tool)
    monkeypatch.setitem(tools.PASS_THROUGH, "simulate", (tool.__name__, "simulations", "a tool"))
    argv = ["--help", "--version", "--log-level", "DEBUG", "steady", "--scale", "2"]
    assert main(["simulate"] + argv) == 0  # None: success
    assert main(["--log-level", "WARNING", "simulate", "--fail"]) == 3
    assert calls == [argv, ["--fail"]]


def test_a_pass_through_tool_not_installed_exits_2_saying_which_extra(
        monkeypatch, in_process, capsys):
    monkeypatch.setitem(tools.PASS_THROUGH, "compare", (NO_SUCH_MODULE, "playback", "a tool"))
    assert main(["compare", "x.log"]) == 2
    said = error_line(capsys, "compare")
    assert said.startswith("zc-lb compare needs %s (" % NO_SUCH_MODULE)
    assert said.endswith("pip install 'zc-lb[playback]'")


def test_reset_skills_asks_every_status_address_given(monkeypatch, in_process, capsys):
    asked = []
    monkeypatch.setattr(status, "fetch", lambda address, **kw: asked.append((address, kw)))
    assert main(["reset-skills", "--status", "10.0.0.1:8079",
                 "--status", "10.0.0.2:8079"]) == 0
    assert asked == [("10.0.0.1:8079", {"action": "reset-skills", "token": None,
                                        "timeout": 5.0}),
                     ("10.0.0.2:8079", {"action": "reset-skills", "token": None,
                                        "timeout": 5.0})]
    assert capsys.readouterr().out.splitlines() == [
        "reset skills on the LB at 10.0.0.1:8079", "reset skills on the LB at 10.0.0.2:8079"]


# -- --config and the exposure check ---------------------------------------------------


def test_a_worker_configured_on_a_public_address_without_a_secret_exits_2(
        tmp_path, in_process, capsys):
    # The app cannot be imported: past the exposure check, main says so instead.
    path = tmp_path / "worker.toml"
    path.write_text('[worker]\napp = "%s:app"\nlisten = "0.0.0.0:0"\n' % NO_SUCH_MODULE)
    config = ["worker", "--config", str(path)]
    assert main(config) == 2
    said = error_line(capsys, "worker")
    assert said.startswith("a worker listening on 0.0.0.0 without --secret-file")
    assert "--insecure" in said
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    for extra in (["--listen", "127.0.0.1:0"], ["--insecure"], ["--secret-file", str(secret)]):
        assert main(config + extra) == 2, extra  # the command line over the file
        assert error_line(capsys, "worker").startswith(
            "cannot load the application %s: cannot import %r" % (APP, NO_SUCH_MODULE))


def test_without_config_sighup_is_ignored_and_with_it_the_file_is_read_again(
        tmp_path, caplog):
    args = build_parser().parse_args(["lb"])
    assert reload.sighup(args, lambda live: None) is service.ignore_sighup
    args, path = parsed(tmp_path, "[lb]\nvariance = 2.0\n")
    hangup = reload.sighup(args, lambda live: None)
    with caplog.at_level("INFO", logger="zc_lb"):
        assert hangup() is False
    assert "SIGHUP: %s read again; nothing changed" % path in caplog.text


def test_reload_of_an_unchanged_file_applies_nothing_and_says_so(tmp_path, caplog):
    args, path = parsed(tmp_path, '[lb]\nvariance = 2.0\nworker = ["a:1"]\n')
    applied = []
    with caplog.at_level("INFO", logger="zc_lb"):
        assert reload_config(args, applied.append, frozenset({"worker"})) is False
    assert applied == []
    assert "SIGHUP: %s read again; nothing changed" % path in caplog.text
    assert "restart" not in caplog.text


def test_reload_of_a_restart_only_option_says_restart_and_keeps_it(tmp_path, caplog):
    args, path = parsed(tmp_path, "[lb]\nresponse_timeout = 300\n")
    path.write_text("[lb]\nresponse_timeout = 60\n")
    applied = []
    with caplog.at_level("INFO", logger="zc_lb"):
        assert reload_config(args, applied.append) is False
    assert applied == [] and args.response_timeout == 300.0
    assert ("response_timeout changed in %s; restart to apply (300 stays in force)" % path
            in caplog.text)
    assert "nothing changed" not in caplog.text


def test_reload_keeps_a_value_the_command_line_gave(tmp_path, caplog):
    args, path = parsed(tmp_path, "[lb]\nvariance = 1.0\n", "--variance", "3")
    assert args.variance == 3.0
    path.write_text("[lb]\nvariance = 2.0\n")
    applied = []
    with caplog.at_level("INFO", logger="zc_lb"):
        reload_config(args, applied.append)
    assert applied == [] and args.variance == 3.0
    assert "nothing changed" in caplog.text


def test_reload_passes_a_live_extra_and_logs_its_change(tmp_path, caplog):
    args, path = parsed(tmp_path, '[lb]\nworker = ["a:1"]\nvariance = 1.0\n')
    path.write_text('[lb]\nworker = ["a:1", "b:2"]\nvariance = 2.0\n')
    applied = []
    with caplog.at_level("INFO", logger="zc_lb"):
        reload_config(args, applied.append, frozenset({"worker"}))
    assert applied == [{"variance": 2.0, "worker": ["a:1", "b:2"]}]
    assert (args.variance, args.worker) == (2.0, ["a:1", "b:2"])
    assert "worker a:1 -> a:1 b:2 (%s)" % path in caplog.text
    # Without it in live_extra, the worker list is a restart's business.
    path.write_text('[lb]\nworker = ["c:3"]\nvariance = 2.0\n')
    with caplog.at_level("INFO", logger="zc_lb"):
        reload_config(args, applied.append)
    assert len(applied) == 1 and args.worker == ["a:1", "b:2"]
    assert "worker changed in %s; restart to apply (a:1 b:2 stays in force)" % path \
        in caplog.text


def test_reload_of_a_file_without_the_worker_list_keeps_it_and_says_no_change(
        tmp_path, caplog):
    # The LB kept its workers ("no worker list in ... the 1 workers stay"),
    # and the log said "worker a:1 -> (none)" all the same; the list put
    # back was then a change, "worker (none) -> a:1", applied again.
    args, path = parsed(tmp_path, '[lb]\nworker = ["a:1"]\nvariance = 1.0\n')
    path.write_text("[lb]\nvariance = 1.0\n")  # (cut short, or the line commented out)
    applied = []
    with caplog.at_level("INFO", logger="zc_lb"):
        reload_config(args, applied.append, frozenset({"worker"}))
        assert applied == [{"worker": None}]  # (LBService.configure keeps the list)
        assert args.worker == ["a:1"]
        path.write_text('[lb]\nworker = ["a:1"]\nvariance = 1.0\n')
        reload_config(args, applied.append, frozenset({"worker"}))
    assert len(applied) == 1
    assert "-> (none)" not in caplog.text and "(none) ->" not in caplog.text
    assert "SIGHUP: %s read again; nothing changed" % path in caplog.text


@pytest.mark.parametrize("error, logged", [
    (ConfigurationError("no such thing"), "SIGHUP: cannot apply {path}: no such thing; "
                                          "keeping the running settings"),
    (RuntimeError("boom"), "SIGHUP: cannot apply {path}"),
])
def test_a_reload_that_cannot_be_applied_keeps_the_settings_and_never_raises(
        tmp_path, caplog, error, logged):
    args, path = parsed(tmp_path, '[lb]\nvariance = 1.0\nworker = ["a:1"]\n')
    path.write_text('[lb]\nvariance = 2.0\nworker = ["a:1", "b:2"]\n')
    tried = []

    def apply(live):
        tried.append(live)
        raise error
    with caplog.at_level("INFO", logger="zc_lb"):
        assert reload_config(args, apply, frozenset({"worker"})) is False
        assert (args.variance, args.worker) == (1.0, ["a:1"])
        reload_config(args, apply, frozenset({"worker"}))  # tried again at the next SIGHUP
    assert tried == [{"variance": 2.0, "worker": ["a:1", "b:2"]}] * 2
    assert logged.format(path=path) in caplog.text
    assert "worker a:1 -> a:1 b:2" not in caplog.text  # (a change that did not happen)


@pytest.mark.parametrize("command, before, after, said", [
    ("lb", 'processes = 2\nworker = ["a:1"]\n', 'processes = 3\nworker = ["a:1"]\n',
     "processes changed in {path}; restart to apply (2 stays in force)"),
    ("lb", 'processes = 2\nworker = ["a:1"]\n',
     'processes = 2\nworker = ["a:1"]\npid_file = "lb.pid"\n',
     "pid_file changed in {path}; restart to apply ((none) stays in force)"),
    ("lb", 'processes = 2\nworker = ["a:1"]\n',
     'processes = 2\nworker = ["a:1"]\nchild_action_timeout = 10\n',
     "child_action_timeout changed in {path}; restart to apply (5 stays in force)"),
    ("lb", 'processes = 2\nworker = ["a:1"]\nchild_status_timeout = 1\n',
     'processes = 2\nworker = ["a:1"]\n',
     "child_status_timeout changed in {path}; restart to apply (1 stays in force)"),
    ("worker", 'app = "apps:app"\nworkers = 2\nlisten = "127.0.0.1:9001"\n',
     'app = "apps:app"\nworkers = 2\nlisten = "127.0.0.1:9101"\n',
     "listen changed in {path}; restart to apply (127.0.0.1:9001 stays in force)"),
])
def test_a_supervisor_says_a_change_to_its_own_settings_needs_a_restart(
        tmp_path, caplog, command, before, after, said):
    # Its children's command lines say --processes 1, --pid-file= (and
    # for -w their --listen, --status): a change to those in the file
    # went unsaid, in the supervisor and in every child.
    table = "[%s]\n" % command
    args, path = parsed(tmp_path, table + before, command=command)
    kept = reload.KeptConfig(args)
    try:
        path.write_text(table + after)
        with caplog.at_level("INFO", logger="zc_lb"):
            assert kept.take()
    finally:
        kept.remove()
    assert [r.getMessage() for r in caplog.records] == [said.format(path=path)]


def test_the_childs_timeouts_a_sighup_changes_are_said_by_the_supervisor_alone(
        tmp_path, caplog):
    # Only the supervisor of --processes uses them, but each of its N
    # children read them from the file: the supervisor said nothing of a
    # change, and every child said it needed a restart (N lines, and a
    # child started again applies nothing of it).
    from zc_lb.process.processes import Child, Supervisor

    before = '[lb]\nprocesses = 2\nworker = ["a:1"]\nchild_status_timeout = 1\n'
    args, path = parsed(tmp_path, before)
    supervisor = Supervisor(2, args.argv[1:], ("127.0.0.1", 0), status_timeout=1.0)
    argv = Child(0, supervisor.argv, 3, "INFO").argv
    argv = argv[argv.index("lb"):]
    child = build_parser().parse_args(argv)
    child.argv = argv
    child = reload.read_config(child)
    kept = reload.KeptConfig(args)
    try:
        path.write_text(before.replace("= 1", "= 3") + "child_action_timeout = 10\n")
        with caplog.at_level("INFO", logger="zc_lb"):
            assert kept.take()
            reload_config(child, lambda live: None)
    finally:
        kept.remove()
    assert [r.getMessage() for r in caplog.records] == [
        "child_status_timeout changed in %s; restart to apply (1 stays in force)" % path,
        "child_action_timeout changed in %s; restart to apply (5 stays in force)" % path,
        "SIGHUP: %s read again; nothing changed" % path]


def test_a_supervisor_names_a_config_file_it_cannot_read_as_a_process_does(tmp_path, caplog):
    # It said "[Errno 2] No such file or directory: '/etc/zc-lb/lb.toml'".
    args, path = parsed(tmp_path, '[lb]\nprocesses = 2\nworker = ["a:1"]\n')
    kept = reload.KeptConfig(args)
    try:
        path.unlink()
        with caplog.at_level("INFO", logger="zc_lb"):
            assert not kept.take()
        assert kept.copy  # (the copy read before stays)
    finally:
        kept.remove()
    assert [r.getMessage() for r in caplog.records] == [
        "SIGHUP: cannot read config file %s: No such file or directory; the running processes "
        "keep their settings, and those started from now on start with the copy read before"
        % path]


def test_a_worker_list_with_a_bad_address_is_no_good_copy_for_a_child_started_again(
        tmp_path, monkeypatch, caplog):
    # The supervisor took such a file as read well: the running processes
    # refused it at SIGHUP, but a child started again (a crash,
    # --max-requests) found it in the file and in the copy, exited 2 at
    # each try, and the LB ran one process short for good.
    args, path = parsed(tmp_path, '[lb]\nprocesses = 2\nworker = ["a:1"]\n')
    kept = reload.KeptConfig(args)
    try:
        path.write_text('[lb]\nprocesses = 2\nworker = ["nohost", "a:2"]\n')
        with caplog.at_level("INFO", logger="zc_lb"):
            assert not kept.take()
        assert "expected HOST:PORT, got 'nohost'" in caplog.text
        assert "those started from now on start with the copy read before" in caplog.text
        monkeypatch.setattr(reload, "_supervised", False)  # (restored)
        monkeypatch.setenv(reload.CONFIG_COPY, kept.copy)
        child = build_parser().parse_args(args.argv)
        child.argv = args.argv
        assert reload.read_config_at_start(child).worker == ["a:1"]
    finally:
        kept.remove()


def test_a_copy_no_process_could_start_with_is_set_aside_until_a_sighup_reads_the_file(
        tmp_path):
    # A file that reads well but that no process can be built from (a
    # classifier that does not import) became the copy every child started
    # again read: each exited 2, at every try, and the LB ran one short.
    args, path = parsed(tmp_path, '[lb]\nworker = ["a:1"]\n')
    kept = reload.KeptConfig(args)
    try:
        first = kept.copy
        kept.served(first)  # (the children started at start serve)
        path.write_text('[lb]\nworker = ["a:1"]\nclassifier = "nosuchmod:x"\n')
        assert kept.take()
        second = kept.copy
        assert second != first
        assert not kept.set_aside(second, 1)  # (not a configuration error: tried again)
        assert kept.set_aside(second, 2)
        assert kept.copy == first
        assert not kept.set_aside(second, 2)  # (said once: a sibling's failure too)
        assert kept.take()  # (the module installed since, say: tried again)
        third = kept.copy
        kept.served(third)
        path.write_text('[lb]\nworker = ["a:1"]\nclassifier = "nosuchmod:y"\n')
        assert kept.take()
        assert kept.set_aside(kept.copy, 2)
        assert kept.copy == third  # (the last one a process started with and served)
        path.write_text('[lb]\nworker = ["a:1"]\nclassifier = "nosuchmod:x"\n')
        assert kept.take()  # (as the good copy: no new one)
        assert kept.copy == third
        for _ in range(5):
            assert kept.take()
        assert len(os.listdir(os.path.dirname(third))) <= 3  # (copies not given are removed)
    finally:
        kept.remove()
    assert not os.path.exists(os.path.dirname(third))


def test_a_sighup_while_the_first_children_start_still_leaves_a_good_copy(tmp_path):
    # The children started with the first copy served after a SIGHUP had
    # made another the latest: none was good, and once a file no process
    # can be built from came, a child set aside started with the file
    # itself, exited 2 at every try, and the pool ran one short for good.
    args, path = parsed(tmp_path, '[lb]\nworker = ["a:1"]\n')
    kept = reload.KeptConfig(args)
    try:
        first = kept.copy
        path.write_text('[lb]\nworker = ["a:1"]\nvariance = 3.0\n')
        assert kept.take()  # (while the children start)
        kept.served(first)
        path.write_text('[lb]\nworker = ["a:1"]\nclassifier = "nosuchmod:x"\n')
        assert kept.take()
        assert kept.set_aside(kept.copy, 2)
        assert kept.copy == first
    finally:
        kept.remove()


def test_a_sighup_after_a_tmp_cleaner_removed_the_copies_copies_the_file_again(tmp_path,
                                                                             caplog):
    # systemd-tmpfiles ages $TMPDIR: once it removed the copies' directory,
    # the next SIGHUP raised FileNotFoundError out of the supervisor's
    # handler, which ended (lb --processes: its children killed, not
    # drained; -w N: every worker stopped).
    import shutil

    args, path = parsed(tmp_path, '[lb]\nworker = ["a:1"]\n')
    kept = reload.KeptConfig(args)
    try:
        kept.served(kept.copy)
        shutil.rmtree(kept.directory)
        assert kept.copy is None  # (meanwhile a child started reads the file itself)
        for worker in ("a:1", "a:2"):  # (unchanged, then changed)
            path.write_text('[lb]\nworker = ["%s"]\n' % worker)
            assert kept.take()
            copy = kept.copy
            assert copy is not None and 'worker = ["%s"]' % worker in open(copy).read()
        kept.served(copy)
        assert kept.copy == copy
    finally:
        kept.remove()
    assert not os.path.exists(os.path.dirname(copy))


@pytest.mark.parametrize("served", [True, False])
def test_a_copy_a_starting_child_was_given_stays_until_it_serves_or_exits(tmp_path, served):
    # Two SIGHUPs while a child started (importing the application) removed
    # the copy it was given: it read the operator's file itself, which may
    # have changed again since (and been refused by the supervisor).
    import subprocess
    import sys

    from zc_lb.process.workergroup import Child

    args, path = parsed(tmp_path, '[worker]\nhistory = 100\n', command="worker")
    kept = reload.KeptConfig(args)
    child = Child(0, [], kept=kept)
    child.command = [sys.executable, "-c", "import time; time.sleep(30)"]  # (never serves)
    try:
        kept.served(kept.copy)  # (the children started at start serve)
        path.write_text('[worker]\nhistory = 200\n')
        assert kept.take()
        child.start()  # (given the copy of history = 200)
        given = child.copy
        for history in (300, 400, 500):
            path.write_text('[worker]\nhistory = %d\n' % history)
            assert kept.take()
        assert given is not None and "history = 200" in open(given).read()
        if served:
            child._serving(child.process)  # (as at its READY line)
        child.process.kill()
        child.process.wait()
        if not served:
            assert not child.set_aside(child.process)  # (status -9: started again)
        path.write_text('[worker]\nhistory = 600\n')
        assert kept.take()
        assert not os.path.exists(given)  # (held no longer: removed)
        assert len(os.listdir(kept.directory)) <= 3  # (the good, the last two read)
    finally:
        if child.process.poll() is None:
            child.process.kill()
        child.process.wait()
        kept.remove()


def test_a_child_of_a_supervisor_reads_its_copy_and_leaves_a_bad_file_to_it(
        tmp_path, monkeypatch, caplog):
    # Each of N children logged the file's error at each SIGHUP, after the
    # supervisor's own: N + 1 lines for one mistake.
    args, path = parsed(tmp_path, '[lb]\nworker = ["a:1"]\nvariance = 2.0\n')
    kept = reload.KeptConfig(args)
    try:
        path.write_text('[lb]\nworker = ["a:1"]\nvariance = 3.0\n')  # (no SIGHUP yet)
        monkeypatch.setattr(reload, "_supervised", False)  # (restored)
        monkeypatch.setenv(reload.CONFIG_COPY, kept.copy)
        child = build_parser().parse_args(args.argv)
        child.argv = args.argv
        child = reload.read_config_at_start(child)
        assert child.variance == 2.0 and child.config == str(path)  # (its SIGHUPs read the file)
        assert reload.CONFIG_COPY not in os.environ
        path.write_text('[lb]\nworker = ["a:1"]\nvariance = -1\n')
        with caplog.at_level("INFO", logger="zc_lb"):
            assert not kept.take()
            reload_config(child, lambda live: None)
    finally:
        kept.remove()
    assert [r.getMessage().count("variance must be at least") for r in caplog.records] == [1]


def test_a_relative_config_path_is_read_again_on_sighup_after_chdir(tmp_path, monkeypatch):
    # SIGHUP read "rel.toml" again in the --chdir directory: not found (or
    # another file of that name).
    from zc_lb import cli

    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    here.mkdir()
    elsewhere.mkdir()
    (here / "rel.toml").write_text('[worker]\nhistory = 100\n')
    monkeypatch.chdir(here)
    seen = {}

    def run(args):  # (what run_worker would do on SIGHUP, without a server)
        (here / "rel.toml").write_text('[worker]\nhistory = 200\n')
        seen["reloaded"] = reload_config(args, lambda live: seen.update(live))
        return 0
    monkeypatch.setitem(cli.COMMANDS, "worker", run)  # (main looks it up as it runs)
    assert cli.main(["worker", "--config", "rel.toml", "--chdir", str(elsewhere),
                     "apps:app"]) == 0
    assert seen.get("history") == 200


@pytest.mark.parametrize("source, cause", [
    ("def app(environ, start_response)\n", "expected ':'"),
    ("raise RuntimeError('no database')\n", "RuntimeError: no database"),
    # A settings module that exits when a variable is missing: it ended
    # the worker with status 1 (0, silently, for sys.exit(0)), which a
    # service manager restarts again and again, and without saying what
    # was being loaded.
    ("import sys; sys.exit('DATABASE_URL is not set')\n",
     "SystemExit: DATABASE_URL is not set"),
    ("import sys; sys.exit(0)\n", "SystemExit: 0"),
])
def test_an_application_that_cannot_load_exits_2_with_the_short_cause(tmp_path, source, cause):
    import subprocess
    import sys

    (tmp_path / "brokenapp.py").write_text(source)
    done = subprocess.run([sys.executable, "-m", "zc_lb.cli", "worker", "brokenapp:app",
                           "--chdir", str(tmp_path)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2, done.stderr
    assert "cannot load the application brokenapp:app" in done.stderr
    assert cause in done.stderr and "brokenapp.py, line 1" in done.stderr
    assert "Traceback" not in done.stderr


def test_an_address_in_use_is_an_error_that_names_the_option():
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        address = "127.0.0.1:%d" % taken.getsockname()[1]
        for argv, option in ((["lb", "--listen", address], "--listen"),
                             (["lb", "--listen", "127.0.0.1:0", "--status", address], "--status"),
                             (["worker", "zc_lb.demo:app", "--listen", address], "--listen")):
            done = subprocess.run([sys.executable, "-m", "zc_lb.cli", *argv],
                                  capture_output=True, text=True, timeout=60)
            assert done.returncode == 1, done.stderr
            assert "%s %s: Address already in use\n" % (option, address) in done.stderr, \
                done.stderr


def test_log_level_in_the_file_applies_unless_the_command_line_gives_one(tmp_path):
    # An LB whose one worker cannot be reached warns so; with log_level
    # = "ERROR" in its file it says nothing, unless the command line
    # gives a level of its own.
    import subprocess
    import sys
    import time

    path = tmp_path / "lb.toml"
    path.write_text('[lb]\nlog_level = "ERROR"\nlisten = "127.0.0.1:0"\n'
                    'worker = ["127.0.0.1:1"]\n')
    for argv, warned in (([], False), (["--log-level", "WARNING"], True)):
        process = subprocess.Popen([sys.executable, "-m", "zc_lb.cli", *argv, "lb", "--config",
                                    str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True)
        try:
            assert process.stdout.readline().startswith("zc-lb lb listening on ")
            time.sleep(1.0)  # (its first attempts to reach the worker)
        finally:
            process.terminate()
            _, err = process.communicate(timeout=30)
        assert ("WARNING" in err) == warned, err


@pytest.mark.parametrize("argv", [["lb"], ["lb", "--processes", "2"], ["worker", "zc_lb.demo:app"]])
def test_the_pid_file_names_the_process_while_it_serves_and_goes_with_it(tmp_path, argv):
    import subprocess
    import sys

    pid_file = tmp_path / "run" / "zc-lb.pid"
    pid_file.parent.mkdir()
    process = subprocess.Popen([sys.executable, "-m", "zc_lb.cli", *argv, "--listen",
                                "127.0.0.1:0", "--pid-file", str(pid_file)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert " listening on " in process.stdout.readline()
        # (written before the line: a script that waits for it finds the pid)
        assert pid_file.read_text() == "%d\n" % process.pid
    finally:
        process.terminate()
        process.communicate(timeout=30)
    assert process.returncode == 0
    assert not pid_file.exists()
    assert list(pid_file.parent.iterdir()) == []  # (no temporary file left either)


@pytest.mark.parametrize("argv", [["lb"], ["lb", "--processes", "2"], ["worker", "zc_lb.demo:app"]])
def test_a_pid_file_that_cannot_be_written_is_said_before_any_listening_line(tmp_path, argv):
    # A script waiting for "listening on" must not take a process that
    # is about to end for one that serves.
    import subprocess
    import sys

    pid_file = tmp_path / "missing" / "zc-lb.pid"
    done = subprocess.run([sys.executable, "-m", "zc_lb.cli", *argv, "--listen", "127.0.0.1:0",
                           "--pid-file", str(pid_file)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2, done.stderr
    assert "--pid-file %s" % pid_file in done.stderr
    assert "listening on" not in done.stdout, done.stdout


def test_reload_starts_the_worker_again_when_the_application_changes(tmp_path):
    import subprocess
    import sys

    from zc_lb.testing import LBProcess, free_port, http_get, wait_for, write_text_app

    app = tmp_path / "devapp.py"
    write_text_app(app, "first")
    address = "127.0.0.1:%d" % free_port()
    worker = subprocess.Popen([sys.executable, "-m", "zc_lb.cli", "worker", "devapp:app",
                               "--reload", "--chdir", str(tmp_path), "--listen", address],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lb = None
    try:
        assert worker.stdout.readline().startswith("zc-lb worker listening on ")
        lb = LBProcess([address]).start()
        wait_for(lambda: http_get(lb.address, "/")[1] == "first", timeout=20,
                 message="the first version served")
        write_text_app(app, "second")
        wait_for(lambda: http_get(lb.address, "/", timeout=5)[1] == "second", timeout=30,
                 message="the second version served")
        assert worker.poll() is None  # (the same process, started again by exec)
    finally:
        if lb is not None:
            lb.kill()
        worker.terminate()
        worker.communicate(timeout=30)


def test_lb_help_lists_its_options_in_groups_each_once(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["lb", "--help"])
    out = capsys.readouterr().out
    headings = [line for line in out.splitlines() if line and not line.startswith(" ")
                and line.endswith(":")]
    assert headings == ["options:", "front (clients, HTTP, TLS):",
                        "workers (where they are, how they are reached and judged):",
                        "routing:", "buffering (request bodies and responses held for slow clients):",
                        "operations:"]
    options = re.findall(r"^  (--[a-z-]+)", out, re.M)
    assert len(options) == len(set(options)) > 50
    routing = out[out.index("routing:"):out.index("buffering")]
    assert "--variance" in routing and "--policy" in routing and "--buffer-dir" not in routing


@pytest.mark.parametrize("built, pure, warned", [
    ("source (installed without compiling: pip install -v says why)", None, True),
    ("source (ZC_LB_PURE=1)", "1", False),
    ("compiled", None, False)])
def test_an_lb_or_worker_running_the_source_unasked_says_so_at_start(
        built, pure, warned, monkeypatch, caplog):
    # A pip install without a C compiler ran the source, at some twice the
    # CPU a request, and said so only to --version and the status page.
    import zc_lb

    monkeypatch.setattr(zc_lb, "_BUILD", built)
    monkeypatch.delenv("ZC_LB_PURE", raising=False)
    if pure:
        monkeypatch.setenv("ZC_LB_PURE", pure)
    with caplog.at_level("WARNING", logger="zc_lb"):
        cli.say_build()
    assert ("the hot path runs uncompiled" in caplog.text) == warned
    assert (built in caplog.text) == warned


@pytest.mark.parametrize("argv", [
    ["zk", "import", "tree.txt", "--delete", "/lb"],
    ["zk", "import", "--delete", "tree.txt", "/lb"],
    ["zk", "import", "tree.txt", "/lb", "--delete"],
    ["zk", "import", "tree.txt", "--zookeeper", "zk1:2181", "--delete", "/lb"],
    ["zk", "--zookeeper", "zk1:2181", "import", "tree.txt", "--timeout", "3", "/lb",
     "--delete", "--log-level", "WARNING"],
])
def test_a_tree_commands_options_go_before_between_or_after_its_arguments(argv):
    # ``zk import FILE --delete ROOT`` was refused (argparse gave the
    # optional ROOT its default before --delete, then had /lb left over),
    # as was any of zk's own options after the tree command.
    args = build_parser().parse_args(argv)
    assert (args.zk_command, args.file, args.root, args.delete) == (
        "import", "tree.txt", "/lb", True)
    assert args.zookeeper == ("zk1:2181" if "--zookeeper" in argv else "127.0.0.1:2181")
    assert args.timeout == (3.0 if "--timeout" in argv else 10.0)
    assert args.log_level == ("WARNING" if "WARNING" in argv else "INFO")
    args = build_parser().parse_args(["zk", "set", "/lb", "a=1", "--force", "b=2"])
    assert (args.path, args.assignments, args.force) == ("/lb", ["a=1", "b=2"], True)
    args = build_parser().parse_args(["zk", "ls", "--timeout", "2", "/lb"])
    assert (args.path, args.timeout, args.zookeeper) == ("/lb", 2.0, "127.0.0.1:2181")


@pytest.mark.parametrize("argv, expected", [
    (["zk", "import", "--", "-tree.txt"], ("-tree.txt", "/")),
    (["zk", "import", "--delete", "--", "-tree.txt", "/lb"], ("-tree.txt", "/lb")),
    (["zk", "import", "tree.txt", "--", "-lb"], ("tree.txt", "-lb")),
    (["zk", "get", "--", "-lb"], "-lb"),
    (["zk", "ls", "--", "-lb"], "-lb"),
    (["zk", "set", "--", "-lb", "a=1"], ("-lb", ["a=1"])),
])
def test_a_tree_commands_arguments_after_double_dash_may_start_with_a_dash(argv, expected):
    # Taking options in any order lost ``--``: what followed it was read
    # as an option ("unrecognized arguments: -tree.txt").
    args = build_parser().parse_args(argv)
    got = {"import": lambda: (args.file, args.root), "set": lambda: (args.path, args.assignments)
           }.get(args.zk_command, lambda: args.path)()
    assert got == expected
