"""The pool's skills by class (routing/skillmap.py): the same mapping, in
the same order, as one dict per class; the classes routing has not read
held where Python's cyclic collector does not walk them."""

import gc
import itertools
import random

from zc_lb.routing.affinity import AffinityPool
from zc_lb.routing.pool import Pool
from zc_lb.routing.skillmap import SkillMap


NUMBERS = itertools.count(1)


class Worker:
    """A worker record, numbered and held by number as the pool does."""

    def __init__(self, name, pool):
        self.name = name
        self.ident = next(NUMBERS)  # (never another's, as Pool.add's)
        pool[self.ident] = self

    def __repr__(self):
        return self.name


def skills_of(*names):
    """A SkillMap and workers of these names in its pool."""
    pool = {}
    return (SkillMap(pool),) + tuple(Worker(name, pool) for name in names)


def as_lists(skills):
    """Each class's workers and scores, in order."""
    return {rclass: list(skilled.items()) for rclass, skilled in skills.items()}


def test_it_holds_what_one_dict_a_class_holds_in_the_same_order():
    # Random résumé updates, reads (which wake a class), rests and
    # removals, checked against a dict of dicts after every step: the
    # order of each class's workers is what ties and sums go by.
    rng = random.Random(7)
    skills, *workers = skills_of(*("w%d" % n for n in range(5)))
    classes = ["c%d" % n for n in range(12)]
    reference = {}
    for step in range(5000):
        rclass, worker = rng.choice(classes), rng.choice(workers)
        action = rng.random()
        if action < 0.4:
            score = float(rng.randrange(1, 4))
            skills.add(rclass, worker, score)
            reference.setdefault(rclass, {})[worker] = score
        elif action < 0.65:
            skills.remove(rclass, worker)
            if rclass in reference:
                reference[rclass].pop(worker, None)
                if not reference[rclass]:
                    del reference[rclass]
        elif action < 0.8:
            got = skills.get(rclass)
            assert (None if got is None else list(got.items())) == \
                (list(reference[rclass].items()) if rclass in reference else None)
        elif action < 0.9:
            skills.rest(rclass)
        elif action < 0.95:
            skilled = skills.setdefault(rclass)  # routing makes one skilled itself
            skilled[worker] = 9.0
            reference.setdefault(rclass, {})[worker] = 9.0
        else:
            for rclass in classes:  # a worker leaves the pool, and comes back
                skills.remove(rclass, worker)
                if rclass in reference:
                    reference[rclass].pop(worker, None)
                    if not reference[rclass]:
                        del reference[rclass]
            del skills.workers[worker.ident]
            workers[workers.index(worker)] = Worker(worker.name, skills.workers)
        assert as_lists(skills) == {c: list(s.items()) for c, s in reference.items()}, step
        assert len(skills) == len(reference) and bool(skills) == bool(reference)
        assert all((c in skills) == (c in reference) for c in classes)
    assert skills.live and skills.dormant  # (both forms were exercised)


def test_a_class_wakes_when_read_and_its_updates_go_to_the_dict_then():
    skills, one, two = skills_of("one", "two")
    skills.add("c", one, 1.0)
    skills.add("c", two, 2.0)
    skills.add("c", one, 3.0)  # (keeps its place)
    assert "c" in skills.dormant and not skills.live
    skilled = skills["c"]
    assert list(skilled.items()) == [(one, 3.0), (two, 2.0)] and skills.live == {"c": skilled}
    skills.add("c", two, 5.0)
    skills.remove("c", one)
    assert skilled == {two: 5.0} and skills.get("c") is skilled
    skills.remove("c", two)
    assert "c" not in skills and skills.get("c") is None and skills.get("c", {}) == {}


def test_dormant_classes_are_not_walked_by_the_cyclic_collector():
    skills, *workers = skills_of("w0", "w1", "w2")
    for n in range(2000):
        for worker in workers[:1 + n % 3]:
            skills.add("c%d" % n, worker, 1.0 + n)
    gc.collect()
    assert not any(gc.is_tracked(held) for held in skills.dormant.values())
    assert gc.is_tracked(skills["c7"])  # (a live class's dict holds workers)


def test_a_worker_gone_from_the_pool_leaves_no_stale_skill_behind():
    skills, one, two = skills_of("one", "two")
    skills.add("c", one, 1.0)
    skills.add("c", two, 2.0)
    del skills.workers[one.ident]  # (out of order: its classes not taken out first)
    assert skills["c"] == {two: 2.0}
    again = Worker("one", skills.workers)  # back again: a new number
    skills.add("d", again, 1.0)
    skills.rest("c")
    assert skills["d"] == {again: 1.0} and skills["c"] == {two: 2.0}


def test_a_pools_intake_keeps_the_classes_not_requested_dormant():
    pool = Pool()
    for handle in "abc":
        pool.add(handle, {"c%d" % n: 1.0 + n for n in range(3000) if n % 3 != "abc".index(handle)})
    for n in range(10):
        pool.put(pool.get("c%d" % n))
    assert len(pool.skilled) == 3000 and len(pool.skilled.live) == 10
    gc.collect()
    assert not any(gc.is_tracked(held) for held in pool.skilled.dormant.values())


def test_the_affinity_pool_puts_the_classes_it_forgets_back_to_sleep():
    # A flood of new Host names: each class is read when requested, and
    # goes back to sleep when the pool forgets it as idle, so the dicts
    # the collector walks stay as few as the classes the pool keeps.
    window = 200
    pool = AffinityPool(footprint_window=window)
    for handle in range(4):
        pool.add(handle, {"site": 10.0})
    for n in range(20 * window):
        pool.put(pool.get("h%d.example" % n if n % 2 else "site", "/p%d" % (n % 50)))
        assert len(pool.skilled.live) <= len(pool.classes) + 1, n
    assert "h3001.example" in pool.skilled.dormant and "h3001.example" not in pool.classes
    asleep = dict(pool.skilled.items())["h3001.example"]
    assert pool.get("h3001.example", "/") in pool.workers  # requested again: awake
    awake = pool.skilled.live["h3001.example"]
    assert "h3001.example" not in pool.skilled.dormant and asleep.items() <= awake.items()
