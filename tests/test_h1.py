"""h1.py, requests from bytes: the size limits, chunkings, and the
request records it hands out.  The grammar case by case is the corpus
(data/http_requests.json, run by test_http.py and test_http_corpus.py)."""

import pytest

from corpus import CASES, request_bytes

from zc_lb.errors import ClientGone
from zc_lb.errors import BadResponseHead
from zc_lb.front.h1 import MAX_TARGET, RequestReader, check_response, ready_head
from zc_lb.front.httpparse import MAX_FIELD_LINE, MAX_FIELDS, MAX_HEAD


def read(*pieces):
    """The requests a reader hands out for ``pieces``, and the reader."""
    reader = RequestReader()
    found = []
    for piece in pieces:
        reader.receive_data(piece)
        while True:
            request = reader.next_request()
            if request is None:
                break
            found.append(request)
    return found, reader


def refusal_status(*pieces):
    [request], reader = read(*pieces)
    assert reader.broken and request.head is None
    return request.refusal.http_status


def head_of(size):
    """A GET head of exactly ``size`` bytes."""
    head = b"GET / HTTP/1.1\r\nHost: a\r\n"
    n = 0
    while len(head) + 2 < size:
        name = b"X-%03d: " % n
        room = min(MAX_FIELD_LINE, size - 2 - len(head)) - len(name) - 2
        head += name + b"v" * max(room, 0) + b"\r\n"
        n += 1
    return head + b"\r\n"


def test_a_head_of_the_limit_passes_and_one_byte_more_is_431():
    assert len(head_of(MAX_HEAD)) == MAX_HEAD
    [request], _ = read(head_of(MAX_HEAD))
    assert request.head is not None
    assert refusal_status(head_of(MAX_HEAD + 1)) == 431


def test_a_field_line_may_be_as_long_as_the_limit_and_no_longer():
    line = b"X: " + b"v" * (MAX_FIELD_LINE - 3) + b"\r\n"
    [request], _ = read(b"GET / HTTP/1.1\r\nHost: a\r\n" + line + b"\r\n")
    assert ("X", "v" * (MAX_FIELD_LINE - 3)) in request.head.fields
    assert refusal_status(b"GET / HTTP/1.1\r\nHost: a\r\nX: v" + line + b"\r\n") == 431


def test_the_number_of_fields_is_limited():
    def head(n):
        return b"GET / HTTP/1.1\r\n" + b"Host: a\r\n" + b"X: y\r\n" * (n - 1) + b"\r\n"
    [request], _ = read(head(MAX_FIELDS))
    assert len(request.head.fields) == MAX_FIELDS
    assert refusal_status(head(MAX_FIELDS + 1)) == 431


def test_a_head_that_never_ends_is_cut_at_the_limit_without_holding_it_all():
    reader = RequestReader()
    reader.receive_data(b"GET / HTTP/1.1\r\nHost: a\r\nX: ")
    for _ in range(100):  # 1.6 MB of one field value, 16 KiB at a time
        reader.receive_data(b"v" * 16384)
        if reader.broken:
            break
    assert reader.broken and reader.next_request().refusal.http_status == 431


CHUNKED = b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"


def test_a_trailer_section_that_never_ends_is_cut_at_the_head_limit():
    reader = RequestReader()
    reader.receive_data(CHUNKED + b"1\r\na\r\n0\r\nX-T: ")
    request = reader.next_request()
    for _ in range(100):  # 1.6 MB of one trailer field, 16 KiB at a time
        reader.receive_data(b"v" * 16384)
        if reader.broken:
            break
    assert reader.broken and not request.complete and request.error.http_status == 431


def test_a_trailer_section_has_the_head_limits_on_its_fields():
    fields = b"X: y\r\n" * MAX_FIELDS
    [request, after], reader = read(CHUNKED + b"1\r\na\r\n0\r\n" + fields + b"\r\n"
                                    b"GET / HTTP/1.1\r\nHost: a\r\n\r\n")
    assert request.complete and after.complete and not reader.broken
    for trailer in (fields + b"X: y\r\n", b"X: " + b"v" * MAX_FIELD_LINE + b"\r\n"):
        [request], reader = read(CHUNKED + b"1\r\na\r\n0\r\n" + trailer + b"\r\n")
        assert reader.broken and request.error.http_status == 431


def test_chunk_data_arriving_after_its_size_line_is_no_trailer():
    data = b"x" * (4 * MAX_HEAD)
    [request], reader = read(CHUNKED + b"%x\r\n" % len(data), data, b"\r\n0\r\n\r\n")
    assert request.complete and request.error is None and request.body_size == len(data)


