"""Tests for zc_lb.routing.pool: the routing algorithm (docs/design.rst, "The routing algorithm").

Scenarios are walked step by step; a reference model written from the
docstring checks every choice of a long seeded random run; a cost test
counts, by instrumentation, what get/put iterate over.
"""

from __future__ import annotations

import json
import random
from collections import OrderedDict

import pytest

from zc_lb.errors import ConfigurationError
from zc_lb.routing.classifier import MAX_CLASS
from zc_lb.routing.pool import ClasslessPool, Pool, PoolWorker


def make_pool(*handles, cls=Pool, **settings) -> Pool:
    pool = cls(**settings)
    for handle in handles:
        pool.add(handle)
    return pool


def cap(pool: Pool) -> float:
    """The cap of step 1, from the pool's public state."""
    return max(pool.variance * pool.mbacklog / len(pool.workers), 1.0)


def under_cap(pool: Pool, handle) -> bool:
    oldest = pool.workers[list(pool.order())[0]]
    return pool.workers[handle].mbacklog - (oldest.mbacklog + 1.0) <= cap(pool)


def reference_choices(pool: Pool, rclass: str) -> set:
    """The handles the documented algorithm allows for ``rclass`` (ties: any)."""
    if not pool.workers:
        return set()
    scored = {}
    for worker, score in pool.skilled.get(rclass, {}).items():
        if under_cap(pool, worker.handle):
            scored[worker.handle] = score / worker.backlog if worker.backlog > 1 else score
    if scored:
        best = max(scored.values())
        return {handle for handle, score in scored.items() if score == best}
    return {list(pool.order())[0]}


def check_invariants(pool: Pool) -> None:
    workers = pool.workers
    assert pool.backlog == sum(w.backlog for w in workers.values())
    assert pool.backlog >= 0 and pool.mbacklog >= 0
    for handle, worker in workers.items():
        assert worker.handle == handle
        assert worker.backlog >= 0 and worker.mbacklog >= 0
        for rclass, score in worker.resume.items():
            assert pool.skilled[rclass][worker] == score
    for rclass, skilled in pool.skilled.items():
        assert skilled, "empty skill entry for %r" % rclass
        for worker, score in skilled.items():
            assert workers.get(worker.handle) is worker, "dead worker in skilled"
            assert worker.resume[rclass] == score
    order = list(pool.order())
    assert len(order) == len(set(order)) == len(workers)
    assert set(order) == set(workers)
    assert len(pool) == len(workers)
    assert pool.worker_decay == 1 - 1 / (2 * pool.backlog_history)
    assert pool.pool_decay == 1 - 1 / (2 * pool.backlog_history * max(len(workers), 1))


def checked_get(pool: Pool, rclass: str):
    """``pool.get``, checked against the reference model and the update rules."""
    allowed = reference_choices(pool, rclass)
    before = {h: (w.backlog, w.mbacklog, w.dsum, w.dcount)
              for h, w in pool.workers.items()}
    pool_before = (pool.backlog, pool.mbacklog, pool.dsum, pool.dcount)
    was_skilled = {w.handle for w in pool.skilled.get(rclass, {})}
    handle = pool.get(rclass)
    if not allowed:
        assert handle is None
        return None
    assert handle in allowed
    worker = pool.workers[handle]
    assert list(pool.order())[-1] == handle
    assert worker.backlog == before[handle][0] + 1
    assert pool.backlog == pool_before[0] + 1
    # the means are normalised: a decayed sum over a decayed count
    d = pool.worker_decay
    assert worker.mbacklog == pytest.approx(
        (d * before[handle][2] + worker.backlog) / (d * before[handle][3] + 1))
    d = pool.pool_decay
    assert pool.mbacklog == pytest.approx(
        (d * pool_before[2] + pool.backlog) / (d * pool_before[3] + 1))
    if handle not in was_skilled:
        assert worker.resume[rclass] == pool.unskilled_score
        assert pool.skilled[rclass][worker] == pool.unskilled_score
    for other, state in before.items():
        if other != handle:
            w = pool.workers[other]
            assert (w.backlog, w.mbacklog, w.dsum, w.dcount) == state
    return handle


# -- scenarios -----------------------------------------------------------------


