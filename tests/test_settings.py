"""The settings table: the command line, ZooKeeper and the pools all
take their defaults and checks from it."""

from __future__ import annotations

import re

import pytest

from zc_lb import cli, settings
from zc_lb.cli import parsers, reload
from zc_lb.routing.affinity import AffinityPool
from zc_lb.errors import ConfigurationError
from zc_lb.lb.outlier import Ejector
from zc_lb.routing.pool import Pool
from zc_lb.worker.resume import Skills
from zc_lb.settings import (CLI, LB_NODE_SETTINGS, LB_SETTINGS, WORKER_NODE_SETTINGS,
                            WORKER_SETTINGS, ZOOKEEPER, check, check_property, parse,
                            parse_each)

TABLES = {"lb": LB_SETTINGS, "worker": WORKER_SETTINGS}


def parse_args(*argv):
    return parsers.build_parser().parse_args(list(argv))


@pytest.mark.parametrize("command,argv", [("lb", ["lb"]), ("worker", ["worker", "app:app"])])
def test_the_parsers_give_the_table_s_defaults(command, argv):
    args = parse_args(*argv)
    for name, setting in settings.given_in(TABLES[command], CLI).items():
        assert getattr(args, name) == setting.default, name


@pytest.mark.parametrize("command", sorted(TABLES))
def test_the_parsers_take_each_setting_by_the_options_the_table_names(command):
    # (the reference lists Setting.options: --busy-members, --no-busy-members)
    given = {option: action.option_strings
             for action in parsers.build_parser().commands[command].options
             for option in action.option_strings}
    for name, setting in settings.given_in(TABLES[command], CLI).items():
        assert given[setting.option] == list(setting.options), name


def test_every_setting_has_help_and_a_known_place():
    for table in TABLES.values():
        for name, setting in table.items():
            assert setting.name == name and setting.help.strip(), name
            assert setting.where and setting.where <= {"cli", "zookeeper", "live"}, name
            if setting.default is not None:
                assert check(table, name, setting.default) == setting.default, name


def test_zookeeper_nodes_take_only_the_settings_marked_for_them():
    assert set(LB_NODE_SETTINGS) == {
        "variance", "backlog_history", "unskilled_score", "spread", "footprint_window",
        "slow_start", "balance", "stick", "widen", "separate_books", "busy_members", "no_worker_timeout",
        "single_version",
        "reset_skills"}
    assert set(WORKER_NODE_SETTINGS) == {"history", "max_skill_age", "max_classes",
                                         "resume_interval", "reset_skills"}
    assert all(ZOOKEEPER in s.where for s in LB_NODE_SETTINGS.values())


def test_the_pools_defaults_are_the_table_s():
    pool = AffinityPool()
    for name in AffinityPool.SETTINGS:
        assert getattr(pool, name) == LB_SETTINGS[name].default, name
    skills = Skills()
    assert skills.history == WORKER_SETTINGS["history"].default
    ejector = Ejector()
    assert (ejector.consecutive, ejector.base_time, ejector.max_share) == (
        LB_SETTINGS["eject_after"].default, LB_SETTINGS["eject_time"].default,
        LB_SETTINGS["max_ejected"].default)


def test_parse_converts_text_and_json_values():
    assert parse(LB_SETTINGS, "backlog_history", "12") == 12
    assert parse(LB_SETTINGS, "backlog_history", 12.0) == 12
    assert parse(LB_SETTINGS, "variance", 2) == 2.0
    assert parse(LB_SETTINGS, "single_version", "yes") is True
    assert parse(LB_SETTINGS, "variance", None) == 1.0  # a JSON null: the default


