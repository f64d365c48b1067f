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
from typing import Any, Dict, List

from zc_lb.settings import LB_SETTINGS, WORKER_SETTINGS

POLICIES = ("affinity", "published", "least_backlog", "round_robin", "two_choices",
            "bounded_hash", "lard")


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
        if field.default is dataclasses.MISSING or field.default is None:
            continue  # (the lists, checked below)
        value, kind = getattr(config, field.name), type(field.default)
        if type(value) is not kind and not (kind is float and type(value) is int):
            raise ValueError("%s must be %s, not %r" % (field.name, kind.__name__, value))
    unknown = [p for p in config.policies if p not in POLICIES]
    if unknown:
        raise ValueError("unknown policies: %s" % ", ".join(unknown))
    if config.clients <= 0 and config.arrival_rate <= 0:
        raise ValueError("need clients > 0 (closed loop) or arrival_rate > 0")
    if config.lbs < 1:
        raise ValueError("need lbs >= 1")
    if config.concurrency < 1 or config.threads < 0:
        raise ValueError("need concurrency >= 1 and threads >= 0")
    for name in ("requests", "workers", "cache_size", "sites", "objects_per_site",
                 "site_depth"):
        if getattr(config, name) < 1:
            raise ValueError("need %s >= 1" % name)
    if not 0.0 <= config.warmup < 1.0:
        raise ValueError("need 0 <= warmup < 1")
    if not all(size > 0 for size in config.cache_sizes):
        raise ValueError("cache_sizes must be positive")
    if not all(speed > 0 for speed in config.speeds):
        raise ValueError("speeds must be positive")
    if config.popularity not in ("zipf", "exponential"):
        raise ValueError("popularity must be zipf or exponential")
    return config
