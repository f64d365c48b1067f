"""What keeping a key where its data is buys, measured: the affinity
policy's evidence for holding a key at a busy owner.

Theory of operation
-------------------

Affinity pays only where a worker serves a key faster once it has
served it before: its data is in that worker's caches.  An application
without such caches (a CPU-bound view, a request that waits on a remote
service) serves every request as fast anywhere, and a key held at a busy
owner while another worker idles is time lost for nothing.  So the pool
measures it.  Each request the affinity policy places is *home* (the
worker the key last went to or, when the LB keeps no book of keys
(``stick`` 0), its rendezvous owner), *away* (any other worker, for a
key that has a home), or neither (a key no worker has served yet: cold
everywhere, it tells nothing).  The worker says how long the application
took for each response (its service time, without the worker's queue;
a 5xx says nothing: a failure teaches nothing),
and the pool keeps, per class, decayed means of the service times of
home and of away requests.  Their ratio is the class's *gain*: how many
times longer a request takes where its key's data is not.

A class's gain is known once it has ``MIN_SAMPLES`` of each kind;
before that the pool's gain stands for it (a decayed mean of each away
request's time over its class's home mean, over all classes); before
that nothing is known and the policy keeps its keys as it always did.
The policy (``Placement.weighed``) then weighs a key's home against the
least busy worker as a request's expected time there:
``(backlog + 1) * cost``, the cost being ``gain`` times longer away.
With a gain of 1 that is least backlog, ties going home; with a gain
of 10 a key waits behind nine requests at home rather than load its data
elsewhere.  A key with little data (a hot page) is served as fast by a
second worker after its first request there: its gain falls and it
spreads over as many workers as its load needs.

An application that knows whether its cache had what a request needed
says so (``environ.CACHE``, carried in the worker's ready response head),
and then a hit counts as a home request and a miss as an away one,
wherever the request was placed: where the data really was, whatever
the book says, and whatever waits the times include.

First visits.  A request for a key no worker has served, in a class of
first visits (``classstats.first_visits``), is neither home nor away:
its time counts at the class's members or elsewhere, and where it takes
``SHARED_GAIN`` times longer elsewhere the class's pages share data its
members hold (``shares_data``), and its first visits stay with them
(``Placement._first_visit``).  Measured only while some go elsewhere:
once they stay, none does, so after ``STALE_AFTER`` first visits at
its members and none elsewhere the class forgets the measure
elsewhere, and its next few first visits go out to take it again.  A
measure taken while every cache was cold, or before the application
changed, so does not keep them among the members for good, for about
one first visit in two hundred sent out to check.  The pool sums the
same times over every class: first visits as fast elsewhere as at
their members (``pages_apart``) say that the application's pages share
nothing their class's members hold (ZODB's pages of objects of their
own), and then a new key of any class goes as a first visit does
(``routing/placement.py``).

Weak spots, admitted.  A thread-mode worker's service time includes the
time its request waited for the interpreter behind the worker's other
threads, and any wait inside the application behind its other requests
that the pool did not see (worker/concurrency.py), so home, usually the busier
worker, looks slower than it is: that errs toward spreading, never
toward pinning.  A home whose data
was evicted looks like away.  Only a lone LB measures, or several whose
books the workers' relays keep alike (``routing/affinity.py``, "Several LBs"):
behind several without, a key's home is only its rendezvous owner,
which the other LBs' moves leave without its data, and gains read far
too low.  Classes whose requests never go away keep
the pool's gain, which a site of mixed classes blends.  So does the
pool's first-visit gain: where some classes' pages share data and
others' do not, the new keys of a class that shares go out, once the
pool reads its pages apart, until its own first visits prove slower
elsewhere (eight of them).
"""

from __future__ import annotations

import math
from typing import Final, Optional, Union

from zc_lb.routing.classstats import ClassStats

MIN_SAMPLES: Final = 8.0  # decayed samples of each kind before a gain counts
CLASS_DECAY: Final = 1.0 - 1.0 / 64  # per sample of the class: its last hundred or so
POOL_DECAY: Final = 1.0 - 1.0 / 256  # per away sample of any class
# how ``choose`` placed a request (``AffinityPool.served`` passes it on):
# away from its key's home or at it (as False and True); a first visit
# (``classstats.first_visits``) at a member of its class, or elsewhere
PLACED_AWAY: Final = 0
PLACED_HOME: Final = 1
FIRST_AT_MEMBER: Final = 2
FIRST_ELSEWHERE: Final = 3
SHARED_GAIN: Final = 1.5  # a first visit this many times slower elsewhere: its class shares data
STALE_AFTER: Final = 2048  # first visits at members, none elsewhere: the measure there is old
# An infinite ratio as the status document shows it (JSON has no such
# number, and its null says "not measured yet")
INFINITE: Final = "Infinity"


def _elsewhere_ratio(member_time: float, member_count: float, elsewhere_time: float,
                     elsewhere_count: float) -> Optional[float]:
    """How many times longer first visits took elsewhere than at their
    class's members, from decayed sums of their times and counts; None
    before ``MIN_SAMPLES`` of each."""
    if member_count < MIN_SAMPLES or elsewhere_count < MIN_SAMPLES:
        return None
    if member_time <= 0.0:
        return 1.0 if elsewhere_time <= 0.0 else float("inf")
    return (elsewhere_time / elsewhere_count) / (member_time / member_count)