def test_get_on_an_empty_pool_returns_none():
    assert Pool().get("x") is None
    assert ClasslessPool().get("x") is None
    pool = make_pool("a")
    pool.remove("a")
    assert pool.get("x") is None


def test_added_workers_are_least_recently_chosen():
    pool = make_pool("a", "b", "c")
    assert pool.order() == ["c", "b", "a"]
    assert pool.get("x") == "c"
    assert pool.order() == ["b", "a", "c"]
    pool.add("d")
    assert pool.order() == ["d", "b", "a", "c"]


def test_new_class_goes_to_least_recently_chosen_and_sticks():
    pool = make_pool("a", "b", "c")
    pool.get("warmup")  # c; now b is the least recently chosen
    pool.put("c")
    assert pool.order()[0] == "b"
    assert checked_get(pool, "x") == "b"
    assert pool.workers["b"].resume["x"] == pool.unskilled_score
    assert set(pool.skilled["x"]) == {pool.workers["b"]}
    pool.put("b")
    for _ in range(200):
        assert checked_get(pool, "x") == "b"
        pool.put("b")
        check_invariants(pool)
    # Other classes meanwhile go to the others, least recently chosen first.
    assert checked_get(pool, "y") == "a"
    assert checked_get(pool, "z") == "c"
    assert checked_get(pool, "x") == "b"


def test_skilled_worker_past_the_cap_overflows_to_another():
    pool = make_pool("a", "b", "c")
    pool.new_resume("c", {"x": 5.0})
    steps = []
    while True:
        chosen_is_c_allowed = under_cap(pool, "c")
        handle = checked_get(pool, "x")  # no put: the backlog builds up
        steps.append(handle)
        if handle != "c":
            break
        assert chosen_is_c_allowed
        assert len(steps) < 100
    # c took requests while under the cap, then x spilled over ...
    assert not chosen_is_c_allowed
    assert set(steps[:-1]) == {"c"} and len(steps) > 2
    # ... onto the least recently chosen worker, which is now skilled in x.
    assert steps[-1] == "b"
    assert pool.workers["b"].resume == {"x": pool.unskilled_score}
    assert {w.handle: s for w, s in pool.skilled["x"].items()} == {
        "c": 5.0, "b": pool.unskilled_score}
    check_invariants(pool)
    # As b loads up too, x spills on to a; then all three share it.
    rest = [checked_get(pool, "x") for _ in range(60)]
    assert "a" in rest and rest.index("a") > 0
    assert set(pool.skilled["x"]) == set(pool.workers.values())
    check_invariants(pool)


def test_spill_over_bounded_by_variance():
    # A larger variance lets a skilled worker run further past the mean.
    def requests_before_spill(variance):
        pool = make_pool("a", "b", "c", variance=variance)
        for i in range(300):  # new classes: round robin, 100 outstanding each
            pool.get("u%d" % i)
        assert [w.backlog for w in pool.workers.values()] == [100, 100, 100]
        pool.new_resume("c", {"x": 5.0})
        for n in range(1000):
            if checked_get(pool, "x") != "c":
                assert pool.order()[-1] != "c"
                return n
        pytest.fail("x never spilled over")
    counts = [requests_before_spill(v) for v in (0.5, 1.0, 2.0)]
    assert counts[0] > 10 and counts == sorted(set(counts))


def test_added_workers_lower_the_mean_and_take_overflow():
    pool = make_pool("a")
    for _ in range(30):
        assert checked_get(pool, "x") == "a"  # alone, a takes everything
    cap_alone = cap(pool)
    pool.add("b")
    assert cap(pool) < cap_alone  # the pool mean is now spread over two
    assert not under_cap(pool, "a")
    assert checked_get(pool, "x") == "b"
    assert "x" in pool.workers["b"].resume
    pool.add("c")
    assert pool.order()[0] == "c"
    # b, skilled now, takes x until it too is past the cap; then c.
    taken = [checked_get(pool, "x") for _ in range(40)]
    assert "a" not in taken
    first_c = taken.index("c")
    assert first_c > 0 and set(taken[:first_c]) == {"b"}
    assert "x" in pool.workers["c"].resume
    check_invariants(pool)


