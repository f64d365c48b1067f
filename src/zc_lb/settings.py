"""The settings table: every tunable of the LB and the worker, once.

Each ``Setting`` says what a tunable is (its type, default, limits and
help) and where it may be given (``where``):

``cli``
    a command-line option, ``--backlog-history`` for ``backlog_history``;
``zookeeper``
    a property of the process's ZooKeeper node, under the setting's name;
``live``
    the running process applies a change (from ZooKeeper) at once.

Everything else comes from the table: ``add_arguments`` makes the
argparse options (type, default, help with the default); ``parse`` reads
a value given as text or JSON (the command line, ZooKeeper) and
``check_property`` the properties ``zc-lb zk set/import`` write; ``check``
validates a value a program passes (the pools' and the skills'
constructors and ``update_settings``).  So a setting's default, type and
limits live here and nowhere else, and every way in refuses the same
values: text that is not a number, a non-integral value for an integer
setting (2.7, or "2.7"), a boolean for a number, a value out of limits.
A bad value raises ConfigurationError naming the setting.
"""

from __future__ import annotations

import argparse
import logging
import math
import re
from dataclasses import dataclass
from typing import (Any, Callable, Dict, FrozenSet, Iterable, List, Mapping, Optional,
                    Tuple)

from zc_lb.errors import ConfigurationError

log = logging.getLogger(__name__)

CLI, ZOOKEEPER, LIVE = "cli", "zookeeper", "live"
# The buckets of the latency histograms (seconds): the LB's response times
# and a worker's application times, alike so that they compare.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
COMMAND_LINE = frozenset({CLI})
EVERYWHERE = frozenset({CLI, ZOOKEEPER, LIVE})
ZOOKEEPER_ONLY = frozenset({ZOOKEEPER, LIVE})


# The converters take text or a JSON value; Setting.convert names the
# setting and the value in its message.

def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError("not a boolean")


def _int(value: Any) -> int:
    if isinstance(value, bool):  # True is 1 to Python, not to an operator
        raise ValueError("not an integer")
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError("not an integer")
        number = int(value)
    else:
        try:
            number = int(value)
        except ValueError:  # "2.7" as well as "abc"
            raise ValueError("not an integer")
    if abs(number) > MAX_INT:  # (the code computes with them as floats too)
        raise ValueError("too large, over %d" % MAX_INT)
    return number


MAX_INT = 2 ** 53  # an integer setting's largest: a float holds it exactly


