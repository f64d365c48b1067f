"""Access log formats: ``--access-log-format``, in Apache's LogFormat notation.

A format is text with %-fields, compiled once at start into a template and
a list of small functions, one per field; an unknown field is refused at
start (ConfigurationError, exit status 2).  The LB puts what only it knows
into the WSGI environ as plain values (``zc_lb.class``, ``zc_lb.worker.server``,
``zc_lb.upstream_time``, ``zc_lb.retries``) and the fields below format
them, so nothing is computed twice.

Fields (Apache's meaning where Apache has the letter)::

    %h            client address
    %l %u         "-" (identd, remote user: never known)
    %t            time the response started, [10/Oct/2000:13:55:36 -0700]
    %r            request line, escaped
    %s %>s        status
    %b            response bytes, "-" for none;  %B  the same, 0 for none
    %m %U %q %H   method, path, query string ("?..." or nothing), protocol
    %D            total time in microseconds;  %T  in whole seconds
    %{NAME}i      request header NAME, escaped ("-" if absent)
    %{class}z     the request's class ("-" if it has none)
    %{worker}z    the worker the request went to (last), HOST:PORT ("-": none)
    %{upstream}z  seconds from sending the request to the worker to its
                  response head ("-": no worker answered)
    %{time}z      total seconds, from the request's head read to the
                  response's end
    %{retries}z   times the request was retried on another worker (0 mostly)
    %{error}z     why the LB answered itself ("-": it did not): the cause, as
                  counted in the status document (``NoWorkerAvailable``,
                  ``HeadTimeout``...), with ``,retry-refused`` when a retry
                  of a request lost with its worker was refused
    %%            a percent sign

``AccessLog`` writes the lines: buffered, once a second, reopened by
name on SIGUSR1.

Escaped values have ``"`` and ``\\`` preceded by a backslash, and control
characters and those past ASCII written ``\\xNN`` (``\\uNNNN`` past
latin-1), as Apache does, so a quoted field stays one field and a line is
ASCII whatever the client sent.  The default is Apache's combined format
followed by ``key=value`` fields (``DEFAULT_FORMAT``), which
playback/logparse.py reads back.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from typing import IO, Callable, List, Optional, Tuple

from zc_lb.errors import ConfigurationError
from zc_lb.environ import CLASS, ERROR, RETRIES, UPSTREAM_TIME, WORKER

log = logging.getLogger(__name__)

DEFAULT_FORMAT = ('%h %l %u %t "%r" %>s %b "%{Referer}i" "%{User-Agent}i" '
                  'host="%{Host}i" class="%{class}z" worker=%{worker}z '
                  'upstream=%{upstream}z time=%{time}z retries=%{retries}z '
                  'error=%{error}z request_id="%{X-Request-ID}i"')
COMBINED = '%h %l %u %t "%r" %>s %b "%{Referer}i" "%{User-Agent}i"'

MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun",
          "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")


def clf_time(when: float) -> str:
    """``10/Oct/2000:13:55:36 -0700``, local time."""
    t = time.localtime(when)
    offset = -(time.altzone if t.tm_isdst > 0 else time.timezone)
    sign = "+" if offset >= 0 else "-"
    offset = abs(offset)
    return "%02d/%s/%04d:%02d:%02d:%02d %s%02d%02d" % (
        t.tm_mday, MONTHS[t.tm_mon - 1], t.tm_year, t.tm_hour, t.tm_min, t.tm_sec,
        sign, offset // 3600, offset % 3600 // 60)


def _escaped(char: str) -> str:
    """One character as a log line writes it: ``"`` and ``\\`` escaped,
    printable ASCII as it is, and every other character as its code:
    control characters (C1's NEL among them, and the line and paragraph
    separators, which readers take for line ends), and past ASCII as
    Apache does.  A header's text is its bytes read as latin-1 (PEP 3333),
    so ``\\xNN`` is the byte the client sent (as UTF-8 text, a client's
    UTF-8 would be encoded twice, and a reader of the log's bytes, as
    playback/logparse.py, would read another class than the LB gave)."""
    if char == '"' or char == "\\":
        return "\\" + char
    if char.isascii() and char.isprintable():
        return char
    code = ord(char)
    return "\\x%02x" % code if code < 256 else "\\u%04x" % code if code < 65536 else (
        "\\U%08x" % code)


def quote(value: Optional[str]) -> str:
    """``value`` escaped for a log line, "-" if empty or None."""
    if not value:
        return "-"
    if value.isascii() and value.isprintable() and '"' not in value and "\\" not in value:
        return value
    return "".join(map(_escaped, value))


# A field's function takes the request's ClientConnection (front/client.py) and
# its environ ({} for a request refused before it had one) and returns text.

Field = Callable[[object, dict], str]


def _host(handler, environ) -> str:
    client = handler.client_address
    return (client[0] if isinstance(client, tuple) else client) or "-"


def _status(handler, environ) -> str:
    status = handler.status or "000"
    if isinstance(status, bytes):
        status = status.decode("latin-1")
    return status.split()[0]


def _elapsed(handler) -> float:
    start = handler.time_start
    if not start:
        return 0.0
    return (handler.time_finish or time.time()) - start


def _header(name: str) -> Field:
    key = name.upper().replace("-", "_")
    if key not in ("CONTENT_TYPE", "CONTENT_LENGTH"):
        key = "HTTP_" + key
    return lambda handler, environ: quote(environ.get(key))


def _upstream(handler, environ) -> str:
    seconds = environ.get(UPSTREAM_TIME)
    return "-" if seconds is None else "%.6f" % seconds


def _class(handler, environ) -> str:
    rclass = environ.get(CLASS)
    return "-" if rclass is None else quote(rclass)


FIELDS = {
    "h": _host,
    "l": lambda handler, environ: "-",
    "u": lambda handler, environ: "-",
    "t": lambda handler, environ: "[%s]" % clf_time(handler.time_start or time.time()),
    "r": lambda handler, environ: quote(handler.requestline),
    "s": _status,
    ">s": _status,
    "b": lambda handler, environ: str(handler.response_length or "-"),
    "B": lambda handler, environ: str(handler.response_length or 0),
    "m": lambda handler, environ: quote(environ.get("REQUEST_METHOD")),
    "U": lambda handler, environ: quote(environ.get("PATH_INFO")),
    "q": lambda handler, environ: ("?" + quote(environ["QUERY_STRING"])
                                   if environ.get("QUERY_STRING") else ""),
    "H": lambda handler, environ: quote(environ.get("SERVER_PROTOCOL")),
    "D": lambda handler, environ: str(int(_elapsed(handler) * 1e6)),
    "T": lambda handler, environ: str(int(_elapsed(handler))),
}
NAMED = {  # %{NAME}z
    "class": _class,
    "worker": lambda handler, environ: environ.get(WORKER) or "-",
    "upstream": _upstream,
    "time": lambda handler, environ: "%.6f" % _elapsed(handler),
    "retries": lambda handler, environ: str(environ.get(RETRIES, 0)),
    "error": lambda handler, environ: (environ.get(ERROR)
                                       or getattr(handler, "error", None) or "-"),
}

_FIELD = re.compile(r"%(?:\{([^}]*)\})?(>?[A-Za-z%]?)")


def _known() -> str:
    return " ".join(["%" + name for name in FIELDS] + ["%{NAME}i"]
                    + ["%%{%s}z" % name for name in NAMED] + ["%%"])


def compile_format(text: str) -> Tuple[str, List[Field]]:
    """A %-template and its fields' functions; ConfigurationError naming
    the first unknown field."""
    template: List[str] = []
    fields: List[Field] = []
    position = 0
    for match in _FIELD.finditer(text):
        template.append(text[position:match.start()].replace("%", "%%"))
        position = match.end()
        argument, letter = match.groups()
        field: Optional[Field] = None
        if letter == "%" and argument is None:
            template.append("%%")
            continue
        if argument is None:
            field = FIELDS.get(letter)
        elif letter == "i" and argument:
            field = _header(argument)
        elif letter == "z":
            field = NAMED.get(argument)
        if field is None:
            raise ConfigurationError("unknown access log field %r in %r; known: %s"
                                     % (match.group(), text, _known()))
        template.append("%s")
        fields.append(field)
    template.append(text[position:].replace("%", "%%"))
    return "".join(template), fields


class LogFormat:
    """A compiled format: ``format(handler)`` is one log line, without
    its newline."""

    def __init__(self, text: str = DEFAULT_FORMAT) -> None:
        self.text = text
        self.template, self.fields = compile_format(text)

    def format(self, handler) -> str:
        environ = handler.environ or {}
        return self.template % tuple([field(handler, environ) for field in self.fields])

    def __repr__(self) -> str:
        return "<LogFormat %r>" % self.text


FLUSH_DELAY = 0.1  # seconds a line may wait in memory
UNWRITTEN_LIMIT = 16 * 1024 * 1024  # bytes held while the log cannot be written


class AccessLog:
    """A buffered access log: lines are kept in memory and written at
    most ``FLUSH_DELAY`` after the first of them came (and at close), all
    in one write: requests never wait on the disk, and an operator
    watching the log sees a request within a tenth of a second.  ``fmt``
    (front/accesslog.py) makes each line; ``reopen`` (SIGUSR1) opens the file
    again by its name, after logrotate moved it.  A write that fails (the
    disk full) loses nothing: what did not go out, to the byte, goes
    first at the next write, and lines past ``UNWRITTEN_LIMIT`` bytes held
    are dropped, counted, and the count logged once the log is written
    again."""

    def __init__(self, stream: IO[str], fmt: Optional[LogFormat] = None,
                 path: Optional[str] = None) -> None:
        self.stream = stream
        self.format = fmt or LogFormat()
        self.path = path
        self._lines: List[str] = []
        self._unwritten = b""  # what a failed write left, from where it stopped
        self.dropped = 0  # lines dropped while the log could not be written
        self._timer = None  # its flush timer, once started
        self.closed = False

    @classmethod
    def open(cls, path: str, fmt: Optional[LogFormat] = None) -> "AccessLog":
        """``-`` for standard output, else a file opened for appending."""
        if path == "-":
            return cls(sys.stdout, fmt)
        return cls(cls._open(path), fmt, path)

    @staticmethod
    def _open(path: str) -> IO[str]:
        try:
            return open(path, "a", encoding="utf-8", errors="replace")
        except OSError as exc:
            raise ConfigurationError("cannot open the access log %s: %s" % (path, exc))

    def start(self) -> None:
        if self._timer is None:  # (several listeners share one log)
            import gevent  # (the formats need no gevent: zc-lb --version imports them)

            # (a timer of the loop's, started by the first line of a batch)
            self._timer = gevent.get_hub().loop.timer(FLUSH_DELAY)

    def write(self, line: str) -> None:
        lines = self._lines
        lines.append(line)
        timer = self._timer
        if len(lines) == 1 and timer is not None and not timer.active:
            timer.start(self.flush)

    def flush(self) -> None:
        lines, self._lines = self._lines, []
        if not lines and not self._unwritten:
            return
        data = self._unwritten + "".join(lines).encode("utf-8", "replace")
        written, error = self._write(data)
        if error is not None:
            if not self._unwritten:  # (said once while it lasts)
                log.error("cannot write the access log: %s; keeping what is not written "
                          "(up to %d MiB) for the next write", error, UNWRITTEN_LIMIT >> 20)
            rest = data[written:]
            if len(rest) > UNWRITTEN_LIMIT:  # the newest lines go
                kept = rest.rfind(b"\n", 0, UNWRITTEN_LIMIT) + 1
                self.dropped += rest.count(b"\n", kept)
                rest = rest[:kept]
            self._unwritten = rest
        elif self._unwritten:
            log.warning("the access log is written again%s",
                        "; %d lines were dropped meanwhile" % self.dropped
                        if self.dropped else "")
            self._unwritten, self.dropped = b"", 0

    def _write(self, data: bytes) -> Tuple[int, Optional[Exception]]:
        """Write ``data`` to the file: how many bytes went out, and the
        error that stopped it, if one did (a partial write comes before
        the disk's error: the rest is written from where it stopped)."""
        stream = self.stream
        written = 0
        try:
            try:
                fd = stream.fileno()
            except (OSError, ValueError, AttributeError):  # (a stream of no file)
                fd = -1
            if fd < 0:
                stream.write(data.decode("utf-8", "replace"))
                stream.flush()
                return len(data), None
            stream.flush()  # (what went through the stream goes first)
            view = memoryview(data)
            while written < len(data):
                written += os.write(fd, view[written:])
        except (OSError, ValueError) as exc:
            return written, exc
        return written, None

    def reopen(self) -> None:
        """Write what is buffered to the old file, then continue in a file
        opened by name (logrotate's postrotate sends SIGUSR1).  If it cannot
        be opened, keep writing to the old one and say so."""
        if self.path is None:
            return
        self.flush()
        try:
            stream = self._open(self.path)
        except ConfigurationError as exc:
            log.error("%s; still writing to the old file", exc)
            return
        old, self.stream = self.stream, stream
        old.close()
        log.info("access log %s reopened", self.path)

    def close(self) -> None:
        """Write what is held and close the file; once (several listeners
        may share the log, each closing it as it stops)."""
        if self.closed:
            return
        self.closed = True
        if self._timer is not None:
            self._timer.stop()
            self._timer = None
        self.flush()
        if self.stream not in (sys.stdout, sys.stderr):
            self.stream.close()
