"""zc_lb.status.document: the status app (the LB's ``--status`` address), fetching
its document and printing it (``zc-lb status``).

The app is served here by wsgiref in a thread, so ``fetch`` (plain
urllib, blocking) meets a real HTTP server; the LB serving it for real,
and ``zc-lb status`` run against it, are in test_e2e.py.
"""

import json
import re
import time

import pytest

from zc_lb import cli
from zc_lb.routing.classifier import host_classifier
from zc_lb.errors import ConfigurationError, ZcLbError
from zc_lb.lb.balancer import LB
from zc_lb.routing.pool import Pool
from zc_lb.status.document import bound_skills, fetch, format_status, status_app

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
        "127.0.0.1:8004": {"connected": True, "in_pool": False, "drained": True,
                           "backlog": 0, "mean_backlog": 0.0, "skills": {}, "version": "7"},
        "127.0.0.1:8005": {"connected": False, "in_pool": False, "standby": True,
                           "backlog": 0, "mean_backlog": 0.0, "skills": {}, "version": "8"},
    },
}


def cells(line):
    return re.split(r"\s{2,}", line)


def call(app, method="GET", path="/", query="", remote="127.0.0.1", **extra):
    """(status, headers, document) of one call of a WSGI app."""
    started = {}

    def start_response(status, headers):
        started.update(status=status, headers=dict(headers))
    environ = dict({"REQUEST_METHOD": method, "PATH_INFO": path, "QUERY_STRING": query,
                    "REMOTE_ADDR": remote}, **extra)
    body = b"".join(app(environ, start_response))
    assert int(started["headers"]["Content-Length"]) == len(body)
    return started["status"], started["headers"], json.loads(body)


# -- the app ---------------------------------------------------------------------


def test_every_get_is_a_fresh_document_as_uncached_json():
    documents = iter([{"requests": 1}, {"requests": 2}])
    app = status_app(lambda: next(documents))
    status, headers, document = call(app, path="/status.json")
    assert (status, document) == ("200 OK", {"requests": 1})
    assert headers["Content-Type"] == "application/json"
    assert headers["Cache-Control"] == "no-store"
    assert call(app)[2] == {"requests": 2}


def test_the_document_is_indented_json_with_sorted_keys_whatever_their_type():
    # Counts keyed by status code (ints) and tuples come out as JSON does
    # them; a reading that is not a number (NaN) is null, valid JSON.
    app = status_app(lambda: {"b": {503: 1, 200: 2}, "a": (1, 2.5), "c": float("nan")})
    started = {}
    body = b"".join(app({"REQUEST_METHOD": "GET", "PATH_INFO": "/status.json",
                         "QUERY_STRING": "", "REMOTE_ADDR": "127.0.0.1"},
                        lambda status, headers: started.update(status=status)))
    assert started["status"] == "200 OK"
    assert body.decode() == ('{\n  "a": [\n    1,\n    2.5\n  ],\n  "b": {\n    "200": 2,\n'
                             '    "503": 1\n  },\n  "c": null\n}\n')


def test_an_unknown_page_is_404_naming_the_pages():
    status, _, document = call(status_app(lambda: {}), path="/anything")
    assert status == "404 Not Found" and "/status.json" in document["pages"]


@pytest.mark.parametrize("method", ["PUT", "DELETE", "PATCH"])
def test_a_method_the_status_address_does_not_serve_is_405(method):
    # (it was served as a GET: DELETE /status.json answered 200)
    status, headers, document = call(status_app(lambda: {}), method, "/status.json")
    assert status == "405 Method Not Allowed" and headers["Allow"] == "GET, HEAD, POST"
    assert document == {"error": "method %s not allowed" % method}


