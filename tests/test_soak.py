"""``make soak`` in a few seconds: it runs, samples and judges; the ten
minute run is the real one (docs/howto/evaluate.rst, "Measure zc-lb
itself")."""

from benchmarks import soak


def test_a_short_soak_samples_and_says_it_cannot_tell(capsys):
    # (two samples, the first of them the warm-up's: nothing to judge by,
    # which must not pass for flat)
    assert soak.main(["--duration", "4", "--every", "2", "--connections", "8"]) == 1
    out = capsys.readouterr().out
    assert "capacity" in out and "verdict: too short to tell; 0 answers not 2xx" in out
    assert out.count("/") >= 6  # RSS/fds samples for three processes, twice


def test_verdict():
    assert soak.verdict([(100, 5), (100, 5), (104, 6)], 1).startswith("flat")
    assert soak.verdict([(100, 5), (100, 5), (106, 5)], 1).startswith("GROWING")
    assert soak.verdict([(100, 5), (100, 5), (100, 20)], 1).startswith("GROWING")
    assert soak.verdict([(100, 5)], 1) == "too short to tell"


def test_the_last_line_is_flat_only_where_every_process_was_judged_flat():
    flat, growing, short = "flat (RSS +1.0%, fds +0)", "GROWING (RSS +9.0%, fds +0)", \
        "too short to tell"
    assert soak.summary({"lb": flat, "worker1": flat}, {"200": 9}) == (
        "verdict: flat; 0 answers not 2xx", 0)
    assert soak.summary({"lb": flat, "worker1": flat}, {"200": 9, "503": 2}) == (
        "verdict: flat; 2 answers not 2xx", 1)
    assert soak.summary({"lb": growing, "worker1": short}, {"200": 9}) == (
        "verdict: growing: lb; 0 answers not 2xx", 1)
    assert soak.summary({"lb": short, "worker1": short}, {"200": 9}) == (
        "verdict: too short to tell; 0 answers not 2xx", 1)


def test_settings_it_cannot_run_with_are_refused_before_it_starts(capsys):
    import pytest

    # (--every 0 divided by zero after the whole run; --share 0 soaked
    # unpaced, at full speed)
    for argv in (["--every", "0"], ["--share", "0"], ["--duration", "-1"],
                 ["--connections", "0"]):
        with pytest.raises(SystemExit) as exc:
            soak.main(["--duration", "0.2"] + argv)
        assert exc.value.code == 2, argv
        assert "must be" in capsys.readouterr().err


def test_a_deployment_that_answers_nothing_is_an_error_not_an_unpaced_soak(
        monkeypatch, capsys):
    import contextlib
    import os

    from zc_lb.testing import free_port

    @contextlib.contextmanager
    def deployment():  # (nothing listens there)
        yield ("127.0.0.1", free_port()), {"lb": os.getpid()}

    monkeypatch.setattr(soak, "deployment", deployment)
    assert soak.main(["--duration", "0.4", "--every", "0.2", "--connections", "2"]) == 1
    out, err = capsys.readouterr()
    assert "soaking at" not in out
    assert "no request answered in the capacity run (error: ConnectionRefusedError" in err


def test_a_process_that_ends_during_the_soak_is_an_error_not_flat(monkeypatch, capsys):
    # (a child that ended and is not yet reaped reads as 0 KiB and no
    # descriptors: RSS -100%, "flat")
    import contextlib
    import subprocess
    import sys

    from zc_lb.testing import wait_for

    def state(pid):
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0]

    zombie = subprocess.Popen([sys.executable, "-c", ""])
    reaped = subprocess.Popen([sys.executable, "-c", ""])
    reaped.wait()
    try:
        wait_for(lambda: state(zombie.pid) == "Z")
        monkeypatch.setattr(soak.Client, "run", lambda self, *args: 100.0)
        for pid in (zombie.pid, reaped.pid):
            @contextlib.contextmanager
            def deployment():
                yield ("127.0.0.1", 1), {"lb": pid}

            monkeypatch.setattr(soak, "deployment", deployment)
            assert soak.main(["--duration", "0.2", "--every", "0.1"]) == 1
            assert "zc-lb soak: error: lb (pid %d) ended" % pid in capsys.readouterr().err
    finally:
        zombie.wait()