def test_a_long_target_is_414():
    assert refusal_status(b"GET /" + b"a" * MAX_TARGET + b" HTTP/1.1\r\nHost: a\r\n\r\n") == 414



def test_an_lbs_hello_on_the_http_port_is_refused_saying_what_it_is():
    # An LB given this HTTP port as a worker's address sends its Hello:
    # "Invalid method encountered" left the operator to guess.
    from zc_lb.wire.encoder import encode
    from zc_lb.wire.handshake import new_hello

    [request], reader = read(encode(new_hello("lb", None)))
    assert request.refusal.http_status == 400
    assert "zc-lb LB's Hello" in str(request.refusal)
    assert "a worker's address" in str(request.refusal)

def test_a_head_cut_short_is_the_client_leaving_not_a_bad_request():
    found, reader = read(b"GET / HTTP/1.1\r\nHost: a\r\nX: y", b"")
    assert found == [] and reader.broken


def test_a_body_cut_short_is_the_client_leaving():
    [request], reader = read(b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 9\r\n\r\nabc", b"")
    assert isinstance(request.error, ClientGone) and not request.complete


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64])
def test_pipelined_requests_with_bodies_in_any_chunking(size):
    data = (b"POST /a HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhello"
            b"POST /b HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"3\r\nwor\r\n2\r\nld\r\n0\r\nX-Trailer: t\r\n\r\n"
            b"GET /c HTTP/1.1\r\nHost: a\r\n\r\n")
    found, reader = read(*[data[i:i + size] for i in range(0, len(data), size)])
    assert [r.head.path for r in found] == ["/a", "/b", "/c"]
    assert [b"".join(r.body) for r in found] == [b"hello", b"world", b""]
    assert all(r.complete for r in found) and not reader.broken
    assert ("X-Trailer", "t") not in found[1].head.fields


@pytest.mark.parametrize("first", [
    b"GET /a HTTP/1.1\r\nHost: a\r\nProxy-Connection: close\r\n\r\n",
    b"GET /a HTTP/1.1\r\nHost: a\r\nX-Tab: a\tb\r\nProxy-Connection: close\r\n\r\n",
    b"POST /a HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"1\r\nx\r\n0\r\nProxy-Connection: close\r\n\r\n",
])
@pytest.mark.parametrize("size", [1, 7, 1000])
def test_whether_a_request_ends_its_connection_is_its_heads_close_not_llhttps(first, size):
    # llhttp, strict, reads Proxy-Connection as Connection: after a head
    # (or a trailer) with "Proxy-Connection: close" that it parsed, the
    # request pipelined behind was refused 400 ("Data after `Connection:
    # close`"), though the front kept the connection open; a head read
    # by hand (``_simple``) had the next request served.
    data = first + b"GET /b HTTP/1.1\r\nHost: a\r\n\r\n"
    found, reader = read(*[data[i:i + size] for i in range(0, len(data), size)])
    assert [r.head and r.head.path for r in found] == ["/a", "/b"] and not reader.broken
    assert not found[0].head.close and all(r.complete for r in found)


def test_expect_100_continue_is_noted_on_http_1_1_only():
    [request], _ = read(b"PUT / HTTP/1.1\r\nHost: a\r\nExpect: 100-Continue\r\n"
                        b"Content-Length: 1\r\n\r\n")
    assert request.expect_continue
    [request], _ = read(b"PUT / HTTP/1.0\r\nExpect: 100-continue\r\nContent-Length: 1\r\n\r\n")
    assert not request.expect_continue


@pytest.mark.parametrize("status, headers", [
    ("200 OK", [("X", "a\nb")]), ("200 OK", [("X:", "a")]), ("200\r\nX: y", []),
    ("OK", []), (b"200 OK", []), ("200 OK", [("X", 1)]),
])
def test_a_response_head_that_could_split_is_refused(status, headers):
    with pytest.raises(BadResponseHead):
        check_response(status, headers)


@pytest.mark.parametrize("status", ["999 Weird", "600 Above", "099 Below", "20 Short",
                                    "2000 Long"])
def test_a_status_out_of_http_s_range_is_refused(status):
    # RFC 9110 15: a status code is three digits, 100-599 (a client takes
    # any other as a 5xx; the LB counted it a success, in no class).
    with pytest.raises(BadResponseHead):
        check_response(status, [])
    check_response("599 Edge", [])


def test_a_ready_head_says_a_repeated_content_length_once():
    head, length = ready_head("200 OK", [("Content-Length", "5"), ("X", "y"),
                                         ("content-length", "5")])
    assert head.count(b"ontent-") == 1 and length == 5
    with pytest.raises(BadResponseHead):
        ready_head("200 OK", [("Content-Length", "5"), ("Content-Length", "6")])


