"""The HTTP(S) front server that feeds the LB's WSGI app.

We use gevent's pywsgi for keep-alive, chunked bodies and responses, and
add what a front proxy needs around it: a strict request head
(httpparse.py: the RFC 9110/9112 grammar, and a size that fits one
Request frame), a deadline for the whole head (slowloris), a cap on
client connections answered with 503, TLS from a context checked at
start with failed handshakes logged in one line, TCP_NODELAY on every
client connection, an access log (accesslog.py: Apache combined plus
the LB's fields, so logs can be replayed with their classes) written
through a buffer and reopened on SIGUSR1, compact logging of errors we
expect (a worker lost mid-body closes the client's connection with one
log line, not a traceback), and a graceful stop.

A refused request head gets a short response with ``Connection: close``
(``refusal``) and its connection is closed.
"""

from __future__ import annotations

import errno
import logging
import socket
import sys
import time
from typing import IO, Callable, List, Optional, Tuple

import gevent
import gevent.pywsgi

from .accesslog import COMBINED, LogFormat
from .connection import send_all
from .errors import BadRequest, ConfigurationError, HeadTimeout, ZcLbError
from .httpparse import MAX_HEAD, check_head, parse_request_line, read_fields
from .settings import LB_SETTINGS

log = logging.getLogger(__name__)
COMBINED_FORMAT = LogFormat(COMBINED)

FLUSH_INTERVAL = 1.0


class AccessLog:
    """A buffered access log: lines are kept in memory and written once a
    second (and at close), so requests never wait on the disk.  ``fmt``
    (accesslog.py) makes each line; ``reopen`` (SIGUSR1) opens the file
    again by its name, after logrotate moved it."""

    def __init__(self, stream: IO[str], fmt: Optional[LogFormat] = None,
                 path: Optional[str] = None) -> None:
        self.stream = stream
        self.format = fmt or LogFormat()
        self.path = path
        self._lines: List[str] = []
        self._greenlet: Optional[gevent.Greenlet] = None

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
        if self._greenlet is not None:
            self._greenlet.kill()
        self.flush()
        if self.stream not in (sys.stdout, sys.stderr):
            self.stream.close()


SMALL_BODY = 64 * 1024
RESERVED_FILES = 100  # descriptors kept for worker links, ZooKeeper, logs
TURN_AWAY_LINGER = 0.5  # seconds to read a refused client's request
MAX_TURNING_AWAY = 50  # past this, refused clients are closed unanswered
OUT_OF_FILES = frozenset((errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM))
ACCEPT_PAUSE = 0.1  # seconds without accepting when out of descriptors
OUT_OF_FILES_LOG_EVERY = 10.0
DEFAULT_CIPHERS = ":".join((  # Mozilla's "intermediate" list (TLS 1.2)
    "ECDHE-ECDSA-AES128-GCM-SHA256", "ECDHE-RSA-AES128-GCM-SHA256",
    "ECDHE-ECDSA-AES256-GCM-SHA384", "ECDHE-RSA-AES256-GCM-SHA384",
    "ECDHE-ECDSA-CHACHA20-POLY1305", "ECDHE-RSA-CHACHA20-POLY1305",
    "DHE-RSA-AES128-GCM-SHA256", "DHE-RSA-AES256-GCM-SHA384"))
TLS_VERSIONS = ("TLSv1.2", "TLSv1.3")
REASONS = {400: "Bad Request", 408: "Request Timeout",
           431: "Request Header Fields Too Large", 501: "Not Implemented",
           503: "Service Unavailable", 505: "HTTP Version Not Supported"}


def refusal(status: int) -> bytes:
    """A complete response refusing a request, closing the connection."""
    reason = REASONS[status]
    return (b"HTTP/1.1 %d %s\r\nConnection: close\r\nContent-Type: text/plain\r\n"
            b"Content-Length: %d\r\n\r\n%s\n" % (
                status, reason.encode(), len(reason) + 1, reason.encode()))


