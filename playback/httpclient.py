"""A minimal keep-alive HTTP/1.1 client on gevent sockets, for replaying.

Why not a library: the replay must send the request target exactly as the
log had it (after percent-encoding), choose the Host per request, set
TCP_NODELAY on every socket (else delayed ACKs stall requests by 40 ms),
and count connection errors instead of retrying them away. One
``Connection`` is one client: one socket at a time, one request at a time.

Responses are read whole and their body discarded (only its length is
kept): Content-Length, chunked, or until close; none for HEAD, 1xx, 204
and 304. A request on a reused connection that the server closed while
idle is sent once more on a new connection (every replayed method is
idempotent or has no body); any other failure raises ``HTTPError``.
"""

from __future__ import annotations

import dataclasses
import socket as _stdsocket
import urllib.parse
from typing import Any, Dict, Optional, Tuple

import gevent
import gevent.socket
import gevent.ssl

MAX_HEAD = 65536
RECV_SIZE = 65536


class HTTPError(Exception):
    """A request failed without a usable response; ``kind`` names the cause."""

    def __init__(self, kind: str, detail: str = ""):
        super().__init__("%s: %s" % (kind, detail) if detail else kind)
        self.kind = kind


class _StaleConnection(Exception):
    """The server closed a kept-alive connection before answering."""


@dataclasses.dataclass(slots=True)
class Response:
    status: int
    headers: Dict[str, str]  # lower-cased names; repeated headers joined by ', '
    length: int  # body bytes received


