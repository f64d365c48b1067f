"""Access-log lines in, replayable entries out.

Theory of operation
-------------------

A log line is matched by one regular expression per format, with named
groups: ``request`` (the quoted request line) or ``method`` and ``path``,
and optionally ``time``, ``vhost`` and ``status``. The request line is then
split leniently, because real logs are not tidy:

- ``"GET /path"`` (HTTP/0.9 style, no version) is accepted;
- extra spaces before the version (``"GET /a   HTTP/1.0"``) are accepted;
- a non-standard version (``HTTP/V1.0``) is accepted: anything after the
  last space that starts with ``HTTP/`` is the version;
- an absolute target (``GET http://host/path``, as proxies log it) gives
  the host and the path;
- Apache's ``\\xNN`` escapes are turned back into bytes, and every byte
  that may not appear in a request target is percent-encoded.

A line that matches no format, or whose request line is not
``METHOD TARGET [VERSION]``, is *unparsable*: counted, a few kept as
examples (their control characters written as codes: they are printed),
never fatal. A parsed line whose method is not replayed is
*skipped*, counted by method.

Formats (``--format``):

``common``          ``%h %l %u %t "%r" %>s %b``
``combined``        common + ``"%{Referer}i" "%{User-Agent}i"``
``vhost_combined``  Apache's ``%v:%p`` + combined
``nginx``           nginx's default ``combined`` (same fields as Apache's),
                    optionally followed by ``"$http_x_forwarded_for"`` as in
                    the ``main`` format of nginx's sample configuration
``zc-lb``           zc-lb's default access log: combined followed by
                    ``key=value`` fields (``host="..." class="..."
                    worker=... upstream=... time=... retries=...``)
``auto``            (default) any of the above, line by line; the
                    referer/agent part is optional and a user agent cut off
                    before its closing quote is tolerated; ``key=value``
                    fields after the agent are read as zc-lb's are

A custom regular expression (``--regex``) needs a group ``request``, or
``path`` (with an optional ``method``, default GET); ``time``, ``host``
(or ``vhost``), ``class`` and ``status`` are used when present.

``key=value`` fields after the combined part (zc-lb's ``host`` and
``class``; values quoted and escaped as Apache quotes them, or bare) are
read in the ``zc-lb`` and ``auto`` formats: ``class`` is the request class
the LB gave the request, so it is what the entry is replayed with (as its
Host: a zc-lb with the ``host`` classifier gives the same class again),
and ``host`` is the Host the client sent, used when the request had no
class (``class="-"``).

The Host an entry is replayed with (its request class) is, in order of
precedence: the path segment chosen by ``host_from_segment``; the fixed
``host``; the class recorded in the log; the host recorded in the log; else None (the replay sends the
target's own host). The segment rule: segment N (1-based) of the path,
query removed, lower-cased, every character outside ``[a-z0-9-]``
replaced by ``-``, cut to 63 characters, followed by ``host_suffix``
(default ``.example``); a path with fewer than N segments, or an empty
segment, gives ``root`` + suffix. So ``/shuttle/missions/x.html`` with
segment 1 is ``shuttle.example``, ``/ksc.html`` is ``ksc-html.example``
and ``/`` is ``root.example``.  With a ``depth`` of D, the class is the
site's section D directories deep: segment N and those after it up to
N + D - 1 that are directories (followed by another segment), joined by
``-``.  So with segment 1 and depth 2, ``/shuttle/missions/x.html`` is
``shuttle-missions.example``, ``/images/x.gif`` stays
``images.example``.

Weak spots: ``%u`` containing spaces is not supported (Apache writes
``-`` for nearly every request); the Common Log Format time is the only
time format recognised without ``time_format``, besides ISO 8601 and
Unix seconds.
"""

from __future__ import annotations

import argparse
import calendar
import collections
import dataclasses
import datetime
import functools
import gzip
import io
import math
import re
import sys
import zlib
from typing import IO, Dict, Iterable, Iterator, List, Optional, Sequence

