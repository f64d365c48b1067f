"""Siblings (``--processes``): the shared book of keys and requests in
flight, and two pools routing as one through them."""

import mmap
import os
import struct

import pytest

from zc_lb.routing import siblings
from zc_lb.routing.affinity import AffinityPool
from zc_lb.errors import ConfigurationError
from zc_lb.routing.pool import Pool
from zc_lb.routing.siblings import Siblings, sync


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_a_key_placed_by_one_sibling_is_read_by_the_other():
    one, two = Siblings.in_memory(2)
    worker = one.worker_hash("w:1")
    assert two.placed(12345, 7) == 0  # nobody placed it
    one.place(12345, 7, worker)
    assert two.placed(12345, 7) == worker == two.worker_hash("w:1")
    assert two.placed(12345, 8) == 0  # the same key in another class says nothing


def test_a_slot_taken_by_another_key_or_torn_says_nothing():
    one, two = Siblings.in_memory(2)
    one.place(5, 7, 99)
    one.place(5 + siblings.BOOK_SLOTS, 7, 98)  # the same slot, another key
    assert two.placed(5, 7) == 0
    assert two.placed(5 + siblings.BOOK_SLOTS, 7) == 98
    # a write torn by two siblings at once: a worker from one, a check from the other
    offset = two.book_offset + 6 * siblings.SLOT.size
    one.place(6, 7, 97)
    struct.pack_into("<Q", one.segment, offset + 16, 96)
    assert two.placed(6, 7) == 0


def test_requests_in_flight_add_up_over_the_other_siblings():
    clock = Clock()
    one, two, three = Siblings.in_memory(3, clock)
    for sibling in (one, two, three):
        sibling.worker_hash("w:1"), sibling.worker_hash("w:2")
    two.publish({"w:1": 2, "w:2": 0})
    three.publish({"w:1": 1, "w:2": 4, "w:3": 5})
    # w:3 is a worker one does not know (yet): left out
    assert one.elsewhere()[0] == {"w:1": 3, "w:2": 4}
    one.publish({"w:1": 1})
    assert two.elsewhere()[0] == {"w:1": 2, "w:2": 4}


def test_the_measures_of_locality_add_up_over_the_other_siblings():
    one, two, three = Siblings.in_memory(3)
    two.publish({}, (6.0, 2.0))
    three.publish({}, (3.0, 1.0))
    one.publish({}, (100.0, 1.0))
    assert one.elsewhere()[1:] == (9.0, 3.0)
    pools = sibling_pools(2)
    pools[1].locality.ratio, pools[1].locality.weight = 40.0, 10.0
    assert pools[0].locality.pool_gain() is None  # (no away request of its own yet)
    for pool in pools[::-1] + pools:
        sync(pool.siblings, pool)
    assert pools[0].locality.pool_gain() == 4.0  # the sibling's measure counts


def test_a_row_not_written_for_a_second_counts_nothing():
    clock = Clock()
    one, two = Siblings.in_memory(2, clock)
    one.worker_hash("w:1")
    two.publish({"w:1": 3})
    clock.now += siblings.STALE / 2
    assert one.elsewhere()[0] == {"w:1": 3}
    clock.now += siblings.STALE  # (a child that died: nothing in flight any more)
    assert one.elsewhere()[0] == {}


def test_a_row_being_written_is_not_read():
    one, two = Siblings.in_memory(2)
    one.worker_hash("w:1")
    two.publish({"w:1": 3})
    row = siblings.HEADER_SIZE + 1 * (siblings.ROW_HEAD_SIZE + siblings.MAX_WORKERS * 16)
    struct.pack_into("<Q", two.segment, row, two.seq + 1)  # odd: in the middle of a write
    assert one.elsewhere()[0] == {}
    assert one.torn == 3  # read again twice, then left for the next exchange


def test_a_child_started_again_forgets_what_it_had_in_flight():
    segment = mmap.mmap(-1, siblings.segment_size(2))
    siblings.HEADER.pack_into(segment, 0, siblings.MAGIC, 2, siblings.BOOK_SLOTS,
                              siblings.MAX_WORKERS)
    one, two = Siblings(segment, 0), Siblings(segment, 1)
    one.worker_hash("w:1")
    two.publish({"w:1": 3})
    assert one.elsewhere()[0] == {"w:1": 3}
    Siblings(segment, 1)  # the child started again, with the same index
    assert one.elsewhere()[0] == {}


