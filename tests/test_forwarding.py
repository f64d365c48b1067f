"""forwarding.py: X-Forwarded-* and X-Request-ID in the worker's variables."""

import pytest

from zc_lb.errors import ConfigurationError
from zc_lb.front.forwarding import Forwarding, parse_headers, parse_networks
from zc_lb.front.h1 import request_variables
from zc_lb.front.httpparse import RequestHead


def forwarded(forwarding, client, trusted, host="a.example", **headers):
    """The HTTP_ variables a worker gets of a request over https with a
    Host (unless None) and ``headers`` (x_forwarded_for=...), from
    ``client``, after ``forwarding``."""
    fields = [] if host is None else [("Host", host)]
    fields += [(name.replace("_", "-").title(), value) for name, value in headers.items()]
    kept, extra = forwarding.fields(fields, client, trusted, "https")
    seen = {}
    request_variables(seen, RequestHead("GET", "/", "HTTP/1.1", kept + extra))
    return {key: value for key, value in seen.items() if key.startswith("HTTP_")}


def test_the_client_is_appended_and_proto_and_host_overwritten():
    seen = forwarded(Forwarding(), "10.1.2.3", False, x_forwarded_for="6.6.6.6",
                     x_forwarded_proto="gopher", x_forwarded_host="evil")
    assert seen["HTTP_X_FORWARDED_FOR"] == "6.6.6.6, 10.1.2.3"
    assert seen["HTTP_X_FORWARDED_PROTO"] == "https"
    assert seen["HTTP_X_FORWARDED_HOST"] == "a.example"
    assert len(seen["HTTP_X_REQUEST_ID"]) == 32


def test_a_trusted_proxy_keeps_what_it_set_but_never_the_client_list():
    seen = forwarded(Forwarding(), "10.0.0.9", True, x_forwarded_for="1.1.1.1",
                     x_forwarded_proto="https", x_forwarded_host="www.example")
    assert seen["HTTP_X_FORWARDED_FOR"] == "1.1.1.1, 10.0.0.9"
    assert (seen["HTTP_X_FORWARDED_PROTO"], seen["HTTP_X_FORWARDED_HOST"]) == (
        "https", "www.example")
    bare = forwarded(Forwarding(), "10.0.0.9", True)  # it set none: ours
    assert bare["HTTP_X_FORWARDED_PROTO"] == "https"


def test_no_host_no_forwarded_host_and_an_id_is_kept():
    seen = forwarded(Forwarding(), "10.1.2.3", False, host=None,  # an HTTP/1.0 request
                     x_forwarded_host="evil", x_request_id="given")
    assert "HTTP_X_FORWARDED_HOST" not in seen
    assert seen["HTTP_X_REQUEST_ID"] == "given"


def test_only_the_chosen_headers_are_set():
    seen = forwarded(Forwarding(parse_headers("for")), "10.1.2.3", False)
    assert set(seen) == {"HTTP_HOST", "HTTP_X_FORWARDED_FOR"}
    assert not Forwarding(parse_headers("none"))


def test_trust_by_address_or_network():
    forwarding = Forwarding(trusted=parse_networks(["10.0.0.0/8, ::1", "192.0.2.7"]))
    assert forwarding.trusts("10.200.3.4") and forwarding.trusts("::1")
    assert forwarding.trusts("192.0.2.7") and not forwarding.trusts("192.0.2.8")
    assert not forwarding.trusts(None) and not forwarding.trusts("not an address")
    assert not Forwarding().trusts("10.0.0.1")


@pytest.mark.parametrize("text", ["for,via", "x"])
def test_unknown_headers_are_refused(text):
    with pytest.raises(ConfigurationError, match="unknown"):
        parse_headers(text)


def test_a_bad_network_is_refused():
    with pytest.raises(ConfigurationError, match="--trusted-proxies '10.0.0/8'"):
        parse_networks(["10.0.0/8"])


def _request_ids(n):
    forwarding = Forwarding()
    return [forwarded(forwarding, "10.1.2.3", False)["HTTP_X_REQUEST_ID"] for _ in range(n)]


def test_request_ids_are_distinct_hex_across_batches_of_randomness():
    ids = _request_ids(1000)  # (some four batches drawn from the OS)
    assert len(set(ids)) == 1000
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)


def test_a_forked_child_draws_request_ids_of_its_own():
    import os

    _request_ids(1)  # (the parent holds a batch)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ids, to the parent
        try:
            os.write(write, " ".join(_request_ids(3)).encode())
        finally:
            os._exit(0)
    os.close(write)
    child = os.read(read, 4096).decode().split()
    os.close(read)
    os.waitpid(pid, 0)
    assert len(child) == 3
    assert not set(child) & set(_request_ids(3))  # not the parent's next ones
