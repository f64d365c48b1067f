"""zc_lb.wire.intake, and the LB decoder's résumés: bounded in bytes (one
over the limit skipped as it comes, never buffered), in classes, and in
rate (the newest of those that come sooner than the rate allows held,
undecoded, till it does); the connection kept through every refusal.  A manual clock,
no sleeps."""

import pytest

from zc_lb.errors import RemoteProtocolError
from zc_lb.wire import protocol
from zc_lb.wire.decoder import NEED_DATA, Decoder, ResumeFrame
from zc_lb.wire.encoder import encode
from zc_lb.wire.frames import (HEADER, MAX_RESUME, RESUME_CLASSES, RESUME_LIMIT,
                               RESUME_RATE, Ping, Resume)
from zc_lb.wire.intake import ResumeIntake, ResumeRefused


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def frame(skills):
    payload = encode(Resume(skills))[HEADER.size:]
    return ResumeFrame([payload], len(payload))


def test_the_bounds_are_far_above_a_real_resume_and_under_the_frame_cap():
    # A real résumé: a few thousand classes, some hundreds of KB.
    real = {"www.site%04d.example" % i: 12.5 for i in range(5000)}
    assert 10 * len(encode(Resume(real))) < RESUME_LIMIT < MAX_RESUME
    assert RESUME_CLASSES >= 10 * 5000


def test_a_resume_is_taken_then_those_sooner_than_the_rate_wait_the_newest_kept():
    clock = Clock()
    first = frame({"a": 1.0})
    intake = ResumeIntake(rate=first.size / 1.0, clock=clock)  # (a second for its size)
    assert intake.offer(first) == Resume({"a": 1.0})
    clock.now += 0.2
    assert intake.offer(frame({"a": 2.0})) is None
    assert intake.offer(frame({"a": 3.0})) is None  # (in place of the one before)
    assert intake.replaced == 1 and intake.due_at == 101.0
    clock.now += 0.5
    assert intake.due() is None  # not yet
    clock.now += 0.3
    assert intake.due() == Resume({"a": 3.0})
    assert intake.due() is None and intake.held is None
    clock.now += 1.0  # its own size's time after the last taken: at once
    assert intake.offer(frame({"a": 4.0})) == Resume({"a": 4.0})


def test_small_resumes_are_each_taken_large_ones_wait_for_their_size():
    # A site of tens of classes: a résumé of a few hundred bytes, sent
    # five times a second by a busy worker, is taken every time (its
    # learning is not held back); one of 4 MiB waits four seconds.
    clock = Clock()
    intake = ResumeIntake(clock=clock)
    small = {"site%02d.example" % i: 12.5 for i in range(30)}
    for n in range(10):
        assert intake.offer(frame(dict(small, n=n))) == Resume(dict(small, n=n))
        clock.now += 0.2
    many = {"c%07d%s" % (i, "x" * 25): 1.5 for i in range(90_000)}
    big = frame(many)
    assert 3 * RESUME_RATE < big.size < RESUME_LIMIT
    assert intake.offer(big) == Resume(many)
    assert intake.offer(frame(small)) is None
    assert intake.due_at == pytest.approx(clock.now + big.size / RESUME_RATE)


