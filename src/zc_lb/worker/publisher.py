"""A worker's résumé as its LBs get it (``ResumePublisher``): learnt from
every request served, sent to every LB and saved, on a schedule; and the
worker's live settings, which are all the résumé's.

Rules:

- Every served request's class and the application's seconds go into a
  ``resume.Skills`` (``record``); a failure teaches nothing and is not
  recorded.
- Every ``history`` requests the résumé is pushed to every connected LB
  and saved to the résumé file, and also ``resume_interval`` seconds
  after the last push while something was served since (so that LBs
  learn within seconds of light traffic, not after thousands of
  requests).  A new LB gets the current résumé at once (``greet``).
  A stopping worker saves what it learnt since the last (``stop``).
- The résumé file is a cache: a corrupt one is moved aside and the worker
  starts with no skills; one that cannot be saved is logged.  It is one
  worker's: another given the same file (``resume.ResumeLock``) reads
  it, says so, and saves nothing to it while the first runs.  It keeps
  the last ``reset_skills`` token seen (``reset_token``), saved as soon
  as it changes, so that a reset made while the worker was stopped is
  carried out when it starts (zookeeper/membership.py).
- Live settings (``LIVE``: ``history``, ``max_skill_age``,
  ``max_classes``, ``resume_interval``) are checked whole before any is
  applied, and each change logged.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, ClassVar, Dict, Mapping, Optional, Tuple

import gevent  # type: ignore[import-untyped]
import gevent.event  # type: ignore[import-untyped]

from zc_lb.errors import CorruptResumeFile, ZcLbError
from zc_lb.settings import WORKER_LIVE, WORKER_SETTINGS, check, log_change
from zc_lb.wire.connection import Connection
from zc_lb.worker import resume as resume_module
from zc_lb.worker.lbs import LBConnections

log = logging.getLogger(__name__)


class ResumePublisher:
    """The skills of a worker (``skills``, once started) and when they go
    to its LBs (``lbs``)."""

    LIVE: ClassVar[Tuple[str, ...]] = WORKER_LIVE  # (the settings table says which)

    def __init__(self, lbs: LBConnections,
                 history: int = resume_module.DEFAULT_HISTORY,
                 max_skill_age: Optional[int] = None,
                 max_classes: int = resume_module.MAX_CLASSES,
                 resume_interval: float = WORKER_SETTINGS["resume_interval"].default,
                 resume_file: Optional[str] = None) -> None:
        self.lbs = lbs
        self.history = history
        self.max_skill_age = max_skill_age
        self.max_classes = max_classes
        self.resume_interval = check(WORKER_SETTINGS, "resume_interval", resume_interval)
        self.resume_file = resume_file
        self.skills: Optional[resume_module.Skills] = None
        self.reset_token: Optional[str] = None  # (the résumé file's; None: not known)
        self._published_at = time.monotonic()
        self._published_generation = 0  # the skills' generation the last résumé had
        self._saved_generation = 0  # and the last one saved (or tried)
        self._timer_changed = gevent.event.Event()  # resume_interval set anew
        self._timer: Optional[gevent.Greenlet] = None
        self._lock: Optional[resume_module.ResumeLock] = None  # (with a résumé file)
        self._lock_refused = False  # another worker holds it, and we said so

    def start(self) -> None:
        """Load the résumé file, and publish on time from now on."""
        initial: Dict[str, float] = {}
        if self.resume_file:
            self._lock = resume_module.ResumeLock(self.resume_file)
            try:
                self._hold()
            except OSError as exc:  # (and at every save: see _save)
                log.error("cannot lock résumé file %s: %s", self.resume_file, exc)
            initial, self.reset_token = self._load_resume(self.resume_file)
        self.skills = resume_module.Skills(self.history, self.max_skill_age, initial,
                                           self.max_classes)
        self._timer = gevent.spawn(self._publish_on_time)

    def stop(self) -> None:
        """Publish no more, and save what was learnt since the last
        résumé (its LBs gone: the next start gets it from the file)."""
        if self._timer is not None:
            self._timer.kill()
        if self.skills is not None and self.skills.generation != self._saved_generation:
            self._save(self.skills.resume())
        if self._lock is not None:
            self._lock.release()

    @staticmethod
    def _load_resume(path: str) -> resume_module.ResumeFile:
        """The skills and token in the résumé file at ``path``.  The file is a cache:
        a corrupt one (empty, cut short, garbled) is moved aside to
        ``path.corrupt`` and the worker starts with no skills, rather than
        not at all (a unit that does not restart after exit status 2
        would stay down).  One that cannot be read is a configuration
        error, as it could not be written either."""
        try:
            return resume_module.load_resume(path)
        except CorruptResumeFile as exc:
            aside = os.path.realpath(path) + ".corrupt"  # (a link's target's, the link kept)
            try:
                os.replace(os.path.realpath(path), aside)
            except OSError as move:
                log.error("%s; starting with no skills (cannot move it aside: %s)", exc, move)
            else:
                log.error("%s; moved it to %s, starting with no skills", exc, aside)
            return resume_module.ResumeFile({})

    def resume(self) -> Dict[str, float]:
        """The résumé now (none before ``start()``)."""
        return self.skills.resume() if self.skills else {}

    def record(self, rclass: str, elapsed: float) -> None:
        """A request of class ``rclass`` was served in ``elapsed`` seconds
        of the application's: into the skills, and, every ``history``
        requests, the résumé out."""
        assert self.skills is not None
        new = self.skills.record(rclass, elapsed)
        if new is not None:
            self.publish(new)

    def greet(self, connection: Connection) -> None:
        """A new LB gets the résumé at once."""
        assert self.skills is not None
        try:
            connection.send_resume(self.skills.resume())
        except ZcLbError:
            pass

    def publish(self, skills: Optional[Dict[str, float]] = None) -> None:
        """Send the résumé to every LB and save it."""
        assert self.skills is not None
        skills = self.skills.resume() if skills is None else skills
        self._published_at = time.monotonic()
        self._published_generation = self.skills.generation
        self.lbs.send_resume(skills)
        self._save(skills)

    def _save(self, skills: Dict[str, float]) -> None:
        self._saved_generation = self.skills.generation if self.skills else 0
        if self.resume_file:
            try:
                if self._hold():
                    resume_module.save_resume(self.resume_file, skills, self.reset_token)
            except OSError as exc:
                log.error("cannot save résumé to %s: %s", self.resume_file, exc)

    def _hold(self) -> bool:
        """Whether this worker holds its résumé file's lock, taking it if
        it is free; saying so, once, when another worker holds it, and
        when it is ours again.  OSError if it cannot be made."""
        assert self._lock is not None
        if self._lock.acquire():
            if self._lock_refused:
                self._lock_refused = False
                log.warning("résumé file %s is free: this worker saves its skills to it",
                            self.resume_file)
            return True
        if not self._lock_refused:
            self._lock_refused = True
            log.error("résumé file %s is in use by another worker (pid %s): this worker "
                      "saves its skills to it only once it is free; give each worker its "
                      "own --resume-file", self.resume_file, self._lock.holder())
        return False

    def reset(self, token: Optional[str] = None) -> None:
        """Forget every skill and tell the LBs (an operator's reset, by
        the ``reset_skills`` value ``token``)."""
        if token is not None:
            self.reset_token = token
        if self.skills is not None:
            self.skills.reset()
            self.publish()

    def seen_reset_token(self, token: str) -> None:
        """ZooKeeper's ``reset_skills`` value, not a reset (the first seen):
        kept in the résumé file, so that a new one seen at a later start
        is known as new."""
        if token != self.reset_token:
            self.reset_token = token
            if self.skills is not None:
                self._save(self.skills.resume())

    def settings(self) -> Dict[str, Any]:
        """The live settings' values now, by name."""
        return {name: getattr(self, name) for name in self.LIVE}

    def configure(self, changes: Mapping[str, Any], source: str = "") -> None:
        """Apply live settings from any source (the command line's file
        read again, ZooKeeper): those of ``changes`` named in ``LIVE``,
        each checked against the settings table first (ConfigurationError,
        and nothing changed, if one is bad), and each change logged as
        "name old -> new (source)".  A ``max_skill_age`` of None is its
        default, 10 x ``history``."""
        checked = {name: check(WORKER_SETTINGS, name, changes[name])
                   for name in self.LIVE if name in changes}
        if self.skills is not None:
            merged = self.settings()
            merged.update(checked)
            self.skills.configure(merged["history"], merged["max_skill_age"],
                                  merged["max_classes"])
        for name, value in checked.items():
            old = getattr(self, name)
            if value != old:
                log_change(name, old, value, source)
                setattr(self, name, value)
        self._timer_changed.set()

    def _publish_on_time(self) -> None:
        """Send the résumé ``resume_interval`` seconds after the last one
        went out, if something was served since; else look again an
        interval later.  (0: only every ``history`` requests.)"""
        changed = self._timer_changed
        while True:
            interval = self.resume_interval
            due = self._published_at + interval - time.monotonic()
            if not interval or due > 0:
                changed.wait(due if interval else None)
                changed.clear()
                continue
            assert self.skills is not None
            if self.skills.generation != self._published_generation:
                self.publish()
            else:
                self._published_at = time.monotonic()
