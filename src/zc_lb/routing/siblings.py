"""Siblings: the processes of one ``zc-lb lb --processes N`` route as one LB.

Each child of ``--processes`` has a pool of its own, and the kernel
hands each client connection to one of them.  Routing alone, each would
place a new key on the member least busy in its own eyes, so two
children put the same key on two workers and its data is loaded twice;
and each would see only its own requests in flight, so its balance bound
and cap would judge a worker by half its load.  (In the simulator, two
such LBs on the NASA log load 59% more per request than one LB, with a
fifth less throughput: seeds 1-4, simulations/README.rst.)

So the supervisor gives its children one shared memory segment (a
memfd, mapped by each), and they share through it:

- Where each key last went: a table of ``BOOK_SLOTS`` slots, one per key
  by its hash, holding the key's hash, its class's, the worker's name's,
  and a check of the three.  The last placement by any sibling wins.  A
  slot holding another key (a collision) or torn by two siblings writing
  at once (its check fails) says nothing: the pool then places the key as
  it would alone.  The pool reads its key's slot once a request, and
  writes it when the key goes somewhere new.
- Each class's last recruit, in the same table (as a key of a class of
  its own, ``RECRUITS``): a child short of members for a class takes the
  worker a sibling took, so that their members agree.  (With the book
  alone, on 10,000 small classes each child recruited its own, the keys
  went to and fro between them, and the siblings loaded more than
  children routing alone.)
- The requests each has in flight on each worker: a row per sibling,
  written by that sibling only, every ``SYNC_INTERVAL``, with a sequence
  number that is odd while it is written (a reader that finds it odd or
  changed reads again) and the time it was written (a row older than
  ``STALE``, a child that died, counts nothing).  Each pool counts its
  siblings' requests into its workers' backlogs (``Pool.take_elsewhere``),
  so every child's bound and cap see the site's load, late by at most
  one interval.
- With its row, each sibling's measure of locality over every class
  (``routing/locality.py``: its decayed sums of away time over home time), which
  every pool's gain counts: alone, each learned it from half the
  requests (in the simulator, sharing it took two siblings on the NASA
  log, 12 seeds, from 2,717 to 2,754 requests a second and 0.084 to
  0.083 loads).

What stays each child's own: a class's statistics (its share, its
footprint, its own gain), which each measures from the requests it
sees, a random half of the same traffic.

The segment's layout is versioned (``MAGIC``): a child that finds
another layout refuses to start, saying so.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from typing import Callable, Dict, List, Mapping, Optional, Tuple

from zc_lb.routing.classstats import stable_hash
from zc_lb.errors import ConfigurationError

MAGIC = b"zclbsib1"  # the layout's name and version
HEADER = struct.Struct("<8sIII")  # magic, siblings, book slots, workers per row
HEADER_SIZE = 64
BOOK_SLOTS = 1 << 16  # keys the shared book holds (a power of two)
SLOT = struct.Struct("<QQQQ")  # key hash, class hash, worker hash, check
MAX_WORKERS = 1024  # workers a sibling's row counts
FORGET_SLACK = 64  # names of workers gone a sibling keeps, past twice its pool's, before it forgets
SEQUENCE = struct.Struct("<Q")  # a row's first word: odd while it is written
ROW_HEAD = struct.Struct("<QdddI")  # sequence, time written, locality's two sums, workers
ROW_TAIL = struct.Struct("<dddI")  # the same less the sequence, written before it
ROW_HEAD_SIZE = 40
PAIR = "Qq"  # a row's pairs: worker hash, requests in flight
PAIR_SIZE = struct.calcsize("<" + PAIR)
SYNC_INTERVAL = 0.001  # seconds between a sibling's row written and the others' read
STALE = 1.0  # seconds after which a row not written again counts nothing
MASK64 = (1 << 64) - 1
RECRUITS = 0x5EC2E7ED5EC2E7ED  # a class's last recruit is kept as a key of this class


def _check(key_hash: int, class_hash: int, worker_hash: int) -> int:
    """What a slot's fourth word must be for its first three to count."""
    return ((key_hash * 0x9E3779B97F4A7C15) ^ (class_hash + 0x632BE59BD9B4E019)
            ^ (worker_hash * 0xC2B2AE3D27D4EB4F) ^ 1) & MASK64


