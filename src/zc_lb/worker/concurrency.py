"""How many requests a thread-mode worker runs at once.

Theory of operation.  A worker's threads wait in parallel but compute
one at a time: the interpreter lock lets one run Python.  Requests that
mostly wait (on a database, on files) need many threads to overlap
their waits.  Requests that mostly compute gain nothing from many
threads and lose by them: each request goes to a thread that sleeps,
which the kernel must wake and which must then win the interpreter lock
from the others, so the lock idles between requests.  A thread that
finishes a request and finds the next one queued takes it without
either.  Measured with an application spending 1 ms of CPU a request,
two workers, ``wrk -c20``, five seconds each, taking turns: 16 threads
taking requests served 1,283-1,329 a second with a fifth of the two
cores idle, 2 served 1,390-1,471 with a twelfth idle.  An application
that spends 5 ms computing and 50 ms waiting needs the opposite: 16
served 337 a second, 4 served 134.

So the number is observed, not configured: ``--threads`` is the most,
and the pool lets in ``COMPUTING`` (2) threads for requests that
compute, and two for each request blocked outside the interpreter, as
a greenlet-mode worker runs another request when one blocks.  Two, not
one: a request let in is about as likely to block as those running, and
blocks only after it has computed a little (a framework's routing, a
query built), so one for one kept requests that would only have waited
on I/O queued behind those that compute.  Measured with a Flask
application, half its requests spending about 1 ms of CPU and half
waiting 20 ms on a "database", ``wrk -c40``: one for one served 1,690-
1,759 a second against all 16 threads' 1,929-1,951; two for one
1,899-1,913 against 1,702-1,935 (taking turns).

The kernel says, for each thread, whether it is in a system call and
which (``/proc/thread-self/syscall``).  A request's thread is:

- computing when it runs, or waits on a lock (a futex) while it got CPU
  time lately: it takes turns at the interpreter lock, which comes round
  within a switch interval (5 ms) for each thread that wants it, twice
  over, and at least ``LOCK_TURNS``; while none of the request threads
  runs, nothing holds the interpreter lock for long, and a lock wait
  with no CPU time for ``QUICK_TURN`` (two samples) is no turn;
- blocked when it waits in any other system call (a socket, a file, a
  sleep): outside the interpreter, on something outside the process;
- queued when it waits on a lock for longer while another request's
  thread works: behind the application's own lock, its pool of database
  connections, its cache's lock.  Such a thread does nothing the
  application could not do later; let in, it only waits inside the
  application, where the worker cannot tell its wait from work, and its
  request's time, which the worker reports as the application's (the
  résumé, and what a key's cached data buys: ``routing/locality.py``), would
  include the requests ahead of it.  So a queued thread is the sign
  that the application serves fewer requests at once than the worker
  let in.  A lock wait while no other request's thread works cannot be
  a wait behind them: it is a wait on something the process's other
  threads do for it (a database client's I/O thread), and counts as
  blocked.

The pool samples its threads every ``SAMPLE`` seconds, and ``Limit``
answers with the threads to let in: ``COMPUTING`` and twice the blocked
ones, and never more than the application's *ceiling*: the requests it
was last seen to serve at once.  It lets them in at once (a burst of
blocked requests must not queue the rest) and parks them slowly,
following a moving average of the blocked count (``SMOOTHING`` a
sample), since a blocked thread's request may end and the next one
block again within a sample.  When threads are seen queued, the ceiling
falls to the threads working beside them, at once; while requests wait
for a thread and none is seen queued, it rises every ``PROBE`` samples,
so an application whose bound grows (a pool that is no longer shared)
is found again, at the cost of a request's wait now and then.  It rises
by one, but doubles while under the ceiling it last fell from: a
moment's hold-up that queued every thread behind one (a database's
failover, a reconnect under a lock) brings the ceiling down to that
one, and at one a second an application that overlaps 16 waits would
run below its bound for 15 s after a 2 s hold-up; doubling, 4 s.
A hold-up seen over many samples is one fall: the ceiling it fell from
is the one before its first sample.  A thread in one lock wait for
``HELD_AFTER`` seconds past its turns is *held*: no queue behind the others
(each of their requests would have gone through the application's lock
by then, a thousand times over), but a deadlock, or a wait on what
never comes.  It holds its thread, as a call hung on a socket does, and
no more: it is let in on top of the rest and neither brings the ceiling
down nor counts among those working, so that two hung threads do not
leave one thread to serve every request while they hang (they did: the
ceiling fell to the one working beside them, and stayed there).  Seen
queued for ``HELD_AFTER`` before they are held, they brought the
ceiling down meanwhile: once held, it goes back to where it fell from.
An application that never queues its threads has no ceiling.  And while
requests wait and none has finished for ``STALL`` seconds, it lets in
one more, and one more each ``STALL`` after, past the ceiling too, for
as long as the calls that held the others run: requests that compute
for seconds (a report) take turns with the short ones queued behind
them rather than hold them, and a wait this sampling misjudges cannot
hold the rest for longer.  A stall ends with the calls that made it (a
stall lasts at most as many threads as calls have run for ``STALL``),
not when the queue is empty: under steady load the queue never is, and
the threads let in past the ceiling for one slow request would queue
inside an application that serializes for as long as the load lasts.

What the pool's threads queue on is also measured: each sample that
finds a request's thread queued adds the time since the last sample to
that request's queued time, which the worker takes off the request's
time (``Threads.queued``).  It is what the ceiling has not yet kept out:
the first requests before the ceiling is found, and the probes.

Weak spots, admitted: sampling sees a moment, not the time between, so
a thread that blocks briefly and often is seen blocked in proportion;
that is the share it needs.  A lock wait shorter than a turn at the
interpreter lock is not seen, so a short queue inside the application
still counts in a request's time.  A thread computing outside the
interpreter lock (a C library that releases it) counts as computing, so
such an application runs ``COMPUTING`` of them at once, however many
cores there are; it can run more workers, or more threads with
``--threads-fixed``.  Where the kernel does not say (no /proc, or a
machine whose lock system call is not in ``FUTEX``), or the interpreter
has no lock to share (a free-threaded build), every thread takes
requests, as ``--threads-fixed`` asks.  No I/O here: worker/threads.py samples
and applies.
"""

