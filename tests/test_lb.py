"""Tests for zc_lb.lb.balancer: classifying, retry budget, drains, and what it forwards."""

from __future__ import annotations

import logging
import time

import gevent
import orjson
import pytest

from zc_lb.routing.affinity import AffinityPool
from zc_lb.routing.pool import Pool
from zc_lb.routing.classifier import MAX_CLASS, bounded_class, get_classifier, get_key_function
from zc_lb.lb.balancer import LB
from zc_lb.errors import ConfigurationError
from zc_lb.status.document import worker_state
from zc_lb.testing import wait_for


def make_lb(classifier, key="path") -> LB:
    return LB(AffinityPool(), classifier, affinity_key=get_key_function(key))


def test_a_class_and_an_affinity_key_per_request():
    lb = make_lb(lambda environ: environ["HTTP_HOST"])
    assert lb._classify({"HTTP_HOST": "a", "PATH_INFO": "/x"}) == ("a", "/x")
    lb = make_lb(lambda environ: 42, key="none")
    assert lb._classify({"PATH_INFO": "/x"}) == ("42", None)


def test_a_stopped_lb_closes_a_classifier_that_can_be_closed():
    closed = []

    class Classifier:  # (as lb/guard.py's, once moved to threads)
        def __call__(self, environ):
            return "a"

        def close(self):
            closed.append(True)

    make_lb(lambda environ: "a").stop()  # (a plain function: nothing to close)
    make_lb(Classifier()).stop()
    assert closed == [True]


def test_a_long_class_is_cut_to_a_bounded_name_that_keeps_classes_apart():
    # An 8 KiB Host header must not become an 8 KiB class, kept in every
    # worker's résumé and the LB's pool.
    lb = make_lb(get_classifier("host"))
    short = "a" * MAX_CLASS
    assert lb._classify({"HTTP_HOST": short, "PATH_INFO": "/"})[0] == short
    names = set()
    for n in range(3):
        host = "x" * 8000 + "%d.example" % n
        rclass = lb._classify({"HTTP_HOST": host, "PATH_INFO": "/"})[0]
        assert len(rclass) == MAX_CLASS and rclass.startswith("x" * 200)
        assert lb._classify({"HTTP_HOST": host, "PATH_INFO": "/"})[0] == rclass  # stable
        names.add(rclass)
    assert len(names) == 3
    assert bounded_class("é" * 300) != bounded_class("é" * 301)


def test_a_class_utf8_cannot_encode_is_escaped_and_the_status_and_metrics_serve():
    # A module: classifier decoding the path's bytes with surrogateescape
    # (as WSGI applications do) made a class of lone surrogates: /metrics
    # (UnicodeEncodeError) and /status.json (orjson) failed for as long as
    # it was among the busiest.
    from zc_lb.status.document import status_app
    from zc_lb.status.metrics import LBCollector
    from zc_lb.status.page import render

    lb = make_lb(lambda environ: environ["PATH_INFO"].encode("latin-1").decode(
        "utf-8", "surrogateescape"))
    assert lb._classify({"PATH_INFO": "/caf\xe9"})[0] == "/caf\\udce9"
    assert lb._classify({"PATH_INFO": "/caf\xc3\xa9"})[0] == "/caf\xe9"
    assert bounded_class("\ud800" * 300).isascii()  # (cut short too, not a surrogate left)
    lb.counters.count_class(lb._classify({"PATH_INFO": "/caf\xe9"})[0] or "")
    app = status_app(lb.status, collector=LBCollector(lb.status), page=render)
    for path, shown in (("/metrics", b"/caf\\\\udce9"), ("/status.json", b"/caf\\\\udce9"),
                        ("/", b"/caf\\udce9")):
        environ = {"REQUEST_METHOD": "GET", "PATH_INFO": path, "SERVER_NAME": "x",
                   "SERVER_PORT": "80", "wsgi.url_scheme": "http", "QUERY_STRING": "",
                   "HTTP_ACCEPT": "text/html"}
        status = []
        body = b"".join(app(environ, lambda line, headers: status.append(line)))
        assert status == ["200 OK"] and shown in body, path


