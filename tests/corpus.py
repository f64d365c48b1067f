"""The front's request corpus (data/http_requests.json) and how a test
reads it, shared by test_http_corpus.py (real processes, on the wire) and
test_http.py (the front handler in process).

A case is raw request bytes (a JSON string, one character a byte) and
what a client must get: for status 200, ``environ`` lists what the
worker must see (null: absent) and ``body`` the request body it must
read; any other status must come with the connection closed.  Each case
is tried in the chunkings of CHUNKINGS, as gunicorn's parser tests do.
``KeepOpen`` reads several responses off one connection (test_hardening.py
too).
"""

import json
import os
import random

CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "http_requests.json")
CHUNKINGS = ("whole", "bytes", "random")


def load_cases():
    with open(CORPUS, encoding="utf-8") as f:
        return json.load(f)["cases"]


CASES = load_cases()
IDS = [case["name"] for case in CASES]


def request_bytes(case):
    return case["request"].encode("latin-1")


def chunks(data, how, seed):
    """``data`` split as the chunking ``how`` says: whole, a byte at a
    time, or at up to four points drawn from ``random.Random(seed)``."""
    if how == "whole":
        return [data]
    if how == "bytes":
        return [data[i:i + 1] for i in range(len(data))]
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(data)), min(4, len(data) - 1)))
    return [data[a:b] for a, b in zip([0] + cuts, cuts + [len(data)])]


def check_answer(case, status, body, closed):
    """Assert that the answer (status, response body, whether the
    connection was closed after it) is the one ``case`` asks for; for
    200, ``body`` is the JSON of what the worker saw (echo_app.py)."""
    if case["status"] == 200:
        assert status == 200, body[:200]
        seen = json.loads(body)
        for key, value in case.get("environ", {}).items():
            assert seen.get(key) == value, (key, seen)
        if "body" in case:
            assert seen["body"] == case["body"]
    else:
        assert status == case["status"], body[:200]
        assert closed, "the connection stayed open after a refused request"


class KeepOpen:
    """A shared buffered reader that http.client cannot close, so one
    connection's read-ahead carries over from response to response."""

    def __init__(self, f):
        self._f = f

    def __getattr__(self, name):
        return getattr(self._f, name)

    def close(self):
        pass


class FileSock:
    """What http.client.HTTPResponse needs of a socket: a file to read."""

    def __init__(self, f):
        self.f = f

    def makefile(self, mode):
        return self.f
