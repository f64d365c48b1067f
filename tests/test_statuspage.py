"""zc_lb.status.page: the status document rendered as the HTML status page."""

import time
from html.parser import HTMLParser

from zc_lb.routing.affinity import AffinityPool
from zc_lb.routing.classifier import host_classifier
from zc_lb.lb.balancer import LB
from zc_lb.status.page import TOP_CLASSES, TOP_SKILLS, render


class Page(HTMLParser):
    """What a browser would show of a page: each table's rows of cell
    texts (by the table's class), the summary's values (by id), every tag
    opened, and the text of every paragraph."""

    def __init__(self, html):
        super().__init__(convert_charrefs=True)
        self.tables, self.summary, self.tags, self.paragraphs = {}, {}, [], []
        self.spans = []  # (class attribute, text) of each <span>
        self._table = self._row = self._cell = self._dd = self._p = self._span = None
        self.feed(html)
        self.close()

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append(tag)
        if tag == "table":
            self._table = self.tables.setdefault(attrs.get("class"), [])
        elif tag == "tr" and self._table is not None:
            self._row = []
        elif tag in ("td", "th") and self._row is not None:
            self._cell = []
        elif tag == "dd":
            self._dd, self._text = attrs.get("id"), []
        elif tag == "p":
            self._p = []
        elif tag == "span":
            self._span = (attrs.get("class"), [])

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self._row.append("".join(self._cell))
            self._cell = None
        elif tag == "tr" and self._row is not None:
            self._table.append(self._row)
            self._row = None
        elif tag == "table":
            self._table = None
        elif tag == "dd" and self._dd is not None:
            self.summary[self._dd] = "".join(self._text)
            self._dd = None
        elif tag == "p" and self._p is not None:
            self.paragraphs.append("".join(self._p))
            self._p = None
        elif tag == "span" and self._span is not None:
            self.spans.append((self._span[0], "".join(self._span[1])))
            self._span = None

    def handle_data(self, data):
        for part in (self._cell, self._p, self._span and self._span[1]):
            if part is not None:
                part.append(data)
        if self._dd is not None:
            self._text.append(data)

    def rows(self, table):
        """The body rows of ``table`` (the header row left out)."""
        header, *body = self.tables[table]
        return body


def worker(**fields):
    """A worker's entry as LB.status() writes it for a pooled worker."""
    info = {"connected": True, "in_pool": True, "drained": False, "standby": False,
            "backlog": 0, "mean_backlog": 0.0, "skills": {}, "version": None,
            "streams": 0, "last_error": None, "ejected": False, "counts": {}}
    info.update(fields)
    return info


HOSTILE = "<script>alert('x')</script>&amp;"


def test_the_page_names_every_worker_with_its_state_counts_backlog_and_best_classes():
    doc = {"pool": {"policy": "AffinityPool"}, "requests": 17, "workers": {
        "10.0.0.2:9001": worker(backlog=3, mean_backlog=2.25, version="v7",
                                skills={"a.example": 9.0, "b.example": 31.5},
                                counts={"requests": 12, "2xx": 10, "5xx": 2, "errors": 1},
                                latency={"buckets": [0.005, 0.01, 0.025, 0.05],
                                         "counts": [0, 8, 1, 1, 0], "sum": 0.2}),
        "10.0.0.1:9001": worker(connected=False, in_pool=False, last_error="refused"),
        "10.0.0.3:9001": worker(in_pool=False, ejected=True, backlog=1),
    }}
    page = Page(render(doc))
    rows = page.rows("workers")
    assert [row[0] for row in rows] == ["10.0.0.1:9001", "10.0.0.2:9001", "10.0.0.3:9001"]
    down, pooled, ejected = rows
    assert pooled == ["10.0.0.2:9001", "in pool", "12", "2xx:10 5xx:2", "1", "10 ms / 50 ms",
                      "3", "2.25", "2", "b.example=31.5, a.example=9", "v7"]
    assert down[1] == "down" and down[-1] == "refused" and down[3] == "-" and down[5] == "-"
    assert ejected[1].startswith("ejected") and ejected[6] == "1"
    # each state is a CSS class, so that down and ejected workers stand out
    assert {("down", "down"), ("in", "in pool")} <= set(page.spans)
    assert ("ejected", "ejected, ?s more: failures") in page.spans  # (no time in the doc)


