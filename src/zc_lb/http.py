"""The HTTP(S) front server that feeds the LB's WSGI app.

A gevent StreamServer whose connection greenlet (``ClientConnection``)
reads requests with h1.py (llhttp, through httptools, plus the rules of
httpparse.py), builds each request's PEP 3333 environ once from a
per-connection base, calls the WSGI app in the same greenlet and writes
the response: the head and the first body bytes in one send, chunked
framing when the length is unknown, keep-alive and pipelining (requests
are answered in order), Expect: 100-continue answered on the first read
of the body.  Around it, what a front proxy needs: a deadline for the
whole head (slowloris), an idle timeout per read and write, a cap on
client connections answered with 503, TLS from a context checked at
start with failed handshakes logged in one line, TCP_NODELAY on every
client connection, an access log (accesslog.py) written through a
buffer and reopened on SIGUSR1, compact logging of errors we expect (a
worker lost mid-body closes the client's connection with one log line,
not a traceback), and a graceful stop.

A refused request head gets a short response with ``Connection: close``
(``refusal``) and its connection is closed; so does a request whose body
was not read to its end, since the next request's first byte cannot be
found without reading it.
"""

from __future__ import annotations

import collections
import errno
import logging
import socket
import sys
import time
from typing import Callable, List, Optional, Tuple

import gevent
import gevent.server
import gevent.ssl
from gevent.hub import Waiter, get_hub

from .accesslog import AccessLog
from .connection import wait
from .sockets import send_all
from .errors import (BadResponseHead, ClientError, ClientGone, ConfigurationError, HeadTimeout,
                     ZcLbError)
from . import proxyproto
from .forwarding import Forwarding
from .h1 import (BODILESS_STATUS, REASONS, Request, RequestReader, check_response, date_line,
                 request_variables, response_head, start_again)
from .settings import LB_SETTINGS

log = logging.getLogger(__name__)

RESERVED_FILES = 100  # descriptors kept for worker links, ZooKeeper, logs
MAX_DEFAULT_CONNECTIONS = 50000  # --max-connections by default, at most
TURN_AWAY_LINGER = 0.5  # seconds to read a refused client's request
MAX_TURNING_AWAY = 50  # past this, refused clients are closed unanswered
EVICT_AFTER = 0.5  # seconds a connection waits for a head before it may make room
ACCEPT_HEADER_WAIT = 10.0  # seconds for a PROXY header when no timeout is set
OUT_OF_FILES = frozenset((errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM))
ACCEPT_PAUSE = 0.1  # seconds without accepting when out of descriptors
OUT_OF_FILES_LOG_EVERY = 10.0
DEFAULT_CIPHERS = ":".join((  # Mozilla's "intermediate" list (TLS 1.2)
    "ECDHE-ECDSA-AES128-GCM-SHA256", "ECDHE-RSA-AES128-GCM-SHA256",
    "ECDHE-ECDSA-AES256-GCM-SHA384", "ECDHE-RSA-AES256-GCM-SHA384",
    "ECDHE-ECDSA-CHACHA20-POLY1305", "ECDHE-RSA-CHACHA20-POLY1305",
    "DHE-RSA-AES128-GCM-SHA256", "DHE-RSA-AES256-GCM-SHA384"))
TLS_VERSIONS = ("TLSv1.2", "TLSv1.3")


def refusal(status: int) -> bytes:
    """A complete response refusing a request, closing the connection."""
    reason = REASONS[status]
    return (b"HTTP/1.1 %d %s\r\nConnection: close\r\nContent-Type: text/plain\r\n"
            b"%sContent-Length: %d\r\n\r\n%s\n" % (
                status, reason.encode(), b"Retry-After: 1\r\n" if status == 503 else b"",
                len(reason) + 1, reason.encode()))


