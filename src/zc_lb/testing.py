"""Test tools, part of the library: real processes on loopback, a
throwaway ZooKeeper, and an in-memory LB<->worker connection pair.

``WorkerProcess`` and ``LBProcess`` run ``zc-lb worker`` / ``zc-lb lb`` as
real subprocesses, wait for the line that says where they listen, and
stop them (SIGTERM, or SIGKILL to simulate a crash).  ``ZooKeeperServer``
runs a standalone ZooKeeper on a free port in a directory of its own (the
test suite's, and ``zc-lb compare --lbs N``'s).  ``connection_pair`` joins
an LB-side and a worker-side ``Connection`` over a socketpair, for
protocol tests that need no ports.  ``cpu_times``, ``cpu_used`` and
``with_children`` count the CPU time processes took (``make bench``,
``zc-lb compare``).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def cpu_times(pids: Sequence[int]) -> Dict[int, float]:
    """Each of ``pids`` still running -> its utime + stime in seconds,
    from /proc."""
    times = {}
    for pid in pids:
        try:
            with open("/proc/%d/stat" % pid) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # (ended)
        times[pid] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return times


def cpu_used(before: Dict[int, float], after: Dict[int, float]) -> float:
    """The CPU seconds used between two ``cpu_times`` readings: what each
    process running at the second used since the first, all it used if
    it started since (a server that replaced a worker); a process that
    ended between them counts nothing."""
    return sum(seconds - before.get(pid, 0.0) for pid, seconds in after.items())


def with_children(pids: Sequence[int]) -> List[int]:
    """``pids`` and the processes they started, and those started in turn
    (``zc-lb lb --processes``'s children; gunicorn's arbiter, which
    serves nothing itself, and its worker), from /proc."""
    found, todo = [], list(pids)
    while todo:
        pid = todo.pop()
        if pid in found:
            continue
        found.append(pid)
        try:
            for task in os.listdir("/proc/%d/task" % pid):
                with open("/proc/%d/task/%s/children" % (pid, task)) as f:
                    todo.extend(int(child) for child in f.read().split())
        except OSError:
            pass  # (ended)
    return found


class ProcessError(RuntimeError):
    """A process we started did not come up as it should."""


def wait_for_port(address: str, process: subprocess.Popen, timeout: float = 10.0) -> None:
    """Wait until ``address`` accepts connections; ProcessError if
    ``process`` exits first or nothing listens within ``timeout``."""
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ProcessError("%s exited with status %s before listening on %s" % (
                " ".join(str(a) for a in process.args[:5]), process.returncode, address))
        try:
            socket.create_connection((host, int(port)), 0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise ProcessError("nothing listens on %s after %.0f s" % (address, timeout))


def stop_process(process: subprocess.Popen, timeout: float = 10.0) -> None:
    """Terminate a process we started; kill it if it lingers."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout)
    if process.stdout is not None:
        process.stdout.close()


