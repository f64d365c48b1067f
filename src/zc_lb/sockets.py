"""Socket helpers every part uses: addresses (``HOST:PORT``, or
``unix:PATH`` for a Unix socket), TCP_NODELAY, sending all of some
bytes, or of a batch of buffers in one system call, without gevent's
per-call costs, and waiting with a timeout on the loop."""

from __future__ import annotations

import errno
import os
import socket
import stat
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

# A listening address: (host, port), or a Unix socket's path.
Listen = Union[Tuple[str, int], str]

UNIX = "unix:"  # the prefix of a Unix socket's address, as gunicorn's
UNIX_BACKLOG = 1024

from zc_lb.errors import ConfigurationError


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


def parse_listen(text: str) -> Listen:
    """``HOST:PORT`` -> (host, port), as ``parse_address``; ``unix:PATH``
    -> PATH."""
    if text.startswith(UNIX):
        path = text[len(UNIX):]
        if not path:
            raise ConfigurationError("expected unix:PATH, got %r" % text)
        return path
    return parse_address(text)


def address_text(address: Any) -> str:
    """A bound or given address as the command line writes it:
    ``HOST:PORT`` (``[v6]:PORT``) or ``unix:PATH``."""
    if isinstance(address, str):
        return UNIX + address
    host, port = address[:2]
    return "%s:%d" % ("[%s]" % host if ":" in host else host, port)


def bound(name: Any) -> Listen:
    """A listening socket's ``getsockname()`` as a Listen: a Unix socket's
    path as it is, an IP socket's (host, port) without IPv6's flow and
    scope."""
    return name if isinstance(name, str) else name[:2]


def unix_listener(path: str) -> Any:
    """A gevent socket listening at the Unix socket ``path``.  A socket
    file nothing accepts on (left by a process that ended) is replaced;
    one in use, or a file of another kind, is refused (OSError)."""
    import gevent.socket  # type: ignore[import-untyped]

    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None:
        if not stat.S_ISSOCK(mode):
            raise OSError(errno.EEXIST, "%s exists and is not a socket" % path)
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            os.unlink(path)  # stale: nobody listens there
        else:
            raise OSError(errno.EADDRINUSE, "Address already in use")
        finally:
            probe.close()
    sock = gevent.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        sock.listen(UNIX_BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def listening_socket(listen: Listen, backlog: int) -> Any:
    """A socket bound and listening at ``listen``, inheritable, for a
    supervisor to hold and hand to its children: a TCP one with
    SO_REUSEADDR, or a Unix one (``unix_listener``)."""
    if isinstance(listen, str):
        sock = unix_listener(listen)
    else:
        sock = socket.socket(socket.AF_INET6 if ":" in listen[0] else socket.AF_INET)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(listen)
            sock.listen(backlog)
        except OSError:
            sock.close()
            raise
    sock.set_inheritable(True)
    return sock


def inherited_socket(fd: int) -> Any:
    """The listening socket a supervisor passed down as ``fd`` (a gevent
    one; ``--listen-fd``)."""
    import gevent.socket  # type: ignore[import-untyped]

    try:
        sock = gevent.socket.socket(fileno=fd)
    except OSError as exc:
        raise ConfigurationError("--listen-fd %d: %s" % (fd, exc))
    if sock.type != socket.SOCK_STREAM:
        raise ConfigurationError("--listen-fd %d is not a stream socket" % fd)
    os.set_inheritable(fd, False)
    return sock


def listener(listen: Any) -> Any:
    """What a gevent server takes for ``listen``: (host, port) or a
    socket as they are, a Unix socket's path bound (``unix_listener``)."""
    return unix_listener(listen) if isinstance(listen, str) else listen


def connect(where: Listen, timeout: float) -> Any:
    """A gevent socket connected to ``where`` (``parse_listen``'s)."""
    import gevent.socket  # type: ignore[import-untyped]

    if isinstance(where, tuple):
        return gevent.socket.create_connection(where, timeout=timeout)
    sock = gevent.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(where)
    except OSError:
        sock.close()
        raise
    return sock


def worker_addresses(texts: Iterable[str], what: str = "--worker") -> List[str]:
    """A list of worker addresses, each checked (HOST:PORT, a port from 1
    to 65535, or unix:PATH; no spaces around, none in HOST:PORT), duplicates
    dropped; ConfigurationError naming every bad one, so that a list is
    taken whole or not at all."""
    bad: List[str] = []
    seen: Dict[str, None] = {}
    for text in texts:
        try:
            if not isinstance(text, str):
                raise ConfigurationError("expected HOST:PORT, got %r" % (text,))
            unspaced = text if text.startswith(UNIX) else "".join(text.split())
            if text != text.strip() or text != unspaced:
                # (int() skips spaces around the port, and a host with one never resolves)
                raise ConfigurationError("a space in %r" % text)
            where = parse_listen(text)
            if isinstance(where, tuple) and where[1] == 0:
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
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # (a socket of [::] takes IPv4 clients so)
    return address.is_loopback


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
