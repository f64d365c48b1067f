"""``zc-lb`` and its subcommands: parse, build, run; nothing else.

``main`` parses the command line (``parsers``), reads ``--config``
(``reload``) and runs the command by its name (``COMMANDS``): ``lb`` and
``worker`` (modules of those names), the commands that act on running
LBs and on ZooKeeper (``admin``), ``demo``, and the tools shipped beside
zc_lb (``tools``).  A ``ZcLbError`` becomes one line on standard error
and its exit status.

Each ``run_*`` function builds the objects of one process from parsed
arguments, starts them, prints the address it listens on (one line on
standard output, so scripts and tests can find an ephemeral port), then
waits for a signal.  Signal handlers only queue the signal; the main loop
dispatches it, as gunicorn's arbiter does.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import List, Optional

from zc_lb.cli.admin import run_reset_skills, run_status, run_worker_state, run_zk
from zc_lb.cli.demo import run_demo
from zc_lb.cli.lb import run_lb
from zc_lb.cli.parsers import build_parser
from zc_lb.cli.reload import read_config_at_start
from zc_lb.cli.tools import PASS_THROUGH, run_pass_through
from zc_lb.cli.worker import run_worker
from zc_lb.errors import ConfigurationError, ZcLbError
from zc_lb.process.service import keep_freed_memory

# What runs each command, by name (cli/parsers.py says its options).
COMMANDS = {"worker": run_worker, "lb": run_lb, "status": run_status, "zk": run_zk,
            "drain": run_worker_state, "enable": run_worker_state,
            "reset-skills": run_reset_skills, "demo": run_demo,
            **dict.fromkeys(PASS_THROUGH, run_pass_through)}


def main(argv: Optional[List[str]] = None) -> int:
    """``zc-lb ARGV...`` (the process's arguments if None): its exit status."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args, rest = parser.parse_known_args(argv)
    if "pass_through" in args:
        args.pass_through = rest
    elif rest:
        parser.error("unrecognized arguments: %s" % " ".join(rest))
    args.argv = argv  # lb --processes starts copies; SIGHUP parses it again
    args.start_dir = os.getcwd()  # where copies start, so that --chdir means the same
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if getattr(args, "config", None):
            args = read_config_at_start(args)
            # (SIGHUP reads it again, after --chdir: by where it was)
            args.config = os.path.abspath(args.config)
            if not any(a == "--log-level" or a.startswith("--log-level=") for a in argv):
                logging.getLogger().setLevel(args.log_level)  # the file's, then
        if "chdir" in args:
            _enter_directory(args.chdir)
        keep_freed_memory()  # (large bodies: see there)
        if args.command in ("lb", "worker"):
            say_build()
        status = COMMANDS[args.command](args)
        sys.stdout.flush()  # (a reader gone is found here, not at the exit)
        return status
    except ZcLbError as exc:  # a configuration error exits 2, ZooKeeper down 69
        print("zc-lb %s: error: %s" % (args.command, exc), file=sys.stderr)
        return exc.exit_status
    except BrokenPipeError:
        if args.command in ("lb", "worker"):
            raise
        return _reader_gone()
    except OSError as exc:  # e.g. the address is in use
        print("zc-lb %s: error: %s" % (args.command, exc), file=sys.stderr)
        return 1


def _reader_gone() -> int:
    """The reader of a report went away (``zc-lb status ... | head``):
    nothing is wrong, and nothing more can be said on stdout."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 1


def say_build() -> None:
    """Warn, at start, an LB or a worker that runs the source though it
    was not asked to (ZC_LB_PURE=1): it costs some twice the CPU a
    request, and a ``pip install`` without a C compiler does it silently."""
    from zc_lb import build

    if build() != "compiled" and os.environ.get("ZC_LB_PURE") != "1":
        logging.getLogger("zc_lb").warning(
            "build: %s: the hot path runs uncompiled, at some twice the CPU a request "
            "(docs/reference/processes.rst)", build())


def _enter_directory(directory: Optional[str]) -> None:
    """Change to ``directory`` (--chdir), and put the working directory
    first on sys.path, so that ``zc-lb worker app:application`` run
    beside app.py imports it (the console script, unlike ``python -m``,
    does not).  A ``--processes`` child and a successor (SIGUSR2) start
    where this process started (``args.start_dir``), so that a relative
    --chdir, --config or other path means the same to them."""
    if directory:
        try:
            os.chdir(directory)
        except OSError as exc:
            raise ConfigurationError("--chdir %s: %s" % (directory, exc.strerror or exc))
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
