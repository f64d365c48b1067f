"""The pages zc-lb answers with itself: one set for every path.

A request the front refuses (a malformed head, one too large, too many
connections) and a request the LB cannot serve (no worker, a worker
lost, a timeout) are answered from the same ``ErrorPages``: an HTML page
naming the status by default, or the operator's page for the statuses
it is given (``--error-page``: 502 and 503, what a client sees while
the site is down).  ``refusal`` makes the whole response the front
sends before it closes the connection; the LB sends ``body`` with the
head it writes through WSGI.
"""

from typing import Dict, Mapping, Optional

from zc_lb.front.h1 import REASONS

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

    def refusal(self, status: int) -> bytes:
        """A whole response refusing a request, the connection closing."""
        page = self.body(status)
        return (b"HTTP/1.1 %d %s\r\nConnection: close\r\n"
                b"Content-Type: text/html; charset=utf-8\r\n%sContent-Length: %d\r\n\r\n%s" % (
                    status, REASONS.get(status, "Error").encode(),
                    b"Retry-After: %d\r\n" % RETRY_AFTER if status == 503 else b"",
                    len(page), page))
