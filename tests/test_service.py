"""Tests for zc_lb.process.service: what every process does around its work, and
the lifecycle of a worker's and an LB's parts (order of start, register,
configure, stop)."""

from __future__ import annotations

import argparse

import pytest

from zc_lb.errors import ConfigurationError
from zc_lb.process.service import (DEFAULT_LISTEN, LBService, WorkerService, parse_listeners,
                           read_secret)


def test_a_secret_file_is_read_stripped_and_an_empty_or_missing_one_refused(tmp_path):
    assert read_secret(None) is None and read_secret("") is None
    path = tmp_path / "secret"
    path.write_bytes(b"  s3cret\n")
    assert read_secret(str(path)) == b"s3cret"
    path.write_bytes(b"\n")
    with pytest.raises(ConfigurationError, match="is empty"):
        read_secret(str(path))
    with pytest.raises(ConfigurationError, match="cannot read secret file"):
        read_secret(str(tmp_path / "missing"))



@pytest.mark.parametrize("mode, who", [(0o644, "group and others"), (0o640, "group"),
                                       (0o604, "others")])
def test_a_secret_file_others_can_read_is_used_with_a_warning_naming_it(
        tmp_path, caplog, mode, who):
    # (as ssh says of a key; refusing it would stop deployments that run)
    import logging
    import os

    path = tmp_path / "secret"
    path.write_bytes(b"s3cret\n")
    path.chmod(mode)
    stranger = 65534  # (nogroup: not this process's)
    if stranger in (os.getegid(), *os.getgroups()):
        pytest.skip("this process is in group %d" % stranger)
    try:
        os.chown(path, -1, stranger)
    except PermissionError:
        pytest.skip("cannot give a file another group")
    with caplog.at_level(logging.WARNING, logger="zc_lb"):
        assert read_secret(str(path)) == b"s3cret"
    assert [r.getMessage() for r in caplog.records] == [
        "secret file %s can be read by %s (mode %04o): make it readable by the service "
        "alone (chmod 600, or 640 and a group the service runs in)" % (path, who, mode)]


@pytest.mark.parametrize("mode", [0o600, 0o400, 0o640])
def test_a_secret_file_of_the_service_alone_or_its_group_is_read_without_a_word(
        tmp_path, caplog, mode):
    # 640 of the service's own group: docs/howto/deploy-systemd.rst's
    import logging

    path = tmp_path / "secret"
    path.write_bytes(b"s3cret\n")
    path.chmod(mode)
    with caplog.at_level(logging.WARNING, logger="zc_lb"):
        assert read_secret(str(path)) == b"s3cret"
    assert not caplog.records


def handled(signum, handler, caplog):
    """Send ourselves ``signum`` and serve it with ``handler`` (by
    ``wait_for_signal``, until a handler returns True), with warnings and
    up in ``caplog``."""
    import logging
    import os
    import signal

    import gevent

    from zc_lb.process.service import wait_for_signal

    previous = signal.getsignal(signum)
    keeper = gevent.spawn(gevent.sleep, 10)  # (signal watchers alone do not keep the loop)
    try:
        gevent.spawn_later(0.05, os.kill, os.getpid(), signum)
        with caplog.at_level(logging.WARNING, logger="zc_lb"):
            wait_for_signal({signal.Signals(signum).name: handler})
    finally:
        keeper.kill()
        signal.signal(signum, previous)


def test_sighup_says_a_changed_secret_file_needs_a_restart(tmp_path, caplog, monkeypatch):
    # The secret is read at start; a SIGHUP said "nothing changed" while
    # the old one stayed in use.
    import os
    import signal

    from zc_lb.process import service

    monkeypatch.setattr(service, "SECRETS_READ", {}, raising=False)
    secret, token = tmp_path / "secret", tmp_path / "token"
    secret.write_bytes(b"s3cret\n")
    token.write_bytes(b"t0ken\n")
    read_secret(str(secret)), read_secret(str(token))
    secret.write_bytes(b"s3cret\n\n")  # (the same secret)
    caplog.clear()
    said = []

    def hangup():  # (after the files were read again)
        said.append([r.getMessage() for r in caplog.records])
        caplog.clear()
        if len(said) == 1:
            secret.write_bytes(b"n3w\n")
            token.unlink()
            os.kill(os.getpid(), signal.SIGHUP)
        return len(said) == 2

    handled(signal.SIGHUP, hangup, caplog)
    unchanged, changed = said
    assert unchanged == []
    assert changed[0] == ("secret file %s changed: restart to apply (the secret read at "
                          "start stays in force)" % secret), changed
    assert changed[1].startswith("SIGHUP: cannot read secret file %s: " % token), changed
    assert changed[1].endswith("; the secret read at start stays in force"), changed


def listeners(*listen, certfile=None, redirect=False, processes=1):
    return parse_listeners(argparse.Namespace(listen=list(listen) or None, certfile=certfile,
                                              redirect_https=redirect, processes=processes))


def test_listeners_take_their_scheme_from_the_address_or_from_certfile():
    assert listeners() == [("http", DEFAULT_LISTEN)]
    assert listeners("h:1") == [("http", "h:1")]
    assert listeners("h:1", certfile="c.pem") == [("https", "h:1")]
    assert listeners("http://h:1", "https://h:2", certfile="c.pem") == [
        ("http", "h:1"), ("https", "h:2")]