def test_the_supervisors_segment_is_shared_through_its_descriptor():
    fd = siblings.create(2)
    try:
        one, two = Siblings.attach(fd, 0), Siblings.attach(fd, 1)
        one.place(1, 2, 3)
        assert two.placed(1, 2) == 3
        assert not os.get_inheritable(fd)  # (children get it by pass_fds alone)
    finally:
        os.close(fd)


def test_another_layout_or_index_is_refused_with_a_clear_message():
    segment = mmap.mmap(-1, siblings.segment_size(2))
    siblings.HEADER.pack_into(segment, 0, b"zclbsib0", 2, siblings.BOOK_SLOTS,
                              siblings.MAX_WORKERS)
    with pytest.raises(ConfigurationError, match="another layout.*same version"):
        Siblings(segment, 0)
    siblings.HEADER.pack_into(segment, 0, siblings.MAGIC, 2, siblings.BOOK_SLOTS,
                              siblings.MAX_WORKERS)
    with pytest.raises(ConfigurationError, match="index 2 outside the 2 siblings"):
        Siblings(segment, 2)
    read, write = os.pipe()
    try:
        with pytest.raises(ConfigurationError, match="not a zc-lb shared segment"):
            Siblings.attach(read, 0)
    finally:
        os.close(read), os.close(write)
    with pytest.raises(ConfigurationError, match="--siblings-fd %d: .*Bad file" % read):
        Siblings.attach(read, 0)  # (closed)


def test_a_pool_counts_its_siblings_requests_in_its_backlogs():
    pool = Pool()
    for name in ("w:1", "w:2"):
        pool.add(name)
    pool.put(pool.get("c"))
    assert pool.get(None) == "w:1"  # (no class: the least busy, the least recently chosen)
    assert pool.take_elsewhere({"w:1": 2, "w:2": 5}) == {"w:1": 1, "w:2": 0}
    assert (pool.workers["w:1"].backlog, pool.workers["w:2"].backlog, pool.backlog) == (3, 5, 8)
    assert pool.get(None) == "w:1"  # the less busy, counting the siblings' requests
    status = pool.status()
    assert (status["workers"]["w:1"]["backlog"], status["workers"]["w:1"]["siblings_backlog"],
            status["backlog"]) == (2, 2, 2)
    assert pool.take_elsewhere({"w:2": 1}) == {"w:1": 2, "w:2": 0}
    assert (pool.workers["w:1"].backlog, pool.workers["w:2"].backlog, pool.backlog) == (2, 1, 3)
    for _ in range(3):  # a put past its own requests (a removal's race) leaves the siblings'
        pool.put("w:2")
    assert pool.workers["w:2"].backlog == 1


def sibling_pools(count=2, workers=4):
    pools = []
    for one in Siblings.in_memory(count):
        pool = AffinityPool()
        for i in range(workers):
            pool.add("w:%d" % i)
        pool.share_with(one)
        pools.append(pool)
    return pools


def test_sibling_pools_send_a_key_where_either_sent_it():
    one, two = sibling_pools()
    for i in range(40):  # keys new to both: each goes where the first to see it sent it
        key = "/page/%d" % i
        first = one.get("site", key)
        one.put(first)
        busy = [two.get(None) for _ in range(i % 3)]  # more load on two than on one
        assert two.get("site", key) == first, key
        for handle in busy + [first]:
            two.put(handle)


def test_sibling_pools_recruit_the_same_worker_into_a_class():
    one, two = sibling_pools(workers=6)
    for pool in (one, two):  # different loads: alone, they would recruit apart
        pool.workers["w:0"].held = 5.0 if pool is one else 0.0
        pool.workers["w:3"].held = 0.0 if pool is one else 5.0
    for i in range(4):
        for pool in (one, two):
            pool.put(pool.get("c%d" % i, "/k"))
    assert {c: set(w.name for w in one.skilled[c]) for c in one.skilled} == \
        {c: set(w.name for w in two.skilled[c]) for c in two.skilled}


def test_sync_exchanges_a_pools_requests_in_flight():
    one, two = sibling_pools()
    siblings_one, siblings_two = one.siblings, two.siblings
    handle = one.get("site", "/a")
    sync(siblings_one, one)  # one says what it has in flight
    sync(siblings_two, two)  # two takes it in
    assert two.workers[handle].backlog == two.workers[handle].elsewhere == 1
    one.put(handle)
    sync(siblings_one, one), sync(siblings_two, two)
    assert two.workers[handle].backlog == 0
    sync(None, two)  # (an LB without siblings: nothing)


