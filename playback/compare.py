"""Compare balancers on the same access log: zc-lb against HAProxy 2.6.

Usage (from the repository root)::

    python playback/compare.py LOG... [--host-from-segment 1] [-w 4] [-c 16] \\
        [-n 5000] [--warmup 1000] [--json]

Theory of operation
-------------------

Three balancers, one after the other, each in front of its own fresh set
of ``-w`` cache-model processes (``playback.cacheapp``, same cache size,
miss cost, objects per request and class on every process, or on a mixed
fleet, ``--cache-sizes`` and ``--speeds``, worker i the same behind every
balancer):

``zc-lb``      ``zc-lb lb`` in front of ``zc-lb worker playback.cacheapp:app``
               processes (``--history`` requests between résumés; the
               worker, not the app, bounds what is served at once, so a
               request's wait for its turn stays out of the résumé); each
               worker serves its cache stats on a side port;
``leastconn``  HAProxy, ``balance leastconn`` (``playback/haproxy/haproxy-leastconn.cfg``),
               in front of ``python -m playback.cacheapp`` (gevent.pywsgi);
``hash``       HAProxy hashing the class (the Host header) on a consistent
               ring with ``hash-balance-factor 125`` (``playback/haproxy/haproxy-hash.cfg``),
               in front of the same.

Each balancer gets the same entries: the first ``--warmup`` entries of the
log are replayed unmeasured (caches fill, zc-lb's workers send résumés),
then the next ``-n`` entries are replayed and measured, always with ``-c``
closed-loop clients (``playback.replay``). After the measured replay the
workers' stats give the overlap of their caches. A row of the table is
that replay's throughput, p50 and p99 latency, database loads per request
(cache misses per response), overlap and errors (requests without a
response, plus 5xx responses: the cache app itself never answers 5xx), and
each one's throughput and loads as a ratio to zc-lb's. The LB's CPU time
per request (utime + stime from /proc) is reported too, and the share of
the machine's CPU time the hypervisor stole during the measured replay
(``steal`` in /proc/stat): on a shared VM a few percent more steal in
one balancer's turn than in another's moves throughput by more than the
balancers differ, so compare rows taken at like steal.  Under the table,
the share of the replay each worker spent loading (its loads times the
miss cost): a balancer whose workers all load most of the time is bound
by its loads; one whose workers load a fraction of it is bound by
something else (latency in the closed loop, CPU, one busy worker).
Then each worker's requests over a fair share and, for zc-lb, how busy
each worker was, from its LBs' status sampled during the replay
(``playback.backlogs``): how often a worker sat idle while another had
requests waiting, and each one's time with a request in flight.

With ``--lbs N``, each balancer runs N times side by side and the
replay's clients take turns between them: N ``zc-lb lb --zookeeper``
processes that find the workers (registered with ``zc-lb worker
--zookeeper``) and each other in a ZooKeeper tree of their own, as a site
with several LBs runs them, so that each hears where the others sent
keys; N HAProxy processes of the same config, each balancing alone.  The
ZooKeeper is ``--zookeeper``'s, or one the tool starts in the run
directory.

Every process's output goes to a file in the run directory (``--log-dir``,
default a new ``/tmp/zc-lb-compare-*``), which is kept, so a failure can be
traced to a log line; the ZODB databases written there are removed once
used. Processes are stopped (SIGTERM, then SIGKILL) in
``finally`` blocks, by the handles we started them with.

Weak spots: everything shares this machine's cores, so a CPU-bound replay
client or worker flattens the differences (choose a miss cost that
dominates); ports are chosen free and then bound by the child, a small
race; HAProxy counts connections, zc-lb requests, toward their limits.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and not __package__:  # run as playback/compare.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import playback  # noqa: F401  (the package of the relative imports below)
    __package__ = "playback"

import argparse
import contextlib
import dataclasses
import itertools
import json
import shutil
import signal
import string
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

from .backlogs import BacklogSampler
from .cacheapp import ENV_PREFIX, PAGE_KEYS, STATS_PATH
from .logparse import (DEFAULT_HOST_SUFFIX, FORMATS, check_host_depth, positive_int,
                       read_entries)
from .replay import replay
from zc_lb.testing import (ProcessError, cpu_times, cpu_used, free_port, stop_process,
                            wait_for_port, with_children)

# The cache model's module, as this package is named: zc_lb.playback when
# installed, playback when run in a checkout.
CACHEAPP = __package__ + ".cacheapp"
ZODBAPP = __package__ + ".zodbapp"
APPS = ("cache", "zodb")

ROOT = Path(__file__).resolve().parents[1]
HAPROXY = Path(__file__).resolve().parent / "haproxy"  # package data: found when installed too
BALANCERS = ("zc-lb", "leastconn", "hash")
ZC_LB_POLICIES = ("affinity", "published", "classless")
HAPROXY_CONFIGS = {"leastconn": HAPROXY / "haproxy-leastconn.cfg",
                   "hash": HAPROXY / "haproxy-hash.cfg"}
START_TIMEOUT = 30.0


class CompareError(ProcessError):
    """A balancer or a process could not be set up; the message says why."""


class Database(NamedTuple):
    """--app zodb: a balancer's ZEO server."""

    address: str
    pid: int


@dataclasses.dataclass
class Target:
    """A running balancer (``--lbs`` of them): where to send requests,
    where to read stats."""

    name: str
    urls: List[str]  # one per LB; the replay's clients take turns between them
    stats_urls: List[str]
    lb_pids: List[int]
    statuses: List[str] = dataclasses.field(default_factory=list)  # zc-lb's status addresses
    database: Optional[Database] = None  # --app zodb: the ZEO server
    # the application's servers (zc-lb's workers, or those behind
    # HAProxy): whose CPU time the run reports, with the LBs' and the
    # database's
    server_pids: List[int] = dataclasses.field(default_factory=list)
    # the cache app: each worker's name (X-Worker) -> the seconds a load takes it
    miss_costs: Dict[str, float] = dataclasses.field(default_factory=dict)


# -- processes ------------------------------------------------------------


def command(process: subprocess.Popen) -> str:
    """The start of the process's command line, to name it in messages."""
    args = process.args if isinstance(process.args, (list, tuple)) else [process.args]
    return " ".join(str(arg) for arg in args[:5])


@contextlib.contextmanager
def spawned(argv: List[str], log: Path, env: Optional[Dict[str, str]] = None,
            stdout=None) -> Iterator[subprocess.Popen]:
    """A child process, its stderr (and stdout unless piped) in ``log``; stopped on exit."""
    with open(log, "w") as stream:
        process = subprocess.Popen(argv, stdout=stream if stdout is None else stdout,
                                   stderr=stream, env=child_env(env), cwd=ROOT, text=True)
    try:
        yield process
    finally:
        stop_process(process)


def child_env(extra: Optional[Dict[str, str]]) -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(extra or {})
    return env


