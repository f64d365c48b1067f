"""zc_lb.routing.slowstart: how an AffinityPool eases in a worker added while it runs."""

from __future__ import annotations

import random
from collections import Counter, defaultdict

import pytest

from zc_lb.routing.affinity import AffinityPool
from zc_lb.routing.slowstart import CLASS_TAKE, GIVE_UP, STARTED, Starter

CLASSES = ["c0", "c1", "c2"]  # each worth more than a worker of five


def pool_of(n: int, **settings) -> AffinityPool:
    pool = AffinityPool(**settings)
    for i in range(n):
        pool.add("w%d" % i)
    return pool


class Traffic:
    """Keyed requests of a few classes, a few per worker in flight: each
    request ends once ``hold`` per worker have come after it."""

    def __init__(self, pool: AffinityPool, seed: int, classes=CLASSES, keys: int = 50,
                 hold: int = 3) -> None:
        self.pool, self.rng = pool, random.Random(seed)
        self.classes, self.keys, self.hold = classes, keys, hold
        self.in_flight: list = []

    def one(self, held=()):
        """One request: (its class, the worker chosen).  A request to a
        worker in ``held`` never ends."""
        rclass = self.rng.choice(self.classes)
        handle = self.pool.get(rclass, "/%s/%d" % (rclass, self.rng.randrange(self.keys)))
        if handle not in held:
            self.in_flight.append(handle)
            if len(self.in_flight) > self.hold * len(self.pool):
                self.pool.put(self.in_flight.pop(0))
        return rclass, handle

    def run(self, n: int, held=()) -> Counter:
        return Counter(self.one(held)[1] for _ in range(n))

    def forget(self, handle) -> None:
        """End the requests in flight on a worker being removed (failed, as
        the LB ends them: each put back)."""
        for _ in range(self.in_flight.count(handle)):
            self.pool.put(handle)
        self.in_flight = [h for h in self.in_flight if h != handle]


def warm_pool(slow_start: int, seed: int = 1, **traffic) -> tuple:
    pool = pool_of(4, slow_start=slow_start)
    traffic = Traffic(pool, seed, **traffic)
    traffic.run(2000)
    return pool, traffic


def test_only_a_worker_added_to_a_running_pool_starts_slowly():
    pool = pool_of(4, slow_start=500)
    pool.add("early")  # no request yet: nothing to ease it into
    assert pool.status()["starting"] == 0
    Traffic(pool, 1).run(1000)
    pool.add("new")
    assert pool.status()["starting"] == 1
    assert pool.starting[pool.workers["new"]].added == pool.requests


def test_with_slow_start_0_a_new_worker_takes_its_share_at_once():
    # "0: at once" gave a new worker no traffic at all: nothing but slow
    # start makes it a member of a class, and 0 turned slow start off.
    pool, traffic = warm_pool(slow_start=0)
    pool.add("new")
    got = traffic.run(2000)
    assert got["new"] > 0.5 * 0.2 * 2000, got  # at least half a fair fifth
    assert not pool.starting  # its ramp, AT_ONCE requests, is long over


@pytest.mark.parametrize("slow_start", [200, 600])
def test_a_starter_is_done_only_after_its_ramp_once_it_has_its_share(slow_start):
    pool, traffic = warm_pool(slow_start)
    pool.add("new")
    new = pool.workers["new"]
    n = 0
    while pool.starting and n < GIVE_UP * slow_start:
        traffic.one()
        n += 1
    # It has its share long before (see test_affinity.py), but not its ramp;
    # and it is done for having its share, not for giving up.
    assert slow_start <= n < GIVE_UP * slow_start // 2, n
    # The floors it joined with now follow its share.
    assert new in pool.fading and not pool.starting
    assert pool.status()["starting"] == 0


def test_a_starter_is_not_done_while_its_share_is_short_until_it_gives_up():
    # Nothing it is sent ever ends: busier than the mean, it is sent no
    # more, never has its share, and is done starting GIVE_UP ramps on.
    slow_start = 20
    pool, traffic = warm_pool(slow_start)
    pool.add("new")
    n = 0
    while pool.starting and n < 2 * GIVE_UP * slow_start:
        traffic.one(held={"new"})
        n += 1
    assert GIVE_UP * slow_start <= n <= GIVE_UP * slow_start + 2, n
    # It keeps the floors it has, as they are.
    floors = {rclass: stats.floors.get(pool.workers["new"])
              for rclass, stats in pool.classes.items() if stats.floors}
    assert floors
    traffic.run(500, held={"new"})
    assert not pool.starting and not pool.fading
    assert floors == {rclass: stats.floors.get(pool.workers["new"])
                      for rclass, stats in pool.classes.items() if stats.floors}


