"""The simulator (simulations/): determinism, the cache model, the
comparison policies, and every shipped scenario in a tiny run."""

import collections
import copy
import json
import math
import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from zc_lb.errors import ConfigurationError  # noqa: E402
from zc_lb.simulations import bound, cli, config as config_module  # noqa: E402
from zc_lb.simulations.cache import Holders, LRUCache  # noqa: E402
from zc_lb.simulations.config import POLICIES, Config  # noqa: E402
from zc_lb.simulations.engine import simulate  # noqa: E402
from zc_lb.simulations.policies import BoundedHash  # noqa: E402
from zc_lb.simulations.workload import Workload  # noqa: E402

# small enough to run in well under a second per policy
SMALL = dict(requests=3000, workers=4, sites=12, objects_per_site=200,
             objects_per_request=5, cache_size=400, clients=8, history=50,
             window=300)


def small(**changes):
    values = dict(SMALL)
    values.update(changes)
    return config_module.build(values)


def without_wall(run):
    run = json.loads(json.dumps(run))
    run["summary"].pop("wall_seconds", None)
    return run


@pytest.mark.parametrize("policy", POLICIES)
def test_same_seed_same_result(policy):
    config = small(actions=[{"at": 1500, "do": "add_worker"}])
    assert without_wall(simulate(config, policy)) == without_wall(
        simulate(config, policy))


def test_another_seed_another_result():
    a = simulate(small(seed=1), "published")["summary"]
    b = simulate(small(seed=2), "published")["summary"]
    assert a != b


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("loop", ["closed", "open"])
def test_every_request_is_routed_and_completed(policy, loop):
    changes = {"actions": [{"at": 1000, "do": "remove_worker", "worker": 1},
                           {"at": 2000, "do": "add_worker"}]}
    if loop == "open":
        changes.update(clients=0, arrival_rate=500.0)
    run = simulate(small(**changes), policy)
    assert sum(w["requests"] for w in run["windows"]) == SMALL["requests"]
    assert [e["do"] for e in run["events"]] == ["remove_worker", "add_worker"]


def test_lru_hits_misses_and_eviction_order():
    holders = Holders(10)
    cache = LRUCache(3, holders)
    assert cache.touch_all([1, 2, 3]) == 3
    assert cache.touch(1)  # hit; 1 becomes most recent, 2 is oldest
    assert not cache.touch(4)  # evicts 2
    assert cache.keys() == [3, 1, 4]
    assert 2 not in cache and len(cache) == 3
    assert cache.touch_all([3, 3, 5]) == 1  # 3 hits twice, 5 evicts 1
    assert cache.keys() == [4, 3, 5]
    assert holders.cached == 3 and holders.shared == 0


def test_holders_count_overlap_between_caches():
    holders = Holders(10)
    a, b = LRUCache(2, holders), LRUCache(2, holders)
    a.touch_all([1, 2])
    b.touch_all([2, 3])
    assert (holders.cached, holders.shared) == (3, 1)
    assert holders.overlap() == pytest.approx(1 / 3)
    b.touch(4)  # evicts 2 from b: no longer shared
    assert (holders.cached, holders.shared) == (4, 0)
    a.clear()
    assert (holders.cached, holders.shared) == (2, 0)
    assert list(holders.count) == [0, 0, 0, 1, 1, 0, 0, 0, 0, 0]


def test_lru_checks_size():
    with pytest.raises(ValueError):
        LRUCache(0)


@pytest.mark.parametrize("factor", [1.0, 1.25, 2.0])
def test_bounded_hash_respects_its_bound(factor):
    rng = random.Random(factor)
    policy = BoundedHash(factor, replicas=20)
    for handle in range(7):
        policy.add(handle)
    outstanding = []
    for step in range(5000):
        if outstanding and rng.random() < 0.45:
            policy.put(outstanding.pop(rng.randrange(len(outstanding))))
            continue
        bound = math.ceil(factor * (policy.total + 1) / len(policy.handles))
        handle = policy.get("c%d" % min(int(rng.expovariate(0.3)), 40))
        outstanding.append(handle)
        assert policy.backlog[handle] <= bound
        assert policy.total == len(outstanding)
        if step == 2500:  # membership changes keep the bound
            policy.remove(3)
            outstanding = [h for h in outstanding if h != 3]
            assert policy.total == len(outstanding)


def test_bounded_hash_is_sticky_when_idle():
    policy = BoundedHash(1.25, replicas=20)
    for handle in range(5):
        policy.add(handle)
    first = policy.get("site")
    policy.put(first)
    assert all(policy.get("site") == first and policy.put(first) is None
               for _ in range(10))


def test_bounded_hash_rejects_factor_below_one():
    with pytest.raises(ValueError):
        BoundedHash(0.9)


