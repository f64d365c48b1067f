"""Worker-side skill accounting: the résumé a worker sends to every LB.

Theory of operation
-------------------

For each request class a worker keeps a decayed count of requests and a
decayed sum of the seconds spent serving them.  Its score for the class is
``count / seconds``: requests per second while serving that class, which
is what a balancer wants to compare.

Decay is ``1 - 1/history`` per request of *any* class, so a class that
stops arriving fades relative to the others.  It is applied lazily: every
request bumps a generation number, and a class is decayed by
``decay ** (generation - its last generation)`` only when it is next
touched.  Since count and seconds decay together, the score of an idle
class does not change while it is idle; what changes is how little a new
sample must outweigh it.

Every ``history`` requests the worker prunes classes unseen for
``max_skill_age`` requests (default ``10 * history``), and the least
requested past ``max_classes`` (10,000), and publishes its
résumé: ``record`` returns it, and the caller pushes it to every LB and
writes it to the résumé file, atomically, so skills survive a restart.
A résumé stays within what an LB takes (``frames.RESUME_LIMIT`` bytes,
``frames.RESUME_CLASSES`` classes, which bounds ``max_classes``): past
it, the most requested classes that fit go, and the log says so once.

The résumé file is JSON: ``{"zc_lb_resume": 2, "reset_skills": TOKEN,
"skills": {class: score}}``, TOKEN being the last ``reset_skills``
value the worker saw in ZooKeeper (null without ZooKeeper), so that a
worker stopped while an operator reset every skill forgets its own at
its next start.  Format 1, the skills alone as one object, is still
read (its token unknown); a release that knows only format 1 moves a
format 2 file aside as corrupt, saying so, and starts without skills.

Weak spot: a worker serving requests concurrently counts wall-clock time
per request, so its scores fall when it is busy.  That is the intent: a
loaded worker looks less attractive.
"""

from __future__ import annotations

import heapq
import logging
import math
import fcntl
import os
from typing import Dict, Final, List, Mapping, NamedTuple, Optional

import orjson

from zc_lb.errors import ConfigurationError, CorruptResumeFile
from zc_lb.wire.frames import MAX_RESUME, RESUME_LIMIT
from zc_lb.settings import WORKER_SETTINGS, check

log = logging.getLogger(__name__)

DEFAULT_HISTORY = WORKER_SETTINGS["history"].default
MIN_ELAPSED = 1e-6
# What a résumé may encode to: an LB drops a bigger one (wire/intake.py),
# so a worker must never send one.
RESUME_BYTES = RESUME_LIMIT - 4096
# Classes a worker keeps skills in: past this, the least requested go.  A
# worker of a real site serves hundreds, a flood of Host names sent once
# would make it a hundred thousand (``max_skill_age``), and each LB takes
# some 3 ms per thousand classes of every résumé, its event loop stopped.
MAX_CLASSES = WORKER_SETTINGS["max_classes"].default
FORMAT: Final = 2  # the résumé file's (the module's docstring)
# What a résumé file may hold: a résumé (RESUME_BYTES, written compact)
# and a reset_skills token (a ZooKeeper node's value, 1 MiB at most).
# A bigger file is none of ours, and is not read into memory.
MAX_FILE: Final = MAX_RESUME + 2 * 1024 * 1024


class _Skill:
    __slots__ = ("count", "seconds", "generation")

    def __init__(self, count: float, seconds: float, generation: int) -> None:
        self.count = count
        self.seconds = seconds
        self.generation = generation


