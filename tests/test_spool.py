"""spool.py: a response body held in memory, then on disk, in order."""

import os
import time

import gevent
import gevent.event
import pytest

from zc_lb.errors import ZcLbError
from zc_lb.lb.bodies import InFlight, ResponseBody
from zc_lb.lb.spool import Spool, SpoolLimits
from zc_lb.routing.pool import Pool
from zc_lb.testing import connection_pair
from zc_lb.wire.connection import Handler
from zc_lb.wire.frames import Body, End


def drain(spool):
    parts = []
    while spool:
        parts.append(spool.take())
    return b"".join(parts)


def test_memory_first_then_disk_and_the_body_comes_out_in_order(tmp_path):
    limits = SpoolLimits(memory=10, total_memory=100, disk=1000, total_disk=1000,
                         directory=str(tmp_path))
    spool = Spool(limits)
    chunks = [bytes([65 + i]) * 6 for i in range(5)]
    for chunk in chunks:
        spool.put(chunk)
    assert spool.memory == 12 and spool.disk == 18  # two in memory (past 10), three on disk
    assert limits.in_memory == 12 and limits.on_disk == 18 and limits.spilled == 1
    assert spool.take() == chunks[0] + chunks[1]  # (small parts in memory: joined)
    spool.put(b"F" * 6)  # memory has room again: the next goes there, after the three on disk
    assert drain(spool) == b"".join(chunks[2:]) + b"F" * 6
    assert limits.in_memory == limits.on_disk == 0
    spool.close()


def test_full_when_neither_memory_nor_disk_has_room():
    limits = SpoolLimits(memory=4, total_memory=100, disk=4, total_disk=100)
    spool = Spool(limits)
    spool.put(b"1234")
    assert not spool.full  # the disk has room
    spool.put(b"5678")
    assert spool.full
    spool.put(b"9")  # still kept (flow control bounds the excess), in memory
    assert drain(spool) == b"123456789"
    assert not spool.full
    spool.close()


def test_the_totals_are_shared_by_every_spool():
    limits = SpoolLimits(memory=100, total_memory=8, disk=0, total_disk=0)
    first, second = Spool(limits), Spool(limits)
    first.put(b"12345678")
    second.put(b"9")
    assert second.full  # no memory left in all, and no disk
    first.take()
    assert not second.full


def test_a_spool_its_client_has_read_is_never_full():
    # Every byte the bounds allow is held by other responses' spools and
    # the disk has failed: a response whose client has read all it had
    # must still take its worker's next bytes, or it waits for room only
    # the others' clients can make, and its client for bytes that never
    # come (ten slow 8 MB downloads with a full buffer disk hung for good).
    limits = SpoolLimits(memory=100, total_memory=8, disk=100, total_disk=0)
    others, mine = Spool(limits), Spool(limits)
    others.put(b"12345678")
    assert not mine.full
    mine.put(b"abc")  # (past the total by what the worker may send unasked)
    assert mine.full
    assert mine.take() == b"abc" and not mine.full


def test_close_gives_back_what_the_spool_held(tmp_path):
    limits = SpoolLimits(memory=2, total_memory=100, disk=100, total_disk=100,
                         directory=str(tmp_path))
    spool = Spool(limits)
    for _ in range(5):
        spool.put(b"abc")
    spool.close()
    assert limits.in_memory == limits.on_disk == 0
    assert not spool
    assert os.listdir(tmp_path) == []  # the file was unlinked from the start


def test_a_disk_that_fails_leaves_the_body_in_memory(tmp_path, caplog):
    limits = SpoolLimits(memory=2, total_memory=100, disk=100, total_disk=100,
                         directory=str(tmp_path / "gone"))
    spool = Spool(limits)
    spool.put(b"ab")
    spool.put(b"cd")  # the directory does not exist: memory it is, said once
    spool.put(b"ef")
    assert drain(spool) == b"abcdef"
    assert [r.getMessage() for r in caplog.records if "on disk" in r.getMessage()]
    assert limits.total_disk == 0


@pytest.mark.parametrize("sizes", [[1] * 50, [7, 300, 1, 64, 1000], [4096] * 8])
def test_any_mix_of_sizes_comes_out_whole(tmp_path, sizes):
    limits = SpoolLimits(memory=100, total_memory=150, disk=3000, total_disk=3000,
                         directory=str(tmp_path))
    spool = Spool(limits)
    body, out = b"", []
    for i, size in enumerate(sizes):
        chunk = bytes([i % 251]) * size
        body += chunk
        spool.put(chunk)
        if i % 3 == 2:
            out.append(spool.take())
    out.append(drain(spool))
    assert b"".join(out) == body
    spool.close()


