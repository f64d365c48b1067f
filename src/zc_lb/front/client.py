"""One client connection of the front server (front/server.py): its requests
read, the LB (or a WSGI application) called for each, its responses written.

The server (front/server.py) accepts, caps and hands over connections; what
each request costs in the front is here: the head's wait and read
(parking an idle client's greenlet; the socket's reads and writes are
front/transport.py's), the environ built once from a per-connection
base, the call (the LB as a Forwarder, front/forwarder.py, with this
connection as its Responder), and the response written with its head
and first body bytes in one send.  The request's body is front/body.py's.
"""

from __future__ import annotations

import logging
import socket
import time
from typing import Any, Dict, Optional, Tuple, cast

import gevent  # type: ignore[import-untyped]

from zc_lb.errors import BadResponseHead, ClientError, ClientGone, HeadTimeout, ZcLbError
from zc_lb.front.h1 import (BODILESS_STATUS, Request, RequestReader, check_response, date_line,
                            response_head, start_again)
from zc_lb.front.httpparse import RequestHead
from zc_lb.lb.relay import Facts, Relay, connection_variables
from zc_lb.front.body import NO_BODY, Input
from zc_lb.front.transport import RECV_SIZE, Transport
from zc_lb.sockets import send_all
from zc_lb.environ import FORWARD, RELAY

log = logging.getLogger("zc_lb.front.server")  # the front server's log, as before the split


BODY_RECV_SIZE = 256 * 1024  # a request body's reads: a quarter of them, for a large one
PARK_AFTER = 2.0  # seconds a keep-alive client idles before its greenlet is let go
PARKED = object()  # what ``_next_request`` says of a connection it parked
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
HEAD_TIMEOUT = "no complete request head within %gs"
EVICTED = "evicted: the slowest request head when the connections ran out"