DEFAULT_METHODS = ("GET", "HEAD")
DEFAULT_HOST_SUFFIX = ".example"
MAX_EXAMPLES = 5

_QUOTED = r'"(?:[^"\\]|\\.)*"'
_CORE = (
    r'(?P<remote>\S+) (?P<ident>\S+) (?P<user>\S+) \[(?P<time>[^\]]+)\] '
    r'"(?P<request>(?:[^"\\]|\\.)*)" (?P<status>\d{3}|-) (?P<size>\d+|-)'
)
_REFERER_AGENT = r' "(?P<referer>(?:[^"\\]|\\.)*)" "(?P<agent>(?:[^"\\]|\\.)*)"'
_PAIR = re.compile(r'(?:^|\s)([A-Za-z_][\w.-]*)=("(?:[^"\\]|\\.)*"|\S*)')
_UNESCAPE = re.compile(r'\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|.)')

FORMATS: Dict[str, str] = {
    "common": r"^" + _CORE + r"\s*$",
    "combined": r"^" + _CORE + _REFERER_AGENT + r"\s*$",
    "vhost_combined": r"^(?P<vhost>\S+) " + _CORE + _REFERER_AGENT + r"\s*$",
    "nginx": r"^" + _CORE + _REFERER_AGENT + r'(?: "(?P<forwarded>(?:[^"\\]|\\.)*)")?\s*$',
    "zc-lb": r"^" + _CORE + _REFERER_AGENT + r"(?P<extra>\s.*)$",
    # Lenient: optional vhost, optional referer and agent (the agent may
    # lack its closing quote: a line cut short), anything after.
    "auto": (
        r"^(?:(?P<vhost>\S+) )?" + _CORE
        + r'(?: "(?P<referer>(?:[^"\\]|\\.)*)" "(?P<agent>(?:[^"\\]|\\.)*)"?(?P<extra>\s.*)?)?\s*$'
    ),
}

_METHOD_RE = re.compile(r"[A-Z][A-Z_-]*\Z")
_SEGMENT_BAD = re.compile(r"[^a-z0-9-]")
# Bytes allowed verbatim in a request target (RFC 3986 unreserved,
# sub-delims, ':', '@', '/', '?', and '%' for existing escapes).
_TARGET_SAFE = frozenset(
    b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    b"-._~!$&'()*+,;=:@/?%"
)


@dataclasses.dataclass(frozen=True, slots=True)
class Entry:
    """One replayable request from a log."""

    method: str
    path: str  # request target: path and query, safe to send as is
    host: Optional[str]  # Host header to send (the request class), None: target's
    time: Optional[float]  # Unix seconds, None when the line had no usable time
    status: Optional[int] = None  # the status the log recorded
    source: str = ""  # file:line, for messages
    rclass: Optional[str] = None  # the class a zc-lb log recorded (also the host)


@dataclasses.dataclass
class ParseStats:
    """What reading the logs gave: counts, and examples of bad lines."""

    lines: int = 0
    entries: int = 0
    unparsable: int = 0
    bad_times: int = 0
    skipped_methods: Dict[str, int] = dataclasses.field(default_factory=dict)
    examples: List[str] = dataclasses.field(default_factory=list)

    def bad_line(self, source: str, reason: str, line: str) -> None:
        self.unparsable += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append("%s: %s: %s" % (source, reason, shown(line[:200])))

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def shown(text: str) -> str:
    """``text`` with what a terminal would act on or not show (an escape
    sequence, a carriage return of a garbled line) written as its code:
    a bad line's example is printed as it is."""
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else "\\x%02x" % ord(char) if ord(char) < 256
                   else "\\u%04x" % ord(char) for char in text)


# -- time -------------------------------------------------------------------

_MONTHS = {
    m: i
    for i, m in enumerate(
        ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"), 1
    )
}