def test_start_response_again_follows_pep_3333():
    from zc_lb.front.h1 import start_again

    try:
        raise KeyError("the app's")
    except KeyError:
        import sys
        exc_info = sys.exc_info()
    start_again(None, started=False, status_set=False)  # the first call
    start_again(exc_info, started=False, status_set=True)  # an error page replaces the head
    with pytest.raises(KeyError, match="the app's"):  # the head is out: the error goes on
        start_again(exc_info, started=True, status_set=True)
    with pytest.raises(AssertionError, match="twice without exc_info"):
        start_again(None, started=False, status_set=True)


def test_statuses_and_names_found_valid_are_remembered_apart_and_within_a_bound():
    from zc_lb.front import h1
    from zc_lb.front import httpparse

    check_response("200 OK", [("X-A", "1")])
    # A status remembered as valid is no valid field name, nor the reverse.
    with pytest.raises(BadResponseHead):
        check_response("200 OK", [("200 OK", "1")])
    with pytest.raises(BadResponseHead):
        check_response("X-A", [])
    for n in range(httpparse.MAX_VALID + 10):
        check_response("200 OK", [("X-%d" % n, "v\t%d" % n)])
    assert 0 < len(h1._VALID_NAMES) <= httpparse.MAX_VALID
    # A value is searched whenever it is not plain printable text.
    for value in ("a\rb", "a\nb", "\x00", "a\x7f"):
        with pytest.raises(BadResponseHead):
            check_response("200 OK", [("X-A", value)])
    check_response("200 OK", [("X-A", "tab\there, and \xa0 or \x85 as before")])


def _outcome(requests, reader):
    """What a reader made of a request, for comparing two ways of reading it."""
    found = []
    for request in requests:
        head = request.head
        found.append(None if head is None else (
            head.method, head.path, head.version, head.fields, head.content_length,
            head.chunked, head.close, request.complete, request.expect_continue,
            b"".join(request.body)))
        found.append(None if request.refusal is None else (
            type(request.refusal), request.refusal.http_status, str(request.refusal)))
    return found, reader.broken


SIMPLE_VARIANTS = [
    b"GET / HTTP/1.1\r\nHost: a\r\n\r\n",
    b"GET / HTTP/1.0\r\n\r\n",
    b"HEAD /x?y=1&z HTTP/1.1\r\nHost: a:80\r\nX-A:v\r\nX-B:   spaced  value  \r\nX-C:\r\n\r\n",
    b"DELETE http://other:8080/p?q HTTP/1.1\r\nHost: a\r\n\r\n",
    b"OPTIONS * HTTP/1.1\r\nHost: a\r\n\r\n",
    b"GET * HTTP/1.1\r\nHost: a\r\n\r\n",  # asterisk-form with GET: 400
    b"GET / HTTP/1.1\r\n\r\n",  # no Host: 400
    b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a b\r\n\r\n",
    b"GET /%zz HTTP/1.1\r\nHost: a\r\n\r\n",
    b"GET /a#frag HTTP/1.1\r\nHost: a\r\n\r\n",
    b"GET http://b.example#frag HTTP/1.1\r\nHost: a\r\n\r\n",  # (llhttp: 400; by hand: 200)
    b"GET / HTTP/1.1\r\nHost: a\r\nConnection: close, x-a\r\nX-A: 1\r\n\r\n",
    b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\nRange: a\r\nRange: b\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\nRange: a\r\nrange: a\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\nX_A: underscore\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\nX-A : space\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\nX-A: tab\there\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\nX-A: del\x7f\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\nX-A: obs\xe9text\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\n folded\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\nno colon\r\n\r\n",
    b"GET  / HTTP/1.1\r\nHost: a\r\n\r\n",
    b"GET / HTTP/1.2\r\nHost: a\r\n\r\n",
    b"GET / HTTP/2.0\r\nHost: a\r\n\r\n",
    b"get / HTTP/1.1\r\nHost: a\r\n\r\n",
    b"CONNECT a:443 HTTP/1.1\r\nHost: a\r\n\r\n",
    b"\r\nGET / HTTP/1.1\r\nHost: a\r\n\r\n",
    b"GET /\x01 HTTP/1.1\r\nHost: a\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(101)) + b"\r\n",
]


