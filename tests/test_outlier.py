"""zc_lb.lb.outlier: ejecting failing workers, on an injected clock."""

from zc_lb.lb.outlier import Ejector


def test_consecutive_failures_eject_for_a_time_that_grows():
    ejector = Ejector(consecutive=3, base_time=10, max_time=35)
    assert not ejector.failure("a", 0, 4) and not ejector.failure("a", 0, 4)
    ejector.success("a")  # not in a row any more
    assert not any(ejector.failure("a", 1, 4) for _ in range(2))
    assert ejector.failure("a", 1, 4) and ejector.ejected("a")
    assert ejector.readmit(10.9) == [] and ejector.readmit(11) == ["a"]
    assert not ejector.ejected("a")
    assert ejector.failure("a", 12, 4)  # on probation: one failure is enough
    assert ejector.records["a"].until == 12 + 20  # twice as long
    ejector.readmit(40)
    assert ejector.failure("a", 40, 4) and ejector.records["a"].until == 40 + 35  # capped
    assert ejector.total_ejections == 3


def test_successes_restore_good_standing():
    ejector = Ejector(consecutive=2, base_time=10)
    ejector.failure("a", 0, 4)
    assert ejector.failure("a", 0, 4)
    ejector.readmit(10)
    ejector.success("a")
    assert not ejector.failure("a", 11, 4)  # probation is over
    for _ in range(8):
        ejector.success("a")
    assert ejector.records["a"].ejections == 0  # the next ejection is short again


def test_at_most_a_share_of_workers_is_ejected():
    ejector = Ejector(consecutive=1, max_share=0.5)
    assert ejector.failure("a", 0, 4) and ejector.failure("b", 0, 4)
    assert not ejector.failure("c", 0, 4)  # half of 4 are out already
    assert ejector.ejected_count() == 2
    status = ejector.status("a", 5)
    assert status["ejected"] and status["ejected_for"] == 25.0
    assert ejector.status("z", 0) == {"ejected": False, "consecutive_failures": 0,
                                      "ejections": 0}


def test_a_route_that_raises_everywhere_ejects_no_worker():
    # Five 500s from one route (Flask's view raising): the application's
    # error, on one path, which no other worker answers well.
    ejector = Ejector(consecutive=3)
    for _ in range(5):
        assert not ejector.failure("w1", 0.0, 2, "/broken")
    assert not ejector.ejected("w1")
    ejector.succeeded_on("/elsewhere", "w2")  # (a path that never failed: nothing noted)
    assert "/elsewhere" not in ejector.watched


def test_answered_failures_on_several_paths_eject_and_say_why():
    ejector = Ejector(consecutive=3)
    assert not ejector.failure("w1", 0.0, 4, "/a")
    assert not ejector.failure("w1", 0.0, 4, "/a")
    assert not ejector.failure("w1", 0.0, 4, "/b")  # three in a row, but two paths
    assert ejector.failure("w1", 0.0, 4, "/c")
    assert ejector.status("w1", 0.0)["ejected_because"] == (
        "4 failed requests in a row, answered 5xx on 3 paths or more")


def test_a_worker_failing_a_path_its_peers_answer_well_is_ejected():
    ejector = Ejector(consecutive=3)
    assert not ejector.failure("w1", 0.0, 2, "/")  # (the path is watched from here)
    ejector.succeeded_on("/", "w2")  # a peer answers it well
    assert not ejector.failure("w1", 0.0, 2, "/")
    assert ejector.failure("w1", 0.0, 2, "/")
    assert "not all of them answered" in ejector.status("w1", 0.0)["ejected_because"]


def test_an_operator_readmits_an_ejected_worker_at_once_in_good_standing():
    ejector = Ejector(consecutive=1)
    assert ejector.failure("w1", 0.0, 4)  # (its connection failed)
    assert ejector.readmit_now("w1") and not ejector.ejected("w1")
    assert not ejector.status("w1", 1.0)["probation"]
    assert not ejector.readmit_now("w1")  # (not ejected now)
    assert not ejector.readmit_now("nobody")


def test_a_worker_ejected_for_unanswered_failures_is_back_on_probation_once_it_reconnects():
    ejector = Ejector(consecutive=2, base_time=30.0)
    ejector.failure("w1", 0.0, 4)
    assert ejector.failure("w1", 0.0, 4)  # (its connection failed under two requests)
    assert ejector.reconnected("w1")  # the process that failed is gone
    assert not ejector.ejected("w1") and ejector.status("w1", 1.0)["probation"]
    assert ejector.failure("w1", 1.0, 4)  # (on probation: one more and it is out again)
    # Ejected for errors it answered, a reconnect proves nothing.
    ejector = Ejector(consecutive=1)
    for path in ("/a", "/b", "/c"):
        ejector.failure("w2", 0.0, 4, path)
    assert ejector.ejected("w2") and not ejector.reconnected("w2")


def test_a_path_failing_now_on_the_peer_that_answered_it_well_blames_no_worker():
    # /x failed once on w1 and w2 answered it well; later a deploy breaks the
    # route everywhere: w2 fails it too, and w1's 500s there are the
    # application's again, not w1's (else a broken route ejects half the fleet).
    ejector = Ejector(consecutive=3)
    ejector.failure("w1", 0.0, 2, "/x")
    ejector.succeeded_on("/x", "w2")
    ejector.success("w1")
    assert not ejector.failure("w2", 1.0, 2, "/x")
    assert not any(ejector.failure("w1", 1.0, 2, "/x") for _ in range(5))
    assert not ejector.ejected("w1")
    ejector.succeeded_on("/x", "w2")  # (it answers it well again: w1's failures count)
    assert ejector.failure("w1", 2.0, 2, "/x")


def test_the_share_cap_is_not_cut_short_by_rounding():
    ejector = Ejector(consecutive=1, max_share=0.29)  # (0.29 * 100 is 28.999999999999996)
    assert all(ejector.failure("w%d" % n, 0.0, 100) for n in range(29))
    assert not ejector.failure("w29", 0.0, 100) and ejector.ejected_count() == 29


def test_the_share_is_of_the_workers_that_can_serve_and_those_past_it_come_back():
    # Of four known workers, two are down: half of the two left may be
    # out, not half of four (both: the pool empty).
    ejector = Ejector(consecutive=1, base_time=10, max_share=0.5)
    assert ejector.failure("a", 0, 2, ejected=0)
    assert not ejector.failure("b", 1, 2, ejected=1) and not ejector.ejected("b")
    # An ejected worker left alone (its peer went): back on probation.
    assert ejector.over_share(["a", "b"]) == []
    assert ejector.over_share(["a"]) == ["a"]
    assert not ejector.ejected("a") and ejector.records["a"].probation
    # Of several past the share, those whose ejection ends soonest.
    ejector = Ejector(consecutive=1, base_time=10, max_share=1.0)
    for now, key in enumerate("cde"):
        assert ejector.failure(key, now, 3, ejected=now)
    ejector.max_share = 0.5
    assert ejector.over_share(["c", "d", "e"]) == ["c", "d"]
    assert ejector.ejected("e")
