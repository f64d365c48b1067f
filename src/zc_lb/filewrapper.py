"""``environ["wsgi.file_wrapper"]``: a file an application hands back whole.

Frameworks that serve files (Django's FileResponse, Flask's send_file)
give the server the open file when it offers a file wrapper (PEP 3333),
and otherwise iterate it themselves in small blocks (Django's 4 KiB),
each block a frame and, in a thread-mode worker, a handoff to the event
loop.  The worker's wrapper reads in ``BLOCK`` bytes whatever block size
the application asked for (PEP 3333 leaves the server that choice), so a
20 MB file is some 80 sends, not 5,000, and closes the file when the
response is done.
"""

from __future__ import annotations

from typing import Any, Iterator

BLOCK = 256 * 1024  # bytes read at once: a large Body frame, within the LB's credit


class FileWrapper:
    """Iterate ``filelike`` in ``BLOCK`` reads; ``close`` closes it."""

    def __init__(self, filelike: Any, block_size: int = 8192) -> None:
        self.filelike = filelike
        self.block_size = max(block_size, BLOCK)  # (the app's, unless smaller)

    def __iter__(self) -> Iterator[bytes]:
        read, size = self.filelike.read, self.block_size
        while True:
            data = read(size)
            if not data:
                return
            yield data

    def close(self) -> None:
        """The server's call once the response is done: close the file."""
        close = getattr(self.filelike, "close", None)
        if close is not None:
            close()