def test_a_classifier_returning_none_means_no_class():
    lb = make_lb(lambda environ: None)
    assert lb._classify({"PATH_INFO": "/x"}) == (None, "/x")  # not the class "None"
    lb.pool.add("a")
    lb.pool.add("b")
    assert lb.pool.get(None, "/x") in ("a", "b")
    assert not lb.pool.skilled  # classless requests teach nothing


def test_a_failing_classifier_is_logged_once_per_error_and_counted(caplog):
    def classify(environ):
        if environ["PATH_INFO"] == "/type":
            raise TypeError("bad type")
        raise KeyError(environ["PATH_INFO"])

    lb = make_lb(classify)
    with caplog.at_level(logging.ERROR, logger="zc_lb.lb.balancer"):
        for _ in range(5):
            assert lb._classify({"PATH_INFO": "/type"}) == (None, None)
        for _ in range(3):
            assert lb._classify({"PATH_INFO": "/k"}) == (None, None)
    logged = [r for r in caplog.records if "classifier failed" in r.getMessage()]
    assert len(logged) == 2  # one per distinct error, with its traceback
    assert all(r.exc_info for r in logged)
    assert lb.status()["classifier_errors"] == {"TypeError: bad type": 5, "KeyError: '/k'": 3}


def test_a_failing_classifier_whose_errors_say_what_the_client_sent_is_logged_once(caplog):
    # Logged once per distinct message, a classifier failing on what each
    # client sent (int() of a header) logged a traceback a request: any
    # client could fill the LB's log.  Logged once per where it failed.
    lb = make_lb(lambda environ: int(environ["HTTP_X_TENANT"]))
    with caplog.at_level(logging.ERROR, logger="zc_lb.lb.balancer"):
        for n in range(50):
            assert lb._classify({"HTTP_X_TENANT": "t%d" % n, "PATH_INFO": "/"}) == (None, None)
        assert lb._classify({"HTTP_X_TENANT": "x" * 8000, "PATH_INFO": "/"}) == (None, None)
    assert len([r for r in caplog.records if "classifier failed" in r.getMessage()]) == 1
    errors = lb.status()["classifier_errors"]
    assert len(errors) == 51 and errors["ValueError: invalid literal for int() with base 10: 't7'"] == 1
    assert max(len(error) for error in errors) <= 200  # (not an 8 KiB header in the status)


def test_a_classifier_whose_result_is_not_text_routes_without_a_class(caplog):
    # Its result was made text outside the guard: a __str__ that raised,
    # or an int too long for str(), made the request a 500.
    class Unprintable:
        def __str__(self):
            raise RuntimeError("no text")

    for result, error in ((Unprintable(), "RuntimeError: no text"),
                          (10 ** 5000, "ValueError: Exceeds the limit")):
        lb = make_lb(lambda environ: result)
        with caplog.at_level(logging.ERROR, logger="zc_lb.lb.balancer"):
            assert lb._classify({"PATH_INFO": "/x"}) == (None, None)
        assert list(lb.status()["classifier_errors"])[0].startswith(error)


def test_a_classifier_returning_bytes_gives_their_text_as_the_class():
    # Not the class "b'tenant'".
    lb = make_lb(lambda environ: environ["PATH_INFO"].encode("latin-1")[1:])
    assert lb._classify({"PATH_INFO": "/tenant"}) == ("tenant", "/tenant")
    assert lb._classify({"PATH_INFO": "/caf\xc3\xa9"})[0] == "caf\xe9"
    assert lb._classify({"PATH_INFO": "/caf\xe9"})[0] == "caf\\udce9"  # (not UTF-8)
    assert make_lb(lambda environ: bytearray(b"t"))._classify({"PATH_INFO": "/"})[0] == "t"


