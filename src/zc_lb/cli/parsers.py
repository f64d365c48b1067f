"""The command line's parsers: every ``zc-lb`` command and its options
(``build_parser``), and nothing that runs them.

Rules: an option's help text is what ``zc-lb --help`` prints and what
docs/reference/cli.rst is generated from (docs/gen_reference.py); the
options that are settings come from the table in settings.py, never
written out here; options are added in the order --help lists them.
``--log-level`` may come before or after the command.  What runs each
command is ``zc_lb.cli.COMMANDS``'s to say; the tools passed through
(``tools.PASS_THROUGH``) parse their own options.
"""

from __future__ import annotations

import argparse
from typing import Any

from zc_lb import config, settings
from zc_lb.cli.tools import PASS_THROUGH
from zc_lb.front.accesslog import DEFAULT_FORMAT
from zc_lb.process.service import DEFAULT_LISTEN

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
# The admin commands' longest --timeout: a socket's timeout past about
# 9e9 s is an OverflowError (a traceback, exit status 1) where a bad
# value is a usage error (2); this one is over eleven days.
ANSWER_TIMEOUT_MAX = 1e6
# The most processes one command starts (worker -w, lb --processes, demo
# --workers): -w 1e10 listed its children until the memory ran out, and
# lb --processes 1e30 was an OverflowError sizing their shared memory.
MAX_PROCESSES = 1024
# zc-lb zk's --timeout: 1e10 or nan waited for a dead ZooKeeper for good,
# -1 said it could not reach it "within -1s".
ZK_TIMEOUT = settings.Setting("timeout", float, 10.0, "seconds to wait for ZooKeeper",
                              minimum=0.01, maximum=ANSWER_TIMEOUT_MAX, metavar="S")

# ``zc-lb lb --help`` in groups: each option's dest, by the group it shows in
# (the rest, --config, --chdir, --log-level, stay under "options").
LB_HELP_GROUPS = {
    "front (clients, HTTP, TLS)": [
        "listen", "redirect_https", "processes", "certfile", "keyfile", "tls_min_version",
        "tls_ciphers", "client_timeout", "header_timeout", "max_connections", "forwarded",
        "proxy_protocol", "trusted_proxies", "max_request_body", "error_page"],
    "workers (where they are, how they are reached and judged)": [
        "worker", "zookeeper", "zookeeper_auth_file", "path", "secret_file", "worker_tls_cert",
        "worker_tls_key", "worker_tls_ca", "keepalive_timeout", "response_timeout",
        "max_retries", "health_check", "health_interval", "eject_after", "eject_time",
        "max_ejected", "no_worker_timeout", "single_version"],
    "routing": [
        "classifier", "policy", "affinity_key", "variance", "backlog_history", "unskilled_score",
        "spread", "footprint_window", "slow_start", "balance", "stick", "separate_books",
        "widen", "busy_members"],
    "buffering (request bodies and responses held for slow clients)": [
        "buffer_memory", "buffer_memory_total", "buffer_disk", "buffer_disk_total",
        "buffer_request", "buffer_dir"],
    "operations": [
        "status", "admin_token_file", "access_log", "access_log_format", "pid_file",
        "drain_timeout", "child_status_timeout", "child_action_timeout", "version"],
}


def build_parser() -> argparse.ArgumentParser:
    """``zc-lb``'s parser: every command's parser in ``parser.commands``,
    by name."""
    parser = config.Parser(
        prog="zc-lb", description="A résumé-based load balancer for WSGI applications.")
    parser.add_argument("--log-level", default="INFO", choices=LOG_LEVELS,
                        help="before or after the command (default INFO)")
    parser.add_argument("--version", action="version", version=version_line())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parser.commands = sub.choices  # type: ignore[attr-defined]  # name -> its parser
    for add in (_add_worker_parser, _add_lb_parser, _add_status_parser, _add_zk_parser,
                _add_worker_state_parsers, _add_reset_skills_parser, _add_demo_parser,
                _add_pass_through_parsers):
        add(sub)
    for name, command in sub.choices.items():
        if name not in PASS_THROUGH:  # (those parse their own options)
            command.add_argument("--log-level", choices=LOG_LEVELS, default=argparse.SUPPRESS,
                                 help="as before the command (default INFO)")
    return parser


def version_line() -> str:
    """``zc-lb --version``: the version, and which build runs (compiled, or
    the source and why: a pip install without a compiler gives the source)."""
    from zc_lb import build

    return "zc-lb %s (%s)" % (version(), build())