class ClientConnection:
    """One client connection: requests read (front/h1.py), the app called
    once per request in this greenlet, responses written.  The access log
    reads a request's record from its attributes (``environ``, ``status``,
    ``requestline``, ``response_length``, ``time_start``, ``time_finish``,
    ``client_address``), as it did pywsgi's handler's."""

    def __init__(self, server: Any, sock: Any, address: Any, accepted: float = 0.0) -> None:
        self.server = server
        self.accepted = accepted or time.monotonic()  # (the first head is due from it)
        self.sock = sock
        self.client_address = address
        self.reader = RequestReader(time.time if server.access_log is not None else None)
        # The client's address, for each request's environ (set there, not
        # kept in dicts of this connection's own: an idle client costs less).
        self.remote = (address[0], str(address[1])) if isinstance(address, tuple) else None
        self.facts: Optional[Facts] = None  # (lb/relay.py's, made at the first request)
        self.peer = address[0] if isinstance(address, tuple) else None
        self.evicted = False  # ended by the server to make room
        self.trusted = server.forwarding is not None and server.forwarding.trusts(self.peer)
        self.transport = Transport(sock, server.client_timeout)
        self._reset()

    def _reset(self) -> None:
        self.environ: Optional[dict] = None
        self.requestline = ""
        self.status: Optional[str] = None
        self.response_length = 0
        self.time_start = self.time_finish = 0.0
        self.headers_sent = False
        self.error: Optional[str] = None  # why the front answered itself, if it did
        self._headers: Any = []  # (the application's, as it gave them)
        self._ready: Optional[bytes] = None  # a head ready for the client (start_ready)
        self._ready_length: Optional[int] = None
        self._chunked = False
        self._bodiless = False
        self.close = False

    def run(self, first: bool = True) -> bool:
        """Serve requests until the client leaves, errs, or keep-alive ends
        (False), or until it idles the server's ``park_after`` seconds between requests
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
                self.transport.linger()  # safely: hang up, once the client has our answer
                return False
            if self.close:
                return False
            # An idle keep-alive client holds nothing of its last request.
            request = None
            self._reset()

    # -- reading --------------------------------------------------------

    def _next_request(self, first: bool) -> Any:
        """The next request; None when the connection should end.  The
        first head must be complete within the header timeout of the
        accept, a later one within the header timeout of its first byte;
        the wait between requests is the client timeout's business."""
        reader = self.reader
        request: object = reader.next_request()  # (or PARKED, below)
        if request is not None or reader.broken:
            return request
        drained = False
        waiting = self.server.waiting
        raw_recv = self.transport.raw_recv
        if (raw_recv is not None and not first and not reader.in_head
                and self not in waiting):  # (not one resumed from parking: see below)
            # Between requests the next is often here already (a busy
            # client): read it without the wait's bookkeeping.
            try:
                data = raw_recv(RECV_SIZE)
            except BlockingIOError:
                drained = True  # (the wait below starts by waiting, not reading)
            except OSError:
                return None
            else:
                reader.receive_data(data)
                request = reader.next_request()
                if request is not None or reader.broken or not data:
                    return request
        if self not in waiting:  # (one resumed from parking is there since it parked)
            waiting[self] = time.monotonic()  # (the oldest may be evicted for a newcomer)
        try:
            request = self._wait_for_request(first, drained)
        except BaseException:
            waiting.pop(self, None)
            raise
        if request is not PARKED:
            waiting.pop(self, None)
        return request

    def _wait_for_request(self, first: bool, drained: bool = False) -> Any:
        """``drained``: the socket was just found empty."""
        reader, server = self.reader, self.server
        header_timeout, client_timeout = server.header_timeout, server.client_timeout
        park_after = server.park_after
        deadline = self.accepted + header_timeout if first and header_timeout else None
        while True:
            if deadline is None and header_timeout and reader.in_head:
                deadline = time.monotonic() + header_timeout
            timeout = client_timeout
            if deadline is not None:
                timeout = deadline - time.monotonic()
                if timeout <= 0:  # (it passed while the last bytes came in)
                    return self._end_waiting(HEAD_TIMEOUT % header_timeout)
                if client_timeout is not None:
                    timeout = min(timeout, client_timeout)
            # Idle between requests: park after ``park_after`` (plain sockets).
            park = (deadline is None and not reader.in_head
                    and self.transport.raw_recv is not None
                    and (timeout is None or timeout > park_after))
            try:
                data = self.transport.recv(park_after if park else timeout, drained)
            except socket.timeout:
                if deadline is not None and time.monotonic() >= deadline:
                    return self._end_waiting(HEAD_TIMEOUT % header_timeout)
                if park:
                    return self._park(None if timeout is None else timeout - park_after)
                return None  # idle between requests: close quietly
            except OSError:
                return None
            if self.evicted:  # (the server made room for a new connection)
                return self._end_waiting(EVICTED)
            drained = False
            reader.receive_data(data)
            request = reader.next_request()
            if request is not None or reader.broken or not data:
                return request

    def _park(self, timeout: Optional[float]) -> object:
        """Let this connection's greenlet go while its client idles
        (front/transport.py), and resume it in a new one (``_unpark``)
        when the client sends again or the server evicts it, or close it
        after ``timeout`` more seconds (``_expire``).  A busy client never
        parks.  PARKED: the caller must let the connection be."""
        self.facts = None  # (made again by the next request: an idle client keeps less)
        self.transport.park(timeout, self._unpark, self._expire)
        return PARKED

    def _unpark(self) -> None:
        """(From the hub) the client sent, or hung up, or was evicted."""
        self.transport.stop_parking()
        gevent.spawn(self.server.serve, self, False)

    def _expire(self) -> None:
        """(From the hub) the client timeout passed while parked: close quietly."""
        self.transport.stop_parking()
        self.server.waiting.pop(self, None)
        self.server.ended(self.sock)

    def _end_waiting(self, why: str) -> Optional[Request]:
        """End a connection waiting for a request (its head took too long,
        or the server evicted it: the longest waiting when the connections
        ran out): 408 (counted) for a head begun, and for one never begun,
        nothing (it asked nothing).  None: the connection ends."""
        if self.reader.in_head:
            self._reset()
            self._refuse(HeadTimeout(why))
        return None

    def fill(self) -> None:
        """Read more of the body of the request being served."""
        self.reader.receive_data(self.sock.recv(BODY_RECV_SIZE))

    def send_continue(self) -> None:
        """Tell a client that waits (Expect: 100-continue) to send its body."""
        if not self.headers_sent:
            send_all(self.sock, CONTINUE)

    # -- serving --------------------------------------------------------

    def _serve(self, request: Request) -> None:
        head = request.head
        assert head is not None  # (a request without a head is a refusal)
        server = self.server
        environ = self.environ = self._request_environ(request, head)
        if server.access_log is not None:
            self.requestline = "%s %s %s" % (head.method, head.path, head.version)
        self.close = head.close or server.draining
        self._bodiless = head.method == "HEAD"
        result = None
        try:
            forwarder = server.forwarder
            if forwarder is not None:
                result = forwarder.forward(environ, self)
            else:
                result = server.application(environ, self.start_response)
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
            self._end_request(result, head)

    def _request_environ(self, request: Request, head: RequestHead) -> Dict[str, Any]:
        """The request's environ: for the LB, the head relayed, not made
        into variables; for another application, all of them."""
        relay = self._relay(head)
        if self.server.forwarder is not None:
            environ = relayed_environ(self.server.base_objects, head, relay)
        else:
            environ = whole_environ(self.server.base_objects, relay)
        environ["wsgi.input"] = (NO_BODY if request.complete and not request.body_size
                                 else Input(self, request))
        return environ

    def _end_request(self, result: Any, head: RequestHead) -> None:
        """Close the application's result, and log the request."""
        if result is not None and hasattr(result, "close"):
            try:
                result.close()
            except Exception:
                log.exception("error closing the response of %s", head.path)
        if self.server.access_log is not None:
            self._log()

    def _relay(self, head: RequestHead) -> Relay:
        """The request as lb/relay.py has it, with this connection's facts."""
        server = self.server
        facts = self.facts
        if facts is None:
            facts = self.facts = Facts(connection_variables(server.base_variables, self.remote))
        return Relay(head, facts, server.base_variables, self.remote, server.forwarding,
                     self.peer, self.trusted)

    def _stalled(self) -> None:
        """The client took nothing (or sent nothing) for the client timeout:
        hang up, and say so, as the response is cut short."""
        self.close = True
        if not self.status:
            self.status = "000"
        environ = completed(self.environ)
        log.info("client %s made no progress for %gs (%s %s, %d body bytes sent): closing",
                 _peer(self.client_address), self.server.client_timeout,
                 environ.get("REQUEST_METHOD"), environ.get("PATH_INFO"), self.response_length)

    def _failed(self, exc: Optional[Exception], status: int) -> None:
        """Answer ``status`` if nothing of the response is out yet, and
        close the connection either way (a response cut short must not
        look complete)."""
        self.close = True
        if exc is not None:
            environ = completed(self.environ)
            log.warning("closing client connection (%s %s): %s",
                        environ.get("REQUEST_METHOD"), environ.get("PATH_INFO"), exc)
        if not self.headers_sent:
            self._send_refusal(status, type(exc).__name__ if exc else "ApplicationError",
                               str(exc or "the application failed"), completed(self.environ))

    def _refuse(self, refusal: ZcLbError) -> None:
        status = refusal.http_status
        log.info("%d for %s: %s", status, _peer(self.client_address), refusal)
        self.close = True
        self._send_refusal(status, type(refusal).__name__, str(refusal))
        if self.server.access_log is not None:
            self._log()
        self.transport.linger()

    def _send_refusal(self, status: int, error: str, message: str,
                      environ: Optional[dict] = None) -> None:
        """Answer ``status`` with the front's page (front/pages.py), and
        count it as the LB counts its errors."""
        response = self.server.pages.refusal(status)
        self.status, self.error = str(status), error  # (the access log's %{error}z)
        try:
            send_all(self.sock, response)
            self.response_length = len(response)
        except OSError:
            pass
        self.server.count(status, error, message, environ)

    # -- writing --------------------------------------------------------

    def start_response(self, status: Any, headers: Any, exc_info: Any = None) -> Any:
        """WSGI's start_response."""
        start_again(exc_info, self.headers_sent, self.status is not None)
        check_response(status, headers)
        self.status, self._headers = status, headers
        return self.write

    def _write_result(self, result: Any) -> None:
        """The application's result: most are one piece, sent with the
        head in one write."""
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

    def write(self, data: Any) -> None:
        """WSGI's write callable (and the way each body chunk goes out);
        an empty one sends nothing (in a chunked body, the last chunk)."""
        if not data:
            return
        if not self.headers_sent:
            self._send_head(data, None)
        elif self._bodiless:
            return
        elif self._chunked:
            self._send(b"%x\r\n%s\r\n" % (len(data), data))
        else:
            self._send(data)

    def start_ready(self, status: str, head: bytes, length: Optional[int]) -> Any:
        """The Forwarder's start_response for a worker's head ready for
        the client (front/forwarder.py, ``frames.READY_RESPONSE``): its
        status line and fields, checked by the worker, with a Date;
        ``length``, the Content-Length it says.  The front adds its own
        lines (framing, Connection)."""
        if self.status is not None:
            raise AssertionError("start_response called twice")
        self.status, self._ready, self._ready_length = status, head, length
        return self.write

    def _send_head(self, data: Any, total: Optional[int]) -> None:
        """The response head, with the first body bytes in the same send.
        ``total``: the body's whole length, when the app gave it all."""
        status = self.status
        if status is None:
            raise AssertionError("the application did not call start_response")
        ready = self._ready
        headers = self._headers
        if ready is None:
            length, dated, connection = scan_headers(headers)
            if connection is not None:  # (the front alone says what the connection does)
                self.close = self.close or "close" in connection.lower()
                headers = [field for field in headers if field[0].lower() != "connection"]
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
        if self.server.draining:  # (a drain begun while the request was in flight)
            self.close = True
        if not getattr(self.environ["wsgi.input"], "complete", True):  # type: ignore[index]
            self.close = True  # (a body left unread: the connection ends after, so say it)
        if self.close:
            extra += b"Connection: close\r\n"
        elif self.environ["SERVER_PROTOCOL"] == "HTTP/1.0":  # type: ignore[index]
            extra += b"Connection: keep-alive\r\n"
        if ready is None:
            head = response_head(status, headers, extra)
        else:
            head = b"%s%s\r\n" % (ready, extra)
        self.headers_sent = True
        self._bodiless = bodiless
        if bodiless or not data:
            self._send(head, 0)
        elif self._chunked:
            self._send(head + b"%x\r\n%s\r\n" % (len(data), data), len(data))
        else:
            self._send(head + data, len(data))

    def _send(self, data: bytes, body_bytes: int = -1) -> None:
        """Send ``data``, of which ``body_bytes`` are the body's (-1: all)."""
        self.transport.send(data)
        self.response_length += len(data) if body_bytes < 0 else body_bytes

    def _log(self) -> None:
        """The request's access log line (the server has an access log)."""
        access_log = self.server.access_log
        completed(self.environ)
        self.time_finish = time.time()
        access_log.write(access_log.format.format(self) + "\n")