def test_a_classifier_that_exits_does_not_end_the_lb(caplog):
    # SystemExit from a request's greenlet reached gevent's hub, which
    # raises it in the main greenlet: one request ended the LB.
    import sys

    lb = make_lb(lambda environ: sys.exit(3))
    with caplog.at_level(logging.ERROR, logger="zc_lb.lb.balancer"):
        assert lb._classify({"PATH_INFO": "/x"}) == (None, None)
    assert lb.status()["classifier_errors"] == {"SystemExit: 3": 1}


def test_the_retry_budget_is_the_room_the_healthy_workers_have():
    lb = make_lb(lambda environ: "a")
    assert lb._may_retry({})  # no worker: it waits for one, as a new request does
    lb.pool.add("w1")
    lb.pool.add("w2")
    # 12 requests were lost with a third worker: with 15 still counted in
    # flight, each healthy worker may reach ceil(16 / 2) = 8.
    lb.flight.requests = 15
    for _ in range(4):
        lb.pool.get("a")  # four on w1 or w2
    placed = 0
    while lb._may_retry({}):
        lb.pool.get("a")
        placed += 1
    assert placed == 12 and lb.counters.retries_refused == 1
    environ = {}
    assert not lb._may_retry(environ)
    assert "no worker has room" in environ["zc_lb.retry_refused"]
    assert max(w.backlog for w in lb.pool.workers.values()) == 8


def test_an_idle_pool_has_room_for_three_retries_a_worker():
    lb = make_lb(lambda environ: "a")
    lb.pool.add("w1")
    assert lb.pool.room(0, 3) == 3
    assert lb.pool.room(0) == 1


def test_drain_waits_for_a_quiet_spell_on_events():
    lb = make_lb(lambda environ: "a")
    lb.pool.add("w")
    assert lb.drain(5, quiet=0.05)  # nothing in flight: quiet at once
    lb._get_worker("a", "/x")  # a request starts ...
    assert not lb.flight.idle.is_set()
    gevent.spawn_later(0.1, lb.flight.worker_done, "w")  # ... and ends
    started = time.monotonic()
    assert lb.drain(5, quiet=0.05)
    assert 0.1 <= time.monotonic() - started < 2


def test_a_request_during_the_quiet_spell_restarts_it():
    lb = make_lb(lambda environ: "a")
    lb.pool.add("w")

    def one_more():  # a keep-alive client's last request
        lb._get_worker("a", "/x")
        gevent.sleep(0.1)
        lb.flight.worker_done("w")

    gevent.spawn_later(0.02, one_more)
    started = time.monotonic()
    assert lb.drain(5, quiet=0.1)
    assert time.monotonic() - started >= 0.2  # 0.02 + the request + a whole quiet spell


def test_a_drained_worker_away_from_the_registry_can_be_enabled_and_comes_back_enabled():
    # Drained, then deregistered (away for maintenance): enabling it was
    # refused ("no worker"), and once it registered again the LB (every
    # child of --processes that had it) still held it drained.
    lb = make_lb(lambda environ: "a")
    fleet, address = lb.fleet, "127.0.0.1:1"  # (never connects: it need not)
    try:
        fleet.set_workers([address])
        fleet.drain_worker(address)
        fleet.set_workers([])
        assert fleet.enable_worker(address) is True
        fleet.set_workers([address])
        assert address not in fleet.drained
        with pytest.raises(ConfigurationError, match="no worker 127.0.0.9:1"):
            fleet.enable_worker("127.0.0.9:1")  # (neither known nor drained: a typo)
    finally:
        fleet.set_workers([])


def test_drain_gives_up_at_its_timeout():
    lb = make_lb(lambda environ: "a")
    lb.pool.add("w")
    lb._get_worker("a", "/x")  # never ends
    assert lb.drain(0.1, quiet=0.05) is False


