"""Tests for zc_lb.wire's frames, encoder and decoder on their own: what
encode refuses, the limits and request numbers of whole and ready frames,
ready frames' fields, response heads as JSON refused, Decoder.allow, the
request an error names, and the decoder's buffer across many frames.

Round trips of every message type, whole and byte by byte, and arbitrary
chunkings are in test_protocol.py; these tests cover what it does not.
"""

from __future__ import annotations

import random

import pytest

from zc_lb.wire import frames
from zc_lb.errors import LocalProtocolError, RemoteProtocolError
from zc_lb.wire.decoder import COMPACT_AT, COPY_ONCE_AT, NEED_DATA, STREAM_AT, Decoder, head_fields
from zc_lb.wire.encoder import encode, ready_frame
from zc_lb.wire.frames import (HEAD_REQUEST, HEADER, MAX_BODY, MAX_MESSAGE, READY_PREFIX,
                          READY_RESPONSE, RETIRED, WHOLE_REQUEST, Body, Credit, End, Hello,
                          Ping, Pong, Request, Response, Resume)


def drain(decoder: Decoder) -> list:
    """Every complete message the decoder holds."""
    out = []
    while True:
        message = decoder.next_message()
        if message is NEED_DATA:
            return out
        out.append(message)


def feed(data: bytes, decoder: Decoder, seed: int) -> list:
    """Feed ``data`` in random splits (a fixed seed) and drain after each."""
    rng, pos, out = random.Random(seed), 0, []
    while pos < len(data):
        size = rng.randint(1, 2 * frames.HEADER_SIZE + 7)
        decoder.receive_data(data[pos:pos + size])
        pos += size
        out.extend(drain(decoder))
    return out


def refused(data: bytes, **limits: int) -> RemoteProtocolError:
    """The RemoteProtocolError ``data`` raises, fed whole; checks it stays raised."""
    decoder = Decoder(**limits)
    decoder.receive_data(data)
    with pytest.raises(RemoteProtocolError) as first:
        drain(decoder)
    with pytest.raises(RemoteProtocolError) as again:
        decoder.next_message()
    assert again.value is first.value
    return first.value


# -- encode ------------------------------------------------------------------


@pytest.mark.parametrize("message", [
    Credit(1, 2**32),  # n over a u32
    Body(2**32, b""),  # request number over a u32
    End(-1),
    Body(1, "text, not bytes"),  # type: ignore[arg-type]
    Hello(2**64, "lb", "n"),  # over what JSON carries here
    Response(1, "200 OK", "HTTP/1.1 200 OK\r\n"),  # type: ignore[arg-type]
    Response(1, "200 OK", b"HTTP/1.1 200 OK\r\n", "text, not bytes", True),  # type: ignore[arg-type]
    Response(1, "200 OK", b"HTTP/1.1 200 OK\r\n", b"", True, -1.0),
], ids=lambda m: repr(m)[:50])
def test_encode_refuses_what_cannot_be_framed_as_a_local_protocol_error(message):
    with pytest.raises(LocalProtocolError):
        encode(message)


@pytest.mark.parametrize("score", [float("inf"), float("-inf"), float("nan"), True, "1.0",
                                   None])
def test_a_resume_with_a_score_that_is_not_finite_is_refused_before_sending(score):
    # orjson would write it as null, which the LB refuses, dropping the connection.
    with pytest.raises(LocalProtocolError, match="not finite"):
        encode(Resume({"a": 1.0, "b": score}))


def test_the_apps_time_goes_exactly():
    head = b"HTTP/1.1 200 OK\r\n"
    decoder = Decoder()
    decoder.receive_data(encode(Response(3, "200 OK", head, b"x", True, 1.23456789))
                         + encode(Response(4, "200 OK", head, b"x", True, 0.0)))
    times = [m.elapsed for m in drain(decoder) if isinstance(m, Response)]
    assert times == [1.23456789, 0.0]


def test_a_resume_of_ints_and_floats_decodes_to_floats_only():
    decoder = Decoder()
    decoder.receive_data(encode(Resume({"a": 1.5, "b": 2, "c": 0})))  # type: ignore[dict-item]
    [resume] = drain(decoder)
    assert resume == Resume({"a": 1.5, "b": 2.0, "c": 0.0})
    assert [type(score) for score in resume.skills.values()] == [float, float, float]


@pytest.mark.parametrize("hello", [
    b'{"version": 1, "role": "lb", "nonce": "n", "features": "whole"}',
    b'{"version": 1, "role": "lb", "nonce": "n", "features": ["whole", 1]}',
    b'{"version": 1, "role": "lb", "nonce": "n", "features": null}',
    b'{"version": 1, "role": "lb", "nonce": "n", "app_version": 3}',
])
def test_a_hello_with_malformed_features_or_app_version_is_refused(hello):
    assert "malformed hello" in str(refused(HEADER.pack(0, Hello.TYPE, len(hello)) + hello))


