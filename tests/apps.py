"""WSGI applications that the end-to-end tests run in real worker processes.

One app, dispatching on the path:

    /            who served it: worker address and request class
    /slow?S      sleeps S seconds (gevent) first
    /block?S     sleeps S seconds blocking the thread (time.sleep), as most apps do
    /count       reads the body in chunks; answers how many bytes came
    /sha256      reads the body in odd-sized reads; answers its SHA-256, hex
    /big?MB      streams MB mebibytes
    /headers     the forwarding headers it got, as JSON
    /bighead?KB  answers with a response head of KB kibibytes (one long header)
    /error       raises
    /upload-slow reads the body slowly; writes a mark file if cancelled
    /endless     streams 1 KiB blocks, no Content-Length, for at most 20 s
                 (?late: start_response in its first block); its close()
                 writes the mark file "closed", holding how many it gave

With ZC_LB_TEST_FAIL=1 in its environment a worker answers 500 at once to
everything: a broken deploy.
"""

import os
import time

import gevent

MIB = 1024 * 1024
CHUNK = b"z" * MIB


def _text(start_response, text, status="200 OK"):
    body = text.encode()
    start_response(status, [("Content-Type", "text/plain"),
                            ("Content-Length", str(len(body)))])
    return [body]


def _mark(name, text=None):
    directory = os.environ.get("ZC_LB_TEST_MARKS")
    if directory:
        with open(os.path.join(directory, name), "w") as f:
            f.write(str(os.getpid()) if text is None else text)


def count_body(environ):
    """How many bytes of request body came (read in chunks)."""
    read = environ["wsgi.input"].read
    total = 0
    while True:
        data = read(65536)
        if not data:
            return total
        total += len(data)


def _upload_slow(environ, start_response):
    _mark("started")
    try:
        read = environ["wsgi.input"].read
        while read(4096):
            gevent.sleep(0.05)
    except BaseException:
        _mark("cancelled")
        raise
    return _text(start_response, "done")


class _Endless:
    """A body without end (20 s at most, for a test's bound), whose
    close() writes the mark "closed", holding how many blocks it gave;
    ``late``: start_response called in its first block."""

    def __init__(self, start_response, late):
        self.start_response, self.late, self.given = start_response, late, 0
        if not late:
            self._start()

    def _start(self):
        self.start_response("200 OK", [("Content-Type", "application/octet-stream"),
                                       ("X-Endless", "yes")])

    def __iter__(self):
        if self.late:
            self._start()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and self.given < 1000000:
            self.given += 1
            yield b"e" * 1024
            gevent.sleep(0)  # (--greenlets: the worker's loop goes on)

    def close(self):
        _mark("closed", str(self.given))


def app(environ, start_response):
    if os.environ.get("ZC_LB_TEST_FAIL"):
        return _text(start_response, "broken\n", "500 Internal Server Error")
    path = environ["PATH_INFO"]
    query = environ.get("QUERY_STRING", "")
    if path == "/slow":
        gevent.sleep(float(query or 1))
    elif path == "/block":
        time.sleep(float(query or 1))
    elif path == "/cpu":  # a CPU-bound view: this many ms of the thread's CPU
        end = time.thread_time() + float(query or 1) / 1000
        while time.thread_time() < end:
            pass
    elif path == "/count":
        return _text(start_response, str(count_body(environ)))
    elif path == "/sha256":
        import hashlib
        digest, read = hashlib.sha256(), environ["wsgi.input"].read
        while True:
            data = read(70001)
            if not data:
                return _text(start_response, digest.hexdigest())
            digest.update(data)
    elif path == "/big":
        megabytes = int(query or 1)
        start_response("200 OK", [("Content-Type", "application/octet-stream"),
                                  ("Content-Length", str(megabytes * MIB))])
        return (CHUNK for _ in range(megabytes))
    elif path == "/headers":
        import json
        return _text(start_response, json.dumps({
            name: environ.get(name) for name in (
                "REMOTE_ADDR", "HTTP_X_FORWARDED_FOR", "HTTP_X_FORWARDED_PROTO",
                "HTTP_X_FORWARDED_HOST", "HTTP_X_REQUEST_ID")}))
    elif path == "/bighead":
        start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", "2"),
                                  ("X-Big", "b" * (int(query or 300) * 1024))])
        return [b"ok"]
    elif path == "/error":
        raise RuntimeError("application failure, on purpose")
    elif path == "/upload-slow":
        return _upload_slow(environ, start_response)
    elif path == "/endless":
        return _Endless(start_response, query == "late")
    return _text(start_response, "%s %s\n" % (
        environ.get("zc_lb.worker"), environ.get("zc_lb.request_class")))