@pytest.mark.parametrize("kw, message", [
    (dict(listen=("ftp://h:1",)), "the scheme is http:// or https://"),
    (dict(listen=("https://h:1",)), "needs --certfile"),
    (dict(listen=("h:1",), redirect=True), "--redirect-https needs an HTTPS --listen"),
    (dict(listen=("h:1", "h:2"), processes=2), "--processes takes one --listen address"),
])
def test_listeners_that_cannot_work_are_refused_saying_why(kw, message):
    with pytest.raises(ConfigurationError, match=message):
        listeners(*kw.pop("listen"), **kw)


class Part:
    """A fake part that writes what is done to it in a shared journal."""

    def __init__(self, name, journal, **attributes):
        self.name, self.journal = name, journal
        self.__dict__.update(attributes)

    def __getattr__(self, method):
        return lambda *args, **kw: self.journal.append((self.name, method) + args)


def test_a_worker_service_leaves_zookeeper_before_it_drains_and_stops_last():
    journal = []
    service = WorkerService(Part("worker", journal), Part("status", journal),
                            Part("zk", journal), drain_timeout=7)
    service.start()
    service.register()
    assert journal == [("worker", "start"), ("status", "start"), ("zk", "start")]
    journal.clear()
    assert service.stop() is True
    assert [entry[:2] for entry in journal] == [("zk", "deregister"), ("worker", "stop"),
                                                ("status", "stop"), ("zk", "stop")]


def test_live_settings_go_through_zookeeper_when_there_is_one_else_to_the_worker():
    journal = []
    alone = WorkerService(Part("worker", journal))
    alone.configure({"history": 5}, "f.toml")
    member = WorkerService(Part("worker", journal), membership=Part("zk", journal))
    member.configure({"history": 6}, "f.toml")
    assert journal == [("worker", "configure", {"history": 5}, "f.toml"),
                       ("zk", "rebase", {"history": 6}, "f.toml")]


def test_an_lb_service_starts_workers_before_fronts_and_drains_before_it_closes():
    journal = []
    log = Part("log", journal)
    fronts = [Part("front0", journal, access_log=log), Part("front1", journal, access_log=log)]
    lb = Part("lb", journal, fleet=Part("fleet", journal))
    service = LBService(lb, fronts, Part("status", journal), drain_timeout=3)
    service.start(["w:1"], "/health", 2.0)
    assert journal == [("fleet", "set_workers", ["w:1"]), ("lb", "watch_workers"),
                       ("fleet", "start_health_checks", "/health", 2.0),
                       ("front0", "start"), ("front1", "start"), ("status", "start")]
    service.register(Part("zk", journal))
    journal.clear()
    assert service.stop() is True
    assert [entry[:2] for entry in journal] == [
        ("front0", "drain"), ("front1", "drain"), ("lb", "drain"),
        ("front0", "stop"), ("front1", "stop"), ("log", "close"),  # once, after both
        ("status", "stop"), ("zk", "stop"), ("lb", "stop")]


def test_an_lb_service_takes_a_new_worker_list_and_passes_the_rest_on():
    journal = []
    lb = Part("lb", journal, fleet=Part("fleet", journal))
    service = LBService(lb, [Part("front", journal, access_log=None)])
    live = {"worker": ["w:2"], "variance": 2.0}
    service.configure(live, "f.toml")
    assert live == {"worker": ["w:2"], "variance": 2.0}  # (the caller records what runs)
    service.configure({"worker": []}, "f.toml")  # (nothing else: no configure call)
    # A list with a bad address changes nothing, the other settings neither.
    with pytest.raises(ConfigurationError, match="'nohost'"):
        service.configure({"worker": ["w:3", "nohost"], "variance": 3.0}, "f.toml")
    assert journal == [("lb", "configure", {"variance": 2.0}, "f.toml"),
                       ("fleet", "set_workers", ["w:2"]),
                       ("fleet", "set_workers", [])]
    assert service.reopen() is False  # no access log: nothing to reopen


def test_signals_that_come_while_the_last_is_handled_are_logged_when_the_process_ends(caplog):
    # A second SIGUSR2 during a restart used to vanish without a word.
    import os
    import signal

    import gevent

    def restart():
        os.kill(os.getpid(), signal.SIGUSR2)  # (a second one, while this one is handled)
        gevent.sleep(0.2)
        return True  # the new LB took over: this one ends

    handled(signal.SIGUSR2, restart, caplog)
    assert any("SIGUSR2 came while SIGUSR2 was handled" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_a_second_wait_for_signal_in_the_process_gets_its_signals(caplog):
    # The first left its watchers behind: once the signal's disposition was
    # put back (by a test, or a library), the second never saw its signal.
    import signal

    import gevent

    got_by_python = []
    previous = signal.signal(signal.SIGUSR1, lambda *_: got_by_python.append(1))
    try:
        for _ in range(2):
            with gevent.Timeout(5):
                handled(signal.SIGUSR1, lambda: True, caplog)
            signal.signal(signal.SIGUSR1, lambda *_: got_by_python.append(1))
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert got_by_python == []
