"""A link's liveness, without I/O: silence, suspicion and floods of Pings.

Each side pings the other every keepalive interval and answers the
other's Pings, so a live peer is heard at least that often.  A peer
silent for SUSPECT_AFTER intervals is suspected (its owner is told, and
told again when it speaks); silent past the keepalive timeout it is
lost.  A tick that comes far later than asked means our own event loop
was blocked: that time is taken off the peer's silence.

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
        self.pings_counted = 0  # the protocol's Ping count when last counted
        self._ping_room = float(MAX_PINGS)  # Pings the peer may send now (a token bucket)
        self._pings_at = now  # when they were last counted

    def stalled(self, slept: float, now: float) -> float:
        """How long our own loop was stuck, if a tick asked for an interval
        after ``slept`` came at ``now``, more than half an interval late:
        that time is taken off the peer's silence (its Pings may wait
        unread in the socket meanwhile); else 0."""
        late = now - slept - self.interval
        if late > self.interval / 2:
            self.last_received = min(now, self.last_received + late)
            return late
        return 0.0

    def suspicion_changed(self, silent: float) -> bool:
        """Whether ``silent`` seconds of silence make the peer suspected, or
        no longer (``suspect`` says which)."""
        if (silent > SUSPECT_AFTER * self.interval) == self.suspect:
            return False
        self.suspect = not self.suspect
        return True

    def count_pings(self, pings: int, now: float) -> None:
        """The protocol has answered ``pings`` Pings, all told, by ``now``:
        a peer may send MAX_PINGS at once, and MAX_PINGS a second after
        (a token bucket); more is a flood (RemoteProtocolError), however
        the bursts are spaced."""
        room = min(float(MAX_PINGS), self._ping_room + (now - self._pings_at) * MAX_PINGS)
        self._ping_room = room - (pings - self.pings_counted)
        self.pings_counted, self._pings_at = pings, now
        if self._ping_room < 0:
            raise RemoteProtocolError("a flood of Pings: more than %d a second" % MAX_PINGS)
