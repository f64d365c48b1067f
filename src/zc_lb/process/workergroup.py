"""``zc-lb worker APP -w N``: N worker processes under one supervisor, as
gunicorn's ``-w`` starts N.

Theory of operation
-------------------

One worker process runs one interpreter, so it computes on one core at
a time; a machine with more cores runs more workers.  ``-w N`` starts N
``zc-lb worker`` processes with the same options, the i-th (from 0)
listening on ``--listen``'s port plus i (and ``--status``'s plus i, its
``--resume-file`` with ``.i`` added), or each on an ephemeral port when
the port is 0 (with ``--zookeeper`` each registers its own).  Each is a
worker of its own to the LBs: its own connections, its own résumé.

The supervisor prints each child's "listening" lines as they come, and
then waits:

- a child that exits is started again on its address, at once if it ran
  for a while (``--max-requests`` ends a child on purpose: it served its
  share), after a growing pause if it keeps failing to start;
- each child's address (a given port, or a Unix socket) is bound by the
  supervisor, once, and handed to every process that serves it
  (``--listen-fd``), as gunicorn's arbiter holds its listeners: between
  one process and the next, an LB connecting waits in the socket's
  queue instead of being refused, and no other program (a client's
  ephemeral port) can take the port.  Ephemeral ports (0) are each
  child's own, as every new process registers its own in ZooKeeper;
- SIGTERM or SIGINT: every child drains and exits, then the supervisor;
- SIGHUP and SIGUSR1 go to every child (to one starting, once it
  handles them: it says so by its first line).

No I/O beyond its children and signals; the children do the serving.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, List, Optional, Sequence, Set

from zc_lb.errors import AddressUnavailable, ConfigurationError
from zc_lb.sockets import UNIX, listening_socket, parse_address, parse_listen

log = logging.getLogger(__name__)

STOP_TIMEOUT = 60.0  # seconds a child may take to drain after SIGTERM
LISTEN_BACKLOG = 128  # LB connections a held socket queues while its process restarts
READY = "zc-lb worker listening on "  # a child's first line, once it handles signals


def child_argv(argv: Sequence[str], index: int, listen: str, status: Optional[str],
               resume_file: Optional[str]) -> List[str]:
    """The command line of child ``index``: ``argv`` (after ``zc-lb``)
    without ``-w``/``--workers`` and ``--pid-file``, with its own
    ``--listen``, ``--status`` and ``--resume-file``."""
    from zc_lb.process.processes import without_options

    out = without_options(argv, ("-w", "--workers", "--pid-file", "--listen", "--listen-fd",
                                 "--status", "--resume-file"))
    # (a --config file, or an abbreviation, may say -w or --pid-file too:
    # the child's own say none, whatever it reads)
    out += ["--listen", offset(listen, index), "--workers", "1", "--pid-file="]
    if status:
        out += ["--status", offset(status, index)]
    if resume_file:
        out += ["--resume-file", "%s.%d" % (resume_file, index)]
    return out


def offset(address: str, index: int) -> str:
    """``HOST:PORT`` with ``index`` added to the port (0 stays 0:
    ephemeral); ``unix:PATH`` with ``.index`` added to the path."""
    if address.startswith(UNIX):
        parse_listen(address)  # (refuses an empty path)
        return "%s.%d" % (address, index)
    host, port = parse_address(address)
    if port and port + index > 65535:
        raise ConfigurationError("-w: %s plus %d is past the last port" % (address, index))
    shown = "[%s]" % host if ":" in host else host
    return "%s:%d" % (shown, port + index if port else 0)


def held_sockets(listen: str, count: int) -> List[Optional[socket.socket]]:
    """The listening socket of each of ``count`` children, bound here to
    be held for their lives (see the module docstring), or None where
    the child binds its own (an ephemeral port).  An address taken is
    refused, naming the option, before any child starts."""
    socks: List[Optional[socket.socket]] = []
    try:
        for index in range(count):
            address = offset(listen, index)
            where = parse_listen(address)
            if isinstance(where, tuple) and not where[1]:
                socks.append(None)
                continue
            try:
                socks.append(listening_socket(where, LISTEN_BACKLOG))
            except OSError as exc:
                raise AddressUnavailable("--listen %s (-w process %d): %s"
                                         % (address, index, exc.strerror or exc))
    except BaseException:
        for sock in socks:
            if sock is not None:
                sock.close()
        raise
    return socks


def check_free(option: str, address: str, count: int) -> None:
    """Refuse, naming ``option``, an address of ``count`` children (each
    ``offset``) that is taken now: such a child would fail at every
    start, and the group run one process short for good.  (The status
    addresses are each child's own to bind; held_sockets holds --listen's.)"""
    for index in range(count):
        shown = offset(address, index)
        where = parse_address(shown)
        if not where[1]:
            continue  # (ephemeral)
        try:
            listening_socket(where, 1).close()
        except OSError as exc:
            raise AddressUnavailable("%s %s (-w process %d): %s"
                                     % (option, shown, index, exc.strerror or exc))


class Child:
    """One worker process of the group, and the socket (``sock``) the
    supervisor holds for it, if any."""

    def __init__(self, index: int, argv: List[str], sock: Optional[socket.socket] = None,
                 cwd: Optional[str] = None, kept: Any = None) -> None:
        from zc_lb.process.processes import Backoff

        self.index = index
        self.kept = kept  # (cli/reload.py's KeptConfig: the --config copies)
        self.copy: Optional[str] = None  # (the one it was started with)
        self.sock = sock
        self.argv = argv if sock is None else argv + ["--listen-fd", str(sock.fileno())]
        self.cwd = cwd  # where the supervisor started: a relative --chdir means the same
        self.command = [sys.executable, "-m", "zc_lb.cli", *self.argv]
        self.process: Optional[subprocess.Popen] = None
        self.started = 0.0
        self.backoff = Backoff()  # (the rule of lb --processes too)
        self.not_before = 0.0  # (failing at start: when to try again)
        self.ready = False  # (it said READY: it handles signals)
        self.missed: Set[int] = set()  # signals that came while it started
        self.lock = threading.RLock()  # (signal handlers take it: reentrant)

    def start(self) -> None:
        from zc_lb.process.processes import die_with_parent

        fds = () if self.sock is None else (self.sock.fileno(), )
        with self.lock:
            self.copy = self.kept.give() if self.kept is not None else None
            env = dict(os.environ, **(self.kept.environ(self.copy) if self.kept else {}))
            self.ready = False
            self.missed.clear()  # (it reads --config and opens its log from now on)
            try:
                self.process = subprocess.Popen(self.command, stdout=subprocess.PIPE,
                                                text=True, pass_fds=fds, cwd=self.cwd, env=env,
                                                preexec_fn=die_with_parent(os.getpid()))
            except BaseException:
                if self.kept is not None:
                    self.kept.release(self.copy)  # (no process holds it)
                raise
        self.started = time.monotonic()
        threading.Thread(target=self._echo, args=(self.process,), daemon=True).start()

    def pass_on(self, signum: int) -> None:
        """Send ``signum`` to the process if it handles signals; if it is
        starting, once it does (the default action of SIGHUP and SIGUSR1
        kills a process before it handles them, and a worker ignores them
        while it starts, reading --config before its application loads)."""
        with self.lock:
            if self.ready and self.process is not None and self.process.poll() is None:
                self.process.send_signal(signum)
            else:
                self.missed.add(signum)

    def set_aside(self, process: subprocess.Popen) -> bool:
        """Whether the process exited at start for a configuration error
        in the --config copy of the last SIGHUP (cli/reload.py's
        KeptConfig): said once; it starts again at once with the copy
        read before."""
        return not self.ready and self.kept is not None and self.kept.set_aside(
            self.copy, process.returncode,
            "worker process %d (pid %d)" % (self.index, process.pid))

    def _echo(self, process: subprocess.Popen) -> None:
        """Pass the child's lines (its addresses) on to our stdout; at the
        first, pass it the signals that came while it started."""
        assert process.stdout is not None
        for line in process.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            if line.startswith(READY):
                self._serving(process)

    def _serving(self, process: subprocess.Popen) -> None:
        with self.lock:
            if self.process is not process or self.ready:
                return
            self.ready = True
            if self.kept is not None:
                self.kept.served(self.copy)
            missed, self.missed = sorted(self.missed), set()
            for signum in missed:
                log.info("worker process %d: passing on %s, which came while it started",
                         self.index, signal.Signals(signum).name)
                process.send_signal(signum)


class WorkerGroup:
    """N children, kept running until ``stop``."""

    def __init__(self, argvs: List[List[str]],
                 socks: Optional[List[Optional[socket.socket]]] = None,
                 cwd: Optional[str] = None, kept: Any = None) -> None:
        socks = socks or [None] * len(argvs)
        self.children = [Child(i, argv, sock, cwd, kept)
                         for i, (argv, sock) in enumerate(zip(argvs, socks))]
        self.stopping = threading.Event()

    def start(self) -> None:
        for child in self.children:
            child.start()

    def watch(self) -> None:
        """Start again each child that exits, until ``stop``; then wait
        for the children to end.  (A child dies with the thread that
        started it, not the process: ``die_with_parent``'s signal follows
        that thread.  Returning at once sent every child this thread had
        started again a second SIGTERM as it drained.)"""
        self._keep_running()
        while any(child.process is not None and child.process.poll() is None
                  for child in self.children):
            time.sleep(0.1)  # (``stop`` kills those that do not end)

    def _keep_running(self) -> None:
        """Start again each child that exits, until ``stop``."""
        while not self.stopping.wait(0.1):
            now = time.monotonic()
            for child in self.children:
                process = child.process
                if process is None or process.poll() is None or now < child.not_before:
                    continue
                # (one set aside is started again at once, with the copy read before)
                if not child.not_before and not child.set_aside(process):
                    ran = now - child.started
                    # (failing at start: longer each time; the others' restarts wait not)
                    pause = child.backoff.after_exit(ran, process.returncode)
                    log.info("worker process %d (pid %d) exited with status %s after %.1fs; "
                             "starting it again%s", child.index, process.pid,
                             process.returncode, ran, " in %gs" % pause if pause else "")
                    if pause:
                        child.not_before = now + pause
                        continue
                child.not_before = 0.0
                with child.lock:  # (stop takes it: a child starts before its SIGTERM, or not)
                    if self.stopping.is_set():
                        return
                    try:
                        child.start()
                    except OSError as exc:  # (it could not be run at all: try again later)
                        log.error("worker process %d: %s", child.index, exc)
                        child.not_before = now + child.backoff.failed()

    def signal_all(self, signum: int) -> None:
        """Pass ``signum`` on to every child (to one starting, once it
        handles signals)."""
        for child in self.children:
            child.pass_on(signum)

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """SIGTERM every child (each drains), wait for them, kill stragglers."""
        self.stopping.set()
        for child in self.children:  # (one starting too: it has nothing to drain)
            with child.lock:  # (one being started again by ``watch``: once it is)
                if child.process is not None and child.process.poll() is None:
                    child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for child in self.children:
            if child.process is None:
                continue
            try:
                child.process.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                log.warning("worker process %d did not drain within %gs: killed",
                            child.index, timeout)
                child.process.kill()
                child.process.wait()
        for child in self.children:
            if child.sock is not None:
                child.sock.close()


def run(args, argv: Sequence[str], kept: Any = None) -> int:
    """``zc-lb worker ... -w N`` (N > 1): the supervisor's life.  ``kept``:
    the --config copies, for the children (cli/reload.py)."""
    from zc_lb.process.service import PidFile, check_secret_files, watch_secrets_for_children

    if not args.app:
        raise ConfigurationError("no application: give module:callable (or a PasteDeploy "
                                 ".ini file) on the command line, or app in --config")
    if args.status:
        check_free("--status", args.status, args.workers)
    watch_secrets_for_children(args.secret_file)
    i = list(argv).index("worker") if "worker" in argv else 0
    prefix, rest = list(argv[:i + 1]), list(argv[i + 1:])
    group = WorkerGroup([prefix + child_argv(rest, index, args.listen, args.status,
                                             args.resume_file)
                         for index in range(args.workers)],
                        held_sockets(args.listen, args.workers),
                        getattr(args, "start_dir", None), kept)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())

    def sighup(*_) -> None:
        check_secret_files()
        if kept is not None:
            kept.take()
        group.signal_all(signal.SIGHUP)

    signal.signal(signal.SIGHUP, sighup)
    signal.signal(signal.SIGUSR1, lambda number, _: group.signal_all(number))
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # (no hand-over here: not our end)
    pid_file = PidFile(args.pid_file)
    try:
        pid_file.write()  # (signals are handled; a failure is one error, with no child to end)
        group.start()
        threading.Thread(target=group.watch, daemon=True).start()
        log.info("%d worker processes, pids %s", len(group.children),
                 " ".join(str(c.process.pid) for c in group.children if c.process))
        while not stop.wait(0.5):
            pass
    finally:
        group.stop(args.drain_timeout + 5)
        pid_file.remove()
        if kept is not None:
            kept.remove()
    log.info("worker processes stopped")
    return 0


__all__ = ["WorkerGroup", "child_argv", "offset", "run"]


if os.name != "posix":  # pragma: no cover
    raise ImportError("zc-lb worker -w needs POSIX signals")
