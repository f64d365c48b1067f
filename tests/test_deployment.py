"""The deployment files in etc/: systemd units, their environment files
and the logrotate snippet say what zc-lb accepts and what systemd does."""

import http.client
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from zc_lb.cli.parsers import build_parser
from zc_lb.testing import LBProcess, WorkerProcess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ETC = os.path.join(ROOT, "etc")
UNITS = {"zc-lb.service": "lb", "zc-lb-worker@.service": "worker"}
SECTIONS = {"Unit", "Service", "Install"}
TESTS = os.path.join(ROOT, "tests")
ENV = {"PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")}


def unit_lines(name):
    """(section, key, value) of every setting; continuation lines joined."""
    with open(os.path.join(ETC, "systemd", name)) as f:
        text = f.read().replace("\\\n", " ")
    section, settings = None, []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        header = re.fullmatch(r"\[(\w+)\]", line)
        if header:
            assert header.group(1) in SECTIONS, (name, number, line)
            section = header.group(1)
            continue
        match = re.fullmatch(r"([A-Za-z]+)=(.*)", line)
        assert match and section, "%s:%d: not a setting: %r" % (name, number, line)
        settings.append((section, match.group(1), match.group(2)))
    return settings


def setting(name, key):
    return [value for _, k, value in unit_lines(name) if k == key]


def environment_file(name):
    """KEY=value lines of a sample environment file, as systemd reads them."""
    values = {}
    with open(os.path.join(ETC, "default", name)) as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("#"):
                key, _, value = line.partition("=")
                values[key] = value[1:-1] if value[:1] == value[-1:] == '"' else value
    return values


def commented_alternatives(name, key):
    """The values of ``#KEY="..."`` lines: alternatives a person uncomments."""
    with open(os.path.join(ETC, "default", name)) as f:
        return [line.split("=", 1)[1].strip().strip('"') for line in f
                if line.startswith("#%s=" % key)]


@pytest.mark.parametrize("name", sorted(UNITS))
def test_units_are_sections_comments_and_settings(name):
    settings = unit_lines(name)
    assert {section for section, _, _ in settings} == SECTIONS
    service = {key: value for section, key, value in settings if section == "Service"}
    assert service["ExecStart"].startswith("/opt/zc-lb/bin/zc-lb ")
    if UNITS[name] == "lb":  # a reload is a hitless restart (test_restart.py)
        assert service["ExecReload"] == "/bin/kill -USR2 $MAINPID"
        assert (service["Type"], service["NotifyAccess"]) == ("notify", "all")
    else:
        assert "ExecReload" not in service
    assert service["KillSignal"] == "SIGTERM"
    # above the default --drain-timeout, so a drain is never cut short
    assert int(service["TimeoutStopSec"]) > build_parser().parse_args(
        [UNITS[name], "zc_lb.demo:app"] if UNITS[name] == "worker" else ["lb"]).drain_timeout
    assert service["Restart"] == "on-failure"
    assert int(service["LimitNOFILE"]) >= 65536
    for key, value in [("NoNewPrivileges", "yes"), ("ProtectSystem", "strict"),
                       ("ProtectHome", "yes"), ("PrivateTmp", "yes"),
                       ("PrivateDevices", "yes"), ("ProtectKernelTunables", "yes"),
                       ("ProtectKernelModules", "yes"), ("ProtectControlGroups", "yes"),
                       ("RestrictAddressFamilies", "AF_INET AF_INET6 AF_UNIX"),
                       ("RestrictNamespaces", "yes"), ("LockPersonality", "yes"),
                       ("MemoryDenyWriteExecute", "yes"), ("User", "zc-lb")]:
        assert service[key] == value, key
    assert "@system-service" in setting(name, "SystemCallFilter")


def test_only_the_lb_may_bind_low_ports():
    assert setting("zc-lb.service", "CapabilityBoundingSet") == ["CAP_NET_BIND_SERVICE"]
    assert setting("zc-lb.service", "AmbientCapabilities") == ["CAP_NET_BIND_SERVICE"]
    assert setting("zc-lb-worker@.service", "CapabilityBoundingSet") == [""]
    assert setting("zc-lb-worker@.service", "AmbientCapabilities") == []