def read_ready_line(process: subprocess.Popen, prefix: str, log: Path,
                    timeout: float = START_TIMEOUT) -> str:
    """The HOST:PORT at the end of the child's first stdout line, which must start with ``prefix``."""
    import select

    assert process.stdout is not None
    readable, _, _ = select.select([process.stdout], [], [], timeout)
    line = process.stdout.readline() if readable else ""
    if not line.startswith(prefix):
        raise CompareError("%s did not start (first line %r; see %s)" % (
            command(process), line, log))
    return line.split()[-1]


# -- the cache app's settings, identical everywhere -------------------------


# compare's option (its dest) -> the cache app's setting of the same meaning
APP_SETTINGS = {name: name for name in ("cache_size", "miss_cost", "objects_per_request",
                                        "objects_per_class", "skew", "page_objects",
                                        "page_key")}
APP_SETTINGS["worker_concurrency"] = "concurrency"


def cache_size_of(args: argparse.Namespace, number: int) -> int:
    """Objects worker ``number`` (from 1) caches: ``--cache-size``, or on a
    mixed fleet entry ``number - 1`` of ``--cache-sizes``, counted round
    (as the simulator's lists)."""
    sizes = args.cache_sizes
    return sizes[(number - 1) % len(sizes)] if sizes else args.cache_size


def miss_cost_of(args: argparse.Namespace, number: int) -> float:
    """Seconds a load takes worker ``number``: ``--miss-cost`` over its
    entry of ``--speeds``, counted round."""
    speeds = args.speeds
    return args.miss_cost / speeds[(number - 1) % len(speeds)] if speeds else args.miss_cost


def worker_settings(args: argparse.Namespace, number: int) -> Dict[str, object]:
    """Worker ``number``'s cache app settings, by compare's option names:
    the same for every worker but on a mixed fleet.  Worker ``number``
    gets the same settings behind every balancer."""
    settings = {name: getattr(args, name) for name in APP_SETTINGS}
    settings.update(cache_size=cache_size_of(args, number), miss_cost=miss_cost_of(args, number))
    return settings


def app_env(args: argparse.Namespace, number: int = 1) -> Dict[str, str]:
    """Worker ``number``'s cache app settings as ZC_LB_CACHEAPP_* variables."""
    settings = worker_settings(args, number)
    return {ENV_PREFIX + setting.upper(): str(settings[name])
            for name, setting in APP_SETTINGS.items()}


def app_bound(args: argparse.Namespace) -> int:
    """Requests the app serves at once: ``--worker-concurrency`` for the
    cache app, 0 (no bound the tool knows) for the ZODB app, whose
    threads wait on its connections and the database."""
    return args.worker_concurrency if args.app == "cache" else 0


def app_argv(args: argparse.Namespace, number: int = 1) -> List[str]:
    """The same settings as ``python -m playback.cacheapp`` options."""
    settings = worker_settings(args, number)
    argv: List[str] = []
    for name, setting in APP_SETTINGS.items():
        argv += ["--" + setting.replace("_", "-"), str(settings[name])]
    return argv


def miss_costs(args: argparse.Namespace, names: Sequence[str]) -> Dict[str, float]:
    """Worker name (``X-Worker``, the i-th of ``names`` worker i) -> the
    seconds its loads take."""
    return {worker: miss_cost_of(args, number) for number, worker in enumerate(names, 1)}


# -- the balancers ----------------------------------------------------------


@contextlib.contextmanager
def zc_lb_target(args: argparse.Namespace, run_dir: Path, name: str = "zc-lb"
                 ) -> Iterator[Target]:
    """zc-lb in front of ``args.workers`` zc-lb workers hosting the cache app;
    ``zc-lb:POLICY`` runs the LB with ``--policy POLICY``."""
    zc_lb = [sys.executable, "-m", "zc_lb.cli", "--log-level", args.zc_lb_log_level]
    with contextlib.ExitStack() as stack:
        workers, stats_urls, server_pids = [], [], []
        database = (stack.enter_context(zeo_server(args, run_dir, name))
                    if args.app == "zodb" else None)
        zeo = database.address if database else None
        # Several LBs find the workers, and each other, in ZooKeeper: a
        # tree of this balancer's own, so that nothing of a previous one
        # is left in it.
        site = stack.enter_context(zookeeper_site(args.zookeeper)) if args.lbs > 1 else None
        register = ["--zookeeper", site, "--path", SITE_PATH + "/workers"] if site else []
        for i in range(1, args.workers + 1):
            if zeo is not None:
                stats = None
                env = zodb_env(args, zeo, "zw%d" % i)
                argv = zc_lb + ["worker", ZODBAPP + ":app", "--listen", "127.0.0.1:0",
                                "--history", str(args.history)] + register
                argv += args.zc_lb_worker_option
                log = run_dir / ("%s-worker%d.log" % (name.replace(":", "-"), i))
                process = stack.enter_context(spawned(argv, log, env, stdout=subprocess.PIPE))
                workers.append(read_ready_line(process, "zc-lb worker listening on ", log))
                server_pids.append(process.pid)
                continue
            stats = "127.0.0.1:%d" % free_port()
            env = dict(app_env(args, i), ZC_LB_CACHEAPP_WORKER_ID="zw%d" % i,
                       ZC_LB_CACHEAPP_STATS_LISTEN=stats)
            argv = zc_lb + ["worker", CACHEAPP + ":app", "--listen", "127.0.0.1:0",
                            "--history", str(args.history)] + register
            if args.zc_lb_workers == "greenlets":
                # The worker bounds what it serves at once, not the app: the
                # wait for a turn is then the worker's queue, which résumés
                # do not count.  The cache app cooperates with gevent.
                env["ZC_LB_CACHEAPP_CONCURRENCY"] = "0"
                argv += ["--greenlets", "--concurrency", str(args.worker_concurrency)]
            else:
                # As a user deploys: the default (thread-mode) worker in front
                # of an ordinary blocking app that bounds itself, so the
                # threads wait inside the app (its lock, its pool of slots).
                env["ZC_LB_CACHEAPP_BLOCKING"] = "1"
            if args.cache_signal:
                env["ZC_LB_CACHEAPP_CACHE_SIGNAL"] = "1"
            argv += args.zc_lb_worker_option
            log = run_dir / ("%s-worker%d.log" % (name.replace(":", "-"), i))
            process = stack.enter_context(spawned(argv, log, env, stdout=subprocess.PIPE))
            workers.append(read_ready_line(process, "zc-lb worker listening on ", log))
            server_pids.append(process.pid)
            wait_for_port(stats, process, START_TIMEOUT)
            stats_urls.append("http://%s%s" % (stats, STATS_PATH))
        argv = zc_lb + ["lb", "--listen", "127.0.0.1:0"] + args.zc_lb_option
        policy = name.partition(":")[2]
        if policy:
            argv += ["--policy", policy]
        if site:
            argv += ["--zookeeper", site, "--path", SITE_PATH]
        else:
            for address in workers:
                argv += ["--worker", address]
        lbs, urls, statuses = [], [], []
        for i in range(1, args.lbs + 1):
            statuses.append("127.0.0.1:%d" % free_port())
            log = run_dir / ("%s-lb%s.log" % (name.replace(":", "-"), i if args.lbs > 1 else ""))
            lbs.append(stack.enter_context(spawned(argv + ["--status", statuses[-1]], log,
                                                   stdout=subprocess.PIPE)))
            urls.append("http://" + read_ready_line(lbs[-1], "zc-lb lb listening on ", log))
        for lb, status in zip(lbs, statuses):
            wait_for_port(status, lb, START_TIMEOUT)
            wait_for_pool(status, workers, args.lbs, lb)
        yield Target(name, urls, stats_urls, [lb.pid for lb in lbs], statuses, database,
                     server_pids, miss_costs(args, ["zw%d" % i for i in range(1, args.workers + 1)]))