def shown_ratio(ratio: Optional[float]) -> Union[float, str, None]:
    """A gain as the status document shows it: rounded, ``INFINITE`` (the
    time at home measured none), or None (not measured yet)."""
    if ratio is None:
        return None
    return INFINITE if ratio == math.inf else round(ratio, 3)


class Locality:
    """Service times at home and away, per class and for the pool."""

    __slots__ = ("ratio", "weight", "ratio_elsewhere", "weight_elsewhere",
                 "member_time", "member_count", "elsewhere_time", "elsewhere_count")

    def __init__(self) -> None:
        self.ratio = 0.0  # decayed sum of away time over the class's home mean
        self.weight = 0.0  # decayed count of those
        # The same sums of the other processes of --processes (routing/siblings.py),
        # which the pool's gain counts too: each sees a part of the requests.
        self.ratio_elsewhere = 0.0
        self.weight_elsewhere = 0.0
        # decayed service times and counts of first visits of every class at
        # their class's members and elsewhere (``pages_apart``)
        self.member_time = self.member_count = 0.0
        self.elsewhere_time = self.elsewhere_count = 0.0

    def observe(self, stats: ClassStats, placed: int, elapsed: float) -> None:
        """A request of ``stats``'s class ``placed`` at home
        (``PLACED_HOME`` or True), away (``PLACED_AWAY`` or False), or as a
        first visit (at a member or elsewhere) took ``elapsed`` seconds of
        the application's time."""
        if not elapsed >= 0.0:  # (NaN, or a clock that went back)
            return
        if placed >= FIRST_AT_MEMBER:  # (the class's, and the pool's over every class)
            if placed == FIRST_AT_MEMBER:
                self.member_time = self.member_time * POOL_DECAY + elapsed
                self.member_count = self.member_count * POOL_DECAY + 1.0
                stats.member_time = stats.member_time * CLASS_DECAY + elapsed
                stats.member_count = stats.member_count * CLASS_DECAY + 1.0
                stats.member_run += 1
                if stats.member_run >= STALE_AFTER:
                    stats.member_run = 0
                    stats.elsewhere_time = stats.elsewhere_count = 0.0
            else:
                self.elsewhere_time = self.elsewhere_time * POOL_DECAY + elapsed
                self.elsewhere_count = self.elsewhere_count * POOL_DECAY + 1.0
                stats.member_run = 0
                stats.elsewhere_time = stats.elsewhere_time * CLASS_DECAY + elapsed
                stats.elsewhere_count = stats.elsewhere_count * CLASS_DECAY + 1.0
            return
        if placed:
            stats.home_time = stats.home_time * CLASS_DECAY + elapsed
            stats.home_count = stats.home_count * CLASS_DECAY + 1.0
            return
        stats.away_time = stats.away_time * CLASS_DECAY + elapsed
        stats.away_count = stats.away_count * CLASS_DECAY + 1.0
        if stats.home_count >= MIN_SAMPLES and stats.home_time > 0.0:
            mean = stats.home_time / stats.home_count
            self.ratio = self.ratio * POOL_DECAY + elapsed / mean
            self.weight = self.weight * POOL_DECAY + 1.0

    def gain(self, stats: Optional[ClassStats]) -> Optional[float]:
        """How many times longer the class's requests take away from
        their key's home: the class's own ratio once known, else the
        pool's (for a request of no ``stats``, the pool's), else None
        (nothing measured yet)."""
        own = None if stats is None else self.class_gain(stats)
        return own if own is not None else self.pool_gain()

    @staticmethod
    def shares_data(stats: ClassStats) -> bool:
        """Whether the first visits of ``stats``'s class (keys no worker has
        served) take ``SHARED_GAIN`` times longer away from its members than
        at them, ``MIN_SAMPLES`` of each measured: its keys share data its
        members hold (a site's templates, say), which each other worker
        would load and keep too."""
        ratio = _elsewhere_ratio(stats.member_time, stats.member_count,
                                 stats.elsewhere_time, stats.elsewhere_count)
        return ratio is not None and ratio > SHARED_GAIN

    def pages_apart(self) -> bool:
        """Whether first visits, over every class, proved as fast away from
        their class's members as at them (``first_visit_gain`` at most
        ``SHARED_GAIN``): the application's pages share nothing the
        members hold."""
        ratio = self.first_visit_gain()
        return ratio is not None and ratio <= SHARED_GAIN

    def first_visit_gain(self) -> Optional[float]:
        """How many times longer first visits of every class took away from
        their class's members than at them, or None before ``MIN_SAMPLES``
        of each."""
        return _elsewhere_ratio(self.member_time, self.member_count,
                                self.elsewhere_time, self.elsewhere_count)

    @staticmethod
    def class_gain(stats: ClassStats) -> Optional[float]:
        """The class's own gain, or None before ``MIN_SAMPLES`` of each kind."""
        if stats.away_count < MIN_SAMPLES or stats.home_count < MIN_SAMPLES:
            return None
        if stats.home_time <= 0.0:
            return 1.0 if stats.away_time <= 0.0 else float("inf")
        return (stats.away_time / stats.away_count) / (stats.home_time / stats.home_count)

    def pool_gain(self) -> Optional[float]:
        """The gain over every class, or None before ``MIN_SAMPLES``."""
        weight = self.weight + self.weight_elsewhere
        if weight < MIN_SAMPLES:
            return None
        return (self.ratio + self.ratio_elsewhere) / weight

    def __repr__(self) -> str:
        gain = self.pool_gain()
        return "<Locality gain=%s>" % ("unknown" if gain is None else "%.2f" % gain)
