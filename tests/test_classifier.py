"""Tests for zc_lb.routing.classifier: host, re:ENVKEY:PATTERN, module:dotted.name."""

from __future__ import annotations

import os.path
import time

import pytest

from zc_lb.routing.classifier import (get_classifier, get_key_function, host_classifier,
                                      import_object, regex_classifier)
from zc_lb.errors import ConfigurationError


# Importable helpers for module:expr specs ("test_classifier:..."; pytest
# puts tests/ on sys.path, as conftest.py's own imports rely on).
def classify_by_method(environ):
    return str(environ.get("REQUEST_METHOD", "")).lower()


class Classifiers:
    @staticmethod
    def first_segment(environ):
        return str(environ.get("PATH_INFO", "")).split("/")[1]


NOT_CALLABLE = {"a": "b"}


def wsgi_app(environ, start_response):
    return []


def make_classifier():
    return classify_by_method


class Callable:
    def __call__(self, environ, extra=None):
        return "c"


def any_arguments(*args, **kw):
    return "c"


CALLABLE = Callable()


# -- host --------------------------------------------------------------------------


@pytest.mark.parametrize("host,expected", [
    ("example.com", "example.com"),
    ("Example.COM", "example.com"),
    ("www.example.com", "example.com"),
    ("WWW.Example.com", "example.com"),
    ("www.example.com:8080", "example.com"),
    ("example.com:443", "example.com"),
    ("wwwexample.com", "wwwexample.com"),
    ("shop.www.example.com", "shop.www.example.com"),
    ("www.www.example.com", "www.example.com"),
    ("127.0.0.1:8080", "127.0.0.1"),
    ("[::1]", "[::1]"),
    ("[::1]:8080", "[::1]"),
    ("[2001:DB8::1]:443", "[2001:db8::1]"),
    ("[::1", "[::1"),
    ("www.", ""),
    (":8080", ""),
])
def test_host(host, expected):
    assert host_classifier({"HTTP_HOST": host}) == expected
    assert get_classifier("host")({"HTTP_HOST": host, "SERVER_NAME": "other"}) == expected


@pytest.mark.parametrize("host", [
    "example.com.", "Example.COM.", "example.com.:8080", "www.example.com.",
    "WWW.Example.com.:443",
])
def test_host_with_the_trailing_dot_of_a_fully_qualified_name_is_the_same_class(host):
    # ``example.com.`` (curl sends it as it was given) names the host
    # ``example.com`` does: two classes split its skills and its keys.
    assert host_classifier({"HTTP_HOST": host}) == "example.com"


def test_host_falls_back_to_server_name():
    assert host_classifier({"SERVER_NAME": "WWW.Fallback.org", "SERVER_PORT": "80"}) == (
        "fallback.org")
    assert host_classifier({"HTTP_HOST": "", "SERVER_NAME": "fallback.org"}) == "fallback.org"


def test_host_missing_is_the_empty_class():
    assert host_classifier({}) == ""
    assert host_classifier({"HTTP_HOST": "", "SERVER_NAME": ""}) == ""


def test_host_spec_is_stripped():
    assert get_classifier("host") is host_classifier
    assert get_classifier("  host\n") is host_classifier


# -- re:ENVKEY:PATTERN -----------------------------------------------------------


def test_regex_match():
    classify = get_classifier("re:PATH_INFO:^/(?P<class>[^/]+)")
    assert classify({"PATH_INFO": "/tenant1/page"}) == "tenant1"
    assert classify({"PATH_INFO": "/tenant2"}) == "tenant2"


def test_regex_is_searched_not_matched():
    classify = get_classifier("re:QUERY_STRING:site=(?P<class>\\w+)")
    assert classify({"QUERY_STRING": "a=1&site=blue&b=2"}) == "blue"


