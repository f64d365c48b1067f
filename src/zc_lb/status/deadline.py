"""One deadline for a whole HTTP exchange over urllib.

urllib's ``timeout`` bounds each wait on the socket, not the call: a
server that sends a byte a second answers ``zc-lb status --timeout 5``
in as many seconds as its answer has bytes.  ``urlopen`` here gives
every wait (connecting, sending, each read of the answer, headers and
body) only what is left of ``timeout`` from its start, and once none is
left raises ``socket.timeout``, as a wait that ran out does.  (The
supervisor of ``--processes`` asks over gevent, under one
``gevent.Timeout``: process/asking.py.)
"""

from __future__ import annotations

import functools
import http.client
import io
import socket
import time
import urllib.request
from typing import Any


class _Reader(io.RawIOBase):
    """A socket's reader (``socket.makefile``'s) whose every read waits
    at most what is left until ``deadline`` (time.monotonic)."""

    def __init__(self, sock: Any, deadline: float) -> None:
        super().__init__()
        self.sock, self.deadline = sock, deadline
        self.raw = sock.makefile("rb", buffering=0)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> Any:
        self.sock.settimeout(left(self.deadline))
        return self.raw.readinto(buffer)

    def close(self) -> None:
        self.raw.close()  # (the socket's, once the connection has closed it too)
        super().close()


class _Socket:
    """A connected socket whose sends and readers keep to ``deadline``;
    the rest is the socket's."""

    def __init__(self, sock: Any, deadline: float) -> None:
        self.sock, self.deadline = sock, deadline

    def sendall(self, data: Any) -> None:
        self.sock.settimeout(left(self.deadline))
        self.sock.sendall(data)

    def makefile(self, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        return io.BufferedReader(_Reader(self.sock, self.deadline))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


def left(deadline: float) -> float:
    """The seconds left until ``deadline``; none left is a socket.timeout."""
    seconds = deadline - time.monotonic()
    if seconds <= 0:
        raise socket.timeout("timed out")
    return seconds


class _Deadline:
    """An http.client connection whose socket waits within ``deadline``."""

    def __init__(self, *args: Any, deadline: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        self.deadline = deadline

    def connect(self) -> None:
        self.timeout = left(self.deadline)
        super().connect()  # type: ignore[misc]
        self.sock = _Socket(self.sock, self.deadline)  # type: ignore[has-type]


# (mypy cannot type a mixin's overrides against both bases: it is checked above)
class _HTTPConnection(_Deadline, http.client.HTTPConnection):  # type: ignore[misc]
    pass


class _HTTPSConnection(_Deadline, http.client.HTTPSConnection):  # type: ignore[misc]
    pass


class _HTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, deadline: float) -> None:
        super().__init__()
        self.deadline = deadline

    def http_open(self, req: Any) -> Any:
        return self.do_open(functools.partial(_HTTPConnection, deadline=self.deadline), req)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, deadline: float) -> None:
        super().__init__()
        self.deadline = deadline

    def https_open(self, req: Any) -> Any:
        return self.do_open(functools.partial(_HTTPSConnection, deadline=self.deadline),
                            req, context=self._context)  # type: ignore[attr-defined]


def urlopen(request: Any, timeout: float) -> Any:
    """``urllib.request.urlopen(request)``, its answer read in ``timeout``
    seconds at most in all (``read`` it before they run out)."""
    deadline = time.monotonic() + timeout
    opener = urllib.request.build_opener(_HTTPHandler(deadline), _HTTPSHandler(deadline))
    return opener.open(request, timeout=timeout)