def wait_for_pool(status: str, workers: Sequence[str], lbs: int, lb: subprocess.Popen,
                  timeout: float = START_TIMEOUT) -> None:
    """Wait until the LB's status says every worker is connected and in the
    pool, and, for a policy that counts LBs (the affinity pool, which hears
    the others' keys), that it counts ``lbs`` (with several, found in
    ZooKeeper); the published policy balances each LB alone."""
    from zc_lb.errors import ZcLbError
    from zc_lb.status.document import fetch

    deadline = time.monotonic() + timeout
    doc: dict = {}
    while time.monotonic() < deadline and lb.poll() is None:
        with contextlib.suppress(ZcLbError):
            doc = fetch(status)
        known = doc.get("workers", {})
        if (all(known.get(w, {}).get("connected") and known[w].get("in_pool") for w in workers)
                and doc.get("pool", {}).get("lbs", lbs) == lbs):
            return
        time.sleep(0.05)
    raise CompareError("the zc-lb LB at %s did not connect to all workers, or count %d LBs: "
                       "%s" % (status, lbs, json.dumps({key: doc.get(key) for key in (
                           "workers", "pool")}, sort_keys=True)[:500]))


SITE_PATH = "/lb"  # where a balancer's LBs and workers meet, in its chroot


@contextlib.contextmanager
def zookeeper_site(hosts: str, timeout: float = START_TIMEOUT) -> Iterator[str]:
    """A new, empty chroot of the ZooKeeper at ``hosts``, with an LB's
    tree in it (``SITE_PATH``, its providers and its workers' providers);
    the hosts string to it.  Removed on exit."""
    from kazoo.client import KazooClient
    from kazoo.exceptions import KazooException
    from kazoo.handlers.threading import KazooTimeoutError

    chroot = "/zc-lb-compare/%d-%d" % (os.getpid(), next(_SITES))
    try:
        client = KazooClient(hosts)
    except ValueError as exc:
        raise CompareError("--zookeeper %r: %s" % (hosts, exc))
    try:
        client.start(timeout=timeout)
    except KazooTimeoutError as exc:
        client.close()
        raise CompareError("ZooKeeper at %s did not answer: %s" % (hosts, exc))
    try:
        for path in ("providers", "workers/providers"):
            client.ensure_path("%s%s/%s" % (chroot, SITE_PATH, path))
        yield hosts + chroot
    finally:
        with contextlib.suppress(KazooException):
            client.delete(chroot, recursive=True)
        client.stop()
        client.close()


_SITES = itertools.count(1)


@contextlib.contextmanager
def zookeeper_server(run_dir: Path) -> Iterator[str]:
    """A throwaway ZooKeeper with its data and log in ``run_dir``; its address."""
    from zc_lb.testing import ZooKeeperServer

    server = ZooKeeperServer(str(run_dir / "zookeeper"))
    server.start(timeout=START_TIMEOUT)
    try:
        yield server.address
    finally:
        server.stop()


@contextlib.contextmanager
def haproxy_target(name: str, args: argparse.Namespace, run_dir: Path) -> Iterator[Target]:
    """HAProxy with config ``name`` in front of cache apps on gevent.pywsgi."""
    with contextlib.ExitStack() as stack:
        database = (stack.enter_context(zeo_server(args, run_dir, name))
                    if args.app == "zodb" else None)
        zeo = database.address if database else None
        servers, server_pids = [], []
        for i in range(1, args.workers + 1):
            address = "127.0.0.1:%d" % free_port()
            log = run_dir / ("%s-app%d.log" % (name, i))
            if zeo is not None:  # gunicorn's threads, as a ZODB site runs them
                process = stack.enter_context(spawned(
                    [sys.executable, "-m", "gunicorn", "-k", "gthread", "--threads",
                     str(args.gunicorn_threads), "-w", "1", "-b", address,
                     ZODBAPP + ":app"], log, zodb_env(args, zeo, "%s%d" % (name[0], i))))
            else:
                process = stack.enter_context(spawned(
                    [sys.executable, "-m", CACHEAPP, "--listen", address,
                     "--worker-id", "%s%d" % (name[0], i)] + app_argv(args, i), log))
            wait_for_port(address, process, START_TIMEOUT)
            servers.append(address)
            server_pids.append(process.pid)
        listens, pids = [], []
        for i in range(1, args.lbs + 1):  # each balancing alone, as HAProxies do
            listens.append("127.0.0.1:%d" % free_port())
            each = "%s%s" % (name, i if args.lbs > 1 else "")
            cfg = run_dir / ("haproxy-%s.cfg" % each)
            cfg.write_text(haproxy_config(HAPROXY_CONFIGS[name], listens[-1], servers))
            process = stack.enter_context(spawned(
                [args.haproxy, "-f", str(cfg), "-db"], run_dir / ("haproxy-%s.log" % each)))
            wait_for_port(listens[-1], process, START_TIMEOUT)
            pids.append(process.pid)
        yield Target(name, ["http://%s" % listen for listen in listens],
                     [] if zeo else ["http://%s%s" % (s, STATS_PATH) for s in servers],
                     pids, database=database, server_pids=server_pids,
                     miss_costs=miss_costs(args, ["%s%d" % (name[0], i)
                                                  for i in range(1, args.workers + 1)]))


def haproxy_config(template: Path, listen: str, servers: Sequence[str]) -> str:
    """An HAProxy config template with $listen and $servers filled in."""
    lines = "\n".join("    server w%d %s" % (i, s) for i, s in enumerate(servers, 1))
    return string.Template(template.read_text(encoding="utf-8")).substitute(
        listen=listen, servers=lines)


# -- the ZODB case ----------------------------------------------------------


def zodb_env(args: argparse.Namespace, zeo: str, worker_id: str) -> Dict[str, str]:
    """The ZODB app's settings as ZC_LB_ZODBAPP_* variables."""
    from .zodbapp import ENV_PREFIX as ZODB_PREFIX

    env = {"ZEO": zeo, "CACHE_SIZE": str(args.zodb_cache_size),
           "ZEO_CACHE_SIZE": str(args.zeo_cache_size), "LOAD_DELAY": str(args.load_delay),
           "CACHE_SIGNAL": "1" if args.cache_signal else "0", "WORKER_ID": worker_id}
    return {ZODB_PREFIX + key: value for key, value in env.items()}


