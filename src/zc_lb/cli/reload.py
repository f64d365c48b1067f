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
import contextlib
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


# In a child of a supervisor (-w, --processes): the copy of --config it
# starts with (KeptConfig.copy; empty: the file itself).
CONFIG_COPY = "ZC_LB_CONFIG_COPY"
_supervised = False  # (a child of a supervisor: it logs a bad file at SIGHUP)


def read_config_at_start(args: argparse.Namespace) -> argparse.Namespace:
    """``read_config``; but a child of a supervisor reads the copy the
    supervisor gives it (``KeptConfig``), the file as a SIGHUP last read
    it: a file edited or broken since costs no process, and the children
    run alike.  The file itself stays the child's ``--config``, for its
    SIGHUPs.  A process started alone reads the file (a bad one: exit 2)."""
    global _supervised
    _supervised = CONFIG_COPY in os.environ
    copy = os.environ.pop(CONFIG_COPY, None)  # (not the application's business)
    if not copy or not os.path.exists(copy):
        return read_config(args)
    try:
        return read_config(argparse.Namespace(**{**vars(args), "config": copy}))
    except ConfigurationError as exc:
        raise ConfigurationError(str(exc).replace(copy, args.config))


# The settings a supervisor keeps to itself: its children's command lines
# give their own (process/processes.py's and process/workergroup.py's
# child_argv, and the Supervisor's), whatever the file says, so only the
# supervisor can say that a change to one needs a restart.
SUPERVISOR_OWN = {"lb": ("processes", "status", "pid_file", "child_status_timeout",
                         "child_action_timeout"),
                  "worker": ("workers", "listen", "status", "resume_file", "pid_file")}


