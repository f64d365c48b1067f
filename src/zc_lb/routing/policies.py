"""The routing policies by name (``--policy``): which pool each is, and
making one with the settings it takes."""

from __future__ import annotations

from typing import Mapping

from zc_lb.routing.affinity import AffinityPool
from zc_lb.errors import ConfigurationError
from zc_lb.routing.pool import ClasslessPool, Pool

POLICIES = {"affinity": AffinityPool, "published": Pool, "classless": ClasslessPool,
            "resume": Pool}  # resume: the published policy's old name

# The settings some policy takes (the others are the LB's own).
POOL_SETTINGS = frozenset(name for pool in POLICIES.values() for name in pool.SETTINGS)


def policy_name(pool: Pool) -> str:
    """The name ``--policy`` gives ``pool``'s policy."""
    return next(name for name, pool_class in POLICIES.items() if type(pool) is pool_class)


def takers(name: str) -> str:
    """The policies that take the setting ``name``, as "--policy a or b"."""
    return " or ".join("--policy " + policy for policy, pool_class in POLICIES.items()
                       if name in pool_class.SETTINGS and policy != "resume")


def make_pool(policy: str, settings: Mapping[str, object]) -> Pool:
    """The pool of ``policy``, with those of ``settings`` it takes."""
    try:
        pool_class = POLICIES[policy]
    except KeyError:
        raise ConfigurationError("unknown policy %r (one of %s)"
                                 % (policy, ", ".join(POLICIES)))
    pool = pool_class()
    pool.configure(settings)
    return pool