@functools.lru_cache(maxsize=4096)
def parse_clf_time(text: str) -> Optional[float]:
    """``01/Aug/1995:00:00:01 -0400`` -> Unix seconds, or None."""
    try:
        day, month, rest = text.split("/", 2)
        year, hour, minute, rest = rest.split(":", 3)
        second, _, zone = rest.partition(" ")
        stamp = calendar.timegm(
            (int(year), _MONTHS[month.lower()], int(day), int(hour), int(minute), int(second))
        )
        if zone:
            sign = -1 if zone[0] == "-" else 1
            digits = zone.lstrip("+-")
            if len(digits) != 4 or not digits.isdigit():
                return None
            stamp -= sign * (int(digits[:2]) * 3600 + int(digits[2:]) * 60)
        return float(stamp)
    except (ValueError, KeyError, OverflowError):  # (OverflowError: a garbled year)
        return None


def parse_time(text: str, time_format: Optional[str] = None) -> Optional[float]:
    """A log timestamp -> Unix seconds: strptime format, or CLF, ISO 8601, seconds."""
    text = text.strip()
    if time_format:
        try:
            parsed = datetime.datetime.strptime(text, time_format)
        except ValueError:
            return None
        if parsed.tzinfo is None:
            parsed = parsed.replace(tzinfo=datetime.timezone.utc)
        return parsed.timestamp()
    stamp = parse_clf_time(text)
    if stamp is not None:
        return stamp
    try:
        seconds = float(text)
    except ValueError:
        pass
    else:  # ("inf" and "nan" are floats, and no time: a replay paced by them stops)
        return seconds if math.isfinite(seconds) else None
    try:
        parsed = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=datetime.timezone.utc)
    return parsed.timestamp()


# -- request line and host --------------------------------------------------


def encode_target(target: str) -> str:
    """Percent-encode what may not appear in a request target; undo the
    log's escapes (``unescape``)."""
    target = unescape(target)
    try:
        raw = target.encode("latin-1")
    except UnicodeEncodeError:  # (past latin-1: its UTF-8, not a "?" that starts a query)
        raw = target.encode("utf-8", "backslashreplace")
    if all(b in _TARGET_SAFE for b in raw):
        return target
    return "".join(chr(b) if b in _TARGET_SAFE else "%%%02X" % b for b in raw)


def split_request(request: str) -> Optional[tuple]:
    """``METHOD TARGET [VERSION]`` -> (method, log host or None, target), or None."""
    parts = request.split()
    if len(parts) < 2 or not _METHOD_RE.match(parts[0]):
        return None
    if len(parts) >= 3 and parts[-1].upper().startswith("HTTP/"):
        parts.pop()
    target = " ".join(parts[1:])
    host = None
    lower = target[:8].lower()
    if lower.startswith("http://") or lower.startswith("https://"):
        rest = target.split("://", 1)[1]
        host, slash, path = rest.partition("/")
        target = slash + path if slash else "/"
    if target == "*":
        return parts[0], host, target
    if not target.startswith("/"):
        return None
    return parts[0], host, encode_target(target)


def _is_name(value: Optional[str]) -> bool:
    """Whether a logged host or class can go into a request's Host field
    without making another field of it (None can: there is none): no
    control character (a class may hold spaces; a Host with one is the
    LB's 400 to answer), and bytes alone: a character past latin-1 (a
    class logged as ``\\uNNNN``) is no byte of a header field."""
    return value is None or (value.isprintable() and (value.isascii() or max(value) <= "\xff"))


def unescape(value: str) -> str:
    """Undo Apache's (and zc-lb's) escapes: ``\\"``, ``\\\\``, ``\\xNN``, and
    zc-lb's ``\\uNNNN`` and ``\\UNNNNNNNN`` (a class's characters past latin-1)."""
    if "\\" not in value:
        return value
    return _UNESCAPE.sub(_unescaped, value)


def _unescaped(match: "re.Match[str]") -> str:
    """What one escape of ``unescape`` stands for (one past Unicode, as it is)."""
    escape = match.group(1)
    if len(escape) == 1:
        return escape
    code = int(escape[1:], 16)
    return chr(code) if code <= sys.maxunicode else match.group()


