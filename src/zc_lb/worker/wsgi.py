"""PEP 3333's side of one request, in the hub: its environ, ``wsgi.input``
(``RequestInput``) and ``start_response`` with its ``write``
(``ResponseWriter``).

The environ is the dict the LB forwarded, decoded for this request
alone: defaults go in only where it lacks a variable, then what only
the worker may say (``fixed_environ``: PEP 3333's flags, the worker's
address).  The body is read from the request's exchange as the
application asks for it, and granted back to the LB as it is read, so an
upload goes at the application's pace.  The response's head goes lazily,
with its first body bytes, and the whole response in one frame when it
fits the LB's credit; a head too large for a frame, or one HTTP forbids,
gets a 500 for that request alone.  ``ResponseWriter.fail`` is what an
application's failure becomes: a 500, or, once the head is out, a
response cut short (a truncated body must not look complete).

In thread mode the application talks to ``threadio``'s objects, which
hand over to these in the hub.
"""

from __future__ import annotations

import io
import logging
import reprlib
import sys
import time
from typing import Any, Dict, Final, List, Optional, Set, Tuple, cast

from zc_lb.environ import CACHE, REQUEST_CLASS, WORKER
from zc_lb.errors import BadResponseHead
from zc_lb.front.h1 import BODILESS_STATUS, start_again
from zc_lb.front.httpparse import HOP_BY_HOP
from zc_lb.wire.exchange import Exchange
from zc_lb.wire.frames import Body, End, MAX_BODY
from zc_lb.worker.filewrapper import FileWrapper
from zc_lb.worker.threadio import NOT_BYTES, read_line

log = logging.getLogger(__name__)

ERROR_500 = b"<html><body><h1>500 Internal Server Error</h1></body></html>"


# -- the environ ------------------------------------------------------------


ENVIRON_DEFAULTS: Final[Dict[str, object]] = {
    "REQUEST_METHOD": "GET", "SCRIPT_NAME": "", "PATH_INFO": "/", "QUERY_STRING": "",
    "SERVER_NAME": "localhost", "SERVER_PORT": "80", "SERVER_PROTOCOL": "HTTP/1.1",
    "wsgi.url_scheme": "http", REQUEST_CLASS: "",
}


def fixed_environ(multithread: bool, worker: str) -> Dict[str, object]:
    """What every environ of a worker holds alike: PEP 3333's flags, and
    the worker's address (``worker``, as text)."""
    return {
        "wsgi.version": (1, 0),
        "wsgi.multithread": multithread,
        "wsgi.multiprocess": True,
        "wsgi.run_once": False,
        "wsgi.input_terminated": True,
        "wsgi.file_wrapper": FileWrapper,
        WORKER: worker,
    }


def make_environ(forwarded: Dict[str, str], exchange: Exchange, ended: bool,
                 fixed: Dict[str, object]) -> Dict:
    """PEP 3333's environ: what the LB forwarded, defaults for what it
    did not, then what only the worker may say (``fixed``)."""
    # The forwarded dict was decoded for this request alone: it becomes
    # the environ, which costs a lookup per default, not a store per
    # forwarded variable into a copy of the defaults.
    environ = cast(Dict[str, object], forwarded)
    if "wsgi.input" not in environ:  # (a head request's has all, and room: relay.ROOM)
        for key, value in ENVIRON_DEFAULTS.items():
            if key not in environ:
                environ[key] = value
    environ.update(fixed)
    environ["wsgi.input"] = RequestInput(exchange, ended)
    environ["wsgi.errors"] = sys.stderr
    return environ


# -- request input ----------------------------------------------------------