from __future__ import annotations

from typing import Optional

COMPUTING = 2  # requests computing at once: two, so that a long one does not stop the rest
SAMPLE = 0.01  # seconds between samples of the threads
SMOOTHING = 0.1  # the moving average's weight for a new sample (some 0.1 s)
STALL = 0.5  # seconds with requests waiting and none finished: let in one more
LOCK_TURNS = 0.03  # seconds: a lock wait with CPU time since is a turn, at least
QUICK_TURN = 0.015  # seconds: while no thread computes, a lock wait is no turn past this
PROBE = 100  # samples (a second) between rises of the ceiling while requests wait
HELD_AFTER = 1.0  # seconds a lock wait lasts past its turns before it is a hung thread's
# The lock wait's system call number, by machine (os.uname().machine).
FUTEX = {"x86_64": 202, "aarch64": 98, "arm64": 98, "riscv64": 98,
         "ppc64le": 221, "ppc64": 221, "s390x": 238}

RUNNING = -1  # (a thread in no system call)


def syscall(text: bytes) -> Optional[int]:
    """The system call /proc/.../syscall says a thread is in: RUNNING,
    a number, or None if the kernel does not say."""
    token = text.split(b" ", 1)[0].strip()
    if token == b"running":
        return RUNNING
    try:
        return int(token)
    except ValueError:
        return None


def turns(threads: int, switch_interval: float) -> float:
    """The longest a thread waits for its turn at the interpreter lock
    when ``threads`` want it."""
    return max(LOCK_TURNS, 2 * switch_interval * threads)


COMPUTES, BLOCKED, QUEUED, HELD = 0, 1, 2, 3  # a busy thread's state (``state``)


def state(call: Optional[int], futex: int, since_cpu: float, turn: float) -> int:
    """What a request's thread does, in system call ``call`` (``futex``:
    a lock), ``since_cpu`` seconds after it last got CPU time, where a
    turn at the interpreter lock comes within ``turn`` seconds: COMPUTES,
    BLOCKED (outside the interpreter), QUEUED (a long lock wait, which
    ``Limit`` counts as queued only beside a thread that works), or HELD
    (a lock wait ``HELD_AFTER`` seconds longer still: hung)."""
    if call is None or call == RUNNING:
        return COMPUTES
    if call == futex:
        if since_cpu <= turn:
            return COMPUTES
        return HELD if since_cpu > turn + HELD_AFTER else QUEUED
    return BLOCKED


class Limit:
    """The number of threads that take requests (``value``)."""

    def __init__(self, size: int, computing: int = COMPUTING) -> None:
        self.size = size
        self.computing = min(computing, size)
        self.value = size  # (all, until the first sample)
        self.blocked = 0.0  # the moving average of blocked threads
        self.stalls = 0  # threads let in for a stall, while the calls that made it run
        self.ceiling = size  # the requests the application was last seen to serve at once
        self.fell_from = size  # the ceiling before it last fell
        self.falling = False  # the last sample saw threads queued: a hold-up goes on
        self.calm = 0  # samples with requests waiting since the ceiling last moved
        self.held = 0  # hung threads (``HELD``), let in on top of the rest

    def update(self, blocked: int, waiting: bool = False, since_finished: float = 0.0,
               queued: int = 0, working: int = 0, stuck: int = 0, held: int = 0) -> int:
        """Take a sample: the count of blocked threads, whether requests
        wait for a thread, the seconds since one last finished, the
        threads queued on a lock beside ``working`` others (computing or
        blocked), the calls running for ``STALL`` seconds or more
        (``stuck``), and the hung threads (``held``, counted in none of
        the others); the threads to let in."""
        self.blocked += SMOOTHING * (blocked - self.blocked)
        if not waiting:
            self.stalls = 0
        elif since_finished > STALL * (self.stalls + 1) and self.stalls < self.size - 1:
            self.stalls += 1  # (one past the others is every thread: no more to let in)
        # (the calls that made a stall are over; ``stuck`` less the held ones is
        # counted apart from them, and one that ended between is no less than none)
        self.stalls = min(self.stalls, max(stuck, 0))
        self.calm += waiting
        if queued:
            if not self.falling:  # (a hold-up's first sample: where it fell from)
                self.fell_from = self.ceiling
            self.ceiling, self.calm = max(1, working), 0
        elif self.ceiling < self.size and self.calm >= PROBE:
            below = self.fell_from - self.ceiling  # (doubling back to it, then one at a time)
            self.ceiling += max(1, min(self.ceiling, below))
            self.calm = 0
        self.falling = queued > 0
        if held > self.held and not queued:
            # Threads found hung were queued before they were held: the fall
            # they made is undone (one working beside two deadlocked left one
            # request at a time until the probes had climbed back).
            self.ceiling = max(self.ceiling, self.fell_from)
        wanted = self.computing + 2 * max(blocked, int(self.blocked + 0.5))
        self.held = held
        self.value = min(self.size, min(wanted, self.ceiling) + self.stalls + held)
        return self.value