@contextlib.contextmanager
def zeo_server(args: argparse.Namespace, run_dir: Path, name: str) -> Iterator[Database]:
    """A ZEO server of its own for balancer ``name``, on a copy of the
    database ``run`` populated: every balancer starts from the same cold
    storage.  Its address and process id."""
    from .zodbapp import start_server

    filename = run_dir / ("zodb-%s.fs" % name.replace(":", "-"))
    shutil.copyfile(args.zodb_file, filename)
    address = "127.0.0.1:%d" % free_port()
    with open(run_dir / ("zeo-%s.log" % name.replace(":", "-")), "w") as log:
        process = start_server(str(filename), address, log)
    try:
        wait_for_port(address, process, START_TIMEOUT)
        yield Database(address, process.pid)
    finally:
        stop_process(process)
        remove_database(filename)


def remove_database(filename: Path) -> None:
    """Remove a FileStorage and the files beside it (its index, lock and
    temporary file): a run's databases are copies, gigabytes of them on a
    large log, where the run directory is kept for its logs."""
    for path in (filename, *(filename.with_name(filename.name + suffix)
                             for suffix in (".index", ".lock", ".tmp", ".old"))):
        try:
            path.unlink()
        except FileNotFoundError:
            pass


def start_target(name: str, args: argparse.Namespace, run_dir: Path):
    if name.partition(":")[0] == "zc-lb":
        return zc_lb_target(args, run_dir, name)
    return haproxy_target(name, args, run_dir)


# -- measuring ----------------------------------------------------------------


Clock = Optional[Tuple[int, int, int]]


def cpu_clock() -> Clock:
    """(stolen, idle, all) clock ticks of this machine's CPUs so far (idle
    with iowait), from the first line of /proc/stat; None where there is
    no such file."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal (guest time is in user)
    ticks = [int(field) for field in fields[1:9]]
    return ticks[7], ticks[3] + ticks[4], sum(ticks)


def stolen(before: Clock, after: Clock) -> Optional[float]:
    """The share of CPU time stolen between two ``cpu_clock`` readings."""
    if before is None or after is None or after[2] <= before[2]:
        return None
    return (after[0] - before[0]) / (after[2] - before[2])


def busy(before: Clock, after: Clock) -> Optional[float]:
    """The share of the machine's CPU time spent working between two
    ``cpu_clock`` readings (neither idle nor stolen): near 1, the run
    was bound by the CPUs, whatever else its balancer did."""
    if before is None or after is None or after[2] <= before[2]:
        return None
    idle, steal = after[1] - before[1], after[0] - before[0]
    return 1.0 - (idle + steal) / (after[2] - before[2])


def measure(name: str, warmup: list, entries: list, args: argparse.Namespace,
            run_dir: Path, progress=None) -> dict:
    """Start balancer ``name``, warm it up, replay ``entries``; its result row."""
    options = dict(concurrency=args.concurrency, timeout=args.timeout, top=args.top)
    with start_target(name, args, run_dir) as target:
        if warmup:
            replay(warmup, target.urls, **options)
        database = target.database
        if database is not None:
            from .zodbapp import server_loads
        loads = None if database is None else server_loads(database.address)
        # (each part with the processes it started: ``zc-lb lb --processes``'
        # children, gunicorn's worker; looked up again after, for any that
        # replaced one that ended)
        parts = {"lb": target.lb_pids, "workers": target.server_pids,
                 "database": [database.pid] if database else []}
        before = {part: cpu_times(with_children(pids)) for part, pids in parts.items()}
        clock = cpu_clock()
        with BacklogSampler(target.statuses, app_bound(args)) as backlogs:
            report = replay(entries, target.urls, stats_urls=target.stats_urls or None,
                            progress=progress, **options)
        cpu = {part: cpu_used(before[part], cpu_times(with_children(pids)))
               for part, pids in parts.items()}
        after = cpu_clock()
        steal, cpus_busy = stolen(clock, after), busy(clock, after)
        if loads is not None:  # the database's own count
            report["server_loads"] = server_loads(database.address) - loads  # type: ignore[union-attr]
        statuses = lb_statuses(target)
    row = result_row(name, report, cpu["lb"], statuses)
    row.update(cpu_row(report, cpu, database is not None))
    if "server_loads" in report and report["responses"]:
        row["loads_per_request"] = report["server_loads"] / report["responses"]
    row["steal"] = steal
    row["cpus_busy"] = cpus_busy
    if target.statuses:  # (zc-lb: its LBs' status says each worker's backlog)
        row["backlogs"] = backlogs.summary()
    # (the ZODB app's loads cost what the ZEO server takes, plus any delay)
    row["loading"] = loading(report, target.miss_costs) if args.app == "cache" else {}
    return row


def loading(report: dict, miss_costs: Dict[str, float]) -> Dict[str, float]:
    """Worker -> the share of the replay it spent loading (its loads
    times its miss cost, over the replay's duration)."""
    duration = report["duration"]
    if duration <= 0:
        return {}
    return {worker: loads * miss_costs[worker] / duration
            for worker, loads in (report.get("worker_loads") or {}).items()
            if worker in miss_costs}


def cpu_row(report: dict, cpu: Dict[str, float], database: bool) -> dict:
    """The CPU time a response took in the application's servers and, if
    there is one, the database server, in microseconds; and in those and
    the LBs together.  On a machine whose CPUs the run keeps busy, this
    sum, not the LB's part alone, bounds the throughput."""
    responses = report["responses"]
    if not responses:
        return {}
    row = {"workers_cpu_us_per_request": cpu["workers"] * 1e6 / responses,
           "database_cpu_us_per_request": cpu["database"] * 1e6 / responses if database else None}
    row["cpu_us_per_request"] = sum(cpu.values()) * 1e6 / responses
    return row


def lb_statuses(target: Target) -> List[dict]:
    """zc-lb's status documents after the run, one per LB that answered
    (none for HAProxy)."""
    from zc_lb.errors import ZcLbError
    from zc_lb.status.document import fetch

    documents = []
    for status in target.statuses:
        with contextlib.suppress(ZcLbError):
            documents.append(fetch(status))
    return documents


# The affinity pool's counts kept with each run (docs/reference/status.rst)
ROUTING_COUNTS = ("widenings", "narrowings", "widened", "spills", "bounded", "explored",
                  "locality_gain", "first_visit_gain")


def result_row(name: str, report: dict, lb_cpu: float, statuses: Sequence[dict]) -> dict:
    """The numbers of the table for one balancer, with the full report."""
    server_errors = sum(n for code, n in report["status"].items() if int(code) >= 500)
    cache = report.get("cache") or {}
    overlap = report.get("overlap") or {}
    row = {
        "balancer": name,
        "requests": report["requests"],
        "responses": report["responses"],
        "throughput": report["throughput"],
        "p50_ms": _ms(report["latency"]["p50"]),
        "p99_ms": _ms(report["latency"]["p99"]),
        "loads_per_request": cache.get("loads_per_request"),
        "overlap": overlap.get("overlap"),
        "errors": report["errors"] + server_errors,
        "lb_cpu_us_per_request": lb_cpu * 1e6 / report["responses"] if report["responses"] else None,
        "report": report,
    }
    each = [lb_counts(status) for status in statuses]
    if len(each) == 1:
        row["lb_status"] = each[0]
    elif each:  # several LBs: their counts summed, and each LB's
        row["lb_status"] = {key: sum(lb[key] or 0 for lb in each)
                            for key in ("requests", "retries", "errors")}
        row["lb_status"]["each"] = each
    return row


def lb_counts(status: dict) -> dict:
    """What one LB's status says it did: requests, retries, errors, each
    worker's skills, and what its affinity pool did (to tell runs apart)."""
    counts = {key: status.get(key) for key in ("requests", "retries", "errors")}
    counts["skills"] = {w: len(info.get("skills") or {})
                        for w, info in status.get("workers", {}).items()}
    pool = status.get("pool") or {}
    counts["routing"] = {key: pool[key] for key in ROUTING_COUNTS if key in pool}
    return counts


def _ms(seconds: Optional[float]) -> Optional[float]:
    return None if seconds is None else seconds * 1000.0


# How the worst of several runs is taken, column by column.
WORST = {"throughput": min, "p50_ms": max, "p99_ms": max, "loads_per_request": max,
         "overlap": max, "errors": max, "lb_cpu_us_per_request": max, "steal": max,
         "workers_cpu_us_per_request": max, "database_cpu_us_per_request": max,
         "cpu_us_per_request": max, "cpus_busy": max}


def worst_of(rows: List[dict]) -> dict:
    """One balancer's runs as one row: each column of ``WORST`` its worst
    over the runs, the rest (the full report, each worker's share) from
    the run that loaded most; ``runs``, every run's row."""
    if len(rows) == 1:
        return rows[0]
    worst = dict(max(rows, key=lambda row: row.get("loads_per_request") or 0.0))
    for key, pick in WORST.items():
        values = [row[key] for row in rows if row.get(key) is not None]
        worst[key] = pick(values) if values else None
    worst["runs"] = rows
    return worst


def add_ratios(rows: List[dict]) -> None:
    """Each row's throughput and loads per request as a ratio to zc-lb's."""
    base = next((r for r in rows if r["balancer"].partition(":")[0] == "zc-lb"), None)
    for row in rows:
        for key, ratio in (("throughput", "throughput_ratio"), ("loads_per_request", "loads_ratio")):
            mine, theirs = row.get(key), base.get(key) if base else None
            row[ratio] = mine / theirs if mine is not None and theirs else None


# -- reporting -----------------------------------------------------------------


COLUMNS = (  # (heading, key, format)
    ("balancer", "balancer", "%-9s"),
    ("req/s", "throughput", "%7.1f"),
    ("p50 ms", "p50_ms", "%7.1f"),
    ("p99 ms", "p99_ms", "%7.1f"),
    ("loads/req", "loads_per_request", "%9.3f"),
    ("overlap", "overlap", "%6.1f%%"),
    ("errors", "errors", "%6d"),
    ("req/s ratio", "throughput_ratio", "%.2f"),
    ("loads ratio", "loads_ratio", "%.2f"),
    ("LB CPU us/req", "lb_cpu_us_per_request", "%.0f"),
    ("steal", "steal", "%.1f%%"),
)


PERCENT = ("overlap", "steal")  # shares, shown as percentages


def format_table(rows: List[dict]) -> str:
    """One line per balancer, columns aligned, '-' for what is unknown."""
    cells = [[heading for heading, _, _ in COLUMNS]]
    for row in rows:
        line = []
        for _, key, fmt in COLUMNS:
            value = row.get(key)
            if key in PERCENT and value is not None:
                value *= 100.0
            line.append("-" if value is None else (fmt % value).strip())
        cells.append(line)
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    out = []
    for n, line in enumerate(cells):
        out.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                             for i, (c, w) in enumerate(zip(line, widths))))
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def format_runs(rows: List[dict]) -> str:
    """With ``--runs``: a line per balancer, each run's throughput, p99,
    loads and CPU time a response took in all (``cpu_row``), in the
    order they ran (the table above has the worst)."""
    lines = ["each run (req/s, p99 ms, loads/req, CPU us/req in all), the table's row being "
             "the worst of them:"]
    width = max(len(row["balancer"]) for row in rows)
    for row in rows:
        if "runs" in row:
            lines.append("  %s  %s" % (row["balancer"].ljust(width), "  ".join(
                "%.0f %s %s %s" % (run["throughput"], _or_dash("%.1f", run.get("p99_ms")),
                                     _or_dash("%.3f", run.get("loads_per_request")),
                                     _or_dash("%.0f", run.get("cpu_us_per_request")))
                for run in row["runs"])))
    return "\n".join(lines) if len(lines) > 1 else ""


