"""The tools shipped beside zc_lb, run as ``zc-lb replay``, ``compare``
and ``simulate``: each its own main, given the arguments after its name
(it parses and documents them itself), installed by an extra.
"""

from __future__ import annotations

import argparse

from zc_lb.errors import ConfigurationError

# command: (module, extra that installs it, what it does)
PASS_THROUGH = {
    "replay": ("zc_lb.playback.replay", "playback",
               "replay access logs against a live URL (playback/replay.py)"),
    "compare": ("zc_lb.playback.compare", "playback",
                "compare zc-lb with HAProxy on the same log (playback/compare.py)"),
    "simulate": ("zc_lb.simulations.cli", "simulations",
                 "simulate routing policies on virtual time (simulations)"),
}


def run_pass_through(args: argparse.Namespace) -> int:
    """Run a shipped tool's own main with the arguments after its name."""
    import importlib

    module_name, extra, _ = PASS_THROUGH[args.command]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError("zc-lb %s needs %s (%s): pip install 'zc-lb[%s]'" % (
            args.command, module_name, exc, extra))
    return module.main(args.pass_through) or 0