class Skills:
    """Decayed per-class rates of one worker."""

    def __init__(
        self,
        history: int = DEFAULT_HISTORY,
        max_skill_age: Optional[int] = None,
        resume: Optional[Mapping[str, float]] = None,
        max_classes: int = MAX_CLASSES,
    ) -> None:
        self._skills: Dict[str, _Skill] = {}
        self.generation = 0
        self.cut = 0  # résumés cut short to fit what an LB takes (logged once)
        self.configure(history, max_skill_age, max_classes)
        if resume:
            for rclass, score in resume.items():
                score = float(score)
                if score > 0:
                    self._skills[str(rclass)] = _Skill(1.0, 1.0 / score, 0)

    def configure(self, history: int, max_skill_age: Optional[int] = None,
                  max_classes: int = MAX_CLASSES) -> None:
        """Change ``history``, ``max_skill_age`` and ``max_classes`` (live
        settings; fewer classes are pruned at the next résumé); a
        ``max_skill_age`` of None is 10 x ``history``."""
        history = check(WORKER_SETTINGS, "history", history)
        max_skill_age = check(WORKER_SETTINGS, "max_skill_age", max_skill_age)
        self.max_classes = check(WORKER_SETTINGS, "max_classes", max_classes)
        # Past this many classes, a new one prunes at once (a client sending
        # a new Host with every request): the slack keeps that amortised.
        self.prune_at = self.max_classes + max(self.max_classes // 10, 16)
        self.history = history
        self.max_skill_age = 10 * history if max_skill_age is None else max_skill_age
        self.decay = 1.0 - 1.0 / history

    def record(self, rclass: str, elapsed: float) -> Optional[Dict[str, float]]:
        """Count one request of ``rclass`` that took ``elapsed`` seconds.

        Returns the new résumé when it is time to publish it, else None.
        """
        self.generation += 1
        generation = self.generation
        skill = self._skills.get(rclass)
        elapsed = max(elapsed, MIN_ELAPSED)
        if skill is None:
            self._skills[rclass] = _Skill(1.0, elapsed, generation)
            if len(self._skills) > self.prune_at:
                self.prune()
        else:
            factor = self.decay ** (generation - skill.generation)
            skill.count = skill.count * factor + 1.0
            skill.seconds = skill.seconds * factor + elapsed
            skill.generation = generation
        if generation % self.history == 0:
            self.prune()
            return self.resume()
        return None

    def prune(self) -> List[str]:
        """Drop classes unseen for ``max_skill_age`` requests, and past
        ``max_classes`` the least requested (decayed); return them."""
        skills = self._skills
        oldest = self.generation - self.max_skill_age
        stale = [c for c, s in skills.items() if s.generation < oldest]
        excess = len(skills) - len(stale) - self.max_classes
        for rclass in stale:
            del skills[rclass]
        if excess > 0:
            least = heapq.nsmallest(excess, skills, key=self._requests)
            for rclass in least:
                del skills[rclass]
            stale.extend(least)
        return stale

    def _requests(self, rclass: str) -> float:
        """The class's requests, decayed to now: what pruning and a
        résumé cut short keep the most of."""
        skill = self._skills[rclass]
        return skill.count * self.decay ** (self.generation - skill.generation)

    def resume(self, max_bytes: int = RESUME_BYTES) -> Dict[str, float]:
        """The résumé: class -> requests per second, in at most
        ``max_bytes`` of JSON.  Over that (classes by the hundred thousand
        with long names: a client sending a new Host with every request),
        it keeps the classes with the most requests, decayed, that fit,
        and says so the first time: an LB would drop the whole, every
        time."""
        skills = self._skills
        classes = (heapq.nlargest(self.max_classes, skills, key=self._requests)
                   if len(skills) > self.max_classes else skills)  # (between prunes)
        resume = {rclass: skills[rclass].count / skills[rclass].seconds for rclass in classes}
        size = len(orjson.dumps(resume))
        if size <= max_bytes:
            return resume
        kept: Dict[str, float] = {}
        used = 2  # {}
        for rclass in sorted(resume, key=self._requests, reverse=True):
            score = resume[rclass]
            entry = len(orjson.dumps(rclass)) + len(orjson.dumps(score)) + 2  # : and ,
            if used + entry <= max_bytes:
                kept[rclass] = score
                used += entry
        if not self.cut:
            log.warning("résumé of %d classes is %d bytes, over the %d an LB takes: sending "
                        "the %d most requested (said once; as many as fit from now on)",
                        len(resume), size, max_bytes, len(kept))
        self.cut += 1
        return kept

    def reset(self) -> None:
        """Forget every skill (the operator's reset_skills, after a
        classifier change): what comes next is learned afresh."""
        self._skills.clear()

    def __len__(self) -> int:
        return len(self._skills)

    def __repr__(self) -> str:
        return "<Skills classes=%d generation=%d history=%d>" % (
            len(self._skills),
            self.generation,
            self.history,
        )


def _finite_rate(score: object) -> Optional[float]:
    """``score`` as a float, if a number of requests per second a worker
    can have: positive, and it and its inverse finite; else None."""
    if not isinstance(score, (int, float)) or isinstance(score, bool):
        return None
    try:
        value = float(score)
    except OverflowError:  # an integer of hundreds of digits
        return None
    if value > 0 and math.isfinite(value) and math.isfinite(1.0 / value):
        return value
    return None


class ResumeFile(NamedTuple):
    """A résumé file's content."""

    skills: Dict[str, float]
    # The reset_skills token the worker last saw (None: not known)
    reset_token: Optional[str] = None


def _read(path: str) -> Optional[bytes]:
    """The bytes of the file at ``path``, None if there is none;
    CorruptResumeFile, unread, if it is bigger than any résumé file."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_FILE:
                raise CorruptResumeFile("résumé file %s is %d bytes, over the %d of any "
                                        "résumé" % (path, size, MAX_FILE))
            return f.read(MAX_FILE + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigurationError("cannot read résumé file %s: %s" % (path, exc))


def load_resume(path: str) -> ResumeFile:
    """Read a résumé file; a missing file is an empty résumé.

    A file that cannot be read raises ConfigurationError; one that is not
    a résumé (empty, cut short, garbled, nested past 1,024 levels, over
    MAX_FILE bytes, a score not a positive, finite number, a format newer
    than ours) raises CorruptResumeFile, naming the file; a big one is
    not read.
    """
    content = _read(path)
    if content is None:
        return ResumeFile({})
    try:
        data = orjson.loads(content)  # (nesting within 1024 levels, valid UTF-8)
    except orjson.JSONDecodeError as exc:
        raise CorruptResumeFile("résumé file %s is not JSON: %s" % (path, exc))
    if not isinstance(data, dict):
        raise CorruptResumeFile("résumé file %s is not a JSON object" % path)
    token = None
    if "zc_lb_resume" in data:
        version = data["zc_lb_resume"]
        if version != FORMAT:
            raise CorruptResumeFile("résumé file %s is of format %r; this zc-lb reads "
                                    "formats 1 and %d" % (path, version, FORMAT))
        token, data = data.get("reset_skills"), data.get("skills")
        if not isinstance(data, dict) or not isinstance(token, (str, type(None))):
            raise CorruptResumeFile("résumé file %s: no skills object, or a reset_skills "
                                    "token that is not a string" % path)
    resume = {}
    for rclass, score in data.items():
        value = _finite_rate(score)
        if value is not None:
            resume[str(rclass)] = value
        else:
            raise CorruptResumeFile(
                "résumé file %s: class %r has a bad score %r" % (path, rclass, score)
            )
    return ResumeFile(resume, token)


def save_resume(path: str, resume: Mapping[str, float],
                reset_token: Optional[str] = None) -> None:
    """Write a résumé file atomically: readers see the old file or the new
    (a symbolic link's target, the link kept), written whole to
    ``.NAME.tmp`` beside it first; its writer holds its ``ResumeLock``.
    It is compact JSON in UTF-8, as the résumé's size is measured, so that
    it stays within MAX_FILE."""
    content = orjson.dumps({"zc_lb_resume": FORMAT, "reset_skills": reset_token,
                            "skills": dict(resume)}, option=orjson.OPT_SORT_KEYS)
    path = os.path.realpath(path)  # (a link stays a link: its target is written)
    tmp = beside(path, "tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def beside(path: str, suffix: str) -> str:
    """The hidden file ``.NAME.suffix`` beside the résumé file ``path``
    (its link's target)."""
    path = os.path.realpath(path)
    return os.path.join(os.path.dirname(path), ".%s.%s" % (os.path.basename(path), suffix))


class ResumeLock:
    """A worker's hold on its résumé file, so that two workers given one
    file name do not write over each other's skills: an exclusive
    ``flock`` on ``.NAME.lock`` beside it, holding the holder's pid, for
    as long as the worker runs (the kernel lets go when it ends, however
    it ends).  The holder alone writes the file, and removes the
    temporary file a save killed half way left (``save_resume``)."""

    def __init__(self, path: str) -> None:
        self.path = beside(path, "lock")
        self._temporary = beside(path, "tmp")
        self._fd: Optional[int] = None

    def acquire(self) -> bool:
        """Whether we hold the lock, taking it if it is free; OSError if
        the lock file cannot be made (no such directory, no permission)."""
        if self._fd is not None:
            return True
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(fd, 0)
            os.write(fd, b"%d\n" % os.getpid())
        except BaseException as exc:
            os.close(fd)
            if isinstance(exc, BlockingIOError):
                return False
            raise
        self._fd = fd
        try:
            os.unlink(self._temporary)
        except OSError:  # (none; or written over at the next save)
            pass
        return True

    def holder(self) -> str:
        """The pid the lock file names, its holder's ("?" if not known)."""
        try:
            with open(self.path, encoding="ascii", errors="replace") as f:
                return f.read(32).strip() or "?"
        except OSError:
            return "?"

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # (and the flock goes with it)
            self._fd = None