def _or_dash(fmt: str, value: Optional[float]) -> str:
    return "-" if value is None else fmt % value


def format_loading(rows: List[dict]) -> str:
    """A line per balancer: each worker's share of the replay spent
    loading, least to most."""
    lines = ["time each worker spent loading (loads x miss cost / replay time), least to most:"]
    width = max(len(row["balancer"]) for row in rows)
    for row in rows:
        shares = sorted((row.get("loading") or {}).values())
        if shares:
            lines.append("  %s  %s" % (row["balancer"].ljust(width),
                                       " ".join("%3.0f%%" % (share * 100.0) for share in shares)))
    return "\n".join(lines) if len(lines) > 1 else ""


def served_shares(report: dict, workers: int) -> List[float]:
    """Each worker's responses in the measured replay over a fair share
    (all responses / ``workers``), least to most; a worker that served
    none counts as 0."""
    counts = list((report.get("workers") or {}).values())
    total = sum(counts)
    if not total or workers < 1:
        return []
    counts += [0] * max(0, workers - len(counts))
    return sorted(count * workers / total for count in counts)


def format_cpu(rows: List[dict]) -> str:
    """A line per balancer: the CPU time a response took in its LBs, its
    workers (the application's servers) and the database server, and
    in all of them; and how busy the machine's CPUs were (``busy``)."""
    several = any("runs" in row for row in rows)
    lines = ["CPU time a response took, in microseconds%s:"
             % (" (each the most of any run)" if several else "")]
    width = max(len(row["balancer"]) for row in rows)
    for row in rows:
        if row.get("cpu_us_per_request") is None:
            continue
        parts = [("LB", row.get("lb_cpu_us_per_request")),
                 ("workers", row.get("workers_cpu_us_per_request")),
                 ("database", row.get("database_cpu_us_per_request")),
                 ("together", row["cpu_us_per_request"])]
        cpus = row.get("cpus_busy")
        lines.append("  %s  %s%s" % (row["balancer"].ljust(width), "  ".join(
            "%s %.0f" % (label, value) for label, value in parts if value is not None),
            "" if cpus is None else "; the machine's CPUs %.0f%% busy" % (100.0 * cpus)))
    return "\n".join(lines) if len(lines) > 1 else ""