def version() -> str:
    """zc-lb's version: ``zc_lb.__version__``, which setup.py reads too."""
    from zc_lb import __version__

    return __version__


# -- worker -------------------------------------------------------------


def _add_worker_parser(sub) -> None:
    p = sub.add_parser("worker", help="run a worker hosting a WSGI application")
    p.add_argument("app", nargs="?",
                   help="module:callable, or a PasteDeploy .ini file (or app in --config)")
    _add_config_argument(p, "worker")
    p.add_argument("--listen", default="127.0.0.1:0", metavar="HOST:PORT|unix:PATH",
                   help="where LBs reach this worker: a TCP address (default: "
                        "127.0.0.1, a port of the kernel's choice) or a Unix socket, "
                        "whose file's permissions say who may connect")
    p.add_argument("--resume-file", help="read skills at start, save them as they change")
    _add_worker_settings(p)
    p.add_argument("--status", metavar="HOST:PORT",
                   help="serve the worker's status (JSON) and Prometheus /metrics")
    p.add_argument("--secret-file", help="shared secret for LB authentication")
    p.add_argument("--pid-file", metavar="FILE",
                   help="write the worker's pid here once it serves; removed when it ends")
    p.add_argument("--reload", action="store_true",
                   help="for development: start again when a source file of the "
                   "application (a module loaded from under the working directory) changes")
    _add_worker_processes(p)
    _add_worker_tls(p)
    _add_worker_zookeeper(p)


def _add_worker_settings(p) -> None:
    """The settings table's worker options, and --greenlets, which excludes
    --threads."""
    mode = p.add_mutually_exclusive_group()
    for setting in settings.given_in(settings.WORKER_SETTINGS, settings.CLI).values():
        settings.add_argument(mode if setting.name == "threads" else p, setting)
    mode.add_argument("--greenlets", dest="threads", action="store_const", const=None,
                      help="run the application in greenlets, for applications that "
                           "cooperate with gevent (never block); a blocked loop is "
                           "logged with the request that blocked it")


def _add_worker_processes(p) -> None:
    """How many worker processes, and when each is started again."""
    p.add_argument("-w", "--workers", type=_process_count, default=1, metavar="N",
                   help="run N worker processes, the i-th on --listen's port + i (and "
                   "--status's), or each on an ephemeral port, or on unix:PATH.i "
                   "(default 1)")
    p.add_argument("--listen-fd", type=int, help=argparse.SUPPRESS)  # a -w child
    p.add_argument("--max-requests", type=int, default=0, metavar="N",
                   help="drain and exit after serving about N requests (0: never), as "
                   "gunicorn's: with -w the process is started again")
    p.add_argument("--max-requests-jitter", type=int, default=0, metavar="J",
                   help="add 0 to J at random to --max-requests, so that processes do not "
                   "all restart at once (default 0)")


def _add_worker_tls(p) -> None:
    """TLS toward the LBs, or --insecure."""
    p.add_argument("--tls-cert", metavar="FILE",
                   help="serve LBs over TLS with this certificate (naming the address "
                   "they connect to); needs --tls-ca: LBs must show a certificate of it")
    p.add_argument("--tls-key", metavar="FILE", help="its key (default: in --tls-cert)")
    p.add_argument("--tls-ca", metavar="FILE", help="the CA of the LBs' certificates")
    p.add_argument("--insecure", action="store_true",
                   help="listen on a non-loopback address without --secret-file")


def _add_worker_zookeeper(p) -> None:
    """Registration in ZooKeeper, and what the worker tells of itself."""
    p.add_argument("--zookeeper", metavar="HOSTS", help="register in ZooKeeper (host:port,...)")
    _add_zookeeper_auth(p)
    p.add_argument("--path", default="/lb/workers",
                   help="ZooKeeper node of the workers (default /lb/workers)")
    p.add_argument("--version", help="the application version: told to every LB (status, "
                   "metrics) and, with --zookeeper, what --single-version LBs compare")
    p.add_argument("--description", help="a note for people reading the tree")


# -- lb -----------------------------------------------------------------