def test_a_starter_takes_at_most_half_a_class_and_joins_classes_for_its_fair_share():
    # Four classes of a quarter each: half of one is not a fair fifth, so
    # it takes half of one and part of another.
    pool, traffic = warm_pool(1000, classes=["a", "b", "c", "d"], keys=60)
    pool.add("new")
    got = defaultdict(Counter)
    for _ in range(1500):
        rclass, handle = traffic.one()
        got[rclass][handle] += 1
    new = pool.workers["new"]
    starter = pool.starting.get(new) or pool.fading[new]  # (done, or nearly)
    fair = 1 / len(pool)
    assert len(starter.joined) >= 2
    assert all(share <= CLASS_TAKE * 0.25 * 1.2 for share in starter.joined.values())
    assert 0.85 * fair <= sum(starter.joined.values()) <= 1.2 * fair
    for rclass, counts in got.items():
        assert counts["new"] <= 0.6 * sum(counts.values()), (rclass, counts)
    assert sum(counts["new"] for counts in got.values()) > 0.5 * fair * 1500


def test_a_worker_removed_while_starting_is_forgotten():
    pool, traffic = warm_pool(1000)
    pool.add("new")
    old = pool.workers["new"]
    assert traffic.run(300)["new"] > 0
    assert any(old in (stats.floors or ()) for stats in pool.classes.values())
    traffic.forget("new")
    pool.remove("new")
    assert not pool.starting and pool.status()["starting"] == 0
    assert "new" not in traffic.run(300)
    # the classes it joined drop its floor when next worked out
    assert not any(old in (stats.floors or ()) for stats in pool.classes.values())
    pool.add("new")  # back: it starts afresh, from nothing
    again = pool.workers["new"]
    assert again is not old and pool.starting[again].added == pool.requests
    assert pool.starting[again].joined == {}
    assert traffic.run(500)["new"] > 0


def test_a_worker_removed_while_its_floors_fade_is_forgotten():
    pool, traffic = warm_pool(200)
    pool.add("new")
    while pool.starting:
        traffic.one()
    assert pool.workers["new"] in pool.fading
    traffic.forget("new")
    pool.remove("new")
    assert not pool.fading
    got = traffic.run(500)
    assert "new" not in got and set(got) <= {"w0", "w1", "w2", "w3"}


def test_a_starters_share_is_its_decayed_part_of_the_pools_requests():
    horizon = 500
    starter = Starter(1000)
    assert starter.share(1000, horizon) == 0.0  # nothing yet, no division by zero
    for now in range(1001, 3001):
        if now % 4 == 0:
            starter.got(now, horizon)
    assert starter.share(3000, horizon) == pytest.approx(0.25, abs=0.01)
    every = Starter(0)
    for now in range(1, 401):
        every.got(now, horizon)
    assert every.share(400, horizon) == pytest.approx(1.0)
    # Sent nothing for a horizon, its share fades: its requests decay
    # (to 1/e), and the pool's go on.
    assert 0.2 < every.share(400 + horizon, horizon) < 0.3


def follow_moved_keys(pool, starter):
    """Make a class the ``starter`` joined follow keys that went to
    another class (a changed classifier): that class's stats and name."""
    stats = next(iter(starter.joined))
    rclass = next(name for name, known in pool.classes.items() if known is stats)
    other = next(c for c in CLASSES if c != rclass)
    for i in range(4):
        pool.put(pool.get(rclass, "/%s/%d" % (other, i)))
    return stats, rclass


def test_a_class_that_follows_moved_keys_away_from_a_starter_no_longer_counts_for_it():
    # A class following its moved keys (a changed classifier) takes its
    # skills from its old members, a starter among them, and drops their
    # floors.  The starter counted the class toward its share still: it
    # joined nothing more, short of its share, until it gave up.
    pool, traffic = warm_pool(1000)
    pool.add("new")
    new = pool.workers["new"]
    starter = pool.starting[new]
    for _ in range(2000):  # until it holds what it needs once warm
        if sum(starter.joined.values()) >= STARTED / len(pool):
            break
        traffic.one()
    stats, rclass = follow_moved_keys(pool, starter)
    assert stats.following and pool.starting.get(new) is starter
    # A class counts for the starter while it is skilled there.
    assert (stats in starter.joined) == (new in pool.skilled[rclass])


def test_a_starter_that_joins_a_class_again_after_it_followed_moved_keys_keeps_it():
    # The starter, an old member of a class that followed its moved keys,
    # is stale there (its data is another class's).  Joining the class
    # again makes it skilled afresh, as a recruit is: its next résumé,
    # which lists the class, took the skill away again, and with it the
    # keys it had begun to warm.
    pool, traffic = warm_pool(1000)
    pool.add("new")
    new = pool.workers["new"]
    starter = pool.starting[new]
    while not starter.joined:
        traffic.one()
    stats, rclass = follow_moved_keys(pool, starter)
    assert stats.following and new in pool.skilled[rclass]  # (joined again)
    assert rclass not in pool.stale.get(new, ())
    pool.new_resume("new", dict(new.resume))
    assert new in pool.skilled[rclass] and stats in starter.joined
