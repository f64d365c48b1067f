"""``--config FILE``: the options of a TOML file, read at start and read
again on SIGHUP (zc_lb/config.py reads the file).

Rules: the command line overrides the file.  On SIGHUP the file is
read again and the command line parsed again with it; the settings that
may change live (``settings.LIVE``, and what a command adds) are handed
to the running process, which logs each change, and every other change
is logged as needing a restart, but for the log level, taken at once.
A bad file, or a value the process refuses, is logged and changes
nothing: a reload never stops a serving process.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import tempfile
from typing import Dict, Optional

from zc_lb import config, settings
from zc_lb.cli.parsers import build_parser
from zc_lb.errors import ConfigurationError
from zc_lb.process.service import ignore_sighup

log = logging.getLogger("zc_lb")

COMMAND_SETTINGS = {"lb": settings.LB_SETTINGS, "worker": settings.WORKER_SETTINGS}
NOT_COMPARED = frozenset({"argv", "start_dir", "config", "command", "log_level"})


def read_config(args: argparse.Namespace) -> argparse.Namespace:
    """``args.argv`` parsed again with ``args.config``'s values as the
    defaults (config.py): the command line overrides the file.  An LB's
    worker list is checked whole here, as at start: a file whose list has
    a bad address reads as bad (a supervisor does not keep it as the copy
    its children start with, which would refuse it)."""
    from zc_lb.sockets import worker_addresses

    parser = build_parser()
    command = parser.commands[args.command]  # type: ignore[attr-defined]
    try:
        new = config.apply(parser, args.argv, command, args.config, args.command,
                           COMMAND_SETTINGS[args.command])
    except SystemExit:  # argparse refused the command line (it said why)
        raise ConfigurationError("the command line is no longer valid with %s" % args.config)
    if args.command == "lb" and new.worker:
        worker_addresses(new.worker, "%s: worker" % args.config)
    new.argv, new.start_dir = args.argv, getattr(args, "start_dir", None)
    return new


# In a child of a supervisor (-w, --processes): the supervisor's copy of
# --config as it last read it well (KeptConfig).
LAST_GOOD_CONFIG = "ZC_LB_LAST_GOOD_CONFIG"


def read_config_at_start(args: argparse.Namespace) -> argparse.Namespace:
    """``read_config``; but a child of a supervisor that finds the file
    bad starts with the supervisor's last good copy of it, and says so: a
    file broken since the supervisor read it must not keep a child from
    starting again (after ``--max-requests``, or a crash), one process
    short for good.  The file itself stays the child's ``--config``, for
    its SIGHUPs.  A process started alone refuses a bad file."""
    kept = os.environ.pop(LAST_GOOD_CONFIG, None)  # (not the application's business)
    try:
        return read_config(args)
    except ConfigurationError as exc:
        if not kept or not os.path.exists(kept):
            raise
        log.error("%s; starting with the copy the supervisor last read well", exc)
        return read_config(argparse.Namespace(**{**vars(args), "config": kept}))


# The settings a supervisor keeps to itself: its children's command lines
# give their own (process/processes.py's and process/workergroup.py's
# child_argv), whatever the file says, so only the supervisor can say
# that a change to one needs a restart.
SUPERVISOR_OWN = {"lb": ("processes", "status", "pid_file"),
                  "worker": ("workers", "listen", "status", "resume_file", "pid_file")}


class KeptConfig:
    """A supervisor's copy of its ``--config`` file as it last read it
    well: at start, and at each SIGHUP (``take``) that finds the file
    good, when a change to the supervisor's own settings
    (``SUPERVISOR_OWN``) is logged as needing a restart.  Each child it
    starts gets the copy's path (``environ``), for
    ``read_config_at_start``.  Without --config, nothing."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.path: Optional[str] = None
        if getattr(args, "config", None):
            directory = tempfile.mkdtemp(prefix="zc-lb-config-")
            self.path = os.path.join(directory, os.path.basename(args.config))
            self.take()

    @property
    def environ(self) -> Dict[str, str]:
        return {LAST_GOOD_CONFIG: self.path} if self.path and os.path.exists(self.path) else {}

    def take(self) -> bool:
        """Copy the file again if it reads well now (a bad one is logged,
        the copy before stays); whether it did."""
        if self.path is None:
            return False
        trial = self.path + ".new"
        try:
            self._copy(trial)
            new = read_config(argparse.Namespace(**{**vars(self.args), "config": trial}))
        except ConfigurationError as exc:
            log.warning("%s; processes started from now on start with the copy read "
                        "before", str(exc).replace(trial, self.args.config))
            return False
        os.replace(trial, self.path)  # (a child reading it finds the old or the new)
        for dest in SUPERVISOR_OWN.get(self.args.command, ()):
            before = getattr(self.args, dest, None)
            if getattr(new, dest, None) != before:
                _needs_restart(dest, before, self.args.config)
        return True

    def _copy(self, trial: str) -> None:
        """The file copied to ``trial``; ConfigurationError saying why not,
        as read_config says it."""
        try:
            shutil.copyfile(self.args.config, trial)
        except OSError as exc:
            raise ConfigurationError("cannot %s config file %s: %s" % (
                "copy" if exc.filename == trial else "read", self.args.config,
                exc.strerror or exc))

    def remove(self) -> None:
        if self.path is not None:
            shutil.rmtree(os.path.dirname(self.path), ignore_errors=True)