def _float(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError("not a number")
    try:
        number = float(value)
    except ValueError:
        raise ValueError("not a number")
    except OverflowError:  # (an integer of hundreds of digits, from JSON or TOML)
        raise ValueError("not a finite number")
    if not math.isfinite(number):
        raise ValueError("not a finite number")
    return number


CONVERTERS: Dict[type, Callable[[Any], Any]] = {bool: _bool, int: _int, float: _float, str: str}

_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def _size(value: Any) -> int:
    """Bytes: a whole number, or one with a unit, as nginx takes them
    (``512K``, ``1M``, ``1.5GiB``, ``64mb``: powers of 1024)."""
    if not isinstance(value, str):
        return _int(value)
    match = _SIZE.fullmatch(value)
    if match is None:
        raise ValueError("not a size (a number of bytes, or with K, M, G or T)")
    number = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if not number.is_integer():
        raise ValueError("not a whole number of bytes")
    return int(number)


@dataclass(frozen=True)
class Setting:
    """One tunable: ``type`` is bool, int, float or str."""

    name: str
    type: type
    default: Any
    help: str
    minimum: Optional[float] = None
    maximum: Optional[float] = None
    where: FrozenSet[str] = COMMAND_LINE
    metavar: Optional[str] = None
    choices: Optional[Tuple[str, ...]] = None
    size: bool = False  # bytes, which may be given with a unit (``_size``)

    @property
    def option(self) -> str:
        """The command-line option: ``--backlog-history``."""
        return "--" + self.name.replace("_", "-")

    @property
    def options(self) -> Tuple[str, ...]:
        """Every option that gives it: ``--backlog-history``; a boolean
        on by default has ``--no-busy-members`` too (``add_argument``)."""
        if self.type is bool and self.default:
            return (self.option, "--no-" + self.option[2:])
        return (self.option,)

    def convert(self, value: Any) -> Any:
        """``value`` (text, or a JSON or Python value) as this setting's
        type, within its limits; ConfigurationError if it cannot be."""
        try:
            converted = (_size if self.size else CONVERTERS[self.type])(value)
        except (TypeError, ValueError) as exc:
            raise ConfigurationError("bad value for %s: %r (%s)" % (self.name, value, exc))
        if self.minimum is not None and converted < self.minimum:
            raise ConfigurationError("%s must be at least %g, got %r"
                                     % (self.name, self.minimum, value))
        if self.maximum is not None and converted > self.maximum:
            raise ConfigurationError("%s must be at most %g, got %r"
                                     % (self.name, self.maximum, value))
        if self.choices is not None and converted not in self.choices:
            raise ConfigurationError("%s must be one of %s, got %r"
                                     % (self.name, ", ".join(self.choices), value))
        return converted


def log_change(name: str, old: Any, new: Any, source: str = "") -> None:
    """A live setting changed: one format, whatever its source."""
    log.info("%s %s -> %s%s", name, shown(old), shown(new),
             " (%s)" % source if source else "")


def shown(value: Any) -> str:
    if isinstance(value, list):
        return " ".join(map(str, value)) or "(none)"
    return _format(value) if value is not None else "(none)"


def _table(settings: Iterable[Setting]) -> Dict[str, Setting]:
    return {setting.name: setting for setting in settings}


def given_in(table: Mapping[str, Setting], where: str) -> Dict[str, Setting]:
    """The settings of ``table`` that may be given ``where`` (CLI, ZOOKEEPER)."""
    return {name: setting for name, setting in table.items() if where in setting.where}


LB_SETTINGS = _table([
    # The pool's, and what else ZooKeeper may change while the LB runs.
    Setting("variance", float, 1.0,
            "a worker's mean backlog may reach VARIANCE times the pool's",
            minimum=1e-9, maximum=1e6, where=EVERYWHERE),
    Setting("backlog_history", int, 9,
            "requests over which backlogs are averaged",
            minimum=1, where=EVERYWHERE, metavar="N"),
    Setting("unskilled_score", float, 1.0,
            "score of a worker for a class it was sent without skill",
            minimum=1e-9, where=EVERYWHERE),
    Setting("spread", float, 1.0,
            "affinity: a class with a share S of requests gets at least SPREAD x S "
            "of the workers",
            minimum=1e-9, maximum=1e6, where=EVERYWHERE),
    Setting("footprint_window", int, 5000,
            "affinity: requests over which class shares and distinct keys are measured",
            minimum=1, where=EVERYWHERE, metavar="N"),
    Setting("slow_start", int, 2000,
            "affinity: requests over which a new worker's share ramps up; 0 at once",
            minimum=0, where=EVERYWHERE, metavar="N"),
    Setting("balance", float, 1.5,
            "affinity: a key moves on from its worker while that one's backlog is "
            "past BALANCE x the class's mean; a member's cap is BALANCE x the "
            "variance cap (an LB alone raises a class's BALANCE to half its "
            "measured gain)",
            minimum=1.0, where=EVERYWHERE),
    Setting("stick", float, 1.5,
            "affinity, an LB alone: a key stays with the worker it last went to while "
            "that one's backlog is under STICK x the balance bound, and a new key goes "
            "to the least busy worker; 0: every key by rendezvous",
            minimum=0, where=EVERYWHERE),
    Setting("separate_books", bool, False,
            "affinity, several LBs: each keeps its own book of where keys went and "
            "goes by rendezvous, instead of one book the workers relay between them "
            "(on a fleet of very different machines that can serve more)",
            where=EVERYWHERE),
    Setting("busy_members", bool, True,
            "affinity: once a class's gain is measured, its members are the skilled "
            "workers that would serve it soonest, score over backlog, rather than the "
            "best-scored, so that on a fleet of unlike machines fast workers busy with "
            "other classes do not take every class; --no-busy-members: the best-scored",
            where=EVERYWHERE),
    Setting("widen", float, 0.3,
            "affinity: a class takes one more worker (two at most) while its workers' "
            "backlogs stay over 1 + WIDEN times the pool's mean, and gives one back under "
            "1 / (1 + WIDEN) times; 0: never",
            minimum=0, where=EVERYWHERE),
    Setting("no_worker_timeout", float, 5.0,
            "seconds to wait for a worker before answering 503 (with Retry-After)",
            minimum=0, where=EVERYWHERE, metavar="S"),
    Setting("single_version", bool, False,
            "serve only from the worker version most workers run",
            where=EVERYWHERE),
    Setting("reset_skills", str, "",
            "set to a new value (e.g. the time) to make every LB forget the skills "
            "it holds and learn them again from résumés",
            where=ZOOKEEPER_ONLY),
    # Command line only.
    Setting("response_timeout", float, 300.0,
            "seconds to wait for a worker to start responding, then 504, and "
            "for more of a response it started while the LB lets it send, then "
            "the client's connection is closed; 0 waits forever",
            minimum=0, metavar="S"),
    Setting("max_retries", int, 1,
            "retry a GET or HEAD whose worker was lost at most N times, while "
            "a healthy worker has room under the backlog cap",
            minimum=0, metavar="N"),
    Setting("health_interval", float, 5.0,
            "seconds between --health-check requests to each worker",
            minimum=0.01, metavar="S"),
    Setting("eject_after", int, 5,
            "eject a worker from the pool after N failed requests in a row (5xx or "
            "its connection failing); 0 never",
            minimum=0, metavar="N"),
    Setting("eject_time", float, 30.0,
            "first ejection's length; it doubles with each one, up to 10x",
            minimum=0, metavar="S"),
    Setting("max_ejected", float, 0.5,
            "at most this share of the connected workers ejected at once (as workers "
            "go, those past it come back on probation)",
            minimum=0, maximum=1, metavar="SHARE"),
    Setting("keepalive_timeout", float, 5.0,
            "declare a worker dead after this long without a word from it (it pings "
            "every second)",
            minimum=0.01, metavar="S"),
    Setting("client_timeout", float, 60.0,
            "drop a client connection idle (sending or reading nothing) this long; "
            "0 never",
            minimum=0, metavar="S"),
    Setting("header_timeout", float, 10.0,
            "answer 408 and close if a request head is not complete this long after "
            "the accept (or, on keep-alive, its first byte); 0 never",
            minimum=0, metavar="S"),
    Setting("max_connections", int, None,
            "concurrent client connections of each --listen (default: half the open-file "
            "hard limit, at most 50,000); past it, the connection waiting longest for a request "
            "head (or in its TLS handshake or PROXY header) makes room, else 503 (0 "
            "no cap; the open-file limit is raised to fit)",
            minimum=0, metavar="N"),
    Setting("buffer_memory", int, 1024 * 1024,
            "bytes of one response the LB holds in memory for a slow client, so "
            "the worker is free as soon as it has produced it",
            minimum=0, metavar="BYTES", size=True),
    Setting("buffer_memory_total", int, 64 * 1024 * 1024,
            "bytes of all responses and request bodies held in memory; past this "
            "or --buffer-memory, on disk",
            minimum=0, metavar="BYTES", size=True),
    Setting("buffer_disk", int, 2**30,
            "bytes of one response held on disk; past this, the worker waits for "
            "the client (0: no disk)",
            minimum=0, metavar="BYTES", size=True),
    Setting("buffer_disk_total", int, 16 * 2**30,
            "bytes of all responses and request bodies held on disk",
            minimum=0, metavar="BYTES", size=True),
    Setting("buffer_request", int, 1024 * 1024,
            "bytes of a request body the LB reads from its client before it sends "
            "the request to a worker, held as a response is (in memory, then on "
            "disk, within the bounds above), so a slow upload holds no worker thread "
            "while it comes; a larger body's rest goes on as it comes (0: none)",
            minimum=0, metavar="BYTES", size=True),
    Setting("buffer_dir", str, "",
            "directory for responses and request bodies buffered on disk (default: "
            "the system's temporary directory)",
            metavar="DIR"),
    Setting("forwarded", str, "for,proto,host,request-id",
            "forwarding headers the LB sets: X-Forwarded-For (appended to), "
            "X-Forwarded-Proto and -Host (overwritten), X-Request-ID (when absent); "
            "a comma list, or none",
            metavar="LIST"),
    Setting("proxy_protocol", bool, False,
            "every client connection begins with a PROXY protocol header (v1 or v2) "
            "naming the client: from --trusted-proxies only, if given"),
    Setting("trusted_proxies", str, "",
            "addresses or CIDR networks of proxies in front of the LB, whose "
            "X-Forwarded-Proto and -Host are kept (comma list)",
            metavar="CIDRS"),
    Setting("max_request_body", int, 2**30,
            "answer 413 to a larger request body (bytes): a Content-Length over it "
            "at once, a chunked body once it goes past it; the connection closes",
            minimum=0, metavar="BYTES", size=True),
    Setting("tls_min_version", str, "TLSv1.2",
            "oldest TLS version accepted",
            choices=("TLSv1.2", "TLSv1.3")),
    Setting("drain_timeout", float, 30.0,
            "seconds to finish requests in flight on SIGTERM",
            minimum=0, metavar="S"),
    Setting("child_status_timeout", float, 2.0,
            "with --processes: seconds the supervisor gives each LB process to answer "
            "for its status (the status document, /metrics, /healthz); one that does "
            "not counts as it last answered, marked stale; keep it under zc-lb "
            "status's --timeout",
            minimum=0.01, metavar="S"),
    Setting("child_action_timeout", float, 5.0,
            "with --processes: seconds the supervisor gives each LB process to answer "
            "an action (drain, enable, reset-skills); if one does not and none refuses, "
            "the action fails with 503 (try again); give those commands a --timeout "
            "above it",
            minimum=0.01, metavar="S"),
])

# The worker starts all its --threads at once: 1e10 of them took all the
# memory there was, never serving, and a few tens of thousands take every
# process id of a machine (Linux's default pid_max is 32768); 10,000 start
# in a second or two.
MAX_THREADS = 10_000
# --concurrency is a gevent semaphore's count, a C int: past 2**31 - 1 it
# was an OverflowError at start.  Far more requests at once than a worker
# holds is no bound at all (0).
MAX_CONCURRENCY = 1_000_000

WORKER_SETTINGS = _table([
    Setting("history", int, 9999,
            "requests between résumé updates; the skill decay horizon",
            minimum=1, where=EVERYWHERE, metavar="N"),
    Setting("resume_interval", float, 10.0,
            "also send the résumé every S seconds while something was served since "
            "the last, so that LBs learn skills within seconds of light traffic "
            "(0: only every history requests)",
            minimum=0, where=EVERYWHERE, metavar="S"),
    Setting("max_skill_age", int, None,
            "drop classes unseen for N requests (default 10 x history)",
            minimum=1, where=EVERYWHERE, metavar="N"),
    Setting("max_classes", int, 10_000,
            "keep skills in at most N classes, the most requested: every LB takes in "
            "each résumé with its event loop stopped (some 3 ms per thousand classes), "
            "and none of more than 100,000",
            # (the most an LB takes, frames.RESUME_CLASSES: not imported, as
            # frames needs mypy_extensions and --version nothing installed)
            minimum=1, maximum=100_000, where=EVERYWHERE, metavar="N"),
    Setting("reset_skills", str, "",
            "set to a new value (e.g. the time) to make every worker forget its "
            "skills and send an empty résumé",
            where=ZOOKEEPER_ONLY),
    Setting("threads", int, 16,  # as gunicorn's gthread and waitress size theirs
            "run the application in a pool of N threads: safe for applications that "
            "block, as most do",
            minimum=1, maximum=MAX_THREADS, metavar="N"),
    Setting("threads_fixed", bool, False,
            "let all --threads threads take requests at once; by default the worker "
            "lets in two for requests that compute and two for each request blocked "
            "on I/O (the interpreter runs one thread at a time)"),
    Setting("concurrency", int, 0,
            "with --greenlets, serve at most N requests at once, the others waiting "
            "their turn (a wait résumés do not count); 0: no bound",
            minimum=0, maximum=MAX_CONCURRENCY, metavar="N"),
    Setting("sendfile", str, "auto",
            "send a file the application hands to wsgi.file_wrapper with sendfile(2): "
            "on, off, or auto: on except to an LB on this machine, where reading it "
            "costs less (loopback copies either way)",
            choices=("auto", "on", "off")),
    Setting("drain_timeout", float, 30.0,
            "seconds to finish requests in flight on SIGTERM",
            minimum=0, metavar="S"),
])

# What the ZooKeeper nodes may hold: the LBs' node, and its ``workers`` child.
LB_NODE_SETTINGS = given_in(LB_SETTINGS, ZOOKEEPER)
WORKER_NODE_SETTINGS = given_in(WORKER_SETTINGS, ZOOKEEPER)
# The worker's settings that change while it runs (Worker.configure): its
# live ones but for reset_skills, a token that resets rather than a value.
WORKER_LIVE = tuple(name for name in given_in(WORKER_SETTINGS, LIVE) if name != "reset_skills")


# -- values given as text or JSON: the command line, ZooKeeper ------------


def parse(settings: Mapping[str, Setting], name: str, value: Any) -> Any:
    """Convert and validate one setting's value; None (a JSON null) is the
    default."""
    setting = settings.get(name)
    if setting is None:
        raise ConfigurationError("unknown setting %r" % name)
    if value is None:
        return setting.default
    return setting.convert(value)


def parse_each(settings: Mapping[str, Setting], properties: Mapping[str, Any]
               ) -> Tuple[Dict[str, Any], List[str]]:
    """The good settings of ``properties``, converted, and a message for
    each bad one: one bad value does not spoil its neighbours.  Names not
    in ``settings`` are ignored (nodes hold other properties too)."""
    good, bad = {}, []
    for name, value in properties.items():
        if name in settings:
            try:
                good[name] = parse(settings, name, value)
            except ConfigurationError as exc:
                bad.append(str(exc))
    return good, bad


NOTES = frozenset({"description"})  # properties any node may carry for people


def node_settings(path: str) -> Mapping[str, Setting]:
    """The settings a ZooKeeper node holds: a node named ``workers`` the
    workers', any other the LBs'."""
    if path.rstrip("/").rpartition("/")[2] == "workers":
        return WORKER_NODE_SETTINGS
    return LB_NODE_SETTINGS


def check_property(path: str, key: str, value: Any, force: bool = False) -> None:
    """Refuse a bad value, or (unless ``force``) a key that is no setting
    of the node at ``path``, with a message saying which and why."""
    settings = node_settings(path)
    if key in settings:
        parse(settings, key, value)
        return
    if key in NOTES or force:
        return
    is_lb = settings is LB_NODE_SETTINGS
    if key in (LB_SETTINGS if is_lb else WORKER_SETTINGS):
        hint = " (a command-line option only)"
    elif key in (WORKER_NODE_SETTINGS if is_lb else LB_NODE_SETTINGS):
        hint = " (a setting of the %s node)" % ("workers" if is_lb else "LB")
    else:
        hint = ""
    raise ConfigurationError("unknown setting %r for %s%s; known: %s (or --force)"
                             % (key, path, hint, ", ".join(sorted(settings))))


# -- values a program passes: the pools' and the skills' --------------------

_KINDS = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}


