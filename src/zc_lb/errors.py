"""Every exception zc-lb raises on purpose, in one place.

Names say who is at fault:

- the *client* (``ClientError``): a request HTTP forbids or the LB does
  not take, or a client that went away; answered with a 4xx (or, gone,
  not at all);
- a *worker* (``WorkerError``): it broke the protocol, was lost, cancelled
  a request, answered badly or not in time; the client gets a 5xx;
- the *configuration* (``ConfigurationError``): a setting, address, file
  or classifier we were given is wrong; a process exits with status 2;
- *ZooKeeper unavailable* (``ZooKeeperUnavailable``): not a typo, an
  outage; a process exits with status 69 (EX_UNAVAILABLE), one a
  supervisor retries;
- *our own code* (``LocalProtocolError``): a bug here.

Each class carries what it becomes: ``http_status`` for a request that
fails with it, ``exit_status`` for a process that ends with it; ``lb/balancer.py``
turns errors into responses, ``cli/`` into exit statuses, each in one
place.

Within the LB<->worker protocol a *local* protocol error means our code
misused the API; a *remote* one that the peer sent what the protocol
forbids.  A connection *lost* broke from outside; one *closed* was closed
by us.  A request *cancelled* says by whom: the peer (``PeerCancelled``),
or this side (``CancelledHere``, and ``ClientGone`` when the LB's client
left).
"""


class ZcLbError(Exception):
    """Base of every error zc-lb raises on purpose."""

    http_status = 500
    exit_status = 1


# -- configuration and environment ---------------------------------------


class ConfigurationError(ZcLbError):
    """A setting, classifier spec, address or file given to us is invalid."""

    exit_status = 2


class CorruptResumeFile(ConfigurationError):
    """A résumé file that is not a JSON object of positive, finite
    scores: a cache gone bad, which a worker moves aside (it starts with
    no skills) rather than refuse to start."""


class AddressUnavailable(ZcLbError):
    """An address to listen on is in use or not this host's: the
    environment's, not the configuration's (exit status 1); the message
    names the option."""


class BufferUnreadable(ZcLbError):
    """A response (or request body) held on disk for a slow client could
    not be read back (a failing disk): the environment's; the client's
    connection is closed, the response cut short (a request answered
    500), and buffering goes on in memory."""


class ChildUnavailable(ZcLbError):
    """LB processes of a ``--processes N`` supervisor did not answer an
    action in time (stopped, or stuck), and none refused it: an outage,
    not the operator's mistake; the status address answers 503 (try
    again), naming those processes."""

    http_status = 503


class ZooKeeperUnavailable(ZcLbError):
    """ZooKeeper could not be reached (wrong hosts, or down): an outage,
    not a mistake in the configuration."""

    http_status = 503
    exit_status = 69  # EX_UNAVAILABLE: try again later


# -- the LB<->worker protocol ---------------------------------------------


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


class BadResponseHead(LocalProtocolError):
    """An application's response head HTTP forbids (a newline in a field,
    say, which would split the response): the worker answers 500 for that
    request only, before anything of it is sent."""

    http_status = 500


class ResponseHeadTooLarge(BadResponseHead):
    """A response head too big for one frame: see BadResponseHead."""


class WorkerError(ZcLbError):
    """Base of what a worker (or, on a worker, the LB) did wrong or
    suffered: the client gets a 5xx."""

    http_status = 502


class RemoteProtocolError(ProtocolError, WorkerError):
    """The peer sent bytes or messages the protocol forbids.  ``rno``: the
    request whose frame broke it (0: none, or the connection's own)."""

    http_status = 502
    rno = 0


class AuthenticationError(RemoteProtocolError):
    """The peer failed the shared-secret challenge."""


class ConnectionLost(WorkerError):
    """A connection to a peer broke from outside (reset, EOF, silence)."""


class ConnectionClosed(WorkerError):
    """We closed a connection ourselves (removal, shutdown)."""


class WorkerLost(ConnectionLost):
    """The LB's connection to a worker broke from outside."""


class WorkerSilent(WorkerLost):
    """The LB gave up waiting on a worker fallen silent for a request it
    may send elsewhere; the connection stays (the silence counts toward
    the worker's ejection once, not once a request it held)."""


class WorkerClosed(ConnectionClosed):
    """The LB closed its connection to a worker itself."""


class RequestCancelled(WorkerError):
    """A request in flight was cancelled; the subclass says by whom."""


class PeerCancelled(RequestCancelled):
    """The other side cancelled the request (to an LB's client: the worker
    gave up on it, a bad gateway)."""


class CancelledHere(RequestCancelled):
    """This side cancelled the request."""


class BadResponse(WorkerError):
    """The worker's response broke HTTP (a bad head, a body longer or
    shorter than its Content-Length)."""


class ResponseTimeout(WorkerError):
    """The worker did not start a response within the response timeout
    (504), or sent nothing more of one it started for as long, free to
    (its client's connection is closed)."""

    http_status = 504


class NoWorkerAvailable(WorkerError):
    """No worker could be had within the no-worker timeout."""

    http_status = 503


# -- the client -------------------------------------------------------------


class ClientError(ZcLbError):
    """Base of what the HTTP client did wrong: a 4xx."""

    http_status = 400


class BadRequest(ClientError):
    """The client's request head breaks HTTP (RFC 9110/9112), or is more
    than the front accepts; ``http_status`` is 400, 431, 501 or 505."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.http_status = status


class HeadTimeout(BadRequest):
    """The client did not send a whole request head within the header
    timeout: 408 Request Timeout."""

    def __init__(self, message: str, status: int = 408) -> None:
        super().__init__(message, status)


class RequestTooLarge(ClientError):
    """The request body is larger than the LB accepts."""

    http_status = 413


class ClientGone(CancelledHere, ClientError):
    """The HTTP client went away while we read its request body or the
    worker worked: nobody to answer (logged as 499)."""

    http_status = 499