def test_the_document_bounds_each_workers_skills_unless_asked_for_all():
    skills = {"c%d" % i: float(i) for i in range(250)}
    app = status_app(lambda: {"workers": {"w": {"skills": dict(skills)}}})
    worker = call(app, path="/status.json")[2]["workers"]["w"]
    assert worker["skills_count"] == 250
    assert sorted(worker["skills"]) == sorted("c%d" % i for i in range(150, 250))  # the best
    full = call(app, path="/status.json", query="skills=all")[2]["workers"]["w"]
    assert full["skills"] == skills
    # a document bounded already (a supervisor's, from its children's) keeps its count
    assert bound_skills({"workers": {"w": worker}})["workers"]["w"]["skills_count"] == 250


def test_the_document_lists_the_busiest_classes_unless_asked_for_all():
    classes = {"c%d" % i: i for i in range(1, 151)}
    latency = {name: {"buckets": [1.0], "counts": [n, 0], "sum": 0.0}
               for name, n in classes.items()}
    app = status_app(lambda: {"classes": dict(classes), "class_latency": latency})
    document = call(app, path="/status.json")[2]
    assert len(document["classes"]) == 101 and document["classes"]["other"] == sum(range(1, 51))
    assert set(document["class_latency"]) == set(document["classes"]) - {"other"}
    assert call(app, path="/status.json", query="classes=all")[2]["classes"] == classes


def test_the_document_keeps_as_many_skills_and_classes_as_asked():
    # (a script polling backlogs 20 times a second got every worker's 100
    # skills and the 100 busiest classes each time)
    app = status_app(lambda: {"workers": {"w": {"backlog": 2, "skills": {"a": 1.0, "b": 2.0}}},
                              "classes": {"a": 5, "b": 3}})
    light = call(app, path="/status.json", query="skills=0&classes=0")[2]
    assert light["workers"]["w"] == {"backlog": 2, "skills": {}, "skills_count": 2}
    assert light["classes"] == {"other": 8}
    one = call(app, path="/status.json", query="skills=1&classes=1")[2]
    assert one["workers"]["w"]["skills"] == {"b": 2.0} and one["classes"] == {"a": 5, "other": 3}
    for query in ("skills=-1", "skills=ten", "classes=1.5", "skills=%D9%A3"):
        status, _, document = call(app, path="/status.json", query=query)
        assert status == "400 Bad Request", query
        assert "takes a count or 'all'" in document["error"], document


def test_a_post_runs_its_action_and_only_a_known_one():
    done = []
    app = status_app(lambda: {}, {"reset-skills": lambda: done.append("reset")})
    status, _, document = call(app, "POST", "/reset-skills")
    assert (status, document, done) == ("200 OK", {"done": "reset-skills"}, ["reset"])
    status, _, document = call(app, "POST", "/shutdown")
    assert (status, document) == ("404 Not Found", {"error": "no such action",
                                                    "actions": ["reset-skills"]})
    assert call(status_app(lambda: {}), "POST", "/reset-skills")[0] == "404 Not Found"
    assert done == ["reset"]


def test_actions_take_parameters_and_say_what_is_wrong():
    drained = []

    def drain(worker):
        if worker == "nowhere":
            raise ConfigurationError("no worker nowhere")
        drained.append(worker)
        return {"worker": worker}
    app = status_app(lambda: {}, {"drain": drain})
    status, _, document = call(app, "POST", "/drain", query="worker=10.0.0.1:9001")
    assert (status, document) == ("200 OK", {"done": "drain", "worker": "10.0.0.1:9001"})
    assert call(app, "POST", "/drain", query="worker=nowhere")[:3:2] == (
        "400 Bad Request", {"error": "drain: no worker nowhere"})
    assert call(app, "POST", "/drain")[0] == "400 Bad Request"  # no worker named
    assert drained == ["10.0.0.1:9001"]