def test_a_resume_over_the_byte_or_class_limit_is_refused_and_says_so():
    intake = ResumeIntake(limit=100, classes=3, clock=Clock())
    refused = intake.offer(ResumeFrame(None, 5000))  # (skipped by the decoder)
    assert refused == ResumeRefused(5000, None, "over the 100 bytes an LB takes")
    many = frame({"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.0})
    assert intake.offer(many) == ResumeRefused(many.size, 4, "over the 3 classes an LB takes")
    intake.clock.now += 1.0  # (past what the refused one's decoding allows)
    assert intake.offer(frame({"a": 1.0, "b": 1.0, "c": 1.0})) == Resume(
        {"a": 1.0, "b": 1.0, "c": 1.0})


def test_a_bad_resume_is_still_a_protocol_error():
    with pytest.raises(RemoteProtocolError):
        ResumeIntake(clock=Clock()).offer(ResumeFrame([b'{"a": "x"}'], 10))


@pytest.mark.parametrize("chunk", [1, 7, 4096, 10**6])
def test_the_decoder_skips_a_resume_over_its_limit_unbuffered(chunk):
    big = encode(Resume({"c%05d" % i: 1.5 for i in range(2000)}))  # ~30 KB
    data = big + encode(Ping()) + encode(Resume({"a": 2.0}))
    decoder = Decoder(resume_limit=1000)
    messages = []
    for start in range(0, len(data), chunk):
        decoder.receive_data(data[start:start + chunk])
        assert decoder.buffered <= max(chunk, 64)  # (never the skipped frame's)
        while (message := decoder.next_message()) is not NEED_DATA:
            messages.append(message)
    skipped, ping, small = messages
    assert skipped.skipped and skipped.size == len(big) - HEADER.size
    assert ping == Ping()
    assert not small.skipped and small.payload() == encode(Resume({"a": 2.0}))[HEADER.size:]


@pytest.mark.parametrize("chunk", [1, 1000, 70000, 10**6])
def test_the_decoder_hands_on_a_resume_within_its_limit_whole(chunk):
    skills = {"c%05d" % i: 1.5 for i in range(20000)}  # ~300 KB: read in parts
    data = encode(Resume(skills)) + encode(Ping())
    decoder = Decoder(resume_limit=RESUME_LIMIT)
    messages = []
    for start in range(0, len(data), chunk):
        piece = data[start:start + chunk]
        while piece:
            wants = decoder.wants() or len(piece)  # (as the connection reads)
            decoder.receive_data(piece[:wants])
            piece = piece[wants:]
            while (message := decoder.next_message()) is not NEED_DATA:
                messages.append(message)
    resume, ping = messages
    assert ResumeIntake(clock=Clock()).offer(resume) == Resume(skills) and ping == Ping()


def lb_and_worker(intake):
    lb = protocol.Connection("lb", intake=intake)
    worker = protocol.Connection("worker")
    lb.receive_data(worker.data_to_send())
    worker.receive_data(lb.data_to_send())
    assert type(lb.next_event()) is protocol.Ready
    assert type(worker.next_event()) is protocol.Ready
    return lb, worker


def events(connection):
    out = []
    while (event := connection.next_event()) is not NEED_DATA:
        out.append(event)
    return out


def test_an_lb_refuses_a_resume_past_its_limit_and_the_connection_goes_on():
    # As a worker of a release before the limit may send (up to MAX_RESUME).
    clock = Clock()
    lb, worker = lb_and_worker(ResumeIntake(limit=5000, rate=10.0, clock=clock))
    big = {"c%05d" % i: 1.5 for i in range(2000)}
    lb.receive_data(worker.send(Resume(big)) + worker.send(Ping()))
    refused, = events(lb)
    assert type(refused) is protocol.ResumeRefused and refused.size > 5000
    assert lb.data_to_send()  # (its Pong: the connection lives)
    lb.receive_data(worker.send(Resume({"a": 1.0})))
    assert events(lb) == [Resume({"a": 1.0})]
    # Sooner than the rate allows (10 bytes a second): held, and handed
    # on once its time is over.
    lb.receive_data(worker.send(Resume({"a": 2.0})) + worker.send(Resume({"a": 3.0})))
    assert events(lb) == []
    clock.now += 2.0
    assert events(lb) == [Resume({"a": 3.0})]


def test_an_lb_still_drops_a_connection_whose_resume_is_past_the_frame_cap():
    lb, worker = lb_and_worker(ResumeIntake(clock=Clock()))
    lb.receive_data(HEADER.pack(0, Resume.TYPE, MAX_RESUME + 1))
    with pytest.raises(RemoteProtocolError, match="limit"):
        lb.next_event()