class RequestHeaders:
    """Checked request fields (httpparse.py), with the interface pywsgi
    expects of its (much slower) ``email.parser`` based message class."""

    __slots__ = ("_items", "_first", "status")

    def __init__(self, items) -> None:
        self._items = items
        self._first: dict = {}
        for name, value in reversed(items):
            self._first[name.lower()] = value
        self.status = ""

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

    _deadline: Optional[gevent.Timeout] = None
    _heads = 0  # request heads started on this connection

    def read_requestline(self) -> str:
        # The first head must be complete within the header timeout of the
        # accept; a later one within the header timeout of its first byte
        # (the wait between keep-alive requests is client_timeout's business).
        # A refused request's access-log line must not show the last one's.
        self.requestline, self._orig_status, self.environ = "", None, None
        self.response_length = 0
        rfile = self.rfile
        if self._heads and not rfile.peek(1):
            return ""
        timeout = self.server.header_timeout
        if timeout:
            self._deadline = gevent.Timeout.start_new(
                timeout, HeadTimeout("no complete request head within %gs" % timeout, 408))
        try:
            if not rfile.peek(1):
                return ""
        except HeadTimeout:
            return ""  # not a byte in time (an idle pre-connection?): close quietly
        self._heads += 1
        line = rfile.readline(gevent.pywsgi.MAX_REQUEST_LINE)
        if line in (b"\r\n", b"\n"):  # RFC 9112 2.2: ignore one empty line first
            line = rfile.readline(gevent.pywsgi.MAX_REQUEST_LINE)
        return line.decode("latin-1")

    def read_request(self, raw_requestline: str) -> bool:
        """Parse and check the head (httpparse.py); BadRequest if it is not HTTP."""
        self.requestline = raw_requestline.rstrip("\r\n")
        try:
            method, target, version = parse_request_line(raw_requestline.encode("latin-1"))
            fields = read_fields(self.rfile.readline, MAX_HEAD - len(raw_requestline))
            head = check_head(method, target, version, fields)
        finally:
            self._cancel_deadline()
        self.command, self.path, self.request_version = head.method, head.path, head.version
        self.headers = RequestHeaders(head.fields)
        self.content_length = head.content_length
        self.close_connection = head.close
        return True

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.close()
            self._deadline = None

    def handle_one_request(self):
        try:
            result = super().handle_one_request()
        except HeadTimeout as exc:  # raised while reading the request line
            result = self._handle_client_error(exc)
        finally:
            self._cancel_deadline()
        if isinstance(result, tuple):  # a refusal: send it here, where a gone
            self.status, response = result  # client is no traceback
            try:
                send_all(self.socket, response)
                self.response_length = len(response)
            except OSError:
                pass
            self.log_request()
            return None
        return result

    def _handle_client_error(self, ex):
        if isinstance(ex, OSError):
            return None  # the client left (or timed out) in the middle of its head
        status = ex.http_status if isinstance(ex, BadRequest) else 400
        log.info("%d for %s: %s", status, _peer(self.client_address), ex)
        return (str(status), refusal(status))

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
        access_log = self.server.access_log
        return (access_log.format if access_log is not None else COMBINED_FORMAT).format(self)

    def log_request(self) -> None:
        access_log = self.server.access_log
        if access_log is not None:
            access_log.write(access_log.format.format(self) + "\n")

    def handle_error(self, t, v, tb) -> None:
        if isinstance(v, ZcLbError):
            log.warning("closing client connection (%s %s): %s",
                        (self.environ or {}).get("REQUEST_METHOD"),
                        (self.environ or {}).get("PATH_INFO"), v)
            self.close_connection = True
            self._send_bad_gateway()
            return
        super().handle_error(t, v, tb)

    def _send_bad_gateway(self) -> None:
        """502, if nothing of the response is out yet (pywsgi's table of
        error responses has no 502, and is not ours to patch)."""
        if self.response_length:
            return
        try:
            self.start_response("502 Bad Gateway", [
                ("Content-Type", "text/plain"), ("Connection", "close"),
                ("Content-Length", "11")])
            self.write(b"Bad Gateway")
        except OSError:
            pass


def tls_context(certfile: str, keyfile: Optional[str] = None,
                min_version: str = "TLSv1.2", ciphers: Optional[str] = None):
    """A server SSLContext with the certificate and key loaded and checked;
    ConfigurationError (one line) if they cannot serve."""
    import gevent.ssl as ssl  # the cooperative module: handshakes must yield

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    if min_version not in TLS_VERSIONS:
        raise ConfigurationError("TLS minimum version must be one of %s, not %r"
                                 % (", ".join(TLS_VERSIONS), min_version))
    context.minimum_version = ssl.TLSVersion[min_version.replace(".", "_")]
    context.options |= ssl.OP_NO_COMPRESSION | ssl.OP_CIPHER_SERVER_PREFERENCE
    try:
        context.set_ciphers(ciphers or DEFAULT_CIPHERS)
    except ssl.SSLError as exc:
        raise ConfigurationError("no usable TLS cipher in %r: %s" % (ciphers, exc))
    try:
        context.load_cert_chain(certfile, keyfile or None)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigurationError("cannot use certificate %s with key %s: %s" % (
            certfile, keyfile or "(in the certificate file)", exc))
    return context


