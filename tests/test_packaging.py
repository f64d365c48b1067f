"""What an installed zc-lb offers: its version, the shipped tools
(``zc-lb replay``, ``compare``, ``simulate``), a ``status`` command that
says when it was pointed at the wrong port, the pure wheel a machine without
a C compiler builds, and the sdist (the compiled wheel: test_wheel.py)."""

import ast
import glob
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import threading
import tomllib
from importlib import metadata

import pytest
from packaging.requirements import Requirement

from zc_lb.cli import parsers
from zc_lb.testing import LBProcess, WorkerProcess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
ENV = {"PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")}


def zc_lb(*args, cwd=ROOT, env=None, python=(sys.executable,), timeout=60):
    """Run ``zc-lb ARGS...``; the completed process, output as text."""
    return subprocess.run(list(python) + ["-m", "zc_lb.cli"] + list(args), cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=timeout)


def package_version():
    """``zc_lb.__version__``, the one place the version is written
    (setup.py reads it there), read without importing the package."""
    with open(os.path.join(ROOT, "src", "zc_lb", "__init__.py")) as f:
        return re.search(r"""^__version__ = ["']([^"']+)["']""", f.read(), re.M).group(1)


# -- --version ------------------------------------------------------------


def test_version_is_the_installed_distributions():
    result = zc_lb("--version")
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(r"zc-lb %s \((compiled|source.*)\)\n" % re.escape(
        metadata.version("zc-lb")), result.stdout), result.stdout
    assert metadata.version("zc-lb") == package_version()


def test_version_of_a_checkout_never_installed_is_the_packages(tmp_path):
    # -S: no site-packages, so no distribution metadata at all (nor gevent:
    # --version must not need it).
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    result = zc_lb("--version", cwd=tmp_path, env=env, python=(sys.executable, "-S"))
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(r"zc-lb %s \((compiled|source.*)\)\n" % re.escape(
        package_version()), result.stdout), result.stdout


# -- the shipped tools ------------------------------------------------------


def test_simulate_lists_and_runs_the_shipped_scenarios():
    listed = zc_lb("simulate", "--list")
    assert listed.returncode == 0, listed.stderr
    names = listed.stdout.split()
    assert {"steady", "nasa", "add_worker"} <= set(names)
    assert len(names) == len(os.listdir(os.path.join(ROOT, "simulations", "scenarios")))
    # options before and after the scenario all reach simulations' parser
    run = zc_lb("--log-level", "WARNING", "simulate", "--scale", "0.005", "steady",
                "--no-plots", "--json", "--policies", "affinity")
    assert run.returncode == 0, run.stderr
    doc = json.loads(run.stdout)
    assert [r["policy"] for r in doc["runs"]] == ["affinity"]


@pytest.mark.parametrize("command, usage, required", [
    ("replay", "--target", ["x.log", "--target", "http://127.0.0.1:1/"]),
    ("compare", "LOG", ["x.log"])])