def test_actions_need_the_token_or_else_a_loopback_client():
    done = []
    open_app = status_app(lambda: {}, {"reset-skills": lambda: done.append(1)})
    assert call(open_app, "POST", "/reset-skills", remote="10.1.2.3")[0] == "403 Forbidden"
    assert call(open_app, "POST", "/reset-skills", remote="::1")[0] == "200 OK"
    app = status_app(lambda: {}, {"reset-skills": lambda: done.append(2)}, token=b"s3cret")
    status, headers, _ = call(app, "POST", "/reset-skills")  # loopback is not enough
    assert status == "401 Unauthorized" and headers["WWW-Authenticate"] == "Bearer"
    assert call(app, "POST", "/reset-skills", remote="10.1.2.3",
                HTTP_AUTHORIZATION="Bearer s3cret")[0] == "200 OK"
    assert call(app, "POST", "/reset-skills", HTTP_AUTHORIZATION="Bearer nope")[0] \
        == "401 Unauthorized"
    # The scheme is case-insensitive; the token is not.
    assert call(app, "POST", "/reset-skills", HTTP_AUTHORIZATION="bearer s3cret")[0] == "200 OK"
    assert call(app, "POST", "/reset-skills", HTTP_AUTHORIZATION="BEARER  s3cret ")[0] \
        == "200 OK"
    for wrong in ("Bearer S3CRET", "Basic s3cret", "Bearers3cret", "s3cret", "Bearer"):
        assert call(app, "POST", "/reset-skills", HTTP_AUTHORIZATION=wrong)[0] \
            == "401 Unauthorized", wrong
    assert done == [1, 2, 2, 2]


def test_actions_from_loopback_are_taken_on_a_status_address_of_both_families():
    # On --status [::]:PORT an IPv4 client is ::ffff:127.0.0.1, which
    # ipaddress does not call loopback (Python 3.11): it was refused.
    done = []
    app = status_app(lambda: {}, {"reset-skills": lambda: done.append(1)})
    assert call(app, "POST", "/reset-skills", remote="::ffff:127.0.0.1")[0] == "200 OK"
    assert call(app, "POST", "/reset-skills", remote="::ffff:10.1.2.3")[0] == "403 Forbidden"
    assert done == [1]


def test_actions_posted_by_a_web_page_of_another_site_are_refused():
    # Without a token a page in a browser on the LB's host could post an
    # action from loopback (a form needs no CORS); a browser says whence.
    done = []
    app = status_app(lambda: {}, {"reset-skills": lambda: done.append(1)})
    for headers in ({"HTTP_ORIGIN": "http://evil.example"},
                    {"HTTP_ORIGIN": "http://127.0.0.1:8082"},  # (another port)
                    {"HTTP_ORIGIN": "null"},
                    {"HTTP_SEC_FETCH_SITE": "cross-site"},
                    {"HTTP_SEC_FETCH_SITE": "same-site"},
                    {"HTTP_ORIGIN": "http://127.0.0.1:8081", "HTTP_SEC_FETCH_SITE": "cross-site"}):
        status, _, document = call(app, "POST", "/reset-skills", HTTP_HOST="127.0.0.1:8081",
                                   **headers)
        assert status == "403 Forbidden", headers
        assert document["error"].startswith(
            "actions are not taken from a web page of another site ("), document
    token_app = status_app(lambda: {}, {"reset-skills": lambda: done.append(2)}, token=b"t")
    assert call(token_app, "POST", "/reset-skills", HTTP_AUTHORIZATION="Bearer t",
                HTTP_ORIGIN="http://evil.example")[0] == "403 Forbidden"
    assert done == []
    for headers in ({},  # (zc-lb drain, curl)
                    {"HTTP_ORIGIN": "http://127.0.0.1:8081", "HTTP_SEC_FETCH_SITE": "same-origin"},
                    {"HTTP_ORIGIN": "HTTP://127.0.0.1:8081"},
                    {"HTTP_SEC_FETCH_SITE": "none"}):
        assert call(app, "POST", "/reset-skills", HTTP_HOST="127.0.0.1:8081",
                    **headers)[0] == "200 OK", headers
    assert done == [1] * 4


# -- fetch -----------------------------------------------------------------------


