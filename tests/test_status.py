"""zc_lb.status: the status app (the LB's ``--status`` address), fetching
its document and printing it (``zc-lb status``).

The app is served here by wsgiref in a thread, so ``fetch`` (plain
urllib, blocking) meets a real HTTP server; the LB serving it for real,
and ``zc-lb status`` run against it, are in test_e2e.py.
"""

import json
import re
import threading
import wsgiref.simple_server

import pytest

from zc_lb import cli
from zc_lb.classifier import host_classifier
from zc_lb.errors import ConfigurationError
from zc_lb.lb import LB
from zc_lb.pool import Pool
from zc_lb.status import fetch, format_status, status_app

DOCUMENT = {
    "pool": {"policy": "resume", "variance": 1.0, "backlog_history": 9,
             "unskilled_score": 1.0, "backlog": 3, "mean_backlog": 1.5},
    "in_flight": 3, "requests": 120, "retries": 2, "errors": {"502": 1},
    "workers": {
        "127.0.0.1:8002": {"connected": True, "in_pool": False, "backlog": 0,
                           "mean_backlog": 0.0, "skills": {}},
        "127.0.0.1:8001": {"connected": True, "in_pool": True, "backlog": 3,
                           "mean_backlog": 1.5,
                           "skills": {"a": 10.0, "b": 200.0, "c": 3.0}},
        "127.0.0.1:8003": {"connected": False, "last_error": "refused"},
    },
}


def cells(line):
    return re.split(r"\s{2,}", line)


def call(app, method="GET", path="/"):
    """(status, headers, document) of one call of a WSGI app."""
    started = {}

    def start_response(status, headers):
        started.update(status=status, headers=dict(headers))
    body = b"".join(app({"REQUEST_METHOD": method, "PATH_INFO": path}, start_response))
    assert int(started["headers"]["Content-Length"]) == len(body)
    return started["status"], started["headers"], json.loads(body)


class _QuietHandler(wsgiref.simple_server.WSGIRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def serve():
    """serve(app) -> "127.0.0.1:PORT" of a thread serving ``app``."""
    servers = []

    def start(app):
        server = wsgiref.simple_server.make_server(
            "127.0.0.1", 0, app, handler_class=_QuietHandler)
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                                  daemon=True)
        thread.start()
        servers.append((server, thread))
        return "127.0.0.1:%d" % server.server_address[1]

    yield start
    for server, thread in servers:
        server.shutdown()
        server.server_close()
        thread.join(5)


# -- the app ---------------------------------------------------------------------


def test_every_get_is_a_fresh_document_as_uncached_json():
    documents = iter([{"requests": 1}, {"requests": 2}])
    app = status_app(lambda: next(documents))
    status, headers, document = call(app, path="/anything")
    assert (status, document) == ("200 OK", {"requests": 1})
    assert headers["Content-Type"] == "application/json"
    assert headers["Cache-Control"] == "no-store"
    assert call(app)[2] == {"requests": 2}


def test_a_post_runs_its_action_and_only_a_known_one():
    done = []
    app = status_app(lambda: {}, {"reset-skills": lambda: done.append("reset")})
    status, _, document = call(app, "POST", "/reset-skills")
    assert (status, document, done) == ("200 OK", {"done": "reset-skills"}, ["reset"])
    status, _, document = call(app, "POST", "/shutdown")
    assert (status, document) == ("404 Not Found", {"error": "no such action"})
    assert call(status_app(lambda: {}), "POST", "/reset-skills")[0] == "404 Not Found"
    assert done == ["reset"]


# -- fetch -----------------------------------------------------------------------


def test_fetch_gets_the_document_or_posts_an_action(serve):
    done = []
    address = serve(status_app(lambda: DOCUMENT, {"reset-skills": lambda: done.append(1)}))
    assert fetch(address) == DOCUMENT
    assert fetch("http://%s/" % address) == DOCUMENT  # a URL will do too
    assert fetch(address, action="reset-skills") == {"done": "reset-skills"}
    assert done == [1]


def test_fetch_failures_are_configuration_errors_naming_the_url(serve):
    from zkserver import free_port
    nowhere = "127.0.0.1:%d" % free_port()
    with pytest.raises(ConfigurationError, match="cannot get status from http://%s/" % nowhere):
        fetch(nowhere, timeout=2)

    def not_json(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"<html>"]
    with pytest.raises(ConfigurationError, match="cannot get status"):
        fetch(serve(not_json))
    with pytest.raises(ConfigurationError, match="404"):
        fetch(serve(status_app(lambda: {})), action="shutdown")


# -- printing --------------------------------------------------------------------


def test_the_table_has_a_row_per_worker_with_its_state_and_top_skills():
    lines = format_status(DOCUMENT, max_skills=2).splitlines()
    assert lines[0] == "pool: resume  variance=1.0  backlog_history=9  unskilled_score=1.0"
    assert lines[1] == ("backlog=3  mean backlog=1.5  in flight=3  requests=120  retries=2"
                        "  errors={'502': 1}")
    assert lines[2] == ""
    header, *rows = lines[3:]
    assert cells(header) == ["worker", "state", "backlog", "mean", "classes",
                             "top skills (req/s)"]
    assert [cells(row) for row in rows] == [  # sorted by address
        ["127.0.0.1:8001", "in pool", "3", "1.5", "3", "b=200, a=10"],  # the 2 best of 3
        ["127.0.0.1:8002", "draining", "0", "0.0", "0"],
        ["127.0.0.1:8003", "down", "-", "-", "0"]]
    column = header.index("state")  # columns aligned under their header
    assert all(row[column - 2:column] == "  " and row[column] != " " for row in rows)


def test_the_document_of_a_real_lb_prints():
    lb = LB(Pool(), host_classifier)
    text = format_status(lb.status())
    assert text.startswith("pool: ") and "requests=0" in text
    assert text.splitlines()[-1].split()[0] == "worker"  # no workers, no rows


def test_zc_lb_status_prints_the_table_or_the_json(serve, capsys):
    address = serve(status_app(lambda: DOCUMENT))
    assert cli.main(["status", address]) == 0
    assert capsys.readouterr().out == format_status(DOCUMENT) + "\n"
    assert cli.main(["status", "--json", address]) == 0
    assert json.loads(capsys.readouterr().out) == DOCUMENT


def test_zc_lb_status_of_an_unreachable_address_is_a_one_line_error(capsys):
    from zkserver import free_port
    assert cli.main(["status", "127.0.0.1:%d" % free_port()]) == 1  # nobody there: not a typo
    err = capsys.readouterr().err
    assert err.startswith("zc-lb status: error: cannot reach a status server at ")
    assert err.count("\n") == 1
