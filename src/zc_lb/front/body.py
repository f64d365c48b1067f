"""A request's body as the application reads it: ``wsgi.input``.

``Input`` gives the body as it arrives from the client connection
(chunked bodies decoded by front/h1.py), asking the client for it
(``100 Continue``) on the first read if the client waits to be asked,
and reading more from the connection only when what came is used up.
A request without a body gets ``NO_BODY``, which keeps nothing.
"""

from __future__ import annotations

from typing import Final, List, Protocol

from zc_lb.errors import ClientGone
from zc_lb.front.h1 import Request, RequestReader

SMALL_PIECES: Final = 16 * 1024  # ``read1`` joins pieces under this, up to this


class Source(Protocol):
    """Where an ``Input`` gets more of its body: the client connection."""

    reader: RequestReader

    def fill(self) -> None:
        """Read more of the body from the client."""

    def send_continue(self) -> None:
        """Tell a client that waits (Expect: 100-continue) to send its body."""


class Input:
    """wsgi.input: the request body as it arrives (chunked bodies
    decoded), asking the client for it (100 Continue) on the first read
    if it waits to be asked.  ``complete``: all of it has come."""

    def __init__(self, connection: Source, request: Request) -> None:
        self._connection = connection
        self._request = request
        self._asked = not request.expect_continue

    @property
    def complete(self) -> bool:
        return self._request.complete

    @property
    def buffered(self) -> int:
        """Body bytes that have come and are not read yet."""
        return self._request.body_size

    def _more(self) -> bool:
        """Wait for more body bytes; False at its end."""
        request = self._request
        if request.error is not None:
            raise request.error
        if request.complete:
            return False
        if self._connection.reader.broken:
            raise ClientGone("client connection ended in the body")
        if not self._asked:
            self._asked = True
            if not request.body_size:
                self._connection.send_continue()
        self._connection.fill()
        return True

    def read(self, size: int = -1) -> bytes:
        request = self._request
        size = -1 if size is None else size
        while (size < 0 or request.body_size < size) and self._more():
            pass
        return self._take(request.body_size if size < 0 else min(size, request.body_size))

    def read1(self, size: int = -1) -> bytes:
        """Up to ``size`` bytes (with -1, a piece) of what has come,
        waiting for more only while nothing has: ``io``'s read1.  The
        LB's upload reads with it, so that a body goes on a piece at a
        time as it comes, not joined into larger ones first (a copy of
        the whole body); but small pieces that have come together (a
        chunk each, of a body sent in tiny chunks) are joined up to
        SMALL_PIECES, as each piece costs the upload a frame."""
        request = self._request
        while not request.body_size and self._more():
            pass
        body = request.body
        if not body:
            return b""
        part = body[0]
        if len(part) < SMALL_PIECES and len(body) > 1:
            joined = 0
            for piece in body:
                if joined and joined + len(piece) > SMALL_PIECES:
                    break
                joined += len(piece)
            return self._take(joined if size < 0 else min(joined, size))
        if size < 0 or len(part) <= size:
            body.popleft()
            request.body_size -= len(part)
            return part
        return self._take(size)

    def readline(self, size: int = -1) -> bytes:
        request = self._request
        size = -1 if size is None else size
        while True:
            joined = b"".join(request.body)
            request.body.clear()
            if joined:
                request.body.append(joined)
            end = joined.find(b"\n") + 1
            if end and (size < 0 or end <= size):
                return self._take(end)
            if 0 <= size <= len(joined) or not self._more():
                return self._take(len(joined) if size < 0 else min(size, len(joined)))

    def readlines(self, hint: int = -1) -> List[bytes]:
        return list(self)

    def __iter__(self):
        while True:
            line = self.readline()
            if not line:
                return
            yield line

    def _take(self, size: int) -> bytes:
        body = self._request.body
        if not size:
            return b""
        taken, parts = 0, []
        while taken < size:
            part = body.popleft()
            if taken + len(part) > size:
                cut = size - taken
                body.appendleft(part[cut:])
                part = part[:cut]
            parts.append(part)
            taken += len(part)
        self._request.body_size -= taken
        return parts[0] if len(parts) == 1 else b"".join(parts)


class NoBody:
    """wsgi.input of a request that has no body (most): one for all,
    since it keeps nothing (an ``Input`` cost a call of its ``__init__``
    on every request)."""

    complete = True
    buffered = 0

    def read(self, size: int = -1) -> bytes:
        return b""

    def read1(self, size: int = -1) -> bytes:
        return b""

    def readline(self, size: int = -1) -> bytes:
        return b""

    def readlines(self, hint: int = -1) -> List[bytes]:
        return []

    def __iter__(self):
        return iter(())


NO_BODY = NoBody()
