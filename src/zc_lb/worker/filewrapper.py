"""``environ["wsgi.file_wrapper"]``: a file an application hands back whole.

Frameworks that serve files (Django's FileResponse, Flask's send_file)
give the server the open file when it offers a file wrapper (PEP 3333),
and otherwise iterate it themselves in small blocks (Django's 4 KiB).
A regular file the worker can reach by its descriptor (``region``) goes
to the LB with sendfile(2): the kernel moves its bytes, and the worker
never reads them (``exchange.Exchange.send_file``).  Otherwise (a pipe,
a file-like object, a connection over TLS) the wrapper is iterated, in
``BLOCK`` reads whatever block size the application asked for (PEP 3333
leaves the server that choice), so a 20 MB file is some 80 sends, not
5,000.  Either way the worker closes the file when the response is done.
"""

from __future__ import annotations

import io
import os
import stat
from typing import Any, Iterator, Optional, Tuple

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

    def region(self) -> Optional[Tuple[int, int, int]]:
        """(descriptor, offset, bytes to its end) of a regular file read
        from where it stands, for sendfile(2); None for anything else."""
        filelike = self.filelike
        if isinstance(filelike, io.TextIOBase):
            return None
        try:
            fd = filelike.fileno()
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                return None
            offset = filelike.tell()
        except (AttributeError, OSError, ValueError):  # (io.UnsupportedOperation too)
            return None
        if type(fd) is not int or type(offset) is not int or offset < 0:
            return None
        return fd, offset, max(0, info.st_size - offset)

    def close(self) -> None:
        """The server's call once the response is done: close the file."""
        close = getattr(self.filelike, "close", None)
        if close is not None:
            close()