class KeptConfig:
    """A supervisor's copies of its ``--config`` file, which the children
    it starts read in its place (``copy``, ``environ``): ``latest``, the
    file as the last SIGHUP that found it good read it (or the start),
    and ``good``, the last copy a child started from and served with.
    A child is given its copy (``give``) and holds it until it serves
    (``served``) or exits before it does (``set_aside``): a SIGHUP
    removes the older copies but those, so that a child still starting
    reads the copy it was given, not the file as it is by then.

    A SIGHUP reads the file, not the LB or application it makes: the
    running children refuse what they cannot apply, but a setting only a
    process being built checks (a classifier that does not import, a bad
    certificate...) is found by the next child started.  So a child
    started with ``latest`` that serves makes it ``good``; one that exits
    with status 2 before it serves sets it aside (``set_aside``), and the
    children start with ``good`` until a SIGHUP reads the file again: a
    bad file never costs a process for good.  At each SIGHUP that reads
    the file well (``take``), a change to the supervisor's own settings
    (``SUPERVISOR_OWN``) is logged as needing a restart.  Without
    --config, nothing."""

    def __init__(self, args: argparse.Namespace) -> None:
        import threading

        self.args = args
        self.directory: Optional[str] = None
        self.latest: Optional[str] = None  # (None: none, or set aside)
        self.good: Optional[str] = None
        self.held: Dict[str, int] = {}  # copy -> how many children starting with it
        self.taken = 0  # (each copy is a file of its own: a child reads the one it was given)
        self.lock = threading.RLock()  # (worker -w: its threads and signal handlers)
        if getattr(args, "config", None):
            self.directory = tempfile.mkdtemp(prefix="zc-lb-config-")
            self.take()

    @property
    def copy(self) -> Optional[str]:
        """The copy a child started now reads (None: the file itself)."""
        with self.lock:
            return next((path for path in (self.latest, self.good)
                         if path is not None and os.path.exists(path)), None)

    def give(self) -> Optional[str]:
        """``copy``, for a child started now, which holds it until it
        serves (``served``) or exits (``set_aside``); its launch that
        failed gives it back (``release``)."""
        with self.lock:
            copy = self.copy
            if copy is not None:
                self.held[copy] = self.held.get(copy, 0) + 1
            return copy

    def release(self, copy: Optional[str]) -> None:
        """A child given ``copy`` holds it no longer."""
        with self.lock:
            if copy is not None and copy in self.held:
                self.held[copy] -= 1
                if not self.held[copy]:
                    del self.held[copy]

    def environ(self, copy: Optional[str]) -> Dict[str, str]:
        """What a child given ``copy`` needs in its environment."""
        return {CONFIG_COPY: copy or ""} if self.directory is not None else {}

    def take(self) -> bool:
        """Copy the file again if it reads well now (a bad one is logged,
        the copies before stay); whether it did."""
        if self.directory is None:
            return False
        with self.lock:
            self.taken += 1
            trial = "%d-%s" % (self.taken, os.path.basename(self.args.config))
            try:
                trial = os.path.join(self._tidy(), trial)
                self._copy(trial)
                new = read_config(argparse.Namespace(**{**vars(self.args), "config": trial}))
            except ConfigurationError as exc:
                log.error("SIGHUP: %s; the running processes keep their settings, and "
                          "those started from now on start with the copy read before",
                          str(exc).replace(trial, self.args.config))
                return False
            self.latest = None if self.good and _same(trial, self.good) else trial
        for dest in SUPERVISOR_OWN.get(self.args.command, ()):
            before = getattr(self.args, dest, None)
            if getattr(new, dest, None) != before:
                _needs_restart(dest, before, self.args.config)
        return True

    def served(self, copy: Optional[str]) -> None:
        """A child started with ``copy`` serves: it is good (one a SIGHUP
        made older while the child started is, when none is yet)."""
        with self.lock:
            self.release(copy)
            if copy is not None and copy == self.latest:
                self.good, self.latest = copy, None
            elif copy is not None and self.good is None and os.path.exists(copy):
                self.good = copy

    def set_aside(self, copy: Optional[str], status: Optional[int], who: str = "") -> bool:
        """A child started with ``copy`` exited with ``status`` before it
        served: if that is the last SIGHUP's copy and a configuration
        error, children start with the good copy from now on, said once
        of ``who`` (the child, with its pid).  Whether it was (the caller
        starts the child again at once)."""
        with self.lock:
            self.release(copy)
            if copy is None or copy != self.latest or status != ConfigurationError.exit_status:
                return False
            self.latest = None
        if who:
            log.error("%s could not start with %s as the last SIGHUP read it (exit status %s: "
                      "its error is above); it and every process started until a SIGHUP finds "
                      "the file good start with the copy read before",
                      who, self.args.config, status)
        return True

    def _tidy(self) -> str:
        """Remove the copies no child is given any more, nor holds; the directory,
        made anew if something removed it (a cleaner of $TMPDIR's old
        files: until then, children read the file itself)."""
        assert self.directory is not None
        if not os.path.isdir(self.directory):
            try:
                self.directory = tempfile.mkdtemp(prefix="zc-lb-config-")
            except OSError as exc:
                raise ConfigurationError("cannot copy config file %s: %s" % (
                    self.args.config, exc.strerror or exc))
            return self.directory
        try:
            names = os.listdir(self.directory)
        except OSError:  # (removed just now: the copy says so)
            names = []
        for name in names:
            path = os.path.join(self.directory, name)
            if path not in (self.latest, self.good) and path not in self.held:
                with contextlib.suppress(OSError):
                    os.remove(path)
        return self.directory

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
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)


def _same(path: str, other: str) -> bool:
    """Whether the files at ``path`` and ``other`` hold the same bytes."""
    try:
        with open(path, "rb") as a, open(other, "rb") as b:
            return a.read() == b.read()
    except OSError:
        return False


def reload_config(args: argparse.Namespace, apply, live_extra=frozenset()) -> bool:
    """SIGHUP with --config: read the file again; pass the changed settings
    that may change live (``where`` has "live", and ``live_extra``) to
    ``apply``, whose configure method logs each as "name old -> new
    (file)" (``live_extra`` is logged here; one the file no longer gives,
    None, ``apply`` keeps as it runs); log the others as needing a
    restart.  A bad file is logged and changes nothing.  Never exits."""
    try:
        new = read_config(args)
    except ConfigurationError as exc:  # (a supervisor's child: the supervisor said it, once)
        (log.debug if _supervised else log.error)(
            "SIGHUP: %s; keeping the running settings", exc)
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