def check(settings: Mapping[str, Setting], name: str, value: Any) -> Any:
    """``value``, of setting ``name``'s type and within its limits, as that
    type (an int for a float setting is a float); ConfigurationError if not.
    Unlike ``parse``, text is no number and None is only taken for a setting
    whose default is None."""
    setting = settings[name]
    if value is None and setting.default is None:
        return None
    numeric = setting.type in (int, float)
    if (value is None or isinstance(value, str) != (setting.type is str)
            or isinstance(value, bool) != (setting.type is bool)
            or (numeric and not isinstance(value, (int, float)))):
        raise ConfigurationError("%s must be %s, got %r"
                                 % (name, _KINDS[setting.type], value))
    return setting.convert(value)


# -- the command line --------------------------------------------------------


def _format(value: Any) -> str:
    return "%g" % value if isinstance(value, float) else str(value)


def add_argument(parser: Any, setting: Setting) -> None:
    """Add ``setting``'s option to ``parser`` (or to an argument group)."""
    text = setting.help
    if setting.size:
        text += "; K, M, G may follow (512K, 64M: powers of 1024)"
    if setting.default not in (None, "") and setting.type is not bool:
        text += " (default %s)" % _format(setting.default)
    elif setting.default is True:
        text += " (default on)"
    if ZOOKEEPER in setting.where:
        text += " [ZooKeeper: %s%s]" % (setting.name, ", live" if LIVE in setting.where else "")
    if setting.type is bool:  # a flag turns it on; one on by default, --no-... off
        if setting.default:
            parser.add_argument(setting.option, action=argparse.BooleanOptionalAction,
                                default=True, help=text)
        else:
            parser.add_argument(setting.option, action="store_true", help=text)
        return

    parser.add_argument(setting.option, type=converter(setting), default=setting.default,
                        choices=setting.choices, metavar=setting.metavar, help=text)


def converter(setting: Setting) -> Callable[[str], Any]:
    """An argparse ``type`` for ``setting``: its value, checked as a
    setting is, or the error argparse says in one line (exit status 2)."""
    def convert(text: str) -> Any:
        try:
            return setting.convert(text)
        except ConfigurationError as exc:
            raise argparse.ArgumentTypeError(str(exc))

    convert.__name__ = setting.name  # argparse names a converter in some messages
    return convert


def add_arguments(parser: Any, settings: Mapping[str, Setting]) -> None:
    """Add the options of those ``settings`` the command line may give."""
    for setting in given_in(settings, CLI).values():
        add_argument(parser, setting)
