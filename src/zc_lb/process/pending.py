"""The signals a process's ``service.wait_for_signal`` has queued and not
yet handled, and a way to act as on one that nobody sent.

Plain Python (no gevent): a compiled module may import it (a worker past
``--max-requests`` drains as on SIGTERM: ``act_as_on``) without taking
in the rest of ``process/service.py``.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

log = logging.getLogger("zc_lb")

# While wait_for_signal runs, its queue of (name, what the log says of it);
# else None.
queue: Any = None


def act_as_on(name: str, why: str) -> None:
    """Do what signal ``name`` does in ``wait_for_signal``, whose log says
    ``why`` rather than "got NAME": a worker past --max-requests drains as
    on SIGTERM, though no one sent one.  (Outside ``wait_for_signal``, that
    signal is sent to this process.)"""
    if queue is not None:
        queue.put((name, why))
        return
    log.info("%s", why)
    os.kill(os.getpid(), getattr(signal, name))