def test_replay_and_compare_take_every_argument_after_their_name(command, usage, required):
    result = zc_lb(command, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: ") and usage in result.stdout
    wrong = zc_lb(command, *required, "--no-such-option")
    assert wrong.returncode == 2
    assert "--no-such-option" in wrong.stderr


@pytest.mark.parametrize("command", ["replay", "compare", "simulate"])
def test_the_tools_name_themselves_as_zc_lb_commands(command):
    # They printed "usage: replay.py", "compare.py", "python -m simulations.cli".
    assert zc_lb(command, "--help").stdout.startswith("usage: zc-lb %s " % command)


def test_simulate_writes_its_plots_under_the_working_directory(tmp_path):
    # Without --out it wrote into the installed package (site-packages).
    run = zc_lb("simulate", "--scale", "0.005", "steady", "--policies", "affinity",
                cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert os.listdir(tmp_path / "simulations" / "out")


def test_log_level_may_follow_the_command_and_demo_explains_its_options():
    # "--log-level" after the subcommand was refused; demo --help said nothing.
    assert "--log-level" in zc_lb("status", "--help").stdout
    args = parsers.build_parser().parse_args(["lb", "--log-level", "DEBUG"])
    assert args.log_level == "DEBUG"
    assert parsers.build_parser().parse_args(["--log-level", "ERROR", "lb"]).log_level == "ERROR"
    demo = zc_lb("demo", "--help").stdout
    assert "demo worker processes to start" in demo and "status address" in demo


def test_other_commands_still_refuse_unknown_arguments():
    result = zc_lb("status", "127.0.0.1:1", "--bogus")
    assert result.returncode == 2
    assert "unrecognized arguments: --bogus" in result.stderr


def test_the_tools_are_listed_in_help():
    result = zc_lb("--help")
    for command in ("replay", "compare", "simulate"):
        assert re.search(r"^\s+%s\s" % command, result.stdout, re.M), result.stdout


# -- status pointed at the wrong port ----------------------------------------


@pytest.fixture
def web_server(tmp_path):
    """A plain HTTP server (not zc-lb): a directory listing at /, 404 elsewhere."""
    (tmp_path / "index.txt").write_text("not a status document\n")

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kw):
            super().__init__(*args, directory=str(tmp_path), **kw)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield "127.0.0.1:%d" % server.server_address[1]
    server.shutdown()
    server.server_close()


def test_status_refuses_a_web_server_that_is_not_zc_lb(web_server):
    for address, got in [(web_server, "200 text/html"),
                         ("http://%s/nowhere" % web_server, "404 text/html"),
                         ("http://%s/index.txt" % web_server, "200 text/plain")]:
        result = zc_lb("status", address)
        assert result.returncode == 2, result
        assert result.stdout == ""
        assert ("zc-lb status: error: %s is not a zc-lb status server (got %s)"
                % (address, got)) in result.stderr
        assert "Traceback" not in result.stderr


def test_status_refuses_an_lb_front_port_and_reads_its_status_port():
    with WorkerProcess("echo_app:app", env=ENV) as worker:
        with LBProcess([worker.address], "--status", "127.0.0.1:0", env=ENV) as lb:
            # The front port answers through a worker: JSON, but no status.
            result = zc_lb("status", lb.address)
            assert result.returncode == 2, result
            assert ("%s is not a zc-lb status server (got 200 application/json, a JSON "
                    "document without workers and pool)" % lb.address) in result.stderr
            status_address = _status_address(lb)
            table = zc_lb("status", status_address)
            assert table.returncode == 0, table.stderr
            assert table.stdout.startswith("pool: ")
            assert worker.address in table.stdout
            raw = zc_lb("status", "--json", status_address)
            assert worker.address in json.loads(raw.stdout)["workers"]


def _status_address(lb):
    for _ in range(200):
        for line in lb.lines:
            if line.startswith("zc-lb status on "):
                return line.split()[-1]
        threading.Event().wait(0.05)
    raise AssertionError("no status line in %r" % lb.lines)


def test_status_of_an_address_nobody_listens_on_exits_1():
    result = zc_lb("status", "127.0.0.1:1")
    assert result.returncode == 1
    assert "cannot reach a status server at 127.0.0.1:1" in result.stderr


# -- the wheel -------------------------------------------------------------


SOURCES = ["setup.py", "pyproject.toml", "README.rst", "LICENSE.txt", "src", "playback",
           "simulations"]


def copy_source(tmp_path):
    """A copy of what a wheel is built from, so that a build leaves
    nothing in the checkout."""
    source = tmp_path / "source"
    source.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "out", "*.so", "build")
    for name in SOURCES:
        if os.path.isdir(os.path.join(ROOT, name)):
            shutil.copytree(os.path.join(ROOT, name), source / name, ignore=ignore)
        else:
            shutil.copy(os.path.join(ROOT, name), source / name)
    return source


