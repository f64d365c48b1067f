"""What the affinity policy sees of classes and keys, in bounded memory.

A key is hashed alike on every LB (``stable_hash``, ``mix``), so every LB
that has the same résumés gives it the same owner (``rendezvous_weight``).
A class's footprint, its distinct keys over the last one or two windows
of requests, is a k-minimum-values ``Sketch``: the ``SKETCH_SIZE``
smallest hashes seen, from which the number of distinct ones follows with
an error of about 1/sqrt(k).  ``ClassStats`` holds, per class, what the
LB sees of it: its decayed request count, its footprint, its members as
last worked out, the floors of the workers that joined it while starting
(``routing/slowstart.py``) or followed its moved keys
(``routing/relearn.py``), and the hashes of the keys requested
(``KeyHashes``: hashed once; counted in the sketches again, a key
changes nothing).  These are plain records and functions: the pool
(``affinity.AffinityPool``) and its parts keep them and act on them.
"""

from __future__ import annotations

from bisect import bisect_left
import hashlib
import math
from typing import Dict, Final, List, Optional, Tuple

from zc_lb.routing.pool import PoolWorker

# (Final: constants in compiled code, see routing/affinity.py; PRIOR stays plain,
# for the tests to change)
MASK64: Final = (1 << 64) - 1
SKETCH_SIZE: Final = 64  # k of the k-minimum-values sketch: ~1/sqrt(k) error
UNIT: Final = float(1 << 53)
LEAST_DRAW: Final = 2.0 ** -54  # -ln(1 - 2**-54), the draw of the largest u
# (k - 1) * 2**64, over the k-th smallest hash plus one, estimates distinct
# hashes; a float over an int, compiled, is worked out on objects: the
# int is made a float first, as Python does
SPAN: Final = (SKETCH_SIZE - 1) * float(MASK64)
PRIOR = 16  # requests and keys per worker before shares and footprints count
VISITS_DECAY: Final = 1.0 - 1.0 / 256  # per request of the class: its last few hundred
FIRST_VISITS: Final = 0.5  # of them for keys the book did not know: a class of first visits


def stable_hash(text: str) -> int:
    """A 64-bit hash of ``text``, the same in every process (unlike hash())."""
    return int.from_bytes(hashlib.blake2b(text_bytes(text), digest_size=8).digest(), "big")


def text_bytes(text: str) -> bytes:
    """``text`` as bytes to hash: UTF-8, a byte that ``surrogateescape``
    decoding kept as a surrogate given back, any other lone surrogate (a
    classifier's key may hold one) encoded as UTF-8 would if it could."""
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass")