RECV_SIZE = 64 * 1024
PARK_AFTER = 2.0  # seconds a keep-alive client idles before its greenlet is let go
PARKED = object()  # what ``_next_request`` says of a connection it parked
LINGER = 0.5  # seconds to read and drop a refused client's bytes before closing
LINGER_BYTES = 1024 * 1024
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class ClientConnection:
    """One client connection: requests read (h1.py), the app called once
    per request in this greenlet, responses written.  The access log
    reads a request's record from its attributes (``environ``,
    ``status``, ``requestline``, ``response_length``, ``time_start``,
    ``time_finish``, ``client_address``), as it did pywsgi's handler's."""

    def __init__(self, server: "_Server", sock, address) -> None:
        self.server = server
        self.sock = sock
        self.client_address = address
        self.reader = RequestReader(time.time if server.access_log is not None else None)
        # The client's address, for each request's environ (set there, not
        # kept in dicts of this connection's own: an idle client costs less).
        self.remote = (address[0], str(address[1])) if isinstance(address, tuple) else None
        forwarding = server.forwarding
        self.peer = address[0] if isinstance(address, tuple) else None
        self.evicted = False  # ended by the server to make room
        self.trusted = forwarding is not None and forwarding.trusts(self.peer)
        # Reads and writes wait at most the client timeout for progress
        # (gevent's socket timeout); a request head's wait has a deadline
        # of its own (``_recv``).
        sock.settimeout(server.client_timeout)
        raw = getattr(sock, "_sock", None)
        plain = not isinstance(sock, gevent.ssl.SSLSocket) and raw is not None
        self._raw_recv = raw.recv if plain else None
        self._raw_send = raw.send if plain else None
        self._readable = None  # the socket's read watcher, made at the first wait
        self._idle = None  # while parked, the client timeout's timer
        self.parked = False  # its greenlet let go while the client idles
        self._reset()

    def _reset(self) -> None:
        self.environ: Optional[dict] = None
        self.requestline = ""
        self.status: Optional[str] = None
        self.response_length = 0
        self.time_start = self.time_finish = 0.0
        self.headers_sent = False
        self.error: Optional[str] = None  # why the front answered itself, if it did
        self._headers: List[Tuple[str, str]] = []
        self._ready: Optional[bytes] = None  # a head ready for the client (start_ready)
        self._ready_length: Optional[int] = None
        self._chunked = False
        self._bodiless = False
        self.close = False

    def run(self, first: bool = True) -> bool:
        """Serve requests until the client leaves, errs, or keep-alive ends
        (False), or until it idles PARK_AFTER seconds between requests
        (True: parked, see ``_park``).  ``first``: no request yet."""
        while True:
            request = self._next_request(first)
            if request is PARKED:
                return True
            if request is None:
                return False
            first = False  # (the state of the last request is reset: see below)
            self.time_start = request.started
            if request.refusal is not None:
                self._refuse(request.refusal)
                return False
            self._serve(request)
            if not request.complete:  # a body left unread cannot be skipped
                self._linger()  # safely: hang up, once the client has our answer
                return False
            if self.close:
                return False
            # An idle keep-alive client holds nothing of its last request.
            request = None
            self._reset()

    # -- reading --------------------------------------------------------

    def _next_request(self, first: bool) -> Optional[Request]:
        """The next request; None when the connection should end.  The
        first head must be complete within the header timeout of the
        accept, a later one within the header timeout of its first byte;
        the wait between requests is the client timeout's business."""
        reader = self.reader
        request = reader.next_request()
        if request is not None or reader.broken:
            return request
        waiting = self.server.waiting
        if self not in waiting:  # (one resumed from parking is there since it parked)
            waiting[self] = time.monotonic()  # (the oldest may be evicted for a newcomer)
        try:
            request = self._wait_for_request(first)
        except BaseException:
            waiting.pop(self, None)
            raise
        if request is not PARKED:
            waiting.pop(self, None)
        return request

    def _wait_for_request(self, first: bool) -> Optional[Request]:
        reader, server = self.reader, self.server
        header_timeout, client_timeout = server.header_timeout, server.client_timeout
        deadline = time.monotonic() + header_timeout if first and header_timeout else None
        while True:
            if deadline is None and header_timeout and reader.in_head:
                deadline = time.monotonic() + header_timeout
            timeout = client_timeout
            if deadline is not None:
                timeout = deadline - time.monotonic()
                if timeout <= 0:  # (it passed while the last bytes came in)
                    return self._head_timeout(header_timeout)
                if client_timeout is not None:
                    timeout = min(timeout, client_timeout)
            # Idle between requests: park after PARK_AFTER (plain sockets).
            park = (deadline is None and not reader.in_head and self._raw_recv is not None
                    and (timeout is None or timeout > PARK_AFTER))
            try:
                data = self._recv(PARK_AFTER if park else timeout)
            except socket.timeout:
                if deadline is not None and time.monotonic() >= deadline:
                    return self._head_timeout(header_timeout)
                if park:
                    return self._park(None if timeout is None else timeout - PARK_AFTER)
                return None  # idle between requests: close quietly
            except OSError:
                return None
            if self.evicted:
                return self._evict()
            reader.receive_data(data)
            request = reader.next_request()
            if request is not None or reader.broken or not data:
                return request

    def _park(self, timeout: Optional[float]) -> object:
        """Let this connection's greenlet go while its client idles, and
        resume it in a new one (``_unpark``) when the client sends again
        or the server evicts it, or close it after ``timeout`` more
        seconds (``_expire``).  A greenlet's saved stack and its frames
        were a third of what an idle keep-alive client cost; a busy
        client never parks.  PARKED: the caller must let the connection be."""
        assert self._readable is not None  # (made by the wait that timed out)
        self.parked = True
        self._readable.start(self._unpark)
        if timeout is not None:
            self._idle = get_hub().loop.timer(timeout)
            self._idle.start(self._expire, update=True)
        return PARKED

    def _stop_parking(self) -> None:
        assert self._readable is not None
        self.parked = False
        self._readable.stop()
        if self._idle is not None:
            self._idle.close()
            self._idle = None

    def _unpark(self) -> None:
        """(From the hub) the client sent, or hung up, or was evicted."""
        self._stop_parking()
        gevent.spawn(self.server.serve, self, False)

    def _expire(self) -> None:
        """(From the hub) the client timeout passed while parked: close quietly."""
        self._stop_parking()
        self.server.waiting.pop(self, None)
        self.server.ended(self.sock)

    def _recv(self, timeout: Optional[float]) -> bytes:
        """``sock.recv`` within ``timeout`` seconds (socket.timeout past it).
        gevent's own made a Timeout object for every wait, and changing
        the socket's timeout for the wait cost as much again; here a
        wait is a timer on the loop.  (A TLS socket reads through gevent.)"""
        raw_recv = self._raw_recv
        if raw_recv is None:
            sock = self.sock
            sock.settimeout(timeout)
            try:
                return sock.recv(RECV_SIZE)
            finally:
                sock.settimeout(self.server.client_timeout)
        while True:
            try:
                return raw_recv(RECV_SIZE)
            except BlockingIOError:
                self._wait_readable(timeout)

    def _wait_readable(self, timeout: Optional[float]) -> None:
        hub = get_hub()
        readable = self._readable
        if readable is None:
            readable = self._readable = hub.loop.io(self.sock.fileno(), 1)
        waiter = Waiter(hub)
        readable.start(waiter.switch, None)
        try:
            wait(waiter, timeout, socket.timeout, "timed out")
        finally:
            readable.stop()

    def _head_timeout(self, header_timeout: float) -> None:
        """The header timeout passed: see ``_end_waiting``."""
        return self._end_waiting("no complete request head within %gs" % header_timeout)

    def _evict(self) -> None:
        """The server made room for a new connection by ending this one,
        the longest waiting for a request: see ``_end_waiting``."""
        return self._end_waiting("evicted: the slowest request head when the connections "
                                 "ran out")

    def _end_waiting(self, why: str) -> None:
        """End a connection waiting for a request: 408 (counted) for a head
        begun, and for one never begun, nothing (it asked nothing).  None:
        the connection ends."""
        if self.reader.in_head:
            self._reset()
            self._refuse(HeadTimeout(why))
        return None

    def fill(self) -> None:
        """Read more of the body of the request being served."""
        self.reader.receive_data(self.sock.recv(RECV_SIZE))

    def send_continue(self) -> None:
        """Tell a client that waits (Expect: 100-continue) to send its body."""
        if not self.headers_sent:
            send_all(self.sock, CONTINUE)

    # -- serving --------------------------------------------------------

    def _serve(self, request: Request) -> None:
        head = request.head
        # The environ is built once: its variables (less the hop-by-hop
        # fields) are also what the LB forwards, as "zc_lb.forward".
        server = self.server
        forward = dict(server.base_variables)
        if self.remote is not None:
            forward["REMOTE_ADDR"], forward["REMOTE_PORT"] = self.remote
        hop = request_variables(forward, head)
        forwarding = server.forwarding
        if forwarding is not None:
            forwarding.apply(forward, self.peer, self.trusted)
        # What the worker gets too (str), and the objects only the LB sees.
        environ = self.environ = dict(server.base_objects)
        environ["zc_lb.client_socket"] = self.sock  # to notice a hang-up
        environ["zc_lb.start_ready"] = self.start_ready  # (the LB's fast way)
        environ.update(forward)
        if hop is not None:
            environ.update(hop)
        environ["zc_lb.forward"] = forward
        environ["wsgi.input"] = Input(self, request)
        if self.server.access_log is not None:
            self.requestline = "%s %s %s" % (head.method, head.path, head.version)
        self.close = head.close or self.server.draining
        self._bodiless = head.method == "HEAD"
        result = None
        try:
            result = self.server.application(environ, self.start_response)
            self._write_result(result)
        except ClientGone:
            self.close = True
        except socket.timeout:
            self._stalled()
        except OSError as exc:  # the client's socket failed: nobody to answer
            self.close = True
            if not self.status:
                self.status = "000"
            log.debug("client %s: %s", _peer(self.client_address), exc)
        except ZcLbError as exc:  # (a head the app gave that HTTP forbids: its 500)
            ours = isinstance(exc, (ClientError, BadResponseHead))
            self._failed(exc, exc.http_status if ours else 502)
        except Exception:
            log.exception("error serving %s %s", head.method, head.path)
            self._failed(None, 500)
        finally:
            if result is not None and hasattr(result, "close"):
                try:
                    result.close()
                except Exception:
                    log.exception("error closing the response of %s", head.path)
            self._log()

    def _stalled(self) -> None:
        """The client took nothing (or sent nothing) for the client timeout:
        hang up, and say so, as the response is cut short."""
        self.close = True
        if not self.status:
            self.status = "000"
        environ = self.environ or {}
        log.info("client %s made no progress for %gs (%s %s, %d body bytes sent): closing",
                 _peer(self.client_address), self.server.client_timeout,
                 environ.get("REQUEST_METHOD"), environ.get("PATH_INFO"), self.response_length)

    def _failed(self, exc: Optional[Exception], status: int) -> None:
        """Answer ``status`` if nothing of the response is out yet, and
        close the connection either way (a response cut short must not
        look complete)."""
        self.close = True
        if exc is not None:
            environ = self.environ or {}
            log.warning("closing client connection (%s %s): %s",
                        environ.get("REQUEST_METHOD"), environ.get("PATH_INFO"), exc)
        if not self.headers_sent:
            self._send_refusal(status)
            self.error = type(exc).__name__ if exc else "ApplicationError"
            self.server.count(status, self.error, str(exc or "the application failed"),
                              self.environ)

    def _refuse(self, refusal: ZcLbError) -> None:
        status = refusal.http_status
        log.info("%d for %s: %s", status, _peer(self.client_address), refusal)
        self.close = True
        self._send_refusal(status)
        self.error = type(refusal).__name__  # (the access log's %{error}z)
        self.server.count(status, self.error, str(refusal))
        self._log()
        self._linger()

    def _linger(self) -> None:
        """Close gently: stop sending, then read and drop what the client
        still sends (up to LINGER_BYTES, for LINGER seconds), so closing
        with unread bytes does not reset the connection before the client
        has read our answer."""
        sock = self.sock
        try:
            sock.shutdown(socket.SHUT_WR)
            sock.settimeout(LINGER)
            deadline, dropped = time.monotonic() + LINGER, 0
            while dropped < LINGER_BYTES and time.monotonic() < deadline:
                data = sock.recv(RECV_SIZE)
                if not data:
                    return
                dropped += len(data)
        except OSError:
            pass

    def _send_refusal(self, status: int) -> None:
        response = refusal(status)
        self.status = str(status)
        try:
            send_all(self.sock, response)
            self.response_length = len(response)
        except OSError:
            pass

    # -- writing --------------------------------------------------------

    def start_response(self, status: str, headers: List[Tuple[str, str]], exc_info=None):
        """WSGI's start_response."""
        start_again(exc_info, self.headers_sent, self.status is not None)
        check_response(status, headers)
        self.status, self._headers = status, headers
        return self.write

    def _write_result(self, result) -> None:
        if type(result) is list and len(result) == 1 and not self.headers_sent:
            self._send_head(result[0], len(result[0]))
            return
        for data in result:
            if data:
                self.write(data)
        if not self.headers_sent:
            self._send_head(b"", 0)
        elif self._chunked:
            self._send(b"0\r\n\r\n")

    def write(self, data: bytes) -> None:
        """WSGI's write callable (and the way each body chunk goes out)."""
        if not self.headers_sent:
            self._send_head(data, None)
        elif self._bodiless:
            return
        elif self._chunked:
            self._send(b"%x\r\n%s\r\n" % (len(data), data))
        else:
            self._send(data)

    def start_ready(self, status: str, head: bytes, length: Optional[int]) -> None:
        """The LB's start_response for a worker's head ready for the client
        (``frames.READY_RESPONSE``): its status line and fields, checked
        by the worker, with a Date; ``length``, the Content-Length it
        says.  The front adds its own lines (framing, Connection)."""
        if self.status is not None:
            raise AssertionError("start_response called twice")
        self.status, self._ready, self._ready_length = status, head, length
        return self.write

    def _send_head(self, data: bytes, total: Optional[int]) -> None:
        """The response head, with the first body bytes in the same send.
        ``total``: the body's whole length, when the app gave it all."""
        status = self.status
        if status is None:
            raise AssertionError("the application did not call start_response")
        ready = self._ready
        if ready is None:
            length, dated = self._scan_headers()
        else:
            length, dated = self._ready_length, True
        extra = b"" if dated else date_line()
        bodiless = self._bodiless or status[:3] in BODILESS_STATUS
        if length is None and not bodiless:
            if total is not None:
                extra += b"Content-Length: %d\r\n" % total
            elif self.environ["SERVER_PROTOCOL"] == "HTTP/1.1":  # type: ignore[index]
                self._chunked = True
                extra += b"Transfer-Encoding: chunked\r\n"
            else:
                self.close = True  # the body ends when the connection does
        if self.close:
            extra += b"Connection: close\r\n"
        elif self.environ["SERVER_PROTOCOL"] == "HTTP/1.0":  # type: ignore[index]
            extra += b"Connection: keep-alive\r\n"
        if ready is None:
            head = response_head(status, self._headers, extra)
        else:
            head = b"%s%s\r\n" % (ready, extra)
        self.headers_sent = True
        self._bodiless = bodiless
        if bodiless or not data:
            self._send_raw(head, 0)
        elif self._chunked:
            self._send_raw(head + b"%x\r\n%s\r\n" % (len(data), data), len(data))
        else:
            self._send_raw(head + data, len(data))

    def _scan_headers(self) -> Tuple[object, bool]:
        """What the application's headers say of the framing: their
        Content-Length (None: none), and whether they have a Date; a
        ``Connection: close`` among them closes the connection after."""
        length: object = None
        dated = False
        for name, value in self._headers:
            lowered = name.lower()
            if lowered == "content-length":
                length = value
            elif lowered == "connection":
                if "close" in value.lower():
                    self.close = True
            elif lowered == "date":
                dated = True
        return length, dated

    def _send(self, data: bytes) -> None:
        self._send_raw(data, len(data))

    def _send_raw(self, data: bytes, body_bytes: int) -> None:
        """Send ``data``: straight to the non-blocking socket first (a
        response's one send, without gevent's wrapper), what it does not
        take through gevent's, which waits for the socket."""
        raw_send = self._raw_send
        if raw_send is None:
            send_all(self.sock, data)
        else:
            try:
                sent = raw_send(data)
            except BlockingIOError:
                sent = 0
            if sent < len(data):
                send_all(self.sock, memoryview(data)[sent:])
        self.response_length += body_bytes

    def _log(self) -> None:
        access_log = self.server.access_log
        if access_log is not None:
            self.time_finish = time.time()
            access_log.write(access_log.format.format(self) + "\n")