def parse_pairs(text: str) -> Dict[str, str]:
    """``key=value key="quoted value"`` fields -> {key: value}, unescaped."""
    pairs = {}
    for key, value in _PAIR.findall(text):
        if value.startswith('"') and value.endswith('"') and len(value) >= 2:
            value = unescape(value[1:-1])
        pairs[key] = value
    return pairs


def strip_port(host: str) -> str:
    """``example.com:80`` -> ``example.com`` (IPv6 literals kept whole)."""
    if host.startswith("["):
        return host[: host.find("]") + 1] if "]" in host else host
    return host.partition(":")[0]


def host_from_segment(path: str, segment: int, suffix: str = DEFAULT_HOST_SUFFIX,
                      depth: int = 1) -> str:
    """The Host made from path segment ``segment`` (1-based), and with a
    ``depth`` over 1 the directories after it; see the module doc."""
    name = section(path.partition("?")[0].split("/"), segment, depth)
    name = _SEGMENT_BAD.sub("-", name.lower())[:63]
    return (name or "root") + suffix


def section(parts: List[str], first: int, depth: int = 1) -> str:
    """Of a path split at its slashes, ``parts[first]`` (or ""), and with
    a ``depth`` over 1 the directories after it to that depth, joined by
    ``-``: not the path's last part, a file's name.  As it is, not made
    a Host (the simulator's sites use it too)."""
    name = parts[first] if len(parts) > first else ""
    if depth > 1 and name:
        name = "-".join([name] + [part for part in parts[first + 1:min(first + depth,
                                                                        len(parts) - 1)]
                                  if part])
    return name


def host_depth_error(args: argparse.Namespace) -> Optional[str]:
    """What is wrong with ``--host-depth`` among the options ``args``, or
    None: it does nothing without ``--host-from-segment``."""
    if args.host_depth > 1 and not args.host_from_segment:
        return "--host-depth needs --host-from-segment"
    return None