class Process:
    """A zc-lb subprocess that announces its address on its first line."""

    command = ""

    def __init__(self, args: Sequence[str], env: Optional[Dict[str, str]] = None,
                 stderr=None, cwd: Optional[str] = None) -> None:
        self.args = list(args)
        self.env = env
        self.cwd = cwd
        self.stderr = stderr
        self.process: Optional[subprocess.Popen] = None
        self.address = ""
        self.lines: List[str] = []

    def start(self, timeout: float = 30.0) -> "Process":
        """Start the process and wait until it listens."""
        return self.launch().wait_started(timeout)

    def launch(self) -> "Process":
        """Start the process; ``wait_started`` waits until it listens (so
        that several start at once: each takes half a second to import)."""
        env = dict(os.environ)
        env.update(self.env or {})
        self.process = subprocess.Popen(
            [sys.executable, "-m", "zc_lb.cli", self.command] + self.args,
            stdout=subprocess.PIPE, stderr=self.stderr, env=env, text=True, cwd=self.cwd)
        return self

    def wait_started(self, timeout: float = 30.0) -> "Process":
        """Wait until the launched process says where it listens."""
        line = self._first_line(timeout)
        prefix = "zc-lb %s listening on " % self.command
        if not line.startswith(prefix):
            self.kill()
            raise RuntimeError("%s did not start: %r" % (self.command, line))
        self.address = line[len(prefix):].strip()
        threading.Thread(target=self._drain, daemon=True).start()
        return self

    def said(self, prefix: str, timeout: float = 10.0) -> str:
        """The address that ends the first line the process printed
        starting with ``prefix`` (e.g. "zc-lb status on "): an address it
        chose itself (port 0) cannot be taken before it binds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if line.startswith(prefix):
                    return line[len(prefix):].strip()
            time.sleep(0.02)
        raise RuntimeError("%s never said %r" % (self.command, prefix))

    def _first_line(self, timeout: float) -> str:
        assert self.process is not None and self.process.stdout is not None
        result: List[str] = []
        reader = threading.Thread(target=lambda: result.append(self.process.stdout.readline()),
                                  daemon=True)
        reader.start()
        reader.join(timeout)
        return result[0] if result else ""

    def _drain(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    @property
    def url(self) -> str:
        return "http://%s" % self.address

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM, and wait for the exit status."""
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)

    def kill(self) -> None:
        """SIGKILL: a crash, as far as everyone else can tell."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def rss(self) -> int:
        """Resident set size in bytes, from /proc."""
        with open("/proc/%d/statm" % self.pid) as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def __enter__(self) -> "Process":
        return self.start()

    def __exit__(self, *exc) -> None:
        try:
            self.terminate(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()

    def __repr__(self) -> str:
        return "<%s %s pid=%s>" % (type(self).__name__, self.address or "unstarted",
                                   self.process.pid if self.process else None)


def start_all(processes: Sequence[Process], timeout: float = 30.0) -> List[Process]:
    """Start ``processes`` at once, and wait until each listens."""
    for process in processes:
        process.launch()
    try:
        return [process.wait_started(timeout) for process in processes]
    except BaseException:
        for process in processes:
            process.kill()
        raise


class WorkerProcess(Process):
    """``zc-lb worker APP ARGS...``"""

    command = "worker"

    def __init__(self, app: str, *args: str, **kw) -> None:
        super().__init__([app] + list(args), **kw)


class LBProcess(Process):
    """``zc-lb lb --listen 127.0.0.1:0 --worker W... ARGS...``"""

    command = "lb"

    def __init__(self, workers: Sequence[str], *args: str, **kw) -> None:
        argv = ["--listen", "127.0.0.1:0"]
        for worker in workers:
            argv += ["--worker", worker]
        super().__init__(argv + list(args), **kw)



# -- a throwaway ZooKeeper --------------------------------------------------

ZOOKEEPER_CLASSPATH = [
    "/usr/share/java/zookeeper.jar",  # (Debian's package) its manifest names its dependencies
    "/usr/share/java/slf4j-simple.jar",  # so the server log says something
]
ZOOKEEPER_MAIN = "org.apache.zookeeper.server.ZooKeeperServerMain"

ZOOKEEPER_CONFIG = """\
tickTime={tick_ms}
dataDir={data_dir}
clientPort={port}
clientPortAddress={host}
maxClientCnxns=0
admin.enableServer=false
4lw.commands.whitelist=srvr,ruok,stat,mntr,cons,dump
"""


class ZooKeeperServerError(ProcessError):
    """A throwaway ZooKeeper could not be started; the message says why."""


def four_letter_word(host: str, port: int, word: str, timeout: float = 1.0) -> str:
    """Send a ZooKeeper four-letter word; the answer ('' if none)."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(word.encode("ascii"))
            chunks = []
            while chunk := sock.recv(4096):
                chunks.append(chunk)
            return b"".join(chunks).decode("utf-8", "replace")
    except OSError:
        return ""