def test_fetch_gets_the_document_or_posts_an_action(wsgi_thread):
    done = []
    address = wsgi_thread(status_app(lambda: DOCUMENT, {"reset-skills": lambda: done.append(1)}))
    assert fetch(address) == bound_skills(DOCUMENT)
    assert fetch("http://%s/" % address) == bound_skills(DOCUMENT)  # a URL will do too
    assert fetch(address, action="reset-skills") == {"done": "reset-skills"}
    assert done == [1]


def test_fetch_failures_name_the_url_and_who_is_at_fault(wsgi_thread):
    # Nothing answering was a ConfigurationError too: zc-lb drain exited 2
    # ("fix it") where zc-lb status exits 1 ("try again").
    from zkserver import free_port
    nowhere = "127.0.0.1:%d" % free_port()
    with pytest.raises(ZcLbError, match="cannot get status from http://%s/" % nowhere) as info:
        fetch(nowhere, timeout=2)
    assert not isinstance(info.value, ConfigurationError)

    def not_json(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"<html>"]
    with pytest.raises(ConfigurationError, match="is not a zc-lb status server"):
        fetch(wsgi_thread(not_json))
    with pytest.raises(ConfigurationError, match="404: no such action"):
        fetch(wsgi_thread(status_app(lambda: {})), action="shutdown")


def test_a_503_is_nothing_answering_not_a_refusal(wsgi_thread):
    # A --processes N supervisor answers an action 503 when its children
    # did not answer in time: zc-lb drain said "answered 503" and exited 2
    # ("fix it") where asking again later is all there is to do.
    def busy(environ, start_response):
        start_response("503 Service Unavailable", [("Content-Type", "application/json")])
        return [b'{"error": "drain: no answer from LB process 1 (try again)"}']
    address = wsgi_thread(busy)
    with pytest.raises(ZcLbError) as info:
        fetch(address, action="drain", params={"worker": "10.0.0.1:9001"})
    assert type(info.value) is ZcLbError and info.value.exit_status == 1
    assert str(info.value) == ("http://%s/drain?worker=10.0.0.1%%3A9001 answered 503: drain: "
                               "no answer from LB process 1 (try again)" % address)


def test_zc_lb_status_and_the_actions_read_an_answer_and_its_failures_in_one_place(
        wsgi_thread, not_http):
    # fetch and zc-lb status's fetch_status each mapped urllib's errors to
    # messages of their own making, alike but for the words.
    from zkserver import free_port

    from zc_lb.cli.admin import fetch_status
    from zc_lb.status.document import answer_at

    address = wsgi_thread(status_app(lambda: {}))
    code, kind, body, reason = answer_at("http://%s/nothing" % address, address)
    assert (code, kind, json.loads(body)["error"], reason) == (
        404, "application/json", "no such page", "Not Found")
    nowhere = "127.0.0.1:%d" % free_port()
    for get, said in ((fetch, "cannot get status from http://%s/: " % nowhere),
                      (fetch_status, "cannot reach a status server at %s: " % nowhere)):
        with pytest.raises(ZcLbError) as info:
            get(nowhere, timeout=2)
        assert str(info.value).startswith(said) and type(info.value) is ZcLbError
    there = not_http(2)
    for get, where in ((fetch, "http://%s/" % there), (fetch_status, there)):
        with pytest.raises(ConfigurationError) as info:
            get(there, timeout=2)
        assert str(info.value) == ("%s is not a zc-lb status server: BadStatusLine: "
                                   "SSH-2.0-OpenSSH" % where)


# -- printing --------------------------------------------------------------------