def test_a_new_worker_is_used_at_once_under_heavy_load():
    # zc.resumelb's pool test of the same name: the normalised mean reads
    # the real backlog from the first event, so a loaded pool spills onto a
    # newcomer at once instead of after ~2 x backlog_history events.
    pool = make_pool("a", "b", "c")
    for handle, rclass in (("a", "x"), ("b", "y"), ("c", "z")):
        pool.new_resume(handle, {rclass: 10.0})
    for _ in range(5):  # 5 outstanding each: a plain average still read ~1
        for rclass in "xyz":
            checked_get(pool, rclass)
    pool.add("d")
    assert checked_get(pool, "x") == "d"
    check_invariants(pool)


def test_the_cap_holds_from_the_start_even_with_a_long_history():
    # With a plain average started at zero, 60 outstanding requests of one
    # skilled class all landed on one of six workers at backlog_history 1000.
    pool = make_pool(*"abcdef", backlog_history=1000)
    pool.new_resume("a", {"x": 10.0})
    taken = [checked_get(pool, "x") for _ in range(60)]
    assert taken.count("a") < 30
    assert len(set(taken)) >= 3


def test_best_score_per_unit_of_backlog():
    pool = make_pool("a", "b")
    pool.new_resume("a", {"x": 3.0})
    pool.new_resume("b", {"x": 2.0})
    assert checked_get(pool, "x") == "a"  # 3 > 2
    assert checked_get(pool, "x") == "a"  # backlog 1 is not penalised: 3 > 2
    assert checked_get(pool, "x") == "b"  # 3/2 < 2
    assert checked_get(pool, "x") == "b"  # 3/2 < 2/1 (not penalised)
    assert checked_get(pool, "x") == "a"  # 3/2 > 2/2
    pool.put("a")
    pool.put("a")
    assert checked_get(pool, "x") == "a"


def test_resume_update_reorders_by_score():
    pool = make_pool("a", "b", "c")
    pool.new_resume("a", {"x": 1.0, "y": 4.0})
    pool.new_resume("b", {"x": 5.0})
    for _ in range(5):
        assert checked_get(pool, "x") == "b"
        pool.put("b")
    pool.new_resume("a", {"x": 10.0})
    assert pool.workers["a"].resume == {"x": 10.0}
    assert "y" not in pool.skilled  # a's old skill went with its old résumé
    for _ in range(5):
        assert checked_get(pool, "x") == "a"
        pool.put("a")
    pool.new_resume("a", {})
    pool.new_resume("b", {"z": 1.0})
    assert "x" not in pool.skilled
    assert checked_get(pool, "x") == pool.order()[-1]
    check_invariants(pool)


def test_new_resume_cleans_scores():
    pool = make_pool("a")
    pool.new_resume("a", {"good": 2, "zero": 0, "negative": -1.0, "nan": float("nan"), 7: "3.5"})
    assert pool.workers["a"].resume == {"good": 2.0, "7": 3.5}
    assert set(pool.skilled) == {"good", "7"}
    pool.new_resume("nobody", {"x": 1.0})  # unknown worker: ignored
    assert "nobody" not in pool and "x" not in pool.skilled
    check_invariants(pool)


def test_a_resume_class_longer_than_any_requests_is_dropped():
    # A worker sent a class of 8 MiB (a résumé may be 64 MiB): the pool
    # and every status document held it whole, though no request's class
    # is longer than MAX_CLASS (classifier.bounded_class).
    pool = make_pool("a")
    longest = "x" * MAX_CLASS
    pool.new_resume("a", {"y" * (MAX_CLASS + 1): 5.0, "z" * 8 * 1024 * 1024: 5.0,
                          longest: 2.0, "good": 1.0})
    assert pool.workers["a"].resume == {longest: 2.0, "good": 1.0}
    assert set(pool.skilled) == {longest, "good"}
    assert max(len(name) for name in pool.status()["workers"]["a"]["skills"]) == MAX_CLASS
    check_invariants(pool)


