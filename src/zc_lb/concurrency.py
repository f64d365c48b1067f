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
  over, and at least ``LOCK_TURNS``;
- blocked when it waits in any other system call (a socket, a file, a
  sleep), or on a lock for longer: the application's own lock or
  condition, or the hub (a request body still arriving).  Such a wait
  may need another request to end, so it must never hold back the rest.

The pool samples its threads every ``SAMPLE`` seconds, and ``Limit``
answers with the threads to let in: ``COMPUTING`` and twice the blocked
ones.  It lets them in at once (a burst of blocked requests must not
queue the rest) and parks them slowly, following a moving average of
the blocked count (``SMOOTHING`` a sample), since a blocked thread's
request may end and the next one block again within a sample.  And
while requests wait and none has finished for ``STALL`` seconds, it
lets in one more, and one more each ``STALL`` after, until the queue is
empty: requests that compute for seconds (a report) take turns with the
short ones queued behind them rather than hold them, and a wait this
sampling misjudges cannot hold the rest for longer.

Weak spots, admitted: sampling sees a moment, not the time between, so
a thread that blocks briefly and often is seen blocked in proportion;
that is the share it needs.  A thread computing outside the
interpreter lock (a C library that releases it) counts as computing, so
such an application runs ``COMPUTING`` of them at once, however many
cores there are; it can run more workers, or more threads with
``--threads-fixed``.  Where the kernel does not say (no /proc, or a
machine whose lock system call is not in ``FUTEX``), or the interpreter
has no lock to share (a free-threaded build), every thread takes
requests, as ``--threads-fixed`` asks.  No I/O here: threads.py samples
and applies.
"""

from __future__ import annotations

from typing import Optional

COMPUTING = 2  # requests computing at once: two, so that a long one does not stop the rest
SAMPLE = 0.01  # seconds between samples of the threads
SMOOTHING = 0.1  # the moving average's weight for a new sample (some 0.1 s)
STALL = 0.5  # seconds with requests waiting and none finished: let in one more
LOCK_TURNS = 0.03  # seconds: a lock wait with CPU time since is a turn, at least
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


def blocked(call: Optional[int], futex: int, since_cpu: float, turn: float) -> bool:
    """Whether a request's thread waits outside the interpreter: in
    system call ``call`` (``futex``: a lock), ``since_cpu`` seconds after
    it last got CPU time, where a turn at the interpreter lock comes
    within ``turn`` seconds."""
    if call is None or call == RUNNING:
        return False
    if call == futex:
        return since_cpu > turn
    return True


class Limit:
    """The number of threads that take requests (``value``)."""

    def __init__(self, size: int, computing: int = COMPUTING) -> None:
        self.size = size
        self.computing = min(computing, size)
        self.value = size  # (all, until the first sample)
        self.blocked = 0.0  # the moving average of blocked threads
        self.stalls = 0  # threads let in for a stall, until no request waits

    def update(self, blocked: int, waiting: bool = False, since_finished: float = 0.0) -> int:
        """Take a sample: the count of blocked threads, whether requests
        wait for a thread, and the seconds since one last finished; the
        threads to let in."""
        self.blocked += SMOOTHING * (blocked - self.blocked)
        if not waiting:
            self.stalls = 0
        elif since_finished > STALL * (self.stalls + 1):
            self.stalls += 1
        wanted = self.computing + self.stalls + 2 * max(blocked, int(self.blocked + 0.5))
        self.value = min(self.size, wanted)
        return self.value
