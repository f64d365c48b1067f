"""Named settings: defaults, types, validation, parsing.

The same names are used on the command line (``--backlog-history``) and
in ZooKeeper node properties (``backlog_history``), so an operator who
knows one knows the other.  ``parse`` turns a property value (a string
from the command line, or any JSON value from ZooKeeper) into the setting's
type, or raises ConfigurationError naming the setting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from .errors import ConfigurationError


@dataclass(frozen=True)
class Setting:
    """One named setting."""

    name: str
    type: Callable[[Any], Any]
    default: Any
    minimum: Optional[float]
    help: str


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError("not a boolean: %r" % (value,))


def _int(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError("not an integer: %r" % (value,))
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError("not an integer: %r" % (value,))
        return int(value)
    return int(value)


def _float(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError("not a number: %r" % (value,))
    number = float(value)
    if not math.isfinite(number):
        raise ValueError("not a finite number: %r" % (value,))
    return number


LB_SETTINGS = {s.name: s for s in [
    Setting("variance", _float, 1.0, 1e-9,
            "a worker's backlog may reach VARIANCE times the mean"),
    Setting("backlog_history", _int, 9, 1,
            "requests over which backlogs are averaged"),
    Setting("unskilled_score", _float, 1.0, 1e-9,
            "score given to a worker for a class it was not skilled in"),
    Setting("no_worker_timeout", _float, 30.0, 0,
            "seconds to wait for a worker before answering 503"),
    Setting("single_version", _bool, False, None,
            "serve only from the worker version most workers run"),
    Setting("spread", _float, 1.0, 1e-9,
            "affinity policy: a class with a share S of requests is spread "
            "over SPREAD x S of the workers"),
    Setting("footprint_window", _int, 5000, 1,
            "affinity policy: requests over which request shares and "
            "distinct keys per class are measured"),
    Setting("slow_start", _int, 2000, 0,
            "affinity policy: requests over which a new worker's share ramps "
            "up (0: at once)"),
    Setting("balance", _float, 1.5, 1.0,
            "affinity policy: a key moves on from its worker while that one's "
            "backlog is past BALANCE times the mean of the class's workers"),
    Setting("reset_skills", str, "", None,
            "set to a new value (e.g. the time) to make every LB forget "
            "the skills it holds and learn them again from résumés"),
]}

POOL_SETTINGS = ("variance", "backlog_history", "unskilled_score", "spread",
                 "footprint_window", "slow_start", "balance")

WORKER_SETTINGS = {s.name: s for s in [
    Setting("history", _int, 9999, 1,
            "requests between résumé updates; the skill decay horizon"),
    Setting("max_skill_age", _int, None, 1,
            "requests after which an unseen class is dropped (default 10 x history)"),
    Setting("reset_skills", str, "", None,
            "set to a new value (e.g. the time) to make every worker forget "
            "its skills and send an empty résumé"),
]}


def parse(settings: Mapping[str, Setting], name: str, value: Any) -> Any:
    """Convert and validate one setting's value."""
    setting = settings.get(name)
    if setting is None:
        raise ConfigurationError("unknown setting %r" % name)
    if value is None:
        return setting.default
    try:
        converted = setting.type(value)
    except (TypeError, ValueError) as exc:
        raise ConfigurationError("bad value for %s: %r (%s)" % (name, value, exc))
    if setting.minimum is not None and converted < setting.minimum:
        raise ConfigurationError("%s must be at least %g, got %r"
                                 % (name, setting.minimum, value))
    return converted


NOTES = frozenset({"description"})  # properties any node may carry for people


def node_settings(path: str) -> Mapping[str, Setting]:
    """The settings a ZooKeeper node holds: a node named ``workers`` the
    workers', any other the LBs'."""
    return WORKER_SETTINGS if path.rstrip("/").rpartition("/")[2] == "workers" else LB_SETTINGS


def check_property(path: str, key: str, value: Any, force: bool = False) -> None:
    """Refuse a bad value, or (unless ``force``) a key that is no setting
    of the node at ``path``, with a message saying which and why."""
    settings = node_settings(path)
    if key in settings:
        parse(settings, key, value)
    elif key in NOTES or force:
        return
    else:
        other = LB_SETTINGS if settings is WORKER_SETTINGS else WORKER_SETTINGS
        hint = (" (a setting of the %s node)" % ("LB" if other is LB_SETTINGS else "workers")
                if key in other else "")
        raise ConfigurationError(
            "unknown setting %r for %s%s; known: %s (or --force)"
            % (key, path, hint, ", ".join(sorted(settings))))


def parse_each(settings: Mapping[str, Setting], properties: Mapping[str, Any]
               ) -> Tuple[Dict[str, Any], List[str]]:
    """The good settings of ``properties``, converted, and a message for
    each bad one: one bad value does not spoil its neighbours."""
    good, bad = {}, []
    for name, value in properties.items():
        if name in settings:
            try:
                good[name] = parse(settings, name, value)
            except ConfigurationError as exc:
                bad.append(str(exc))
    return good, bad


def parse_all(settings: Mapping[str, Setting], properties: Mapping[str, Any],
              strict: bool = False) -> Dict[str, Any]:
    """Known settings found in ``properties``, converted; unknown names are
    ignored (ZooKeeper nodes hold other properties too) unless ``strict``."""
    result = {}
    for name, value in properties.items():
        if name in settings:
            result[name] = parse(settings, name, value)
        elif strict:
            raise ConfigurationError("unknown setting %r" % name)
    return result
