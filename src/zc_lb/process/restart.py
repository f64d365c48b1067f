"""Hitless restart and upgrade: SIGUSR2 starts a new LB on the same sockets.

As nginx and gunicorn do on USR2: the running LB (the old one) starts a
new process of the same command line, whatever version of zc-lb is
installed now, handing it its listening sockets (the front's and the
status address's) as inherited descriptors.  The new LB uses them
instead of binding, connects to its workers, and says it is ready on a
pipe.  It takes a socket only where it is to listen at the very address
the old one did (the same ``--listen`` or ``--status`` text): an address
its configuration changed is bound anew, and a socket it does not take
is closed once it is ready, so that the address stops taking
connections when the old LB has drained.  Only then does the old one stop accepting and drain, exactly as
on SIGTERM: connections the kernel has queued are taken by the new one,
which shares the very sockets, so no client is refused at any moment.
If the new LB fails to become ready within ``READY_TIMEOUT`` seconds (a
bad option in a new version, a crash), the old one kills it, logs why,
and goes on serving.

Under systemd (``Type=notify``, ``NotifyAccess=all``), every LB tells
the service manager ``READY=1`` and its pid (``MAINPID``) when it is
ready, so ``ExecReload=/bin/kill -USR2 $MAINPID`` hands the service over
to the new process (etc/systemd/zc-lb.service).

The handover travels in the environment: ``ZC_LB_INHERIT`` names the
sockets (``front0=5,status=6``), ``ZC_LB_INHERIT_ADDRESSES`` their
addresses (JSON: ``{"front0": "0.0.0.0:80"}``; an LB of a release
before hands down by name alone), and ``ZC_LB_READY_FD`` the pipe's end.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from typing import Dict, List, Optional, Sequence

log = logging.getLogger(__name__)

INHERIT_ENV = "ZC_LB_INHERIT"
ADDRESSES_ENV = "ZC_LB_INHERIT_ADDRESSES"
READY_FD_ENV = "ZC_LB_READY_FD"
READY_TIMEOUT = 60.0  # seconds a new LB has to connect and say it is ready
EXIT_WAIT = 5.0  # seconds for a new LB that closed its ready pipe to be seen exiting
READY = b"ready\n"

_inherited: Optional[Dict[str, int]] = None
_addresses: Optional[Dict[str, str]] = None  # (None: an old LB that did not say them)
_ready_fd: Optional[int] = None


def _take_handover() -> Dict[str, int]:
    """What the old LB handed down, taken out of the environment once, so
    that no process this one starts (a --processes child) believes it."""
    global _inherited, _addresses, _ready_fd
    if _inherited is None:
        _inherited = {}
        for item in os.environ.pop(INHERIT_ENV, "").split(","):
            key, _, fd = item.partition("=")
            if key and fd.isdigit():
                _inherited[key] = int(fd)
        try:
            addresses = json.loads(os.environ.pop(ADDRESSES_ENV, "null"))
        except ValueError:
            addresses = None
        _addresses = ({str(key): str(value) for key, value in addresses.items()}
                      if isinstance(addresses, dict) else None)
        ready = os.environ.pop(READY_FD_ENV, "")
        _ready_fd = int(ready) if ready.isdigit() else None
    return _inherited


def _kind(name: str) -> str:
    return name.rstrip("0123456789")  # ("front1" is a front, as "front0")


def inherited(name: str, address: str):
    """The listening socket that the old LB handed down for ``name``
    ("front0" for the first ``--listen``, "front1"..., "status"), to
    listen at ``address`` (the option's text): of the sockets of the
    same kind, the one the old LB listened on at that very ``address``
    (a gevent socket), or None: bind as usual."""
    handed = _take_handover()
    if _addresses is None:  # (an LB of a release before: by name alone)
        fd = handed.pop(name, None)
    else:
        fd = next((handed.pop(key) for key in sorted(handed)
                   if _kind(key) == _kind(name) and _addresses.get(key) == address), None)
    if fd is None:
        return None
    import gevent.socket

    return gevent.socket.socket(fileno=fd)


def close_unclaimed() -> None:
    """Close the sockets the old LB handed down that this one does not
    listen on (an address its configuration no longer has): kept open,
    each would take connections that no one answers."""
    handed = _take_handover()
    for name in sorted(handed):
        fd = handed.pop(name)
        shown = (_addresses or {}).get(name, name)
        log.info("%s %s is not in this LB's configuration: closed here; it stops taking "
                 "connections when the old LB has drained",
                 "--status" if _kind(name) == "status" else "--listen", shown)
        try:
            os.close(fd)
        except OSError:
            pass


def announce_ready() -> None:
    """Tell the old LB (if one started us) and systemd (if it runs us)
    that this LB serves now, having closed the sockets it did not take."""
    global _ready_fd
    close_unclaimed()
    if _ready_fd is not None:
        try:
            os.write(_ready_fd, READY)
            os.close(_ready_fd)
        except OSError as exc:
            log.warning("cannot tell the old LB we are ready: %s", exc)
        _ready_fd = None
    sd_notify("READY=1\nMAINPID=%d" % os.getpid())


def sd_notify(state: str) -> bool:
    """Send ``state`` to systemd's notify socket, if there is one."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    address = "\0" + path[1:] if path.startswith("@") else path
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.sendto(state.encode(), address)
        return True
    except OSError as exc:
        log.warning("cannot notify systemd at %s: %s", path, exc)
        return False


class Successor:
    """The new LB that an old one starts on SIGUSR2."""

    def __init__(self, argv: Sequence[str], sockets: Dict[str, socket.socket],
                 cwd: Optional[str] = None,
                 addresses: Optional[Dict[str, str]] = None) -> None:
        self.argv = [sys.executable, "-m", "zc_lb.cli"] + list(argv)
        self.sockets = sockets
        self.addresses = addresses or {}  # name -> the --listen or --status text
        self.cwd = cwd  # where this LB started: its --chdir and paths mean the same there
        self.process: Optional[subprocess.Popen] = None

    def start(self, timeout: float = READY_TIMEOUT) -> bool:
        """Start it and wait until it is ready, at most ``timeout``
        seconds; whether it is (if not, it is killed)."""
        import gevent
        import gevent.os
        import gevent.subprocess

        fds = {name: sock.fileno() for name, sock in self.sockets.items()}
        for fd in fds.values():
            os.set_inheritable(fd, True)
        read_end, write_end = os.pipe()
        env = dict(os.environ)
        env[INHERIT_ENV] = ",".join("%s=%d" % item for item in sorted(fds.items()))
        env.pop(ADDRESSES_ENV, None)
        if self.addresses:
            env[ADDRESSES_ENV] = json.dumps(self.addresses)
        env[READY_FD_ENV] = str(write_end)
        try:
            self.process = gevent.subprocess.Popen(
                self.argv, env=env, pass_fds=list(fds.values()) + [write_end], cwd=self.cwd)
        except OSError as exc:  # (the start directory gone in a deploy, the interpreter)
            os.close(read_end)
            log.error("cannot start a new LB (%s): this one goes on serving", exc)
            return False
        finally:
            os.close(write_end)
        said = None
        try:
            gevent.os.make_nonblocking(read_end)
            with gevent.Timeout(timeout, False):
                said = gevent.os.nb_read(read_end, len(READY))
                if said == READY:
                    return True
        finally:
            os.close(read_end)
        if said == b"":  # it closed the pipe: it exits, or has (not yet reaped)
            with gevent.Timeout(EXIT_WAIT, False):
                self.process.wait()
        self._failed(timeout)
        return False

    def _failed(self, timeout: float) -> None:
        process = self.process
        assert process is not None
        status = process.poll()
        if status is None:
            log.error("the new LB (pid %d) was not ready within %gs: killed it; this "
                      "one goes on serving", process.pid, timeout)
            process.kill()
            process.wait()
        else:
            log.error("the new LB (pid %d) exited with status %s before it was ready; "
                      "this one goes on serving", process.pid, status)


def command_line(argv: List[str]) -> List[str]:
    """The arguments a successor gets: the same, less what only this
    process was given (``--listen-fd`` from a supervisor)."""
    out: List[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg.split("=", 1)[0] == "--listen-fd":
            skip = "=" not in arg
        else:
            out.append(arg)
    return out
