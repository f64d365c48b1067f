"""The floor: the least a proxy of zc-lb's design costs in Python and gevent.

``make bench`` runs this proxy beside zc-lb so that every run says how
far the LB's CPU per request is from what its architecture costs before
any of its own work.  ``floor-proxy`` is an HTTP/1.1 front on gevent
sockets with httptools (the LB's parser), one greenlet per client
connection, and one multiplexed connection to each ``floor-worker``,
whose reader greenlet wakes the waiting client greenlet, as the LB's
does.  Each request goes to the worker with the fewest in flight.

What it leaves out is everything the LB is for: the request checks and
limits, the environ and the classifier, the pool, the protocol's
handshake, credit and keepalives, timeouts, retries, the response
checks, logs and metrics.  It forwards the method and target, answers a
request that has a body with 501, and is for the bench alone.

Its frames: a request number and a length (two u32), then the payload:
the request's method and target from the proxy, the response body from
the worker (every response is ``200 OK``).
"""

from __future__ import annotations

import signal
import socket
import struct
from typing import Dict, List

import gevent
import gevent.server
import gevent.socket
import httptools
from gevent.hub import Waiter, get_hub

FRAME = struct.Struct("!II")  # request number, payload length
READY = "zc-lb floor listening on "
RECV_SIZE = 65536
NOT_IMPLEMENTED = (b"HTTP/1.1 501 Not Implemented\r\nContent-Length: 0\r\n"
                   b"Connection: close\r\n\r\n")


def frames(buffer: bytearray):
    """Take the complete frames off the front of ``buffer``: (rno, payload)."""
    pos, size = 0, len(buffer)
    while size - pos >= FRAME.size:
        rno, length = FRAME.unpack_from(buffer, pos)
        end = pos + FRAME.size + length
        if end > size:
            break
        yield rno, bytes(buffer[pos + FRAME.size:end])
        pos = end
    del buffer[:pos]


def _nodelay(sock) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class Upstream:
    """One multiplexed connection to a floor worker."""

    def __init__(self, address: str) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = gevent.socket.create_connection((host, int(port)))
        _nodelay(self.sock)
        self.waiting: Dict[int, Waiter] = {}
        self.rno = 0
        self.outgoing: List[bytes] = []
        self.hub = get_hub()
        gevent.spawn(self._read)

    def call(self, payload: bytes) -> bytes:
        """Send ``payload`` as a request; the response body."""
        self.rno += 1
        waiter = self.waiting[self.rno] = Waiter(self.hub)
        if not self.outgoing:  # the first this turn: flush after the others
            self.hub.loop.run_callback(self._flush)
        self.outgoing.append(FRAME.pack(self.rno, len(payload)) + payload)
        return waiter.get()

    def _flush(self) -> None:
        data = b"".join(self.outgoing)
        self.outgoing.clear()
        self.sock.sendall(data)

    def _read(self) -> None:
        buffer = bytearray()
        run_callback, waiting = self.hub.loop.run_callback, self.waiting
        while True:
            data = self.sock.recv(RECV_SIZE)
            if not data:
                for waiter in waiting.values():
                    run_callback(waiter.throw, ConnectionError("floor worker closed"))
                waiting.clear()
                return
            buffer += data
            for rno, payload in frames(buffer):
                run_callback(waiting.pop(rno).switch, payload)


class _Requests:
    """httptools' callbacks: the requests a client sent, in order."""

    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.ready: List[bytes] = []
        self.url = b""
        self.body = False

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_headers_complete(self) -> None:
        self.url = self.parser.get_method() + b" " + self.url

    def on_body(self, body: bytes) -> None:
        self.body = True

    def on_message_complete(self) -> None:
        self.ready.append(self.url)
        self.url = b""


def serve_proxy(address: str, workers: List[str]) -> None:
    """The floor proxy on HOST:PORT in front of ``workers``, until SIGTERM."""
    upstreams = [Upstream(worker) for worker in workers]
    in_flight = {upstream: 0 for upstream in upstreams}

    def handle(sock, client_address) -> None:
        _nodelay(sock)
        requests = _Requests()
        try:
            while True:
                data = sock.recv(RECV_SIZE)
                if not data:
                    return
                requests.parser.feed_data(data)
                if requests.body:
                    sock.sendall(NOT_IMPLEMENTED)
                    return
                for head in requests.ready:
                    upstream = min(upstreams, key=in_flight.__getitem__)
                    in_flight[upstream] += 1
                    try:
                        body = upstream.call(head)
                    finally:
                        in_flight[upstream] -= 1
                    sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n"
                                 b"Content-Type: text/plain\r\n\r\n%s" % (len(body), body))
                requests.ready.clear()
        except (OSError, httptools.HttpParserError):
            return

    _serve(address, handle)


def serve_worker(address: str, body: bytes) -> None:
    """A floor worker on HOST:PORT answering every request with ``body``."""

    def handle(sock, client_address) -> None:
        _nodelay(sock)
        buffer = bytearray()
        while True:
            data = sock.recv(RECV_SIZE)
            if not data:
                return
            buffer += data
            sock.sendall(b"".join(FRAME.pack(rno, len(body)) + body
                                  for rno, _ in frames(buffer)))

    _serve(address, handle)


HOP_RECV = 256 * 1024  # the hop's reads, as large as the LB's body reads


def serve_hop(address: str, target: str) -> None:
    """A bare TCP hop on HOST:PORT to ``target``: bytes copied both ways
    by two greenlets a connection, read into one buffer each and sent
    on whole; nothing parsed.  Large bodies through it are what one more
    process in the way costs on this machine, before any proxy's work."""
    host, port = target.rsplit(":", 1)

    def pump(source, sink) -> None:
        buffer = bytearray(HOP_RECV)
        view = memoryview(buffer)
        try:
            while True:
                n = source.recv_into(buffer)
                if not n:
                    break
                sink.sendall(view[:n])
        except OSError:
            pass
        for sock in (source, sink):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def handle(sock, client_address) -> None:
        _nodelay(sock)
        upstream = gevent.socket.create_connection((host, int(port)))
        _nodelay(upstream)
        back = gevent.spawn(pump, upstream, sock)
        pump(sock, upstream)
        back.join()
        upstream.close()

    _serve(address, handle)


def _serve(address: str, handle) -> None:
    host, port = address.rsplit(":", 1)
    server = gevent.server.StreamServer((host, int(port)), handle)
    server.start()
    print(READY + "%s:%d" % server.address[:2], flush=True)
    gevent.signal_handler(signal.SIGTERM, server.stop, 1)
    server.serve_forever()