def test_regex_no_match_or_missing_key_is_the_empty_class():
    classify = get_classifier("re:PATH_INFO:^/(?P<class>[^/]+)")
    assert classify({"PATH_INFO": "/"}) == ""
    assert classify({"PATH_INFO": ""}) == ""
    assert classify({}) == ""
    assert classify({"PATH_INFO": None}) == ""


def test_regex_optional_group_that_did_not_take_part():
    classify = get_classifier("re:PATH_INFO:^/(x/(?P<class>\\w+))?")
    assert classify({"PATH_INFO": "/x/abc"}) == "abc"
    assert classify({"PATH_INFO": "/y"}) == ""


def test_regex_pattern_may_contain_colons():
    classify = get_classifier("re:HTTP_HOST:^(?P<class>[^:]+):\\d+$")
    assert classify({"HTTP_HOST": "a.example:8080"}) == "a.example"
    assert classify({"HTTP_HOST": "a.example"}) == ""


def test_regex_non_string_values_are_searched_as_text():
    classify = get_classifier("re:SERVER_PORT:(?P<class>\\d+)")
    assert classify({"SERVER_PORT": 8080}) == "8080"


def test_regex_classifier_name():
    classify = regex_classifier("PATH_INFO", "(?P<class>.)")
    assert classify.__name__ == "re:PATH_INFO:(?P<class>.)"


# -- module:expr ------------------------------------------------------------------


def test_module_expr_function_in_a_module():
    classify = get_classifier("test_classifier:classify_by_method")
    assert classify({"REQUEST_METHOD": "POST"}) == "post"


def test_module_expr_attribute_path():
    classify = get_classifier("test_classifier:Classifiers.first_segment")
    assert classify({"PATH_INFO": "/docs/intro"}) == "docs"


def test_module_expr_dotted_module():
    assert get_classifier("os.path:basename").func is os.path.basename
    assert import_object("os:path.basename") is os.path.basename


@pytest.mark.parametrize("source, cause", [
    ("raise RuntimeError('no database')\n", "RuntimeError: no database"),
    ("import sys; sys.exit('SITE is not set')\n", "SystemExit: SITE is not set"),
    ("def classify(environ)\n", "expected ':'"),
])
def test_a_classifier_module_that_fails_as_it_loads_is_a_configuration_error_saying_where(
        tmp_path, monkeypatch, source, cause):
    # It ended the LB with a traceback and status 1 (a service manager
    # restarts that), where the same module as a worker's application
    # exits 2 with one line.
    name = "brokenclassifier%d" % abs(hash(source))
    (tmp_path / (name + ".py")).write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigurationError) as refused:
        get_classifier(name + ":classify")
    message = str(refused.value)
    assert message.startswith("cannot load the classifier %s:classify: " % name), message
    assert cause in message and "%s.py, line 1" % name in message


@pytest.mark.parametrize("spec, cause", [
    ("nosuchmodule_zc_lb:classify", "cannot import 'nosuchmodule_zc_lb': No module named"),
    ("zc_lb.nosuchmodule:classify", "cannot import 'zc_lb.nosuchmodule': No module named"),
    ("os:nosuchattr", "os has no attribute 'nosuchattr'"),
    ("os:path.nosuch", "os.path has no attribute 'nosuch'"),
    ("os", "expected module:dotted.name"),
    ("os:1abc", "bad name '1abc'"),
])
def test_a_classifier_that_cannot_be_imported_is_named_with_its_spec(spec, cause):
    # "cannot import 'nosuchmodule_zc_lb' from ..." did not say it was the
    # classifier: with an application given too, which of them was it?
    with pytest.raises(ConfigurationError) as refused:
        get_classifier(spec)
    message = str(refused.value)
    assert message.startswith("cannot load the classifier %s: " % spec), message
    assert cause in message, message
    assert message.count(spec) == 1, message


def slow_classifier(environ):
    time.sleep(float(environ.get("SLEEP", 0)))
    return "slow"


