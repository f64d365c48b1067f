"""A link's liveness, without I/O: silence, suspicion and floods of Pings.

Each side pings the other every keepalive interval and answers the
other's Pings, so a live peer is heard at least that often.  A peer
silent for SUSPECT_AFTER intervals is suspected (its owner is told, and
told again when it speaks); silent past the keepalive timeout it is
lost.  A tick that comes far later than asked means our own event loop
was blocked: the silence is then ours, and the peer is not blamed.

Rules: no I/O and no clock: the time comes in as an argument (the
caller's ``time.monotonic()``).  ``connection.Connection`` tells a
``Keepalive`` when bytes arrive (``last_received``) and how many Pings
the protocol has answered (``count_pings``), and acts in its keepalive
greenlet on what it answers.
"""

from __future__ import annotations

from zc_lb.errors import RemoteProtocolError
from zc_lb.settings import LB_SETTINGS

KEEPALIVE_INTERVAL = 1.0
SUSPECT_AFTER = 2  # keepalive intervals of silence before a peer is suspected
KEEPALIVE_TIMEOUT = LB_SETTINGS["keepalive_timeout"].default
# A peer sends a Ping a keepalive interval (a second); more than this many
# in a second is a flood, and a protocol error: answering each with a
# Pong would give one peer the loop every other connection waits for.
MAX_PINGS = 64


class Keepalive:
    """One link's liveness: when its peer was last heard, whether it is
    suspected, and how many Pings it sent lately."""

    def __init__(self, interval: float, timeout: float, now: float) -> None:
        self.interval = interval
        self.timeout = timeout
        self.last_received = now  # when the peer's bytes last came
        self.suspect = False  # silent past SUSPECT_AFTER intervals, and not heard since
        self.pings_counted = 0  # the protocol's Ping count when ``_pings_since`` began
        self._pings_since = now

    def stalled(self, slept: float, now: float) -> float:
        """How long our own loop was stuck, if a tick asked for an interval
        after ``slept`` came at ``now``, past half the timeout late (the
        silence since is ours, not the peer's, and is forgiven); else 0."""
        if now - slept > self.interval + self.timeout / 2:
            self.last_received = now
            return now - slept - self.interval
        return 0.0

    def suspicion_changed(self, silent: float) -> bool:
        """Whether ``silent`` seconds of silence make the peer suspected, or
        no longer (``suspect`` says which)."""
        if (silent > SUSPECT_AFTER * self.interval) == self.suspect:
            return False
        self.suspect = not self.suspect
        return True

    def count_pings(self, pings: int, now: float) -> None:
        """More than MAX_PINGS Pings since ``_pings_since`` (``pings``, all
        told): a flood if that was within a second (RemoteProtocolError),
        else count anew."""
        if now - self._pings_since < 1.0:
            raise RemoteProtocolError("a flood of Pings: %d in %.2fs, more than %d a second"
                                      % (pings - self.pings_counted, now - self._pings_since,
                                         MAX_PINGS))
        self.pings_counted, self._pings_since = pings, now
