"""Real ZooKeeper servers for tests: the standalone ``ZooKeeperServer``
of zc_lb.testing (one JVM on a free port, shared by the session), and
``Ensemble``, a quorum of them, for the tests where one server dies.

They never skip: a missing java or jar, or a server that does not answer
in time, raises ZooKeeperServerError with the command and the tail of
the server's log.  Set ZOOKEEPER_CLASSPATH to use other jars.
"""

import os
import time

from zc_lb.testing import (ZOOKEEPER_CONFIG, ZooKeeperServer, ZooKeeperServerError,
                           four_letter_word, free_port)

__all__ = ["Ensemble", "ZooKeeperServer", "ZooKeeperServerError", "free_port"]

QUORUM_MAIN = "org.apache.zookeeper.server.quorum.QuorumPeerMain"

ENSEMBLE_CONFIG = ZOOKEEPER_CONFIG + """\
initLimit=20
syncLimit=10
{servers}
"""


class EnsembleMember(ZooKeeperServer):
    """One server of an ``Ensemble``: QuorumPeerMain, its myid, the
    ensemble's server lines."""

    main = QUORUM_MAIN

    def __init__(self, directory, myid, servers, **kw):
        super().__init__(directory, **kw)
        self.myid = myid
        self.servers = servers  # the config's server.N lines, filled in by Ensemble

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
        self.launch()


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