def _peer(address) -> str:
    if isinstance(address, tuple):
        return "%s:%s" % address[:2]
    return str(address or "-")


def relayed_environ(objects: Dict[str, Any], head: RequestHead, relay: Relay) -> Dict[str, Any]:
    """The LB's environ: the ``objects`` (wsgi.*), the method and version
    the front and the LB read, and the Relay (``environ.RELAY``), which
    makes the rest when it is asked (``completed``)."""
    environ: Dict[str, Any] = objects.copy()
    environ["REQUEST_METHOD"] = head.method
    environ["SERVER_PROTOCOL"] = head.version
    environ[RELAY] = relay
    return environ


def whole_environ(objects: Dict[str, Any], relay: Relay) -> Dict[str, Any]:
    """PEP 3333's environ, for an application that takes no Relay: the
    Relay's variables, all made now, and the ``objects``; what a worker
    would get of them (less the hop-by-hop fields) is ``environ.FORWARD``."""
    environ: Dict[str, Any] = dict(relay.all_variables())
    environ.update(objects)
    environ[FORWARD] = relay.variables()
    return environ


def completed(environ: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """A request's environ with all its variables (a relayed request's
    are made now): for the access log and log lines."""
    if environ is None:
        return {}
    relay = environ.get(RELAY)
    if relay is not None:
        cast(Relay, relay).complete(environ)
    return environ


def scan_headers(headers: Any) -> Tuple[object, bool, Optional[str]]:
    """What an application's headers say of the framing: their
    Content-Length (None: none), whether they have a Date, and their
    Connection fields' values, joined (None: none; with ``close``, the
    connection closes after)."""
    length: object = None
    dated = False
    connection: Optional[str] = None
    for name, value in headers:
        lowered = name.lower()
        if lowered == "content-length":
            length = value
        elif lowered == "connection":
            connection = value if connection is None else connection + "," + value
        elif lowered == "date":
            dated = True
    return length, dated, connection