def fit_open_files(connections: int) -> int:
    """Raise the open-file limit so ``connections`` fit, as far as the hard
    limit allows; the number of connections that do fit."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = connections + RESERVED_FILES
    if soft != resource.RLIM_INFINITY and soft < wanted:
        soft = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    if soft != resource.RLIM_INFINITY and soft < wanted:
        fitted = max(soft - RESERVED_FILES, 1)
        log.warning("the open-file limit (%d) allows %d client connections, not %d",
                    soft, fitted, connections)
        return fitted
    return connections


class _WSGIServer(gevent.pywsgi.WSGIServer):
    """pywsgi's server, counting client connections (turning away those
    past ``max_connections`` with 503) and doing TLS handshakes itself, so
    a failed one is one log line, not a traceback."""

    access_log: Optional[AccessLog] = None
    client_timeout: Optional[float] = None
    header_timeout: Optional[float] = None
    max_connections: Optional[int] = None
    tls = None
    draining = False
    connections = 0
    turning_away = 0
    _out_of_files_logged = 0.0

    def do_read(self):
        try:
            return super().do_read()
        except OSError as exc:
            if exc.errno not in OUT_OF_FILES:
                raise
        # gevent would log a traceback per accept; pause, and say it once in a while
        now = time.monotonic()
        if now - self._out_of_files_logged > OUT_OF_FILES_LOG_EVERY:
            self._out_of_files_logged = now
            log.warning("out of file descriptors with %d client connections; pausing "
                        "accepts (lower --max-connections, or raise the limit)",
                        self.connections)
        self.stop_accepting()
        self._timer = self.loop.timer(ACCEPT_PAUSE)
        self._timer.start(self._start_accepting_if_started)
        return None

    def handle(self, sock, address) -> None:
        if self.max_connections is not None and self.connections >= self.max_connections:
            self._turn_away(sock, address)
            return
        self.connections += 1
        try:
            if self.tls is not None:
                sock = self._handshake(sock, address)
            if sock is not None:
                super().handle(sock, address)
        finally:
            self.connections -= 1

    def _handshake(self, sock, address):
        """The TLS socket, or None (logged, closed) if the handshake failed."""
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(self.header_timeout or self.client_timeout)
            tls_sock = self.tls.wrap_socket(sock, server_side=True,
                                            do_handshake_on_connect=False)
            tls_sock.do_handshake()
            return tls_sock
        except OSError as exc:  # ssl.SSLError and socket.timeout are OSErrors
            reason = getattr(exc, "reason", None) or exc
            log.info("TLS handshake with %s failed: %s%s", _peer(address), reason,
                     " (plain HTTP sent to the HTTPS port)" if reason == "HTTP_REQUEST" else "")
            sock.close()
            return None

    def _turn_away(self, sock, address) -> None:
        """503 and close: past the cap, a clear answer, not a silent queue."""
        if self.turning_away >= MAX_TURNING_AWAY:
            sock.close()  # a flood: answering would cost the descriptors we lack
            return
        self.turning_away += 1
        log.info("503 for %s: %d client connections already", _peer(address),
                 self.connections)
        try:
            sock.settimeout(TURN_AWAY_LINGER)
            if self.tls is None:  # TLS clients cannot read a plain answer
                send_all(sock, refusal(503))
            sock.shutdown(socket.SHUT_WR)
            while sock.recv(65536):  # read the request, so closing does not
                pass  # reset the connection before the client reads the 503
        except OSError:
            pass
        finally:
            sock.close()
            self.turning_away -= 1


class FrontServer:
    """The HTTP(S) server in front of a WSGI app (the LB, or the status app).

    ``client_timeout`` bounds each read or write on a client connection,
    ``header_timeout`` the whole request head from its first byte;
    ``max_connections`` caps concurrent client connections (503 past it);
    ``tls`` is an SSLContext from ``tls_context``, for HTTPS.
    """

    def __init__(self, listen: Tuple[str, int], app: Callable,
                 access_log: Optional[AccessLog] = None, tls=None,
                 client_timeout: Optional[float] = None,
                 header_timeout: Optional[float] = LB_SETTINGS["header_timeout"].default,
                 max_connections: Optional[int] = None) -> None:
        self.listen = listen
        self.client_timeout = client_timeout
        self.header_timeout = header_timeout
        self.max_connections = max_connections
        self.app = app
        self.access_log = access_log
        self.tls = tls
        self.server: Optional[_WSGIServer] = None

    @property
    def address(self) -> Tuple[str, int]:
        assert self.server is not None, "not started"
        return self.server.address[:2]

    def start(self) -> None:
        """Bind and start serving."""
        scheme = "https" if self.tls is not None else "http"
        server = self.server = _WSGIServer(
            self.listen, self.app, log=self.access_log, error_log=_ErrorLog(),
            handler_class=FrontHandler, environ={"wsgi.url_scheme": scheme})
        # pywsgi replaces log=None by a logger of its own; remember ours.
        server.access_log = self.access_log
        server.client_timeout = self.client_timeout
        server.header_timeout = self.header_timeout
        server.tls = self.tls
        if self.max_connections is not None:
            server.max_connections = fit_open_files(self.max_connections)
        server.start()
        if self.access_log is not None:
            self.access_log.start()

    def drain(self) -> None:
        """Stop accepting; answer what is in flight with Connection: close."""
        if self.server is not None:
            self.server.draining = True
            self.server.close()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop accepting, wait up to ``timeout`` for requests in flight."""
        if self.server is not None:
            self.server.close()
            self.server.stop(timeout=timeout)
        if self.access_log is not None:
            self.access_log.close()


def _peer(address) -> str:
    if isinstance(address, tuple):
        return "%s:%s" % address[:2]
    return str(address or "-")


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
