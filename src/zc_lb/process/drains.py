"""The drains of ``zc-lb lb --processes N``: each child an LB of its own.

Theory of operation
-------------------

An operator drains a worker at the supervisor's status address, which
asks every child that serves (``Drains.drain``).  The supervisor keeps
the workers drained through it (``drained``) until they are enabled, so
that:

- a drain is held before any child is asked: a child that starts
  serving meanwhile is given it with the others (``catch_up``), as is a
  child started again after a crash, once it serves;
- a child that refuses one while others take it is asked again every
  ``DRAIN_RETRY`` seconds until it takes it (``later``): in ZooKeeper
  mode each child learns a worker on its own, and one started again
  knows no worker that was not registered then (away for maintenance,
  or named to it late); a drain no child takes fails, and is not held;
- an enable forgets the drain first, so that a drain on its way to a
  child is undone there (``drain_in``), and asks no child that has not
  taken the drain: one ``drain_in`` is giving it to (caught up, or
  asked again), or one that refused it (it does not know the worker:
  nothing to undo), held as refused at once.  One whose drain went
  unanswered (``unanswered``: it may have taken it late) is asked, and
  its refusal then means it never took it;
- the children of an action are asked at once (process/asking.py), one
  action after another (the supervisor's ``FifoLock``); a drain no child
  answered, or an enable some child did not answer and none refused, is
  ChildUnavailable (503, try again).

What is held of one child and one worker drained through the
supervisor, and what an enable of the worker does with it
(``Drains.release``):

=====================  ====================================  ======================
held in                meaning                               an enable
=====================  ====================================  ======================
``Drains.sending``     a drain on its way to the child's     leaves the child out:
                       process (``drain_in``), or refused    ``drain_in`` undoes the
                       and not yet in ``refused``            drain there if taken
``child.refused``      not taken: refused, or not answered;  forgets it; leaves the
                       asked again (``ask_again``)           child out unless it is
                                                             also ``unanswered``
``child.unanswered``   a drain went unanswered, and no       asks the child; a
                       drain was taken nor enable answered   refusal then is no error
                       since: the child may have taken it
nothing                taken (or never asked)                asks the child
=====================  ====================================  ======================

The three are apart, not one state, because they overlap: a drain
``ask_again`` sends is ``refused`` and ``sending``; one that goes
unanswered is ``unanswered`` as well, and stays so after a refusal (the
child may have taken the unanswered one); a drain no child answered is
held by none, and ``unanswered`` alone.  ``sending`` is the
supervisor's, by process, so that a drain still on its way to a process
that ended touches nothing of the one started after it.

A child here is the supervisor's ``processes.Child``: its ``index``,
``process``, whether it is ``serving``, ``refused`` and ``unanswered``
(above), which its launch clears.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import gevent  # type: ignore[import-untyped]

from zc_lb.errors import ChildUnavailable, ConfigurationError, ZcLbError
from zc_lb.process.asking import each

log = logging.getLogger(__name__)

DRAIN_RETRY = 1.0  # seconds between asks of a child to take a drain it refused

# (child, action, worker) -> the child's answer; raises ZcLbError
Ask = Callable[[Any, str, str], dict]


def ask_each(children: Sequence[Any], ask: Callable[[Any], Optional[dict]]
             ) -> Tuple[List[dict], Dict[Any, ZcLbError]]:
    """``ask`` every child that serves, all at once, whichever fails:
    their answers (but None's), and the failures by child."""
    answers, refused = [], {}
    for child, answer in each([child for child in children if child.serving], ask):
        if isinstance(answer, ZcLbError):
            refused[child] = answer
        elif answer is not None:
            answers.append(answer)
    return answers, refused


def failed(action: str, refused: Dict[Any, ZcLbError]) -> ZcLbError:
    """The error of ``action`` that ``refused`` children failed: a
    ConfigurationError (400) if any refused it, else ChildUnavailable
    (503, try again) naming those that did not answer."""
    said = "; ".join("process %d: %s" % (child.index, exc) for child, exc in refused.items())
    if not all(unanswered(exc) for exc in refused.values()):
        return ConfigurationError("%s failed in %s" % (action, said))
    return ChildUnavailable("%s failed: no answer from LB process%s %s (try again): %s" % (
        action, "es" if len(refused) > 1 else "",
        ", ".join(str(child.index) for child in refused), said))


def unanswered(exc: ZcLbError) -> bool:
    """Whether ``exc`` says that a child did not answer (it may have
    done what it was asked, late), not that it refused."""
    return not isinstance(exc, ConfigurationError)


def merged(answers: List[dict]) -> dict:
    """The children's answers as one: the last, with ``changed`` if any
    child changed something."""
    answer = dict(answers[-1]) if answers else {}
    answer.pop("done", None)
    if "changed" in answer:
        answer["changed"] = any(a.get("changed") is True for a in answers)
    return answer


class Drains:
    """The workers drained through the supervisor, given to its children;
    ``ask`` asks a child, ``stopping`` says whether the supervisor stops."""

    def __init__(self, ask: Ask, stopping: Callable[[], bool]) -> None:
        self.drained: Set[str] = set()  # drained through us, not enabled since
        # (a child's process, a worker): drains on their way to it, or
        # refused by it and not yet held in its ``refused`` (``drain_in``)
        self.sending: Set[Tuple[Any, str]] = set()
        self.ask = ask
        self.stopping = stopping

    def drain(self, worker: str, children: Sequence[Any]) -> dict:
        """Drain ``worker`` in every child that serves: the merged answer."""
        held = worker in self.drained
        self.drained.add(worker)  # (first: a child serving from now on is given it)
        answers, refused = ask_each(children, lambda child: self.ask_drain(child, worker))
        if refused and not answers:
            if not held:
                self.drained.discard(worker)
            raise failed("drain", refused)
        for child, exc in refused.items():
            self.later(child, child.process, {worker: exc})
        return merged(answers)

    def enable(self, worker: str, children: Sequence[Any]) -> dict:
        """Enable ``worker`` in every child that serves and took its drain:
        the merged answer, ``changed`` if any child had something to undo."""
        self.drained.discard(worker)
        # Which children to leave out is settled before any is asked: the
        # asks yield, and a child's retry (``ask_again``) that runs
        # meanwhile forgets the worker, no longer drained, in ``refused``.
        left_out = {child for child in children if self.release(child, worker)}

        def ask(child: Any) -> Optional[dict]:
            return None if child in left_out else self.ask_enable(child, worker)

        answers, refused = ask_each(children, ask)
        if refused:
            raise failed("enable", refused)
        answer = merged(answers)
        answer["worker"] = worker  # (also when no child was asked: nothing undone)
        answer["changed"] = any(a.get("changed") is True for a in answers)
        return answer

    def release(self, child: Any, worker: str) -> bool:
        """Forget the drain of ``worker`` held for ``child`` (the worker is
        enabled): whether the enable leaves the child out, as the module's
        table says: its drain is on its way there (``drain_in`` undoes
        it if it is taken), or the child refused it and answered (it
        does not know the worker: nothing to undo)."""
        held = worker in child.refused
        child.refused.discard(worker)
        if (child.process, worker) in self.sending:
            return True
        return held and worker not in child.unanswered

    def ask_drain(self, child: Any, worker: str) -> dict:
        """``child``'s answer to the drain of ``worker``.  One that did
        not answer may have taken it late: the worker is ``unanswered``
        there (an enable asks it) until it answers a drain or an enable."""
        process = child.process
        try:
            answer = self.ask(child, "drain", worker)
        except ZcLbError as exc:
            if unanswered(exc) and child.process is process:
                child.unanswered.add(worker)
            raise
        if child.process is process:
            child.unanswered.discard(worker)
        return answer

    def ask_enable(self, child: Any, worker: str) -> Optional[dict]:
        """``child``'s answer to the enable of ``worker``; None if a child
        whose drain went unanswered refuses it (it does not know the
        worker: it never took the drain)."""
        unsure, process = worker in child.unanswered, child.process
        try:
            answer = self.ask(child, "enable", worker)
        except ConfigurationError:
            if not unsure:
                raise
            answer = None
        if child.process is process:
            child.unanswered.discard(worker)
        return answer

    def catch_up(self, child: Any) -> None:
        """Give ``child``, which serves (again), the drains not undone."""
        refused = self.drain_in(child, sorted(self.drained))
        if refused:
            self.later(child, child.process, refused)

    def drain_in(self, child: Any, workers: List[str]) -> Dict[str, ZcLbError]:
        """Ask ``child`` to drain each of ``workers`` still drained: those it
        refused, and why.  One enabled while its drain was on its way (the
        child may have taken the enable first) is enabled there again.
        Until the child takes one, and until this returns those it
        refused (for the caller to hold, ``later``), an enable asks the
        child nothing (``sending``)."""
        refused, process = {}, child.process
        sending = {(process, worker) for worker in workers if worker in self.drained}
        self.sending |= sending
        try:
            for worker in workers:
                if worker not in self.drained:
                    continue
                try:
                    self.ask_drain(child, worker)
                except ZcLbError as exc:
                    refused[worker] = exc
                taken = worker not in refused
                if worker not in self.drained and (taken or worker in child.unanswered):
                    self.undo(child, worker)  # (taken, or perhaps taken late)
                if taken:
                    self.sending.discard((process, worker))  # (taken there)
        finally:
            self.sending -= sending
        return refused

    def undo(self, child: Any, worker: str) -> None:
        """Enable ``worker`` again in ``child``, which took its drain (or
        did not answer it) after an enable had left it out."""
        try:
            self.ask_enable(child, worker)
        except ZcLbError as exc:
            log.warning("LB process %d may have worker %s drained, though it was enabled: "
                        "%s", child.index, worker, exc)

    def later(self, child: Any, process: Any, refused: Dict[str, ZcLbError]) -> None:
        """Hold the drains ``child`` (``process``) ``refused`` that are not
        undone, at once (an enable then asks the child nothing), and have
        it asked again (``ask_again``)."""
        refused = {worker: exc for worker, exc in refused.items() if worker in self.drained}
        if child.process is not process or not refused:  # (started again: given them anew)
            return
        for worker, exc in sorted(refused.items()):
            log.warning("LB process %d does not have worker %s drained yet (%s): asking it "
                        "again every %gs", child.index, worker, exc, DRAIN_RETRY)
        if child.refused:  # (it is asked again already: for these too)
            child.refused.update(refused)
            return
        child.refused = set(refused)
        gevent.spawn(self.ask_again, child, process)

    def ask_again(self, child: Any, process: Any) -> None:
        """Ask ``child`` (``process``) every DRAIN_RETRY seconds to drain the
        workers it refused, until it takes each, the worker is enabled,
        the process ends, or the supervisor stops."""
        while child.refused:
            gevent.sleep(DRAIN_RETRY)
            if self.stopping() or child.process is not process or not child.serving:
                return
            pending = child.refused & self.drained
            refused = self.drain_in(child, sorted(pending))
            if child.process is not process:  # (what the last one refused is no news)
                return
            for worker in sorted(pending - set(refused)):
                if worker in self.drained:
                    log.info("LB process %d has worker %s drained now", child.index, worker)
            # (with those added while it asked)
            child.refused = set(refused) | (child.refused & self.drained) - pending