def test_resume_pool_beats_least_backlog_on_misses():
    config = config_module.build(dict(requests=20000, workers=8, sites=40,
                                      objects_per_site=500, cache_size=2000,
                                      clients=32, history=100))
    resume = simulate(config, "published")["summary"]
    least = simulate(config, "least_backlog")["summary"]
    assert resume["misses_per_request"] < 0.5 * least["misses_per_request"]
    assert resume["throughput"] > least["throughput"]


def test_hot_class_and_new_worker_metrics():
    config = small(actions=[{"at": 1000, "do": "hot_site", "site": 6,
                             "fraction": 0.3},
                            {"at": 1500, "do": "add_worker"}])
    summary = simulate(config, "published")["summary"]
    assert 0 < summary["hot_worker_share"] <= 1
    assert 0 < summary["hot_backlog_share"] <= 1
    assert summary["fair_share"] == pytest.approx(1 / 5)
    assert 0 <= summary["new_worker_share"] <= 1


def test_scaled_moves_actions_with_requests():
    config = Config(requests=200000, actions=[{"at": 100000, "do": "add_worker"}])
    tiny = config_module.scaled(config, 0.01)
    assert tiny.requests == 2000 and tiny.actions[0]["at"] == 1000
    assert config.actions[0]["at"] == 100000  # the original is untouched


def test_unknown_parameters_and_policies_are_refused(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"requets": 5}')
    with pytest.raises(ValueError, match="requets"):
        config_module.load(str(path))
    with pytest.raises(ValueError, match="nope"):
        config_module.build({"policies": ["nope"]})


@pytest.mark.parametrize("text, error", [
    ('{"workers": 3,', "bad.json: not a JSON scenario"),
    ('[3]', "bad.json: not a JSON object of parameters"),
    ('{"workers": "six"}', "workers must be int, not 'six'"),
    ('{"busy_members": 1}', "busy_members must be bool, not 1"),
    ('{"workers": 0}', "need workers >= 1"),
    ('{"warmup": 1.0}', "need 0 <= warmup < 1"),
])
def test_a_bad_scenario_file_is_a_clear_error_of_the_simulator_and_the_oracle(
        tmp_path, text, error):
    from zc_lb.simulations import oracle

    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(SystemExit, match="^simulate: .*" + error):
        cli.main([str(path), "--no-plots"])
    with pytest.raises(SystemExit, match="^oracle: .*" + error):
        oracle.main([str(path)])
    with pytest.raises(SystemExit, match="^simulate: need site_depth >= 1"):
        cli.main(["nasa", "--site-depth", "0", "--no-plots"])