def test_past_the_classes_it_counts_the_lb_still_forwards_each_requests_own_class(monkeypatch):
    # The status counts a bounded table of classes by name and the rest
    # as "other"; the worker is told each request's own class all the same.
    import gevent.socket

    import zc_lb.lb.stats
    from zc_lb.front.server import FrontServer
    from zc_lb.worker.server import Worker

    def app(environ, start_response):
        body = environ["zc_lb.request_class"].encode()
        start_response("200 OK", [("Content-Length", str(len(body)))])
        return [body]

    monkeypatch.setattr(zc_lb.lb.stats, "MAX_COUNTED_CLASSES", 2)
    worker = Worker(app)
    worker.start()
    lb = make_lb(get_classifier("host"))
    lb.fleet.set_workers(["%s:%d" % worker.address[:2]])
    front = FrontServer(("127.0.0.1", 0), lb)
    front.start()
    try:
        assert lb.fleet.wait_for_workers(10)
        bodies = []
        for host in ("a.example", "b.example", "c.example", "d.example"):
            sock = gevent.socket.create_connection(front.address)
            sock.sendall(b"GET / HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n"
                         % host.encode())
            with sock.makefile("rb") as answer:  # (to the end: Connection: close)
                bodies.append(answer.read().split(b"\r\n\r\n", 1)[1])
            sock.close()
        assert bodies == [b"a.example", b"b.example", b"c.example", b"d.example"]
        # (the table full, the class with the fewest requests, the oldest
        # first, is folded into "other" to make room)
        assert lb.counters.classes == {"other": 2, "c.example": 1, "d.example": 1}
        # Response times by worker and by class as counted (for the page).
        doc = lb.status()
        address = "%s:%d" % worker.address[:2]
        assert sum(doc["workers"][address]["latency"]["counts"]) == 4
        assert {name: sum(h["counts"]) for name, h in doc["class_latency"].items()} == {
            "c.example": 1, "d.example": 1, "other": 2}
        from zc_lb.status.metrics import LBCollector, exposition

        text = exposition(LBCollector(lb.status)).decode()
        assert 'zc_lb_worker_response_seconds_count{worker="%s"} 4.0' % address in text
    finally:
        front.stop(timeout=1)
        lb.stop()
        worker.stop(timeout=1)


def test_two_lbs_hear_through_the_workers_where_each_sent_a_key():
    # frames.Keys: each LB sends the workers the keys it sent them, and
    # they relay them to the other LB, whose book then sends each key
    # where its data is, as one LB would.
    from zlib import crc32

    from zc_lb.routing.classstats import mixed
    from zc_lb.lb.fleet import _parts
    from zc_lb.worker.server import Worker

    def app(environ, start_response):
        start_response("200 OK", [])
        return [b""]

    workers = [Worker(app) for _ in range(2)]
    lbs = [make_lb(lambda environ: "c") for _ in range(2)]
    try:
        for worker in workers:
            worker.start()
        addresses = ["%s:%d" % worker.address for worker in workers]
        for lb in lbs:
            lb.pool.lbs = 2
            lb.fleet.set_workers(addresses)
            assert lb.fleet.wait_for_workers(10)
            lb.fleet.relay_turn()
            assert lb.pool.relayed
        first, second = lbs
        # A request held on one worker: the first LB's new keys go to the other.
        busy = first.pool.get("c", "/busy")
        placed = {}
        for i in range(20):
            handle = placed["/k%d" % i] = first.pool.get("c", "/k%d" % i)
            first.pool.put(handle)
        assert {handle.peer for handle in placed.values()} != {busy.peer}
        first.fleet.relay_turn()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and len(second.pool.book) < len(placed):
            gevent.sleep(0.01)
        for key, handle in placed.items():  # (and the book decides, see test_affinity)
            entry = second.pool.book.get(mixed(crc32(key.encode()) ^ second.pool.hash_seed))
            went = second.pool.relearning.by_ident[entry[1]]
            assert entry[0] == "c" and went.handle.peer == handle.peer, key
        first.pool.put(busy)
        # A worker that dies: its keys are not sent, the relays go on for
        # the other.
        for i in range(20):
            first.pool.put(first.pool.get("c", "/k%d" % i))
        workers[1].stop(timeout=0)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and len(first.pool) == 2:
            gevent.sleep(0.01)
        assert len(first.pool) == 1
        first.fleet.relay_turn()
        assert first.pool.relayed
        # One LB alone (ZooKeeper's count of 1) relays nothing.
        first.pool.lbs = 1
        first.fleet.relay_turn()
        assert not first.pool.relayed
    finally:
        for lb in lbs:
            lb.stop()
        for worker in workers:
            worker.stop(timeout=1)
    # A frame's worth of keys at most in each part; all of them in all.
    keys = {"c%d" % i: list(range(i * 10000, i * 10000 + 9000)) for i in range(3)}
    parts = _parts(keys)
    assert len(parts) > 1 and all(len(orjson.dumps(part)) < 256 * 1024 for part in parts)
    merged = {}
    for part in parts:
        for rclass, hashes in part.items():
            merged.setdefault(rclass, []).extend(hashes)
    assert merged == keys