def test_a_row_counts_the_busy_workers_of_a_pool_past_its_row_size():
    # Every worker went into a sibling's row, idle or not, in pool order:
    # past MAX_WORKERS, the requests in flight on the later ones were
    # never counted, however few the busy ones.
    a, b = Siblings.in_memory(2)
    pools = AffinityPool(), AffinityPool()
    for pool, sibling in zip(pools, (a, b)):
        for i in range(siblings.MAX_WORKERS + 100):
            pool.add("w%d" % i)
        pool.share_with(sibling)
    busy = ["w%d" % i for i in range(siblings.MAX_WORKERS, siblings.MAX_WORKERS + 100)]
    for name in busy:
        pools[1].workers[name].backlog += 1
        pools[1].backlog += 1
    sync(b, pools[1])
    sync(a, pools[0])
    assert {name for name, w in pools[0].workers.items() if w.elsewhere == 1} == set(busy)


def test_a_worker_in_the_pool_twice_stays_known_to_the_siblings_when_one_goes():
    # Its old connection and its new one, both named by its address: the
    # old one's removal took the new one out of the siblings' map, and their
    # placements and recruits for it were ignored.
    me, _ = Siblings.in_memory(2)
    pool = AffinityPool()
    pool.share_with(me)
    pool.add("old", {"a": 5.0}, name="10.0.0.1:8000")
    pool.add("other", {"a": 1.0}, name="10.0.0.2:8000")
    pool.add("new", {"a": 5.0}, name="10.0.0.1:8000")
    pool.remove("old")
    assert pool.by_hash[me.worker_hash("10.0.0.1:8000")] is pool.workers["new"]


def test_a_pool_of_another_policy_counts_its_siblings_requests_on_a_worker_it_never_chose():
    # A sibling read back only the workers it had named, and a published
    # pool named a worker only once it had a request of its own on it: the
    # siblings' requests on the others were not counted, and it sent its
    # next ones to the busiest.
    one, two = Siblings.in_memory(2)
    pools = Pool(), Pool()
    for pool in pools:
        pool.add("w:1"), pool.add("w:2")
    sync(two, pools[1])  # (the second's exchanges, before and after the first's requests)
    for _ in range(5):  # (the first sibling's five requests, all on w:1)
        pools[0].workers["w:1"].backlog += 1
        pools[0].backlog += 1
    sync(one, pools[0])
    sync(two, pools[1])
    assert (pools[1].workers["w:1"].backlog, pools[1].workers["w:2"].backlog) == (5, 0)
    assert pools[1].get(None) == "w:2"


def test_a_sibling_forgets_the_names_of_workers_gone_from_its_pool():
    # Workers on ports of the kernel's choice take a new name each time
    # they start again: a sibling kept every name it had seen, for ever.
    one, two = Siblings.in_memory(2)
    pools = AffinityPool(), AffinityPool()
    for pool, sibling in zip(pools, (one, two)):
        pool.share_with(sibling)
    for n in range(2000):
        name = "10.0.0.1:%d" % (40000 + n)
        for pool, sibling in zip(pools, (one, two)):
            pool.add(name)
            pool.put(pool.get("c", "/k"))
            sync(sibling, pool)
            if n >= 4:
                pool.remove("10.0.0.1:%d" % (40000 + n - 4))
    assert len(one.names) < 100 and len(one.worker_hashes) < 100
    pools[1].workers["10.0.0.1:41999"].backlog += 3  # (the workers still in the pool: counted)
    pools[1].backlog += 3
    sync(two, pools[1])
    sync(one, pools[0])
    assert pools[0].workers["10.0.0.1:41999"].elsewhere == 3


def test_a_segment_short_of_its_siblings_rows_is_refused_as_such():
    # It was refused as "process index 0 outside the 2 siblings".
    segment = mmap.mmap(-1, siblings.segment_size(1))
    siblings.HEADER.pack_into(segment, 0, siblings.MAGIC, 2, siblings.BOOK_SLOTS,
                              siblings.MAX_WORKERS)
    with pytest.raises(ConfigurationError, match="is %d bytes, short of the %d its 2 siblings"
                       % (siblings.segment_size(1), siblings.segment_size(2))):
        Siblings(segment, 0)
