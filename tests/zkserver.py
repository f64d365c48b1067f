"""A real ZooKeeper server for tests: one standalone JVM on a free port.

``ZooKeeperServer(directory).start()`` writes a zoo.cfg into
``directory``, runs ``org.apache.zookeeper.server.ZooKeeperServerMain``
from the Debian package's jar, and returns once the server answers the
``srvr`` four-letter word.  ``stop()`` ends the JVM; ``start()`` again
reuses the same port and data directory, so sessions and nodes survive,
as they do when an operator restarts ZooKeeper.  That is what the
"ZooKeeper stopped, then back" tests need.

It never skips: a missing java or jar, or a server that does not answer
in time, raises ZooKeeperServerError with the command and the tail of
the server's log.  Set ZOOKEEPER_CLASSPATH to use other jars.
"""

import os
import signal
import socket
import subprocess
import time

DEBIAN_CLASSPATH = [
    "/usr/share/java/zookeeper.jar",  # its manifest names its dependencies
    "/usr/share/java/slf4j-simple.jar",  # so the server log says something
]
MAIN = "org.apache.zookeeper.server.ZooKeeperServerMain"

CONFIG = """\
tickTime={tick_ms}
dataDir={data_dir}
clientPort={port}
clientPortAddress={host}
maxClientCnxns=0
admin.enableServer=false
4lw.commands.whitelist=srvr,ruok,stat,mntr,cons,dump
"""


class ZooKeeperServerError(Exception):
    """The test ZooKeeper could not be started."""