def test_without_a_compiler_the_wheel_is_pure_and_says_so(tmp_path):
    source = copy_source(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ZC_LB_COMPILE")}
    env["CC"] = "no-such-compiler"
    wheels = tmp_path / "wheels"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "-w", str(wheels),
         str(source)], capture_output=True, text=True, timeout=300, env=env)
    assert build.returncode == 0, build.stderr
    assert "building the pure-Python zc-lb" in build.stdout + build.stderr
    assert "a C compiler (no-such-compiler)" in build.stdout + build.stderr
    (wheel,) = wheels.glob("zc_lb-*.whl")
    assert wheel.name.endswith("-py3-none-any.whl"), wheel.name
    target = tmp_path / "installed"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--target", str(target), str(wheel)], check=True, timeout=120, env=env)
    env["PYTHONPATH"] = str(target)
    version = subprocess.run([sys.executable, "-m", "zc_lb.cli", "--version"], env=env,
                             cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert version.stdout == ("zc-lb %s (source (installed without compiling: pip install -v "
                              "says why))\n" % package_version()), version.stderr


def build_here(source, env):
    """``setup.py build`` in ``source``, as a wheel's build runs it; the
    completed process, and the compiled modules it built."""
    build = subprocess.run([sys.executable, "setup.py", "build"], cwd=source, env=env,
                           capture_output=True, text=True, timeout=300)
    return build, sorted(os.path.relpath(path, source) for path in glob.glob(
        os.path.join(source, "build", "lib*", "zc_lb", "**", "*.so"), recursive=True))


def test_a_compiler_that_fails_on_zc_lb_gives_the_pure_build_and_says_so(tmp_path):
    # A C compiler is there, but fails (one that rejects mypyc's C, a
    # broken tool chain): the install failed.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ZC_LB_COMPILE")}
    env["CC"] = "false"
    source = copy_source(tmp_path)
    build, compiled = build_here(source, env)
    assert build.returncode == 0, build.stderr[-3000:]
    assert ("the C compiler failed on zc-lb (above); building the pure-Python zc-lb"
            in build.stderr), build.stderr[-3000:]
    assert compiled == []
    # make asks for the compiled build, and gets it or an error
    env["ZC_LB_COMPILE"] = "1"
    assert build_here(source, env)[0].returncode != 0


def test_the_compiler_looked_for_is_the_one_the_build_runs(tmp_path):
    # Without $CC the build runs the compiler Python was built with (gcc,
    # x86_64-linux-gnu-gcc), but "cc" was looked for: where only cc was
    # there (clang), the install failed.
    python_cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if python_cc == "cc":
        pytest.skip("this Python's compiler is cc")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    os.symlink(shutil.which("gcc") or shutil.which("cc"), bin_dir / "cc")
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "ZC_LB_COMPILE", "CC")}
    env["PATH"] = str(bin_dir)
    build, compiled = build_here(copy_source(tmp_path), env)
    assert build.returncode == 0, build.stderr[-3000:]
    assert "missing: a C compiler (%s)" % os.path.basename(python_cc) in build.stderr
    assert compiled == []


# -- the sdist --------------------------------------------------------------


# What the checkout holds beside the package: what .gitignore leaves out
# (build products, caches, the venv) is not.
CHECKOUT = [".ci", ".gitignore", "LICENSE.txt", "MANIFEST.in", "Makefile", "README.rst",
            "benchmarks", "docs", "etc", "playback", "pyproject.toml", "pytest.ini", "setup.py",
            "simulations", "src", "tests"]
UNSHIPPED = shutil.ignore_patterns("__pycache__", "*.py[cod]", "*.egg-info", "*.so", "out",
                                   "build", "dist", ".hypothesis", ".mypy_cache")


