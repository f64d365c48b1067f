"""Tests for zc_lb.routing.relearn: the book of keys, moved keys followed, stale skills and resets."""

from __future__ import annotations

import gc
import random
from collections import Counter
from zlib import crc32

import pytest

from zc_lb.routing import relearn
from zc_lb.routing.affinity import AffinityPool
from zc_lb.routing.classstats import mixed
from zc_lb.routing.relearn import ADOPTED, SHARED, adopted, floor_weight


def pool_of(n: int, **settings) -> AffinityPool:
    pool = AffinityPool(**settings)
    for i in range(n):
        pool.add("w%d" % i)
    return pool


def booked(pool: AffinityPool, rclass: str, key: str):
    """Route one request; its handle, and the book's hash and entry for
    its key."""
    handle = pool.get(rclass, key)
    pool.put(handle)
    book_hash = mixed(crc32(key.encode()) ^ pool.hash_seed)
    return handle, book_hash, pool.book.get(book_hash)


def small_class_on_one_worker():
    """Four workers; "big" (300 keys, nine requests in ten) spreads over
    them, "b" (five keys) lives on one: the pool, and that worker's handle."""
    pool = pool_of(4)
    served = Counter()
    for i in range(2000):
        if i % 10 == 0:
            handle = pool.get("b", "/b/%d" % (i // 10 % 5))
            served[handle] += 1
        else:
            handle = pool.get("big", "/big/%d" % (i % 300))
        pool.put(handle)
    assert len(served) == 1, served  # (the scenario: "b" is a one-worker class)
    return pool, next(iter(served))


def rename(pool: AffinityPool, new: str, requests: int) -> Counter:
    """A changed classifier: "b"'s keys now come as class ``new``."""
    served = Counter()
    for i in range(requests):
        handle = pool.get(new, "/b/%d" % (i % 5))
        pool.put(handle)
        served[handle] += 1
    return served


# -- the book ---------------------------------------------------------------


def test_the_book_remembers_the_class_and_worker_a_key_last_went_to():
    pool = pool_of(3)
    hashes = {}
    for i in range(12):
        rclass, key = "abc"[i % 3], "/%d" % i
        handle, hashes[key], entry = booked(pool, rclass, key)
        assert entry[:3] == (rclass, pool.workers[handle].ident, False)
    assert len(pool.book) == 12 and len(set(hashes.values())) == 12
    assert len({pool.book.get(h)[1] for h in hashes.values()}) > 1  # (several workers)
    again, same_hash, entry = booked(pool, "a", "/0")  # seen again: the same entry
    assert same_hash == hashes["/0"] and len(pool.book) == 12
    assert entry[:3] == ("a", pool.workers[again].ident, False)
    # A number and a string a key: never in the cyclic collector's passes,
    # however many keys the book holds, nor are the classes' keys.
    assert not any(gc.is_tracked(shard) for shard in pool.book.shards)
    assert not gc.is_tracked(pool.book.numbers)
    assert pool.classes["a"].keys and not any(
        gc.is_tracked(stats.keys) for stats in pool.classes.values())


@pytest.mark.parametrize("entry", [
    ("a", 1, False, relearn.AWAY, 0),
    ("", 7, True, 0, 3),  # (an empty class name is a class)
    ("b", (1 << 16) - 1, True, relearn.JOINS_LIMIT - 1, relearn.AGE_LIMIT - 1),
    ("c", 1 << 40, False, 5, 1),  # (an ident past 2**16: a larger number)
    SHARED,
])
def test_the_book_gives_back_each_entry_it_was_given(entry):
    book = relearn.Book(1024)  # (one dict: in order)
    book.put(1, ("x", 2, False, 3, 4))
    book.put(2 ** 64 - 1, entry)
    assert book.get(2 ** 64 - 1) == entry and book.get(1) == ("x", 2, False, 3, 4)
    assert list(book) == [1, 2 ** 64 - 1] and len(book) == 2
    assert book.remove(1) == 2  # (the ident it named)
    assert book.get(1) is None and list(book.items()) == [(2 ** 64 - 1, entry)]
    with pytest.raises(KeyError):
        book.remove(1)  # (not there)


def test_the_book_numbers_a_class_while_it_holds_a_key_of_it():
    book = relearn.Book(1024)  # (one dict: in order)
    for i in range(9):
        book.put(i, ("c%d" % (i % 3), 1, False, 0, 0))
    book.put(9, SHARED)  # (no class: no number)
    assert sorted(book.numbers) == ["c0", "c1", "c2"] and not book.free
    for i in (0, 3, 6):
        book.remove(i)
    assert sorted(book.numbers) == ["c1", "c2"] and len(book.free) == 1
    book.put(10, ("new", 2, False, 0, 0))  # (the freed number, given again)
    assert not book.free and len(book.names) == 4
    assert [book.get(h)[0] for h in book] == ["c1", "c2"] * 3 + [None, "new"]


def test_a_classs_joins_and_the_books_age_are_counted_as_the_book_keeps_them(monkeypatch):
    # Joins and ages wrap at their fields, so that an entry compares equal
    # to the count it was made with.
    pool = pool_of(2)
    pool.relearning.age = relearn.AGE_LIMIT - 1
    monkeypatch.setattr(relearn, "BOOK_SIZE", 16)  # (an age: one new key)
    booked(pool, "a", "/x")
    assert pool.relearning.age == 0
    stats = pool.classes["a"]
    stats.joins = relearn.JOINS_LIMIT - 1
    workers = list(pool.workers.values())
    stats.holders = workers[:1]
    pool.members._new_members(stats, {w: 1.0 for w in workers}, 1)  # (it grew: a join)
    assert stats.joins == 0
    book_hash = booked(pool, "a", "/z")[1]
    assert pool.book.get(book_hash)[3] in (relearn.AWAY, 0)


def test_the_book_names_a_worker_by_a_number_no_later_worker_takes():
    pool = pool_of(2)
    handle, _, entry = booked(pool, "a", "/x")
    gone = pool.workers[handle]
    assert pool.relearning.holder(entry, "a") is gone
    assert pool.relearning.holder(entry, "b") is None  # (a key of another class)
    pool.remove(handle)
    assert pool.relearning.holder(entry, "a") is None
    pool.add(handle)  # back, under the same handle: a new record, a new number
    assert pool.workers[handle].ident not in (0, gone.ident)
    assert pool.relearning.holder(entry, "a") is None


def test_a_key_seen_in_a_second_class_is_moved_and_in_a_third_is_shared_for_good():
    pool = pool_of(3)
    _, book_hash, _ = booked(pool, "a", "/x")
    handle, same_hash, entry = booked(pool, "b", "/x")  # the same path: one entry
    assert same_hash == book_hash and len(pool.book) == 1
    assert entry[:3] == ("b", pool.workers[handle].ident, True)
    assert booked(pool, "c", "/x")[2] == SHARED  # moved twice: in several classes
    assert booked(pool, "a", "/x")[2] == SHARED  # and it stays so
    assert booked(pool, "c", "/x")[2] == SHARED


def test_the_book_is_bounded_and_forgets_the_least_recently_seen_key_first(monkeypatch):
    monkeypatch.setattr(relearn, "BOOK_SIZE", 8)
    pool = pool_of(3)
    hashes = {key: booked(pool, "a", key)[1] for key in ("/k%d" % i for i in range(8))}
    assert len(pool.book) == 8
    booked(pool, "a", "/k0")  # seen again: the most recent now
    hashes["/k8"] = booked(pool, "a", "/k8")[1]
    assert len(pool.book) == 8
    assert pool.book.get(hashes["/k1"]) is None  # the least recently seen went
    assert pool.book.get(hashes["/k0"]) and pool.book.get(hashes["/k8"])
    for i in range(9, 40):
        booked(pool, "a", "/k%d" % i)
    assert len(pool.book) == 8


def test_a_large_book_forgets_its_oldest_keys_in_batches(monkeypatch):
    # A dict finds its oldest key by a scan from its start: the book
    # lets a 256th more in, then sweeps down to its size at once.  A key
    # seen again goes to the end once an age (a sixteenth of new keys).
    monkeypatch.setattr(relearn, "BOOK_SIZE", 1024)
    pool = pool_of(3)
    hashes = [booked(pool, "a", "/k%d" % i)[1] for i in range(1028)]
    assert list(pool.book) == hashes  # (four over, none forgotten yet)
    booked(pool, "a", "/k0")  # seen again: the most recent now
    hashes.append(booked(pool, "a", "/k1028")[1])
    assert list(pool.book) == hashes[6:1028] + [hashes[0], hashes[1028]]  # 5 least recent went
    booked(pool, "a", "/k0")  # again in the same age (no new key since): left where it is
    assert list(pool.book)[-2:] == [hashes[0], hashes[1028]]
    assert sum(w.booked for w in pool.workers.values()) == 1024
    assert not gc.is_tracked(pool.book.shards[0])  # (numbers: never walked by the collector)


def test_a_book_of_the_default_size_is_split_in_shards_each_forgetting_its_oldest():
    # A dict that keys come and go through is rebuilt now and then, all at
    # once: in sixteen shards each rebuild is a sixteenth of the book's.
    book = relearn.Book(relearn.BOOK_SIZE)
    assert len(book.shards) == relearn.BOOK_SIZE // relearn.SHARD_KEYS == 16
    assert book.limit * len(book.shards) == relearn.BOOK_SIZE
    rng = random.Random(3)
    order = []  # every hash put, oldest first
    forgotten = 0
    for i in range(3 * relearn.BOOK_SIZE):
        book_hash = rng.getrandbits(64)
        book.put(book_hash, ("c%d" % (i % 5), 1 + i % 3, False, 0, 0))
        order.append(book_hash)
        if book.crowded(book_hash):
            oldest = book.oldest(book_hash)
            shard = book.shards[book_hash & book.mask]
            assert oldest == list(shard)[:len(shard) - book.limit]
            for old in oldest:
                book.remove(old)
            forgotten += len(oldest)
            assert len(shard) == book.limit
    assert all(len(shard) <= book.limit * 257 // 256 for shard in book.shards)
    assert relearn.BOOK_SIZE <= len(book) <= relearn.BOOK_SIZE * 257 // 256
    assert len(book) + forgotten == len(order)
    # Each shard kept its newest keys: across the book, those held are the
    # most recent to within a shard's luck of the hash.
    held = set(book)
    assert held == {h for h in order if book.get(h) is not None}
    newest = order[-relearn.BOOK_SIZE:]
    assert sum(h in held for h in newest) > 0.97 * relearn.BOOK_SIZE
    assert sum(h in held for h in order[:-relearn.BOOK_SIZE * 5 // 4]) == 0


def test_a_book_under_twice_a_shard_is_one_dict():
    assert len(relearn.Book(2 * relearn.SHARD_KEYS - 1).shards) == 1
    assert len(relearn.Book(2 * relearn.SHARD_KEYS).shards) == 2
    assert len(relearn.Book(8).shards) == 1


def test_each_worker_counts_the_keys_the_book_says_went_to_it(monkeypatch):
    # New keys, keys moved on, keys of several classes (SHARED, no one's)
    # and keys the bounded book forgets: the counts follow the book.
    monkeypatch.setattr(relearn, "BOOK_SIZE", 50)
    pool = pool_of(3)
    rng = random.Random(7)
    in_flight = []
    for i in range(600):
        rclass = rng.choice("ab")
        handle = pool.get(rclass, "/k%d" % rng.randrange(80))
        in_flight.append(handle)  # (backlogs build up: the bound moves keys on)
        if len(in_flight) > rng.randrange(1, 12):
            pool.put(in_flight.pop(rng.randrange(len(in_flight))))
        tally = Counter(entry[1] for _, entry in pool.book.items() if entry[1])
        assert {w: w.booked for w in pool.workers.values()} == {
            w: tally[w.ident] for w in pool.workers.values()}, i
    assert len(pool.book) == 50
    assert any(entry == SHARED for _, entry in pool.book.items())


# -- a changed classifier -------------------------------------------------------


def test_a_renamed_class_follows_its_keys_to_the_worker_that_holds_them():
    pool, holder = small_class_on_one_worker()
    elsewhere = next(h for h in pool.workers if h != holder)
    pool.new_resume(elsewhere, {"c": 10.0})  # "c"'s old member, with other data
    served = rename(pool, "c", 20)
    assert served[holder] >= 18  # the first key came before the move was known
    worker = pool.workers[holder]
    assert set(pool.skilled["c"]) == {worker} and pool.adoptions == 1
    floors = pool.classes["c"].floors
    assert floors == {worker: ADOPTED} and floor_weight(floors[worker]) == 1.0
    assert pool.classes["c"].following
    old = pool.workers[elsewhere]
    assert "c" not in old.resume and pool.stale == {old: {"c"}}


def test_the_old_member_the_keys_came_from_is_followed_not_left_stale():
    pool, holder = small_class_on_one_worker()
    elsewhere = next(h for h in pool.workers if h != holder)
    for handle in (holder, elsewhere):  # both skilled in "c" before the change
        pool.new_resume(handle, {"c": 10.0})
    rename(pool, "c", 20)
    worker, old = pool.workers[holder], pool.workers[elsewhere]
    assert pool.stale == {old: {"c"}}
    assert set(pool.skilled["c"]) == {worker}
    pool.new_resume(holder, {"c": 12.0})  # its next résumé counts
    assert pool.skilled["c"][worker] == 12.0


def test_a_stale_skill_counts_for_nothing_until_the_workers_resume_drops_it():
    pool, holder = small_class_on_one_worker()
    elsewhere = next(h for h in pool.workers if h != holder)
    pool.new_resume(elsewhere, {"c": 10.0})
    rename(pool, "c", 20)
    old = pool.workers[elsewhere]
    version = pool.classes["c"].version
    touched = pool.new_resume(elsewhere, {"c": 50.0, "d": 3.0})  # it still lists "c"
    assert "c" in touched and pool.classes["c"].version == -1 != version
    assert "c" not in old.resume and old not in pool.skilled["c"]
    assert old.resume == {"d": 3.0} and pool.stale == {old: {"c"}}
    pool.new_resume(elsewhere, {"d": 3.0})  # dropped: no longer stale
    assert pool.stale == {}
    pool.new_resume(elsewhere, {"c": 50.0, "d": 3.0})  # learned again: it counts
    assert pool.skilled["c"][old] == 50.0


def test_a_class_that_followed_its_keys_settles_and_drops_the_floors():
    pool, holder = small_class_on_one_worker()
    rename(pool, "c", 20)
    stats = pool.classes["c"]
    assert stats.following and stats.floors
    rename(pool, "c", 1000)  # keys it already had: the moves fade
    assert not stats.following and stats.senders is None
    assert not stats.floors or not any(adopted(ratio) for ratio in stats.floors.values())
    assert pool.workers[holder] in pool.skilled["c"]


def test_keys_from_a_worker_that_is_gone_are_not_followed():
    pool, holder = small_class_on_one_worker()
    gone = pool.workers[holder]
    pool.remove(holder)
    served = rename(pool, "c", 20)
    assert holder not in served and set(served) <= set(pool.workers)
    assert pool.adoptions == 0 and not pool.classes["c"].following
    assert gone not in pool.skilled["c"]


def test_removing_a_worker_drops_its_votes_as_a_sender():
    # A worker gone leaves no trace in a class's books: its votes would
    # hold it (and its résumé) in memory, and stand as the top sender that
    # another worker's keys must reach half of before they are followed.
    pool, holder = small_class_on_one_worker()
    rename(pool, "c", 20)
    stats, gone = pool.classes["c"], pool.workers[holder]
    assert stats.following and gone in stats.senders
    pool.remove(holder)
    assert gone not in (stats.senders or {})


def test_removing_a_worker_forgets_its_stale_skills():
    pool, holder = small_class_on_one_worker()
    elsewhere = next(h for h in pool.workers if h != holder)
    pool.new_resume(elsewhere, {"c": 10.0})
    rename(pool, "c", 20)
    assert pool.stale
    pool.remove(elsewhere)
    assert pool.stale == {}


def test_adopted_is_a_mark_no_starters_floor_takes_and_weighs_the_mean():
    # A starter's floor may be 1.0 too: it must not pass for an adopted one.
    assert adopted(ADOPTED) and adopted(None)
    assert not adopted(1.0) and not adopted(0.0) and not adopted(2.5)
    assert floor_weight(ADOPTED) == 1.0 and floor_weight(0.75) == 0.75


# -- resets --------------------------------------------------------------------


def test_reset_skills_forgets_every_skill_and_stale_mark_and_keeps_the_book():
    pool, holder = small_class_on_one_worker()
    elsewhere = next(h for h in pool.workers if h != holder)
    pool.new_resume(elsewhere, {"c": 10.0})
    rename(pool, "c", 20)
    assert pool.stale and pool.skilled
    book = list(pool.book.items())
    version = pool.skills_version
    pool.reset_skills()
    assert pool.stale == {} and not pool.skilled
    assert all(not w.resume for w in pool.workers.values())
    assert pool.book and list(pool.book.items()) == book
    assert all(stats.reset for stats in pool.classes.values())
    assert pool.skills_version > version and pool.resets == 1
    # every class unknown now: no reset by itself until most are known again
    assert pool.unskilled == pool.total and not pool.relearn_armed
    rename(pool, "c", 1)  # the book sends "c" back: a skill the LB gave
    assert pool.workers[holder].given == {"c"}
    pool.reset_skills()
    assert not pool.workers[holder].given and pool.resets == 2


def test_after_a_reset_a_key_whose_last_worker_is_gone_goes_to_a_live_one():
    pool = pool_of(4, footprint_window=500)
    last = None
    for i in range(300):
        last = pool.get("a", "/a/%d" % (i % 10))
        pool.put(last)
    before = pool.get("a", "/a/9")
    pool.put(before)
    pool.reset_skills()
    gone = pool.workers[before]
    pool.remove(before)
    handle = pool.get("a", "/a/9")  # the book says: the worker removed
    pool.put(handle)
    assert handle in pool.workers and handle != before
    assert gone not in pool.skilled.get("a", {})


def test_a_new_pool_does_not_reset_itself_in_its_first_footprint_window():
    # Every request of a pool just started hits a class nobody knows yet.
    pool = pool_of(4, footprint_window=100)
    for i in range(100):
        pool.put(pool.get("n%d" % i, "/"))
    assert pool.resets == 0 and not pool.relearn_armed
    assert pool.unskilled > relearn.RELEARN_SHARE * pool.total  # (it would have, armed)


def test_a_pool_that_never_knew_most_of_its_classes_never_resets_itself():
    # 64 classes over 4 workers with a window of 100: every class's
    # requests are few, so most hit one no worker knew yet.  It reset all
    # skills at request 101 with no classifier change.
    pool = pool_of(4, footprint_window=100)
    for i in range(1000):
        pool.put(pool.get("c%d" % (i % 64), "/"))
    assert pool.resets == 0


def test_an_operators_reset_is_not_followed_by_one_of_the_pools_own():
    # After reset_skills every class is unknown; with many classes most
    # requests then hit one, and the pool reset itself again, losing what
    # résumés had taught it since.
    pool = pool_of(4, footprint_window=100)
    for i in range(2000):
        pool.put(pool.get("c%d" % (i % 8), "/p%d" % (i % 30)))
    assert pool.relearn_armed
    pool.reset_skills()
    for i in range(300):
        pool.put(pool.get("c%d" % (i % 70), "/"))
    assert pool.resets == 1


def test_an_automatic_reset_disarms_until_few_requests_hit_unknown_classes():
    pool = pool_of(3, footprint_window=100)
    for i in range(300):
        pool.put(pool.get("site", "/p%d" % (i % 20)))
    for i in range(400):  # a new classifier: every class unknown
        pool.put(pool.get("new%d" % i, "/"))
    assert pool.resets == 1 and not pool.relearn_armed
    for i in range(30):  # known classes again, but not yet for long
        pool.put(pool.get("site", "/p%d" % (i % 20)))
    assert not pool.relearn_armed
    for i in range(300):
        pool.put(pool.get("site", "/p%d" % (i % 20)))
    assert pool.relearn_armed
    assert pool.unskilled < relearn.RELEARN_SHARE / 2 * pool.total


def test_a_reset_during_a_resumes_pauses_leaves_skills_and_resume_agreeing():
    # A reset while a large résumé was taken in steps (the LB's loop runs
    # between them) cut the intake's copy loose, and the worker's résumé
    # was set back to it at the end: classes it listed that the skill map
    # did not, and the worker's next résumé, with the same scores, never
    # brought them back.
    from zc_lb.routing.pool import RESUME_STEP

    pool = AffinityPool()
    pool.add("w", {"old%d" % i: 2.0 for i in range(5)})
    pool.add("v")
    resume = {"c%d" % i: 3.0 for i in range(2 * RESUME_STEP + 5)}
    resets = []

    def pause():
        if not resets:
            resets.append(pool.reset_skills())

    pool.new_resume("w", resume, pause)
    worker = pool.workers["w"]
    assert resets
    assert all(pool.skilled.get(rclass, {}).get(worker) == score
               for rclass, score in worker.resume.items())
    pool.new_resume("w", dict(resume))  # (the same skills again: all of them back)
    assert all(worker in pool.skilled.get(rclass, {}) for rclass in resume)