def test_a_resume_touches_only_the_classes_whose_skill_changed():
    # A 10,000-class résumé took 11 ms of the LB's loop, rebuilding every
    # class; an idle class's score does not move, so most stay as they are.
    pool = make_pool("a", "b")
    scores = {"c%d" % i: 10.0 + i for i in range(1000)}
    assert sorted(pool.new_resume("a", scores)) == sorted(scores)
    kept = pool.skilled["c5"]
    new = dict(scores, c7=99.0, fresh=3.0, c9=float("nan"))
    del new["c8"]
    assert sorted(pool.new_resume("a", new)) == ["c7", "c8", "c9", "fresh"]
    assert pool.skilled["c5"] is kept and pool.workers["a"].resume["c7"] == 99.0
    assert "c8" not in pool.skilled and "c9" not in pool.skilled
    assert pool.new_resume("a", new) == set()  # nothing new
    worker = pool.workers[pool.get("unknown")]
    assert worker.given == {"unknown"}  # the LB's own skill, its résumé's to replace
    ours = {rclass: score for rclass, score in worker.resume.items() if rclass != "unknown"}
    assert pool.new_resume(worker.handle, ours) == {"unknown"}
    assert not worker.given and "unknown" not in pool.skilled
    check_invariants(pool)


def test_add_is_idempotent_and_may_carry_a_resume():
    pool = make_pool("a", "b")
    pool.add("c", {"x": 2.0}, version="1.2")
    assert pool.workers["c"].version == "1.2"
    assert pool.skilled["x"] == {pool.workers["c"]: 2.0}
    pool.get("x")
    order, backlog = pool.order(), pool.workers["c"].backlog
    pool.add("c")
    assert pool.order() == order and pool.workers["c"].backlog == backlog
    assert pool.workers["c"].resume == {"x": 2.0}
    pool.add("c", {"y": 1.0})
    assert pool.workers["c"].resume == {"y": 1.0} and "x" not in pool.skilled
    assert pool.order() == order and pool.workers["c"].backlog == backlog
    assert "c" in pool and "zz" not in pool and len(pool) == 3
    check_invariants(pool)


def test_removed_worker_with_requests_in_flight_leaves_no_trace():
    pool = make_pool("a", "b", "c")
    pool.new_resume("a", {"x": 3.0, "y": 1.0})
    pool.new_resume("b", {"x": 1.0})
    for rclass in "xxxyyz":
        pool.get(rclass)
    assert pool.workers["a"].backlog > 0
    gone = pool.workers["a"]
    in_flight = gone.backlog
    pool.remove("a")
    assert "a" not in pool.workers and "a" not in pool.order()
    assert all(gone not in skilled for _, skilled in pool.skilled.items())
    assert "y" not in pool.skilled or gone not in pool.skilled["y"]
    check_invariants(pool)
    backlog = pool.backlog
    pool.put("a")  # the in-flight requests end later: harmless
    pool.put("a")
    assert pool.backlog == backlog
    pool.remove("a")  # removing twice, or an unknown worker: harmless
    pool.remove("nobody")
    pool.put("nobody")
    check_invariants(pool)
    assert pool.get("x") in ("b", "c")
    # The same handle added again starts afresh, but for its requests still
    # in flight (two of them ended meanwhile), which end with ``put``.
    pool.add("a")
    assert (pool.workers["a"].backlog, pool.workers["a"].resume) == (in_flight - 2, {})
    assert pool.workers["a"] is not gone
    check_invariants(pool)
    for _ in range(in_flight - 2):
        pool.put("a")
    assert pool.workers["a"].backlog == 0
    check_invariants(pool)


def test_removing_every_worker():
    pool = make_pool("a", "b")
    pool.get("x")
    pool.get("y")
    pool.remove("a")
    pool.remove("b")
    assert (pool.backlog, len(pool.skilled), pool.order()) == (0, 0, [])
    check_invariants(pool)


def test_put_reverses_get():
    pool = make_pool("a", "b")
    handle = pool.get("x")
    pool.put(handle)
    assert pool.backlog == 0 and pool.workers[handle].backlog == 0
    pool.put(handle)  # an extra put does not drive the backlog negative
    assert pool.backlog == 0 and pool.workers[handle].backlog == 0
    check_invariants(pool)


# -- settings ----------------------------------------------------------------