class RequestInput(io.RawIOBase):
    """wsgi.input: the request body, read from an exchange as it arrives.

    Bytes are granted back to the LB as the application asks for them, so
    an upload proceeds at the application's pace.
    """

    def __init__(self, exchange: Exchange, ended: bool = False) -> None:
        self._exchange = exchange
        self._buffer = b""
        self._pos = 0  # bytes of the buffer read already (not cut off: no copy)
        self._eof = ended  # the request came whole: it has no body
        # Seconds its reader waited for the body to come: the client's
        # pace (a slow upload), not the application's time.
        self.waited = 0.0

    def readable(self) -> bool:
        return True

    def _fill(self) -> bool:
        """Get the next chunk into the buffer; False at end of body."""
        if self._eof:
            return False
        if not self._exchange.inbox:
            # The application keeps up (it read all that came): let the
            # body come at full speed, not a window at a time.
            self._exchange.widen()
            began = time.perf_counter()
            message = self._exchange.receive()
            self.waited += time.perf_counter() - began
        else:
            message = self._exchange.receive()
        if isinstance(message, End):
            self._eof = True
            return False
        assert isinstance(message, Body)
        if self._pos == len(self._buffer):
            self._buffer, self._pos = message.data, 0
        else:
            self._buffer = self._buffer[self._pos:] + message.data
            self._pos = 0
        # Buffered here only because the application asked for it.
        self._exchange.consumed(len(message.data))
        return True

    @property
    def _buffered(self) -> int:
        return len(self._buffer) - self._pos

    def _take(self, n: int) -> bytes:
        """The next ``n`` buffered bytes (a whole chunk is not copied)."""
        buffer, pos = self._buffer, self._pos
        if pos == 0 and n >= len(buffer):
            data = buffer
        else:
            data = buffer[pos:pos + n]
        self._pos = min(pos + n, len(buffer))
        return data

    def read(self, size: Optional[int] = -1) -> bytes:
        if size is None or size < 0:
            size = -1
        if 0 <= size <= self._buffered:
            return self._take(size)
        # More than is buffered: each chunk taken as it comes, and the
        # pieces joined once (a buffer grown chunk by chunk was copied
        # whole with each one: most of a worker's copies of an upload).
        pieces: List[bytes] = []
        wanted = size
        while True:
            buffered = self._buffered
            if buffered:
                n = buffered if wanted < 0 else min(buffered, wanted)
                pieces.append(self._take(n))
                if wanted >= 0:
                    wanted -= n
                    if not wanted:
                        break
            if not self._fill():
                break
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def read1(self, size: int = -1) -> bytes:
        """Up to ``size`` bytes (any number, if negative): waiting only
        for the first, and more only if they are here already; b"" at the
        end of the body.  (``threadio.ThreadInput``'s pump.)"""
        pieces: List[bytes] = []
        got = 0
        inbox = self._exchange.inbox
        while size < 0 or got < size:
            if not self._buffered and not ((not got or inbox) and self._fill()):
                break
            piece = self._take(self._buffered if size < 0 else size - got)
            pieces.append(piece)
            got += len(piece)
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def readinto(self, b) -> int:  # type: ignore[override]
        data = self.read(len(b))
        b[:len(data)] = data
        return len(data)

    def readline(self, size: Optional[int] = -1) -> bytes:
        return read_line(self._view, self._fill, self._take, size)

    def _view(self) -> Tuple[bytes, int]:
        return self._buffer, self._pos

    def __iter__(self):
        return iter(self.readline, b"")


# -- response output --------------------------------------------------------


NOT_A_STATUS: Final = "the application's status must be a str, not %s"
NOT_TAKEN: Final = object()  # (a response's zc_lb.cache before it starts)
CACHE_WORDS: Final = '"hit" or True, "miss" or False'  # (what the log says it takes)
# The log's lines about what an application says of its cache, each said
# once a process: an application that says it wrong says it on every
# request.  (The hub's alone: no lock.)
SAID_ONCE: Final[Set[str]] = set()


def say_once(what: str, message: str, *args: object) -> None:
    """Log ``message`` % ``args`` as a warning, the first time ``what``
    happens in this process."""
    if what not in SAID_ONCE:
        SAID_ONCE.add(what)
        log.warning(message + " (logged once)", *args)


