"""The pages zc-lb answers with itself: one set for every path.

A request the front refuses (a malformed head, one too large, too many
connections) and a request the LB cannot serve (no worker, a worker
lost, a timeout) are answered from the same ``ErrorPages``: an HTML page
naming the status by default, or the operator's page for the statuses
it is given (``--error-page``: 502 and 503, what a client sees while
the site is down).  Their heads are made in one place too (``head``):
the front sends a whole ``refusal`` before it closes the connection;
the LB writes ``status_line`` and ``head`` through WSGI, then ``body``.
A 503 says when to ask again (``Retry-After``).
"""

from typing import Dict, List, Mapping, Optional, Tuple

from zc_lb.front.h1 import REASONS, response_head

RETRY_AFTER = 1  # seconds, in a refusal's 503: the front is full now, not for long


class ErrorPages:
    """Status -> the page answering it: the operator's, else the default."""

    def __init__(self, pages: Optional[Mapping[int, bytes]] = None) -> None:
        self.pages: Dict[int, bytes] = dict(pages or {})

    def body(self, status: int) -> bytes:
        """The page for ``status``."""
        page = self.pages.get(status)
        if page is None:
            page = self.pages[status] = (
                "<html><body><h1>%d %s</h1></body></html>\n"
                % (status, REASONS.get(status, "Error"))).encode()
        return page

    def head(self, status: int, retry_after: int,
             close: bool = False) -> List[Tuple[str, str]]:
        """The fields of the response answering ``status`` with its page:
        a 503's says to ask again after ``retry_after`` seconds; ``close``,
        the connection closes after it."""
        fields = [("Content-Type", "text/html; charset=utf-8"),
                  ("Content-Length", str(len(self.body(status))))]
        if status == 503:
            fields.append(("Retry-After", str(retry_after)))
        if close:
            fields.append(("Connection", "close"))
        return fields

    def refusal(self, status: int) -> bytes:
        """A whole response refusing a request, the connection closing."""
        head = response_head(status_line(status), self.head(status, RETRY_AFTER, close=True))
        return head + self.body(status)


def status_line(status: int) -> str:
    """``status`` with its reason phrase: "503 Service Unavailable"."""
    return "%d %s" % (status, REASONS.get(status, "Error"))