@pytest.mark.parametrize("settings", [
    {"variance": 0}, {"variance": -1.0}, {"variance": float("nan")},
    {"backlog_history": 0}, {"backlog_history": -3}, {"backlog_history": 1.5},
    {"backlog_history": "9"},
    {"unskilled_score": 0}, {"unskilled_score": -0.5}, {"unskilled_score": float("nan")},
])
def test_settings_validated(settings):
    with pytest.raises(ConfigurationError):
        Pool(**settings)
    pool = make_pool("a", "b")
    before = (pool.variance, pool.backlog_history, pool.unskilled_score,
              pool.worker_decay, pool.pool_decay)
    with pytest.raises(ConfigurationError):
        pool.update_settings(**settings)
    assert (pool.variance, pool.backlog_history, pool.unskilled_score,
            pool.worker_decay, pool.pool_decay) == before


def test_update_settings_changes_the_decays():
    pool = make_pool("a", "b", "c", "d")
    assert pool.worker_decay == 1 - 1 / 18
    assert pool.pool_decay == 1 - 1 / (18 * 4)
    pool.update_settings(backlog_history=4)
    assert pool.worker_decay == 1 - 1 / 8
    assert pool.pool_decay == 1 - 1 / (8 * 4)
    assert (pool.variance, pool.unskilled_score) == (1.0, 1.0)
    handle = pool.get("x")
    # normalised means: one event with backlog 1 reads 1, whatever the decay
    assert pool.workers[handle].mbacklog == pytest.approx(1.0)
    assert pool.mbacklog == pytest.approx(1.0)
    pool.put(handle)
    assert pool.workers[handle].mbacklog == pytest.approx(7 / 8 / (7 / 8 + 1))
    assert pool.mbacklog == pytest.approx(31 / 32 / (31 / 32 + 1))
    pool.update_settings(variance=3, unskilled_score=2)
    assert (pool.variance, pool.backlog_history, pool.unskilled_score) == (3.0, 4, 2.0)
    assert pool.get("y") == pool.order()[-1]
    assert pool.skilled["y"] == {pool.workers[pool.order()[-1]]: 2.0}
    pool.update_settings()  # nothing changes
    assert (pool.variance, pool.backlog_history, pool.unskilled_score) == (3.0, 4, 2.0)


def test_pool_decay_follows_the_number_of_workers():
    pool = make_pool("a")
    assert pool.pool_decay == 1 - 1 / 18
    pool.add("b")
    assert pool.pool_decay == 1 - 1 / 36
    pool.remove("a")
    pool.remove("b")
    assert pool.pool_decay == 1 - 1 / 18


# -- introspection ---------------------------------------------------------------


def test_repr():
    pool = make_pool("a", "b")
    pool.get("x")
    text = repr(pool)
    assert text.startswith("<Pool ") and "workers=2" in text and "classes=1" in text
    assert "backlog=1" in text and "variance=1" in text
    assert repr(ClasslessPool()).startswith("<ClasslessPool ")
    assert repr(pool.workers["b"]) == "<PoolWorker 'b' backlog=1 mbacklog=1.00 skills=1>"
    assert repr(PoolWorker(("10.0.0.1", 80))) == (
        "<PoolWorker ('10.0.0.1', 80) backlog=0 mbacklog=0.00 skills=0>")


def test_status_is_json_serialisable():
    pool = Pool(variance=2.5)
    pool.add(("10.0.0.1", 8080), {"x": 2.0, "a": 1.0}, version="1.0")
    pool.add(("10.0.0.2", 8080))
    pool.get("x")
    status = json.loads(json.dumps(pool.status()))
    assert status["policy"] == "Pool"
    assert (status["variance"], status["backlog_history"], status["backlog"]) == (2.5, 9, 1)
    worker = status["workers"][str(("10.0.0.1", 8080))]
    assert worker["skills"] == {"a": 1.0, "x": 2.0}
    assert worker["version"] == "1.0" and worker["backlog"] == 1
    assert list(status["workers"]) == [str(h) for h in pool.order()]
    assert json.loads(json.dumps(ClasslessPool().status()))["policy"] == "ClasslessPool"