def test_a_site_classifier_that_blocks_is_logged_once_and_moved_to_threads(caplog):
    # A 20 ms classifier cut an LB from about 1,560 requests/s to 69.
    import gevent

    for _ in range(5):  # (a fast call preempted past 5 ms on a busy machine reads slow)
        classify = get_classifier("test_classifier:slow_classifier")
        if classify({}) == "slow" and classify.pool is None:  # fast: inline
            break
        caplog.clear()
    assert classify.pool is None
    assert classify({"SLEEP": "0.02"}) == "slow" and classify.pool is not None
    logged = [r.getMessage() for r in caplog.records if "blocking" in r.getMessage()]
    assert len(logged) == 1 and "test_classifier:slow_classifier took" in logged[0]
    # From now on the loop stays free: 8 slow calls at once take one's time
    # (0.3 s), not eight's (2.4 s), and the loop ticks meanwhile.  (Half of
    # eight's as the bound: a test run beside others may wait for a CPU.)
    started = time.monotonic()
    jobs = [gevent.spawn(classify, {"SLEEP": "0.3"}) for _ in range(8)]
    ticks = 0
    while not all(job.ready() for job in jobs):
        gevent.sleep(0.01)
        ticks += 1
    assert time.monotonic() - started < 1.2 and ticks > 5
    assert [job.value for job in jobs] == ["slow"] * 8
    status = classify.status()
    assert status["threaded"] and status["slow_calls"] == 9
    assert len([r for r in caplog.records if "blocking" in r.getMessage()]) == 1
    # Closed (the LB stops), its threads end, not left for the process's life.
    threads = len(os.listdir("/proc/self/task"))
    classify.close()
    deadline = time.monotonic() + 5
    while len(os.listdir("/proc/self/task")) > threads - 8 and time.monotonic() < deadline:
        gevent.sleep(0.01)
    assert len(os.listdir("/proc/self/task")) <= threads - 8


def test_a_request_waits_a_bounded_time_for_a_classifier_hung_in_its_threads():
    # Moved to threads, a classifier that hung (a lookup with no timeout)
    # held its request, and once its threads were all taken every other
    # request, for ever: now each is routed without a class after ``wait``.
    import threading

    import gevent

    from zc_lb.lb.guard import Guarded

    release = threading.Event()

    def hangs(environ):
        if environ.get("HANG"):
            release.wait(30)
        return "c"

    classify = Guarded(hangs, slow=0.0, threads=2, wait=0.2)  # (every call is slow)
    try:
        assert classify({}) == "c" and classify.pool is not None
        started = time.monotonic()
        jobs = [gevent.spawn(classify, {"HANG": "1"}) for _ in range(4)]  # (2 wait for a thread)
        gevent.joinall(jobs, timeout=5)
        assert time.monotonic() - started < 2
        assert all(isinstance(job.exception, TimeoutError) for job in jobs)
        assert "gave no answer in 0.2 s" in str(jobs[0].exception)
        release.set()  # (the hung calls end; the next is answered)
        assert gevent.spawn(classify, {}).get(timeout=5) == "c"
    finally:
        release.set()
        classify.close()


def test_a_classifier_moved_to_threads_comes_back_to_the_loop_once_it_proves_fast(caplog):
    # One slow call (a busy machine preempting a fast function) moved it
    # to threads for the LB's life, some 65 us of CPU a request.  Now it
    # comes back after back_after fast calls there, and each time it is
    # slow anew the next return waits twice as long.
    import threading

    import gevent

    from zc_lb.lb.guard import Guarded

    ran_in = []

    def classifier(environ):
        ran_in.append(threading.get_ident())
        time.sleep(float(environ.get("SLEEP", 0)))
        return "c"

    loop = threading.get_ident()
    classify = Guarded(classifier, slow=0.05, back_after=5)
    try:
        def call(environ=None):
            return gevent.spawn(classify, environ or {}).get(timeout=5)

        assert call() == "c" and ran_in[-1] == loop
        assert call({"SLEEP": "0.08"}) == "c" and classify.status()["threaded"]
        for _ in range(4):
            assert call() == "c" and ran_in[-1] != loop and classify.status()["threaded"]
        assert call() == "c" and not classify.status()["threaded"]  # (the fifth fast one)
        assert call() == "c" and ran_in[-1] == loop
        assert classify.status()["moved_back"] == 1
        # Slow again on the loop: back in the threads, for 10 fast calls now.
        assert call({"SLEEP": "0.08"}) == "c" and classify.status()["threaded"]
        for _ in range(9):
            call()
        assert classify.status()["threaded"] and ran_in[-1] != loop
        call()
        assert not classify.status()["threaded"] and classify.status()["moved_back"] == 2
        assert classify.status()["slow_calls"] == 2
        warned = [r for r in caplog.records if "blocking" in r.getMessage()]
        assert len(warned) == 1  # (the first move alone is a warning)
    finally:
        classify.close()


