"""The handshake: each side's Hello, the proof of a shared secret, and the
frames a peer may send once it is done.

Connection start: each side sends ``Hello`` at once (protocol version, its
role, a random nonce, whether it holds a shared secret, its role's
features).  With a secret, each then sends ``Auth``: HMAC-SHA256(secret,
peer's nonce + own role), so both sides prove the secret without sending
it, and a reply cannot be replayed to another connection.

Rules: the peer must speak our version, have the other role, offer
every feature of its role (``role_features``: a peer that lacks one is
of an older release, and is refused with the names of what it lacks)
and hold a secret exactly when we do (``check_hello``), then prove it
(``check_auth``, compared in constant time).  Until then it may send a
Hello, then an Auth, each of at most HANDSHAKE_LIMIT bytes, and nothing
else: an unauthenticated peer can make us buffer a kilobyte, not a
résumé's 64 MiB.  Once open, it may send what its role sends
(``open_limits``): a worker accepts no résumé or response, an LB no
request.  What the features bring is part of every open connection: a
peer without one never gets this far.  A peer whose first bytes do
not begin a Hello frame is none of ours, and ``stranger`` says what it
sent (escaped, cut short) and what that looks like (an HTTP server or
client), for both the LB's and the worker's log.  A peer refused at
its Hello reads the connection as open when it holds no secret (it
waits for no Auth): the refusing side says why in a GoAway whose reason
begins ``REFUSED`` (``refusal``), so that the refused side logs why
and sends nothing more, rather than take the close that follows for a
connection lost.  No I/O: ``protocol.Connection`` drives these.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Dict, Final, Optional, Tuple

from zc_lb.errors import AuthenticationError, RemoteProtocolError
from zc_lb.wire.frames import (
    HEAD_REQUEST,
    LB_FEATURES,
    VERSION,
    WHOLE_REQUEST,
    WORKER_FEATURES,
    Auth,
    GoAway,
    Hello,
    Request,
    Response,
    Resume,
)

HANDSHAKE_LIMIT: Final = 1024  # payload bytes of a Hello or Auth: nothing more before it
HELLO_START: Final = bytes((0, 0, 0, 0, Hello.TYPE))  # how a Hello frame begins
SHOWN: Final = 40  # bytes of a stranger's first ones a log line shows
HTTP_METHODS: Final = (b"GET ", b"HEAD ", b"POST ", b"PUT ", b"DELETE ", b"OPTIONS ",
                       b"PATCH ", b"CONNECT ", b"TRACE ", b"PRI * ")
UPGRADE: Final = "docs/howto/upgrade.rst"  # what a refused peer's operator reads
REFUSED: Final = "refused at its Hello: "  # how a GoAway's reason says the peer was refused


def role_features(role: str) -> Tuple[str, ...]:
    """The features a peer of ``role`` offers in its Hello, every one of
    which a peer of the other role requires."""
    return LB_FEATURES if role == "lb" else WORKER_FEATURES


def new_hello(role: str, secret: Optional[bytes], app_version: Optional[str] = None,
              features: Optional[Tuple[str, ...]] = None,
              instance: Optional[str] = None) -> Hello:
    """Our Hello, with a fresh nonce, offering our role's features (or
    ``features``: in tests, those of an older release), naming the
    worker that sends it (``instance``: see frames.Hello)."""
    return Hello(VERSION, role, os.urandom(16).hex(), secret is not None, app_version,
                 role_features(role) if features is None else features, instance)


def _name(role: str) -> str:
    """What the log calls a peer of ``role``."""
    return {"lb": "LB", "worker": "worker"}.get(role, "peer")


def shown(data: bytes) -> str:
    """The first bytes a peer sent, for a log line: escaped (control
    characters and all), at most SHOWN of them."""
    return repr(data[:SHOWN]) + ("..." if len(data) > SHOWN else "")


def stranger(role: str, received: bytes) -> Optional[str]:
    """What to say of the peer of our ``role`` whose first bytes are
    ``received``, if they do not begin a Hello frame: not zc-lb's peer,
    and what it looks like; None if they do (or may yet)."""
    if received[:len(HELLO_START)] == HELLO_START[:len(received)]:
        return None
    peer = "worker" if role == "lb" else "lb"
    guess = ""
    if role == "lb" and received.startswith(b"HTTP/"):
        guess = ": an HTTP server, not a zc-lb worker's port"
    elif role == "worker" and received.startswith(HTTP_METHODS):
        guess = ": an HTTP client on a zc-lb worker's port, which takes LBs only"
    return "expected a zc-lb %s's Hello, received %s%s" % (_name(peer), shown(received), guess)


def refusal(refused: Optional[Hello], error: Exception) -> Optional[GoAway]:
    """The GoAway that tells a peer whose Hello (``refused``) we refused
    with ``error`` why, if it reads the connection as open by now: one
    of our version (its framing is ours) that holds no secret (it waits
    for no Auth); None otherwise (it refuses us too, or waits for an Auth
    that never comes, and says so)."""
    if refused is None or refused.version != VERSION or refused.auth:
        return None
    return GoAway(REFUSED + str(error))


def auth_digest(secret: bytes, nonce: str, role: str) -> str:
    """HMAC-SHA256 of the peer's nonce and the prover's role."""
    return hmac.new(secret, (nonce + ":" + role).encode(), hashlib.sha256).hexdigest()


def check_hello(ours: Hello, theirs: Hello) -> None:
    """Raise unless the peer's Hello fits ours (version, role, the
    role's features, secret)."""
    if theirs.version != VERSION:
        peer, us = _name(theirs.role), _name(ours.role)
        raise RemoteProtocolError(
            "the %s speaks protocol version %d and this %s version %d: their zc-lb "
            "releases are too far apart to work together; upgrade %s (%s)" % (
                peer, theirs.version, us, VERSION,
                "this " + us if theirs.version > VERSION else "the " + peer, UPGRADE))
    if theirs.role == ours.role or theirs.role not in ("lb", "worker"):
        raise RemoteProtocolError("peer has role %r, we are %r" % (theirs.role, ours.role))
    missing = [name for name in role_features(theirs.role) if name not in theirs.features]
    if missing:
        raise RemoteProtocolError(
            "the %s lacks the protocol features %s: it is of an older zc-lb "
            "release and must be upgraded (%s)" % (
                _name(theirs.role), ", ".join(missing), UPGRADE))
    if theirs.auth != ours.auth:
        raise AuthenticationError(
            "shared secret configured on %s only" % ("the peer" if theirs.auth else "our side"))


def check_auth(secret: bytes, ours: Hello, theirs: Hello, auth: Auth) -> None:
    """Raise AuthenticationError unless ``auth`` proves the secret."""
    expected = auth_digest(secret, ours.nonce, theirs.role)
    if not auth.digest.isascii() or not hmac.compare_digest(expected, auth.digest):
        raise AuthenticationError("peer failed the shared-secret challenge")


def open_limits(role: str, limits: Dict[int, int]) -> Dict[int, int]:
    """The frame types the peer may send us, of ``role``, once the
    handshake is done, each up to its payload limit in ``limits`` (every
    type, as the decoder takes them): those the other role sends, and no
    second Hello or Auth."""
    refused = {Hello.TYPE, Auth.TYPE}  # once is enough
    if role == "worker":
        refused |= {Resume.TYPE, Response.TYPE}
    else:
        refused |= {Request.TYPE, WHOLE_REQUEST, HEAD_REQUEST}
    return {mtype: limit for mtype, limit in limits.items() if mtype not in refused}