# -- randomized invariants -------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_operations_keep_the_invariants(seed):
    rng = random.Random(seed)
    pool = Pool(variance=rng.choice([0.5, 1.0, 4.0]), backlog_history=rng.choice([1, 3, 9]))
    handles = ["w%d" % i for i in range(12)]
    classes = ["c%d" % i for i in range(25)]
    in_flight: list = []
    counts = {"get": 0, "fallback": 0, "skilled": 0}
    for _ in range(5000):
        op = rng.random()
        if op < 0.06:
            pool.add(rng.choice(handles))
        elif op < 0.09:
            pool.remove(rng.choice(handles))
        elif op < 0.14:
            resume = {c: rng.choice([0.0, -1.0, 0.5, 1.0, 3.0, 10.0])
                      for c in rng.sample(classes, rng.randrange(6))}
            pool.new_resume(rng.choice(handles), resume)
        elif op < 0.17:
            pool.update_settings(variance=rng.choice([0.5, 1.0, 4.0]))
        elif op < 0.60 or not in_flight:
            rclass = rng.choice(classes)
            skilled = pool.skilled.get(rclass, {})
            handle = checked_get(pool, rclass)
            if handle is not None:
                in_flight.append(handle)
                counts["get"] += 1
                counts["skilled" if pool.workers[handle] in skilled else "fallback"] += 1
        else:
            # Responses end in any order, some for workers since removed.
            pool.put(in_flight.pop(rng.randrange(len(in_flight))))
        check_invariants(pool)
    # The run went through both branches of the algorithm.
    assert counts["skilled"] > 100 and counts["fallback"] > 50


# -- cost ----------------------------------------------------------------------


class Counter:
    def __init__(self) -> None:
        self.n = 0


class CountingDict(dict):
    """A dict that counts every item any iteration over it yields."""

    def __init__(self, data, counter: Counter) -> None:
        super().__init__(data)
        self.counter = counter

    def _count(self, iterable):
        for item in iterable:
            self.counter.n += 1
            yield item

    def __iter__(self):
        return self._count(super().__iter__())

    def keys(self):
        return self._count(super().keys())

    def values(self):
        return self._count(super().values())

    def items(self):
        return self._count(super().items())


class CountingOrderedDict(OrderedDict):
    def __init__(self, data, counter: Counter) -> None:
        super().__init__(data)
        self.counter = counter

    def __iter__(self):
        for item in super().__iter__():
            self.counter.n += 1
            yield item


def test_get_and_put_touch_only_the_workers_skilled_in_the_class():
    rng = random.Random(42)
    handles = ["w%03d" % i for i in range(100)]
    classes = ["class-%06d" % i for i in range(100_000)]
    resumes: dict = {h: {} for h in handles}
    for rclass in classes:
        for handle in rng.sample(handles, rng.randint(1, 3)):
            resumes[handle][rclass] = rng.uniform(0.5, 5.0)
    pool = Pool()
    for handle in handles:
        pool.add(handle, resumes[handle])
    assert len(pool.skilled) == 100_000

    # Instrument every collection get/put could scan.
    all_workers, all_classes, lru = Counter(), Counter(), Counter()
    per_class = Counter()
    pool.workers = CountingDict(pool.workers, all_workers)
    # (every class live, as after a request of each: see routing/skillmap.py)
    pool.skilled.live = CountingDict(
        {c: CountingDict(s, per_class) for c, s in pool.skilled.items()}, all_classes)
    pool.skilled.dormant = CountingDict({}, all_classes)
    assert isinstance(pool._lru, OrderedDict)  # the LRU order is an ordered dict
    pool._lru = CountingOrderedDict(pool._lru, lru)

    in_flight = []
    for _ in range(5000):
        rclass = rng.choice(classes)
        n_skilled = len(pool.skilled[rclass])
        before = (per_class.n, lru.n)
        handle = pool.get(rclass)
        assert per_class.n - before[0] <= n_skilled
        assert lru.n - before[1] <= 1  # the first item only: the least recently chosen
        in_flight.append(handle)
        if len(in_flight) > 50:
            before = (per_class.n, lru.n)
            pool.put(in_flight.pop(rng.randrange(len(in_flight))))
            assert (per_class.n, lru.n) == before  # put iterates nothing
    assert all_workers.n == 0 and all_classes.n == 0
    assert per_class.n > 0  # the instrumentation did see the skilled scans