def format_served(rows: List[dict], workers: int) -> str:
    """A line per balancer: each worker's requests over a fair share."""
    lines = ["requests each worker served, over a fair share, least to most:"]
    width = max(len(row["balancer"]) for row in rows)
    for row in rows:
        shares = served_shares(row["report"], workers)
        if shares:
            lines.append("  %s  %s" % (row["balancer"].ljust(width),
                                       " ".join("%4.2f" % share for share in shares)))
    return "\n".join(lines) if len(lines) > 1 else ""


def format_busy(rows: List[dict]) -> str:
    """A line per zc-lb run, from its LBs' status sampled during the
    replay (``playback.backlogs``): the share of samples in which a
    worker had nothing in flight while another had requests waiting, and
    each worker's share of samples with a request in flight over a fair
    share, least to most."""
    lines = ["a worker idle while another had requests waiting (share of samples), and each "
             "worker's time with a request in flight over a fair share, least to most:"]
    width = max(len(row["balancer"]) for row in rows)
    for row in rows:
        for run in row.get("runs", [row]):
            backlogs = run.get("backlogs")
            if not backlogs:
                continue
            name = row["balancer"].ljust(width)
            if not backlogs["samples"]:
                lines.append("  %s  no samples (%d status reads failed)"
                             % (name, backlogs["failures"]))
                continue
            idle = "-" if backlogs["idle"] is None else "%4.1f%%" % (100.0 * backlogs["idle"])
            lines.append("  %s  idle %s of %d samples; busy %s%s" % (
                name, idle, backlogs["samples"],
                " ".join("%4.2f" % share for share in sorted(backlogs["busy"].values())),
                "; %d status reads failed" % backlogs["failures"] if backlogs["failures"] else ""))
    return "\n".join(lines) if len(lines) > 1 else ""


def format_notes(rows: List[dict]) -> str:
    """Lines about anything unusual: statuses other than 200, error examples, LB counters."""
    notes = []
    for row in rows:
        report = row["report"]
        other = {code: n for code, n in report["status"].items() if code != "200"}
        if other or report["errors"]:
            notes.append("%s: status %s; %d without response %s" % (
                row["balancer"], json.dumps(report["status"]), report["errors"],
                json.dumps(report["error_kinds"])))
            notes.extend("  " + example for example in report["error_examples"])
        status = row.get("lb_status")
        if status and (status.get("retries") or status.get("errors")):
            notes.append("%s LB: %s" % (row["balancer"], json.dumps(status, sort_keys=True)))
    return "\n".join(notes)


def format_header(args: argparse.Namespace, parse: dict, counts: Dict[str, int]) -> str:
    """Two lines: what was replayed, and the cache app's settings."""
    logs = ", ".join(os.path.basename(p) for p in args.logs)
    replayed = "log %s: %d entries; %d warm-up + %d measured (%d classes), -c %d, %d workers" % (
        logs, parse["entries"], counts["warmup"], counts["measured"], counts["classes"],
        args.concurrency, args.workers)
    if args.lbs > 1:
        replayed += ("; %d of each balancer, the clients taking turns (zc-lb's through "
                     "ZooKeeper, HAProxy's each alone)" % args.lbs)
    if args.runs > 1:
        replayed += "; each balancer %d times, taking turns, the worst of them" % args.runs
    fleet = "%d objects cached/worker, miss %g ms" % (args.cache_size, args.miss_cost * 1000)
    if args.cache_sizes or args.speeds:
        fleet = "a mixed fleet: " + ", ".join("%d objects and miss %g ms" % (
            cache_size_of(args, n), miss_cost_of(args, n) * 1000)
            for n in range(1, args.workers + 1))
    app = ("cache app: %s, %d objects/request of %d/class, "
           "skew %g,%s %s requests at once%s; zc-lb workers (%s) --history %d%s%s" % (
               fleet, args.objects_per_request,
               args.objects_per_class, args.skew,
               " pages by path (queries ignored)," if args.page_key == "path" else "",
               args.worker_concurrency or "any",
               ", says hit or miss" if args.cache_signal else "",
               args.zc_lb_workers, args.history,
               "".join(" " + o for o in args.zc_lb_worker_option),
               "; LB" + "".join(" " + o for o in args.zc_lb_option) if args.zc_lb_option else ""))
    if args.app == "zodb":
        from .zodbapp import PARTS

        app = ("ZODB app on ZEO: a page and %d parts per path, %d objects cached per "
               "connection, ZEO client cache %d bytes, %g ms added per load%s; loads counted "
               "by the ZEO server; zc-lb workers (default)%s; HAProxy in front of gunicorn "
               "-k gthread --threads %d" % (
                   PARTS, args.zodb_cache_size, args.zeo_cache_size, args.load_delay * 1000,
                   ", says hit or miss" if args.cache_signal else "",
                   "".join(" " + o for o in args.zc_lb_worker_option), args.gunicorn_threads))
    return "%s\n%s\nratios are the balancer's number / zc-lb's" % (replayed, app)