def test_every_live_lb_setting_has_one_holder():
    # The settings table says which settings are live; each is held by the
    # pool (a policy's SETTINGS), the LB itself (LB.SETTINGS), or the
    # ZooKeeper membership (a token, and the version rule).
    from zc_lb.routing.policies import POLICIES
    from zc_lb.settings import LB_SETTINGS, LIVE, given_in
    pooled = set().union(*(policy.SETTINGS for policy in POLICIES.values()))
    held = pooled | set(LB.SETTINGS) | {"reset_skills", "single_version"}
    assert set(given_in(LB_SETTINGS, LIVE)) == held
    assert not pooled & set(LB.SETTINGS)


def test_configure_changes_the_pool_and_the_lb_and_logs_each(caplog):
    lb = make_lb(lambda environ: "a")
    with caplog.at_level(logging.INFO, logger="zc_lb.settings"):
        lb.configure({"variance": 2.0, "no_worker_timeout": 1.5, "port": 80}, "test")
    assert lb.pool.variance == 2.0 and lb.no_worker_timeout == 1.5
    assert "no_worker_timeout 5 -> 1.5 (test)" in caplog.text
    with pytest.raises(ConfigurationError):
        lb.configure({"variance": 3.0, "no_worker_timeout": -1})
    assert lb.pool.variance == 2.0 and lb.no_worker_timeout == 1.5


def test_a_setting_the_policy_does_not_take_is_said_once_a_value(caplog):
    # The published policy has no spread: set, it changes nothing, and says so,
    # once for each value (ZooKeeper hands over every setting at each change).
    lb = LB(Pool(), lambda environ: "a")
    with caplog.at_level(logging.WARNING, logger="zc_lb.lb.balancer"):
        lb.configure({"spread": 1.0, "balance": 1.5}, "zk")  # (the defaults)
        assert not caplog.records
        lb.configure({"spread": 2.0}, "zk")
        lb.configure({"spread": 2.0, "variance": 3.0}, "zk")
    said = [record.getMessage() for record in caplog.records]
    assert said == ["spread = 2 (zk): the published policy does not use it "
                    "(--policy affinity does)"]
    with pytest.raises(ConfigurationError):  # a bad value is bad under any policy
        lb.configure({"spread": -1.0, "variance": 4.0})
    assert lb.pool.variance == 3.0


