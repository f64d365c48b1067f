"""httpparse.py, the rules across a request's fields: the head it returns.

The grammar case by case is the corpus (data/http_requests.json), fed in
chunks to the front in process (test_http.py) and on the wire
(test_http_corpus.py); the size limits are in test_h1.py.
"""

from zc_lb.front.httpparse import check_head


def test_absolute_form_gives_path_query_and_the_targets_host():
    head = check_head("GET", b"http://B.example:81?q=1#f", "HTTP/1.1",
                      [("Host", "a.example"), ("X", "1")])
    assert (head.path, head.version) == ("/?q=1", "HTTP/1.1")
    assert head.fields == [("X", "1"), ("Host", "B.example:81")]


def test_framing_fields_come_out_normalised():
    head = check_head("POST", b"/", "HTTP/1.1",
                      [("Host", "a"), ("Content-Length", "007, 7"), ("Connection", "Host, x")])
    assert (head.content_length, head.chunked, head.close) == (7, False, False)
    assert ("Content-Length", "7") in head.fields and ("Connection", "x") in head.fields
    head = check_head("POST", b"/", "HTTP/1.1", [("Host", "a"), ("Transfer-Encoding", "Chunked,")])
    assert (head.content_length, head.chunked) == (None, True)
    assert ("Transfer-Encoding", "chunked") in head.fields


def test_a_content_length_too_long_for_a_machine_word_is_only_too_large():
    head = check_head("POST", b"/", "HTTP/1.1", [("Host", "a"), ("Content-Length", "9" * 5000)])
    assert head.content_length >= 10**18  # the LB answers 413


def test_keepalive_follows_the_version_and_connection_tokens():
    def close(version, connection):
        fields = [("Host", "a")] + ([("Connection", connection)] if connection else [])
        return check_head("GET", b"/", version, fields).close
    assert not close("HTTP/1.1", None) and close("HTTP/1.1", "Close")
    assert close("HTTP/1.0", None) and not close("HTTP/1.0", "Keep-Alive")


def test_hosts_found_valid_are_remembered_within_a_bound_and_never_excuse_a_bad_one():
    import pytest

    from zc_lb.front import httpparse
    from zc_lb.errors import BadRequest

    for n in range(httpparse.MAX_VALID + 10):
        check_head("GET", b"/", "HTTP/1.1", [("Host", "h%d.example" % n)])
    assert 0 < len(httpparse._VALID_HOSTS) <= httpparse.MAX_VALID
    with pytest.raises(BadRequest, match="invalid Host"):
        check_head("GET", b"/", "HTTP/1.1", [("Host", "h1.example/x")])
    assert check_head("GET", b"/", "HTTP/1.1", [("Host", "h1.example")]).path == "/"