def _add_lb_parser(sub) -> None:
    p = sub.add_parser("lb", help="run a load balancer")
    p.group(LB_HELP_GROUPS)
    _add_config_argument(p, "lb")
    _add_lb_listen_arguments(p)
    _add_lb_routing_arguments(p)
    _add_lb_operator_arguments(p)
    p.add_argument("--version", action="version", version=version_line(),
                   help="print zc-lb's version and build, and exit")
    p.add_argument("--pid-file", metavar="FILE",
                   help="write the LB's pid here once it serves (a supervisor's, with "
                   "--processes); removed when it ends")
    p.add_argument("--zookeeper", metavar="HOSTS",
                   help="discover workers and settings in ZooKeeper (host:port,...)")
    _add_zookeeper_auth(p)
    p.add_argument("--path", default="/lb", help="ZooKeeper node of the LB (default /lb)")
    settings.add_arguments(p, settings.LB_SETTINGS)


def _add_lb_listen_arguments(p) -> None:
    """Where the LB serves, and in how many processes."""
    p.add_argument("--listen", action="append", metavar="[SCHEME://]ADDRESS",
                   help="where to serve, repeatable (default %s): http://ADDRESS or "
                        "https://ADDRESS, the address HOST:PORT or unix:PATH (a Unix "
                        "socket, for a proxy on this machine); a bare ADDRESS is HTTPS "
                        "with --certfile, else HTTP" % DEFAULT_LISTEN)
    p.add_argument("--redirect-https", action="store_true",
                   help="the HTTP listeners answer every request with a redirect to the "
                        "HTTPS one")
    p.add_argument("--processes", type=_process_count, default=1, metavar="N",
                   help="run N LB processes accepting on the one --listen address, each "
                        "with its own pool and worker connections (default 1); --status "
                        "then sums them")
    p.add_argument("--listen-fd", type=int, help=argparse.SUPPRESS)  # a --processes child
    p.add_argument("--process-index", type=int, help=argparse.SUPPRESS)
    p.add_argument("--siblings-fd", type=int, help=argparse.SUPPRESS)  # their shared memory


def _add_lb_routing_arguments(p) -> None:
    """Where the workers are, how requests are routed to them, how they are
    checked."""
    p.add_argument("--worker", action="append", metavar="HOST:PORT|unix:PATH",
                   help="a worker address, repeatable")
    p.add_argument("--classifier", default="host",
                   help="host, re:ENVKEY:PATTERN or module:dotted.name (default host)")
    p.add_argument("--policy", choices=("affinity", "published", "classless", "resume"),
                   default="affinity",
                   help="affinity (default): résumés pick a class's workers, affinity "
                        "keys split the class among them; published: the published "
                        "résumé algorithm (resume is its old name); classless: least "
                        "backlog")
    p.add_argument("--affinity-key", default="path", metavar="path|none|re:ENVKEY:PATTERN",
                   help="what sends requests of a class to the same worker (default "
                        "path)")
    p.add_argument("--health-check", metavar="PATH",
                   help="GET PATH from every worker every --health-interval seconds; "
                        "failures count toward ejection as failed requests do")


def _add_lb_operator_arguments(p) -> None:
    """The LB's logs, status address, error page, TLS and secret options."""
    p.add_argument("--access-log", metavar="FILE|-",
                   help="write an access log (reopened on SIGUSR1)")
    p.add_argument("--access-log-format", default=DEFAULT_FORMAT, metavar="FORMAT",
                   help="the access log's line, in Apache LogFormat %%-fields (default: "
                        "Apache combined + host, class, worker, upstream, time, retries; "
                        "see docs/reference/accesslog.rst)")
    p.add_argument("--status", metavar="HOST:PORT",
                   help="serve the status document (JSON), a status page, Prometheus "
                        "/metrics and /healthz")
    p.add_argument("--admin-token-file", metavar="FILE",
                   help="a token the status address's actions (drain, enable, "
                        "reset-skills) need, as 'Authorization: Bearer TOKEN'; without "
                        "it they are taken from this host only")
    p.add_argument("--error-page", metavar="FILE", help="HTML page for 502 and 503")
    p.add_argument("--certfile", help="TLS certificate (serve HTTPS)")
    p.add_argument("--keyfile", help="TLS private key (default: in the certfile)")
    p.add_argument("--tls-ciphers", default=None, metavar="OPENSSL-CIPHERS",
                   help="TLS 1.2 cipher list (default: Mozilla's intermediate list)")
    p.add_argument("--secret-file", help="shared secret for worker authentication")
    p.add_argument("--worker-tls-cert", metavar="FILE",
                   help="connect to workers over TLS, showing this certificate; needs "
                   "--worker-tls-ca: workers must show a certificate of it")
    p.add_argument("--worker-tls-key", metavar="FILE",
                   help="its key (default: in --worker-tls-cert)")
    p.add_argument("--worker-tls-ca", metavar="FILE", help="the CA of the workers' certificates")


