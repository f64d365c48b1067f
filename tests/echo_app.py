"""A WSGI application that answers with what it was given, for the
front's request corpus (test_http_corpus.py): the environ's strings and
the body, as JSON."""

import json


def app(environ, start_response):
    echoed = {key: value for key, value in environ.items()
              if type(value) is str and not key.startswith("wsgi.")}
    echoed["body"] = environ["wsgi.input"].read().decode("latin-1")
    body = json.dumps(echoed).encode()
    start_response("200 OK", [("Content-Type", "application/json"),
                              ("Content-Length", str(len(body)))])
    return [body]
