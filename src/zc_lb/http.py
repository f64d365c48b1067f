"""The HTTP(S) front server that feeds the LB's WSGI app.

We use gevent's pywsgi for HTTP/1.1 parsing, keep-alive, chunked bodies
and TLS, and add what a front proxy needs around it: TCP_NODELAY on every
client connection, an Apache combined access log (so logs can be
replayed) written through a buffer, compact logging of errors we expect
(a worker lost mid-body closes the client's connection with one log line,
not a traceback), and a graceful stop.
"""

from __future__ import annotations

import logging
import socket
import sys
import time
from typing import IO, Callable, List, Optional, Tuple

import gevent
import gevent.pywsgi

from .connection import send_all
from .errors import ZcLbError

log = logging.getLogger(__name__)

FLUSH_INTERVAL = 1.0
MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun",
          "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")


def _clf_time(when: float) -> str:
    t = time.localtime(when)
    offset = -(time.altzone if t.tm_isdst > 0 else time.timezone)
    sign = "+" if offset >= 0 else "-"
    offset = abs(offset)
    return "%02d/%s/%04d:%02d:%02d:%02d %s%02d%02d" % (
        t.tm_mday, MONTHS[t.tm_mon - 1], t.tm_year, t.tm_hour, t.tm_min, t.tm_sec,
        sign, offset // 3600, offset % 3600 // 60)


def _quote(value: Optional[str]) -> str:
    if not value:
        return "-"
    return value.replace("\\", "\\\\").replace('"', '\\"')


class AccessLog:
    """A buffered access log: lines are kept in memory and written once a
    second (and at close), so requests never wait on the disk."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self._lines: List[str] = []
        self._greenlet: Optional[gevent.Greenlet] = None

    @classmethod
    def open(cls, path: str) -> "AccessLog":
        """``-`` for standard output, else a file opened for appending."""
        if path == "-":
            return cls(sys.stdout)
        return cls(open(path, "a", encoding="utf-8", errors="replace"))

    def start(self) -> None:
        self._greenlet = gevent.spawn(self._flush_loop)

    def write(self, line: str) -> None:
        self._lines.append(line)

    def _flush_loop(self) -> None:
        while True:
            gevent.sleep(FLUSH_INTERVAL)
            self.flush()

    def flush(self) -> None:
        if self._lines:
            lines, self._lines = self._lines, []
            try:
                self.stream.write("".join(lines))
                self.stream.flush()
            except (OSError, ValueError) as exc:
                log.error("cannot write the access log: %s", exc)

    def close(self) -> None:
        if self._greenlet is not None:
            self._greenlet.kill()
        self.flush()
        if self.stream not in (sys.stdout, sys.stderr):
            self.stream.close()


MAX_HEADERS = 100
SMALL_BODY = 64 * 1024
MAX_HEADER_LINE = 8190


class RequestHeaders:
    """Request headers, parsed strictly and fast, with the interface pywsgi
    expects of its (much slower) ``email.parser`` based message class.

    A header line without a colon, a name with white space, obsolete line
    folding, too many headers or too long a line sets ``status``, which
    pywsgi answers with 400.
    """

    __slots__ = ("_items", "_first", "status")

    def __init__(self, items, status: str = "") -> None:
        self._items = items
        self._first: dict = {}
        for name, value in reversed(items):
            self._first[name.lower()] = value
        self.status = status

    @classmethod
    def read(cls, rfile) -> "RequestHeaders":
        items = []
        while True:
            line = rfile.readline(MAX_HEADER_LINE + 1)
            if len(line) > MAX_HEADER_LINE:
                return cls([], "Header line too long")
            if line in (b"\r\n", b"\n", b""):
                return cls._checked(items)
            if len(items) >= MAX_HEADERS:
                return cls([], "Too many headers")
            name, sep, value = line.partition(b":")
            if not sep or not name or name[:1] in b" \t" or b" " in name or b"\t" in name:
                return cls([], "Invalid header line %r" % (line[:80],))
            items.append((name.decode("latin-1"), value.strip().decode("latin-1")))

    @classmethod
    def _checked(cls, items) -> "RequestHeaders":
        """Refuse the framing ambiguities request smuggling is made of."""
        lengths = {v for k, v in items if k.lower() == "content-length"}
        codings = [v.strip().lower() for k, v in items if k.lower() == "transfer-encoding"]
        if len(lengths) > 1:
            return cls([], "Conflicting Content-Length headers")
        if codings and codings != ["chunked"]:
            return cls([], "Unsupported Transfer-Encoding %r" % ", ".join(codings))
        if codings and lengths:
            return cls([], "Both Content-Length and Transfer-Encoding")
        return cls(items)

    def get(self, name: str, default=None):
        return self._first.get(name.lower(), default)

    getheader = get

    def __delitem__(self, name: str) -> None:
        lowered = name.lower()
        self._items = [(k, v) for (k, v) in self._items if k.lower() != lowered]
        self._first.pop(lowered, None)

    @property
    def headers(self):
        return ["%s: %s\r\n" % item for item in self._items]

    @property
    def typeheader(self):
        return self._first.get("content-type")


class FrontHandler(gevent.pywsgi.WSGIHandler):
    """pywsgi's handler with NODELAY, strict and fast header parsing,
    combined log lines and compact errors."""

    def MessageClass(self, rfile, *args):  # noqa: N802 (pywsgi's name)
        return RequestHeaders.read(rfile)

    def get_environ(self) -> dict:
        environ = super().get_environ()
        environ["zc_lb.client_socket"] = self.socket  # to notice a hang-up
        return environ

    def finalize_headers(self) -> None:
        super().finalize_headers()
        if self.response_use_chunked and self.command == "HEAD":
            # No body follows a HEAD response, so no chunked framing either.
            self.response_use_chunked = False
            self.response_headers.remove((b"Transfer-Encoding", b"chunked"))
        if getattr(self.server, "draining", False) and not self.close_connection:
            self.close_connection = True  # tell keep-alive clients we are going
            self.response_headers.append((b"Connection", b"close"))

    def _write_with_headers(self, data) -> None:
        # pywsgi sends the head and the first chunk in two system calls;
        # for a small first chunk, one is enough.
        if not data or len(data) > SMALL_BODY:
            return super()._write_with_headers(data)
        self.headers_sent = True
        self.finalize_headers()
        towrite = bytearray(b"HTTP/1.1 ")
        towrite += self.status
        towrite += b"\r\n"
        for header, value in self.response_headers:
            towrite += header + b": " + value + b"\r\n"
        towrite += b"\r\n"
        if self.response_use_chunked:
            towrite += b"%x\r\n" % len(data) + data + b"\r\n"
        else:
            towrite += data
        self._sendall(towrite)

    def _sendall(self, data) -> None:
        try:
            send_all(self.socket, data)
        except OSError as exc:
            self.status = "socket error: %s" % exc
            if self.code > 0:
                self.code = -self.code
            raise
        self.response_length += len(data)

    def __init__(self, sock, address, server, rfile=None) -> None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
        # A client that sends or reads nothing for this long is dropped,
        # so idle or slowloris connections cannot pile up.
        sock.settimeout(getattr(server, "client_timeout", None))
        super().__init__(sock, address, server, rfile)

    def format_request(self) -> str:
        environ = self.environ or {}
        client = self.client_address
        host = client[0] if isinstance(client, tuple) else client
        status = (self._orig_status or self.status or "000").split()[0]
        if isinstance(status, bytes):
            status = status.decode("latin-1")
        length = self.response_length or "-"
        return '%s - - [%s] "%s" %s %s "%s" "%s"' % (
            host or "-", _clf_time(self.time_start or time.time()),
            _quote(self.requestline), status, length,
            _quote(environ.get("HTTP_REFERER")), _quote(environ.get("HTTP_USER_AGENT")))

    def log_request(self) -> None:
        access_log = self.server.access_log
        if access_log is not None:
            access_log.write(self.format_request() + "\n")

    def handle_error(self, t, v, tb) -> None:
        if isinstance(v, ZcLbError):
            log.warning("closing client connection (%s %s): %s",
                        (self.environ or {}).get("REQUEST_METHOD"),
                        (self.environ or {}).get("PATH_INFO"), v)
            self.close_connection = True
            self._send_error_response_if_possible(502)
            return
        super().handle_error(t, v, tb)


gevent.pywsgi._ERRORS.setdefault(502, (  # type: ignore[attr-defined]
    "502 Bad Gateway",
    [("Content-Type", "text/plain"), ("Connection", "close"), ("Content-Length", "11")],
    b"Bad Gateway"))


class FrontServer:
    """The HTTP(S) server in front of a WSGI app (the LB, or the status app)."""

    def __init__(self, listen: Tuple[str, int], app: Callable,
                 access_log: Optional[AccessLog] = None,
                 certfile: Optional[str] = None, keyfile: Optional[str] = None,
                 client_timeout: Optional[float] = None) -> None:
        self.listen = listen
        self.client_timeout = client_timeout
        self.app = app
        self.access_log = access_log
        self.certfile = certfile
        self.keyfile = keyfile
        self.server: Optional[gevent.pywsgi.WSGIServer] = None

    @property
    def address(self) -> Tuple[str, int]:
        assert self.server is not None, "not started"
        return self.server.address[:2]

    def start(self) -> None:
        """Bind and start serving."""
        ssl_args = {}
        if self.certfile:
            ssl_args = {"certfile": self.certfile, "keyfile": self.keyfile or self.certfile}
        self.server = gevent.pywsgi.WSGIServer(
            self.listen, self.app, log=self.access_log, error_log=_ErrorLog(),
            handler_class=FrontHandler, **ssl_args)
        # pywsgi replaces log=None by a logger of its own; remember ours.
        self.server.access_log = self.access_log  # type: ignore[attr-defined]
        self.server.client_timeout = self.client_timeout  # type: ignore[attr-defined]
        self.server.start()
        if self.access_log is not None:
            self.access_log.start()

    def drain(self) -> None:
        """Stop accepting; answer what is in flight with Connection: close."""
        if self.server is not None:
            self.server.draining = True  # type: ignore[attr-defined]
            self.server.close()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop accepting, wait up to ``timeout`` for requests in flight."""
        if self.server is not None:
            self.server.close()
            self.server.stop(timeout=timeout)
        if self.access_log is not None:
            self.access_log.close()


class _ErrorLog:
    """pywsgi's error log, routed to our logger."""

    def write(self, text: str) -> None:
        text = text.rstrip()
        if text:
            log.warning("%s", text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        pass
