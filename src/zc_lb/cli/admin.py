"""The commands that act on running LBs and on ZooKeeper: ``zc-lb
status``, ``drain``, ``enable``, ``reset-skills`` and ``zk``.

Rules: each does its one thing and exits; what it reaches is named in
its error.  Exit status 1 when nothing answers at an address (the LB
is down: try again), 2 when what answers is not a zc-lb status server
or refuses the action (a wrong address, token or worker: fix it), 69
when ZooKeeper does not answer.
"""

from __future__ import annotations

import argparse
import logging
import os
import time

from zc_lb.errors import ConfigurationError
from zc_lb.process.service import read_admin_token


def fetch_status(address: str, timeout: float = 5.0) -> dict:
    """The status document at ADDRESS, or an error that says what answered
    there instead: ConfigurationError (exit status 2) for anything that is
    not a zc-lb status server, ZcLbError (1) when nothing answers."""
    import json

    from zc_lb.status.document import answer_at

    url = address if "://" in address else "http://%s/" % address
    code, kind, body, _ = answer_at(url, address, timeout,
                                    unreachable="cannot reach a status server at %s")
    doc = None
    if code == 200 and kind == "application/json":
        try:
            doc = json.loads(body)
        except ValueError:
            pass
    if not (isinstance(doc, dict) and isinstance(doc.get("workers"), dict)
            and isinstance(doc.get("pool"), dict)):
        raise ConfigurationError("%s is not a zc-lb status server (got %d %s%s); give "
                                 "the address of an LB's --status" % (
                                     address, code, kind, "" if doc is None else
                                     ", a JSON document without workers and pool"))
    return doc


def run_status(args: argparse.Namespace) -> int:
    import json

    from zc_lb.status.document import format_status

    doc = fetch_status(args.address, args.timeout)
    if args.json:
        print(json.dumps(doc, indent=2, sort_keys=True))
    else:
        print(format_status(doc))
    return 0


def run_worker_state(args: argparse.Namespace) -> int:
    from zc_lb.status.document import fetch

    answer = fetch(args.address, action=args.action, params={"worker": args.worker},
                   token=read_admin_token(args.token_file), timeout=args.timeout)
    print("%s %s on the LB at %s%s" % (
        "drained" if args.action == "drain" else "enabled", args.worker, args.address,
        " (it was neither drained nor ejected)" if answer.get("changed") is False else ""))
    return 0


def run_reset_skills(args: argparse.Namespace) -> int:
    from zc_lb.status.document import fetch

    if not args.zookeeper and not args.status:
        raise ConfigurationError("give --zookeeper or --status")
    token = read_admin_token(args.token_file)
    for address in args.status:
        fetch(address, action="reset-skills", token=token, timeout=args.timeout)
        print("reset skills on the LB at %s" % address)
    if args.zookeeper:
        from zc_lb.zookeeper import client as zk

        logging.getLogger("kazoo").setLevel(logging.WARNING)
        token = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()) + "-%d" % os.getpid()
        client = zk.connect(args.zookeeper, credentials=(
            zk.read_credentials(args.zookeeper_auth_file) if args.zookeeper_auth_file else None))
        try:
            base = args.path.rstrip("/") or ""
            for path in (base + "/workers", base or "/"):  # workers first
                zk.set_properties(client, path, ["reset_skills=%s" % token])
                print("set reset_skills=%s on %s" % (token, path))
        finally:
            client.stop()
            client.close()
    return 0


def run_zk(args: argparse.Namespace) -> int:
    from zc_lb.zookeeper.client import run_zk_command

    logging.getLogger("kazoo").setLevel(logging.WARNING)  # a command, not a service

    return run_zk_command(args)