class Input:
    """wsgi.input: the request body as it arrives (chunked bodies
    decoded), asking the client for it (100 Continue) on the first read
    if it waits to be asked.  ``complete``: all of it has come."""

    def __init__(self, connection: ClientConnection, request: Request) -> None:
        self._connection = connection
        self._request = request
        self._asked = not request.expect_continue

    @property
    def complete(self) -> bool:
        return self._request.complete

    @property
    def buffered(self) -> int:
        """Body bytes that have come and are not read yet."""
        return self._request.body_size

    def _more(self) -> bool:
        """Wait for more body bytes; False at its end."""
        request = self._request
        if request.error is not None:
            raise request.error
        if request.complete:
            return False
        if self._connection.reader.broken:
            raise ClientGone("client connection ended in the body")
        if not self._asked:
            self._asked = True
            if not request.body_size:
                self._connection.send_continue()
        self._connection.fill()
        return True

    def read(self, size: int = -1) -> bytes:
        request = self._request
        size = -1 if size is None else size
        while (size < 0 or request.body_size < size) and self._more():
            pass
        return self._take(request.body_size if size < 0 else min(size, request.body_size))

    def readline(self, size: int = -1) -> bytes:
        request = self._request
        size = -1 if size is None else size
        while True:
            joined = b"".join(request.body)
            request.body.clear()
            if joined:
                request.body.append(joined)
            end = joined.find(b"\n") + 1
            if end and (size < 0 or end <= size):
                return self._take(end)
            if 0 <= size <= len(joined) or not self._more():
                return self._take(len(joined) if size < 0 else min(size, len(joined)))

    def readlines(self, hint: int = -1) -> List[bytes]:
        return list(self)

    def __iter__(self):
        while True:
            line = self.readline()
            if not line:
                return
            yield line

    def _take(self, size: int) -> bytes:
        body = self._request.body
        if not size:
            return b""
        taken, parts = 0, []
        while taken < size:
            part = body.popleft()
            if taken + len(part) > size:
                cut = size - taken
                body.appendleft(part[cut:])
                part = part[:cut]
            parts.append(part)
            taken += len(part)
        self._request.body_size -= taken
        return parts[0] if len(parts) == 1 else b"".join(parts)


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