# -- command line -------------------------------------------------------------


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zc-lb compare", description="Replay one log through zc-lb and through HAProxy "
        "(leastconn, consistent hash) in front of the same cache-model workers.")
    parser.add_argument("logs", nargs="+", metavar="LOG", help="log files ('.gz' ok)")
    log = parser.add_argument_group("log")
    log.add_argument("--format", default="auto", choices=sorted(FORMATS))
    log.add_argument("--methods", default="GET,HEAD", help="methods to replay (default %(default)s)")
    host = log.add_mutually_exclusive_group()
    host.add_argument("--host", help="send this Host with every request (one class)")
    host.add_argument("--host-from-segment", type=positive_int, metavar="N",
                      help="class (Host) = path segment N + --host-suffix, for single-site logs")
    log.add_argument("--host-suffix", default=DEFAULT_HOST_SUFFIX)
    log.add_argument("--host-depth", type=positive_int, default=1, metavar="D",
                     help="with --host-from-segment: the class is the section D directories "
                     "deep (segment N and the directories after it, joined by '-'; "
                     "default %(default)s)")
    run = parser.add_argument_group("replay")
    run.add_argument("-n", "--max-requests", type=int, default=5000,
                     help="measured requests per balancer (default %(default)s)")
    run.add_argument("--warmup", type=int, default=1000,
                     help="log entries replayed unmeasured before them (default %(default)s)")
    run.add_argument("-c", "--concurrency", type=positive_int, default=16,
                     help="closed-loop clients (default %(default)s)")
    run.add_argument("--timeout", type=float, default=30.0, help="seconds per request")
    run.add_argument("--lbs", type=int, default=1, metavar="N",
                     help="balancers of each kind side by side, the clients taking turns "
                     "between them (default %(default)s): N zc-lb LBs, which find the "
                     "workers and each other in ZooKeeper and hear where the others sent "
                     "keys, as a site with several LBs runs them; N HAProxy processes, "
                     "each balancing alone")
    run.add_argument("--zookeeper", metavar="HOSTS",
                     help="--lbs N: the ZooKeeper to use (each balancer gets a chroot of "
                     "its own, removed after); without it, compare starts one in the run "
                     "directory (java and Debian's zookeeper package)")
    run.add_argument("--runs", type=int, default=1, metavar="N",
                     help="measure each balancer N times, taking turns, and report the "
                     "worst of them in each column (default 1): runs of one workload "
                     "differ, and the worst is what an operator has to plan for")
    run.add_argument("--balancers", default=",".join(BALANCERS),
                     help="comma-separated subset of %s; zc-lb:POLICY runs zc-lb with "
                          "--policy POLICY (%s), several in one run" % (
                              ",".join(BALANCERS), ", ".join(ZC_LB_POLICIES)))
    app = parser.add_argument_group("workers (the same for every balancer)")
    app.add_argument("--app", choices=APPS, default="cache",
                     help="'cache', the cache model (playback.cacheapp); 'zodb', a ZODB "
                     "application on a ZEO server the tool starts (playback.zodbapp: a "
                     "page per path of the log; needs the zodb extra), behind zc-lb's "
                     "default workers and, for HAProxy, gunicorn -k gthread "
                     "(default %(default)s)")
    app.add_argument("-w", "--workers", type=int, default=4, help="processes (default %(default)s)")
    app.add_argument("--cache-size", type=int, default=1000, help="objects cached per worker "
                     "(default %(default)s)")
    app.add_argument("--miss-cost", type=float, default=0.010,
                     help="seconds per cache miss, a database load (default %(default)s)")
    app.add_argument("--cache-sizes", type=number_list(int), default=[], metavar="N,N,...",
                     help="a fleet of unlike machines: worker i (from 1) caches entry i of "
                     "this list, counted round (e.g. 150,600: every other worker four "
                     "times the cache); instead of --cache-size")
    app.add_argument("--speeds", type=number_list(float), default=[], metavar="S,S,...",
                     help="with it or alone: worker i's loads take --miss-cost over entry i "
                     "of this list, counted round (e.g. 1,1,2,2 with --cache-sizes "
                     "150,600: each size at each speed, as the simulator's mixed_fleet)")
    app.add_argument("--objects-per-request", type=int, default=10)
    app.add_argument("--objects-per-class", type=int, default=1000)
    app.add_argument("--skew", type=float, default=0.0)
    app.add_argument("--page-objects", type=int, default=0,
                     help="objects of a URL's own that its requests touch too (default 0)")
    app.add_argument("--page-key", choices=PAGE_KEYS, default="url",
                     help="what names a page of the cache app: 'url', its path and query "
                     "(default: each query a page of its own); 'path', the path alone, as "
                     "the ZODB app, the simulator and zc-lb's default affinity key name it")
    app.add_argument("--worker-concurrency", type=int, default=1, metavar="N",
                     help="requests a worker process serves at once, the rest wait (0: no "
                     "bound; default %(default)s: a Python process whose loads are its own "
                     "time, as the simulator's workers)")
    app.add_argument("--zc-lb-workers", choices=("threads", "greenlets"), default="threads",
                     help="how zc-lb's workers run the app: 'threads', the default worker "
                     "in front of a blocking app that bounds itself with a threading "
                     "semaphore of --worker-concurrency slots (as an app's lock or "
                     "connection pool); 'greenlets', --greenlets --concurrency N in front "
                     "of the app unbounded (default %(default)s)")
    app.add_argument("--cache-signal", action="store_true",
                     help="the app tells zc-lb's workers whether its cache hit "
                     "(environ['zc_lb.cache'])")
    zodb = parser.add_argument_group("--app zodb")
    zodb.add_argument("--zodb-cache-size", type=int, default=0, metavar="N",
                      help="objects in each ZODB connection's cache (default 0: the "
                      "objects of the measured entries' pages over -w, each worker's "
                      "share of a perfect partition)")
    zodb.add_argument("--zeo-cache-size", type=int, default=65536, metavar="BYTES",
                      help="each process's ZEO client cache (default %(default)s)")
    zodb.add_argument("--load-delay", type=float, default=0.0, metavar="SECONDS",
                      help="seconds added to each database load, for a database further "
                      "away (default 0)")
    zodb.add_argument("--gunicorn-threads", type=int, default=16,
                      help="gunicorn's threads behind HAProxy (default %(default)s, as "
                      "zc-lb's workers)")
    app.add_argument("--zc-lb-worker-option", action="append", default=[], metavar="OPT",
                     help="extra `zc-lb worker` argument, e.g. --zc-lb-worker-option=--threads=1 "
                     "(repeat)")
    app.add_argument("--history", type=int, default=100,
                     help="zc-lb workers: requests between résumés (default %(default)s)")
    app.add_argument("--zc-lb-option", action="append", default=[], metavar="OPT",
                     help="extra `zc-lb lb` argument, e.g. --zc-lb-option=--variance=4 (repeat)")
    app.add_argument("--zc-lb-log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    app.add_argument("--haproxy", default=shutil.which("haproxy", path="/usr/sbin:/usr/bin:"
                                                       + os.environ.get("PATH", "")))
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the results as JSON")
    out.add_argument("--top", type=int, default=10, help="classes kept per report")
    out.add_argument("--log-dir", help="where process logs and configs go (default: a new "
                     "/tmp/zc-lb-compare-* directory, kept)")
    out.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                     help="progress bar on stderr (default: when stderr is a terminal)")
    return parser