def body_limit(status: str, length: object) -> Optional[int]:
    """The body bytes a response of ``status`` may have: none if the
    status has no body (a 204, a 304), else its Content-Length ``length``
    (None: any, when there is none, or one the head will refuse)."""
    if status[:3] in BODILESS_STATUS:
        return 0
    if type(length) is str and length.isdigit() and length.isascii() and len(length) <= 18:
        return int(length)
    return None


def _same_length(first: object, second: object) -> object:
    """The Content-Length of two of an application's fields: the first if
    both say the same valid number, as the head takes them, else "", no
    limit: such a head is refused (a 500 goes instead), and its body is
    held to neither, nor said in the log to miss either."""
    number = body_limit("200", first)
    return first if number is not None and number == body_limit("200", second) else ""


def cache_said(value: object) -> Optional[bool]:
    """What an application's ``zc_lb.cache`` says: True (a hit), False
    (a miss), or None (nothing, or a value it does not know: said once
    in the log)."""
    if value is True or value is False:
        return value
    if isinstance(value, str) and 3 <= len(value) <= 4:  # (a long one is no word)
        word = value.lower()
        if word == "hit":
            return True
        if word == "miss":
            return False
    if value is not None:
        say_once("unknown", "the application set zc_lb.cache to %s, which says nothing: "
                 "it takes %s", reprlib.repr(value), CACHE_WORDS)
    return None


