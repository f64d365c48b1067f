"""zc_lb.errors: every error's group, HTTP status and exit status."""

import inspect

import pytest

from zc_lb import cli, errors
from zc_lb.errors import (AuthenticationError, BadRequest, BadResponse, BadResponseHead,
                          CancelledHere, ClientError, ClientGone, ConfigurationError,
                          ConnectionClosed, ConnectionLost, CorruptResumeFile, HeadTimeout,
                          LocalProtocolError, MessageTooLarge, NoWorkerAvailable,
                          PeerCancelled, ProtocolError, RemoteProtocolError, RequestCancelled,
                          RequestTooLarge, ResponseHeadTooLarge, ResponseTimeout, WorkerClosed,
                          WorkerError, WorkerLost, ZcLbError, ZooKeeperUnavailable)
from zc_lb.testing import free_port

ALL = [cls for _, cls in inspect.getmembers(errors, inspect.isclass)
       if issubclass(cls, BaseException) and cls.__module__ == errors.__name__]


def make(cls, message="it went wrong"):
    return cls(message)


def test_every_error_is_a_zc_lb_error_with_an_http_and_an_exit_status():
    assert len(ALL) >= 25 and ZcLbError in ALL
    for cls in ALL:
        assert issubclass(cls, ZcLbError), cls
        error = make(cls)
        assert isinstance(error.http_status, int) and 400 <= error.http_status <= 599, cls
        assert isinstance(error.exit_status, int) and error.exit_status > 0, cls


def test_str_of_every_error_is_its_message():
    for cls in ALL:
        assert str(make(cls, "résumé file /x is not JSON")) == "résumé file /x is not JSON"


def test_exit_statuses_say_configuration_outage_or_anything_else():
    # docs/reference/processes.rst, "Exit statuses": 2 for a configuration
    # error (a restart will not help), 69 (EX_UNAVAILABLE) when ZooKeeper
    # cannot be reached, 1 for anything else.
    for cls in ALL:
        if issubclass(cls, ConfigurationError):
            expected = 2
        elif issubclass(cls, ZooKeeperUnavailable):
            expected = 69
        else:
            expected = 1
        assert make(cls).exit_status == expected, cls
    assert ConfigurationError.exit_status == 2 and ZooKeeperUnavailable.exit_status == 69


def test_a_corrupt_resume_file_is_a_configuration_error():
    # a worker catches it to move the file aside; a command line exits 2 on it
    assert issubclass(CorruptResumeFile, ConfigurationError)
    assert CorruptResumeFile("x").exit_status == 2


def test_what_a_client_did_is_answered_with_a_4xx():
    clients = [cls for cls in ALL if issubclass(cls, ClientError)]
    assert set(clients) == {ClientError, BadRequest, HeadTimeout, RequestTooLarge, ClientGone}
    for cls in clients:
        assert 400 <= make(cls).http_status <= 499, cls
    assert RequestTooLarge.http_status == 413
    assert ClientGone.http_status == 499  # nobody to answer: logged as 499


def test_what_a_worker_did_or_suffered_is_answered_with_a_5xx():
    workers = [cls for cls in ALL if issubclass(cls, WorkerError)]
    assert {WorkerLost, WorkerClosed, PeerCancelled, BadResponse, ResponseTimeout,
            NoWorkerAvailable, RemoteProtocolError, AuthenticationError} <= set(workers)
    for cls in workers:
        if issubclass(cls, ClientError):
            continue  # ClientGone: cancelled here, but the client's doing
        assert 500 <= make(cls).http_status <= 599, cls
    # the statuses docs/reference/failures.rst promises
    assert WorkerLost.http_status == 502  # lost before its response started
    assert BadResponse.http_status == 502
    assert PeerCancelled.http_status == 502  # the worker gave up: a bad gateway
    assert NoWorkerAvailable.http_status == 503
    assert ResponseTimeout.http_status == 504


def test_subclasses_keep_their_parents_grouping_and_status():
    assert issubclass(WorkerLost, ConnectionLost) and WorkerLost.http_status == 502
    assert issubclass(WorkerClosed, ConnectionClosed) and WorkerClosed.http_status == 502
    for cls in (PeerCancelled, CancelledHere, ClientGone):
        assert issubclass(cls, RequestCancelled)
    assert issubclass(AuthenticationError, RemoteProtocolError)
    assert AuthenticationError.http_status == 502
    assert issubclass(ResponseHeadTooLarge, BadResponseHead)
    assert issubclass(HeadTimeout, BadRequest)


def test_a_client_that_left_is_the_clients_doing_and_a_cancellation_here():
    gone = ClientGone("client went away")
    assert isinstance(gone, ClientError) and isinstance(gone, CancelledHere)
    assert not isinstance(gone, PeerCancelled)
    assert gone.http_status == 499 and gone.exit_status == 1


def test_a_remote_protocol_error_is_the_workers_fault_and_a_local_one_ours():
    # Remote: the peer broke the protocol, a 502.  Local: our code misused
    # it, a 500 (a bug here), and not the worker's fault.
    assert issubclass(RemoteProtocolError, ProtocolError)
    assert issubclass(RemoteProtocolError, WorkerError)
    assert RemoteProtocolError("bad frame").http_status == 502
    assert RemoteProtocolError("bad frame").rno == 0  # (no request named)
    assert issubclass(LocalProtocolError, ProtocolError)
    assert not issubclass(LocalProtocolError, WorkerError)
    assert LocalProtocolError("misuse").http_status == 500
    # An application's bad response head: the worker answers 500 for it.
    assert BadResponseHead.http_status == ResponseHeadTooLarge.http_status == 500
    # A request head too big for a frame is refused for that request alone.
    assert MessageTooLarge("head of 70000 bytes").http_status == 431
    assert issubclass(MessageTooLarge, LocalProtocolError)


@pytest.mark.parametrize("status", [400, 408, 431, 501, 505])
def test_a_bad_request_carries_the_status_it_was_given(status):
    error = BadRequest("no", status)
    assert error.http_status == status and str(error) == "no"
    timeout = HeadTimeout("slow head", status)
    assert timeout.http_status == status and isinstance(timeout, ClientError)


def test_a_bad_requests_status_is_its_own_not_its_classes():
    # (another request's refusal does not change what this one says)
    version = BadRequest("version", 505)
    timeout = HeadTimeout("slow head")  # (408 Request Timeout unless told otherwise)
    plain = BadRequest("plain")
    assert (version.http_status, timeout.http_status, plain.http_status) == (505, 408, 400)
    assert BadRequest.http_status == 400


def test_zookeeper_unavailable_is_503_to_a_request():
    assert ZooKeeperUnavailable("down").http_status == 503
    assert not issubclass(ZooKeeperUnavailable, ConfigurationError)


def test_zookeeper_unreachable_makes_a_command_exit_69(capsys):
    port = free_port()  # nothing listens there
    status = cli.main(["zk", "--zookeeper", "127.0.0.1:%d" % port, "--timeout", "0.3", "ls"])
    assert status == 69
    assert "cannot reach ZooKeeper at 127.0.0.1:%d" % port in capsys.readouterr().err


def test_a_configuration_error_makes_a_command_exit_2(capsys):
    # The bad setting is found before connecting: no ZooKeeper needed.
    status = cli.main(["zk", "--zookeeper", "127.0.0.1:%d" % free_port(), "--timeout", "0.3",
                       "set", "/lb", "no_such_setting=1"])
    assert status == 2
    assert "no_such_setting" in capsys.readouterr().err