@pytest.mark.parametrize("name,value,message", [
    ("backlog_history", 2.7, "not an integer"),
    ("backlog_history", "2.7", "not an integer"),
    ("backlog_history", True, "not an integer"),
    ("variance", True, "not a number"),
    ("variance", "abc", "not a number"),
    ("variance", "nan", "finite"),
    ("variance", 10 ** 400, "finite"),  # (JSON's or TOML's integer, past a float's range)
    ("backlog_history", 10 ** 400, "too large"),
    ("backlog_history", float(2 ** 60), "too large"),
    ("variance", 0, "at least"),
    ("balance", 0.5, "at least 1"),
    ("max_ejected", 1.5, "at most 1"),
    ("slow_start", -1, "at least 0"),
    ("tls_min_version", "TLSv1.1", "one of"),
    ("single_version", "maybe", "not a boolean"),
])
def test_parse_refuses_bad_values_naming_the_setting(name, value, message):
    with pytest.raises(ConfigurationError, match=message) as info:
        parse(LB_SETTINGS, name, value)
    assert name in str(info.value)


def test_parse_refuses_unknown_names():
    with pytest.raises(ConfigurationError, match="unknown setting 'varience'"):
        parse(LB_SETTINGS, "varience", 1)


def test_check_takes_only_values_of_the_setting_s_type():
    assert check(LB_SETTINGS, "variance", 2) == 2.0
    assert check(LB_SETTINGS, "backlog_history", 4.0) == 4
    assert check(WORKER_SETTINGS, "max_skill_age", None) is None  # default None
    for name, value in (("backlog_history", "9"), ("backlog_history", 2.7),
                        ("backlog_history", None), ("variance", True),
                        ("variance", "1"), ("single_version", 1),
                        ("history", 0)):
        table = WORKER_SETTINGS if name == "history" else LB_SETTINGS
        with pytest.raises(ConfigurationError, match=name):
            check(table, name, value)


@pytest.mark.parametrize("make", [
    lambda: Pool(backlog_history=2.7), lambda: Pool(variance=True),
    lambda: AffinityPool(footprint_window=2.7), lambda: AffinityPool(balance=0.99),
    lambda: Skills(history=2.7), lambda: Skills(history=9, max_skill_age=True),
])
def test_constructors_refuse_what_the_table_refuses(make):
    with pytest.raises(ConfigurationError):
        make()


def test_update_settings_is_all_or_nothing_and_knows_its_settings():
    pool = AffinityPool()
    with pytest.raises(ConfigurationError):
        pool.update_settings(variance=3.0, slow_start=2.5)
    assert (pool.variance, pool.slow_start) == (1.0, 2000)
    pool.update_settings(variance=3, slow_start=10.0)
    assert (pool.variance, pool.slow_start) == (3.0, 10)
    assert type(pool.slow_start) is int
    with pytest.raises(TypeError):
        Pool().update_settings(spread=2.0)


def test_check_property():
    check_property("/lb", "variance", 2)
    check_property("/lb", "description", "the main site")
    check_property("/lb/workers", "history", 50)
    check_property("/lb", "anything", 1, force=True)
    for path, key, value, message in (
            ("/lb", "backlog_history", 2.7, "bad value for backlog_history"),
            ("/lb", "balance", 0.5, "at least 1"),
            ("/lb", "varience", 5, "unknown setting 'varience'"),
            ("/lb", "history", 5, "a setting of the workers node"),
            ("/lb/workers", "variance", 5, "a setting of the LB node"),
            ("/lb", "max_connections", 5, "a command-line option only"),
            ("/lb/workers", "threads", 5, "a command-line option only")):
        with pytest.raises(ConfigurationError, match=message):
            check_property(path, key, value)


def test_parse_each_keeps_good_values_next_to_bad_ones():
    good, bad = parse_each(LB_NODE_SETTINGS, {
        "variance": "2", "backlog_history": 2.7, "balance": 0.5, "spread": 3,
        "description": "x", "max_connections": 5})
    assert good == {"variance": 2.0, "spread": 3.0}
    assert len(bad) == 2
    assert any("backlog_history" in m for m in bad) and any("balance" in m for m in bad)


