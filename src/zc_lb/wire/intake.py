"""An LB's intake of one worker's résumés: bounded in size, in classes
and in rate, sans I/O.

Theory of operation
-------------------

An LB decodes a résumé and takes it into its pool in its event loop: a
MiB of JSON costs it 3-30 ms, and a worker (buggy, or hostile) that
sent 50 MB résumés back to back stopped every client of the LB for half
a second each.  So an LB's decoder hands a résumé on undecoded
(``decoder.ResumeFrame``), and a ``ResumeIntake`` decides:

- a résumé over ``limit`` bytes (``frames.RESUME_LIMIT``, 4 MiB) is
  refused: the decoder skipped it as its bytes came, unread;
- one decoded to more than ``classes`` classes
  (``frames.RESUME_CLASSES``, 100,000) is refused;
- after one is decoded, the next waits as long as decoding at ``rate``
  bytes a second (``frames.RESUME_RATE``, 1 MiB) would take for it:
  those that come sooner are held, undecoded, the newest replacing the
  one before, and taken when that time is over (``due``), so that a
  worker costs the LB some 3-30 ms of decoding a second at most, and the
  LB still ends with its newest skills.  A résumé of a few KB (a site of
  tens of classes) waits a few ms: the LB takes every one a worker
  sends; one of 4 MiB, four seconds.

A refusal is a ``ResumeRefused`` event, for the LB to log; the
connection stays up, since a worker of a release before these bounds
sends what its own allow (up to ``frames.MAX_RESUME``, past which the
protocol is broken and the connection dropped), and an honest worker
cuts its résumé to fit (``worker/resume.py``).  A résumé refused
leaves the worker's skills as they were.

A held résumé is taken when the protocol next looks
(``protocol.Connection.next_event``): the connection's reader looks
again at ``due_at`` (``connection._wait_readable``), whether
the worker sent anything more or not.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Union

from mypy_extensions import mypyc_attr

from zc_lb.wire.decoder import ResumeFrame, decode_resume
from zc_lb.wire.frames import RESUME_CLASSES, RESUME_LIMIT, RESUME_RATE, Resume


@mypyc_attr(native_class=False)
@dataclass(frozen=True)
class ResumeRefused:
    """A résumé the LB did not take: ``size`` bytes, of ``classes``
    classes (None: skipped undecoded, over the byte limit), and why."""

    size: int
    classes: Optional[int]
    reason: str


class ResumeIntake:
    """The bounds of one connection's résumés (the module's docstring);
    ``clock`` is a monotonic one, in seconds."""

    def __init__(self, limit: int = RESUME_LIMIT, classes: int = RESUME_CLASSES,
                 rate: float = RESUME_RATE,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self.classes = classes
        self.rate = rate
        self.clock = clock
        self.held: Optional[ResumeFrame] = None  # the newest résumé waiting its turn
        self.replaced = 0  # résumés held then replaced by a newer, all told
        self._next: Optional[float] = None  # when the next may be decoded (None: at once)

    def offer(self, frame: ResumeFrame) -> Union[Resume, ResumeRefused, None]:
        """A résumé that came: the event it makes now, or None if it is
        held for later (``due``)."""
        if frame.skipped or frame.size > self.limit:
            return ResumeRefused(frame.size, None, "over the %d bytes an LB takes" % self.limit)
        now = self.clock()
        if self._next is not None and now < self._next:
            if self.held is not None:
                self.replaced += 1
            self.held = frame
            return None
        return self._take(frame, now)

    @property
    def due_at(self) -> Optional[float]:
        """When the held résumé may be taken (None: none is held)."""
        if self.held is None:
            return None
        return self._next

    def due(self) -> Union[Resume, ResumeRefused, None]:
        """The held résumé's event, once its time has come; else None."""
        frame = self.held
        if frame is None:
            return None
        now = self.clock()
        if self._next is not None and now < self._next:
            return None
        self.held = None
        return self._take(frame, now)

    def _take(self, frame: ResumeFrame, now: float) -> Union[Resume, ResumeRefused]:
        self._next = now + frame.size / self.rate
        resume = decode_resume(frame.payload())
        if len(resume.skills) > self.classes:
            return ResumeRefused(frame.size, len(resume.skills),
                                 "over the %d classes an LB takes" % self.classes)
        return resume

    def __repr__(self) -> str:
        return "<ResumeIntake limit=%d classes=%d rate=%g%s>" % (
            self.limit, self.classes, self.rate, " held" if self.held else "")
