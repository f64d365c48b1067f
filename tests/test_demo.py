"""`zc-lb demo` (what `make run` starts): an LB and 4 demo workers."""

import http.client
import re
import signal
import subprocess
import sys
import threading

from zc_lb.testing import free_port


def test_demo_routes_each_site_to_a_worker_that_has_it_cached():
    port, status_port = free_port(), free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "zc_lb.cli", "demo", "--listen", "127.0.0.1:%d" % port,
         "--status", "127.0.0.1:%d" % status_port],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        lines = []
        reader = threading.Thread(target=lambda: lines.extend(
            iter(process.stdout.readline, "")), daemon=True)
        reader.start()
        reader.join(0)
        deadline = threading.Event()
        for _ in range(300):
            if any(line.startswith("Stop with Ctrl-C") for line in lines):
                break
            deadline.wait(0.05)
        text = "".join(lines)
        assert "curl -H 'Host: alpha.example' http://127.0.0.1:%d/" % port in text
        assert "in front of 4 workers" in text
        answers = []
        for _ in range(3):
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            connection.request("GET", "/", headers={"Host": "www.alpha.example"})
            answers.append(connection.getresponse().read().decode())
            connection.close()
        assert "cache miss" in answers[0]
        assert all("cache hit" in answer for answer in answers[1:])
        workers = {re.match(r"(\S+) served", answer).group(1) for answer in answers}
        assert len(workers) == 1
    finally:
        process.send_signal(signal.SIGINT)
        assert process.wait(20) == 0


def test_demo_names_the_zc_lb_it_runs_for_the_status_command(tmp_path):
    # It said "(or: .venv/bin/zc-lb status ...)", true of make run alone.
    script = tmp_path / "bin" / "zc-lb"  # installed, but not on PATH
    script.parent.mkdir()
    script.write_text("#!%s\nimport sys\nfrom zc_lb.cli import main\nsys.exit(main())\n"
                      % sys.executable)
    script.chmod(0o755)
    status_port = free_port()
    process = subprocess.Popen(
        [str(script), "demo", "--workers", "1", "--listen", "127.0.0.1:%d" % free_port(),
         "--status", "127.0.0.1:%d" % status_port],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        lines = []
        for line in iter(process.stdout.readline, ""):
            lines.append(line)
            if line.startswith("Stop with Ctrl-C"):
                break
        (status,) = [line for line in lines if line.startswith("Status:")]
        assert status == "Status:  %s status 127.0.0.1:%d\n" % (script, status_port)
    finally:
        process.send_signal(signal.SIGINT)
        assert process.wait(20) == 0


def test_demo_on_a_port_in_use_says_which_option():
    # It said "[Errno 98] Address already in use: ('127.0.0.1', PORT)".
    import socket
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        result = subprocess.run(
            [sys.executable, "-m", "zc_lb.cli", "--log-level", "ERROR", "demo", "--workers", "1",
             "--listen", "127.0.0.1:%d" % port, "--status", "127.0.0.1:0"],
            capture_output=True, text=True, timeout=60)
    finally:
        taken.close()
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1] == (
        "zc-lb demo: error: --listen 127.0.0.1:%d: Address already in use" % port)


def test_a_demo_worker_that_does_not_end_is_killed_in_one_line(monkeypatch, caplog):
    # One that outlived the wait after SIGTERM ended the demo in a
    # TimeoutExpired traceback, and left it (and the others) running.
    import socket

    from zc_lb import cli
    from zc_lb.cli import demo
    stubborn = []

    def start_worker_process(argv):
        process = subprocess.Popen([sys.executable, "-c", (
            "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('ready', flush=True); time.sleep(60)")], stdout=subprocess.PIPE, text=True)
        process.stdout.readline()  # (its SIGTERM ignored from now on)
        stubborn.append(process)
        return process, "127.0.0.1:1"
    monkeypatch.setattr(demo, "start_worker_process", start_worker_process)
    monkeypatch.setattr(demo, "WORKER_STOP_TIMEOUT", 0.2, raising=False)
    taken = socket.socket()  # (the demo stops at its --listen, before it serves)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        status = cli.main(["demo", "--workers", "2", "--listen",
                           "127.0.0.1:%d" % taken.getsockname()[1], "--status", "127.0.0.1:0"])
    finally:
        taken.close()
        for process in stubborn:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert status == 1  # (the address in use's, as ever)
    assert [process.returncode for process in stubborn] == [-signal.SIGKILL] * 2
    killed = [r.getMessage() for r in caplog.records if "killed" in r.getMessage()]
    assert killed == ["demo worker (pid %d) did not end within 0.2s of SIGTERM: killed"
                      % process.pid for process in stubborn]