@pytest.mark.parametrize("spec", ["test_classifier:wsgi_app", "test_classifier:make_classifier"])
def test_a_module_classifier_that_cannot_take_one_argument_is_refused_at_start(spec):
    # It was accepted, and every request's call raised TypeError: the
    # site ran without classes, one line in the log saying why.
    with pytest.raises(ConfigurationError, match="one argument"):
        get_classifier(spec)


def test_a_module_classifier_may_take_one_argument_any_way():
    for spec in ("test_classifier:CALLABLE", "test_classifier:any_arguments",
                 "test_classifier:classify_by_method"):
        get_classifier(spec)
    assert get_classifier("builtins:len").func is len


@pytest.mark.parametrize("spec", [
    "", " ", "re:", "re:KEY", "re:KEY:", "re::(?P<class>x)", "re:KEY:(",
    "re:KEY:(?P<class>", "re:KEY:x", "re:KEY:(?P<klass>x)", "re:KEY:(x)",
    "nosuchmodule_zc_lb:x", "zc_lb.nosuchmodule:x", "os:nosuchattr", "os:path.nosuchattr",
    "os:", ":basename", "os", "os:1abc", "os:path..basename", "os:path.", "os:a-b",
    "os:sep", "test_classifier:NOT_CALLABLE", "os.path:sep",
])
def test_bad_specs(spec):
    with pytest.raises(ConfigurationError):
        get_classifier(spec)


@pytest.mark.parametrize("envkey", [
    "path_info", "Path_Info", "HTTP_X-TENANT", "HTTP_x_tenant", " PATH_INFO", "HTTP HOST",
])
def test_an_envkey_no_request_can_have_is_refused_at_start(envkey):
    # It was accepted, and every request got the empty class (or no key).
    with pytest.raises(ConfigurationError, match="environ key"):
        get_classifier("re:%s:(?P<class>x)" % envkey)
    with pytest.raises(ConfigurationError, match="environ key"):
        get_key_function("re:%s:x" % envkey)


def test_an_envkey_may_be_any_a_request_can_have():
    for envkey in ("PATH_INFO", "HTTP_X_TENANT", "REMOTE_ADDR", "wsgi.url_scheme"):
        assert get_classifier("re:%s:(?P<class>.+)" % envkey)({envkey: "v"}) == "v"
        assert get_key_function("re:%s:.+" % envkey)({envkey: "v"}) == "v"


def test_bad_spec_messages_say_what_is_wrong():
    with pytest.raises(ConfigurationError, match="class"):
        get_classifier("re:KEY:(?P<klass>x)")
    with pytest.raises(ConfigurationError, match="not callable"):
        get_classifier("os:sep")
    with pytest.raises(ConfigurationError, match="nosuchattr"):
        get_classifier("os:nosuchattr")
    with pytest.raises(ConfigurationError, match="nosuchmodule_zc_lb"):
        get_classifier("nosuchmodule_zc_lb:x")


def test_relative_module_spec_is_a_configuration_error():
    with pytest.raises(ConfigurationError):
        get_classifier(".foo:bar")
