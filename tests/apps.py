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


def _mark(name):
    directory = os.environ.get("ZC_LB_TEST_MARKS")
    if directory:
        with open(os.path.join(directory, name), "w") as f:
            f.write(str(os.getpid()))


def _count(environ):
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
        return _text(start_response, str(_count(environ)))
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
    return _text(start_response, "%s %s\n" % (
        environ.get("zc_lb.worker"), environ.get("zc_lb.request_class")))
