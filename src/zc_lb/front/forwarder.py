"""The front server's interface to the LB: a ``Forwarder``.

The front server runs any WSGI application (PEP 3333): it builds the
request's environ and calls ``application(environ, start_response)``.
An application that is a ``Forwarder`` (the LB, lb/balancer.py) is
called instead as ``forward(environ, responder)``: its environ holds the
request's ``Relay`` (lb/relay.py, ``environ.RELAY``), the head as the
front checked it, in place of the CGI variables, made only when asked;
and the ``Responder`` it answers through is the client connection
itself (front/client.py):

- ``start_response``: WSGI's, for a head the forwarder made (its error
  pages, a worker's head in fields);
- ``start_ready``: a worker's head ready for the client (checked by the
  worker, dated, its hop-by-hop fields gone); the front adds its own
  lines (framing, ``Connection``);
- ``sock``: the client's socket, to notice a client that hangs up while
  its response is awaited (None when there is none to watch).

Both return WSGI's ``write``; the body is the iterable ``forward``
returns, as an application's is.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Protocol, runtime_checkable


class Responder(Protocol):
    """How a forwarded request's response reaches its client."""

    sock: Any

    def start_response(self, status: str, headers: Any, exc_info: Any = None) -> Callable:
        ...

    def start_ready(self, status: str, head: bytes, length: Optional[int]) -> Callable:
        ...


@runtime_checkable
class Forwarder(Protocol):
    """An application that takes a relayed request and a ``Responder``."""

    def forward(self, environ: dict, responder: Responder) -> Iterable[bytes]:
        ...