@pytest.mark.parametrize("name", sorted(UNITS))
def test_units_pass_systemd_analyze_verify(name, tmp_path):
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze is not installed (make sysdeps installs systemd)"
    # verify checks that ExecStart exists: point it at this zc-lb
    zc_lb = shutil.which("zc-lb", path=os.path.dirname(sys.executable)) or shutil.which("zc-lb")
    assert zc_lb, "no zc-lb script next to %s" % sys.executable
    with open(os.path.join(ETC, "systemd", name)) as f:
        text = f.read().replace("/opt/zc-lb/bin/zc-lb", zc_lb)
    path = tmp_path / name.replace("@.", "@9001.")  # an instance of the template
    path.write_text(text)
    result = subprocess.run([analyze, "verify", str(path)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stderr == "", result.stderr  # unknown keys are only warnings


def test_sample_lb_options_are_valid_lb_options():
    values = environment_file("zc-lb")
    options = [values["ZC_LB_OPTIONS"]] + commented_alternatives("zc-lb", "ZC_LB_OPTIONS")
    assert len(options) == 2  # static, and ZooKeeper mode
    for text in options:
        args = build_parser().parse_args(["lb"] + shlex.split(text))
        assert args.access_log == "/var/log/zc-lb/access.log"  # what logrotate rotates
        assert bool(args.worker) != bool(args.zookeeper)


def test_sample_worker_options_are_valid_worker_options():
    values = environment_file("zc-lb-worker")
    assert set(values) >= {"ZC_LB_APP", "ZC_LB_WORKER_HOST", "ZC_LB_WORKER_OPTIONS"}
    options = [values["ZC_LB_WORKER_OPTIONS"]] + commented_alternatives(
        "zc-lb-worker", "ZC_LB_WORKER_OPTIONS") + commented_alternatives(
        "zc-lb-worker-9001", "ZC_LB_WORKER_OPTIONS")
    assert len(options) == 3
    for text in options:
        build_parser().parse_args(["worker", values["ZC_LB_APP"]] + shlex.split(text))
    # the unit reads exactly these variables, and the per-instance file
    exec_start = setting("zc-lb-worker@.service", "ExecStart")[0]
    for name in ("ZC_LB_LOG_LEVEL", "ZC_LB_APP", "ZC_LB_WORKER_HOST", "ZC_LB_WORKER_OPTIONS"):
        assert name in exec_start
    assert setting("zc-lb-worker@.service", "EnvironmentFile") == [
        "/etc/default/zc-lb-worker", "-/etc/default/zc-lb-worker-%i"]
    assert "--listen ${ZC_LB_WORKER_HOST}:%i" in exec_start


def test_logrotate_moves_the_log_and_signals_the_lb_to_reopen_it(tmp_path):
    with open(os.path.join(ETC, "logrotate.d", "zc-lb")) as f:
        text = f.read()
    assert text.count("{") == text.count("}") == 1
    assert "/var/log/zc-lb/*.log {" in text
    # zc-lb reopens its log on SIGUSR1 (tests/test_accesslog.py): no
    # copytruncate, whose lines between copy and truncation were lost.
    assert not re.search(r"^\s+copytruncate$", text, re.M)
    assert re.search(r"^\s+postrotate\n\s+systemctl kill -s USR1 zc-lb\.service\b.*\n"
                     r"\s+endscript$", text, re.M)
    assert re.search(r"^\s+sharedscripts$", text, re.M)  # one signal for all the files
    logrotate = shutil.which("logrotate", path="/usr/sbin:/sbin:/usr/bin")
    assert logrotate, "logrotate is not installed (make sysdeps installs it)"
    # This machine has no zc-lb user: check the snippet as the user running the test.
    import grp
    import pwd
    me = "%s %s" % (pwd.getpwuid(os.getuid()).pw_name, grp.getgrgid(os.getgid()).gr_name)
    snippet = tmp_path / "zc-lb"
    snippet.write_text(text.replace("zc-lb zc-lb", me))  # su and create
    result = subprocess.run([logrotate, "-d", "-s", str(tmp_path / "state"), str(snippet)],
                            capture_output=True, text=True, timeout=30)
    assert "error" not in result.stderr.lower(), result.stderr


def test_lb_and_workers_serve_under_memory_deny_write_execute():
    # The kernel's PR_SET_MDWE is the rule MemoryDenyWriteExecute=yes sets:
    # no memory both writable and executable.  Children inherit it.
    code = """if 1:
        import ctypes, mmap, sys
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(65, 1, 0, 0, 0) != 0:  # PR_SET_MDWE, REFUSE_EXEC_GAIN
            sys.exit(77)
        try:
            mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
        except OSError:
            pass
        else:
            sys.exit('PR_SET_MDWE did not refuse a writable executable mapping')
        sys.path[:0] = sys.argv[1].split(':')
        import test_deployment
        test_deployment.serve_a_few_requests()
        print('served')
    """
    result = subprocess.run([sys.executable, "-c", code, TESTS + os.pathsep + ENV["PYTHONPATH"]],
                            capture_output=True, text=True, timeout=120)
    if result.returncode == 77:
        pytest.skip("this kernel has no PR_SET_MDWE (Linux < 6.3)")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("served")


def serve_a_few_requests():
    """An LB in front of a threaded and a greenlet worker; 20 requests."""
    with WorkerProcess("echo_app:app", env=ENV) as threaded, \
            WorkerProcess("echo_app:app", "--greenlets", env=ENV) as greenlets:
        with LBProcess([threaded.address, greenlets.address], env=ENV) as lb:
            host, port = lb.address.rsplit(":", 1)
            for i in range(20):
                connection = http.client.HTTPConnection(host, int(port), timeout=10)
                connection.request("POST", "/page%d" % i, body=b"x" * 100,
                                   headers={"Host": "site%d.example" % (i % 3)})
                response = connection.getresponse()
                assert response.status == 200, response.status
                response.read()
                connection.close()