def test_a_workers_best_classes_are_its_few_highest_scores_and_its_class_count_is_whole():
    skills = {"c%d" % i: float(i) for i in range(12)}
    doc = {"workers": {"w:1": worker(skills=skills)},
           "classes": {}}
    best = Page(render(doc)).rows("workers")[0][9]
    assert best == ", ".join("c%d=%d" % (i, i) for i in range(11, 11 - TOP_SKILLS, -1))
    # The status app trims a worker's skills and says how many it had.
    trimmed = {"workers": {"w:1": worker(skills={"c1": 1.0}, skills_count=40000)}}
    assert Page(render(trimmed)).rows("workers")[0][8] == "40000"


def test_the_busiest_classes_come_first_bounded_with_their_workers_best_scored_first():
    classes = {"site%02d.example" % i: 100 + i for i in range(3 * TOP_CLASSES)}
    doc = {"classes": classes, "workers": {
        "w:1": worker(skills={"site59.example": 2.0}),
        "w:2": worker(skills={"site59.example": 40.0, "site58.example": 1.0}),
        "w:3": worker(skills={"unrelated": 5.0})}}
    rows = Page(render(doc)).rows("classes")
    assert len(rows) == TOP_CLASSES
    busiest = sorted(classes, key=classes.get, reverse=True)[:TOP_CLASSES]
    assert [row[0] for row in rows] == busiest
    assert [int(row[1]) for row in rows] == [classes[name] for name in busiest]
    assert rows[0][3] == "w:2=40, w:1=2"
    assert rows[1][3] == "w:2=1"
    assert rows[2][3] == "-"
    assert rows[0][2] == "-"  # (no latency in the document)
    doc["class_latency"] = {busiest[0]: {"buckets": [0.1, 1.0], "counts": [1, 0, 1],
                                         "sum": 5.1}}
    assert Page(render(doc)).rows("classes")[0][2] == "100 ms / > 1 s"


def test_the_requests_without_a_class_are_shown_as_such():
    rows = Page(render({"classes": {"": 4, "a": 3}})).rows("classes")
    assert rows[0][:2] == ["(no class)", "4"]


def test_a_hostile_host_header_comes_out_escaped_wherever_it_shows():
    # An LB without workers answers 503, keeping the Host as the class and
    # the path in its recent errors: both end up on the page.
    lb = LB(AffinityPool(), host_classifier, no_worker_timeout=0)
    path = "/<img src=x onerror=alert(1)>&x=1"
    environ = {"REQUEST_METHOD": "GET", "PATH_INFO": path, "QUERY_STRING": "",
               "HTTP_HOST": HOSTILE, "SERVER_NAME": "x", "SERVER_PORT": "80"}
    b"".join(lb(environ, lambda status, headers: None))
    doc = lb.status()
    # A worker's résumé names the class too; what it says of itself is its own.
    doc["workers"]["w&1:80"] = worker(skills={HOSTILE: 3.0}, version="<b>1.0</b>")
    doc["workers"]["w:2"] = worker(connected=False, last_error="</td><script>x</script>")
    html = render(doc)
    page = Page(html)
    assert "script" not in page.tags and "img" not in page.tags and "b" not in page.tags
    assert "<script>" not in html and "<img" not in html
    # escaped once, not twice: what shows is what came
    classes = page.rows("classes")
    assert classes[0][0] == HOSTILE and classes[0][3] == "w&1:80=3"
    error, = page.rows("errors")
    assert error[1:4] == ["503", "NoWorkerAvailable", "GET " + path]
    workers = {row[0]: row for row in page.rows("workers")}
    assert workers["w&1:80"][9] == HOSTILE + "=3"
    assert workers["w&1:80"][10] == "<b>1.0</b>"
    assert workers["w:2"][10] == "</td><script>x</script>"
    assert len(workers["w:2"]) == 11  # the last error did not end its cell


def test_a_document_missing_its_optional_fields_still_renders():
    page = Page(render({}))
    assert page.rows("workers") == [] and page.rows("classes") == []
    assert "none" in page.paragraphs  # no recent errors
    assert page.summary["errors"] == "none"
    assert page.summary["uptime"] == page.summary["build"] == "-"  # (not "Nones")
    sparse = {"workers": {"w:1": {}}, "recent_errors": [{}], "processes": [{}],
              "classes": {"a": 1}}
    page = Page(render(sparse))
    row, = page.rows("workers")
    assert row[:9] == ["w:1", "down", "0", "-", "0", "-", "-", "-", "0"]
    assert len(page.rows("errors")) == 1
    assert page.rows("classes") == [["a", "1", "-", "-"]]