def free_port(host="127.0.0.1"):
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def four_letter_word(host, port, word, timeout=1.0):
    """Send a ZooKeeper four-letter word; return the answer ('' if none)."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(word.encode("ascii"))
            chunks = []
            while chunk := s.recv(4096):
                chunks.append(chunk)
            return b"".join(chunks).decode("utf-8", "replace")
    except OSError:
        return ""


class ZooKeeperServer:
    """A standalone ZooKeeper in ``directory``, on ``port`` (free if None)."""

    def __init__(self, directory, port=None, host="127.0.0.1", tick_ms=200,
                 heap="256m"):
        self.directory = os.path.abspath(directory)
        self.host = host
        self.port = port or free_port(host)
        self.tick_ms = tick_ms  # sessions may time out from 2 to 20 ticks
        self.heap = heap
        self.process = None
        self.data_dir = os.path.join(self.directory, "data")
        self.config_path = os.path.join(self.directory, "zoo.cfg")
        self.log_path = os.path.join(self.directory, "zookeeper.log")

    def __repr__(self):
        state = "running" if self.running else "stopped"
        return f"<ZooKeeperServer {self.address} {state}>"

    @property
    def address(self):
        """'host:port', the hosts string for a client (add a chroot)."""
        return f"{self.host}:{self.port}"

    @property
    def running(self):
        return self.process is not None and self.process.poll() is None

    def command(self):
        classpath = os.environ.get("ZOOKEEPER_CLASSPATH") or ":".join(
            DEBIAN_CLASSPATH)
        return [
            "java", f"-Xmx{self.heap}", "-XX:+UseSerialGC",
            "-XX:TieredStopAtLevel=1",  # starts faster; speed is moot here
            "-Dzookeeper.admin.enableServer=false",
            f"-Dorg.slf4j.simpleLogger.logFile={self.log_path}",
            "-Dorg.slf4j.simpleLogger.showDateTime=true",
            "-cp", classpath, MAIN, self.config_path,
        ]

    def start(self, timeout=30.0):
        """Start the server and wait until it serves; idempotent."""
        if self.running:
            return
        self._launch()
        self._wait_serving(self.command(), timeout)

    def config(self):
        """The zoo.cfg text."""
        return CONFIG.format(tick_ms=self.tick_ms, data_dir=self.data_dir, port=self.port,
                             host=self.host)

    def _launch(self):
        """Write the data directory and zoo.cfg, and start the JVM."""
        os.makedirs(self.data_dir, exist_ok=True)
        with open(self.config_path, "w") as f:
            f.write(self.config())
        command = self.command()
        try:
            self.process = subprocess.Popen(
                command, cwd=self.directory, stdin=subprocess.DEVNULL,
                stdout=open(self.log_path + ".out", "ab"),
                stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as e:
            raise ZooKeeperServerError(f"cannot run {command[0]}: {e}")

    def _wait_serving(self, command, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            if "Mode: standalone" in four_letter_word(self.host, self.port,
                                                      "srvr"):
                return
            time.sleep(0.05)
        self.stop()
        raise ZooKeeperServerError(
            f"ZooKeeper did not serve on {self.address} within {timeout}s\n"
            f"command: {' '.join(command)}\n{self.log_tail()}")

    def log_tail(self, lines=30):
        text = []
        for path in (self.log_path + ".out", self.log_path):
            try:
                with open(path, errors="replace") as f:
                    text.extend(f.read().splitlines()[-lines:])
            except OSError:
                pass
        return "\n".join(text)

    def stop(self, timeout=10.0):
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
                raise ZooKeeperServerError(f"{self.address} still answers")
            time.sleep(0.05)


QUORUM_MAIN = "org.apache.zookeeper.server.quorum.QuorumPeerMain"

ENSEMBLE_CONFIG = CONFIG + """\
initLimit=20
syncLimit=10
{servers}
"""


class EnsembleMember(ZooKeeperServer):
    """One server of an ``Ensemble``: QuorumPeerMain, its myid, the
    ensemble's server lines."""

    def __init__(self, directory, myid, servers, **kw):
        super().__init__(directory, **kw)
        self.myid = myid
        self.servers = servers  # the config's server.N lines, filled in by Ensemble

    def command(self):
        command = super().command()
        command[command.index(MAIN)] = QUORUM_MAIN
        return command

    @property
    def mode(self):
        """'leader', 'follower', or '' (not serving: electing, or down)."""
        for line in four_letter_word(self.host, self.port, "srvr").splitlines():
            if line.startswith("Mode: "):
                return line[len("Mode: "):].strip()
        return ""

    def config(self):
        return ENSEMBLE_CONFIG.format(tick_ms=self.tick_ms, data_dir=self.data_dir,
                                      port=self.port, host=self.host,
                                      servers="\n".join(self.servers))

    def start(self, timeout=60.0):
        """Start the JVM (``Ensemble`` waits for the quorum)."""
        if self.running:
            return
        os.makedirs(self.data_dir, exist_ok=True)
        with open(os.path.join(self.data_dir, "myid"), "w") as f:
            f.write("%d\n" % self.myid)
        self._launch()


class Ensemble:
    """``size`` ZooKeeper servers on loopback ports, one quorum: what a
    site runs, so that one server may die."""

    def __init__(self, directory, size=3, host="127.0.0.1"):
        lines = []
        self.members = []
        for myid in range(1, size + 1):
            peer, election = free_port(host), free_port(host)
            member = EnsembleMember(os.path.join(directory, "zk%d" % myid), myid, lines,
                                    host=host)
            lines.append("server.%d=%s:%d:%d" % (myid, host, peer, election))
            self.members.append(member)

    @property
    def hosts(self):
        """The client's hosts string: every member."""
        return ",".join(member.address for member in self.members)

    def start(self, timeout=60.0):
        """Start every member; return once one leads and the rest follow."""
        for member in self.members:
            member.start()
        self.wait_for_quorum(len(self.members), timeout)

    def wait_for_quorum(self, serving, timeout=60.0):
        """Wait until ``serving`` members serve, one of them the leader."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            modes = [member.mode for member in self.members if member.running]
            if modes.count("leader") == 1 and modes.count("follower") == serving - 1:
                return
            time.sleep(0.1)
        raise ZooKeeperServerError("no quorum of %d within %gs: %s\n%s" % (
            serving, timeout, [m.mode for m in self.members],
            "\n".join(m.log_tail(10) for m in self.members)))

    def leader(self):
        return next(member for member in self.members if member.mode == "leader")

    def stop(self):
        for member in self.members:
            member.stop()