def test_an_lb_of_another_policy_keeps_its_workers_when_keys_are_relayed_to_it():
    # The workers relay an affinity LB's keys to every other LB: one of
    # the published policy (another policy during a rolling change, say)
    # has no book to put them in, and its connection to the worker failed
    # on each relay (AttributeError), every 50 ms.
    from zc_lb.worker.server import Worker

    def app(environ, start_response):
        start_response("200 OK", [])
        return [b""]

    worker = Worker(app)
    affinity = make_lb(lambda environ: "c")
    published = LB(Pool(), lambda environ: "c")
    try:
        worker.start()
        address = "%s:%d" % worker.address
        for lb in (affinity, published):
            lb.pool.lbs = 2
            lb.fleet.set_workers([address])
            assert lb.fleet.wait_for_workers(10)
        affinity.fleet.relay_turn()
        assert affinity.pool.relayed
        connection = published.fleet.links[address].connection
        for i in range(5):
            affinity.pool.put(affinity.pool.get("c", "/k%d" % i))
        affinity.fleet.relay_turn()
        deadline = time.monotonic() + 0.5  # (the relayed frame's way back)
        while time.monotonic() < deadline and not connection.closed:
            gevent.sleep(0.01)
        assert not connection.closed and published.fleet.links[address].connection is connection
    finally:
        for lb in (affinity, published):
            lb.stop()
        worker.stop(timeout=1)


def test_relayed_keys_of_classes_json_escapes_go_in_frames_a_worker_takes():
    # A class is the classifier's (a re: one on the path can give control
    # characters, which JSON writes as six bytes each): parts sized by the
    # class's length made frames over the limit, and the worker dropped
    # the LB's connection and its requests in flight.
    from zc_lb.lb.fleet import RELAY_FRAME, _parts
    from zc_lb.wire.encoder import encode
    from zc_lb.wire.frames import HEADER_SIZE, MAX_MESSAGE, Keys

    for char in ("\x01", '"', "\u4e2d", "\U0001f600", "a"):
        keys = {bounded_class(char * 300 + str(i)): [2 ** 64 - 1 - i] for i in range(2000)}
        keys["many"] = list(range(2 ** 64 - 20000, 2 ** 64))
        parts = _parts(keys)
        sizes = [len(encode(Keys(part))) - HEADER_SIZE for part in parts]
        assert max(sizes) <= RELAY_FRAME < MAX_MESSAGE, char
        merged = {}
        for part in parts:
            for rclass, hashes in part.items():
                merged.setdefault(rclass, []).extend(hashes)
        assert merged == keys


def test_a_worker_known_by_two_addresses_is_pooled_once():
    # Listed as 127.0.0.1:P and localhost:P (or listed and registered), one
    # worker process was two in the pool: its requests counted toward two
    # backlogs, so it took twice its share and the backlog cap's double.
    from zc_lb.worker.server import Worker

    worker = Worker(_echo_class_app)
    worker.start()
    lb = make_lb(get_classifier("host"))
    port = worker.address[1]
    try:
        lb.fleet.set_workers(["127.0.0.1:%d" % port, "localhost:%d" % port])
        assert lb.fleet.wait_for_workers(10)
        assert len(lb.pool) == 1
        doc = lb.status()["workers"]
        pooled = [address for address, info in doc.items() if info["in_pool"]]
        twin = [address for address, info in doc.items() if info["twin_of"]]
        assert len(pooled) == 1 and len(twin) == 1 and doc[twin[0]]["twin_of"] == pooled[0]
        assert worker_state(doc[twin[0]]) == "pooled as %s" % pooled[0]
        # The address pooled is no more (deregistered): the other serves.
        lb.fleet.set_workers(twin)
        wait_for(lambda: lb.status()["workers"][twin[0]]["in_pool"], message="the other address pooled")
        assert lb.status()["workers"][twin[0]]["in_pool"]
        assert lb.status()["workers"][twin[0]]["twin_of"] is None
    finally:
        lb.stop()
        worker.stop(timeout=0.5)


def _echo_class_app(environ, start_response):
    start_response("200 OK", [("Content-Length", "2")])
    return [b"ok"]