# -- whole and ready frames: request numbers and limits ---------------------------


@pytest.mark.parametrize("mtype", [WHOLE_REQUEST, READY_RESPONSE, HEAD_REQUEST])
def test_whole_and_ready_frames_with_request_number_0_are_refused(mtype):
    error = refused(HEADER.pack(0, mtype, 0))
    assert "request number 0" in str(error)


@pytest.mark.parametrize("mtype, limit, small_limit", [
    (WHOLE_REQUEST, MAX_MESSAGE, 10),
    (READY_RESPONSE, READY_PREFIX.size + MAX_MESSAGE + MAX_BODY, READY_PREFIX.size + 10 + 20),
])
def test_whole_and_ready_frames_over_their_limits_are_refused_from_the_header_alone(
        mtype, limit, small_limit):
    # Exactly at the limit waits for the payload; one byte over is refused at once.
    for limits, at in (({}, limit), ({"max_message": 10, "max_body": 20}, small_limit)):
        decoder = Decoder(**limits)
        decoder.receive_data(HEADER.pack(1, mtype, at))
        assert decoder.next_message() is NEED_DATA
        assert "over the limit of %d" % at in str(refused(HEADER.pack(1, mtype, at + 1),
                                                          **limits))


# -- ready frames ------------------------------------------------------------------


@pytest.mark.parametrize("elapsed", [float("nan"), float("inf"), -0.5, 1e9, True])
def test_a_response_time_the_lb_would_refuse_is_refused_before_sending(elapsed):
    # The LB drops the whole connection over a malformed response time.
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n"
    for make in (lambda: ready_frame(1, head, 1, elapsed, b"x", True),
                 lambda: encode(Response(1, "200 OK", head, b"x", True, elapsed))):
        with pytest.raises(LocalProtocolError, match="response time"):
            make()
    ready_frame(1, head, 1, 1e9 - 1, b"x", True)  # (the largest a peer takes)


def test_a_ready_frame_keeps_a_zero_length_and_a_zero_time_apart_from_none():
    head = b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n"
    data = (ready_frame(1, head, 0, 0.0, b"", False)
            + ready_frame(2, head, None, None, b"", True))
    assert HEADER.unpack_from(data)[1] == READY_RESPONSE
    zero, none = feed(data, Decoder(), seed=1)
    assert (zero.length, zero.elapsed, zero.end) == (0, 0.0, False)
    assert (none.length, none.elapsed, none.end) == (None, None, True)
    for response in (zero, none):
        assert (response.status, response.head, response.body) == ("204 No Content", head, b"")


def test_a_ready_frame_carries_the_first_body_bytes_after_the_head():
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n"
    body = b"hello\r\n\r\nyo"  # (an empty line in the body is only body)
    [response] = feed(ready_frame(7, head, 11, 0.25, body, True), Decoder(), seed=2)
    assert (response.rno, response.status, response.length, response.elapsed) == (
        7, "200 OK", 11, 0.25)
    assert (response.head, response.body, response.end) == (head, body, True)


def test_head_fields_are_the_header_lines_with_values_stripped():
    head = b"HTTP/1.1 200 OK\r\nA:  b c \r\nLocation: http://x.example:80/\r\nEmpty:\r\n"
    assert head_fields(head) == [("A", "b c"), ("Location", "http://x.example:80/"),
                                 ("Empty", "")]
    assert head_fields(b"HTTP/1.1 200 OK\r\n") == []
    assert head_fields(b"HTTP/1.1 200 OK\r\nX: \xe9\r\n") == [("X", "\u00e9")]  # latin-1


@pytest.mark.parametrize("mtype", sorted(RETIRED))
def test_a_response_head_as_json_is_refused_from_its_header_saying_what_it_was(mtype):
    # (frame types 13 and 17 of the releases before ready heads)
    head = b'["200 OK", [["A", "b"]]]'
    payload = head if mtype == 13 else len(head).to_bytes(4, "big") + head + b"body"
    for data in (HEADER.pack(1, mtype, len(payload)),
                 HEADER.pack(1, mtype, len(payload)) + payload):
        error = refused(data)
        assert str(error) == (
            "frame type %d, %s, is not taken: a worker sends a response head ready for the "
            "client (READY_RESPONSE)" % (mtype, RETIRED[mtype]))
        assert error.rno == 1
    assert RETIRED == {13: "a response head as JSON",
                       17: "a whole response with its head as JSON"}


# -- the decoder -------------------------------------------------------------------


def test_a_type_allow_leaves_out_is_refused_saying_why():
    decoder = Decoder()
    decoder.allow({Ping.TYPE: 0}, " before the handshake")
    decoder.receive_data(encode(Ping()) + encode(Pong()) + encode(Ping()))
    assert decoder.next_message() == Ping()
    with pytest.raises(RemoteProtocolError, match="^Pong frame not allowed before the handshake$"):
        decoder.next_message()
    with pytest.raises(RemoteProtocolError, match="Pong frame not allowed"):
        decoder.next_message()  # broken: the Ping after it never comes out