class ResponseWriter:
    """Sends one response: status and headers lazily with the first body
    bytes (PEP 3333), body within credit, End at the end."""

    def __init__(self, exchange: Exchange, head: bool,
                 environ: Optional[Dict[str, Any]] = None) -> None:
        self.exchange = exchange
        self.head = head
        self.environ = environ  # (for what the app says of its cache: CACHE)
        # Its CACHE when the response started (``cache_now``; NOT_TAKEN
        # before), and what that told the LB.
        self.said: object = NOT_TAKEN
        self.cache: Optional[bool] = None
        self.status: Optional[str] = None
        self.headers: List[Tuple[str, str]] = []
        # Body bytes the application may still give (``body_limit``: its
        # Content-Length, none for a 204 or 304; None: any, and for HEAD,
        # whose body goes nowhere): past it, they are cut (``_past``).
        self.limit: Optional[int] = None
        # The body is a ``wsgi.file_wrapper``'s: a file read up to its
        # Content-Length is how WSGI sends part of one (a range), cut there
        # without a word.
        self.from_file = False
        self.started = False
        self.began: Optional[float] = None  # perf_counter() when the app began
        # What of its time since is not the application's (``app_seconds``).
        # In greenlet mode: its waits for the request's body (``input``'s)
        # and for the LB's credit for its response (``held``).  In thread
        # mode: the pool's record of the thread running the app while it
        # runs, with its waits inside the app behind the others (``queued``:
        # worker/threads.py) and on the hub (``held``: threadio.py); then
        # the app's own seconds (``took``), reckoned as the thread returned:
        # what the hub sends after is the LB's pace, not the app's.
        stream = None if environ is None else environ.get("wsgi.input")
        self.input = stream if isinstance(stream, RequestInput) else None
        self.held = 0.0
        self.thread: Optional[Any] = None
        self.queued = 0.0
        self.took: Optional[float] = None
        self.refused = False  # its head was too large: a 500 went instead
        self.ended = False  # its End went: a Cancel now ends the stream, not the request

    def start_response(self, status: object, headers: Any, exc_info: Any = None) -> Any:
        start_again(exc_info, self.started, self.status is not None)
        if not isinstance(status, str):  # (compiled, ``self.status``'s type check said less)
            raise TypeError(NOT_A_STATUS % type(status).__name__)
        self.status = status
        kept: List[Any] = []  # (Any: an application's pair is checked as the head is made)
        length: object = None
        for name, value in headers:
            lowered = name.lower()
            if lowered not in HOP_BY_HOP:
                kept.append((name, value))
                if lowered == "content-length":
                    length = value if length is None else _same_length(length, value)
        self.headers = kept
        self.limit = None if self.head else body_limit(status, length)
        return self.write

    def write(self, data: object) -> None:
        if type(data) is not bytes:
            raise TypeError(NOT_BYTES % type(data).__name__)
        if self.status is None:
            raise AssertionError("write() before start_response()")
        exchange = self.exchange
        if self.refused:
            return
        limit = self.limit
        if limit is not None:
            if len(data) > limit:
                data = self._past(data, limit)
            else:
                self.limit = limit - len(data)
        if not self.started:
            self.started = True
            if self.head or not data:
                self._respond()
                return
            if len(data) <= min(exchange.credit, MAX_BODY):
                self._respond(data)
                return
            if not self._respond():
                return
        if data and not self.head:
            began = time.perf_counter()
            exchange.send_body(data)
            self.held += time.perf_counter() - began

    def finish(self, data: object = b"") -> None:
        """End the response, after ``data`` (the whole body, when the
        application returned it in one piece: head, body and End then go
        in one write)."""
        if type(data) is not bytes:
            raise TypeError(NOT_BYTES % type(data).__name__)
        exchange = self.exchange
        started = self.started
        if not started:
            if self.status is None:
                raise AssertionError("application returned without start_response()")
            if self.head or not data or (  # (``exchange.credit``, without its call)
                    len(data) <= MAX_BODY
                    and len(data) <= exchange.connection.protocol.credit(exchange.rno)):
                limit = self.limit
                if limit is not None and len(data) != limit:  # (the app's body is not its head's)
                    data = self._past(data, limit) if len(data) > limit else self._short(
                        data, limit - len(data))
                self.started = True
                self._respond(b"" if self.head else data, True)
                self._ended()
                return
        if data:
            self.write(data)
        if not self.refused:
            limit = self.limit
            if limit is not None and limit > 0:  # (bytes its head said would come)
                self._short(b"", limit)
            exchange.send(End(exchange.rno))
            self._ended()
            if started:  # (its head went before: the app ran on after it)
                self._said_late()

    def cache_now(self) -> None:
        """The response starts: what the application's ``zc_lb.cache``
        says is taken now.  (In thread mode, at its first block, in its
        thread: the hub sends the head later, but for the application it
        is out, as in greenlet mode.)"""
        environ = self.environ
        self.said = None if environ is None else environ.get(CACHE)

    def _said_late(self) -> None:
        """A ``zc_lb.cache`` set once the response's head was out reached
        no LB (a generator's, or a middleware's that wraps one): said once
        in the log."""
        environ, status = self.environ, self.status
        if environ is None or status is None or status[:1] == "5":  # (nothing went: _respond)
            return
        said = environ.get(CACHE)
        if said is not None and said is not self.said and cache_said(said) not in (
                None, self.cache):
            say_once("late", "the application set zc_lb.cache after the response to %s "
                     "started: the LB did not get it; set it before the first body bytes",
                     environ.get("PATH_INFO"))

    def _ended(self) -> None:
        """The response is whole: a Cancel from now on (the LB ending its
        side of a request whose body it no longer sends) must not kill the
        application's ``close()`` still to run."""
        self.ended = True
        self.exchange.on_cancel = None

    def _past(self, data: bytes, limit: int) -> bytes:
        """The application's body goes past what its head allows (its
        Content-Length, or none for a 204 or 304): what of ``data`` is
        within ``limit``, the rest dropped, and the first time for the
        request a warning (``limit`` -1: said already), but for a file
        wrapper's part of a file (``from_file``)."""
        if limit >= 0:
            status = cast(str, self.status)
            if status[:3] in BODILESS_STATUS:
                log.warning("the application's %s response to %s has a body: dropped (a %s "
                            "response has none)", status[:3], self._request(), status[:3])
            elif not self.from_file:
                log.warning("the application's response to %s ran past its Content-Length "
                            "of %s: cut there", self._request(), self._content_length())
        self.limit = -1
        return data[:limit] if limit > 0 else b""

    def _short(self, data: bytes, missing: int) -> bytes:
        """The application's body ends ``missing`` bytes short of its
        Content-Length: said in the log (the LB closes its client's
        connection: a truncated body must not look complete)."""
        log.warning("the application's response to %s ended %d bytes short of its "
                    "Content-Length of %s (the LB closes the client's connection after it)",
                    self._request(), missing, self._content_length())
        self.limit = 0
        return data

    def _request(self) -> str:
        """The request, for the log: its method and path."""
        environ = self.environ
        if environ is None:
            return "request %d" % self.exchange.rno
        return "%s %s" % (environ.get("REQUEST_METHOD"), environ.get("PATH_INFO"))

    def _content_length(self) -> str:
        for name, value in self.headers:
            if name.lower() == "content-length":
                return value
        return "?"

    def fail(self) -> None:
        """The application failed: a 500, or, once the head is out, the
        response cut short."""
        if self.started:
            # Headers are out: a truncated body must not look complete.
            self.exchange.cancel()
            return
        self.status = None
        self.start_response("500 Internal Server Error", [
            ("Content-Type", "text/html"), ("Content-Length", str(len(ERROR_500)))])
        self.write(ERROR_500)
        self.finish()

    def send_file(self, fd: int, offset: int, count: int) -> None:
        """The body from an open file, with sendfile(2): the head first,
        if it has not gone; at most the Content-Length the app gave.  A
        file that ends first cuts the response short (cancelled, as an
        application error after the head is)."""
        if self.refused:
            return
        if not self.started:
            self.started = True
            if not self._respond() or self.head:
                return
        elif self.head:
            return
        limit = self.limit
        if limit is not None:
            if count > limit:
                self._past(b"", limit)
                count = max(limit, 0)
            else:
                self.limit = limit - count
        began = time.perf_counter()
        whole = self.exchange.send_file(fd, offset, count)
        self.held += time.perf_counter() - began
        if not whole:
            log.error("request %d from %s: the file ended before its response did",
                      self.exchange.rno, self.exchange.connection.peer)
            self.exchange.cancel()
            self.refused = True  # (nothing more goes: no End)

    def _taught(self) -> Tuple[Optional[float], Optional[bool]]:
        """What the response starting tells the LB, which learns from it
        what a key's cached data buys (``routing/locality.py``): the
        application's seconds until now, and what it said its cache did;
        nothing for a 5xx (a failure teaches nothing)."""
        status = self.status
        if type(status) is str and status[:1] == "5":
            return None, None
        elapsed = None if self.began is None else self.app_seconds()
        if self.said is NOT_TAKEN:
            self.cache_now()
        said = self.said
        if said is not None:  # (most apps say nothing)
            self.cache = cache_said(said)
        return elapsed, self.cache

    def app_seconds(self) -> float:
        """The application's own seconds from its start to now (to its
        return, in thread mode): less its waits behind its other requests
        and on the LB, which are no measure of its skill."""
        thread = self.thread
        if thread is not None:  # (thread mode, while it runs)
            return time.perf_counter() - cast(float, self.began) - thread.queued - thread.held
        if self.took is not None:  # (thread mode, once it returned)
            return self.took
        waited = self.queued + self.held + (0.0 if self.input is None else self.input.waited)
        return time.perf_counter() - cast(float, self.began) - waited

    def _respond(self, body: bytes = b"", end: bool = False) -> bool:
        """Send the head (with ``body``, and End if ``end``); False if it
        was refused as too large for a frame and a 500 went instead (the
        request alone fails: the connection and its other requests go on)."""
        exchange = self.exchange
        elapsed, cache = self._taught()
        try:
            exchange.respond(self.status, self.headers, body, end,  # type: ignore[arg-type]
                             elapsed, cache)
            return True
        except BadResponseHead as exc:  # (too large, or one HTTP forbids)
            log.error("request %d from %s: %s; answering 500 instead",
                      exchange.rno, exchange.connection.peer, exc)
        self.refused = True
        self.status = "500 Internal Server Error"
        self.headers = [("Content-Type", "text/html"), ("Content-Length", str(len(ERROR_500)))]
        exchange.respond(self.status, self.headers, ERROR_500, True)
        return False

