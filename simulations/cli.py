"""Command line: ``python -m simulations.cli SCENARIO [--param value ...]``.

SCENARIO is a JSON file of parameters, or the name of one shipped in
``simulations/scenarios/`` (``steady``, ``add_worker``, ...).  Every
parameter of :class:`simulations.config.Config` is also an option
(``--cache-size 5000``; lists comma-separated; ``--actions`` takes JSON)
and overrides the file.  Prints a table; ``--json`` prints JSON instead;
PNG plots go to ``--out`` unless ``--no-plots``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any, Dict, List, Optional

from zc_lb.errors import ConfigurationError
from zc_lb.settings import CONVERTERS

from . import config as config_module
from . import bound, report
from .engine import simulate

HERE = os.path.dirname(os.path.abspath(__file__))
SCENARIOS = os.path.join(HERE, "scenarios")
DEFAULT_OUT = os.path.join("simulations", "out")  # under the working directory


LISTS = {"cache_sizes": int, "speeds": float}  # lists of numbers: "300,900"


def option_type(field: dataclasses.Field):
    """How to parse a parameter given on the command line."""
    if field.name == "actions":
        return json.loads
    if field.name == "policies":
        return lambda text: [p for p in text.split(",") if p]
    if field.name in LISTS:
        of = LISTS[field.name]
        return lambda text: [of(item) for item in text.split(",") if item]
    if isinstance(field_default(field), bool):
        return yes_or_no
    return type(field_default(field))


def yes_or_no(text: str) -> bool:
    """A yes/no parameter, read as the LB reads its boolean settings."""
    try:
        return CONVERTERS[bool](text)
    except ValueError:
        raise argparse.ArgumentTypeError("expected yes or no, got %r" % text) from None


def field_default(field: dataclasses.Field) -> Any:
    """A field's default value."""
    if field.default is not dataclasses.MISSING:
        return field.default
    return field.default_factory()  # type: ignore[misc]


def parser() -> argparse.ArgumentParser:
    """The argument parser, one option per parameter."""
    p = argparse.ArgumentParser(
        prog="zc-lb simulate",
        description="Simulate zc-lb's résumé pool against other policies.")
    p.add_argument("scenario", nargs="?",
                   help="scenario file, or name in simulations/scenarios/")
    p.add_argument("--json", action="store_true", help="print JSON, not a table")
    p.add_argument("--out", default=DEFAULT_OUT,
                   help="directory for PNG plots (default: simulations/out under the "
                        "working directory)")
    p.add_argument("--no-plots", action="store_true", help="do not draw PNGs")
    p.add_argument("--list", action="store_true", help="list shipped scenarios")
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiply requests and action times (0.01: a quick look)")
    p.add_argument("--sweep", metavar="PARAM=V1,V2,...",
                   help="run once per value of a parameter (e.g. lbs=1,2,4,8), "
                        "one table each")
    add_parameters(p)
    return p


def add_parameters(p: argparse.ArgumentParser) -> None:
    """One option per parameter, overriding the scenario file; an option
    not given is left out of the parsed arguments."""
    params = p.add_argument_group("parameters (override the scenario file)")
    for field in config_module.fields():
        params.add_argument("--" + field.name.replace("_", "-"), dest=field.name,
                            type=option_type(field), default=argparse.SUPPRESS,
                            help="default: %r" % (field_default(field),))


def configured(scenario: Optional[str], overrides: Dict[str, Any], prog: str
               ) -> config_module.Config:
    """The configuration of ``scenario`` (a file, a shipped scenario's
    name, or None for the defaults) with ``overrides``; or exit, saying
    what is wrong with them, as ``prog``."""
    values: Dict[str, Any] = {}
    try:
        if scenario:
            values = config_module.load(scenario_path(scenario))
            values.setdefault("name", os.path.basename(scenario).rsplit(".", 1)[0])
        values.update(overrides)
        return config_module.build(values)
    except (OSError, ValueError) as error:
        raise SystemExit("%s: %s" % (prog, error))