def test_a_type_allow_keeps_is_refused_over_its_new_limit():
    decoder = Decoder()
    decoder.allow({Ping.TYPE: 0, Body.TYPE: 4})
    decoder.receive_data(encode(Body(1, b"1234")))
    assert decoder.next_message() == Body(1, b"1234")
    decoder.receive_data(encode(Body(1, b"12345")))
    with pytest.raises(RemoteProtocolError, match="over the limit of 4"):
        decoder.next_message()


def test_an_unknown_type_is_still_unknown_after_allow():
    decoder = Decoder()
    decoder.allow({Ping.TYPE: 0}, " before the handshake")
    decoder.receive_data(HEADER.pack(0, 99, 0))
    with pytest.raises(RemoteProtocolError, match="^unknown frame type 99$"):
        decoder.next_message()


@pytest.mark.parametrize("data, rno", [
    (HEADER.pack(7, Credit.TYPE, 3) + b"abc", 7),  # a bad payload
    (HEADER.pack(9, Body.TYPE, MAX_BODY + 1), 9),  # over the limit, from the header
    (HEADER.pack(5, Request.TYPE, 2) + b"[]", 5),  # not an environ
    (HEADER.pack(0, Hello.TYPE, 2) + b"[]", 0),  # the connection's own
    (encode(Body(3, b"ok")) + HEADER.pack(0, Body.TYPE, 0), 0),  # after another request's
])
def test_an_error_names_the_request_whose_frame_broke_the_decoder(data, rno):
    assert refused(data).rno == rno


def test_a_frame_split_after_many_decoded_frames_decodes_intact():
    # Past COMPACT_AT decoded bytes the buffer drops them while a frame is
    # partial; past COPY_ONCE_AT a payload is copied through a memoryview.
    small = [Body(n, bytes([n]) * 1000) for n in range(1, 101)]
    large = Body(101, bytes(range(256)) * 40)
    assert 100 * 1000 > COMPACT_AT and len(large.data) >= COPY_ONCE_AT
    data = b"".join(encode(m) for m in small) + encode(large)
    cut = len(data) - len(large.data) // 2
    decoder = Decoder()
    decoder.receive_data(data[:cut])
    assert drain(decoder) == small
    assert decoder.buffered == frames.HEADER_SIZE + len(large.data) - len(large.data) // 2
    assert feed(data[cut:], decoder, seed=3) == [large]
    assert decoder.buffered == 0



def test_a_large_body_frame_is_handed_on_in_pieces_as_it_comes():
    """From STREAM_AT bytes a Body frame goes on a piece per read, in
    order, and the frames after it decode intact, however it is split."""
    large = Body(7, bytes(range(256)) * 1024)  # 256 KiB
    assert len(large.data) >= STREAM_AT
    after = [End(7), Body(8, b"x" * 100), Credit(8, 5)]
    data = encode(Body(6, b"before")) + encode(large) + b"".join(encode(m) for m in after)
    counts = []
    for seed in range(6):
        decoder, out, pos, rng = Decoder(), [], 0, random.Random(seed)
        while pos < len(data):
            size = rng.choice([1, 7, 1000, 70000, 300000])
            decoder.receive_data(data[pos:pos + size])
            pos += size
            out.extend(drain(decoder))
        pieces = [m for m in out if type(m) is Body and m.rno == 7]
        assert b"".join(p.data for p in pieces) == large.data
        assert [m for m in out if not (type(m) is Body and m.rno == 7)] == [Body(6, b"before")] + after
        assert out.index(pieces[-1]) + 1 == out.index(after[0])
        counts.append(len(pieces))
    assert max(counts) > 1  # (a frame that came whole in one read goes on whole)


def test_the_rest_of_a_large_body_frame_is_wanted_alone_and_kept_as_it_came():
    """``wants``: the rest of a large frame, read by itself, goes on as
    the very bytes object the read made; then a header alone."""
    payload = b"y" * STREAM_AT
    data = encode(Body(3, payload))
    decoder = Decoder()
    decoder.receive_data(data[:frames.HEADER_SIZE + 10])
    assert drain(decoder) == [Body(3, payload[:10])]
    assert decoder.wants() == len(payload) - 10
    rest = data[frames.HEADER_SIZE + 10:]
    decoder.receive_data(rest)
    [piece] = drain(decoder)
    assert piece.data is rest
    assert decoder.wants() == frames.HEADER_SIZE
    decoder.receive_data(encode(End(3)))
    assert decoder.wants() == 0 and drain(decoder) == [End(3)]


def test_a_large_body_frame_over_its_limit_is_refused_from_the_header_alone():
    decoder = Decoder(max_body=STREAM_AT)
    decoder.receive_data(HEADER.pack(4, Body.TYPE, STREAM_AT + 1) + b"z" * 10)
    with pytest.raises(RemoteProtocolError):
        drain(decoder)