def mix(x: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit function of ``x``."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


# Remembered hashes are kept in slots by their low bits, a newer one
# taking its slot from an older (a direct-mapped cache).  A dict cleared
# when full held up its request 1.5-4 ms once every 11,000 requests under
# a flood of new keys, and took the hot keys with it; forgetting its
# oldest entries a few at a time held up 1 request in 3,000 for 0.5-1 ms.
# Final lists: compiled, a C global each, where a plain module name is
# looked up in the module's dict every time.  (An input and its value are
# two stores: the pools run on one thread, the LB's loop.)
MEMORY_SLOTS: Final = 1 << 15  # remembered mixes, and draws: hot keys' hashes
_SLOT: Final = MEMORY_SLOTS - 1
# (each slot starts as 0's: x lands in x's slot, so no other x is taken for 0)
_MIX_INPUTS: Final[List[int]] = [0] * MEMORY_SLOTS
_MIXES: Final[List[int]] = [mix(0)] * MEMORY_SLOTS


def mixed(x: int) -> int:
    """``mix(x)``, remembered: a pool hashes every request's key twice,
    and hot keys come back (an index instead of 64-bit arithmetic on
    Python integers, 0.75 us)."""
    slot = x & _SLOT
    if _MIX_INPUTS[slot] == x:
        return _MIXES[slot]
    result = mix(x)
    _MIX_INPUTS[slot] = x
    _MIXES[slot] = result
    return result


def rendezvous_weight(key_hash: int, salt: int, score: float) -> float:
    """Weighted rendezvous: the owner of a key is the highest ``score/-ln(u)``."""
    return score / rendezvous_draw(key_hash ^ salt)


def draw(x: int) -> float:
    """``-ln(u)`` for the uniform ``u`` in (0, 1) that ``x`` (a key's hash
    xor a worker's salt) draws."""
    result = -math.log(((mix(x) >> 11) + 0.5) / UNIT)
    if result <= 0.0:  # (u of 1 - 2**-54 rounds to 1.0: its draw, not -0.0)
        result = LEAST_DRAW
    return result


_DRAW_INPUTS: Final[List[int]] = [0] * MEMORY_SLOTS
_DRAWS: Final[List[float]] = [draw(0)] * MEMORY_SLOTS


def rendezvous_draw(x: int) -> float:
    """``draw(x)``, remembered, as a pool computes it for every member on
    every request and hot keys come back: an index instead of a mix and a
    logarithm."""
    slot = x & _SLOT
    if _DRAW_INPUTS[slot] == x:
        return _DRAWS[slot]
    result = draw(x)
    _DRAW_INPUTS[slot] = x
    _DRAWS[slot] = result
    return result


class Sketch:
    """Distinct values seen, estimated from the k smallest 64-bit hashes."""

    __slots__ = ("smallest",)

    def __init__(self) -> None:
        self.smallest: List[int] = []

    def add(self, value: int) -> bool:
        """Note a hash; whether the estimate changed."""
        smallest = self.smallest
        if len(smallest) >= SKETCH_SIZE and value >= smallest[-1]:
            return False
        i = bisect_left(smallest, value)
        if i < len(smallest) and smallest[i] == value:
            return False
        smallest.insert(i, value)
        if len(smallest) > SKETCH_SIZE:
            smallest.pop()
        return True

    def estimate(self) -> float:
        """How many distinct values were added."""
        smallest = self.smallest
        if len(smallest) < SKETCH_SIZE:
            return float(len(smallest))
        return SPAN / float(smallest[-1] + 1)  # (float(): see SPAN)


class Footprint:
    """Distinct keys over the last one or two windows of the pool."""

    __slots__ = ("window", "current", "previous")

    def __init__(self, window: int) -> None:
        self.window = window  # the pool's window number this one counts
        self.current = Sketch()
        self.previous = 0.0  # the last full window's estimate

    def add(self, value: int, window: int) -> bool:
        """Note a key hash seen in pool window ``window``; whether the
        estimate may have changed."""
        if window != self.window:
            self.previous = (self.current.estimate()
                             if window == self.window + 1 else 0.0)
            self.current = Sketch()
            self.window = window
        smallest = self.current.smallest
        if len(smallest) >= SKETCH_SIZE and value >= smallest[-1]:
            return False  # (most keys: not among the smallest, and no call)
        return self.current.add(value)

    def estimate(self, window: int) -> float:
        """Distinct keys, as of pool window ``window``."""
        if window > self.window + 1:
            return 0.0
        if window == self.window + 1:
            return self.current.estimate()
        return max(self.previous, self.current.estimate())



# A key's hash in its class and its hash in the book, as one number:
# ``key_hash | book_hash << 64``.  A dict of numbers is never tracked by
# Python's cyclic collector, where one of tuples is tracked again by each
# tuple put in it until a full pass, and then walked whole, up to 65,536
# keys, in each of the collector's passes until then.
KeyHashes = int


class ClassStats:
    """What the LB sees of one class: its decayed request count, its keys."""

    __slots__ = ("count", "seen", "footprint", "salt", "members", "uses", "version",
                 "joins", "holders", "held", "floors", "fresh", "moved", "following",
                 "senders", "reset", "work", "cost", "key_width", "extra", "pressure",
                 "home_time", "home_count", "away_time", "away_count", "keys",
                 "first_visits", "member_time", "member_count", "elsewhere_time",
                 "elsewhere_count", "member_run")

    def __init__(self, rclass: str, window: int, seed: int = 0) -> None:
        self.members: Optional[Dict[PoolWorker, float]] = None  # as last worked out
        self.uses = 0  # requests since the members were worked out
        self.version = -1  # the pool's skills_version then
        self.joins = 0  # times its members grew in number (``Members.of``)
        # the members its keys were last counted on (``Members.held``),
        # and how many keys each was counted to hold
        self.holders: List[PoolWorker] = []
        self.held = 0.0
        self.count = 0.0  # decayed requests, as of pool request ``seen``
        self.seen = 0
        self.work = 0.0  # decayed seconds of work, as of ``seen``
        self.cost: Optional[float] = None  # seconds a request takes, from résumés
        self.key_width = 0  # the workers its keys last asked for (``Members.widths``)
        self.extra = 0  # members it has over its width, for its pressure (``Members._widen``)
        self.pressure = 1.0  # its members' mean backlog over the pool's, decayed
        # decayed service times and counts of its requests placed where
        # their key last went and elsewhere (``routing/locality.py``)
        self.home_time = self.home_count = 0.0
        self.away_time = self.away_count = 0.0
        # the share of its requests for keys the book did not know, a mean
        # decayed from none (``first_visits``)
        self.first_visits = 0.0
        # and the decayed service times and counts of its first visits at
        # its members and at other workers (``routing/locality.py``)
        self.member_time = self.member_count = 0.0
        self.elsewhere_time = self.elsewhere_count = 0.0
        self.member_run = 0  # first visits at its members since one elsewhere
        self.footprint = Footprint(window)
        # keys requested -> their hashes, remembered (``Members.observe``)
        self.keys: Dict[str, KeyHashes] = {}
        self.salt = stable_hash(rclass) ^ seed
        # workers that joined while starting -> pool request when they did
        self.floors: Optional[Dict[PoolWorker, float]] = None
        # sampled keys new to the class: never seen, or last in another class
        self.fresh = 0.0
        self.moved = 0.0
        self.following = False  # its keys moved in: it follows them
        # while following: worker -> sampled keys moved in from it, decayed
        self.senders: Optional[Dict[PoolWorker, float]] = None
        self.reset = False  # its skills were reset: the book knows better


FORGET_STEP: Final = 64  # keys forgotten at most a call of ``forget_keys``


def forget_keys(classes: Dict[str, ClassStats], queue: List[Tuple[str, ClassStats]]) -> int:
    """Forget up to ``FORGET_STEP`` of the keys the classes of ``queue``
    (class name, stats; ``classes`` as they are, if it is empty) remember,
    from its last class on, each class while it is still the one in
    ``classes`` (one forgotten since took its keys with it); how many.  A
    few a request: a dict of 65,536 keys freed at once holds up the loop
    for some 14 ms."""
    if not queue:
        queue.extend(classes.items())
    forgotten = 0
    while queue and forgotten < FORGET_STEP:
        name, stats = queue[-1]
        if classes.get(name) is not stats or not stats.keys:
            queue.pop()
            continue
        stats.keys.popitem()
        forgotten += 1
    return forgotten


def first_visits(stats: ClassStats, new: bool) -> bool:
    """Count a request of ``stats``'s class, for a key the book did not know
    (``new``) or for one it did; whether the class is one of first visits:
    ``FIRST_VISITS`` of its requests for keys the book did not know, by a
    mean over its last few hundred requests decayed from none, as a
    shop's products might be, each visited once.  Starting from none, a
    class takes some 180 requests for new keys in a row to be one: not
    the first requests of every class, to a cold LB, nor a crawl of a few
    dozen new pages in a class visited again."""
    share = stats.first_visits * VISITS_DECAY
    if new:
        share += 1.0 - VISITS_DECAY
    stats.first_visits = share
    return share >= FIRST_VISITS