# -- ClasslessPool -----------------------------------------------------------------


def classless_choice(pool: ClasslessPool):
    """Least backlog; among equals, the least recently chosen."""
    order = list(pool.order())
    if not order:
        return None
    return min(order, key=lambda h: (pool.workers[h].backlog, order.index(h)))


def test_classless_least_backlog_ties_to_least_recently_chosen():
    pool = make_pool("a", "b", "c", cls=ClasslessPool)
    assert [pool.get("x") for _ in range(3)] == ["c", "b", "a"]  # all idle: LRU order
    assert [pool.get("x") for _ in range(3)] == ["c", "b", "a"]  # all at 1: LRU order
    pool.put("b")
    assert pool.get("x") == "b"  # least backlog beats recency
    pool.put("a")
    pool.put("a")
    assert pool.get("y") == "a" and pool.get("z") == "a"  # a: 0 then 1, others 2
    assert pool.get("x") == "c"  # all at 2 now; c least recently chosen
    assert pool.backlog == 7
    check_invariants(pool)


def test_classless_ignores_resumes():
    pool = ClasslessPool()
    pool.add("a", {"x": 100.0})
    pool.add("b")
    pool.new_resume("b", {"x": 100.0})
    assert not pool.skilled and pool.workers["a"].resume == {}
    assert [pool.get("x"), pool.get("x"), pool.get("x")] == ["b", "a", "b"]
    assert not pool.skilled
    assert all(w.resume == {} for w in pool.workers.values())


def test_classless_random_operations_follow_least_backlog():
    rng = random.Random(5)
    pool = ClasslessPool()
    handles = ["w%d" % i for i in range(8)]
    in_flight: list = []
    for _ in range(3000):
        op = rng.random()
        if op < 0.05:
            pool.add(rng.choice(handles), {"x": 1.0})
        elif op < 0.08:
            pool.remove(rng.choice(handles))
        elif op < 0.6 or not in_flight:
            expected = classless_choice(pool)
            handle = pool.get(rng.choice("xyz"))
            assert handle == expected
            if handle is not None:
                assert list(pool.order())[-1] == handle
                in_flight.append(handle)
        else:
            pool.put(in_flight.pop(rng.randrange(len(in_flight))))
        check_invariants(pool)
        assert not pool.skilled


def test_a_large_resume_is_taken_in_steps_with_the_same_result():
    from zc_lb.routing.pool import RESUME_STEP

    resume = {"c%d" % i: float(i + 1) for i in range(2 * RESUME_STEP + 10)}
    whole, stepped = Pool(), Pool()
    for pool in (whole, stepped):
        pool.add("w")
        pool.new_resume("w", {"old": 1.0, "c0": 5.0})
    pauses = []
    assert stepped.new_resume("w", resume, lambda: pauses.append(len(stepped.skilled))) == \
        whole.new_resume("w", resume)
    assert len(pauses) == 2  # after each RESUME_STEP changed classes
    assert set(stepped.skilled) == set(whole.skilled) and "old" not in stepped.skilled
    assert stepped.workers["w"].resume == whole.workers["w"].resume == resume


def test_a_worker_removed_while_its_resume_is_taken_leaves_no_skill_behind():
    from zc_lb.routing.pool import RESUME_STEP

    pool = Pool()
    pool.add("w")
    pool.add("v", {"shared": 2.0})
    resume = {"c%d" % i: 1.0 for i in range(3 * RESUME_STEP)}
    resume["shared"] = 3.0
    pool.new_resume("w", resume, lambda: pool.remove("w"))
    assert "w" not in pool.workers
    assert list(pool.skilled) == ["shared"]  # only v's
    assert [worker.name for worker in pool.skilled["shared"]] == ["v"]


def test_a_resume_score_of_none_drops_its_class():
    # None for a class the worker had no score in compared equal to the
    # missing score, and stayed in its résumé (an int key too): status()
    # could not sort them.
    pool = Pool()
    pool.add("w")
    pool.new_resume("w", {"a": None, 7: None, "b": 2.0})
    assert pool.workers["w"].resume == {"b": 2.0}
    json.dumps(pool.status())