def test_the_sdist_holds_the_whole_checkout(tmp_path):
    # It held the package and the tests' modules, but not their helpers
    # (conftest.py, tests/data), docs/ (which the README points to), etc/
    # (the systemd units), the Makefile, the benchmarks nor the simulator's
    # golden results: "make test" could not run from it.
    source = tmp_path / "source"
    source.mkdir()
    for name in CHECKOUT:
        if os.path.isdir(os.path.join(ROOT, name)):
            shutil.copytree(os.path.join(ROOT, name), source / name, ignore=UNSHIPPED)
        elif os.path.exists(os.path.join(ROOT, name)):
            shutil.copy(os.path.join(ROOT, name), source / name)
    expected = {os.path.relpath(os.path.join(top, name), source)
                for top, _, names in os.walk(source) for name in names}
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ZC_LB_COMPILE")}
    build = subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path)],
                           cwd=source, env=env, capture_output=True, text=True, timeout=120)
    assert build.returncode == 0, build.stderr
    (sdist,) = tmp_path.glob("zc[_-]lb-*.tar.gz")  # (older setuptools: zc-lb)
    with tarfile.open(sdist) as archive:
        shipped = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert sorted(expected - shipped) == []
    assert "docs/index.rst" in shipped and "tests/conftest.py" in shipped
    assert not [name for name in shipped if "__pycache__" in name or name.endswith(".so")]


# -- the dependencies --------------------------------------------------------


def setup_argument(name):
    """The argument ``name`` of setup.py's ``setup()``, read without
    running it."""
    with open(os.path.join(ROOT, "setup.py")) as f:
        tree = ast.parse(f.read())
    (value,) = [keyword.value for node in ast.walk(tree) if isinstance(node, ast.Call)
                for keyword in node.keywords if keyword.arg == name]
    return ast.literal_eval(value)


def setup_requirements():
    """setup.py's ``install_requires``."""
    return [Requirement(text) for text in setup_argument("install_requires")]


# Releases that the floors once allowed and zc-lb cannot run on.
BROKEN = [("webob", "1.8.2", "from collections import MutableMapping: not on Python 3.10+"),
          ("webob", "1.8.8", "imports cgi, which Python 3.13 has not"),
          ("httptools", "0.6.2", "no set_dangerous_leniencies, which front/h1.py calls")]


@pytest.mark.parametrize("name, version, why", BROKEN, ids=["%s-%s" % b[:2] for b in BROKEN])
def test_the_dependency_floors_leave_out_releases_zc_lb_cannot_run_on(name, version, why):
    (requirement,) = [r for r in setup_requirements() if r.name.lower() == name]
    assert not requirement.specifier.contains(version), why


def test_the_build_requires_the_same_floors_as_an_install():
    # mypyc type-checks against the build's orjson and httptools
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        build = [Requirement(text) for text in tomllib.load(f)["build-system"]["requires"]]
    install = {r.name.lower(): r.specifier for r in setup_requirements()}
    shared = [r for r in build if r.name.lower() in install]
    assert {r.name.lower() for r in shared} == {"orjson", "httptools"}
    for requirement in shared:
        assert requirement.specifier == install[requirement.name.lower()], requirement


def test_the_readme_says_how_to_install_and_names_every_extra():
    # It said only "make run", in a checkout, with Debian's packages.
    with open(os.path.join(ROOT, "README.rst"), encoding="utf-8") as f:
        install = f.read().split("Install\n=======\n")[1].split("\n====")[0]
    assert "pip install" in install and "zc-lb --version" in install
    assert "(compiled)" in install and "(source ...)" in install
    for extra in setup_argument("extras_require"):
        assert "``%s``" % extra in install, extra


DOCUMENTS = ["README.rst", "playback/README.rst", "playback/logs/README.rst",
             "simulations/README.rst"] + sorted(
    os.path.relpath(path, ROOT)
    for path in glob.glob(os.path.join(ROOT, "docs", "**", "*.rst"), recursive=True))


@pytest.mark.parametrize("path", DOCUMENTS)
def test_the_documents_are_valid_restructuredtext(path):
    # A malformed table is not an error to a reader's eye, but PyPI and
    # docutils drop it (make bench's table overflowed its columns once).
    import docutils.core
    import docutils.utils

    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        text = f.read()
    try:
        docutils.core.publish_string(text, source_path=path, writer="null",
                                     settings_overrides={"report_level": 2, "halt_level": 2})
    except docutils.utils.SystemMessage as exc:
        pytest.fail("%s: %s" % (path, exc))
