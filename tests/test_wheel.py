"""The wheel a user's ``pip install`` builds: compiled, with the tools,
the shipped data and the licence, and serving from outside the checkout.

Its own file, as it is the suite's longest test (gcc on the compiled
modules): tests/conftest.py hands it out first, so that the rest of the
suite runs beside it."""

import json
import os
import site
import subprocess
import sys
import time
import urllib.request
import zipfile

import pytest

from test_packaging import copy_source, package_version


# (its build compiles the hot path with gcc -O3: some 160-200 s on two
# cores, more when the machine is busy, past the suite's 180 s a test)
@pytest.mark.timeout(420)
def test_wheel_installed_outside_the_checkout_has_the_tools_and_the_licence(tmp_path):
    source = copy_source(tmp_path)
    # Built as a user's "pip install" builds it: by the pip of a fresh venv
    # that has none of zc-lb's dependencies, so that the build has only
    # what pyproject.toml requires (mypyc type-checks the compiled modules'
    # imports, which the checkout's venv would lend it).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # no checkout
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    wheels = tmp_path / "wheels"
    build = subprocess.run(
        [python, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(source)],
        capture_output=True, text=True, timeout=300, env=env)
    assert build.returncode == 0, build.stderr
    assert "WARNING" not in build.stderr, build.stderr
    (wheel,) = wheels.glob("zc_lb-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        meta = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA")))
    dist_info = next(n for n in names if n.endswith(".dist-info/METADATA")).split("/")[0]
    assert "%s/licenses/LICENSE.txt" % dist_info in names
    assert b"License-File: LICENSE.txt" in meta
    assert b"Provides-Extra: playback" in meta and b"Provides-Extra: simulations" in meta
    for name in ["playback/logs/nasa_aug95_first20k.log", "playback/haproxy/haproxy-hash.cfg",
                 "simulations/scenarios/steady.json", "playback/replay.py",
                 "simulations/cli.py"]:
        assert "zc_lb/" + name in names  # under the project's name
    assert "zc_lb/cli/__main__.py" in names
    # The tools are not top-level packages, whose generic names could collide.
    assert {name.split("/")[0] for name in names} == {"zc_lb", dist_info}

    # The venv gets the wheel alone; its dependencies (gevent, kazoo,
    # webob, matplotlib) come from this interpreter's site-packages through
    # a .pth, so the test needs no zc-lb but the wheel's.
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    str(wheel)], check=True, timeout=120, env=env)
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()"
                              "['purelib'])"], capture_output=True, text=True).stdout.strip()
    with open(os.path.join(purelib, "zz_dependencies.pth"), "w") as f:
        f.write("\n".join(site.getsitepackages()) + "\n")

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    script = str(venv / "bin" / "zc-lb")

    def run(*args):
        result = subprocess.run([script] + list(args), cwd=outside, env=env,
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, (args, result.stderr)
        return result.stdout

    # pip compiled it (mypy is a build requirement; this machine has cc and
    # Python's headers, as make sysdeps sees to): what a user gets.
    assert wheel.name.endswith("-linux_%s.whl" % os.uname().machine), wheel.name
    assert run("--version") == "zc-lb %s (compiled)\n" % package_version()
    # ...and serves.
    processes = []
    try:
        for argv, prefix in ((["worker", "zc_lb.demo:app", "--listen", "127.0.0.1:0"],
                              "zc-lb worker listening on "),
                             (None, "zc-lb lb listening on ")):
            if argv is None:
                argv = ["lb", "--listen", "127.0.0.1:0", "--worker", worker_address]
            process = subprocess.Popen([script] + argv, cwd=outside, env=env, text=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            processes.append(process)
            line = process.stdout.readline()
            assert line.startswith(prefix), line
            worker_address = line.split()[-1]
        lb_address = worker_address  # (the last line read: the LB's)
        deadline = time.monotonic() + 20
        status = None
        while status != 200 and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen("http://%s/" % lb_address, timeout=5) as response:
                    status = response.status
            except OSError:
                time.sleep(0.1)
        assert status == 200
    finally:
        for process in processes:
            process.terminate()
            process.wait(30)
    assert "nasa" in run("simulate", "--list").split()
    assert run("replay", "--help").startswith("usage: ")
    assert run("compare", "--help").startswith("usage: ")
    # the shipped NASA log is found as package data
    doc = json.loads(run("--log-level", "WARNING", "simulate", "nasa", "--scale", "0.005",
                         "--no-plots", "--json", "--policies", "affinity"))
    assert doc["runs"][0]["summary"]["requests"] > 0
    where = subprocess.run([python, "-c", "import zc_lb.playback, zc_lb.simulations as s; "
                            "print(zc_lb.__file__, zc_lb.playback.__file__, s.__file__)"],
                           cwd=outside, env=env, capture_output=True, text=True).stdout
    assert len(where.split()) == 3 and all(path.startswith(purelib) for path in where.split())
    assert subprocess.run([python, "-c", "import playback"], cwd=outside, env=env,
                          capture_output=True).returncode == 1  # no top-level name taken
