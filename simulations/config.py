"""Simulation parameters: one dataclass, filled from a scenario file and
the command line.

Every field of :class:`Config` is a parameter.  A scenario file (JSON) sets
any of them; ``--name value`` on the command line overrides the file.
Scheduled changes (a worker added, a class made hot, ...) are listed in
``actions``: each is a dict with ``at`` (the number of requests issued
before it happens) and ``do`` (the action's name) plus its arguments.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Dict, List

from zc_lb.settings import LB_SETTINGS, WORKER_SETTINGS

POLICIES = ("affinity", "published", "least_backlog", "round_robin", "two_choices",
            "bounded_hash", "lard")
ACTIONS = ("add_worker", "remove_worker", "hot_site", "change_classifier")
CLASSIFIER_CHANGES = ("rename", "permute")
# the parameters that count something, and the least each may be
AT_LEAST = {"requests": 1, "workers": 1, "cache_size": 1, "sites": 1, "objects_per_site": 1,
            "site_depth": 1, "window": 1, "sample_every": 1, "hash_replicas": 1, "lbs": 1,
            "concurrency": 1, "threads": 0, "lbs_told": 0, "pages_per_site": 0,
            "page_objects": 0, "objects_per_request": 0, "max_skill_age": 0,
            "lard_low": 0, "lard_high": 0}
# the parameters that are lists, and of what
LISTS = {"policies": str, "cache_sizes": int, "speeds": float, "actions": dict}
# the times and rates, none below 0
NOT_NEGATIVE = ("base_cost", "hit_cost", "miss_cost", "think_time", "arrival_rate",
                "relay_interval", "resume_interval")


@dataclasses.dataclass
class Config:
    """Everything a run depends on; the same Config and seed give the same
    result."""

    name: str = "custom"
    seed: int = 1
    requests: int = 200_000
    policies: List[str] = dataclasses.field(default_factory=lambda: list(POLICIES))
    # workers
    workers: int = 16
    concurrency: int = 1  # requests the application serves at once
    # Requests a worker lets in (its threads): 0, as many as the app serves
    # (``--greenlets --concurrency N``, or a thread-mode worker once it has
    # found the app's bound).  More: the app serves ``concurrency`` and the
    # rest wait inside it, a wait the worker cannot tell from work and
    # records in their time (a thread-mode worker blind to it, as before
    # its pool learnt the app's bound).
    threads: int = 0
    # Each of the app's connections has a cache of its own (ZODB's
    # per-connection object caches): a request touches the cache of the
    # connection it got, the last one given back (the pool's stack), and a
    # worker has as many connections as requests were ever inside at once.
    connection_caches: bool = False
    # The app tells the worker whether its cache had what a request needed
    # (``environ["zc_lb.cache"]``): a request with no miss is a hit.
    cache_signal: bool = False
    cache_size: int = 10_000
    # A mixed fleet: worker i has cache_sizes[i % len] objects of cache and
    # serves speeds[i % len] times as fast (empty: cache_size, and 1)
    cache_sizes: List[int] = dataclasses.field(default_factory=list)
    speeds: List[float] = dataclasses.field(default_factory=list)
    history: int = 200
    # virtual seconds; 0: résumés every history requests only
    resume_interval: float = WORKER_SETTINGS["resume_interval"].default
    max_skill_age: int = 0  # 0: resume.py's default, 10 * history
    # costs, seconds
    base_cost: float = 0.001
    hit_cost: float = 0.0001
    miss_cost: float = 0.005
    # workload
    sites: int = 100
    popularity: str = "zipf"  # or "exponential"
    popularity_param: float = 1.0  # Zipf exponent, or sites per e-fold
    objects_per_site: int = 2000
    object_zipf: float = 0.8  # popularity of objects within a site; 0: uniform
    objects_per_request: int = 6  # of the site's objects, drawn per request
    pages_per_site: int = 100  # 0: requests have no page and no affinity key
    page_zipf: float = 1.0  # popularity of pages within a site
    page_objects: int = 4  # objects of a page's own, touched by its requests
    fixed_draws: bool = False  # a page touches the same shared objects each time
    log: str = ""  # an access log to take sites and pages from, in order
    site_depth: int = 1  # a log's site: its first path segment, and directories to this depth
    clients: int = 64  # closed loop; 0 for open loop
    think_time: float = 0.0  # mean, exponential, closed loop
    arrival_rate: float = 0.0  # requests per second, open loop
    lbs: int = 1  # LBs sharing the workers, each with its own pool
    lbs_told: int = 0  # how many each is told there are (0: lbs; 1: each thinks it alone)
    siblings: bool = False  # the LBs are one host's --processes, sharing keys and backlogs
    separate_books: bool = LB_SETTINGS["separate_books"].default
    busy_members: bool = LB_SETTINGS["busy_members"].default
    # (several LBs hear where the others sent keys, relayed by the workers
    # every relay_interval virtual seconds, as LBs and workers of this
    # version do: frames.Keys, AffinityPool.take_keys)
    relay_interval: float = 0.05
    # policies
    variance: float = LB_SETTINGS["variance"].default  # the LB's defaults
    backlog_history: int = LB_SETTINGS["backlog_history"].default
    unskilled_score: float = LB_SETTINGS["unskilled_score"].default
    spread: float = LB_SETTINGS["spread"].default
    footprint_window: int = LB_SETTINGS["footprint_window"].default
    slow_start: int = LB_SETTINGS["slow_start"].default
    balance: float = LB_SETTINGS["balance"].default
    stick: float = LB_SETTINGS["stick"].default
    widen: float = LB_SETTINGS["widen"].default
    hash_balance_factor: float = 1.25
    hash_replicas: int = 100
    lard_low: int = 2
    lard_high: int = 4
    # measurement
    warmup: float = 0.2  # fraction of requests left out of the summary
    window: int = 4000  # completed requests per window
    sample_every: int = 10  # requests between backlog samples
    actions: List[Dict[str, Any]] = dataclasses.field(default_factory=list)

    def replace(self, **changes: Any) -> "Config":
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)


def scaled(config: Config, fraction: float) -> Config:
    """A smaller (or larger) run of the same scenario: ``requests`` and
    every action's ``at`` multiplied by ``fraction``, so actions fall at
    the same point of the run; windows shrink with it (at least 50)."""
    if not fraction > 0:
        raise ValueError("scale must be > 0")
    actions = [dict(a, at=int(a["at"] * fraction)) for a in config.actions]
    return config.replace(requests=max(1, int(config.requests * fraction)),
                          window=max(50, int(config.window * fraction)),
                          actions=actions)


def fields() -> List[dataclasses.Field]:
    """The parameters, in declaration order."""
    return list(dataclasses.fields(Config))


def load(path: str) -> Dict[str, Any]:
    """Read a scenario file: a JSON object of Config fields."""
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except ValueError as error:  # (not JSON, or not UTF-8)
            raise ValueError("%s: not a JSON scenario: %s" % (path, error)) from None
    if not isinstance(data, dict):
        raise ValueError("%s: not a JSON object of parameters" % path)
    names = {field.name for field in fields()}
    unknown = sorted(set(data) - names - {"description"})
    if unknown:
        raise ValueError("%s: unknown parameters %s" % (path, ", ".join(unknown)))
    data.pop("description", None)
    return data


def build(overrides: Dict[str, Any]) -> Config:
    """A Config from defaults and overrides, checked."""
    config = Config(**overrides)
    for field in fields():  # (of the type of its default; a whole number for a float)
        value = getattr(config, field.name)
        if field.name in LISTS:
            if not isinstance(value, list) or not all(
                    of_kind(item, LISTS[field.name]) for item in value):
                raise ValueError("%s must be a list of %s, not %r"
                                 % (field.name, LISTS[field.name].__name__, value))
            continue
        kind = type(field.default)
        if not of_kind(value, kind):
            raise ValueError("%s must be %s, not %r" % (field.name, kind.__name__, value))
        if kind is float and not math.isfinite(value):
            raise ValueError("%s must be a finite number, not %r" % (field.name, value))
    unknown = [p for p in config.policies if p not in POLICIES]
    if unknown:
        raise ValueError("unknown policies: %s" % ", ".join(unknown))
    if not config.policies:
        raise ValueError("need at least one policy (of %s)" % ", ".join(POLICIES))
    if config.clients <= 0 and config.arrival_rate <= 0:
        raise ValueError("need clients > 0 (closed loop) or arrival_rate > 0")
    for name, least in AT_LEAST.items():
        if getattr(config, name) < least:
            raise ValueError("need %s >= %d" % (name, least))
    for name in NOT_NEGATIVE:
        if getattr(config, name) < 0:
            raise ValueError("need %s >= 0" % name)
    if not 0.0 <= config.warmup < 1.0:
        raise ValueError("need 0 <= warmup < 1")
    if config.hash_balance_factor < 1:
        raise ValueError("need hash_balance_factor >= 1")
    if not all(size > 0 for size in config.cache_sizes):
        raise ValueError("cache_sizes must be positive")
    if not all(0 < speed < math.inf for speed in config.speeds):
        raise ValueError("speeds must be positive and finite")
    if config.popularity not in ("zipf", "exponential"):
        raise ValueError("popularity must be zipf or exponential")
    if config.popularity == "exponential" and config.popularity_param <= 0:
        raise ValueError("need popularity_param > 0 (sites per e-fold) with exponential")
    for action in config.actions:
        check_action(action, config)
    return config


def of_kind(value: Any, kind: type) -> bool:
    """Whether ``value`` is a ``kind`` (a whole number counts as a float;
    a bool as nothing else)."""
    return type(value) is kind or (kind is float and type(value) is int)


def check_action(action: Any, config: Config) -> None:
    """Refuse a scheduled action the run could not carry out, before it
    starts."""
    at, do = action.get("at"), action.get("do")
    if type(at) is not int or at < 0:
        raise ValueError("action %r: at must be a request number >= 0" % (action,))
    if do not in ACTIONS:
        raise ValueError("action %r: do must be one of %s" % (action, ", ".join(ACTIONS)))
    if do == "remove_worker":  # (no worker, or null: the first live one)
        worker = action.get("worker")
        if worker is not None and (type(worker) is not int or worker < 0):
            raise ValueError("action %r: worker must be a worker's number >= 0" % (action,))
    elif do == "hot_site":
        site, fraction = action.get("site"), action.get("fraction")
        if config.log:
            raise ValueError("action %r: a log workload cannot make a site hot" % (action,))
        if type(site) is not int or not 0 <= site < config.sites:
            raise ValueError("action %r: site must be a site's number, 0 to %d"
                             % (action, config.sites - 1))
        if not of_kind(fraction, float) or not 0 <= fraction <= 1:
            raise ValueError("action %r: fraction must be from 0 to 1" % (action,))
    elif do == "change_classifier" and action.get("mode", "rename") not in CLASSIFIER_CHANGES:
        raise ValueError("action %r: mode must be one of %s"
                         % (action, ", ".join(CLASSIFIER_CHANGES)))
