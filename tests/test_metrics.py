"""Monitoring: /metrics (Prometheus), /status.json, /healthz and the status
page on the LB's --status address, and a worker's --status /metrics.

The end-to-end tests run real worker and LB processes, send real traffic
and parse the exposition back with prometheus_client's parser; the status
page is loaded in a real headless Chromium (selenium), which CI installs
(Makefile APT_PACKAGES, setup.py's test extra): it never skips.
"""

import http.client
import json
import os
import shutil
import tempfile
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from zc_lb.routing.affinity import AffinityPool
from zc_lb.lb.balancer import LB
from zc_lb.status.metrics import LBCollector, WorkerCollector, bound_classes, exposition
from zc_lb.status.document import RequestHistory, merge_status, status_app
from zc_lb.status.page import render, sparkline
from zc_lb.testing import LBProcess, WorkerProcess, wait_for

TESTS = os.path.dirname(os.path.abspath(__file__))
ENV = {"PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")}


def samples(text):
    """{(name, sorted label items): value} of an exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return out


def get(address, path="/", accept=None):
    """(status, content type, body text) of a GET."""
    request = urllib.request.Request("http://%s%s" % (address, path))
    if accept:
        request.add_header("Accept", accept)
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.status, response.headers["Content-Type"], response.read().decode()


def call(app, path="/", accept=None, method="GET"):
    environ = {"REQUEST_METHOD": method, "PATH_INFO": path, "SERVER_NAME": "x",
               "SERVER_PORT": "80", "wsgi.url_scheme": "http", "QUERY_STRING": ""}
    if accept:
        environ["HTTP_ACCEPT"] = accept
    started = {}
    body = b"".join(app(environ, lambda status, headers: started.update(
        status=status, headers=dict(headers))))
    return started["status"], started["headers"], body.decode()


# -- the app and the collector, without processes ------------------------------------


def test_routes_of_the_status_app():
    doc = {"pool": {"policy": "AffinityPool"}, "workers": {}, "requests": 3}
    app = status_app(lambda: doc, collector=LBCollector(lambda: doc), page=render)
    assert call(app, "/healthz")[::2] == ("200 OK", "ok\n")
    status, headers, body = call(app, "/status.json", accept="text/html")
    assert json.loads(body) == doc and headers["Content-Type"] == "application/json"
    assert headers["Cache-Control"] == "no-store"
    assert json.loads(call(app, "/")[2]) == doc  # no Accept: JSON, as ever
    assert json.loads(call(app, "/", accept="application/json")[2]) == doc
    assert json.loads(call(app, "/", accept="*/*")[2]) == doc  # curl
    status, headers, body = call(app, "/", accept="text/html,application/xhtml+xml,*/*;q=0.8")
    assert headers["Content-Type"].startswith("text/html") and "<table" in body
    status, headers, body = call(app, "/metrics")
    assert headers["Content-Type"].startswith("text/plain; version=")
    assert samples(body)["zc_lb_requests_total", ()] == 3
    # without a collector or a page, those fall back to the document
    plain = status_app(lambda: doc)
    assert json.loads(call(plain, "/", accept="text/html")[2]) == doc


def test_healthz_says_not_ready_while_the_lb_has_no_worker_in_its_pool():
    # An LB that can only answer 503 is not ready: a balancer or an
    # orchestrator in front of several should send elsewhere.
    from zc_lb.process.service import lb_status_app

    doc = {"pool": {}, "workers": {}, "requests": 0}
    in_pool = [0]
    app = lb_status_app(lambda: doc, {}, lambda: 0, None, lambda: in_pool[0])
    assert call(app, "/healthz")[::2] == ("503 Service Unavailable",
                                          "not ready: no worker in the pool\n")
    in_pool[0] = 2
    assert call(app, "/healthz")[::2] == ("200 OK", "ok\n")


def test_class_labels_are_bounded_to_the_busiest_and_other():
    classes = {"c%02d" % i: i for i in range(1, 51)}
    bounded = bound_classes(classes, 20)
    assert len(bounded) == 21
    assert set(bounded) - {"other"} == {"c%02d" % i for i in range(31, 51)}
    assert bounded["other"] == sum(range(1, 31))
    assert bound_classes({"a": 1, "other": 5}, 20) == {"a": 1, "other": 5}
    assert bound_classes({"a": 1}, 20) == {"a": 1}


def hit(lb, host):
    environ = {"REQUEST_METHOD": "GET", "PATH_INFO": "/", "QUERY_STRING": "",
               "HTTP_HOST": host, "SERVER_NAME": "x", "SERVER_PORT": "80"}
    b"".join(lb(environ, lambda status, headers: None))


def class_series(collector):
    return {dict(labels)["class"]: value for (name, labels), value in
            samples(exposition(collector).decode()).items()
            if name == "zc_lb_class_requests_total"}


def test_classes_seen_first_do_not_keep_the_busiest_out_of_the_series():
    # The first 1000 classes were counted by name for good, every later
    # one as "other": a scanner's random Host headers, once each, kept the
    # site's busiest class out of the series until a restart.
    from zc_lb.lb.stats import MAX_COUNTED_CLASSES
    from zc_lb.routing.classifier import get_classifier

    lb = LB(AffinityPool(), get_classifier("host"), no_worker_timeout=0)
    collector = LBCollector(lb.status)
    for i in range(MAX_COUNTED_CLASSES + 50):
        hit(lb, "junk%d.example" % i)
    before = class_series(collector)
    for _ in range(30):
        hit(lb, "shop.example")
    for i in range(MAX_COUNTED_CLASSES, 2 * MAX_COUNTED_CLASSES):  # more junk after
        hit(lb, "junk%d.example" % i)
    after = class_series(collector)
    assert after["shop.example"] == 30 and lb.status()["classes"]["shop.example"] == 30
    assert len(lb.counters.classes) <= MAX_COUNTED_CLASSES + 1
    assert after["other"] >= before["other"]
    assert sum(after.values()) == lb.counters.requests == 2 * MAX_COUNTED_CLASSES + 80


def test_no_worker_counts_as_a_503_by_cause_and_in_the_histogram():
    lb = LB(AffinityPool(), lambda environ: "a", no_worker_timeout=0)
    environ = {"REQUEST_METHOD": "GET", "PATH_INFO": "/", "QUERY_STRING": "",
               "HTTP_HOST": "a", "SERVER_NAME": "x", "SERVER_PORT": "80"}
    for _ in range(3):
        b"".join(lb(dict(environ), lambda status, headers: None))
    metrics = samples(exposition(LBCollector(lb.status)).decode())
    assert metrics["zc_lb_5xx_total", (("cause", "no_worker"),)] == 3
    assert metrics["zc_lb_errors_total", (("status", "503"),)] == 3
    assert metrics["zc_lb_response_seconds_count", ()] == 3
    assert metrics["zc_lb_response_seconds_bucket", (("le", "+Inf"),)] == 3
    assert metrics["zc_lb_class_requests_total", (("class", "a"),)] == 3
    assert lb.status()["recent_errors"][-1]["cause"] == "NoWorkerAvailable"


def test_the_pools_measured_gains_are_gauges_once_measured():
    def gauges(pool):
        doc = {"pool": dict(pool, policy="AffinityPool"), "requests": 0}
        return {name: value for (name, _), value in
                samples(exposition(LBCollector(lambda: doc)).decode()).items()
                if name.endswith("_gain")}

    assert gauges({"locality_gain": None, "first_visit_gain": None}) == {}
    assert gauges({"locality_gain": 12.5, "first_visit_gain": 1.1}) == {
        "zc_lb_pool_locality_gain": 12.5, "zc_lb_pool_first_visit_gain": 1.1}
    # (first visits at members measured no time, elsewhere some: +Inf)
    assert gauges({"first_visit_gain": "Infinity"}) == {
        "zc_lb_pool_first_visit_gain": float("inf")}


def test_merged_documents_sum_histograms_and_per_worker_counts():
    def doc(n):
        latency = {"buckets": [0.1], "counts": [n, 1], "sum": 0.5}
        return {"pool": {}, "requests": n,
                "workers": {"w": {"counts": {"2xx": n}, "latency": dict(latency)}},
                "latency": latency, "class_latency": {"a": dict(latency)},
                "classes": {"a": n}, "error_causes": {"NoWorkerAvailable": 1}}
    merged = merge_status([doc(2), doc(3)])
    assert merged["latency"] == {"buckets": [0.1], "counts": [5, 2], "sum": 1.0}
    assert merged["workers"]["w"]["latency"] == merged["latency"]
    assert merged["class_latency"] == {"a": merged["latency"]}
    assert merged["workers"]["w"]["counts"] == {"2xx": 5}
    assert merged["classes"] == {"a": 5} and merged["error_causes"] == {"NoWorkerAvailable": 2}


def test_the_request_rate_sparkline():
    counts = iter([0, 10, 30, 30])
    history = RequestHistory(lambda: next(counts), interval=1)
    for _ in range(4):
        history.sample()
    rates = [rate for _, rate in history.rates()]
    assert len(rates) == 3 and rates[0] > 0 and rates[2] == 0
    svg = sparkline([(0, 1.0), (1, 3.0), (2, 2.0)])
    assert svg.startswith("<svg") and "<polyline" in svg
    assert "<polyline" not in sparkline([])


@pytest.fixture
def in_process():
    """An LB (its front server on loopback) and one in-process worker of
    ``app``: (LB, front server, worker address)."""
    from zc_lb.front.server import FrontServer
    from zc_lb.routing.classifier import get_key_function
    from zc_lb.worker.server import Worker

    started = []

    def make(app):
        worker = Worker(app)
        worker.start()
        lb = LB(AffinityPool(), lambda environ: "a", affinity_key=get_key_function("none"),
                no_worker_timeout=1)
        address = "127.0.0.1:%d" % worker.address[1]
        lb.fleet.set_workers([address])
        front = FrontServer(("127.0.0.1", 0), lb)
        front.start()
        started.append((front, lb, worker))
        assert lb.fleet.wait_for_workers(10)
        return lb, front, address

    yield make
    for front, lb, worker in started:
        front.stop(timeout=1)
        lb.stop()
        worker.stop(timeout=1)


def ask(front, path):
    """The status line of a GET of ``path`` through ``front``."""
    import gevent.socket

    sock = gevent.socket.create_connection(front.address)
    sock.sendall(b"GET %s HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n" % path.encode())
    with sock.makefile("rb") as answer:
        line = answer.read().split(b"\r\n", 1)[0]
    sock.close()
    return line


def app_of_500s_and_slow_answers(environ, start_response):
    import gevent

    if environ["PATH_INFO"] == "/slow":
        gevent.sleep(0.5)
    status = "500 Internal Server Error" if environ["PATH_INFO"] == "/error" else "200 OK"
    start_response(status, [("Content-Length", "2")])
    return [b"ok"]


def test_the_workers_5xx_never_go_back_when_a_worker_is_removed(in_process):
    # The total was summed over the workers known at each scrape: a worker
    # removed took its 5xx with it, and Prometheus read a counter reset.
    lb, front, address = in_process(app_of_500s_and_slow_answers)
    for _ in range(3):
        assert ask(front, "/error").startswith(b"HTTP/1.1 500")
    assert ask(front, "/").startswith(b"HTTP/1.1 200")
    worker_5xx = ("zc_lb_5xx_total", (("cause", "worker"),))
    assert samples(exposition(LBCollector(lb.status)).decode())[worker_5xx] == 3
    lb.fleet.set_workers([])
    metrics = samples(exposition(LBCollector(lb.status)).decode())
    assert metrics[worker_5xx] == 3
    assert not any(name == "zc_lb_worker_requests_total" for name, _ in metrics)
    assert lb.status()["retired_workers"] == {"requests": 4, "5xx": 3, "2xx": 1}
    merged = merge_status([lb.status(), lb.status()])
    assert samples(exposition(LBCollector(lambda: merged)).decode())[worker_5xx] == 6


def test_an_answer_ending_after_its_worker_was_removed_counts_as_the_retired_workers(
        in_process):
    # It made the removed worker's counters anew (a leak under churn), and
    # the address, registered again, went on from them.
    import gevent

    lb, front, address = in_process(app_of_500s_and_slow_answers)
    assert ask(front, "/").startswith(b"HTTP/1.1 200")
    slow = gevent.spawn(ask, front, "/slow")
    gevent.sleep(0.2)
    lb.fleet.set_workers([])  # deregistered while a request is in flight
    assert slow.get(timeout=5).startswith(b"HTTP/1.1 200")
    assert lb.counters.workers == {} and lb.counters.worker_latency == {}
    assert lb.counters.retired == {"requests": 2, "2xx": 2}
    lb.fleet.set_workers([address])  # the same address, registered again
    assert lb.fleet.wait_for_workers(10)
    assert lb.status()["workers"][address]["counts"] == {}
    assert ask(front, "/").startswith(b"HTTP/1.1 200")
    assert lb.status()["workers"][address]["counts"] == {"requests": 1, "2xx": 1}


# -- real processes ------------------------------------------------------------------


@pytest.fixture
def cluster():
    started = []

    def make(n_workers=2, worker_status=False):
        workers = []
        for _ in range(n_workers):
            args = ["apps:app"]
            if worker_status:
                args += ["--status", "127.0.0.1:0"]
            worker = WorkerProcess(*args, env=ENV).start()
            worker.status_address = (worker.said("zc-lb worker status on ") if worker_status
                                     else None)
            started.append(worker)
            workers.append(worker)
        lb = LBProcess([w.address for w in workers], "--status", "127.0.0.1:0").start()
        lb.status_address = status = lb.said("zc-lb status on ")
        started.append(lb)

        def connected():
            try:
                doc = json.loads(get(status, "/status.json")[2])
            except OSError:
                return False
            return sum(bool(w.get("in_pool")) for w in doc["workers"].values()) == n_workers
        wait_for(connected, message="LB connected to workers")
        return lb, workers

    yield make
    for process in reversed(started):
        process.kill()


def send(lb, host, path="/", n=1):
    connection = http.client.HTTPConnection(*lb.address.split(":"), timeout=20)
    try:
        for _ in range(n):
            connection.request("GET", path, headers={"Host": host})
            response = connection.getresponse()
            response.read()
    finally:
        connection.close()


def test_metrics_count_what_was_sent(cluster):
    lb, workers = cluster(2)
    sent = 0
    for i in range(30):  # 30 classes, class i gets i + 1 requests
        send(lb, "c%02d.example" % i, n=i + 1)
        sent += i + 1
    send(lb, "c29.example", "/error", n=4)  # the application's 500s
    sent += 4
    status, kind, text = get(lb.status_address, "/metrics")
    assert status == 200 and kind.startswith("text/plain")
    metrics = samples(text)
    assert metrics["zc_lb_requests_total", ()] == sent
    assert metrics["zc_lb_response_seconds_count", ()] == sent
    assert metrics["zc_lb_response_seconds_bucket", (("le", "+Inf"),)] == sent
    assert metrics["zc_lb_5xx_total", (("cause", "worker"),)] == 4
    assert metrics["zc_lb_5xx_total", (("cause", "no_worker"),)] == 0
    addresses = {w.address for w in workers}
    per_worker = {labels[0][1]: value for (name, labels), value in metrics.items()
                  if name == "zc_lb_worker_requests_total"}
    assert set(per_worker) == addresses and sum(per_worker.values()) == sent
    responses = {(dict(labels)["worker"], dict(labels)["code"]): value
                 for (name, labels), value in metrics.items()
                 if name == "zc_lb_worker_responses_total"}
    assert sum(v for (_, code), v in responses.items() if code == "2xx") == sent - 4
    assert sum(v for (_, code), v in responses.items() if code == "5xx") == 4
    for address in addresses:
        for name in ("zc_lb_worker_connected", "zc_lb_worker_in_pool", "zc_lb_worker_backlog",
                     "zc_lb_worker_mean_backlog", "zc_lb_worker_skills",
                     "zc_lb_worker_in_flight", "zc_lb_worker_errors_total",
                     "zc_lb_worker_retries_total"):
            assert (name, (("worker", address),)) in metrics, name
        assert metrics["zc_lb_worker_connected", (("worker", address),)] == 1
    # classes: the 20 busiest by name, the other 10 summed, nothing more
    classes = {dict(labels)["class"]: value for (name, labels), value in metrics.items()
               if name == "zc_lb_class_requests_total"}
    assert len(classes) == 21
    assert classes["c29.example"] == 30 + 4 and classes["c10.example"] == 11
    assert classes["other"] == sum(range(1, 11))
    assert sum(classes.values()) == sent
    assert metrics["zc_lb_pool_variance", ()] > 0
    assert ("zc_lb_pool_info", (("policy", "AffinityPool"),)) in metrics


def test_healthz_status_json_and_the_worker_metrics(cluster):
    lb, workers = cluster(2, worker_status=True)
    assert get(lb.status_address, "/healthz")[::2] == (200, "ok\n")
    send(lb, "a.example", n=10)
    doc = json.loads(get(lb.status_address, "/status.json", accept="text/html")[2])
    assert doc["requests"] == 10 and doc["classes"] == {"a.example": 10}
    assert json.loads(get(lb.status_address, "/")[2])["requests"] == 10  # zc-lb status
    for worker in workers:
        assert get(worker.status_address, "/healthz")[::2] == (200, "ok\n")
        metrics = samples(get(worker.status_address, "/metrics")[2])
        assert metrics["zc_lb_app_lbs", ()] == 1
        assert ("zc_lb_app_seconds_total", ()) in metrics
        assert ("zc_lb_app_resume_classes", ()) in metrics
        assert 2 <= metrics["zc_lb_app_threads_taking_requests", ()] <= 16  # (thread mode)

    def served():  # a worker counts a request just after its last byte went out
        return sum(samples(get(w.status_address, "/metrics")[2])[
            "zc_lb_app_requests_total", (("outcome", "served"),)] for w in workers)

    wait_for(lambda: served() == 10, timeout=10, message="10 requests counted as served")
    # The app's seconds a request, in a histogram: every request served is in it.
    histograms = [samples(get(w.status_address, "/metrics")[2]) for w in workers]
    assert sum(m["zc_lb_app_request_seconds_count", ()] for m in histograms) == 10
    assert all(m["zc_lb_app_request_seconds_bucket", (("le", "+Inf"),)]
               == m["zc_lb_app_request_seconds_count", ()] for m in histograms)


def _chromium():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    raise AssertionError("no chromium: make sysdeps installs it (Makefile APT_PACKAGES)")


def test_the_status_page_in_a_browser(cluster):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    lb, workers = cluster(2)
    send(lb, "alpha.example", n=7)
    send(lb, "beta.example", n=5)
    options = webdriver.ChromeOptions()
    options.binary_location = _chromium()
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu",
                     "--disable-dev-shm-usage"):
        options.add_argument(argument)
    driver_path = shutil.which("chromedriver") or "/usr/bin/chromedriver"
    # (Chromium's singleton directory goes in TMPDIR and outlives the
    # browser: in one of the test's own, removed after, not one more in
    # /tmp each run; a short one, as its socket's path must fit 108 bytes.)
    scratch = tempfile.mkdtemp(prefix="zc-chromium-")
    service = Service(driver_path, env=dict(os.environ, TMPDIR=scratch))
    try:
        driver = webdriver.Chrome(service=service, options=options)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    try:
        driver.set_page_load_timeout(20)
        driver.get("http://%s/" % lb.status_address)
        assert driver.title == "zc-lb status"
        assert driver.find_element(By.ID, "requests").text == "12"
        # what a newcomer looks for: the version, where it listens, the policy
        # by the name given, the application's own 5xx beside the LB's errors
        assert driver.find_element(By.ID, "listening-on").text == "http://%s" % lb.address
        assert driver.find_element(By.ID, "version").text not in ("", "-")
        assert driver.find_element(By.ID, "policy").text == "affinity"
        assert driver.find_element(By.ID, "app-5xx").text == "0"
        assert driver.find_element(By.ID, "latency-p99").text.startswith("<=")
        rows = driver.find_elements(By.CSS_SELECTOR, "table.workers tbody tr")
        shown = {row.find_element(By.CLASS_NAME, "address").text: row for row in rows}
        assert set(shown) == {w.address for w in workers}
        requests = sum(int(row.find_elements(By.TAG_NAME, "td")[2].text)
                       for row in shown.values())
        assert requests == 12
        assert all("in pool" in row.text for row in shown.values())
        # response times by worker (those that served) and by class: "p50 / p99"
        latencies = [row.find_elements(By.TAG_NAME, "td")[5].text for row in shown.values()
                     if row.find_elements(By.TAG_NAME, "td")[2].text != "0"]
        assert latencies and all(" ms / " in text for text in latencies), latencies
        cells = {row.find_elements(By.TAG_NAME, "td")[0].text:
                 [cell.text for cell in row.find_elements(By.TAG_NAME, "td")[1:3]]
                 for row in driver.find_elements(By.CSS_SELECTOR, "table.classes tbody tr")}
        assert {name: cell[0] for name, cell in cells.items()} == {
            "alpha.example": "7", "beta.example": "5"}
        assert all(" ms / " in cell[1] for cell in cells.values()), cells
        assert driver.find_elements(By.CSS_SELECTOR, "#rate svg.sparkline")
        driver.find_element(By.LINK_TEXT, "metrics").click()
        assert "zc_lb_requests_total 12.0" in driver.find_element(By.TAG_NAME, "body").text
    finally:
        driver.quit()
        shutil.rmtree(scratch, ignore_errors=True)


# -- the sample configurations in etc/ -------------------------------------------------


def test_the_dashboard_uses_only_metrics_that_exist():
    import re

    from zc_lb.status.metrics import WorkerCollector

    root = os.path.join(TESTS, os.pardir, "etc")
    with open(os.path.join(root, "grafana-dashboard.json")) as f:
        dashboard = json.load(f)
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = set(re.findall(r"\bzc_lb_\w+", " ".join(exprs)))
    doc = {"pool": {"policy": "AffinityPool", "variance": 2.0}, "requests": 1,
           "latency": {"buckets": [0.1], "counts": [1, 0], "sum": 0.01},
           "workers": {"w:1": {"connected": True, "skills": {"a": 1.0}}}, "classes": {"a": 1}}
    emitted = set(samples(exposition(LBCollector(lambda: doc)).decode()))
    emitted |= set(samples(exposition(WorkerCollector(lambda: {"served": 1})).decode()))
    names = {name for name, _ in emitted}
    assert used and used <= names, used - names
    with open(os.path.join(root, "prometheus.yml")) as f:
        text = f.read()
    assert "metrics_path: /metrics" in text and "job_name: zc-lb-worker" in text
    import yaml  # the test extra installs PyYAML

    config = yaml.safe_load(text)
    assert {job["job_name"] for job in config["scrape_configs"]} == {"zc-lb", "zc-lb-worker"}


def test_the_build_info_says_the_version_and_whether_compiled():
    from zc_lb import build
    from zc_lb.cli.parsers import version
    from zc_lb.status.metrics import WorkerCollector, exposition

    for collector in (LBCollector(lambda: {"workers": {}}), WorkerCollector(lambda: {})):
        text = exposition(collector).decode()
        assert 'zc_lb_build_info{build="%s",version="%s"} 1.0' % (build(), version()) in text


def test_a_hung_thread_pool_shows_in_the_worker_metrics():
    # Every thread busy and requests piling up behind them: what an alert
    # on a hung application watches, as the status document says it.
    doc = {"served": 5, "failed": 0, "threads": {
        "size": 16, "taking_requests": 16, "busy": 16, "waiting": 40, "ceiling": 16}}
    metrics = samples(exposition(WorkerCollector(lambda: doc)).decode())
    assert metrics["zc_lb_app_threads_busy", ()] == 16
    assert metrics["zc_lb_app_threads_waiting", ()] == 40
