"""How the supervisor of ``zc-lb lb --processes N`` asks its children.

The supervisor is one gevent loop, not monkey-patched: a blocking
urllib call to a child that hangs (stopped, or stuck) would stop it all
for the call's timeout, a child after another, with no signal handled,
no other status request served and no crashed child started again
meanwhile.  So a child is asked over gevent's sockets (``ask``, the
same answer and errors as ``status.document.fetch``'s), every child at
once (``each``), and actions in the order they came (``FifoLock``).
"""

from __future__ import annotations

import collections
import http.client
import socket
import urllib.parse
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple, Union

import gevent  # type: ignore[import-untyped]
import gevent.event  # type: ignore[import-untyped]
import gevent.socket  # type: ignore[import-untyped]

from zc_lb.errors import ConfigurationError, ZcLbError
from zc_lb.status.document import answering, status_answer, status_request


class _Connection(http.client.HTTPConnection):
    """http.client's HTTP/1.1 over a gevent socket: waiting for its answer
    lets the rest of the supervisor run."""

    def connect(self) -> None:
        self.sock = gevent.socket.create_connection((self.host, self.port), self.timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def ask(address: str, timeout: float = 5.0, action: Optional[str] = None,
        params: Optional[Dict[str, str]] = None, token: Optional[bytes] = None) -> dict:
    """What ``fetch`` gets at the status ``address`` (an ``action``'s
    answer, POSTed with the admin ``token``), with its errors, in
    ``timeout`` seconds at most in all: waiting yields to other greenlets."""
    url, data = status_request(address, action, params)
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http":
        raise ConfigurationError("%s: a child's status address is asked over http" % url)
    headers = {"Connection": "close"}
    if token is not None:
        headers["Authorization"] = "Bearer " + token.decode("latin-1")
    with answering(url):
        with gevent.Timeout(timeout, socket.timeout("timed out")):
            connection = _Connection(parts.hostname or "", parts.port, timeout=timeout)
            try:
                connection.request("GET" if data is None else "POST",
                                   (parts.path or "/") + ("?" + parts.query if parts.query
                                                          else ""), body=data, headers=headers)
                response = connection.getresponse()
                code, body, reason = response.status, response.read(), str(response.reason)
            finally:
                connection.close()
    return status_answer(url, action, code, body, reason)


def each(children: Sequence[Any], ask: Callable[[Any], Any]
         ) -> List[Tuple[Any, Union[Any, ZcLbError]]]:
    """``ask(child)`` for every child at once: each child with its answer,
    or the ZcLbError it raised, in their order (another error is raised).
    Those still asked when the caller is killed are killed with it."""
    def answer(child: Any) -> Union[Any, ZcLbError]:
        try:
            return ask(child)
        except ZcLbError as exc:  # (an answer here: not a greenlet's failure to log)
            return exc

    asked = [(child, gevent.spawn(answer, child)) for child in children]
    try:
        gevent.joinall([greenlet for _, greenlet in asked])
    finally:
        gevent.killall([greenlet for _, greenlet in asked if not greenlet.dead], block=False)
    return [(child, greenlet.get(block=False)) for child, greenlet in asked]


class FifoLock:
    """A gevent lock taken in the order it was asked for (first come,
    first served): two actions on their way (a drain, then the enable of
    the same worker) reach each child in the order they came.  Not
    reentrant."""

    def __init__(self) -> None:
        self._turns: Deque[gevent.event.Event] = collections.deque()  # the holder's first

    @property
    def locked(self) -> bool:
        return bool(self._turns)

    def __enter__(self) -> "FifoLock":
        turn = gevent.event.Event()
        self._turns.append(turn)
        if len(self._turns) == 1:
            return self
        try:
            turn.wait()
        except BaseException:  # (killed, or timed out, waiting)
            if self._turns[0] is turn:
                self._pass_on()  # (it was our turn: the next one's now)
            else:
                self._turns.remove(turn)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self._pass_on()

    def _pass_on(self) -> None:
        self._turns.popleft()
        if self._turns:
            self._turns[0].set()