def number_list(kind: type):
    """An argparse type: a comma-separated list of positive finite numbers."""

    def parse(text: str) -> list:
        try:
            numbers = [kind(item) for item in text.split(",") if item.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError("not a list of numbers: %r" % text) from None
        if not numbers or not all(0 < n < float("inf") for n in numbers):
            raise argparse.ArgumentTypeError("want positive numbers, comma-separated: %r" % text)
        return numbers

    parse.__name__ = "list of %s" % kind.__name__  # (argparse's "invalid ... value")
    return parse


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    args.balancers = [b for b in args.balancers.split(",") if b]
    unknown = set(args.balancers) - set(BALANCERS) - {"zc-lb:" + p for p in ZC_LB_POLICIES}
    if unknown or not args.balancers:
        parser.error("--balancers: choose from %s" % ",".join(BALANCERS))
    if min(args.workers, args.concurrency, args.max_requests, args.cache_size) < 1 or args.warmup < 0:
        parser.error("-w, -c, -n and --cache-size must be at least 1, --warmup at least 0")
    if args.runs < 1 or args.lbs < 1:
        parser.error("--runs and --lbs must be at least 1")
    check_host_depth(parser, args)
    if args.worker_concurrency < 0:
        parser.error("--worker-concurrency must be 0 (no bound) or more")
    if (args.cache_sizes or args.speeds) and args.app != "cache":
        parser.error("--cache-sizes and --speeds shape the cache app's fleet (not --app %s)"
                     % args.app)
    if args.app == "zodb":
        try:
            import gunicorn  # noqa: F401
            import ZEO  # noqa: F401
        except ImportError as exc:
            parser.error("--app zodb needs ZODB, ZEO and gunicorn (pip install "
                         "'zc-lb[zodb]'): %s" % exc)
    if set(args.balancers) & set(HAPROXY_CONFIGS) and not args.haproxy:
        parser.error("haproxy not found: install it (apt-get install haproxy) or pass --haproxy")


def run(args: argparse.Namespace, run_dir: Path) -> dict:
    """Read the log, measure every balancer; the results as a dict."""
    entries, parse_stats = read_entries(
        args.logs, fmt=args.format, methods=[m.strip() for m in args.methods.split(",") if m.strip()],
        host=args.host, segment=args.host_from_segment, host_suffix=args.host_suffix,
        depth=args.host_depth)
    warmup = entries[:args.warmup]
    measured = entries[args.warmup:args.warmup + args.max_requests]
    if not measured:
        raise CompareError("the log has %d entries, none left after %d of warm-up" % (
            len(entries), args.warmup))
    progress = sys.stderr if (args.progress if args.progress is not None else sys.stderr.isatty()) else None
    runs: Dict[str, List[dict]] = {name: [] for name in args.balancers}
    with contextlib.ExitStack() as stack:
        if args.app == "zodb":
            stack.callback(remove_database, run_dir / "zodb.fs")  # (the logs stay)
            prepare_zodb(args, run_dir, warmup + measured, measured)
        if args.lbs > 1 and not args.zookeeper and any(
                name.partition(":")[0] == "zc-lb" for name in args.balancers):
            args.zookeeper = stack.enter_context(zookeeper_server(run_dir))
        for n in range(args.runs):  # (taking turns: a slow spell of the machine hits all)
            where = run_dir if args.runs == 1 else run_dir / ("run%d" % (n + 1))
            where.mkdir(exist_ok=True)
            for name in args.balancers:
                if progress is not None:
                    progress.write("%s%s...\n" % (name, "" if args.runs == 1 else
                                                   " (run %d of %d)" % (n + 1, args.runs)))
                runs[name].append(measure(name, warmup, measured, args, where, progress))
    rows = [worst_of(each) for each in runs.values()]
    add_ratios(rows)
    floor = floor_loads(warmup, measured, args) if args.app == "cache" else None
    counts = {"warmup": len(warmup), "measured": len(measured),
              "classes": len({e.host for e in measured})}
    settings = {key: getattr(args, key) for key in (
        "logs", "format", "host", "host_from_segment", "host_depth", "max_requests", "warmup", "runs",
        "concurrency", "lbs",
        "workers", "history", "zc_lb_option", "zc_lb_workers", "zc_lb_worker_option",
        "cache_signal", "cache_sizes", "speeds", "app", "zodb_cache_size", "zeo_cache_size", "load_delay",
        "gunicorn_threads", "balancers") + tuple(APP_SETTINGS)}
    return {"settings": settings, "counts": counts, "parse": parse_stats.as_dict(),
            "cpus": os.cpu_count(), "log_dir": str(run_dir), "results": rows,
            "floor_loads_per_request": floor}


def page_path(target: str) -> str:
    """The PATH_INFO a WSGI server makes of a request target: its path,
    percent-decoded, as latin-1 (PEP 3333)."""
    from urllib.parse import unquote_to_bytes

    return unquote_to_bytes(target.partition("?")[0]).decode("latin-1")


def prepare_zodb(args: argparse.Namespace, run_dir: Path, entries: list, measured: list) -> None:
    """Write the database every balancer's ZEO server starts from (a page
    per path), and size the connection caches when not told: the objects
    of the measured pages over the workers, as each worker would hold its
    share of a perfect partition."""
    from .zodbapp import PARTS, populate

    args.zodb_file = str(run_dir / "zodb.fs")
    populate(args.zodb_file, (page_path(e.path) for e in entries))
    if not args.zodb_cache_size:
        pages = len({page_path(e.path) for e in measured})
        args.zodb_cache_size = max(10, pages * (1 + PARTS) // args.workers)


def floor_loads(warmup: list, measured: list, args: argparse.Namespace) -> float:
    """Database loads per measured request of the perfect partition: the
    workers' caches as one shared LRU of all their objects (``--cache-sizes``
    summed over the workers, or ``workers * cache_size``), the same objects
    touched, nothing loaded twice.  With caches of a
    useful size no balancer does better; with tiny ones LRU's quirks can
    let one."""
    from .cacheapp import CacheModel, objects_for, page_name, request_class

    model = CacheModel(sum(cache_size_of(args, number) for number in range(1, args.workers + 1)))
    for n, entry in enumerate(warmup + measured):
        if n == len(warmup):
            model.misses = 0
        cls = request_class({"HTTP_HOST": entry.host or "localhost"})
        page = page_name(entry.path, args.page_key)
        ids = objects_for(cls, page, args.objects_per_request, args.objects_per_class,
                          args.skew)
        ids.extend("%s|%s|%d" % (cls, page, i) for i in range(args.page_objects))
        model.touch(ids)
    return model.misses / len(measured)


def _terminate(signum, frame):
    raise SystemExit(128 + signum)  # so that every finally block stops its processes


def main(argv=None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    run_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="zc-lb-compare-", dir="/tmp"))
    run_dir.mkdir(parents=True, exist_ok=True)
    previous = signal.signal(signal.SIGTERM, _terminate)
    started = time.monotonic()
    try:
        result = run(args, run_dir)
    except (ProcessError, OSError) as exc:
        print("compare.py: %s (process logs in %s)" % (exc, run_dir), file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    result["elapsed"] = time.monotonic() - started
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(text_report(args, result))
    return 0


def text_report(args: argparse.Namespace, result: dict) -> str:
    parts = [format_header(args, result["parse"], result["counts"]), "",
             format_table(result["results"])]
    if result["floor_loads_per_request"] is not None:
        parts.append("floor (the %d caches as one shared LRU, perfectly partitioned): %.3f "
                     "loads/request" % (args.workers, result["floor_loads_per_request"]))
    each = format_runs(result["results"])
    if each:
        parts.append(each)
    for shares in (format_cpu(result["results"]),
                   format_loading(result["results"]),
                   format_served(result["results"], args.workers),
                   format_busy(result["results"])):
        if shares:
            parts.append(shares)
    notes = format_notes(result["results"])
    if notes:
        parts += ["", notes]
    parts += ["", "%.0f s in all; process logs in %s" % (result["elapsed"], result["log_dir"])]
    return "\n".join(parts)


if __name__ == "__main__":
    sys.exit(main())