def default_max_connections() -> int:
    """Half the open-file hard limit (a client connection may hold a
    buffer file too) less what RESERVED_FILES keeps, at most
    MAX_DEFAULT_CONNECTIONS."""
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY:
        return MAX_DEFAULT_CONNECTIONS
    return max(min((hard - RESERVED_FILES) // 2, MAX_DEFAULT_CONNECTIONS), 16)


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


class _Server(gevent.server.StreamServer):
    """The listening socket's server: counts client connections (turning
    away those past ``max_connections`` with 503), does TLS handshakes
    itself, so a failed one is one log line, not a traceback, and runs a
    ``ClientConnection`` on each."""

    access_log: Optional[AccessLog] = None
    client_timeout: Optional[float] = None
    header_timeout: Optional[float] = None
    max_connections: Optional[int] = None
    tls = None
    draining = False
    counter: Optional[Callable[[int, str, str, Optional[dict]], None]] = None
    forwarding: Optional[Forwarding] = None
    proxy_protocol = False
    connections = 0
    turning_away = 0
    _out_of_files_logged = 0.0

    def __init__(self, listener, application: Callable, scheme: str) -> None:
        super().__init__(listener)
        # Connections waiting for a request head, longest waiting first.
        self.waiting: "collections.OrderedDict[ClientConnection, float]" = (
            collections.OrderedDict())
        self.application = application
        self.scheme = scheme
        self._set_base(*self.address[:2])

    def init_socket(self) -> None:
        super().init_socket()
        self._set_base(*self.address[:2])

    def _set_base(self, host: str, port: int) -> None:
        """What every request's environ starts from: variables (str, a
        worker gets them too) and objects (only the app in this process)."""
        self.base_variables = {
            "SCRIPT_NAME": "", "SERVER_NAME": host, "SERVER_PORT": str(port),
            "GATEWAY_INTERFACE": "CGI/1.1", "SERVER_SOFTWARE": "zc-lb",
            "wsgi.url_scheme": self.scheme}
        self.base_objects = {
            "wsgi.version": (1, 0), "wsgi.errors": sys.stderr, "wsgi.multithread": False,
            "wsgi.multiprocess": False, "wsgi.run_once": False}

    def count(self, status: int, cause: str, message: str,
              environ: Optional[dict] = None) -> None:
        """An answer the front gave itself (a refused request, a turned
        away connection, a failed application): counted by ``counter``
        (the LB's ``count_answer``) with the rest of the LB's errors."""
        if self.counter is not None:
            self.counter(status, cause, message, environ)

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
        if (self.max_connections is not None and self.connections >= self.max_connections
                and not self._make_room()):
            self._turn_away(sock, address)
            return
        self.connections += 1
        client = connection = None
        try:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
            if self.proxy_protocol:
                address = self._proxied(sock, address)
                if address is None:
                    return
            client = sock if self.tls is None else self._handshake(sock, address)
            if client is not None:
                connection = ClientConnection(self, client, address)
        finally:
            if connection is None:
                if client is not None:
                    client.close()
                self.ended(sock)
        if connection is not None:
            self.serve(connection, True)

    def do_close(self, sock, *args) -> None:
        """gevent closes a connection when its handler returns; here the
        connection does (``ended``), as a parked one outlives its handler."""

    def serve(self, connection: ClientConnection, first: bool) -> None:
        """Run ``connection`` in this greenlet until it ends (closed and
        counted out here) or parks (it resumes in another)."""
        parked = False
        try:
            parked = connection.run(first)
        finally:
            if not parked:
                self.ended(connection.sock)

    def ended(self, sock) -> None:
        """A client connection is over: close it, count it out."""
        self.connections -= 1
        sock.close()

    def _proxied(self, sock, address):
        """The client's address from the PROXY protocol header the
        connection must begin with (read to its last byte, and no further:
        a TLS handshake may follow), or the connection's own for UNKNOWN
        and LOCAL; None, the connection closed and logged, if the header
        is missing or bad, or the peer is not a trusted proxy."""
        forwarding = self.forwarding
        if forwarding is not None and forwarding.trusted and not forwarding.trusts(address[0]):
            log.info("PROXY protocol from %s, not a trusted proxy: closed", _peer(address))
            return None
        try:
            sock.settimeout(self.header_timeout or self.client_timeout or ACCEPT_HEADER_WAIT)
            data = b""
            length = None
            while length is None:  # v1 a byte at a time, to its CRLF; v2 its fixed part
                v2 = data[:1] == proxyproto.V2_SIGNATURE[:1]
                data += _read_exactly(sock, proxyproto.V2_FIXED - len(data) if v2 else 1)
                length = proxyproto.header_length(data)
            data += _read_exactly(sock, length - len(data))
            client = proxyproto.parse(data)
        except (ClientError, OSError) as exc:
            log.info("PROXY protocol from %s: %s; closed", _peer(address), exc)
            return None
        return address if client is None else client

    def _make_room(self) -> bool:
        """Out of connections: end the one that has waited longest for a
        request head (a slow or idle client), if it has waited EVICT_AFTER
        seconds, so that a client sending its head promptly still gets in;
        whether there was one."""
        waiting = self.waiting
        if not waiting:
            return False
        oldest, since = next(iter(waiting.items()))
        if time.monotonic() - since < EVICT_AFTER:
            return False
        del waiting[oldest]
        oldest.evicted = True
        try:
            oldest.sock.shutdown(socket.SHUT_RD)  # its recv returns: it ends itself
        except OSError:
            pass
        return True

    def _handshake(self, sock, address):
        """The TLS socket, or None (logged, closed) if the handshake failed."""
        try:
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
        self.count(503, "TooManyConnections",
                   "%d client connections already" % self.connections)
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
    ``tls`` is an SSLContext from ``tls_context``, for HTTPS;
    ``counter(status, cause, message, environ)`` counts the answers the
    front gives itself (the LB's ``count_answer``); ``forwarding``
    (forwarding.py) sets X-Forwarded-* and X-Request-ID.
    """

    def __init__(self, listen: Tuple[str, int], app: Callable,
                 access_log: Optional[AccessLog] = None, tls=None,
                 client_timeout: Optional[float] = None,
                 header_timeout: Optional[float] = LB_SETTINGS["header_timeout"].default,
                 max_connections: Optional[int] = None,
                 counter: Optional[Callable[[int, str, str, Optional[dict]], None]] = None,
                 forwarding: Optional[Forwarding] = None,
                 proxy_protocol: bool = False) -> None:
        self.listen = listen
        self.proxy_protocol = proxy_protocol
        self.counter = counter
        self.forwarding = forwarding or None  # (one that sets nothing is none)
        self.client_timeout = client_timeout
        self.header_timeout = header_timeout
        self.max_connections = max_connections
        self.app = app
        self.access_log = access_log
        self.tls = tls
        self.server: Optional[_Server] = None

    @property
    def address(self) -> Tuple[str, int]:
        assert self.server is not None, "not started"
        return self.server.address[:2]

    def start(self) -> None:
        """Bind and start serving."""
        scheme = "https" if self.tls is not None else "http"
        server = self.server = _Server(self.listen, self.app, scheme)
        server.access_log = self.access_log
        server.client_timeout = self.client_timeout
        server.header_timeout = self.header_timeout
        server.tls = self.tls
        server.counter = self.counter
        server.forwarding = self.forwarding
        server.proxy_protocol = self.proxy_protocol
        if self.max_connections is not None:
            server.max_connections = fit_open_files(self.max_connections)
        server.start()
        if self.access_log is not None:
            self.access_log.start()

    def set_tls(self, context) -> None:
        """Serve new connections with another SSLContext (new certificates)."""
        self.tls = context
        if self.server is not None:
            self.server.tls = context

    def drain(self) -> None:
        """Stop accepting; answer what is in flight with Connection: close."""
        if self.server is not None:
            self.server.draining = True
            self.server.close()

    def stop(self, timeout: float = 30.0, close_log: bool = True) -> None:
        """Stop accepting, wait up to ``timeout`` for requests in flight,
        and (unless another listener still writes it) close the access log."""
        if self.server is not None:
            self.server.close()
            self.server.stop(timeout=timeout)
        if self.access_log is not None and close_log:
            self.access_log.close()


def https_redirect(port: Callable[[], int]) -> Callable:
    """The app of a plain HTTP listener with --redirect-https: every request
    is sent to the same URL over HTTPS on ``port()`` (301 for GET and
    HEAD, 308, which keeps the method and body, for the others)."""
    def app(environ: dict, start_response: Callable) -> List[bytes]:
        number = port()
        suffix = "" if number == 443 else ":%d" % number
        host = environ.get("HTTP_HOST") or environ.get("SERVER_NAME") or "localhost"
        if host.startswith("["):  # [v6]:port
            host = host[:host.find("]") + 1]
        else:
            host = host.rsplit(":", 1)[0]
        query = environ.get("QUERY_STRING")
        location = "https://%s%s%s%s" % (host, suffix, environ.get("RAW_URI") or
                                         environ.get("PATH_INFO", "/"),
                                         "" if environ.get("RAW_URI") or not query
                                         else "?" + query)
        status = "301 Moved Permanently" if environ.get("REQUEST_METHOD") in (
            "GET", "HEAD") else "308 Permanent Redirect"
        body = b"Moved to " + location.encode("latin-1") + b"\n"
        start_response(status, [("Location", location), ("Content-Type", "text/plain"),
                                ("Content-Length", str(len(body)))])
        return [body]
    return app


def _read_exactly(sock, size: int) -> bytes:
    """``size`` bytes from ``sock`` (OSError if it ends first)."""
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionResetError("the connection ended")
        data += chunk
    return data


def _peer(address) -> str:
    if isinstance(address, tuple):
        return "%s:%s" % address[:2]
    return str(address or "-")