def test_the_table_has_a_row_per_worker_with_its_state_and_top_skills():
    lines = format_status(DOCUMENT, max_skills=2).splitlines()
    assert lines[0] == "pool: resume  variance=1.0  backlog_history=9  unskilled_score=1.0"
    assert lines[1] == ("backlog=3  mean backlog=1.5  in flight=3  requests=120  retries=2"
                        "  errors={'502': 1}")
    assert lines[2] == ""
    header, *rows, why = lines[3:]
    assert cells(header) == ["worker", "state", "version", "backlog", "mean", "classes",
                             "top skills (req/s)"]
    assert why == "127.0.0.1:8003 down: refused"  # (the JSON's reason, under the table)
    assert [cells(row) for row in rows] == [  # sorted by address
        ["127.0.0.1:8001", "in pool", "-", "3", "1.5", "3", "b=200, a=10"],  # 2 best of 3
        ["127.0.0.1:8002", "draining", "-", "0", "0.0", "0"],
        ["127.0.0.1:8003", "down", "-", "-", "-", "0"],
        ["127.0.0.1:8004", "drained", "7", "0", "0.0", "0"],
        ["127.0.0.1:8005", "idle (other version)", "8", "0", "0.0", "0"]]
    column = header.index("state")  # columns aligned under their header
    assert all(row[column - 2:column] == "  " and row[column] != " " for row in rows)


def test_the_document_of_a_real_lb_prints():
    lb = LB(Pool(), host_classifier)
    text = format_status(lb.status())
    assert text.startswith("pool: ") and "requests=0" in text
    assert text.splitlines()[-1].split()[0] == "worker"  # no workers, no rows


def test_zc_lb_status_prints_the_table_or_the_json(wsgi_thread, capsys):
    address = wsgi_thread(status_app(lambda: DOCUMENT))
    assert cli.main(["status", address]) == 0
    assert capsys.readouterr().out == format_status(DOCUMENT) + "\n"
    assert cli.main(["status", "--json", address]) == 0
    assert json.loads(capsys.readouterr().out) == bound_skills(DOCUMENT)


def test_zc_lb_status_of_an_unreachable_address_is_a_one_line_error(capsys):
    from zkserver import free_port
    assert cli.main(["status", "127.0.0.1:%d" % free_port()]) == 1  # nobody there: not a typo
    err = capsys.readouterr().err
    assert err.startswith("zc-lb status: error: cannot reach a status server at ")
    assert err.count("\n") == 1


def test_the_admin_commands_exit_1_when_nothing_answers(capsys):
    # drain, enable and reset-skills exited 2 (a configuration error) where
    # status exits 1, and the docs say 1: nobody there is not a typo.
    from zkserver import free_port
    nowhere = "127.0.0.1:%d" % free_port()
    for argv in (["status", nowhere], ["drain", nowhere, "10.0.0.5:9001"],
                 ["enable", nowhere, "10.0.0.5:9001"], ["reset-skills", "--status", nowhere]):
        assert cli.main(argv) == 1, argv
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1, argv
        assert err.startswith("zc-lb %s: error: cannot " % argv[0]) and nowhere in err, argv


ADMIN_COMMANDS = {"status": ["status", "{}"], "drain": ["drain", "{}", "10.0.0.5:9001"],
                  "enable": ["enable", "{}", "10.0.0.5:9001"],
                  "reset-skills": ["reset-skills", "--status", "{}"]}


@pytest.mark.parametrize("command", sorted(ADMIN_COMMANDS))
def test_the_admin_commands_wait_their_timeout_for_an_answer(command, silent, capsys):
    # They waited 5 s, fixed: an LB --processes N whose supervisor gives
    # its children --child-action-timeout 5 s or more answered after they
    # had said nothing answered.
    address, = silent()
    argv = [arg.format(address) for arg in ADMIN_COMMANDS[command]]
    started = time.monotonic()
    assert cli.main(argv + ["--timeout", "0.3"]) == 1
    took = time.monotonic() - started
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith("zc-lb %s: error: cannot " % command) and address in err, err
    assert err.endswith(": timed out\n"), err
    assert 0.25 < took < 1.5


@pytest.fixture
def trickling():
    """"127.0.0.1:PORT" where an answer comes a byte every 0.2 s, for
    10 s at most (a server stuck in its send loop, or a slow link)."""
    import socket
    import threading

    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def trickle():
        conn = server.accept()[0]
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.recv(65536)
        answer = b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n" + b"X: y\r\n" * 50
        with conn:
            for i in range(50):
                if stop.wait(0.2):
                    break
                try:
                    conn.sendall(answer[i:i + 1])
                except OSError:
                    break

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    yield "127.0.0.1:%d" % server.getsockname()[1]
    stop.set()
    thread.join(5)
    server.close()