def scenario_path(name: str) -> str:
    """A scenario file's path from a path or a shipped scenario's name."""
    if os.path.exists(name):
        return name
    path = os.path.join(SCENARIOS, name + ".json")
    if not os.path.exists(path):
        raise ValueError("no scenario file or shipped scenario %r (shipped: %s)"
                         % (name, ", ".join(shipped())))
    return path


def shipped() -> List[str]:
    """Names of the shipped scenarios."""
    return sorted(f[:-5] for f in os.listdir(SCENARIOS) if f.endswith(".json"))


def run_all(config: config_module.Config, log) -> List[Dict[str, Any]]:
    """Run every policy of ``config``; note each one's wall time."""
    runs = []
    for name in config.policies:
        started = time.perf_counter()
        run = simulate(config, name)
        run["summary"]["wall_seconds"] = time.perf_counter() - started
        log("%s: %.1f s\n" % (name, run["summary"]["wall_seconds"]))
        runs.append(run)
    report.add_ratios(runs)
    return runs


def main(argv: Optional[List[str]] = None) -> int:
    """Parse, run, report."""
    args = vars(parser().parse_args(argv))
    if args.pop("list"):
        print("\n".join(shipped()))
        return 0
    scenario = args.pop("scenario")
    as_json, out, no_plots = args.pop("json"), args.pop("out"), args.pop("no_plots")
    scale = args.pop("scale")
    sweep = sweep_values(args.pop("sweep"))
    config = configured(scenario, args, "simulate")
    if scale != 1.0:
        try:
            config = config_module.scaled(config, scale)
        except ValueError as error:
            raise SystemExit("simulate: %s" % error)
    configs = swept_configs(config, sweep)
    if not no_plots:
        try:  # (before any run, not after minutes of them)
            os.makedirs(out, exist_ok=True)
        except OSError as error:
            raise SystemExit("simulate: --out: %s (or give --no-plots)" % error)
    for swept in configs:
        try:
            runs = run_all(swept, sys.stderr.write)
        except (ConfigurationError, OSError) as error:  # a pool setting out of bounds, a log
            raise SystemExit("simulate: %s" % error)
        report_runs(swept, runs, as_json, None if no_plots else out)
    return 0


def swept_configs(config: config_module.Config, sweep: List[Any]
                  ) -> List[config_module.Config]:
    """One configuration per value of the sweep (``config`` alone without
    one), each checked before any runs."""
    if not sweep:
        return [config]
    try:
        return [config_module.build(dict(dataclasses.asdict(config), **{name: value},
                                         name="%s %s=%s" % (config.name, name, value)))
                for name, value in sweep]
    except ValueError as error:
        raise SystemExit("simulate: --sweep: %s" % error)


def sweep_values(text: Optional[str]) -> List[Any]:
    """``PARAM=V1,V2`` as [(param, v1), (param, v2)], values typed."""
    if not text:
        return []
    name, sep, values = text.partition("=")
    fields = {field.name: field for field in config_module.fields()}
    if not sep or name not in fields or name in ("actions", "policies"):
        raise SystemExit("--sweep takes PARAM=V1,V2,... of a plain parameter")
    kind = option_type(fields[name])
    try:
        return [(name, kind(value)) for value in values.split(",") if value]
    except (ValueError, argparse.ArgumentTypeError) as exc:
        raise SystemExit("--sweep %s: %s" % (name, exc))


def report_runs(config: config_module.Config, runs: List[Dict[str, Any]],
                as_json: bool, out: Optional[str]) -> None:
    """Print one configuration's runs, with the perfect partition's
    misses (bound.py); plot them into ``out`` if given."""
    partition = bound.partition_misses(config)
    if as_json:
        report.dump(config.name, dataclasses.asdict(config), runs, sys.stdout, partition)
    else:
        report.table(config.name, runs, sys.stdout, partition)
    if out is not None:
        try:
            from . import plots  # matplotlib is slow to import; only when needed
        except ImportError as exc:  # (the table is out: say why there is no plot)
            sys.stderr.write("no plot: %s (pip install 'zc-lb[simulations]' for matplotlib, "
                             "or give --no-plots)\n" % exc)
            return
        sys.stderr.write("plot: %s\n" % plots.plot(config.name.replace(" ", "_"), runs, out))


if __name__ == "__main__":
    sys.exit(main())