def segment_size(siblings: int) -> int:
    return HEADER_SIZE + siblings * _row_size() + BOOK_SLOTS * SLOT.size


def _row_size() -> int:
    return ROW_HEAD_SIZE + MAX_WORKERS * PAIR_SIZE


def create(siblings: int) -> int:
    """The supervisor's part: a shared segment for ``siblings`` processes,
    as a file descriptor its children inherit (``--siblings-fd``)."""
    fd = os.memfd_create("zc-lb-siblings")  # (close-on-exec: the children get it by pass_fds)
    os.ftruncate(fd, segment_size(siblings))
    with mmap.mmap(fd, segment_size(siblings)) as segment:
        HEADER.pack_into(segment, 0, MAGIC, siblings, BOOK_SLOTS, MAX_WORKERS)
    return fd


class Siblings:
    """One sibling's view of the shared segment: ``index`` of ``count``.
    ``clock`` says the time rows are stamped and judged by (the
    simulator's is virtual)."""

    def __init__(self, segment: mmap.mmap, index: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        magic, count, slots, workers = HEADER.unpack_from(segment, 0)
        if (magic, slots, workers) != (MAGIC, BOOK_SLOTS, MAX_WORKERS):
            raise ConfigurationError(
                "the shared segment of --processes has another layout (%r, %d slots, %d "
                "workers; this zc-lb's is %r, %d, %d): the supervisor and its children must "
                "be the same version" % (magic, slots, workers, MAGIC, BOOK_SLOTS, MAX_WORKERS))
        if len(segment) < segment_size(count):
            raise ConfigurationError("the shared segment of --processes is %d bytes, short of "
                                     "the %d its %d siblings take" % (len(segment),
                                                                      segment_size(count), count))
        if not 0 <= index < count:
            raise ConfigurationError("process index %d outside the %d siblings of the shared "
                                     "segment" % (index, count))
        self.segment = segment
        self.index = index
        self.count = count
        self.clock = clock
        self.book_offset = HEADER_SIZE + count * _row_size()
        self.mask = BOOK_SLOTS - 1
        self.seq = 0
        self.worker_hashes: Dict[str, int] = {}  # worker name -> its hash
        self.names: Dict[int, str] = {}  # and back
        self.torn = 0  # rows read again, or skipped, because they were being written
        self.publish({})  # a child started again forgets what it had in flight

    @classmethod
    def attach(cls, fd: int, index: int) -> "Siblings":
        """A child's view of the supervisor's segment (``create``)."""
        try:
            size = os.fstat(fd).st_size
            segment = mmap.mmap(fd, size) if size >= HEADER_SIZE else None
        except (OSError, ValueError) as exc:
            raise ConfigurationError("--siblings-fd %d: %s" % (fd, exc))
        if segment is None:
            raise ConfigurationError("--siblings-fd %d is not a zc-lb shared segment" % fd)
        return cls(segment, index)

    @classmethod
    def in_memory(cls, count: int, clock: Callable[[], float] = time.monotonic
                  ) -> Tuple["Siblings", ...]:
        """``count`` siblings over one anonymous segment, in one process
        (the simulator, and tests)."""
        segment = mmap.mmap(-1, segment_size(count))
        HEADER.pack_into(segment, 0, MAGIC, count, BOOK_SLOTS, MAX_WORKERS)
        return tuple(cls(segment, index, clock) for index in range(count))

    # -- the book ------------------------------------------------------

    def worker_hash(self, name: str) -> int:
        """A worker's name's hash, the same in every sibling."""
        hashed = self.worker_hashes.get(name)
        if hashed is None:
            hashed = self.worker_hashes[name] = stable_hash(name) or 1
            self.names[hashed] = name
        return hashed

    def placed(self, key_hash: int, class_hash: int) -> int:
        """The hash of the worker a sibling last sent the key to in this
        class, or 0: none did, or its slot says nothing."""
        key, rclass, worker, check = SLOT.unpack_from(
            self.segment, self.book_offset + (key_hash & self.mask) * SLOT.size)
        if key != key_hash or rclass != class_hash or check != _check(key, rclass, worker):
            return 0
        return worker

    def place(self, key_hash: int, class_hash: int, worker_hash: int) -> None:
        """The key of the class went to the worker."""
        SLOT.pack_into(self.segment, self.book_offset + (key_hash & self.mask) * SLOT.size,
                       key_hash, class_hash, worker_hash,
                       _check(key_hash, class_hash, worker_hash))

    def recruited(self, class_hash: int) -> int:
        """The hash of the worker a sibling last recruited into the class, or 0."""
        return self.placed(class_hash ^ RECRUITS, RECRUITS)

    def recruit(self, class_hash: int, worker_hash: int) -> None:
        """The class recruited the worker."""
        self.place(class_hash ^ RECRUITS, RECRUITS, worker_hash)

    # -- requests in flight ---------------------------------------------

    def _row(self, index: int) -> int:
        return HEADER_SIZE + index * _row_size()

    def publish(self, in_flight: Mapping[str, int],
                measure: Tuple[float, float] = (0.0, 0.0)) -> None:
        """Write this sibling's requests in flight, worker name -> count,
        and its pool's measure of locality (``Pool.measure``).
        ``in_flight`` names every worker of the pool, idle ones too: the
        siblings' requests are read back on those (``elsewhere``), and
        the names of workers gone since are forgotten (a worker on a port
        of the kernel's choice has a new one each time it starts)."""
        hashes = self.worker_hashes
        if len(hashes) > 2 * len(in_flight) + FORGET_SLACK:
            self.worker_hashes = hashes = {name: hashed for name, hashed in hashes.items()
                                           if name in in_flight}
            self.names = {hashed: name for name, hashed in hashes.items()}
        pairs: List[int] = []
        for name, count in in_flight.items():
            hashed = hashes.get(name)
            if hashed is None:
                hashed = self.worker_hash(name)
            if count and len(pairs) < 2 * MAX_WORKERS:  # (none: nothing to add)
                pairs += (hashed, count)
        row = self._row(self.index)
        segment = self.segment
        self.seq += 1  # odd: being written
        SEQUENCE.pack_into(segment, row, self.seq)
        struct.pack_into("<" + PAIR * (len(pairs) // 2), segment, row + ROW_HEAD_SIZE, *pairs)
        ROW_TAIL.pack_into(segment, row + SEQUENCE.size, self.clock(), measure[0], measure[1],
                           len(pairs) // 2)
        self.seq += 1  # even: written
        SEQUENCE.pack_into(segment, row, self.seq)

    def elsewhere(self) -> Tuple[Dict[str, int], float, float]:
        """Worker name -> requests the other siblings have in flight on it
        (workers not in this sibling's pool when it last published are
        left out), and the sums of their measures of locality."""
        segment = self.segment
        names = self.names
        now = self.clock()
        total: Dict[str, int] = {}
        ratio = weight = 0.0
        for index in range(self.count):
            if index == self.index:
                continue
            row = self._row(index)
            for _ in range(3):
                seq, written, row_ratio, row_weight, n = ROW_HEAD.unpack_from(segment, row)
                if seq & 1:
                    self.torn += 1
                    continue
                pairs = struct.unpack_from("<" + PAIR * min(n, MAX_WORKERS), segment,
                                           row + ROW_HEAD_SIZE)
                if SEQUENCE.unpack_from(segment, row)[0] == seq:
                    break
                self.torn += 1
            else:
                continue  # (written all along: read it next time)
            if not seq or now - written > STALE:
                continue
            ratio += row_ratio
            weight += row_weight
            for i in range(0, len(pairs), 2):
                name = names.get(pairs[i])
                if name is not None and pairs[i + 1] > 0:
                    total[name] = total.get(name, 0) + pairs[i + 1]
        return total, ratio, weight


def sync(siblings: Optional[Siblings], pool) -> None:
    """One exchange with the siblings: their requests in flight counted
    into ``pool``'s backlogs and their measures of locality into its
    gain, and this pool's own published."""
    if siblings is not None:
        in_flight, ratio, weight = siblings.elsewhere()
        pool.take_measure(ratio, weight)
        siblings.publish(pool.take_elsewhere(in_flight), pool.measure())