# Bodies of a Content-Length, read by hand after a head read by hand.
BODY_VARIANTS = [
    b"POST /a HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhello",
    b"POST /a HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhelloGET /b HTTP/1.1\r\nHost: a\r\n\r\n",
    b"PUT /a HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\nabcPUT /b HTTP/1.1\r\nHost: a\r\n"
    b"Content-Length: 2\r\n\r\nde",
    b"POST /a HTTP/1.1\r\nHost: a\r\nContent-Length: 005\r\n\r\nhello",
    b"POST /a HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\nGET /b HTTP/1.1\r\nHost: a\r\n\r\n",
    b"POST /a HTTP/1.1\r\nHost: a\r\nContent-Length: 9\r\n\r\nhello",  # the rest to come
    b"POST /a HTTP/1.1\r\nHost: a\r\nContent-Length: 2, 2\r\n\r\nhi",
    b"POST /a HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nhi",
    b"POST /a HTTP/1.1\r\nHost: a\r\nContent-Length: +2\r\n\r\nhi",
    b"POST /a HTTP/1.1\r\nHost: a\r\nContent-Length:\r\n\r\nhi",
    b"POST /a HTTP/1.1\r\nHost: a\r\nContent-Length: 99999999999999999999\r\n\r\nhi",
    b"POST /a HTTP/1.1\r\nHost: a\r\nContent-Length: 999999999999999999\r\n\r\nhi",
    b"POST /a HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n",
    b"POST /a HTTP/1.0\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\nhi",
    b"POST /a HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\nhiGET / HTTP/1.1\r\n\r\n",
    b"POST /a HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\nhi\r\nGET / HTTP/1.1\r\nHost: a\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\n\r\nGET /b HTTP/1.1\r\nHost: a\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\nProxy-Connection: close\r\n\r\nGET /b HTTP/1.1\r\nHost: a\r\n\r\n",
]


@pytest.mark.parametrize("data", [request_bytes(case) for case in CASES] + SIMPLE_VARIANTS
                         + BODY_VARIANTS)
def test_a_head_read_whole_is_what_llhttp_makes_of_it_in_pieces(data):
    """A head that comes whole in one read may be read without llhttp
    (``RequestReader._simple``); it must come out exactly as llhttp's
    reading makes it, fed the same bytes in two pieces, whatever it is."""
    whole = _outcome(*read(data))
    assert whole == _outcome(*read(data[:-1], data[-1:]))
    assert whole == _outcome(*read(data[:3], data[3:]))


def test_the_simple_way_reads_the_commonest_heads():
    """Not a test of what comes out (the one above is), but that the
    quick way is taken where it should be, and not where it should not:
    llhttp's parser, fresh, says DELETE (method 0) until it parses a head."""
    def llhttp_read(data):
        reader = RequestReader()
        reader.receive_data(data)
        assert reader.next_request() is not None
        return reader._parser.get_method() == data.split(b" ")[0]

    simple = [SIMPLE_VARIANTS[i].replace(b"GET", b"HEAD", 1) for i in (0, 1, 2, 4)]
    assert not any(llhttp_read(data) for data in simple)
    assert not llhttp_read(SIMPLE_VARIANTS[0].replace(b"GET", b"HEAD") * 2)  # two in one read
    assert not llhttp_read(b"HEAD / HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\n")
    assert not llhttp_read(BODY_VARIANTS[0].replace(b"POST", b"HEAD"))
    assert llhttp_read(b"HEAD / HTTP/1.1\r\nHost: a\r\nX-A: tab\there\r\n\r\n")
    assert llhttp_read(BODY_VARIANTS[6].replace(b"POST", b"HEAD"))  # "2, 2": llhttp's to refuse


def test_a_counted_body_is_kept_as_it_came_and_ends_at_its_length():
    """A body read by hand goes into the request a read at a time, each
    read that lies within it kept as the same object (no copy), and the
    bytes after it are the next request's."""
    reader = RequestReader()
    reader.receive_data(b"PUT /a HTTP/1.1\r\nHost: a\r\nContent-Length: 10\r\n\r\n0123")
    request = reader.next_request()
    piece = b"4567"
    reader.receive_data(piece)
    assert request.body[-1] is piece and request.body_size == 8 and not request.complete
    reader.receive_data(b"89GET /b HTTP/1.1\r\nHost: a\r\n\r\n")
    assert b"".join(request.body) == b"0123456789" and request.complete
    assert reader.next_request().head.path == "/b" and not reader.broken


def test_thousands_of_requests_in_one_read_are_all_read():
    """A read of many small pipelined requests is taken in a loop (no
    recursion, no copy of the rest for each one)."""
    data = b"GET / HTTP/1.1\r\nHost: a\r\n\r\n" * 3000
    found, reader = read(data)
    assert len(found) == 3000 and not reader.broken
