"""The HTTP(S) front server that feeds the LB's WSGI app.

A gevent StreamServer whose connection greenlet (``ClientConnection``,
front/client.py) reads requests with front/h1.py (llhttp, through httptools, plus the rules of
front/httpparse.py), builds each request's PEP 3333 environ once from a
per-connection base, calls the WSGI app in the same greenlet and writes
the response: the head and the first body bytes in one send, chunked
framing when the length is unknown, keep-alive and pipelining (requests
are answered in order), Expect: 100-continue answered on the first read
of the body.  Around it, what a front proxy needs: a deadline for the
whole head (slowloris), an idle timeout per read and write, a cap on
client connections answered with 503, TLS from a context checked at
start with failed handshakes logged in one line, TCP_NODELAY on every
client connection, an access log (front/accesslog.py) written through a
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
from typing import Any, Callable, List, Optional, Tuple

import gevent
import gevent.server
import gevent.ssl

from zc_lb.front.accesslog import AccessLog
from zc_lb.front.client import PARK_AFTER, ClientConnection, _peer
from zc_lb.front.forwarder import Forwarder
from zc_lb.front.pages import ErrorPages
from zc_lb.front.transport import linger
from zc_lb.sockets import bound, listener, send_all
from zc_lb.errors import ClientError, ConfigurationError
from zc_lb.front import proxyproto
from zc_lb.front.forwarding import Forwarding
from zc_lb.settings import LB_SETTINGS

log = logging.getLogger(__name__)

RESERVED_FILES = 100  # descriptors kept for worker links, ZooKeeper, logs
MAX_DEFAULT_CONNECTIONS = 50000  # --max-connections by default, at most
TURN_AWAY_LINGER = 0.5  # seconds to read a refused client's request
MAX_TURNING_AWAY = 50  # past this, refused clients are closed unanswered
EVICT_AFTER = 0.5  # seconds a connection waits for a head before it may make room
ACCEPT_HEADER_WAIT = 10.0  # seconds for a PROXY header and handshake when no timeout is set
EVICTED = "evicted to make room (the connections ran out)"
OUT_OF_FILES = frozenset((errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM))
ACCEPT_PAUSE = 0.1  # seconds without accepting when out of descriptors
OUT_OF_FILES_LOG_EVERY = 10.0
DEFAULT_CIPHERS = ":".join((  # Mozilla's "intermediate" list (TLS 1.2)
    "ECDHE-ECDSA-AES128-GCM-SHA256", "ECDHE-RSA-AES128-GCM-SHA256",
    "ECDHE-ECDSA-AES256-GCM-SHA384", "ECDHE-RSA-AES256-GCM-SHA384",
    "ECDHE-ECDSA-CHACHA20-POLY1305", "ECDHE-RSA-CHACHA20-POLY1305",
    "DHE-RSA-AES128-GCM-SHA256", "DHE-RSA-AES256-GCM-SHA384"))
TLS_VERSIONS = ("TLSv1.2", "TLSv1.3")


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
    # (An end of the stream without TLS's close_notify, a client gone or
    # the LB's own shutdown of an evicted connection, is an end, not an
    # error that leaves the session unable to send a last answer.)
    context.options |= (ssl.OP_NO_COMPRESSION | ssl.OP_CIPHER_SERVER_PREFERENCE
                        | ssl.OP_IGNORE_UNEXPECTED_EOF)
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
    """Raise the open-file limit so ``connections`` fit, each with a
    buffer file (lb/spool.py), as far as the hard limit allows; the number
    of connections that fit with a descriptor each (short of their files,
    a response is buffered in memory alone)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 2 * connections + RESERVED_FILES
    if soft != resource.RLIM_INFINITY and soft < wanted:
        soft = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    if soft != resource.RLIM_INFINITY and soft < connections + RESERVED_FILES:
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
    pages = ErrorPages()
    forwarding: Optional[Forwarding] = None
    proxy_protocol = False
    park_after = PARK_AFTER  # seconds an idle keep-alive client keeps its greenlet
    connections = 0
    turning_away = 0
    _out_of_files_logged = 0.0

    def __init__(self, listener, application: Callable, scheme: str) -> None:
        super().__init__(listener)
        # Connections waiting for a request head, longest waiting first.
        self.waiting: "collections.OrderedDict[ClientConnection, float]" = (
            collections.OrderedDict())
        # Sockets in their PROXY protocol header or TLS handshake, oldest
        # first: when each was accepted, and its file descriptor.
        self.opening: "collections.OrderedDict[Any, Tuple[float, int]]" = (
            collections.OrderedDict())
        self.application = application
        # The LB is called as a Forwarder (front/forwarder.py): a Relay in
        # place of the request's variables, and the connection to answer on.
        self.forwarder: Optional[Forwarder] = (
            application if isinstance(application, Forwarder) else None)
        self.scheme = scheme
        self._set_base(self.address)

    def init_socket(self) -> None:
        super().init_socket()
        self._set_base(self.address)

    def _set_base(self, address) -> None:
        """What every request's environ starts from: variables (str, a
        worker gets them too) and objects (only the app in this process).
        (On a Unix socket, SERVER_NAME is localhost and the port the
        scheme's: an application takes the Host header's anyway.)"""
        if isinstance(address, str):
            host, port = "localhost", 443 if self.scheme == "https" else 80
        else:
            host, port = address[:2]
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
        accepted = 0.0  # (a plain socket: its first wait begins at once)
        try:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
            if self.proxy_protocol or self.tls is not None:
                accepted = time.monotonic()  # (its first head is due from the accept)
                opened = self._open(sock, address)
                if opened is None:
                    return
                client, address = opened
            else:
                client = sock
            connection = ClientConnection(self, client, address, accepted)
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

    def _open(self, sock, address):
        """The connection's PROXY protocol header and TLS handshake, as
        it has them, within one deadline from the accept (the header
        timeout, else the client timeout, else ACCEPT_HEADER_WAIT), and
        evictable meanwhile (``_make_room``): (the socket to serve, the
        client's address), or None (logged; the caller closes)."""
        opening = self.opening
        opening[sock] = (time.monotonic(), sock.fileno())
        limit = self.header_timeout or self.client_timeout or ACCEPT_HEADER_WAIT
        timeout = gevent.Timeout(limit, socket.timeout("not done within %gs" % limit))
        timeout.start()
        try:
            if self.proxy_protocol:
                address = self._proxied(sock, address)
                if address is None:
                    return None
            if self.tls is None:
                return sock, address
            client = self._handshake(sock, address)
            return None if client is None else (client, address)
        finally:
            timeout.close()
            opening.pop(sock, None)

    def _proxied(self, sock, address):
        """The client's address from the PROXY protocol header the
        connection must begin with (read to its last byte, and no further:
        a TLS handshake may follow), or the connection's own for UNKNOWN
        and LOCAL; None, logged, if the header is missing or bad, or the
        peer is not a trusted proxy, or the connection was evicted (no
        longer ``opening``)."""
        forwarding = self.forwarding
        if forwarding is not None and forwarding.trusted and not forwarding.trusts(address[0]):
            log.info("PROXY protocol from %s, not a trusted proxy: closed", _peer(address))
            return None
        try:
            data = b""
            length = None
            while length is None:  # v1 a byte at a time, to its CRLF; v2 its fixed part
                v2 = data[:1] == proxyproto.V2_SIGNATURE[:1]
                data += _read_exactly(sock, proxyproto.V2_FIXED - len(data) if v2 else 1)
                length = proxyproto.header_length(data)
            data += _read_exactly(sock, length - len(data))
            client = proxyproto.parse(data)
        except (ClientError, OSError) as exc:
            log.info("PROXY protocol from %s: %s; closed", _peer(address),
                     exc if sock in self.opening else EVICTED)
            return None
        return address if client is None else client

    def _make_room(self) -> bool:
        """Out of connections: end the one that has waited longest for a
        request head (a slow or idle client), or in its PROXY protocol
        header or TLS handshake, if it has waited EVICT_AFTER seconds, so
        that a client sending its head promptly still gets in; whether
        there was one."""
        waiting, opening = self.waiting, self.opening
        if opening:
            sock, (since, fd) = next(iter(opening.items()))
            if (time.monotonic() - since >= EVICT_AFTER
                    and (not waiting or since <= next(iter(waiting.values())))):
                del opening[sock]  # (its read fails: ``_open`` ends it)
                _shut_down(fd)
                return True
        if not waiting:
            return False
        oldest, since = next(iter(waiting.items()))
        if time.monotonic() - since < EVICT_AFTER:
            return False
        del waiting[oldest]
        oldest.evicted = True
        # Its recv returns: it ends itself.  (Under a TLS socket, the socket
        # itself: gevent's SSLSocket.shutdown drops the TLS session first,
        # and the 408 could not be sent.)
        sock = getattr(oldest.sock, "_sock", oldest.sock)
        try:
            sock.shutdown(socket.SHUT_RD)
        except OSError:
            pass
        return True

    def _handshake(self, sock, address):
        """The TLS socket, or None (logged) if the handshake failed or the
        connection was evicted (no longer ``opening``)."""
        tls_sock = None
        try:
            tls_sock = self.tls.wrap_socket(sock, server_side=True,
                                            do_handshake_on_connect=False)
            tls_sock.do_handshake()
            return tls_sock
        except OSError as exc:  # ssl.SSLError and socket.timeout are OSErrors
            reason = getattr(exc, "reason", None) or exc
            log.info("TLS handshake with %s failed: %s%s", _peer(address),
                     reason if sock in self.opening else EVICTED,
                     " (plain HTTP sent to the HTTPS port)" if reason == "HTTP_REQUEST" else "")
            if tls_sock is not None:
                tls_sock.close()  # (it holds the descriptor now, not ``sock``)
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
                send_all(sock, self.pages.refusal(503))
            # Read the request, so closing does not reset the connection
            # before the client reads the 503 (for TURN_AWAY_LINGER in all:
            # a client that sends without end held its place for ever).
            linger(sock, TURN_AWAY_LINGER)
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
    (front/forwarding.py) sets X-Forwarded-* and X-Request-ID;
    ``pages`` (front/pages.py) answers what the front refuses, the LB's
    own, so that one status has one page.
    """

    def __init__(self, listen: Any, app: Callable,
                 access_log: Optional[AccessLog] = None, tls=None,
                 client_timeout: Optional[float] = None,
                 header_timeout: Optional[float] = LB_SETTINGS["header_timeout"].default,
                 max_connections: Optional[int] = None,
                 counter: Optional[Callable[[int, str, str, Optional[dict]], None]] = None,
                 forwarding: Optional[Forwarding] = None,
                 proxy_protocol: bool = False, pages: Optional[ErrorPages] = None) -> None:
        self.listen = listen
        self.pages = pages or ErrorPages()
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
    def connections(self) -> int:
        """Client connections open now (0 before it starts)."""
        return self.server.connections if self.server is not None else 0

    @property
    def address(self) -> Any:
        """(host, port) bound, or a Unix socket's path."""
        assert self.server is not None, "not started"
        return bound(self.server.address)

    def start(self) -> None:
        """Bind and start serving."""
        scheme = "https" if self.tls is not None else "http"
        server = self.server = _Server(listener(self.listen), self.app, scheme)
        server.access_log = self.access_log
        server.client_timeout = self.client_timeout
        server.header_timeout = self.header_timeout
        server.tls = self.tls
        server.counter = self.counter
        server.forwarding = self.forwarding
        server.proxy_protocol = self.proxy_protocol
        server.pages = self.pages
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


def _shut_down(fd: int) -> None:
    """Shut down the socket of descriptor ``fd``, whichever object holds
    it (a TLS socket takes over the accepted one's)."""
    sock = socket.socket(fileno=fd)
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.detach()


def _read_exactly(sock, size: int) -> bytes:
    """``size`` bytes from ``sock`` (OSError if it ends first)."""
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionResetError("the connection ended")
        data += chunk
    return data
