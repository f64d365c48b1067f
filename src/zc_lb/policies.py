"""The routing policies by name (``--policy``): which pool each is, and
making one with the settings it takes."""

from __future__ import annotations

from typing import Mapping

from .affinity import AffinityPool
from .errors import ConfigurationError
from .pool import ClasslessPool, Pool

POLICIES = {"affinity": AffinityPool, "published": Pool, "classless": ClasslessPool,
            "resume": Pool}  # resume: the published policy's old name


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
