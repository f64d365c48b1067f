"""``zc-lb lb --processes N``: N LB processes on one listening address.

One Python process uses one core.  With ``--processes N`` the process
started is a supervisor: it binds the listening socket, then starts N
children (``zc-lb lb`` with the same options and ``--listen-fd``), each
accepting on that one inherited socket with its own pool and its own
connections to every worker; workers send their résumés to each, as to
any LB.  The kernel hands each new client connection to one child.  The
children route as one LB: the supervisor gives them a shared memory
segment (``--siblings-fd``, see routing/siblings.py) for where keys went, the
classes' recruits, their measures of locality and their requests in
flight.

The supervisor serves ``--status`` itself: one summed view of the
children's documents (counters added, each worker's backlog summed over
the processes, ``processes`` listing each child with its own status
address), and a POST action goes to every child: all asked at once,
over gevent's sockets, so one that hangs holds up nothing else
(process/asking.py), each given --child-status-timeout or
--child-action-timeout seconds to answer, actions one after another.  SIGHUP (read --config
again) and SIGUSR1 (reopen the access log) are passed on to every child,
as are SIGTERM and SIGINT, on which each child drains as a single LB
does; the supervisor exits when they all have.  A child that dies otherwise is
started again, so one crash does not halve the LB for good: at once if
it ran for a while, after a growing pause if it keeps failing at start
(``Backoff``, the rule of ``worker -w`` too).  Once it serves, it is
given the SIGHUP and SIGUSR1 that came while it started, and the drains
not undone (asked again until it takes each: in ZooKeeper mode it may
not know the worker yet).

In ZooKeeper mode each child registers as an LB of its own
(``HOST:PORT#I``), so the pool's count of LBs counts processes: the
children share their book through the segment, and with LBs on other
hosts through the keys the workers relay, as any LB does
(docs/routing.rst, "Several LB processes").
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Set

from zc_lb.process.asking import FifoLock, ask, each
from zc_lb.process.drains import Drains, ask_each, failed, merged
from zc_lb.process.retired import Retired
from zc_lb.routing import siblings
from zc_lb.errors import AddressUnavailable, ConfigurationError, ZcLbError
from zc_lb.settings import LB_SETTINGS, check
from zc_lb.status.document import merge_status

PR_SET_PDEATHSIG = 1  # prctl(2): the signal a child gets when its parent dies
log = logging.getLogger(__name__)

READY = "zc-lb lb listening on "
STATUS_READY = "zc-lb status on "
START_TIMEOUT = 60.0  # seconds a child has to say its status address (a new LB's too)
RESTART_MIN = 0.1  # seconds before a child failing at start is started again, doubling
RESTART_MAX = 10.0
HEALTHY_RUN = 5.0  # seconds a child must have run for its exit to be no failure
# Seconds a child has to answer for its status document, and an action,
# unless --child-status-timeout and --child-action-timeout say otherwise.
STATUS_TIMEOUT = LB_SETTINGS["child_status_timeout"].default
ACTION_TIMEOUT = LB_SETTINGS["child_action_timeout"].default
# What the summed document needs of each child's: every worker's every
# skill (its skills_count, and the workers skilled for each class), and
# every class counted (a class's sum goes back if a child's share of it
# drops into that child's "other").
CHILD_QUERY = {"skills": "all", "classes": "all"}


def without_options(argv: Sequence[str], names: Sequence[str]) -> List[str]:
    """``argv`` without the options ``names`` and their values, however
    given (``--opt V``, ``--opt=V``, and for a short one ``-oV``)."""
    out: List[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in names:
            skip = "=" not in arg
            continue
        if any(len(n) == 2 and arg.startswith(n) and len(arg) > 2 for n in names):
            continue  # (-w3)
        out.append(arg)
    return out


def child_argv(argv: Sequence[str]) -> List[str]:
    """The ``zc-lb lb`` options of a child: ours, without ``--processes``,
    ``--listen`` and ``--status`` (the supervisor has those)."""
    return without_options(argv, ("--processes", "--listen", "--status", "--listen-fd",
                                  "--process-index"))


class Child:
    """One LB process and what it said when it started."""

    def __init__(self, index: int, argv: List[str], fd: int, log_level: str,
                 cwd: Optional[str] = None, siblings_fd: Optional[int] = None,
                 kept: Any = None) -> None:
        import gevent.event

        self.index = index
        self.kept = kept  # (cli/reload.py's KeptConfig: the --config copies)
        self.copy: Optional[str] = None  # (the one it was started with)
        self.cwd = cwd  # where the supervisor started: --chdir means the same there
        self.argv = [sys.executable, "-m", "zc_lb.cli", "--log-level", log_level, "lb"] + argv + [
            "--listen-fd", str(fd), "--status", "127.0.0.1:0", "--process-index", str(index),
            "--processes", "1", "--pid-file="]  # whatever a --config file says
        if siblings_fd is not None:
            self.argv += ["--siblings-fd", str(siblings_fd)]
        self.fds = (fd,) if siblings_fd is None else (fd, siblings_fd)
        self.fd = fd
        self.process: Optional[subprocess.Popen] = None
        self.launched = gevent.event.Event()  # (not set while a launch is under way)
        self.launched.set()
        self.status: Optional[str] = None
        self.started = 0.0
        self.ready = False  # (it said its status address: it handles signals)
        self.missed: Set[int] = set()  # signals that came while it started
        self.refused: Set[str] = set()  # drains it has not taken yet (asked again)
        self.unanswered: Set[str] = set()  # drains it did not answer (it may have them)
        self.backoff = Backoff()

    @property
    def serving(self) -> bool:
        """Whether it runs and handles signals and actions (not dead, nor
        starting: the default action of SIGHUP or SIGUSR1 kills a process
        before it handles them, and an LB ignores them while it starts)."""
        return self.ready and self.process is not None and self.process.poll() is None

    def start(self) -> None:
        self.launch()
        self.wait_started()

    def launch(self) -> None:
        """Start the process (``wait_started`` waits for its status address:
        several children import at once)."""
        import gevent.subprocess

        self.started = time.monotonic()
        self.ready = False
        self.missed.clear()  # (it reads --config and opens its log from now on)
        self.copy = self.kept.give() if self.kept is not None else None
        env = dict(os.environ, **(self.kept.environ(self.copy) if self.kept is not None else {}))
        env.pop("NOTIFY_SOCKET", None)  # the supervisor is the service's main process
        self.launched.clear()  # (Popen yields: a stop meanwhile waits for the process)
        try:
            self.process = gevent.subprocess.Popen(
                self.argv, pass_fds=self.fds, stdout=subprocess.PIPE, text=True, env=env,
                preexec_fn=die_with_parent(os.getpid()), cwd=self.cwd)
        except BaseException:
            if self.kept is not None:
                self.kept.release(self.copy)  # (no process holds it)
            raise
        finally:
            self.refused.clear()  # (once the process is new: the last one's refusals go)
            self.unanswered.clear()
            self.launched.set()

    def wait_started(self) -> None:
        """Wait until the process says its status address (it handles
        signals from then on); ConfigurationError if it exits first, or
        has not said it START_TIMEOUT seconds after its launch (killed)."""
        import gevent

        assert self.process is not None
        self.status = None
        timed_out = True
        with gevent.Timeout(max(self.started + START_TIMEOUT - time.monotonic(), 0.01), False):
            for line in self.process.stdout:  # type: ignore[union-attr]
                if line.startswith(STATUS_READY):
                    self.status = line[len(STATUS_READY):].strip()
                if self.status is not None:
                    break
            timed_out = False
        if timed_out:
            self.process.kill()
            self.process.wait()
            raise ConfigurationError("LB process %d did not start within %gs: killed"
                                     % (self.index, START_TIMEOUT))
        if self.status is None:
            raise ConfigurationError("LB process %d did not start (exit status %s)"
                                     % (self.index, self.process.wait()))
        gevent.spawn(_discard, self.process.stdout)  # nothing more should come
        self.ready = True
        if self.kept is not None:
            self.kept.served(self.copy)

    def __repr__(self) -> str:
        return "<Child %d pid=%s status=%s>" % (
            self.index, self.process.pid if self.process else None, self.status)


class Supervisor:
    """Starts, watches and stops the LB processes; serves their status.
    Constructing one does nothing; ``start()`` binds the address (or
    takes the socket handed down) and starts the children.  A child has
    ``status_timeout`` seconds to answer for its status document, and
    ``action_timeout`` to answer an action (STATUS_TIMEOUT and
    ACTION_TIMEOUT if not given)."""

    def __init__(self, count: int, argv: Sequence[str], listen, log_level: str = "INFO",
                 backlog: int = 1024, scheme: str = "http", cwd: Optional[str] = None,
                 kept: Any = None, admin_token: Optional[bytes] = None,
                 status_timeout: Optional[float] = None,
                 action_timeout: Optional[float] = None) -> None:
        if count < 1:
            raise ConfigurationError("--processes must be at least 1, got %d" % count)
        self.status_timeout: float = check(
            LB_SETTINGS, "child_status_timeout",
            STATUS_TIMEOUT if status_timeout is None else status_timeout)
        self.action_timeout: float = check(
            LB_SETTINGS, "child_action_timeout",
            ACTION_TIMEOUT if action_timeout is None else action_timeout)
        self.count, self.listen, self.log_level, self.backlog = count, listen, log_level, backlog
        # (each child serves the socket as the one --listen said: HTTP or
        # HTTPS; and has our timeouts for it, whatever a --config file says:
        # only we use them, and say that a change to one needs a restart)
        self.argv = child_argv(argv) + [
            "--listen", scheme + "://127.0.0.1:0",
            "--child-status-timeout", repr(self.status_timeout),
            "--child-action-timeout", repr(self.action_timeout)]
        self.cwd = cwd
        self.kept = kept
        self.admin_token = admin_token  # (what its children's actions need)
        self.drains = Drains(self._ask, lambda: self.stopping)  # (and enables)
        self.acting = FifoLock()  # (one action after another, in the order they came)
        self.sock: Optional[socket.socket] = None
        self.siblings_fd: Optional[int] = None  # the children's shared memory (routing/siblings.py)
        self.children: List[Child] = []
        self._last: Dict[str, dict] = {}  # each child's last status document, by address
        self.retired = Retired()  # the counters of the children that ended
        self.stopping = False

    @property
    def address(self):
        assert self.sock is not None, "not started"
        from zc_lb.sockets import bound

        return bound(self.sock.getsockname())

    def start(self) -> None:
        import gevent

        self.sock = self._socket()
        if self.siblings_fd is None:  # (one segment for the supervisor's life: a
            self.siblings_fd = siblings.create(self.count)  # child restarted finds it)
        self.children = [Child(i, self.argv, self.sock.fileno(), self.log_level, self.cwd,
                               self.siblings_fd, self.kept)
                         for i in range(self.count)]
        try:
            for child in self.children:
                child.launch()
            for child in self.children:
                child.wait_started()
        except BaseException:
            self.stop(timeout=5)  # no orphans when one of them cannot start
            raise
        for child in self.children:
            gevent.spawn(self._watch, child)

    def _socket(self) -> socket.socket:
        from zc_lb.sockets import address_text, listening_socket

        if isinstance(self.listen, (tuple, str)):  # (host, port), or a Unix socket's path
            try:
                return listening_socket(self.listen, self.backlog)
            except OSError as exc:  # (named as a single LB names it: service.start_named)
                raise AddressUnavailable("--listen %s: %s" % (
                    address_text(self.listen), exc.strerror or exc))
        self.listen.set_inheritable(True)  # handed down by the supervisor this one
        return self.listen                 # replaces (SIGUSR2)

    def _watch(self, child: Child) -> None:
        """Start ``child`` again whenever it dies (not when we stop them),
        after a pause if it keeps failing at start (``Backoff``): a greenlet
        per child, waiting on its exit (gevent's child watcher), not polling."""
        while not self.stopping:
            process = child.process
            assert process is not None
            process.wait()
            if self.stopping:
                return
            ran = time.monotonic() - child.started
            if self._set_aside(child, process):
                self._start_again(child, 0.0)
                continue
            # (one that never served failed at start, however long it took)
            pause = child.backoff.after_exit(ran if child.ready else 0.0, process.returncode)
            log.warning("LB process %d (pid %d) exited with status %s after %.1fs%s; "
                        "starting it again%s", child.index, process.pid, process.returncode,
                        ran, "" if child.ready else ", before it served",
                        " in %gs" % pause if pause else "")
            self._start_again(child, pause)

    def _set_aside(self, child: Child, process: subprocess.Popen) -> bool:
        """Whether ``child`` exited at start for a configuration error in
        the --config copy of the last SIGHUP (cli/reload.py's KeptConfig):
        said once; it starts again at once with the copy read before."""
        return not child.ready and child.kept is not None and child.kept.set_aside(
            child.copy, process.returncode, "LB process %d (pid %d)" % (child.index, process.pid))

    def _start_again(self, child: Child, pause: float) -> None:
        """Start ``child`` after ``pause`` seconds; once it serves, catch it
        up.  One that exits before it serves is left to ``_watch`` (which
        says so, once); one that cannot be run at all is tried again."""
        import gevent

        while True:
            gevent.sleep(pause)
            if self.stopping:
                return
            try:
                child.start()
            except OSError as exc:  # (it could not be run at all)
                pause = child.backoff.failed()
                log.error("LB process %d cannot be run (%s): trying again in %gs",
                          child.index, exc, pause)
                continue
            except ZcLbError:
                return  # (it exited before it served)
            self._catch_up(child)
            return

    def _catch_up(self, child: Child) -> None:
        """Give ``child``, started again, what its siblings were given while
        it started: the signals (each said), and the drains not undone."""
        assert child.process is not None
        for signum in sorted(child.missed):
            log.info("LB process %d: passing on %s, which came while it started",
                     child.index, signal.Signals(signum).name)
            child.process.send_signal(signum)
        child.missed.clear()
        self.drains.catch_up(child)

    def _ask(self, child: Child, action: str, worker: str = "") -> dict:
        """``child``'s answer to a status action (of ``worker``)."""
        return ask(child.status, timeout=self.action_timeout, action=action,
                   params={"worker": worker} if worker else {}, token=self.admin_token)

    def stop(self, timeout: float) -> None:
        """SIGTERM every child (each drains) and wait for them all."""
        self.stopping = True
        for child in self.children:  # (one being launched again is stopped with the others)
            child.launched.wait(timeout)
        for child in self.children:
            if child.process is not None and child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for child in self.children:
            if child.process is None:
                continue
            try:
                child.process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                log.warning("LB process %d did not drain in time; killing it", child.index)
                child.process.kill()
                child.process.wait()
        if self.sock is not None:
            self.sock.close()

    def send_signal(self, signum: int) -> bool:
        """Pass a signal on to every child (SIGHUP: each reads its --config
        again; SIGUSR1: each reopens its access log), or to one that is
        starting, once it serves (``_catch_up``); never exits."""
        for child in self.children:
            if child.serving:
                child.process.send_signal(signum)  # type: ignore[union-attr]
            else:
                child.missed.add(signum)
        return False

    def status(self, full: bool = True) -> dict:
        """One summed view of every child's status document.  A child that
        does not answer this time counts with its last document (marked
        ``stale``), and one that ended with its last document's counters
        (``Retired``), so that summed counters never go back.  Not ``full``
        (/healthz, the request rate's samples: often, and only totals and
        the workers' states), each child's bounded document, kept for
        nothing."""
        docs: Dict[str, dict] = {}
        stale = set()
        asked = [child.status for child in self.children if child.status is not None]
        for address in [address for address in self._last if address not in asked]:
            self.retired.add(self._last.pop(address))  # (its child is started again)
        for address, doc in each(asked, lambda address: ask(
                address, timeout=self.status_timeout, params=CHILD_QUERY if full else None)):
            if isinstance(doc, ZcLbError):  # (all asked at once: one that hangs delays none)
                docs[address] = self._last.get(address) or {"error": str(doc)}
                stale.add(address)
                continue
            docs[address] = doc
            last = self._last.get(address)
            if last is not None and last.get("pid") != doc.get("pid"):  # (the port again)
                self.retired.add(self._last.pop(address))
            if full and any(child.status == address for child in self.children):
                self._last[address] = doc  # (not one retired while it answered)
        merged = self.retired.into(merge_status(list(docs.values())))
        merged["pid"] = os.getpid()
        merged["processes"] = [
            {"index": child.index, "pid": child.process.pid if child.process else None,
             "status": child.status, "stale": child.status in stale,
             "requests": docs.get(child.status or "", {}).get("requests"),
             "in_flight": docs.get(child.status or "", {}).get("in_flight")}
            for child in self.children]
        return merged

    def action(self, name: str):
        """An action of the status address, done by every child that
        serves (all asked at once), whichever fails, the failures raised
        together (``drains.failed``: ChildUnavailable if none refused);
        one action after another, in the order they came; drains and
        enables are ``drains.Drains``'s."""
        def run(**params: str) -> dict:
            worker = params.get("worker", "")
            with self.acting:
                if name == "drain":
                    return self.drains.drain(worker, self.children)
                if name == "enable":
                    return self.drains.enable(worker, self.children)
                answers, refused = ask_each(self.children,
                                            lambda child: self._ask(child, name, worker))
            if refused:
                raise failed(name, refused)
            return merged(answers)
        return run


def run(args, argv: Sequence[str], kept: Any = None) -> int:
    """``zc-lb lb --processes N`` (N > 1).  ``kept``: the --config
    copies, for the children (cli/reload.py)."""
    from zc_lb.sockets import address_text, parse_listen
    from zc_lb.process import restart
    from zc_lb.process.service import (PidFile, hand_over, parse_listeners, read_admin_token,
                                       wait_for_signal, watch_secrets_for_children)

    (scheme, where), = parse_listeners(args)
    watch_secrets_for_children(args.secret_file, args.admin_token_file)
    listen = restart.inherited("front0", where) or parse_listen(where)
    supervisor = Supervisor(args.processes, lb_argv(argv), listen, args.log_level,
                            scheme=scheme, cwd=getattr(args, "start_dir", None), kept=kept,
                            admin_token=read_admin_token(args.admin_token_file),
                            status_timeout=args.child_status_timeout,
                            action_timeout=args.child_action_timeout)
    supervisor.start()
    status = _status_server(args, supervisor)
    log.info("%d LB processes, pids %s", len(supervisor.children),
             " ".join(str(c.process.pid) for c in supervisor.children if c.process))
    pid_file = PidFile(getattr(args, "pid_file", None))

    def stop() -> bool:
        supervisor.stop(args.drain_timeout + 5)
        if status is not None:
            status.stop(timeout=1)
        pid_file.remove()
        if kept is not None:
            kept.remove()
        return True

    def upgrade() -> bool:
        sockets, addresses = {"front0": supervisor.sock}, {"front0": where}
        if status is not None:
            sockets["status"] = status.server.socket  # type: ignore[union-attr]
            addresses["status"] = args.status
        return hand_over(args, sockets, addresses) and stop()

    def ready() -> None:
        # (ready once it could write its pid file: a new LB that could not
        # leaves the old one serving)
        try:
            pid_file.write()
        except ConfigurationError:
            stop()  # (one error, and a clean stop: the children drain, nothing is left)
            raise
        # (said once the pid file names us, and signals are handled: one
        # sent on seeing it counts)
        print("zc-lb lb listening on %s" % address_text(supervisor.address), flush=True)
        if status is not None:
            print("zc-lb status on %s:%d" % status.address, flush=True)
        restart.announce_ready()

    wait_for_signal({"SIGTERM": stop, "SIGINT": stop,
                     "SIGHUP": lambda: (kept is None or kept.take(),
                                        supervisor.send_signal(signal.SIGHUP))[1],
                     "SIGUSR1": lambda: supervisor.send_signal(signal.SIGUSR1),
                     "SIGUSR2": upgrade}, ready=ready)
    log.info("lb stopped (%d processes)", len(supervisor.children))
    return 0


def _status_server(args, supervisor: "Supervisor"):
    """The supervisor's status server (started), summing its children's
    documents, its actions reaching every child; None without --status."""
    from zc_lb.process import restart
    from zc_lb.front.server import FrontServer
    from zc_lb.process.service import lb_status_app, start_named
    from zc_lb.sockets import parse_address

    if not args.status:
        return None
    status = FrontServer(restart.inherited("status", args.status) or parse_address(args.status),
                         lb_status_app(
        supervisor.status, {name: supervisor.action(name)
                            for name in ("reset-skills", "drain", "enable")},
        lambda: supervisor.status(full=False)["requests"], supervisor.admin_token,
        lambda: sum(1 for worker in supervisor.status(full=False).get("workers", {}).values()
                    if worker.get("in_pool"))))
    try:
        start_named("--status", status.listen, status.start)
    except AddressUnavailable:
        supervisor.stop(timeout=5)  # (its children started: they drain, and end)
        raise
    return status


class Backoff:
    """When a supervisor (this one, and ``worker -w``'s) starts again a
    child that exited: at once if it ran for HEALTHY_RUN seconds or more,
    or exited well (status 0: ``--max-requests``, a SIGTERM of its own);
    else, failing at start, after a pause that doubles at each failure in
    a row, from RESTART_MIN to RESTART_MAX, and is short again once the
    child has run well.  No I/O: the supervisor sleeps."""

    def __init__(self) -> None:
        self.pause = RESTART_MIN

    def after_exit(self, ran: float, status: Optional[int]) -> float:
        """Seconds to wait before starting again a child that exited with
        ``status`` after running ``ran`` seconds."""
        if ran >= HEALTHY_RUN or status == 0:
            self.pause = RESTART_MIN
            return 0.0
        return self.failed()

    def failed(self) -> float:
        """Seconds to wait before starting again a child that failed at
        start (or could not be run at all); the next pause is twice as long."""
        pause, self.pause = self.pause, min(self.pause * 2, RESTART_MAX)
        return pause


def die_with_parent(parent: int):
    """A preexec_fn: the child gets SIGTERM (and drains) when the
    supervisor dies, however it dies, so no LB process (nor a worker of
    ``-w N``, workergroup.py) outlives it."""
    def preexec() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        except (OSError, AttributeError):
            return  # not Linux: the supervisor's SIGTERM must do
        if os.getppid() != parent:  # it died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)
    return preexec


def _discard(stream) -> None:
    for _ in stream:
        pass


def lb_argv(argv: Sequence[str]) -> List[str]:
    """The arguments after ``lb`` in a ``zc-lb [--log-level L] lb ...`` command line."""
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        i += 1 if "=" in argv[i] else 2
    if argv[i:i + 1] != ["lb"]:
        raise ConfigurationError("not a zc-lb lb command line: %r" % (list(argv),))
    return list(argv[i + 1:])