def test_the_summary_shows_the_documents_counters():
    doc = {"requests": 1234, "in_flight": 7, "retries": 2, "clients": 40,
           "errors": {"503": 1, "502": 2}, "uptime": 12.5, "build": "compiled",
           "pool": {"policy": "AffinityPool", "variance": 4.0, "backlog": 9,
                    "mean_backlog": 2.5}}
    summary = Page(render(doc)).summary
    assert summary == {"requests": "1234", "in-flight": "7", "retries": "2", "clients": "40",
                       "errors": "502: 2, 503: 1", "app-5xx": "0", "latency-p50": "-",
                       "latency-p99": "-", "policy": "affinity", "version": "-",
                       "build": "compiled", "listening-on": "-", "variance": "4.0",
                       "backlog": "9", "mean-backlog": "2.5", "uptime": "12.5s"}


def test_the_summary_says_the_apps_errors_latency_version_and_addresses():
    # "errors: none" while the application had answered five 500s, no
    # latency, no version, no address: what a newcomer missed.
    doc = {"errors": {}, "version": "0.1.0", "listen": ["0.0.0.0:80", "0.0.0.0:443"],
           "latency": {"buckets": [0.005, 0.01, 0.025, 1.0], "counts": [90, 5, 4, 0, 1]},
           "pool": {"policy": "ClasslessPool"},
           "workers": {"a:1": {"counts": {"5xx": 5}}, "b:1": {"counts": {"2xx": 9}}}}
    summary = Page(render(doc)).summary
    assert summary["errors"] == "none" and summary["app-5xx"] == "5"
    assert (summary["latency-p50"], summary["latency-p99"]) == ("<= 5 ms", "<= 25 ms")
    assert summary["policy"] == "classless" and summary["version"] == "0.1.0"
    assert summary["listening-on"] == "0.0.0.0:80, 0.0.0.0:443"


def test_an_ejected_worker_says_why_and_for_how_long_and_a_malformed_request_says_so():
    doc = {"workers": {"a:1": {"connected": True, "in_pool": False, "ejected": True,
                               "ejected_for": 12.5, "ejected_because": "5 failed requests"}},
           "recent_errors": [{"time": 0, "status": 400, "cause": "BadRequest",
                              "method": None, "path": None, "message": "bad head"}]}
    page = Page(render(doc))
    assert page.rows("workers")[0][1] == "ejected, 12.5s more: 5 failed requests"
    assert page.rows("errors")[0][3] == "(a malformed request)"


def test_recent_errors_are_listed_newest_first():
    start = time.mktime((2026, 11, 26, 9, 30, 0, 0, 0, -1))
    errors = [{"time": start + i, "status": 502 + i, "cause": "C%d" % i, "method": "GET",
               "path": "/%d" % i, "message": "m%d <&>" % i} for i in range(3)]
    rows = Page(render({"recent_errors": errors})).rows("errors")
    assert rows == [["09:30:0%d" % i, str(502 + i), "C%d" % i, "GET /%d" % i, "m%d <&>" % i]
                    for i in (2, 1, 0)]


def test_the_current_request_rate_comes_from_the_history():
    class History:
        def rates(self):
            return [(0.0, 10.0), (1.0, 42.31)]
    page = Page(render({}, History()))
    assert any(p.strip().endswith("42.3 requests/s now") for p in page.paragraphs)
    # the sparkline's scale: the top line's rate, and the time it covers
    assert any("top 42.3 requests/s, the last 1 s" in p for p in page.paragraphs)
    assert not any("requests/s now" in p for p in Page(render({})).paragraphs)


def test_each_lb_process_of_a_summed_document_is_listed():
    doc = {"processes": [{"index": 0, "pid": 101, "status": "127.0.0.1:8081", "requests": 5},
                         {"index": 1, "pid": 102, "status": "127.0.0.1:8082", "requests": 7}]}
    paragraphs = Page(render(doc)).paragraphs
    assert "process 0 (pid 101, status 127.0.0.1:8081): 5 requests" in paragraphs
    assert "process 1 (pid 102, status 127.0.0.1:8082): 7 requests" in paragraphs