@pytest.mark.parametrize("argv,message", [
    (["lb", "--backlog-history", "2.7"], "argument --backlog-history: .*not an integer"),
    (["lb", "--variance", "abc"], "argument --variance: .*not a number"),
    (["lb", "--max-ejected", "2"], "argument --max-ejected: .*at most 1"),
    (["lb", "--footprint-window", "0"], "argument --footprint-window: .*at least 1"),
    (["lb", "--tls-min-version", "SSLv3"], "argument --tls-min-version"),
    (["worker", "app:app", "--history", "1.5"], "argument --history: .*not an integer"),
    (["worker", "app:app", "--threads", "0"], "argument --threads: .*at least 1"),
    (["worker", "app:app", "--greenlets", "--concurrency", "-1"],
     "argument --concurrency: .*at least 0"),
])
def test_argparse_refuses_a_bad_value_naming_the_option(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(*argv)
    assert info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_the_command_line_parses_through_the_table():
    args = parse_args("lb", "--backlog-history", "4", "--variance", "2", "--single-version",
                      "--max-ejected", "0.25", "--tls-min-version", "TLSv1.3")
    assert (args.backlog_history, args.variance, args.single_version, args.max_ejected,
            args.tls_min_version) == (4, 2.0, True, 0.25, "TLSv1.3")
    assert parse_args("worker", "app:app", "--greenlets").threads is None
    assert parse_args("worker", "app:app", "--threads", "4").threads == 4
    assert parse_args("worker", "app:app", "--greenlets", "--concurrency", "2").concurrency == 2


def test_a_greenlet_bound_with_threads_is_refused(capsys):
    assert cli.main(["worker", "app:app", "--threads", "4", "--concurrency", "2"]) == 2
    assert "--concurrency bounds --greenlets" in capsys.readouterr().err


def test_the_lb_hands_zookeeper_its_command_line_values_as_the_base():
    from zc_lb.cli.lb import _lb_settings

    base = _lb_settings(parse_args("lb", "--balance", "2"))
    assert set(base) == set(LB_NODE_SETTINGS)
    assert base["balance"] == 2.0 and base["reset_skills"] == ""


def test_help_shows_the_default_and_where_a_setting_lives(capsys):
    with pytest.raises(SystemExit):
        parse_args("lb", "--help")
    out = " ".join(capsys.readouterr().out.split())
    assert "(default 9) [ZooKeeper: backlog_history, live]" in out
    assert "0 waits forever (default 300)" in out


@pytest.mark.parametrize("text, size", [("1M", 1 << 20), ("512K", 512 << 10), ("64mb", 64 << 20),
                                        ("1.5GiB", 3 << 29), ("4096", 4096), (4096, 4096)])
def test_sizes_take_units(text, size):
    from zc_lb.settings import LB_SETTINGS

    assert LB_SETTINGS["buffer_memory"].convert(text) == size


@pytest.mark.parametrize("text", ["1X", "-1M", "1.3", "M", "1 M B"])
def test_a_size_that_is_none_is_refused(text):
    from zc_lb.settings import LB_SETTINGS

    with pytest.raises(ConfigurationError, match="buffer_memory"):
        LB_SETTINGS["buffer_memory"].convert(text)


def test_sizes_with_units_on_the_command_line_and_in_a_file(tmp_path):
    args = parsers.build_parser().parse_args(["lb", "--buffer-memory", "1M"])
    assert args.buffer_memory == 1 << 20
    path = tmp_path / "lb.toml"
    path.write_text('[lb]\nbuffer_memory_total = "64M"\n')
    args = parsers.build_parser().parse_args(["lb", "--config", str(path)])
    args.argv, args.command = ["lb", "--config", str(path)], "lb"
    assert reload.read_config(args).buffer_memory_total == 64 << 20


@pytest.mark.parametrize("name", ["variance", "spread"])
def test_a_setting_the_pool_rounds_up_refuses_what_would_overflow(name):
    # (ceil of the product with a pool's counts: 1e308 made inf, and OverflowError)
    with pytest.raises(ConfigurationError, match="at most"):
        parse(LB_SETTINGS, name, 1e308)
