"""The exception hierarchy.

Names say who is at fault: a *local* protocol error means our own code
misused the API (a bug here); a *remote* protocol error means the peer
sent something the protocol forbids.  A worker *lost* broke from outside;
a worker *closed* was closed by us.  Each error carries the HTTP status it
should become, so ``lb.py`` turns errors into responses in one place.
"""


class ZcLbError(Exception):
    """Base of every error zc-lb raises on purpose."""

    http_status = 500


class ConfigurationError(ZcLbError):
    """A setting, classifier spec, address or file given to us is invalid."""

    http_status = 500


class ProtocolError(ZcLbError):
    """Base of the LB<->worker protocol errors."""

    http_status = 502


class LocalProtocolError(ProtocolError):
    """Our own code tried something the protocol forbids (a bug here)."""

    http_status = 500


class MessageTooLarge(LocalProtocolError):
    """A request head too big for one frame: refused for that request only,
    before anything is sent (431 Request Header Fields Too Large)."""

    http_status = 431


class RemoteProtocolError(ProtocolError):
    """The peer sent bytes or messages the protocol forbids."""

    http_status = 502


class AuthenticationError(RemoteProtocolError):
    """The peer failed the shared-secret challenge."""


class ConnectionLost(ZcLbError):
    """A connection to a peer broke from outside (reset, EOF, silence)."""

    http_status = 502


class ConnectionClosed(ZcLbError):
    """We closed a connection ourselves (removal, shutdown)."""

    http_status = 502


class WorkerLost(ConnectionLost):
    """The LB's connection to a worker broke from outside."""


class WorkerClosed(ConnectionClosed):
    """The LB closed its connection to a worker itself."""


class NoWorkerAvailable(ZcLbError):
    """No worker could be had within the no-worker timeout."""

    http_status = 503


class RequestCancelled(ZcLbError):
    """The other side cancelled a request in flight (to an LB's client:
    the worker gave up on it, a bad gateway)."""

    http_status = 502


class BadRequest(ZcLbError):
    """The client's request head breaks HTTP (RFC 9110/9112), or is more
    than the front accepts; ``http_status`` is 400, 431, 501 or 505."""

    http_status = 400

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.http_status = status