@pytest.mark.parametrize("command", ["status", "drain"])
def test_the_admin_commands_timeout_is_for_the_whole_answer_not_each_read(
        command, trickling, capsys):
    # --timeout S was urllib's, each read's: an answer that came a byte
    # every 0.2 s kept zc-lb status --timeout 1 waiting 16 s.
    argv = [arg.format(trickling) for arg in ADMIN_COMMANDS[command]]
    started = time.monotonic()
    assert cli.main(argv + ["--timeout", "1"]) == 1
    took = time.monotonic() - started
    err = capsys.readouterr().err
    assert err.startswith("zc-lb %s: error: cannot " % command) and trickling in err, err
    assert err.endswith(": timed out\n"), err
    assert 0.9 < took < 1.6, took


def test_the_admin_commands_at_what_speaks_no_http_exit_2(not_http, capsys):
    # http.client's BadStatusLine (and InvalidURL, for a bad port) went
    # through as a traceback.
    address = not_http(3)
    for where in (address, "127.0.0.1:x"):
        for argv in (["status", where], ["drain", where, "10.0.0.5:9001"],
                     ["reset-skills", "--status", where]):
            assert cli.main(argv) == 2, argv
            out, err = capsys.readouterr()
            assert out == "" and err.count("\n") == 1, argv
            assert where in err and "is not a zc-lb status server" in err, (argv, err)


def test_zc_lb_reset_skills_sends_the_admin_token(wsgi_thread, tmp_path, capsys):
    # It had no --token-file: an LB with --admin-token-file answered 401, always.
    done = []
    address = wsgi_thread(status_app(lambda: DOCUMENT, {"reset-skills": lambda: done.append(1)},
                               token=b"t0ken"))
    token = tmp_path / "admin-token"
    token.write_text("t0ken\n")
    token.chmod(0o600)
    assert cli.main(["reset-skills", "--status", address, "--token-file", str(token)]) == 0
    assert done == [1]
    assert capsys.readouterr().out == "reset skills on the LB at %s\n" % address


def test_an_action_posted_to_what_is_no_status_server_fails(wsgi_thread, capsys):
    # An LB's front port hands the POST to the application; one answering
    # JSON made zc-lb drain say "drained", though nothing was.
    def application(environ, start_response):
        start_response("200 OK", [("Content-Type", "application/json")])
        return [b'{"ok": true}']
    address = wsgi_thread(application)
    for argv in (["drain", address, "10.0.0.5:9001"], ["enable", address, "10.0.0.5:9001"],
                 ["reset-skills", "--status", address]):
        assert cli.main(argv) == 2, argv
        out, err = capsys.readouterr()
        assert out == "", argv
        assert "is not a zc-lb status server" in err, argv


def test_an_admin_token_no_header_can_carry_is_refused_at_start(tmp_path, capsys):
    # A token file of two lines (or of random bytes) was taken: no action
    # could ever be taken, and zc-lb drain blamed the LB ("is not a zc-lb
    # status server: ValueError: Invalid header value").
    import subprocess
    import sys

    token = tmp_path / "admin-token"
    token.write_bytes(b"first line\nsecond line\n")
    token.chmod(0o600)
    assert cli.main(["reset-skills", "--status", "127.0.0.1:1", "--token-file", str(token)]) == 2
    err = capsys.readouterr().err
    assert "admin token file %s holds a control character" % token in err, err
    try:
        result = subprocess.run(
            [sys.executable, "-m", "zc_lb.cli", "lb", "--listen", "127.0.0.1:0", "--status",
             "127.0.0.1:0", "--admin-token-file", str(token)],
            capture_output=True, text=True, timeout=15)
    except subprocess.TimeoutExpired:
        pytest.fail("the LB started with a token no header can carry")
    assert result.returncode == 2, result.stderr
    assert "holds a control character (a line break?)" in result.stderr
