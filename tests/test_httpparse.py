"""httpparse.py, the pure request-head parser: its limits and rewrites.

The grammar case by case is the corpus (data/http_requests.json), fed in
chunks to the front's handler in process (test_http.py) and on the wire
(test_http_corpus.py); here are the edges that are sizes, and the head it
returns.
"""

import io

import pytest

from zc_lb.errors import BadRequest
from zc_lb.httpparse import (
    MAX_FIELD_LINE, MAX_FIELDS, check_head, parse_request_line, read_fields)


def fields_of(data, budget=10**6):
    return read_fields(io.BytesIO(data).readline, budget)


def status_of(call, *args):
    with pytest.raises(BadRequest) as info:
        call(*args)
    return info.value.http_status


def test_a_field_line_may_be_as_long_as_the_limit_and_no_longer():
    line = b"X: " + b"v" * (MAX_FIELD_LINE - 5) + b"\r\n"
    assert len(line) == MAX_FIELD_LINE
    assert fields_of(line + b"\r\n") == [("X", "v" * (MAX_FIELD_LINE - 5))]
    assert status_of(fields_of, b"X: v" + line + b"\r\n") == 431


def test_the_number_of_fields_is_limited():
    assert len(fields_of(b"X: y\r\n" * MAX_FIELDS + b"\r\n")) == MAX_FIELDS
    assert status_of(fields_of, b"X: y\r\n" * (MAX_FIELDS + 1) + b"\r\n") == 431


def test_the_head_budget_counts_every_byte_with_the_empty_line():
    data = b"X: y\r\nY: z\r\n\r\n"
    assert len(fields_of(data, budget=len(data))) == 2
    assert status_of(fields_of, data, len(data) - 1) == 431


def test_a_head_cut_short_is_the_client_leaving_not_a_bad_request():
    with pytest.raises(ConnectionAbortedError):
        fields_of(b"X: y\r\nY: z")


def test_absolute_form_gives_path_query_and_the_targets_host():
    method, target, version = parse_request_line(
        b"GET http://B.example:81?q=1#f HTTP/1.1\r\n")
    head = check_head(method, target, version, [("Host", "a.example"), ("X", "1")])
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