class ZooKeeperServer:
    """A standalone ZooKeeper in ``directory``, on ``port`` (free if None).

    ``start()`` writes a zoo.cfg into ``directory``, runs
    ``ZooKeeperServerMain`` from Debian's ``zookeeper`` package (or the
    jars ZOOKEEPER_CLASSPATH names), and returns once the server answers
    the ``srvr`` four-letter word.  ``stop()`` ends the JVM; ``start()``
    again reuses the same port and data directory, so sessions and nodes
    survive, as they do when an operator restarts ZooKeeper.  A missing
    java or jar, or a server that does not answer in time, raises
    ZooKeeperServerError with the command and the tail of the server's log.
    """

    main = ZOOKEEPER_MAIN

    def __init__(self, directory: str, port: Optional[int] = None, host: str = "127.0.0.1",
                 tick_ms: int = 200, heap: str = "256m") -> None:
        self.directory = os.path.abspath(directory)
        self.host = host
        self.port = port or free_port(host)
        self.tick_ms = tick_ms  # sessions may time out from 2 to 20 ticks
        self.heap = heap
        self.process: Optional[subprocess.Popen] = None
        self.data_dir = os.path.join(self.directory, "data")
        self.config_path = os.path.join(self.directory, "zoo.cfg")
        self.log_path = os.path.join(self.directory, "zookeeper.log")

    def __repr__(self) -> str:
        return "<ZooKeeperServer %s %s>" % (self.address,
                                            "running" if self.running else "stopped")

    @property
    def address(self) -> str:
        """'host:port', the hosts string for a client (add a chroot)."""
        return "%s:%d" % (self.host, self.port)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def command(self) -> List[str]:
        classpath = os.environ.get("ZOOKEEPER_CLASSPATH") or ":".join(ZOOKEEPER_CLASSPATH)
        return [
            "java", "-Xmx" + self.heap, "-XX:+UseSerialGC",
            "-XX:TieredStopAtLevel=1",  # starts faster; speed is moot here
            "-Dzookeeper.admin.enableServer=false",
            "-Dorg.slf4j.simpleLogger.logFile=" + self.log_path,
            "-Dorg.slf4j.simpleLogger.showDateTime=true",
            "-cp", classpath, self.main, self.config_path,
        ]

    def start(self, timeout: float = 30.0) -> None:
        """Start the server and wait until it serves; idempotent."""
        if self.running:
            return
        self.launch()
        self._wait_serving(timeout)

    def config(self) -> str:
        """The zoo.cfg text."""
        return ZOOKEEPER_CONFIG.format(tick_ms=self.tick_ms, data_dir=self.data_dir,
                                       port=self.port, host=self.host)

    def launch(self) -> None:
        """Write the data directory and zoo.cfg, and start the JVM."""
        os.makedirs(self.data_dir, exist_ok=True)
        with open(self.config_path, "w") as f:
            f.write(self.config())
        command = self.command()
        try:
            with open(self.log_path + ".out", "ab") as out:
                self.process = subprocess.Popen(
                    command, cwd=self.directory, stdin=subprocess.DEVNULL, stdout=out,
                    stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as e:
            raise ZooKeeperServerError("cannot run %s: %s (ZooKeeper needs java and "
                                       "Debian's zookeeper package)" % (command[0], e))

    def _wait_serving(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                break
            if "Mode: standalone" in four_letter_word(self.host, self.port, "srvr"):
                return
            time.sleep(0.05)
        self.stop()
        raise ZooKeeperServerError("ZooKeeper did not serve on %s within %gs\ncommand: %s\n%s" % (
            self.address, timeout, " ".join(self.command()), self.log_tail()))

    def log_tail(self, lines: int = 30) -> str:
        text: List[str] = []
        for path in (self.log_path + ".out", self.log_path):
            try:
                with open(path, errors="replace") as f:
                    text.extend(f.read().splitlines()[-lines:])
            except OSError:
                pass
        return "\n".join(text)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server (clients see the connection drop); idempotent."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        # The port is free once nothing answers on it.
        deadline = time.monotonic() + timeout
        while four_letter_word(self.host, self.port, "ruok", 0.2):
            if time.monotonic() > deadline:
                raise ZooKeeperServerError("%s still answers" % self.address)
            time.sleep(0.05)

def connection_pair(lb_handler, worker_handler, secret: Optional[bytes] = None,
                    worker_secret: Optional[bytes] = None, **kw) -> Tuple:
    """An LB-side and a worker-side Connection joined by a socketpair,
    handshaken and started (gevent)."""
    import gevent
    import gevent.socket

    from zc_lb.wire.connection import Connection

    a, b = gevent.socket.socketpair()
    lb = Connection(a, "lb", lb_handler, peer="worker", secret=secret, **kw)
    worker = Connection(b, "worker", worker_handler, peer="lb",
                        secret=secret if worker_secret is None else worker_secret, **kw)
    jobs = [gevent.spawn(lb.handshake, 5), gevent.spawn(worker.handshake, 5)]
    gevent.joinall(jobs, raise_error=True)
    lb.start()
    worker.start()
    return lb, worker


def read_body(exchange, timeout: Optional[float] = 5.0) -> bytes:
    """Receive body frames up to End, granting credit as a real reader does."""
    from zc_lb.wire.frames import End

    body = b""
    while True:
        message = exchange.receive(timeout)
        if isinstance(message, End):
            return body
        body += message.data
        exchange.consumed(len(message.data))


def read_response(exchange, timeout: Optional[float] = 5.0):
    """(Response, body) of an exchange, on the LB side."""
    from zc_lb.wire.frames import Response

    start = exchange.receive(timeout)
    assert isinstance(start, Response), start
    if start.end:
        return start, start.body
    if start.body:
        exchange.consumed(len(start.body))
    return start, start.body + read_body(exchange, timeout)


def write_text_app(path, text: str) -> None:
    """Write a module at ``path`` whose ``app`` answers ``text`` as
    text/plain, with a modification time past any before (for the tests
    of ``--reload``, which looks at it)."""
    with open(path, "w") as f:
        f.write("def app(environ, start_response):\n"
                "    start_response('200 OK', [('Content-Type', 'text/plain')])\n"
                "    return [%r]\n" % text.encode())
    later = time.time() + 5
    os.utime(path, (later, later))


def read_until_closed(sock) -> bytes:
    """All a socket receives until its peer closes it."""
    received = b""
    while True:
        data = sock.recv(65536)
        if not data:
            return received
        received += data


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.02,
             message: str = "condition") -> None:
    """Poll ``predicate`` until true; AssertionError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for %s" % message)
        time.sleep(interval)


def http_get(address: str, path: str = "/", host: str = "a.example",
             timeout: float = 20.0) -> Tuple[int, str]:
    """(status, body as text) of one GET on a new connection to HOST:PORT."""
    import http.client

    connection = http.client.HTTPConnection(*address.rsplit(":", 1), timeout=timeout)
    try:
        connection.request("GET", path, headers={"Host": host})
        response = connection.getresponse()
        return response.status, response.read().decode()
    finally:
        connection.close()