def check_host_depth(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse ``--host-depth`` where it would do nothing (``host_depth_error``:
    a command line's ``parser.error``, exit 2)."""
    error = host_depth_error(args)
    if error is not None:
        parser.error(error)


def positive_int(text: str) -> int:
    """``--host-depth``'s type: a whole number of 1 or more."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError("%r is not a whole number of 1 or more" % text)
    return value


def positive_number(text: str) -> float:
    """``--speed``'s type: a number over 0."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError("%r is not a number over 0" % text)
    return value


# -- the reader ---------------------------------------------------------------


class LogReader:
    """Iterate over the entries of one or more log files.

    ``paths`` are read in the order given ('-' is standard input, ``.gz``
    files are decompressed). ``stats`` is filled in while iterating.
    Iterating again reads the files again (with fresh stats).
    """

    def __init__(
        self,
        paths: Sequence[str],
        fmt: str = "auto",
        regex: Optional[str] = None,
        time_format: Optional[str] = None,
        methods: Iterable[str] = DEFAULT_METHODS,
        host: Optional[str] = None,
        segment: Optional[int] = None,
        host_suffix: str = DEFAULT_HOST_SUFFIX,
        depth: int = 1,
    ):
        if regex is None and fmt not in FORMATS:
            raise ValueError("unknown log format %r (one of %s)" % (fmt, ", ".join(FORMATS)))
        self.paths = list(paths)
        self.pattern = re.compile(regex if regex is not None else FORMATS[fmt])
        groups = self.pattern.groupindex
        if "request" not in groups and "path" not in groups:
            raise ValueError("log regular expression needs a group 'request' or 'path'")
        self.time_format = time_format
        self.methods = frozenset(m.upper() for m in methods)
        self.host = host
        self.segment = segment
        self.host_suffix = host_suffix
        self.depth = depth
        self.stats = ParseStats()

    def __repr__(self) -> str:
        return "<LogReader %s %r>" % (self.pattern.pattern[:40], self.paths)

    def __iter__(self) -> Iterator[Entry]:
        self.stats = ParseStats()
        for path in self.paths:
            with _open(path) as stream:
                try:
                    yield from self.parse_lines(stream, name=path)
                except (EOFError, zlib.error) as exc:  # (gzip's: not OSErrors)
                    raise OSError("%s is cut short or corrupt after %d lines: %s"
                                  % (path, self.stats.lines, exc))

    def parse_lines(self, lines: Iterable[str], name: str = "-") -> Iterator[Entry]:
        """Entries from lines of text; counts into ``stats``."""
        stats = self.stats
        for number, line in enumerate(lines, 1):
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            stats.lines += 1
            source = "%s:%d" % (name, number)
            entry = self.parse_line(line, source)
            if entry is not None:
                stats.entries += 1
                yield entry

    def parse_line(self, line: str, source: str = "") -> Optional[Entry]:
        """One line -> an Entry to replay, or None (counted as bad or skipped)."""
        stats = self.stats
        match = self.pattern.match(line)
        if match is None:
            stats.bad_line(source, "no format matches", line)
            return None
        fields = match.groupdict()
        if fields.get("request") is not None:
            split = split_request(fields["request"])
            if split is None:
                stats.bad_line(source, "bad request line", line)
                return None
            method, log_host, path = split
        else:
            method = (fields.get("method") or "GET").upper()
            log_host = None
            path = encode_target(fields.get("path") or "/")
        if method not in self.methods:
            stats.skipped_methods[method] = stats.skipped_methods.get(method, 0) + 1
            return None
        stamp = None
        if fields.get("time"):
            stamp = parse_time(fields["time"], self.time_format)
            if stamp is None:
                stats.bad_times += 1
        status = fields.get("status")
        rclass = fields.get("class")
        if fields.get("extra"):
            pairs = parse_pairs(fields["extra"])
            rclass = rclass or pairs.get("class")
            log_host = pairs.get("host") or log_host
        if rclass == "-":
            rclass = None
        host = fields.get("host") or fields.get("vhost") or log_host
        if not all(_is_name(value) for value in (host, rclass)):  # (a CR LF: another header)
            stats.bad_line(source, "a host or class that is no name", line)
            return None
        return Entry(
            method=method,
            path=path,
            host=self.choose_host(path, host, rclass),
            time=stamp,
            status=int(status) if status and status.isascii() and status.isdigit() else None,
            source=source,
            rclass=rclass,
        )

    def choose_host(self, path: str, log_host: Optional[str],
                    rclass: Optional[str] = None) -> Optional[str]:
        if self.segment:
            return host_from_segment(path, self.segment, self.host_suffix, self.depth)
        if self.host:
            return self.host
        if rclass:
            return rclass  # sent as it was classified: the class, whatever its case
        if log_host:
            name = strip_port(log_host).lower()
            if name and name != "-":
                return name
        return None


def _open(path: str) -> IO[str]:
    """A text stream over a log file; latin-1 never fails and keeps every byte."""
    if path == "-":
        return io.TextIOWrapper(sys.stdin.buffer, encoding="latin-1", newline="")
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="latin-1", newline="")
    return open(path, encoding="latin-1", newline="")


def read_entries(paths: Sequence[str], **options) -> tuple:
    """Read whole logs: (list of entries, ParseStats). Options as LogReader's."""
    reader = LogReader(paths, **options)
    entries = list(reader)
    return entries, reader.stats


def status_summary(stats: ParseStats) -> str:
    """One line saying what parsing gave."""
    skipped = sum(stats.skipped_methods.values())
    text = "%d lines, %d entries, %d unparsable, %d skipped by method" % (
        stats.lines, stats.entries, stats.unparsable, skipped)
    if stats.skipped_methods:
        text += " (%s)" % ", ".join(
            "%s %d" % item for item in collections.Counter(stats.skipped_methods).most_common())
    return text
