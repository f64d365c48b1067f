"""Tests for zc_lb.routing.classstats on its own: the hashes every LB must share
(stable_hash, mix, mixed), rendezvous draws and weights, the k-minimum-values
Sketch, a class's Footprint over windows, and a new ClassStats.

What test_affinity.py checks already (stable_hash against blake2b, the
draw's formula and bounded memo, the 2:1 share of keys at a 2:1 score, a
sketch's estimate of 5,000 hashed keys, a footprint forgotten when idle)
is not repeated here.
"""

from __future__ import annotations

import hashlib
import math
import random

from zc_lb.routing import classstats
from zc_lb.routing.classstats import (MASK64, SKETCH_SIZE, ClassStats, Footprint, Sketch, mix, mixed,
                              rendezvous_draw, rendezvous_weight, stable_hash)

GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment


def blake(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


# -- the hashes ------------------------------------------------------------------


def test_a_key_with_undecodable_bytes_hashes_as_those_bytes():
    # A key decoded with surrogateescape (bytes that are not UTF-8) neither
    # raises nor hashes apart from the bytes it came from.
    raw = b"/caf\xe9/\xff"
    key = raw.decode("utf-8", "surrogateescape")
    assert stable_hash(key) == blake(raw)
    assert stable_hash("/caf\u00e9") == blake("/caf\u00e9".encode("utf-8"))
    assert stable_hash(key) != stable_hash("/caf\u00e9/")


def test_mix_is_splitmix64s_finaliser():
    # The first outputs of splitmix64 seeded with 0 (its reference
    # implementation): every LB of every version must mix alike.
    assert [mix(GOLDEN * n & MASK64) for n in (1, 2, 3)] == [
        0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


def test_mix_spreads_consecutive_inputs_over_all_64_bits():
    outputs = [mix(x) for x in range(4096)]
    assert len(set(outputs)) == len(outputs)  # (a bijection: no two alike)
    assert all(0 <= y <= MASK64 for y in outputs)
    for bit in range(64):
        share = sum(y >> bit & 1 for y in outputs) / len(outputs)
        assert 0.45 < share < 0.55, (bit, share)


def test_mixed_is_mix_whichever_value_last_had_its_slot():
    # Values a multiple of the slots apart share a slot: each takes it from
    # the other, and each is still given its own mix.
    slots = classstats.MEMORY_SLOTS
    values = [0, 1, slots, slots + 1, 5 * slots, stable_hash("k"), stable_hash("k") ^ slots,
              MASK64, MASK64 - slots, -1, -slots]  # (any int has a slot)
    for _ in range(2):  # the second time, each slot holds the last of its values
        for x in values:
            assert mixed(x) == mix(x)
            assert mixed(x) == mix(x)  # (remembered)
    assert len(classstats._MIX_INPUTS) == len(classstats._MIXES) == slots  # (bounded)


# -- rendezvous ------------------------------------------------------------------


def test_the_largest_draw_is_finite():
    # mix(0) is 0: the smallest u there is, about 2**-54, is not 0.
    assert mix(0) == 0
    draw = rendezvous_draw(0)
    assert math.isfinite(draw) and draw > 30


def test_draws_are_exponential_with_mean_1():
    # Weighted rendezvous gives a key to a worker in proportion to its
    # score only if -ln(u) is an exponential draw.
    draws = [rendezvous_draw(stable_hash("d%d" % i)) for i in range(20_000)]
    assert all(draw > 0 for draw in draws)
    assert 0.97 < sum(draws) / len(draws) < 1.03
    median = sorted(draws)[len(draws) // 2]
    assert abs(median - math.log(2)) < 0.03


def test_a_keys_weight_is_the_score_over_the_draw_of_key_xor_salt():
    key, salt = stable_hash("/page"), stable_hash("w1")
    assert rendezvous_weight(key, salt, 3.0) == 3.0 / rendezvous_draw(key ^ salt)
    assert rendezvous_weight(key, salt, 1.0) == rendezvous_weight(salt, key, 1.0)
    assert rendezvous_weight(key, salt, 1.0) != rendezvous_weight(key, salt ^ 1, 1.0)


def test_scaling_every_score_alike_keeps_every_keys_owner():
    salts = [stable_hash("w%d" % i) for i in range(5)]
    scores = [1.0, 2.5, 0.25, 7.0, 3.0]

    def owner(key, factor):
        return max(range(5), key=lambda w: rendezvous_weight(key, salts[w], scores[w] * factor))

    keys = [stable_hash("/k%d" % k) for k in range(500)]
    assert [owner(k, 1.0) for k in keys] == [owner(k, 4.0) for k in keys]
    assert len({owner(k, 1.0) for k in keys}) == 5


# -- Sketch ------------------------------------------------------------------------


def test_sketch_add_says_whether_the_estimate_changed():
    sketch = Sketch()
    values = [(i + 1) << 40 for i in range(SKETCH_SIZE)]
    assert all(sketch.add(v) for v in values)
    assert not sketch.add(values[3])  # seen
    assert not sketch.add(values[-1])  # seen, the largest kept
    assert not sketch.add(values[-1] + 1)  # full, and above the largest kept
    before = sketch.estimate()
    assert sketch.add(1)  # below it: the largest kept goes
    assert sketch.smallest == [1] + values[:-1]
    assert sketch.estimate() > before


def test_sketch_keeps_only_the_smallest_in_order_whatever_the_order_of_adds():
    values = [stable_hash("v%d" % i) for i in range(1000)]
    shuffled = values * 2
    random.Random(5).shuffle(shuffled)
    one, other = Sketch(), Sketch()
    for v in values:
        one.add(v)
    for v in shuffled:
        other.add(v)
    assert one.smallest == other.smallest == sorted(values)[:SKETCH_SIZE]
    assert one.estimate() == other.estimate()


def test_sketch_estimate_of_evenly_spread_values_is_their_number():
    # The k-th smallest of n values spread evenly over 64 bits is at k/n of
    # the range: the estimate (k - 1) / that is n, whatever n.
    for n in (SKETCH_SIZE, 1000, 10_000, 1_000_000):
        step = (1 << 64) // n
        sketch = Sketch()
        for i in range(min(n, SKETCH_SIZE * 3)):  # (the rest: above the largest kept)
            sketch.add(i * step)
        assert abs(sketch.estimate() / n - 1) < 0.02, n


def test_sketch_counts_exactly_below_k_and_estimates_from_k():
    sketch = Sketch()
    for i in range(SKETCH_SIZE - 1):
        sketch.add(stable_hash("x%d" % i))
        assert sketch.estimate() == i + 1
    sketch.add(stable_hash("last"))
    assert len(sketch.smallest) == SKETCH_SIZE
    expected = (SKETCH_SIZE - 1) * float(MASK64) / (sketch.smallest[-1] + 1)
    assert sketch.estimate() == expected


# -- Footprint ---------------------------------------------------------------------


def keys(prefix: str, n: int) -> list:
    return [stable_hash("%s%d" % (prefix, i)) for i in range(n)]


def test_a_footprint_counts_the_larger_of_this_window_and_the_last():
    footprint = Footprint(5)
    for key in keys("a", 30):
        footprint.add(key, 5)
    for key in keys("b", 10):
        footprint.add(key, 6)
    assert footprint.estimate(6) == 30  # the last window had more
    for key in keys("c", 30):
        footprint.add(key, 6)
    assert footprint.estimate(6) == 40  # this one has more now: not 70
    assert footprint.estimate(7) == 40  # as the last full window, next
    assert footprint.estimate(8) == 0


def test_a_footprint_forgets_a_window_with_no_key_between():
    footprint = Footprint(0)
    for key in keys("a", 30):
        footprint.add(key, 0)
    assert footprint.add(stable_hash("new"), 2)  # window 1 had no key
    assert footprint.estimate(2) == 1


def test_a_footprint_add_says_what_a_sketch_add_says():
    footprint, sketch = Footprint(0), Sketch()
    values = keys("k", 500) * 2
    random.Random(11).shuffle(values)
    said = [footprint.add(v, 0) for v in values]
    assert said == [sketch.add(v) for v in values]
    assert said.count(True) < 500  # (full: most keys are not among the smallest)
    assert footprint.current.smallest == sketch.smallest


def test_the_first_key_of_a_new_window_changes_the_estimate():
    footprint = Footprint(0)
    for key in keys("a", 500):
        footprint.add(key, 0)
    largest = footprint.current.smallest[-1]
    assert not footprint.add(largest + 1, 0)
    assert footprint.add(largest + 1, 1)


# -- ClassStats --------------------------------------------------------------------


def test_a_class_salt_depends_on_its_name_and_the_seed_alone():
    salt = ClassStats("site.example", 0, seed=7).salt
    assert salt == stable_hash("site.example") ^ 7
    assert ClassStats("site.example", 99, seed=7).salt == salt  # not on the window
    assert ClassStats("site.example", 0).salt == stable_hash("site.example")
    assert ClassStats("site.example", 0, seed=8).salt != salt
    assert ClassStats("other.example", 0, seed=7).salt != salt


def test_a_new_class_has_no_members_worked_out_and_counts_from_its_window():
    stats = ClassStats("c", 12)
    assert stats.members is None and stats.version == -1  # worked out at first use
    assert (stats.count, stats.seen, stats.uses, stats.joins) == (0.0, 0, 0, 0)
    assert stats.footprint.window == 12 and stats.footprint.estimate(12) == 0
    assert stats.floors is None and stats.senders is None and not stats.following


def test_class_stats_hold_no_per_instance_dict():
    # One per class, thousands of classes: slots only.
    stats = ClassStats("c", 0)
    assert not hasattr(stats, "__dict__")
    assert not hasattr(stats.footprint, "__dict__")
    assert not hasattr(stats.footprint.current, "__dict__")


def test_the_largest_hash_draws_a_positive_number_not_minus_zero():
    # mix(x) == 2**64 - 1: u = (2**53 - 0.5) / 2**53 rounded to 1.0 drew
    # -0.0, and a key's weight on that worker divided by zero.
    x = 0xCF9A04AFFA6BADC0
    assert classstats.mix(x) == 2**64 - 1
    assert classstats.rendezvous_draw(x) == 2.0 ** -54
    assert classstats.rendezvous_weight(x, 0, 1.0) == 2.0 ** 54


def test_any_lone_surrogate_hashes_and_escaped_bytes_hash_as_before():
    # A classifier's key with a lone surrogate outside surrogateescape's
    # range raised UnicodeEncodeError from the pool's get().
    from zc_lb.routing.classstats import stable_hash, text_bytes

    assert text_bytes("caf\udce9") == b"caf\xe9"  # (as hashed before)
    assert text_bytes("a\ud800b") == b"a\xed\xa0\x80b"
    assert stable_hash("a\ud800b") != stable_hash("a\ud801b")


def test_an_affinity_key_with_a_lone_surrogate_is_routed():
    from zc_lb.routing.affinity import AffinityPool

    pool = AffinityPool()
    pool.add("w", {"a": 5.0})
    handle = pool.get("a", "/\ud800")
    assert handle == "w"
    pool.put(handle)