def parse_url(url: str) -> Tuple[str, str, int, str]:
    """``http://host:port/prefix`` -> (scheme, host, port, path prefix without '/')."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("expected an http:// or https:// URL, got %r" % url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return parts.scheme, parts.hostname, port, parts.path.rstrip("/")


class Connection:
    """A client connection to one server, reconnecting as needed."""

    def __init__(self, host: str, port: int, timeout: float = 30.0,
                 ssl_context: Optional[gevent.ssl.SSLContext] = None):
        self.host = host
        self.port = port
        self.timeout = timeout
        self.ssl_context = ssl_context
        self.sock: Any = None  # a gevent socket (or SSL socket) while connected
        self.buffer = b""
        self.connects = 0
        self.keep_body = False  # keep the last body in ``body`` (small responses)
        self.body = b""

    def __repr__(self) -> str:
        return "<Connection %s:%d %s>" % (self.host, self.port, "open" if self.sock else "closed")

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        self.buffer = b""

    def request(self, method: str, target: str, host: str,
                headers: Optional[Dict[str, str]] = None) -> Response:
        """Send one request and read its whole response (within ``timeout``)."""
        lines = ["%s %s HTTP/1.1" % (method, target), "Host: " + host]
        if method not in ("GET", "HEAD"):
            lines.append("Content-Length: 0")
        for name, value in (headers or {}).items():
            lines.append("%s: %s" % (name, value))
        data = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        timeout = HTTPError("timeout", "no response in %gs" % self.timeout)
        attempts = 2 if self.sock is not None else 1
        with gevent.Timeout(self.timeout, timeout):
            try:
                while True:
                    try:
                        return self._exchange(method, data)
                    except (_StaleConnection, ConnectionResetError, BrokenPipeError) as exc:
                        # A kept-alive connection the server closed while idle.
                        self.close()
                        attempts -= 1
                        if attempts:
                            continue
                        if isinstance(exc, OSError):
                            raise
                        raise HTTPError("closed", "connection closed before a response")
            except OSError as exc:
                self.close()
                raise HTTPError(_os_error_kind(exc), str(exc))
            except BaseException:
                self.close()
                raise

    def _connect(self) -> None:
        try:
            sock = gevent.socket.create_connection((self.host, self.port))
        except OSError as exc:
            raise HTTPError("connect", str(exc))
        sock.setsockopt(_stdsocket.IPPROTO_TCP, _stdsocket.TCP_NODELAY, 1)
        if self.ssl_context is not None:
            sock = self.ssl_context.wrap_socket(sock, server_hostname=self.host)
        self.sock = sock
        self.buffer = b""
        self.connects += 1

    def _exchange(self, method: str, data: bytes) -> Response:
        if self.sock is None:
            self._connect()
        self.sock.sendall(data)
        status, headers, version = self._read_head()
        length = self._read_body(method, status, headers)
        connection = headers.get("connection", "").lower()
        if "close" in connection or (version == "HTTP/1.0" and "keep-alive" not in connection):
            self.close()
        return Response(status, headers, length)

    def _fill(self) -> bool:
        chunk = self.sock.recv(RECV_SIZE)
        if not chunk:
            return False
        self.buffer += chunk
        return True

    def _read_head(self) -> Tuple[int, Dict[str, str], str]:
        started = False
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end >= 0:
                head, self.buffer = self.buffer[:end], self.buffer[end + 4:]
                status, headers, version = _parse_head(head)
                if 100 <= status < 200 and status != 101:
                    started = True
                    continue  # interim response: read the final one
                return status, headers, version
            if len(self.buffer) > MAX_HEAD:
                raise HTTPError("protocol", "response head too large")
            if not self._fill():
                if started or self.buffer:
                    raise HTTPError("protocol", "connection closed in response head")
                raise _StaleConnection()

    def _read_body(self, method: str, status: int, headers: Dict[str, str]) -> int:
        self.body = b""
        if method == "HEAD" or status in (204, 304):
            return 0
        if "chunked" in headers.get("transfer-encoding", "").lower():
            return self._read_chunked()
        if "content-length" in headers:
            try:
                wanted = int(headers["content-length"])
            except ValueError:
                raise HTTPError("protocol", "bad Content-Length")
            while len(self.buffer) < wanted:
                if not self._fill():
                    raise HTTPError("protocol", "connection closed in body")
            if self.keep_body:
                self.body = self.buffer[:wanted]
            self.buffer = self.buffer[wanted:]
            return wanted
        while self._fill():  # body delimited by close
            pass
        length = len(self.buffer)
        if self.keep_body:
            self.body = self.buffer
        self.close()
        return length

    def _read_chunked(self) -> int:
        total = 0
        while True:
            size_line = self._read_line()
            try:
                size = int(size_line.split(b";")[0].strip(), 16)
            except ValueError:
                raise HTTPError("protocol", "bad chunk size")
            if size == 0:
                while self._read_line():  # trailers
                    pass
                return total
            while len(self.buffer) < size + 2:
                if not self._fill():
                    raise HTTPError("protocol", "connection closed in chunk")
            if self.keep_body:
                self.body += self.buffer[:size]
            self.buffer = self.buffer[size + 2:]
            total += size

    def _read_line(self) -> bytes:
        while True:
            end = self.buffer.find(b"\r\n")
            if end >= 0:
                line, self.buffer = self.buffer[:end], self.buffer[end + 2:]
                return line
            if len(self.buffer) > MAX_HEAD or not self._fill():
                raise HTTPError("protocol", "bad chunked body")


def _parse_head(head: bytes) -> Tuple[int, Dict[str, str], str]:
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise HTTPError("protocol", "bad status line %r" % lines[0][:80])
    headers: Dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            raise HTTPError("protocol", "bad header line %r" % line[:80])
        name = name.strip().lower()
        value = value.strip()
        headers[name] = headers[name] + ", " + value if name in headers else value
    return int(parts[1]), headers, parts[0]


def _os_error_kind(exc: OSError) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "connect"
    if isinstance(exc, (ConnectionResetError, BrokenPipeError)):
        return "reset"
    if isinstance(exc, _stdsocket.timeout):
        return "timeout"
    return "socket"


def get_json(url: str, timeout: float = 10.0):
    """GET a URL and decode its JSON body (for stats URLs)."""
    import json

    scheme, host, port, prefix = parse_url(url)
    parts = urllib.parse.urlsplit(url)
    target = (parts.path or "/") + ("?" + parts.query if parts.query else "")
    context = gevent.ssl.create_default_context() if scheme == "https" else None
    conn = Connection(host, port, timeout, context)
    conn.keep_body = True
    try:
        response = conn.request("GET", target, parts.netloc)
    finally:
        conn.close()
    if response.status != 200:
        raise HTTPError("status", "%s answered %d" % (url, response.status))
    return json.loads(conn.body)