# -- the other commands ---------------------------------------------------


def _add_status_parser(sub) -> None:
    p = sub.add_parser("status", help="print an LB's status")
    p.add_argument("address", help="the LB's --status HOST:PORT")
    p.add_argument("--json", action="store_true", help="print the raw JSON")
    _add_answer_timeout(p, "the LB's answer", "--child-status-timeout")


def _add_worker_state_parsers(sub) -> None:
    for name, help_text in (
            ("drain", "send one worker nothing new through an LB (its requests finish)"),
            ("enable", "let an LB send a drained worker requests again")):
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("address", help="the LB's --status HOST:PORT")
        p.add_argument("worker", help="the worker's HOST:PORT, as the LB knows it")
        p.add_argument("--token-file", metavar="FILE",
                       help="the LB's --admin-token-file")
        _add_answer_timeout(p, "the LB's answer", "--child-action-timeout")
        p.set_defaults(action=name)


def _add_reset_skills_parser(sub) -> None:
    p = sub.add_parser(
        "reset-skills", help="make LBs and workers forget skills (after a classifier change)")
    p.add_argument("--zookeeper", metavar="HOSTS",
                   help="set reset_skills in ZooKeeper: every LB and worker resets")
    _add_zookeeper_auth(p)
    p.add_argument("--path", default="/lb",
                   help="the LBs' node; the workers' is PATH/workers (default /lb)")
    p.add_argument("--status", action="append", metavar="HOST:PORT", default=[],
                   help="an LB's status address (static mode: that LB resets, its "
                        "workers keep their résumés); may be repeated")
    p.add_argument("--token-file", metavar="FILE",
                   help="the LBs' --admin-token-file")
    _add_answer_timeout(p, "each --status address's answer", "--child-action-timeout")


def _add_answer_timeout(p, answer: str, childs: str) -> None:
    """--timeout: how long a command waits for an LB's status address,
    checked as a setting is (a number from 0.01 to ANSWER_TIMEOUT_MAX:
    else exit status 2)."""
    settings.add_argument(p, settings.Setting(
        "timeout", float, 5.0,
        "seconds to wait for %s, all of it; an LB with --processes waits up to its %s for its "
        "processes' answers: give more than that" % (answer, childs),
        minimum=0.01, maximum=ANSWER_TIMEOUT_MAX, metavar="S"))


class AnyOrderParser(config.Parser):
    """A command's parser that takes its options before, between or after
    its arguments, as ``zc-lb zk import FILE --delete ROOT``: argparse
    alone, at an option between two arguments, gives an optional one its
    default and leaves the next one over.  (Only for a parser without
    commands of its own: argparse cannot intermix those.)  A command
    line with ``--`` is argparse's alone: its intermixed parse drops the
    ``--``, and reads what followed it as options."""

    _parsing = False  # (in the intermixed parse, whose passes are argparse's own)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        if self._parsing or (args is not None and "--" in args):
            return super().parse_known_args(args, namespace)
        self._parsing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._parsing = False