def test_small_parts_in_memory_are_taken_together_up_to_join_bytes():
    # A body that came in 4 KiB frames goes to the client in a few large
    # writes, not one a frame; order and the accounts are kept.
    from zc_lb.lb.spool import JOIN, SMALL

    limits = SpoolLimits(memory=10 * JOIN, total_memory=10 * JOIN)
    spool = Spool(limits)
    blocks = [bytes([i % 256]) * 4096 for i in range(JOIN // 4096 + 3)]
    for block in blocks:
        spool.put(block)
    first = spool.take()
    assert first == b"".join(blocks[:JOIN // 4096]) and len(first) == JOIN
    assert spool.take() == b"".join(blocks[JOIN // 4096:])
    assert not spool and spool.memory == limits.in_memory == 0
    big = b"x" * SMALL
    spool.put(b"w")
    spool.put(big)
    spool.put(big)
    spool.put(b"y")
    assert spool.take() == b"w"  # (the next is not small)
    assert spool.take() is big  # (a large part as it is: no copy)
    assert spool.take() is big
    assert spool.take() == b"y"
    spool.close()


def test_a_closed_spool_keeps_nothing_more(tmp_path):
    # (a pump on its way when the client left: its bytes must not count)
    limits = SpoolLimits(memory=2, total_memory=100, disk=100, total_disk=100,
                         directory=str(tmp_path))
    spool = Spool(limits)
    spool.put(b"abc")
    spool.close()
    spool.put(b"abc")  # (past memory: it would go to a new file)
    spool.put(b"de")
    assert limits.in_memory == limits.on_disk == 0 and not spool


class _Sends(Handler):
    """A worker side that answers with a head, then ``chunks`` of body
    (once ``go`` is set, if given), then End (or, with ``cancel``, cancels
    instead of ending).  A send the LB cut short ends it quietly."""

    def __init__(self, chunks, cancel=False, go=None):
        self.chunks, self.cancel, self.go = chunks, cancel, go
        self.done = gevent.event.Event()

    def handle_request(self, connection, exchange):
        gevent.spawn(self.stream, exchange)

    def stream(self, exchange):
        exchange.receive()
        exchange.respond("200 OK", [])
        try:
            if self.go is not None:
                self.go.wait()
            for chunk in self.chunks:
                exchange.send_body(chunk)
            if self.cancel:
                exchange.cancel()
            else:
                exchange.send(End(exchange.rno))
        except ZcLbError:
            pass
        finally:
            self.done.set()


@pytest.mark.parametrize("client_read_first", [True, False])
def test_a_client_gone_as_the_pump_wakes_leaves_no_bytes_counted(client_read_first):
    go = gevent.event.Event()
    limits = SpoolLimits(memory=32 * 1024, disk=0) if client_read_first else SpoolLimits()
    lb, worker = connection_pair(Handler(), _Sends([b"x" * 16384] * 64, go=go))
    try:
        flight = InFlight(Pool(), limits)
        exchange = lb.open_request({}, end=True)
        response = exchange.receive(5)
        body = ResponseBody(flight, lb, exchange, None, None, response)
        if client_read_first:  # a slow client: the spool full, the worker held
            go.set()
            deadline = time.monotonic() + 5
            while not limits.stalled:
                gevent.sleep(0.01)
                assert time.monotonic() < deadline
            next(iter(body))  # it takes a piece (which grants credit), then its send fails
        else:  # a frame delivered in the loop turn in which the client's send fails
            gevent.sleep(0.1)
            exchange.received(Body(exchange.rno, b"y" * 16384))
        body.close()
        gevent.sleep(0.2)
        assert (limits.in_memory, limits.on_disk) == (0, 0)
    finally:
        lb.close()
        worker.close()


@pytest.mark.parametrize("cancel", [False, True])
def test_a_worker_done_while_the_spool_is_full_is_back_in_the_pool_at_once(cancel):
    # The spool is full after the first chunk, but the rest of the body
    # fits the worker's credit window: the worker sends it and its End
    # (or cancels) and is free.  The LB must give it back to the pool
    # then, not once a slow client has made room in the spool (until
    # then the pool counted a busy worker that was idle, and a request
    # the worker had ended); the client still gets every byte that came.
    chunks = [bytes([65 + i]) * 16384 for i in range(6)]
    sender = _Sends(chunks, cancel)
    limits = SpoolLimits(memory=16384, total_memory=10 * 16384, disk=0, total_disk=0)
    lb, worker = connection_pair(Handler(), sender)
    try:
        flight = InFlight(Pool(), limits)
        flight.started()
        exchange = lb.open_request({}, end=True)
        response = exchange.receive(5)
        body = ResponseBody(flight, lb, exchange, None, None, response)
        assert sender.done.wait(5)
        deadline = time.monotonic() + 5
        while flight.requests and time.monotonic() < deadline:
            gevent.sleep(0.01)
        assert flight.requests == 0, "the worker is still held for the client"
        got = b""
        try:
            for data in body:
                got += data
        except Exception as exc:
            assert cancel, exc
        else:
            assert not cancel
        assert got == b"".join(chunks)
        body.close()
        assert (limits.in_memory, limits.on_disk) == (0, 0)
    finally:
        lb.close()
        worker.close()


def test_a_disk_that_fails_a_read_is_said_and_left(tmp_path, caplog, monkeypatch):
    # A buffer file that cannot be read back (an I/O error) used to raise
    # a bare OSError, which the front takes for the client's socket
    # failing: the truncated response was logged at DEBUG only, and every
    # later response went on to the failing disk.  Now it is an error
    # said once, the disk is left for memory, and the response fails with
    # a ZcLbError (which the front logs as it closes the connection).
    from zc_lb.errors import ZcLbError
    import zc_lb.lb.spool as spool_module

    limits = SpoolLimits(memory=2, total_memory=100, disk=100, total_disk=100,
                         directory=str(tmp_path))
    spool = Spool(limits)
    spool.put(b"ab")
    spool.put(b"cd")  # on disk

    def failing_pread(fd, size, offset):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(spool_module.os, "pread", failing_pread)
    assert spool.take() == b"ab"
    with pytest.raises(ZcLbError):
        spool.take()
    assert [r for r in caplog.records if r.levelname == "ERROR" and "disk" in r.getMessage()]
    assert limits.total_disk == 0
    spool.close()
    assert limits.in_memory == limits.on_disk == 0


def test_out_of_descriptors_is_no_failing_disk(monkeypatch, caplog):
    # A flood of connections that took every descriptor made the first
    # spill fail (tempfile, finding none, says "No usable temporary
    # directory": ENOENT), and the LB left the disk for good: every slow
    # client after the flood held its worker.  Now the response that
    # found no descriptor is held in memory alone, within its bounds (so
    # that its worker waits, as flow control makes it), and the next
    # response spills to disk again.
    import errno
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # (as in a new process)
    limits = SpoolLimits(memory=2, total_memory=100, disk=100, total_disk=100)

    def out_of_files(*args, **kw):
        raise OSError(errno.EMFILE, "Too many open files")

    with monkeypatch.context() as patched:
        patched.setattr(os, "open", out_of_files)
        spool = Spool(limits)
        spool.put(b"ab")
        spool.put(b"cd")  # no descriptor: memory
        assert spool.full  # (memory past its bound, and no disk: the worker waits)
        spool.put(b"ef")
    assert limits.total_disk == 100 and limits.on_disk == 0
    assert [r for r in caplog.records if "descriptor" in r.getMessage()]
    later = Spool(limits)
    later.put(b"gh")
    later.put(b"ij")  # descriptors back: the disk
    assert limits.on_disk == 2 and not later.full
    assert drain(spool) == b"abcdef" and drain(later) == b"ghij"
    spool.close()
    later.close()


def test_a_file_written_on_while_it_is_read_stays_within_its_bound(tmp_path, monkeypatch):
    # The file counted what it held unread, not its size: written on
    # while its client read it, it was never emptied, and grew with the
    # response past every bound (16 MB after 18 s of a slow download,
    # with --buffer-disk 2M).  It now counts for its size until emptied;
    # meanwhile what comes goes to memory, within bounds.
    import zc_lb.lb.spool as spool_module

    written = []
    pwrite = os.pwrite
    monkeypatch.setattr(spool_module.os, "pwrite", lambda fd, data, at: written.append(
        at + len(data)) or pwrite(fd, data, at))
    limits = SpoolLimits(memory=4, total_memory=100, disk=8, total_disk=100,
                         directory=str(tmp_path))
    spool = Spool(limits)
    body = taken = b""
    for i in range(30):  # a body of 4-byte parts, the client a take behind each put
        part = bytes([65 + i % 26]) * 4
        spool.put(part)
        body += part
        if i >= 2:
            taken += spool.take()
    assert max(written) <= 8 and limits.on_disk <= 8
    assert taken + drain(spool) == body
    assert limits.in_memory == limits.on_disk == 0
    spool.close()


def test_credit_is_granted_within_the_room_the_spool_has(tmp_path):
    # Granting a worker all it had sent whenever the spool had any room
    # (a slow client had read one part from the file) let it send a
    # window more each time, kept in memory past every bound: 7 MB held
    # in memory for one response with a 64 KiB bound, and growing.
    limits = SpoolLimits(memory=64 * 1024, total_memory=10 ** 9, disk=256 * 1024,
                         total_disk=10 ** 9, directory=str(tmp_path))
    lb, worker = connection_pair(Handler(), _Sends([b"x" * 65536] * 160))
    try:
        flight = InFlight(Pool(), limits)
        exchange = lb.open_request({}, end=True)
        body = ResponseBody(flight, lb, exchange, None, None, exchange.receive(5))
        got = most = 0
        for data in body:  # a slow client
            got += len(data)
            most = max(most, limits.in_memory)
            gevent.sleep(0.002)
        assert got == 160 * 65536
        assert most < limits.memory + 2 * 1024 * 1024, most  # (a credit window past it)
        body.close()
    finally:
        lb.close()
        worker.close()