@pytest.mark.parametrize("scenario", cli.shipped())
def test_every_scenario_runs_tiny(scenario, capsys):
    assert cli.main([scenario, "--scale", "0.01", "--no-plots", "--json",
                     "--workers", "6", "--sites", "60",
                     "--objects-per-site", "300", "--cache-size", "600"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["scenario"] == scenario
    assert [r["policy"] for r in result["runs"]] == list(POLICIES)
    for run in result["runs"]:
        assert sum(w["requests"] for w in run["windows"]) == result["config"]["requests"]
        assert run["summary"]["requests"] > 0


def test_shipped_scenarios():
    assert set(cli.shipped()) >= {"steady", "add_worker", "remove_worker",
                                  "hot_class", "changed_classifier",
                                  "light_load"}


def test_the_perfect_partition_is_one_lru_of_all_the_caches():
    # LRU is a stack algorithm: a bigger cache holds what a smaller one
    # would, so its misses never exceed the smaller one's.
    bounds = [bound.partition_misses(small(cache_size=size)) for size in (50, 200, 800, 5000)]
    assert bounds == sorted(bounds, reverse=True) and bounds[0] > bounds[2]
    # With room for every object (7,200 of them), only first touches miss.
    big = small(cache_size=5000)
    workload, seen, first = Workload(big, random.Random(big.seed)), set(), 0
    for issued in range(big.requests):
        objects = workload.next()[2]
        if issued >= int(big.warmup * big.requests):
            first += len(set(objects) - seen)
        seen.update(objects)
    assert bounds[-1] == first / (big.requests - int(big.warmup * big.requests)) > 0
    # Scenarios whose caches change have none; those whose requests change
    # take the change at the same request as the engine.
    assert bound.partition_misses(small(actions=[{"at": 1000, "do": "add_worker"}])) is None
    hot = small(actions=[{"at": 1500, "do": "hot_site", "site": 3, "fraction": 0.9}])
    assert bound.partition_misses(hot) != bound.partition_misses(small())
    # A mixed fleet pools all its caches.
    assert (bound.partition_misses(small(cache_sizes=[100, 300]))
            == bound.partition_misses(small(cache_size=200)))


def test_the_table_and_json_say_the_perfect_partition(capsys):
    argv = ["steady", "--scale", "0.005", "--no-plots", "--policies", "affinity,least_backlog"]
    assert cli.main(argv) == 0
    line = [line for line in capsys.readouterr().out.splitlines() if "partition" in line]
    assert len(line) == 1 and "affinity" in line[0] and "least_backlog" in line[0], line
    assert cli.main(argv + ["--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    partition = result["partition_misses_per_request"]
    assert 0 < partition < min(r["summary"]["misses_per_request"] for r in result["runs"])
    assert cli.main(["add_worker", "--scale", "0.005", "--no-plots", "--json",
                     "--policies", "least_backlog"]) == 0
    assert json.loads(capsys.readouterr().out)["partition_misses_per_request"] is None


def test_table_and_plot(tmp_path, capsys):
    assert cli.main(["add_worker", "--scale", "0.005", "--out", str(tmp_path),
                     "--policies", "affinity,published,least_backlog",
                     "--objects-per-site", "200"]) == 0
    out = capsys.readouterr().out
    assert "published" in out and "least_backlog" in out and "new wk" in out
    assert (tmp_path / "add_worker.png").stat().st_size > 1000


def test_a_plot_directory_that_cannot_be_made_is_refused_before_any_run(tmp_path, capsys):
    # It failed with a traceback after the first table, and a sweep's
    # other runs were lost.
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit, match="^simulate: --out: .*Not a directory.*--no-plots"):
        cli.main(["steady", "--scale", "0.005", "--policies", "round_robin",
                  "--sweep", "lbs=1,2", "--out", str(tmp_path / "file" / "plots")])
    assert "scenario steady" not in capsys.readouterr().out


# -- the affinity policy against the published one, on small runs ----------------

NASA_LOG = ROOT / "playback" / "logs" / "nasa_aug95_first20k.log"


def scenario(name, **changes):
    values = config_module.load(str(ROOT / "simulations" / "scenarios" / (name + ".json")))
    values.update(changes)
    return config_module.build(values)


_summaries: dict = {}


def summary_of(config, policy):
    """``simulate(config, policy)``'s summary, run once for this module:
    a run is the same for the same config (test_same_seed_same_result),
    and the tests of the logs below look at the same runs (NASA's seeds
    1-3 under affinity, mixed_fleet's 60,000 requests) for different
    things."""
    key = (repr(config), policy)
    if key not in _summaries:
        _summaries[key] = simulate(config, policy)["summary"]
    return copy.deepcopy(_summaries[key])


def test_the_log_workload_takes_classes_and_keys_from_the_log(tmp_path):
    log = tmp_path / "tiny.log"
    log.write_text("".join(
        '1.2.3.4 - - [01/Aug/1995:00:00:%02d -0400] "GET /%s/p%d.html HTTP/1.0" 200 10\n'
        % (i % 60, "ab"[i % 2], i % 5) for i in range(40)))
    config = small(log=str(log), requests=200)
    run = simulate(config, "affinity")
    assert run["summary"]["requests"] > 0
    from zc_lb.simulations.workload import Workload
    workload = Workload(config, random.Random(1))
    assert len(workload.labels) == 2 and workload.pages == 10
    site, label, objects, key = workload.next()
    assert (label, key) == ("s0", "p0")
    assert len(objects) == config.objects_per_request + config.page_objects


@pytest.mark.parametrize("content", ["", "garbage\n",
                                     '1.2.3.4 - - [x] "POST /a HTTP/1.0" 200 1\n'])
def test_a_log_of_no_request_to_replay_is_a_clear_error(tmp_path, capsys, content):
    log = tmp_path / "access.log"
    log.write_text(content)
    with pytest.raises(SystemExit, match="simulate: .*access.log: no request to replay"):
        cli.main(["--log", str(log), "--scale", "0.01", "--no-plots",
                  "--policies", "round_robin"])


def test_a_log_sites_depth_makes_sections_its_classes(tmp_path):
    log = tmp_path / "tiny.log"
    paths = ["/a/x/p.html", "/a/y/p.html", "/a/p.html", "/b/p.html", "/a/x/"]
    log.write_text("".join(
        '1.2.3.4 - - [01/Aug/1995:00:00:%02d -0400] "GET %s HTTP/1.0" 200 10\n' % (i, path)
        for i, path in enumerate(paths)))
    from zc_lb.simulations.workload import read_log
    requests, sites, pages = read_log(str(log))
    assert [site for site, _ in requests] == [0, 0, 0, 1, 0] and sites == 2
    requests, sites, pages = read_log(str(log), depth=2)  # a-x, a-y, a, b, a-x
    assert [site for site, _ in requests] == [0, 1, 2, 3, 0] and sites == 4 and pages == 5


def test_with_fixed_draws_a_page_touches_the_same_shared_objects_each_time():
    from zc_lb.simulations.workload import Workload
    draws = {}
    for fixed in (False, True):
        config = small(fixed_draws=fixed, sites=1, pages_per_site=2, objects_per_site=50,
                       objects_per_request=4, page_objects=1)
        workload = Workload(config, random.Random(1))
        seen = draws[fixed] = {}
        for _ in range(40):
            _, _, objects, key = workload.next()
            shared = [o for o in objects if o < 50]
            assert len(shared) == 4
            seen.setdefault(key, set()).add(tuple(shared))
    assert all(len(sets) == 1 for sets in draws[True].values())  # one draw per page
    (page_draw,), _ = draws[True].values()
    assert len(set(page_draw)) == 4  # without repetition
    assert any(len(sets) > 1 for sets in draws[False].values())  # a new draw per request


def test_the_log_scenarios_draw_as_playbacks_cache_app():
    assert scenario("nasa").fixed_draws and scenario("elastic").fixed_draws


def test_affinity_loads_less_than_published_on_the_nasa_log():
    # Hashing and the objects drawn vary with the seed: compare over three.
    totals = {"affinity": [0.0, 0.0], "published": [0.0, 0.0]}
    for seed in (1, 2, 3):
        config = scenario("nasa", seed=seed)
        for policy, total in totals.items():
            summary = summary_of(config, policy)
            total[0] += summary["misses_per_request"]
            total[1] += summary["overlap"]
    assert totals["affinity"][0] < 0.9 * totals["published"][0]
    assert totals["affinity"][1] < totals["published"][1]


@pytest.mark.parametrize("log", ["nasa", "elastic"])
def test_affinity_loads_within_a_fifth_of_the_partition_on_the_logs(log):
    # The routing issue's workload, seeds 1-3: at most 1.2 times the loads
    # of the caches as one LRU (1.06-1.17x), and on NASA at least twice
    # least backlog's throughput with a better p99.  Each class's balance
    # rising with its gain is what took it there (1.36-1.54x before).
    for seed in (1, 2, 3):
        config = scenario(log, seed=seed)
        summary = summary_of(config, "affinity")
        assert summary["misses_per_request"] <= 1.2 * bound.partition_misses(config), seed
        if log == "nasa":
            least = summary_of(config, "least_backlog")
            assert summary["throughput"] >= 2.0 * least["throughput"], seed
            assert summary["p99_ms"] < least["p99_ms"], seed


def test_the_least_busy_worker_does_half_a_fair_share_of_the_work_on_the_logs():
    # The fairness target by the work each worker does: the least busy
    # worker's application takes at least half the mean seconds, on the
    # logs' seeds 1-3 and on elastic's seed 9, where a worker starved (0.27)
    # while a class under pressure could take one extra member only.  (Not
    # every seed: simulations/README.rst, "the least busy worker's share".)
    for log, seeds in (("nasa", (1, 2, 3)), ("elastic", (1, 2, 3, 9))):
        for seed in seeds:
            summary = summary_of(scenario(log, seed=seed), "affinity")
            assert summary["least_busy"] >= 0.5, (log, seed, summary["least_busy"])


def test_several_lbs_that_hear_each_others_keys_load_less():
    # frames.Keys: the workers relay the keys each LB sent them to the
    # others, whose books then agree; NASA with two LBs, seeds 1-2.
    for seed in (1, 2):
        config = scenario("nasa", seed=seed, lbs=2)
        relayed = summary_of(config, "affinity")
        alone = simulate(config.replace(separate_books=True), "affinity")["summary"]
        assert relayed["misses_per_request"] < 0.8 * alone["misses_per_request"], seed
        assert relayed["throughput"] > alone["throughput"], seed


def test_two_lbs_that_take_each_others_recruits_load_about_as_one_lb():
    # A class recruits the worker another LB recruited, which the relays
    # tell: the two LBs' members agree, and the class's data is not loaded
    # on two workers.  (NASA, seeds 1-8: 1.08 times one LB's misses; from
    # the ring alone 1.15.  Over fewer seeds the ratio swings with small
    # changes of routing.)
    misses = {}
    for lbs in (1, 2):
        misses[lbs] = sum(summary_of(scenario("nasa", seed=seed, lbs=lbs), "affinity")
                          ["misses_per_request"] for seed in range(1, 9))
    assert misses[2] < 1.1 * misses[1], misses


def test_a_mixed_fleet_serves_by_speed_and_cache_and_affinity_favours_the_big_caches():
    # Without a hand-set weight: résumé scores carry a worker's speed, and
    # its cache shows in them as hits.  Least backlog sees only the speed.
    config = scenario("mixed_fleet", requests=60000)
    kinds = {policy: summary_of(config, policy)["by_kind"]
             for policy in ("affinity", "least_backlog")}
    for by_kind in kinds.values():
        assert sorted(by_kind) == ["cache 20000 speed 1", "cache 20000 speed 2",
                                   "cache 5000 speed 1", "cache 5000 speed 2"]
        assert all(kind["workers"] == 2 and kind["fair_share"] == 0.25
                   for kind in by_kind.values())
        fast = sum(kind["share"] for name, kind in by_kind.items() if name.endswith("2"))
        assert fast > 0.6  # (half the workers)
    least = kinds["least_backlog"]
    assert least["cache 20000 speed 1"]["misses_per_request"] < \
        least["cache 5000 speed 1"]["misses_per_request"]
    affinity = kinds["affinity"]
    big = sum(kind["share"] for name, kind in affinity.items() if "20000" in name)
    assert big > 0.55
    assert all(affinity[name]["misses_per_request"] < least[name]["misses_per_request"]
               for name in affinity)


@pytest.mark.parametrize("lbs, share", [(1, 0.95), (2, 1.0), (4, 1.0)])
def test_on_a_mixed_fleet_affinity_serves_about_as_much_as_published(lbs, share):
    # busy_members (the default): a class's members are chosen counting
    # how busy they are.  Ranked by score alone, the fast workers took
    # every class and queued while the slow ones idled (one LB 810
    # requests a second against 869, two LBs 697 against 808).  With
    # four, each LB's quarter of a backlog had to be counted for the
    # other three's (714-773 against 736-792, seeds 1-3).
    config = scenario("mixed_fleet", requests=60000, lbs=lbs)
    served = {policy: summary_of(config, policy)["throughput"]
              for policy in ("affinity", "published")}
    assert served["affinity"] >= share * served["published"], served


def test_affinity_degrades_no_more_than_published_as_lbs_are_added():
    # Many classes for the requests: each LB recruits for them, which is
    # where LBs that recruit differently copy classes.
    base = small(requests=8000, workers=16, sites=1000, pages_per_site=10,
                 objects_per_site=50, cache_size=500, clients=64, concurrency=4,
                 window=1000)
    growth = {}
    for policy in ("affinity", "published"):
        one = simulate(base, policy)["summary"]["misses_per_request"]
        four = simulate(base.replace(lbs=4), policy)["summary"]["misses_per_request"]
        growth[policy] = four / one
    assert growth["affinity"] < growth["published"] - 0.02


def test_a_new_worker_gets_more_under_affinity_slow_start():
    config = small(requests=8000, workers=6, sites=4, clients=24, concurrency=4,
                   actions=[{"at": 3000, "do": "add_worker"}])
    shares = {policy: simulate(config, policy)["summary"]["new_worker_share"]
              for policy in ("affinity", "published")}
    assert shares["affinity"] > shares["published"]


def test_reset_skills_forgets_on_the_lbs_and_the_workers():
    config = small(actions=[{"at": 1500, "do": "change_classifier", "mode": "permute",
                             "reset_skills": True}], lbs=2)
    from zc_lb.simulations.engine import Simulation
    simulation = Simulation(config, "affinity")
    simulation.run()
    assert all(lb.resets == 1 for lb in simulation.lbs)


def test_sweep_runs_one_table_per_value(capsys):
    assert cli.main(["steady", "--scale", "0.005", "--no-plots", "--policies",
                     "affinity,published", "--sweep", "lbs=1,2"]) == 0
    out = capsys.readouterr().out
    assert "scenario steady lbs=1" in out and "scenario steady lbs=2" in out
    with pytest.raises(SystemExit):
        cli.main(["steady", "--sweep", "nonsense=1"])


def test_a_pool_setting_out_of_bounds_is_a_clear_error():
    with pytest.raises(SystemExit, match="stick must be at least 0"):
        cli.main(["steady", "--scale", "0.005", "--no-plots", "--stick", "-1"])


@pytest.mark.parametrize("option, error", [
    (["--sample-every", "0"], "need sample_every >= 1"),
    (["--window", "0"], "need window >= 1"),
    (["--pages-per-site", "-1"], "need pages_per_site >= 0"),
    (["--page-objects", "-2"], "need page_objects >= 0"),
    (["--base-cost", "-1"], "need base_cost >= 0"),
    (["--hash-replicas", "0"], "need hash_replicas >= 1"),
    (["--hash-balance-factor", "0.5"], "need hash_balance_factor >= 1"),
    (["--popularity", "exponential", "--popularity-param", "0"], "need popularity_param > 0"),
    (["--popularity-param", "nan"], "popularity_param must be a finite number, not nan"),
    (["--speeds", "1,inf"], "speeds must be positive and finite"),
    (["--policies", ""], "need at least one policy"),
    (["--cache-sizes", ""], None),  # (an empty list: the one cache size)
])
def test_a_parameter_out_of_bounds_is_a_clear_error_before_any_run(option, error, capsys):
    # Each of these crashed in a run (a modulo by zero, an index out of
    # range, matplotlib given no policy) or ran with negative times.
    argv = ["steady", "--scale", "0.001", "--no-plots", "--policies", "round_robin"] + option
    if error is None:
        assert cli.main(argv) == 0
        return
    with pytest.raises(SystemExit, match="^simulate: " + error):
        cli.main(argv)
    assert "round_robin" not in capsys.readouterr().err  # (refused before it ran)


@pytest.mark.parametrize("actions, error", [
    ([{"do": "add_worker"}], "at must be a request number >= 0"),
    ([{"at": 10, "do": "explode"}], "do must be one of add_worker, remove_worker"),
    ([{"at": 10, "do": "hot_site"}], "site must be a site's number, 0 to 99"),
    ([{"at": 10, "do": "hot_site", "site": 5, "fraction": 2}], "fraction must be from 0 to 1"),
    ([{"at": 10, "do": "change_classifier", "mode": "zap"}], "mode must be one of rename"),
    ([{"at": 10, "do": "remove_worker", "worker": -1}], "worker must be a worker's number"),
    ([3], "actions must be a list of dict, not \\[3\\]"),
    ({"at": 10}, "actions must be a list of dict"),
])
def test_a_bad_action_is_a_clear_error_before_any_run(actions, error):
    with pytest.raises(SystemExit, match="^simulate: .*" + error):
        cli.main(["steady", "--scale", "0.01", "--no-plots", "--policies", "round_robin",
                  "--actions", json.dumps(actions)])


def test_a_hot_site_on_a_log_workload_is_a_clear_error_before_any_run():
    with pytest.raises(SystemExit, match="^simulate: .*a log workload cannot make a site hot"):
        cli.main(["nasa", "--scale", "0.01", "--no-plots", "--policies", "round_robin",
                  "--actions", '[{"at": 10, "do": "hot_site", "site": 1, "fraction": 0.5}]'])


def test_removing_a_worker_that_is_not_there_or_the_last_one_is_a_clear_error():
    # The last one removed, the requests waited for ever and the run
    # reported what the others had served, with no word of them.
    argv = ["steady", "--requests", "2000", "--no-plots", "--policies", "round_robin",
            "--workers", "2", "--actions"]
    with pytest.raises(SystemExit, match="^simulate: remove_worker at request 10: no worker 7"):
        cli.main(argv + ['[{"at": 10, "do": "remove_worker", "worker": 7}]'])
    with pytest.raises(SystemExit, match="^simulate: remove_worker at request 10: no worker 1 "):
        cli.main(argv + ['[{"at": 5, "do": "remove_worker", "worker": 1},'
                         ' {"at": 10, "do": "remove_worker", "worker": 1}]'])
    with pytest.raises(SystemExit, match="^simulate: .*requests found no worker"):
        cli.main(argv + ['[{"at": 10, "do": "remove_worker"}, {"at": 10, "do": "remove_worker"}]'])
    with pytest.raises(SystemExit, match="^simulate: remove_worker at request 10: no worker left"):
        cli.main(argv + ['[{"at": 10, "do": "remove_worker"}, {"at": 10, "do": "remove_worker"},'
                         ' {"at": 10, "do": "remove_worker"}]'])
    # (removed, then one added: the requests that waited are served; with
    # closed-loop clients all waiting, no later request brings the new one)
    removed = [{"at": 100, "do": "remove_worker"}, {"at": 200, "do": "add_worker"}]
    run = simulate(small(workers=1, clients=0, arrival_rate=500.0, actions=removed),
                   "round_robin")
    assert sum(w["requests"] for w in run["windows"]) == SMALL["requests"]
    with pytest.raises(ConfigurationError, match="^8 requests found no worker"):
        simulate(small(workers=1, actions=removed), "round_robin")


def test_a_sweep_value_out_of_bounds_is_refused_before_any_run(capsys):
    with pytest.raises(SystemExit, match="^simulate: --sweep: need workers >= 1"):
        cli.main(["steady", "--scale", "0.005", "--no-plots", "--policies", "round_robin",
                  "--sweep", "workers=2,0"])
    assert "scenario steady" not in capsys.readouterr().out


@pytest.mark.parametrize("changes", [dict(warmup=0.0), dict(requests=3)])
def test_with_no_warm_up_the_summary_covers_every_request(changes):
    # A warm-up of no request (--warmup 0, or a run of under five
    # requests) left the summary empty: 0 requests a second, 0 misses.
    run = simulate(small(**changes), "round_robin")
    requests = changes.get("requests", SMALL["requests"])
    assert run["summary"]["requests"] == requests
    assert run["summary"]["misses_per_request"] > 0 and run["summary"]["throughput"] > 0


def test_holders_count_past_255_caches():
    # Hundreds of workers, or of connections' caches, may hold one object.
    holders = Holders(2)
    caches = [LRUCache(1, holders) for _ in range(300)]
    for cache in caches:
        cache.touch(1)
    assert (holders.count[1], holders.cached, holders.shared) == (300, 1, 1)
    for cache in caches:
        cache.clear()
    assert (holders.count[1], holders.cached, holders.shared) == (0, 0, 0)


def test_an_unknown_scenario_is_a_clear_error_naming_the_shipped_ones():
    from zc_lb.simulations import oracle

    with pytest.raises(SystemExit, match="^simulate: no scenario file or shipped scenario "
                                         "'stedy' \\(shipped: add_worker, .*steady"):
        cli.main(["stedy"])
    with pytest.raises(SystemExit, match="^oracle: no scenario .*'stedy'"):
        oracle.main(["stedy"])


# -- where locality buys nothing -------------------------------------------------


def served(config, policy):
    """A run's summary and the busiest worker's share of the requests."""
    from zc_lb.simulations.engine import Simulation
    simulation = Simulation(config, policy)
    summary = simulation.run()["summary"]
    counts = [worker.served for worker in simulation.workers]
    return summary, max(counts) / sum(counts)


@pytest.mark.parametrize("workers, busiest", [(2, 0.6), (4, 0.3)])
def test_a_hot_key_without_a_cache_spreads_as_least_backlog_does(workers, busiest):
    # One Host, one path, 1 ms a request on any worker, 20 clients: the
    # key's owner took 99.4% of the requests at half least backlog's rate.
    config = scenario("one_hot_key", workers=workers, requests=6000, window=500)
    affinity, share = served(config, "affinity")
    least, _ = served(config, "least_backlog")
    assert share <= busiest
    assert affinity["throughput"] >= 0.95 * least["throughput"]
    assert affinity["p99_ms"] <= least["p99_ms"]


@pytest.mark.parametrize("name", ["few_hot_paths", "no_cache"])
def test_cache_less_traffic_runs_as_fast_as_least_backlog(name):
    config = scenario(name, requests=8000, window=500)
    affinity, _ = served(config, "affinity")
    least, _ = served(config, "least_backlog")
    assert affinity["throughput"] >= 0.95 * least["throughput"]
    assert affinity["p99_ms"] <= least["p99_ms"]


def test_sibling_processes_load_less_than_lbs_routing_alone():
    # Two processes of one LB (--processes 2) each routing alone place a
    # key apart and judge workers by half their load; sharing a book of
    # keys, their recruits and their backlogs (zc_lb/routing/siblings.py), they
    # route as one LB does, nearly.  (Seeds 1-2: 0.200 misses against
    # 0.256 alone and 0.192 for one LB.  Told they are alone, neither
    # pair has its keys relayed by the workers, as in a real LB.)
    misses = {}
    for label, changes in (("one", dict(lbs=1)), ("alone", dict(lbs=2, lbs_told=1)),
                           ("siblings", dict(lbs=2, lbs_told=1, siblings=True))):
        misses[label] = sum(simulate(scenario("nasa", seed=seed, requests=8000, **changes),
                                     "affinity")["summary"]["misses_per_request"]
                            for seed in (1, 2))
    assert misses["siblings"] < 0.97 * misses["alone"], misses
    assert misses["siblings"] < 1.15 * misses["one"], misses


def test_the_oracle_reaches_the_elastic_bound_only_knowing_the_caches_and_the_future(capsys):
    """simulations/oracle.py: on the elastic log seen twice, whose whole
    working set fits the caches, the bound is reached by packing keys by
    cache footprint with the whole run in view, at a busiest worker 1.17
    times the mean; balancing by classes' requests alone stays near six
    times it, and the same packing planned from the warm-up alone near
    four.  (See simulations/README.rst, "The oracle".)"""
    from zc_lb.simulations import oracle

    config = config_module.build(config_module.load(cli.scenario_path("elastic_twice")))
    requests = oracle.draw(config)
    limit = bound.partition_misses(config)
    found = {name: oracle.route(config, requests, place)
             for name, place in oracle.placements(config, requests, 1.2).items()}
    assert found["packed"][0] <= 1.05 * limit and found["packed"][1] <= 1.2
    assert found["classes"][0] >= 4 * limit and found["classes"][1] <= 1.1
    assert found["learned"][0] >= 2 * limit
    assert oracle.main(["elastic_twice", "--slack", "1.2"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "scenario elastic_twice, seed 1: partition bound 0.0139 misses/request"
    assert [line.split()[0] for line in printed[2:]] == ["classes", "packed", "learned"]


def test_the_oracle_takes_the_simulators_parameters(capsys):
    """``--site-depth 2`` and ``--seed`` as the simulator takes them: the
    elastic log by section, whose classes a static plan by requests packs
    within 1.1 times the bound (simulations/README.rst, "The oracle")."""
    from zc_lb.simulations import oracle

    assert oracle.main(["elastic", "--site-depth", "2", "--seed", "3", "--slack", "1.2"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "scenario elastic, seed 3: partition bound 0.1647 misses/request"
    classes = printed[2].split()
    assert classes[0] == "classes" and float(classes[2].rstrip("x")) < 1.1
    assert oracle.main(["elastic", "--seed", "3"]) == 0  # by first segment: another bound
    assert capsys.readouterr().out.splitlines()[0] != printed[0]


@pytest.mark.parametrize("slack", ["0", "-1", "0.5", "nan", "inf"])
def test_an_oracle_slack_under_one_or_not_finite_is_a_clear_error(slack, capsys):
    # (each printed a table: every worker over the limit, or none)
    from zc_lb.simulations import oracle

    with pytest.raises(SystemExit):
        oracle.main(["nasa", "--requests", "500", "--slack", slack])
    out, err = capsys.readouterr()
    assert "--slack must be a number >= 1" in err and out == ""


def test_an_oracle_placement_keeps_each_key_on_one_worker():
    from zc_lb.simulations import oracle

    config = small(pages_per_site=20, workers=3)
    requests = oracle.draw(config)
    for place in oracle.placements(config, requests, 1.2).values():
        homes = collections.defaultdict(set)
        for site, _, _, key in requests:
            homes[(site, key)].add(place(site, key))
        assert all(len(workers) == 1 for workers in homes.values())


def test_waits_inside_the_app_the_worker_cannot_see_cost_loads_and_the_cache_signal_wins_them_back():
    # NASA, seed 1: the app serves one request at a time.  A worker that
    # lets in only that one (the default, once its pool found the bound)
    # records the app's own times; one that lets in 16 records each wait
    # inside the app as the app's time, and the LB's measure of what a
    # key's data buys reads far too low.  The app's word on its cache
    # (hit or miss) does not depend on those times.
    config = scenario("nasa", seed=1)
    default = summary_of(config, "affinity")["misses_per_request"]
    blind = simulate(config.replace(threads=16), "affinity")["summary"]["misses_per_request"]
    told = simulate(config.replace(threads=16, cache_signal=True),
                    "affinity")["summary"]["misses_per_request"]
    assert blind > 2 * default
    assert told < 0.65 * blind


def test_per_connection_caches_load_more_the_more_requests_a_worker_lets_in():
    # ZODB: each connection has a cache of its own.
    loads = [simulate(small(concurrency=n, connection_caches=True, seed=3),
                      "affinity")["summary"]["misses_per_request"] for n in (1, 8)]
    assert loads[1] > 1.3 * loads[0]
    # (and with one request at a time, one connection: the plain cache)
    assert loads[0] == simulate(small(seed=3), "affinity")["summary"]["misses_per_request"]


def test_without_matplotlib_the_table_is_printed_and_the_plot_skipped_with_a_reason(
        tmp_path, capsys, monkeypatch):
    import builtins

    from zc_lb.simulations import cli as sim_cli

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    import zc_lb.simulations as package

    monkeypatch.delitem(sys.modules, "zc_lb.simulations.plots", raising=False)
    monkeypatch.delattr(package, "plots", raising=False)  # (imported by an earlier test)
    code = sim_cli.main(["steady", "--scale", "0.01", "--policies", "least_backlog",
                         "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 0 and "least_backlog" in out
    assert "no plot: No module named 'matplotlib'" in err and "Traceback" not in err


def test_idle_beside_queue_is_the_share_of_samples_with_a_worker_idle_while_another_has_a_queue():
    # Least backlog never sends to a worker with requests waiting while
    # another has none; round robin, blind to backlogs, leaves workers
    # idle beside queues (the affinity policy does too, on purpose where
    # a cached key is worth the wait: simulations/README.rst).
    config = small(requests=4000)
    idle = {policy: simulate(config, policy)["summary"]["idle_beside_queue"]
            for policy in ("least_backlog", "round_robin")}
    assert idle["least_backlog"] < 0.02
    assert idle["round_robin"] > 0.1 + idle["least_backlog"]
    assert all(0.0 <= share <= 1.0 for share in idle.values())


def test_the_least_busy_worker_is_measured_by_requests_and_by_work():
    # Round robin gives every worker the same count of requests, whatever
    # they cost; a worker four times slower takes four times as long for
    # as many, so the others do less than a fair share of the work.
    config = small(requests=4000, speeds=[0.25, 1.0, 1.0, 1.0])
    summary = simulate(config, "round_robin")["summary"]
    assert summary["least_share"] == pytest.approx(1.0, abs=0.01)
    assert summary["least_busy"] < 0.9
    # The affinity policy on the NASA log: fewer requests than a fair share
    # for its least busy worker, and less short of a fair share of the work
    # (simulations/README.rst, "The least busy worker's share").
    summary = summary_of(scenario("nasa", seed=1), "affinity")
    assert 0.0 < summary["least_share"] < summary["least_busy"] < 1.0
