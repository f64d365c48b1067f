"""The modules of ``zc_lb.COMPILED`` (the routing pool, the HTTP head's
parsing and checks) run compiled (mypyc) or from their source, all or
none, and say which; both route alike, to the bit (the simulator's golden
results below are checked in both builds by ``make test``)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import zc_lb

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).parent / "data" / "simulations_golden.json"

# Short runs of the scenarios whose results hang on every part of the pool:
# starters, adopted floors, relearning, several LBs, widening.
RUNS = {
    "steady": ["steady", "--requests", "20000"],
    "hot_class": ["hot_class", "--seed", "2", "--requests", "30000"],
    "add_worker": ["add_worker", "--requests", "30000"],
    "changed_classifier_reset": ["changed_classifier_reset", "--requests", "120000"],
    "many_lbs": ["many_lbs", "--requests", "10000", "--lbs", "2"],
    "one_hot_key": ["one_hot_key", "--requests", "20000"],
}


def simulate(args):
    """The affinity pool's results of a simulator run (its runs, not the
    parameters, which grow), as JSON without its wall time."""
    out = subprocess.run(
        [sys.executable, "-m", "zc_lb.simulations", *args, "--json", "--no-plots",
         "--policies", "affinity"],
        capture_output=True, text=True, timeout=120, check=True).stdout
    return without_wall_time(json.loads(out)["runs"])


def without_wall_time(results):
    if isinstance(results, dict):
        return {key: without_wall_time(value) for key, value in results.items()
                if key != "wall_seconds"}
    if isinstance(results, list):
        return [without_wall_time(value) for value in results]
    return results


def test_make_compiles_the_modules_the_package_names():
    # (make reads them from zc_lb.COMPILED, the one list of them)
    shown = subprocess.run(
        ["make", "-s", "--no-print-directory", "--eval",
         "show-compiled: ; @echo $(COMPILED_SOURCES)", "show-compiled"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=True).stdout.split()
    assert shown == ["src/zc_lb/%s.py" % name.replace(".", "/") for name in zc_lb.COMPILED]


def test_the_modules_are_all_compiled_or_all_source_and_say_which():
    build = zc_lb.build()
    modules = [__import__("zc_lb." + name, fromlist=["_"]) for name in zc_lb.COMPILED]
    compiled = [not module.__file__.endswith(".py") for module in modules]
    assert all(compiled) if build == "compiled" else not any(compiled), (build, compiled)
    expected = os.environ.get("ZC_LB_EXPECT_BUILD")
    if expected:  # make test runs the suite on each build
        assert build.split()[0] == expected, build


def test_the_build_said_is_the_one_imported_whatever_is_on_disk_since(monkeypatch):
    # What runs was decided at import: a library built or removed beside
    # the package since changes nothing, and the status document and the
    # metrics, which ask on every read, do not look at the disk.
    said = zc_lb.build()
    monkeypatch.setattr(zc_lb, "_built", lambda name: None)  # (the library gone)
    monkeypatch.setattr(zc_lb, "_checkout", lambda: False)
    assert zc_lb.build() == said
    assert zc_lb._which_build().startswith("source (installed without compiling")


def test_pure_runs_the_source_where_the_pool_is_built():
    code = ("import zc_lb, zc_lb.routing.affinity as a; "
            "print(zc_lb.build(), a.__file__.endswith('.py'))")
    env = dict(os.environ, ZC_LB_PURE="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=60, check=True).stdout.split()
    built = zc_lb._built("_compiled__mypyc") is not None
    if built:
        assert out == ["source", "(ZC_LB_PURE=1)", "True"]
    else:  # (and why: a checkout, not compiled)
        assert out[0] == "source" and "make compile" in " ".join(out) and out[-1] == "True"


def test_a_checkout_whose_source_is_newer_than_its_build_runs_the_source(tmp_path):
    # A copy of the package, as a checkout: a source edited after the build
    # must not run stale compiled code.
    package = tmp_path / "src" / "zc_lb"
    package.mkdir(parents=True)
    (tmp_path / "setup.py").write_text("")
    (package / "__init__.py").write_text((ROOT / "src/zc_lb/__init__.py").read_text())
    suffix = zc_lb.importlib.machinery.EXTENSION_SUFFIXES[0]
    for name in zc_lb.COMPILED:  # a stale build would not even load
        *subpackage, module = name.split(".")
        where = package.joinpath(*subpackage)
        where.mkdir(exist_ok=True)
        (where / "__init__.py").touch()
        (where / (module + ".py")).write_text("BUILT = False\n")
        (where / (module + suffix)).write_bytes(b"not a library")
    library = package / ("_compiled__mypyc" + suffix)
    library.write_bytes(b"not a library")
    code = "import zc_lb, zc_lb.routing.pool; print(zc_lb.build(), zc_lb.routing.pool.BUILT)"
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "src"))
    env.pop("ZC_LB_PURE", None)
    built = time.time() - 10
    os.utime(library, (built, built))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=60, check=True)
    assert run.stdout.split()[0] == "source" and run.stdout.split()[-1] == "False"
    assert "older than" in run.stderr


@pytest.mark.parametrize("name", sorted(RUNS))
def test_the_pool_routes_as_its_golden_results_say(name):
    # Any change of routing shows here, to the bit: one that is meant is
    # taken by writing the results again (python tests/test_compiled.py).
    golden = json.loads(GOLDEN.read_text())
    assert simulate(RUNS[name]) == golden[name]


if __name__ == "__main__":
    GOLDEN.write_text(json.dumps({name: simulate(args) for name, args in sorted(RUNS.items())},
                                 indent=1, sort_keys=True) + "\n")
    print("wrote", GOLDEN)
