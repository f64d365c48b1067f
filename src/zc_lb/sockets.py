"""Socket helpers every part uses: addresses (``HOST:PORT``), TCP_NODELAY,
sending all of some bytes, or of a batch of buffers in one system call,
without gevent's per-call costs, and waiting with a timeout on the loop."""

from __future__ import annotations

import os
import socket
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from .errors import ConfigurationError


def parse_address(text: str, default_host: str = "127.0.0.1") -> Tuple[str, int]:
    """``HOST:PORT`` (or ``:PORT``, or ``[v6]:PORT``) -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep:
        raise ConfigurationError("expected HOST:PORT, got %r" % text)
    host = host.strip("[]") or default_host
    try:
        number = int(port)
    except ValueError:
        raise ConfigurationError("bad port in %r" % text)
    if not 0 <= number <= 65535:
        raise ConfigurationError("port out of range in %r" % text)
    return host, number


def worker_addresses(texts: Iterable[str], what: str = "--worker") -> List[str]:
    """A list of worker addresses, each checked (HOST:PORT, a port from 1
    to 65535), duplicates dropped; ConfigurationError naming every bad
    one, so that a list is taken whole or not at all."""
    bad: List[str] = []
    seen: Dict[str, None] = {}
    for text in texts:
        try:
            if not isinstance(text, str):
                raise ConfigurationError("expected HOST:PORT, got %r" % (text,))
            host, port = parse_address(text)
            if port == 0:
                raise ConfigurationError("port 0 in %r: a worker listens on a port of "
                                         "its own" % text)
        except ConfigurationError as exc:
            bad.append(str(exc))
            continue
        seen[text] = None
    if bad:
        raise ConfigurationError("%s: %s" % (what, "; ".join(bad)))
    return list(seen)


def send_all(sock, data) -> None:
    """``sendall`` without gevent's per-call ``getsockopt(SO_SNDBUF)``,
    which profiling showed to be a sixth of the LB's time."""
    sent = sock.send(data)
    if sent < len(data):
        view = memoryview(data)[sent:]
        while view:
            view = view[sock.send(view):]


MAX_PIECES = 512  # buffers per sendmsg, well under IOV_MAX


def unsent(pieces: List, sent: int) -> List:
    """What of ``pieces`` is left after ``sent`` bytes of them went out."""
    for i, piece in enumerate(pieces):
        size = len(piece)
        if sent < size:
            rest = pieces[i:]
            if sent:
                rest[0] = memoryview(piece)[sent:]
            return rest
        sent -= size
    return []


def send_pieces(send: Callable, sendmsg: Optional[Callable], pieces: List) -> List:
    """Send ``pieces`` (bytes and memoryviews) with one system call, a
    body chunk not copied into a joined buffer; what the socket did not
    take.  ``send`` and ``sendmsg`` are the socket's (non-blocking or
    gevent's)."""
    if len(pieces) == 1:
        data = pieces[0]
        sent = send(data)
        return [] if sent == len(data) else [memoryview(data)[sent:]]
    if len(pieces) > MAX_PIECES or sendmsg is None:
        return send_pieces(send, sendmsg, [b"".join(pieces)])
    return unsent(pieces, sendmsg(pieces))


def send_file(sock: Any, fd: int, offset: int, count: int) -> int:
    """``count`` bytes of the open file ``fd`` from ``offset`` to the
    gevent socket ``sock`` with sendfile(2), waiting whenever the socket
    is full: the bytes sent, fewer only if the file ended."""
    from gevent.socket import wait_write  # type: ignore[import-untyped]

    fileno, sent = sock.fileno(), 0
    while sent < count:
        try:
            n = os.sendfile(fileno, fd, offset + sent, count - sent)
        except (BlockingIOError, InterruptedError):
            wait_write(fileno)
            continue
        if not n:
            break
        sent += n
    return sent


def is_loopback(host: Optional[str]) -> bool:
    """Whether ``host`` (an address, or ``localhost``) is this machine's
    loopback; False for other names, which may reach anything."""
    import ipaddress

    host = (host or "").split("%", 1)[0]  # (an IPv6 address's zone)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def set_nodelay(sock: socket.socket) -> None:
    """TCP_NODELAY: small frames must not wait 40 ms for a delayed ACK."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        pass  # not TCP (a unix socket in a test)


_TIMED_OUT = object()  # what a wait's timer hands its waiter (``wait``)


def wait(waiter: Any, timeout: Optional[float], error: type, *args: Any) -> None:
    """``waiter.get()``, or ``error(*args)`` raised after ``timeout``
    seconds, counted from now (not from the loop's time at the start of
    its turn, which would end the wait early): a timer on the loop, not
    a gevent Timeout object.  (``waiter``: a gevent Waiter.)"""
    timer = None
    if timeout is not None:
        timer = waiter.hub.loop.timer(timeout)
        timer.start(waiter.switch, _TIMED_OUT, update=True)
    try:
        if waiter.get() is _TIMED_OUT:
            raise error(*args)
    finally:
        if timer is not None:
            timer.close()