def _add_zk_parser(sub) -> None:
    p = sub.add_parser("zk", help="import, export, read and set the ZooKeeper tree")
    p.add_argument("--zookeeper", default="127.0.0.1:2181", metavar="HOSTS",
                   help="host:port,...[/chroot] (default 127.0.0.1:2181)")
    _add_zookeeper_auth(p)
    settings.add_argument(p, ZK_TIMEOUT)
    zk = p.add_subparsers(dest="zk_command", required=True, metavar="ZKCOMMAND",
                          parser_class=AnyOrderParser)
    i = zk.add_parser("import", help="make the tree match FILE (- for stdin)")
    i.add_argument("file", help="the tree text (- for stdin; etc/tree.txt is a sample)")
    i.add_argument("root", nargs="?", default="/", help="import under this path")
    i.add_argument("--dry-run", action="store_true", help="print the changes only")
    i.add_argument("--delete", action="store_true",
                   help="also delete nodes and properties absent from FILE")
    i.add_argument("--delete-at-root", action="store_true",
                   help="allow --delete at /, where it removes every other top-level tree")
    i.add_argument("--force", action="store_true",
                   help="accept properties that are no known setting")
    e = zk.add_parser("export", help="print the tree at PATH as text")
    e.add_argument("path", nargs="?", default="/",
                   help="the node (default /), printed under its own name: import the "
                   "text under its parent (zc-lb zk export /lb/workers > f; zc-lb zk "
                   "import f /lb)")
    e.add_argument("--ephemeral", action="store_true",
                   help="list ephemeral nodes as comments")
    g = zk.add_parser("get", help="print a node's properties as JSON")
    g.add_argument("path", help="the node, e.g. /lb")
    s = zk.add_parser("set", help="set properties: key=value (JSON, else string)")
    s.add_argument("path", help="the node, e.g. /lb")
    s.add_argument("assignments", nargs="+", metavar="key=value",
                   help="a property and its value, e.g. variance=2 (repeat)")
    s.add_argument("--force", action="store_true",
                   help="accept properties that are no known setting")
    ls = zk.add_parser("ls", help="list a node's children")
    ls.add_argument("path", nargs="?", default="/", help="the node (default /)")
    _add_zk_options_after(zk.choices.values())


def _add_zk_options_after(commands) -> None:
    """zk's options to its ``commands``, to be given after ZKCOMMAND too."""
    for command in commands:
        command.add_argument("--zookeeper", metavar="HOSTS", default=argparse.SUPPRESS,
                             help="as before ZKCOMMAND")
        command.add_argument("--zookeeper-auth-file", metavar="FILE",
                             default=argparse.SUPPRESS, help="as before ZKCOMMAND")
        command.add_argument("--timeout", type=settings.converter(ZK_TIMEOUT),
                             default=argparse.SUPPRESS, metavar="S", help="as before ZKCOMMAND")
        command.add_argument("--log-level", choices=LOG_LEVELS, default=argparse.SUPPRESS,
                             help="as before the command (default INFO)")


def _add_demo_parser(sub) -> None:
    text = "an LB on 127.0.0.1:8080 with 4 local demo workers (what make run starts)"
    p = sub.add_parser("demo", help=text, description=text + "; Ctrl-C stops them all.")
    p.add_argument("--workers", type=_process_count, default=4,
                   help="demo worker processes to start (default 4)")
    p.add_argument("--listen", default="127.0.0.1:8080",
                   help="the LB's HOST:PORT (default 127.0.0.1:8080)")
    p.add_argument("--status", default="127.0.0.1:8079",
                   help="the LB's status address: page, JSON, /metrics (default "
                        "127.0.0.1:8079)")


def _add_pass_through_parsers(sub) -> None:
    for name, (_, _, description) in PASS_THROUGH.items():
        # No options of its own (not even --help): everything after the
        # name goes to the tool, which parses and documents it.
        p = sub.add_parser(name, help=description + "; --help for its options",
                           add_help=False)
        p.set_defaults(pass_through=None)


# -- shared by the commands ---------------------------------------------


def _add_config_argument(p, section: str) -> None:
    p.add_argument("--config", metavar="FILE",
                   help="read options from the [%s] table of a TOML file (keys: the long "
                        "options with _ for -); the command line overrides it; SIGHUP "
                        "reads it again" % section)
    p.add_argument("--chdir", metavar="DIR",
                   help="change to DIR before loading anything; modules (the "
                        "application, a classifier) are imported from the working "
                        "directory first, as gunicorn does")


def _add_zookeeper_auth(p) -> None:
    p.add_argument("--zookeeper-auth-file", metavar="FILE",
                   help="ZooKeeper credentials, one line USER:PASSWORD: nodes this "
                   "creates only they may read or change")


def _process_count(text: str) -> int:
    """A number of processes to start: from 1 to MAX_PROCESSES."""
    try:
        value = int(text)
    except ValueError:  # (argparse would name this function)
        raise argparse.ArgumentTypeError("not an integer: %r" % text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    if value > MAX_PROCESSES:
        raise argparse.ArgumentTypeError("must be at most %d" % MAX_PROCESSES)
    return value


def zk_credentials(args: argparse.Namespace):
    """The ZooKeeper credentials of ``--zookeeper-auth-file``, or None."""
    if not getattr(args, "zookeeper_auth_file", None):
        return None
    from zc_lb.zookeeper.client import read_credentials

    return read_credentials(args.zookeeper_auth_file)
