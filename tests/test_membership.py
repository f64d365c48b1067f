"""zc_lb.zookeeper.membership, mostly without ZooKeeper: how settings read from a
node are applied (the recipes that read them are tested in test_recipes.py),
and, against the real ZooKeeper of conftest.py, a start it refuses."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import pytest

from zc_lb.routing.affinity import AffinityPool
from zc_lb.lb.balancer import LB
from zc_lb.errors import ConfigurationError
from zc_lb.zookeeper import client as zk
from zc_lb.zookeeper.membership import LBMembership, WorkerMembership


def lb_membership(**base):
    lb = LB(AffinityPool(), lambda environ: None, no_worker_timeout=30.0)
    settings = dict(variance=1.0, backlog_history=9, unskilled_score=1.0,
                    no_worker_timeout=30.0, single_version=False, spread=1.0,
                    footprint_window=5000, slow_start=2000, balance=1.5, stick=1.5, widen=0.3,
                    reset_skills="")
    settings.update(base)
    return LBMembership(lb, "127.0.0.1:1", "/lb", ("127.0.0.1", 1), base_settings=settings)


def test_each_good_setting_applies_even_beside_a_bad_one(caplog):
    # One bad value used to make the LB ignore the whole node.
    membership = lb_membership()
    with caplog.at_level(logging.ERROR, logger="zc_lb.zookeeper.membership"):
        membership.settings_changed({"variance": "abc", "unskilled_score": 2,
                                      "backlog_history": 2.7, "balance": 0.5,
                                      "no_worker_timeout": 5, "description": "x"})
    pool = membership.lb.pool
    assert pool.unskilled_score == 2.0 and membership.lb.no_worker_timeout == 5.0
    assert (pool.variance, pool.backlog_history, pool.balance) == (1.0, 9, 1.5)
    errors = [r.getMessage() for r in caplog.records]
    assert len(errors) == 3 and all("ignoring a bad LB setting" in e for e in errors)
    assert any("variance" in e for e in errors) and any("balance" in e for e in errors)


def test_a_bad_setting_keeps_its_value_a_removed_one_falls_back():
    membership = lb_membership(variance=2.0)
    membership.settings_changed({"variance": 4})
    assert membership.lb.pool.variance == 4.0
    membership.settings_changed({"variance": -1, "spread": 2})
    assert membership.lb.pool.variance == 4.0 and membership.lb.pool.spread == 2.0
    membership.settings_changed({})
    assert membership.lb.pool.variance == 2.0 and membership.lb.pool.spread == 1.0


def test_a_null_setting_falls_back_to_the_command_lines_value():
    # (`zc-lb zk set /lb variance=null`) It gave the built-in default.
    membership = lb_membership(variance=4.0)
    membership.settings_changed({"variance": 2})
    assert membership.lb.pool.variance == 2.0
    membership.settings_changed({"variance": None})
    assert membership.lb.pool.variance == 4.0


def test_a_new_reset_skills_value_resets_the_pool_once():
    membership = lb_membership()
    pool = membership.lb.pool
    pool.add("w")
    pool.new_resume("w", {"a": 3.0})
    membership.settings_changed({"reset_skills": "t1"})  # the value at start
    assert pool.resets == 0 and pool.skilled
    membership.settings_changed({"reset_skills": "t2"})
    assert pool.resets == 1 and not pool.skilled
    membership.settings_changed({"reset_skills": "t2", "variance": 2})
    assert pool.resets == 1
    # Removed (a site's tree imported with --delete), then put back: no new token.
    membership.settings_changed({"variance": 2})
    membership.settings_changed({"reset_skills": "t2"})
    assert pool.resets == 1
    membership.settings_changed({"reset_skills": "t3"})
    assert pool.resets == 2


def test_worker_settings_apply_each_good_value():
    configured = []
    live = ("history", "max_skill_age", "max_classes", "resume_interval")
    worker = SimpleNamespace(
        settings=lambda: dict(history=100, max_skill_age=None, max_classes=10_000,
                              resume_interval=10.0),
        configure=lambda changes, source: configured.append(tuple(changes[n] for n in live)),
        reset_skills=lambda token: configured.append("reset"), reset_token=None,
        seen_reset_token=lambda token: None)
    membership = WorkerMembership(worker, "127.0.0.1:1", "/lb/workers")
    membership.settings_changed({"history": "x", "max_skill_age": 50, "max_classes": 0,
                                  "resume_interval": -1})
    assert configured == [(100, 50, 10_000, 10.0)]
    membership.settings_changed({"max_classes": 500, "resume_interval": 2.5})
    assert configured[-1] == (100, None, 500, 2.5)
    membership.settings_changed({"reset_skills": "now"})
    assert configured[-1] == "reset"


def test_both_roles_keep_the_value_in_force_on_a_bad_one_and_fall_back_when_removed():
    # design.rst's rule, one NodeSettings for both: the worker fell back
    # to the command line's value on a bad one, where the LB kept its own.
    configured = []
    live = ("history", "max_skill_age", "max_classes", "resume_interval")
    worker = SimpleNamespace(
        settings=lambda: dict(history=100, max_skill_age=None, max_classes=10_000,
                              resume_interval=10.0),
        configure=lambda changes, source: configured.append(changes["history"]),
        reset_skills=lambda token: None, reset_token=None,
        seen_reset_token=lambda token: None)
    membership = WorkerMembership(worker, "127.0.0.1:1", "/lb/workers")
    membership.settings_changed({"history": 50})
    membership.settings_changed({"history": "x"})  # bad: 50 stays
    membership.settings_changed({})  # removed: the command line's
    assert configured == [50, 50, 100]
    lb = lb_membership()
    lb.settings_changed({"variance": 3})
    lb.settings_changed({"variance": "x"})
    assert lb.lb.pool.variance == 3
    lb.settings_changed({})
    assert lb.lb.pool.variance == 1


def test_a_setting_changed_in_zookeeper_is_logged_as_a_file_change_is(caplog):
    # Each source applied settings itself, and ZooKeeper's logged the whole
    # dict where a file's logged "variance 1 -> 2.5 (file)".
    membership = lb_membership()
    with caplog.at_level("INFO", logger="zc_lb"):
        membership.settings_changed({"variance": "2.5", "no_worker_timeout": 3})
    assert "variance 1 -> 2.5 (ZooKeeper /lb)" in caplog.text
    assert "no_worker_timeout 30 -> 3 (ZooKeeper /lb)" in caplog.text
    assert "balance" not in caplog.text  # (unchanged: not logged)
    assert membership.lb.pool.variance == 2.5 and membership.lb.no_worker_timeout == 3


def test_an_lb_on_a_unix_socket_registers_under_a_name_without_slashes():
    import socket

    from zc_lb.zookeeper.membership import advertised

    assert advertised("/run/zc-lb/lb.sock") == "unix:%2Frun%2Fzc-lb%2Flb.sock@" + \
        socket.gethostname()
    assert advertised(("10.1.2.3", 8081)) == "10.1.2.3:8081"


def test_a_worker_compares_the_first_token_with_its_resume_files():
    # The first token seen resets nothing, unless the résumé file saw another
    # before the worker stopped: a reset it missed.
    def worker(file_token):
        calls = []
        fake = SimpleNamespace(
            settings=lambda: dict(history=100, max_skill_age=None, max_classes=10_000,
                                  resume_interval=10.0),
            configure=lambda changes, source: None, reset_token=file_token,
            reset_skills=lambda token: calls.append(("reset", token)),
            seen_reset_token=lambda token: calls.append(("seen", token)))
        membership = WorkerMembership(fake, "127.0.0.1:1", "/lb/workers")
        membership.reset_token = fake.reset_token  # (as _start takes it)
        return membership, calls

    for file_token, zk_token, expected in [
            ("t1", "t2", [("reset", "t2")]),  # reset while it was stopped
            ("", "t2", [("reset", "t2")]),  # the first reset of the site, missed
            ("t1", "t1", []),
            ("t1", "", []),  # the property removed: no new token
            (None, "t2", [("seen", "t2")])]:  # a file of format 1, or none: not known
        membership, calls = worker(file_token)
        membership.settings_changed({"reset_skills": zk_token} if zk_token else {})
        assert calls == expected, (file_token, zk_token)


def test_a_start_with_credentials_the_acl_refuses_is_a_configuration_error(zk_hosts):
    # It started anyway, logged 4 tracebacks a second for ever, and took 4
    # times its timeout to start.
    site = zk.connect(zk_hosts, timeout=5, credentials=("site", "s3cret"))
    try:
        zk.import_tree(site, "/lb\n  variance = 4\n  /providers\n  /workers\n"
                             "    /providers\n")
    finally:
        site.stop()
        site.close()
    worker = SimpleNamespace(settings=lambda: dict(history=100), reset_token=None,
                             address=("127.0.0.1", 1))
    for credentials in (("site", "wrong"), None):
        lb = LBMembership(lb_membership().lb, zk_hosts, "/lb", ("127.0.0.1", 1),
                          credentials=credentials)
        worker_membership = WorkerMembership(worker, zk_hosts, "/lb/workers",
                                             credentials=credentials)
        for member, start in ((lb, lb.start), (worker_membership, worker_membership._start)):
            began = time.monotonic()
            with pytest.raises(ConfigurationError, match="ZooKeeper refused"):
                start(timeout=2)
            assert time.monotonic() - began < 2
            member.stop()