def reload_config(args: argparse.Namespace, apply, live_extra=frozenset()) -> bool:
    """SIGHUP with --config: read the file again; pass the changed settings
    that may change live (``where`` has "live", and ``live_extra``) to
    ``apply``, whose configure method logs each as "name old -> new
    (file)" (``live_extra`` is logged here; one the file no longer gives,
    None, ``apply`` keeps as it runs); log the others as needing a
    restart.  A bad file is logged and changes nothing.  Never exits."""
    try:
        new = read_config(args)
    except ConfigurationError as exc:
        log.error("SIGHUP: %s; keeping the running settings", exc)
        return False
    except Exception:  # a reload must never stop a serving process
        log.exception("SIGHUP: cannot read %s; keeping the running settings", args.config)
        return False
    live, restart = _changes(args, new, live_extra)
    level = _log_level(args, new)
    if live:
        try:
            apply(live)
        except ConfigurationError as exc:
            log.error("SIGHUP: cannot apply %s: %s; keeping the running settings",
                      args.config, exc)
            return False
        except Exception:
            log.exception("SIGHUP: cannot apply %s", args.config)
            return False
        for dest, value in live.items():
            if dest in live_extra:  # (logged once applied, as configure logs the others)
                if value is None:  # (none in the file: ``apply`` kept what runs, and said so)
                    continue
                settings.log_change(dest, getattr(args, dest, None), value, args.config)
            setattr(args, dest, value)
    if not live and not restart and not level:
        log.info("SIGHUP: %s read again; nothing changed", args.config)
    return False


def _log_level(args: argparse.Namespace, new: argparse.Namespace) -> bool:
    """Take ``new``'s log level (the file's, unless the command line gives
    one), logged; whether it changed."""
    if new.log_level == args.log_level:
        return False
    logging.getLogger().setLevel(new.log_level)
    log.warning("log_level %s -> %s (%s)", args.log_level, new.log_level,  # (whatever the level)
                args.config)
    args.log_level = new.log_level
    return True


def _changes(args: argparse.Namespace, new: argparse.Namespace, live_extra) -> tuple:
    """What ``new`` changes of ``args``: the live settings' new values,
    and the names of the others (each logged as needing a restart)."""
    table = COMMAND_SETTINGS[args.command]
    live, restart = {}, []
    for dest in sorted(set(vars(args)) | set(vars(new))):
        before, after = getattr(args, dest, None), getattr(new, dest, None)
        if dest in NOT_COMPARED or before == after:
            continue
        setting = table.get(dest)
        if dest in live_extra or (setting is not None and settings.LIVE in setting.where):
            live[dest] = after
        else:
            restart.append(dest)
            _needs_restart(dest, before, args.config)
    return live, restart


def _needs_restart(dest: str, before, path: str) -> None:
    log.warning("%s changed in %s; restart to apply (%s stays in force)",
                dest, path, settings.shown(before))


def sighup(args: argparse.Namespace, apply, live_extra=frozenset()):
    """The SIGHUP handler: reload ``--config``, or without one, say SIGHUP
    means nothing."""
    if not getattr(args, "config", None):
        return ignore_sighup
    return lambda: reload_config(args, apply, live_extra)
