"""relay.py: a request relayed as its checked head gives the worker the
very variables the JSON environ gave; the classifier's mapping; bad
head-request frames."""

import re

import orjson
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from zc_lb.errors import RemoteProtocolError, RequestTooLarge
from zc_lb.front.forwarding import Forwarding, parse_networks
from zc_lb.front.h1 import RequestReader, request_variables
from zc_lb.lb.relay import HEAD_PREFIX, REQUIRED, ROOM, Facts, Relay, decode_head_request

BASE = {"SCRIPT_NAME": "", "SERVER_NAME": "127.0.0.1", "SERVER_PORT": "8080",
        "GATEWAY_INTERFACE": "CGI/1.1", "SERVER_SOFTWARE": "zc-lb", "wsgi.url_scheme": "http"}
REMOTE = ("10.0.0.7", "51234")

# Heads of every shape the front takes: the simple ones (h1's ``_simple``)
# and those llhttp parses; fields about one hop; forwarding fields sent
# by the client; an absolute-form target; repeats; percent-escapes.
HEADS = [
    b"GET / HTTP/1.1\r\nHost: example.com\r\n\r\n",
    b"GET /a%20b/c?x=1&y=%zz HTTP/1.1\r\nHost: example.com:8080\r\nAccept: */*\r\n\r\n",
    b"GET /x HTTP/1.1\r\nHost:example.com\r\nUser-Agent:   spaced  \r\n\r\n",
    b"GET /x HTTP/1.1\r\nHost: h\r\nAccept:\ttabbed\t\r\n\r\n",
    b"GET /x HTTP/1.0\r\n\r\n",
    b"GET /x HTTP/1.0\r\nConnection: keep-alive\r\nKeep-Alive: 5\r\n\r\n",
    b"GET /x HTTP/1.1\r\nHost: h\r\nConnection: X-Secret, close\r\nX-Secret: s\r\n"
    b"TE: trailers\r\nX-Kept: k\r\n\r\n",
    b"GET /x HTTP/1.1\r\nHost: h\r\nX-Forwarded-For: 1.2.3.4\r\nx-forwarded-for: 5.6.7.8\r\n"
    b"X-Forwarded-Proto: https\r\nX-Forwarded-Host: other\r\nX-Request-ID: abc\r\n\r\n",
    b"GET /x HTTP/1.1\r\nHost: h\r\nX-Request-ID: \r\nX-Forwarded-For: \r\n\r\n",
    b"GET /x HTTP/1.1\r\nHost: h\r\nConnection: X-Forwarded-For, TE\r\n"
    b"X-Forwarded-For: 6.6.6.6\r\nTE: a\r\nte: b\r\n\r\n",
    b"GET http://absolute.example/p?q HTTP/1.1\r\nHost: ignored\r\n\r\n",
    b"GET /x#frag HTTP/1.1\r\nHost: h\r\n\r\n",
    b"GET /x HTTP/1.1\r\nHost: h\r\nCookie: a=1\r\nCookie: b=2\r\nUser-Agent: u\r\n"
    b"User-Agent: u\r\nX_Underscore: dropped\r\n\r\n",
    b"POST /form HTTP/1.1\r\nHost: h\r\nContent-Type: text/plain\r\nContent-Length: 3\r\n\r\nabc",
    b"PUT /up HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    b"OPTIONS * HTTP/1.1\r\nHost: h\r\n\r\n",
    b"GET /caf%C3%A9 HTTP/1.1\r\nHost: h\r\nX-Latin: caf\xe9\r\n\r\n",
]

FORWARDINGS = [
    None,
    Forwarding(),
    Forwarding(("for", "host")),
    Forwarding(trusted=parse_networks(["10.0.0.0/8"])),
    Forwarding(("request-id",), trusted=parse_networks(["10.0.0.0/8"])),
]


def head_of(data):
    reader = RequestReader()
    reader.receive_data(data)
    request = reader.next_request()
    assert request is not None and request.refusal is None, data
    return request.head


def environ_variables(head, forwarding, trusted):
    """What the front made of a head before relay.py, and the LB forwarded
    as JSON: its variables, and the fields about one hop apart."""
    forward = dict(BASE)
    forward["REMOTE_ADDR"], forward["REMOTE_PORT"] = REMOTE
    hop = request_variables(forward, head)
    if forwarding is not None:
        apply_forwarding(forwarding, forward, REMOTE[0], trusted)
    return forward, hop or {}


def apply_forwarding(forwarding, variables, client, trusted):
    """The forwarding rules over the variables, as the front applied them
    before relay.py: what Forwarding.fields must come to, stated apart."""
    if forwarding.set_for and client:
        previous = variables.get("HTTP_X_FORWARDED_FOR")
        variables["HTTP_X_FORWARDED_FOR"] = "%s, %s" % (previous, client) if previous else client
    if forwarding.set_proto and not (trusted and "HTTP_X_FORWARDED_PROTO" in variables):
        variables["HTTP_X_FORWARDED_PROTO"] = variables.get("wsgi.url_scheme", "http")
    if forwarding.set_host and not (trusted and "HTTP_X_FORWARDED_HOST" in variables):
        host = variables.get("HTTP_HOST")
        if host is None:
            variables.pop("HTTP_X_FORWARDED_HOST", None)
        else:
            variables["HTTP_X_FORWARDED_HOST"] = host
    if forwarding.set_request_id and not variables.get("HTTP_X_REQUEST_ID"):
        variables["HTTP_X_REQUEST_ID"] = "0" * 32  # (a made one: see ids_made)


def ids_made(variables):
    """``variables`` with a request id forwarding made (32 random hex
    digits) said as "made"; the two ways make different ones."""
    made = dict(variables)
    if re.fullmatch("[0-9a-f]{32}", made.get("HTTP_X_REQUEST_ID", "")):
        made["HTTP_X_REQUEST_ID"] = "made"
    return made


def without_room(variables):
    """Decoded variables less the keys the worker is to set (relay.ROOM),
    each an empty string until it does."""
    assert all(variables.get(key, "") == "" for key in ROOM if not key.isupper())
    return {k: v for k, v in variables.items() if k.isupper() or k not in ROOM}


def relay_of(head, forwarding, trusted):
    variables = dict(BASE)
    variables["REMOTE_ADDR"], variables["REMOTE_PORT"] = REMOTE
    return Relay(head, Facts(variables), BASE, REMOTE, forwarding or None, REMOTE[0], trusted)


@pytest.mark.parametrize("data", HEADS)
@pytest.mark.parametrize("forwarding", FORWARDINGS)
@pytest.mark.parametrize("trusted", [False, True])
def test_the_worker_gets_what_the_json_environ_gave(data, forwarding, trusted):
    head = head_of(data)
    expected, hop = environ_variables(head, forwarding, trusted)
    relay = relay_of(head, forwarding, trusted)
    assert ids_made(relay.variables()) == ids_made(expected)
    for end in (True, False):
        variables, ended = decode_head_request(relay.payload("the class", end))
        assert ended is end
        assert variables.pop("zc_lb.request_class") == "the class"
        assert without_room(variables) == relay.variables()  # (the same request id too)
    # The LB's own view has the fields about one hop too, as its environ had.
    assert ids_made(relay.all_variables()) == ids_made({**expected, **hop})


def test_a_simple_head_goes_as_it_came():
    data = b"GET /x?y HTTP/1.1\r\nHost:  h \r\nAccept: */*\r\n\r\n"
    head = head_of(data)
    assert head.raw == data[:-2]
    payload = relay_of(head, None, False).payload("", True)
    assert payload.endswith(data[:-2])
    # Changed by the checks (a fragment cut off), it is made again.
    head = head_of(b"GET /x#f HTTP/1.1\r\nHost: h\r\n\r\n")
    assert head.raw is None
    assert relay_of(head, None, False).payload("", True).endswith(
        b"GET /x HTTP/1.1\r\nHost: h\r\n")


def test_fields_about_one_hop_go_with_the_head_as_it_came():
    # The worker leaves them out itself, as the front's environ did: a
    # browser's Connection: keep-alive does not make the head be made again.
    data = b"GET /x HTTP/1.1\r\nHost: h\r\nConnection: keep-alive, X-A\r\nX-A: 1\r\n\r\n"
    relay = relay_of(head_of(data), Forwarding(), False)
    payload = relay.payload("", True)
    assert data[:-2] in payload and payload.endswith(b"X-Request-ID: %s\r\n" % (
        relay.variables()["HTTP_X_REQUEST_ID"].encode()))
    assert without_room(decode_head_request(payload)[0]) == relay.variables()
    assert "HTTP_X_A" not in relay.variables() and relay.all_variables()["HTTP_X_A"] == "1"
    # A forwarding header the client's Connection names: made again, or the
    # worker would leave out the one forwarding sets.
    data = b"GET /x HTTP/1.1\r\nHost: h\r\nConnection: X-Forwarded-For\r\n\r\n"
    relay = relay_of(head_of(data), Forwarding(), False)
    payload = relay.payload("", True)
    assert b"Connection" not in payload
    assert decode_head_request(payload)[0]["HTTP_X_FORWARDED_FOR"] == REMOTE[0]


def test_the_classifiers_mapping():
    head = head_of(b"GET /a%2Fb?q=1 HTTP/1.1\r\nHost: Example.COM:80\r\nConnection: close\r\n\r\n")
    relay = relay_of(head, Forwarding(), False)
    expected = relay.all_variables()
    assert relay.get("HTTP_HOST") == "Example.COM:80" == expected["HTTP_HOST"]
    assert relay.get("PATH_INFO") == "/a/b" == expected["PATH_INFO"]
    assert relay["QUERY_STRING"] == "q=1"
    assert relay["HTTP_CONNECTION"] == "close"  # (as the environ had it)
    assert relay.get("HTTP_NOPE") is None and relay.get("HTTP_NOPE", 7) == 7
    with pytest.raises(KeyError):
        relay["HTTP_NOPE"]
    assert "wsgi.url_scheme" in relay and "HTTP_NOPE" not in relay
    assert dict(relay) == expected and len(relay) == len(expected)
    assert dict(relay.items()) == expected and list(relay.keys()) == list(expected)
    # Without a Host (HTTP/1.0), the default.
    relay = relay_of(head_of(b"GET / HTTP/1.0\r\n\r\n"), None, False)
    assert relay.get("HTTP_HOST", "none") == "none"


def test_complete_puts_the_variables_into_the_lbs_environ_once():
    relay = relay_of(head_of(b"GET /p HTTP/1.1\r\nHost: h\r\n\r\n"), None, False)
    environ = {"zc_lb.class": "h", "REQUEST_METHOD": "GET"}
    relay.complete(environ)
    assert environ["PATH_INFO"] == "/p" and environ["zc_lb.class"] == "h"
    environ["PATH_INFO"] = "changed"
    relay.complete(environ)
    assert environ["PATH_INFO"] == "changed"


def test_has_body_and_its_limit():
    assert not relay_of(head_of(HEADS[0]), None, False).has_body(10)
    [posted] = [data for data in HEADS if b"Content-Length: 3" in data]
    [chunked] = [data for data in HEADS if b"chunked" in data]
    assert relay_of(head_of(posted), None, False).has_body(10)
    assert relay_of(head_of(chunked), None, False).has_body(1)
    with pytest.raises(RequestTooLarge):
        relay_of(head_of(posted), None, False).has_body(2)


def test_facts_keep_the_start_of_the_last_payload():
    facts = Facts({"REMOTE_ADDR": "1.2.3.4"})
    start = facts.start("c", True)
    assert facts.start("c", True) is start
    assert facts.start("c", False) != start and facts.start("d", False) != start
    flags, length, class_length = HEAD_PREFIX.unpack_from(facts.start("\u00e9", True))
    assert (flags, length, class_length) == (1, len(facts.encoded), 2)


def payload(facts=b'{"A":"b"}', rclass=b"c", head=b"GET / HTTP/1.1\r\nHost: h\r\n", flags=1,
            facts_length=None, class_length=None):
    return HEAD_PREFIX.pack(flags, len(facts) if facts_length is None else facts_length,
                            len(rclass) if class_length is None else class_length
                            ) + facts + rclass + head


def test_a_good_payload():
    variables, end = decode_head_request(payload())
    assert end and variables["A"] == "b" and variables["HTTP_HOST"] == "h"
    assert variables["zc_lb.request_class"] == "c"
    # Facts without the variables PEP 3333 requires: a worker's defaults.
    assert REQUIRED.items() <= variables.items()
    variables, _ = decode_head_request(payload(facts=b'{"SERVER_NAME":"s"}'))
    assert variables["SERVER_NAME"] == "s" and variables["SERVER_PORT"] == "80"


@pytest.mark.parametrize("data, error", [
    (b"\x01\x00", "shorter than its prefix"),
    (payload(flags=3), "malformed head request prefix"),
    (payload(facts_length=500), "malformed head request prefix"),
    (payload(facts=b'{"A":', facts_length=5), "bad head request facts"),
    (payload(facts=b'{"A":1}'), "object of strings"),
    (payload(facts=b'["A"]'), "object of strings"),
    (payload(rclass=b"\xff"), "not UTF-8"),
    (payload(head=b"GET /\r\n"), "malformed head request"),
    (payload(head=b"GET / HTTP/1.1\r\nHost: h"), "malformed head request"),
    (payload(head=b""), "malformed head request"),
    (payload(head=b"GET / HTTP/1.1\r\nno colon\r\n"), "malformed head request field"),
    (payload(head=b"GET / HTTP/1.1\r\n: v\r\n"), "malformed head request field"),
])
def test_a_bad_payload_is_a_protocol_error(data, error):
    with pytest.raises(RemoteProtocolError, match=error):
        decode_head_request(data)


def test_facts_are_decoded_once_per_connection():
    from zc_lb.lb import relay as relay_module

    facts = orjson.dumps({"REMOTE_PORT": "4242"})
    relay_module._FACTS.pop(facts, None)
    first, _ = decode_head_request(payload(facts=facts))
    assert facts in relay_module._FACTS
    second, _ = decode_head_request(payload(facts=facts))
    assert first == second and first is not second  # (each request its own dict)
    first["REMOTE_PORT"] = "changed"
    assert decode_head_request(payload(facts=facts))[0]["REMOTE_PORT"] == "4242"


# Heads made at random from pieces of every kind the front takes (and
# some it refuses, which are skipped): the two ways agree on each.
names = st.sampled_from(["Host", "host", "Accept", "Cookie", "Connection", "Keep-Alive", "TE",
                         "X-Forwarded-For", "x-forwarded-proto", "X-Forwarded-Host",
                         "X-Request-ID", "X-Custom", "X_Under", "Content-Type", "Upgrade",
                         "Proxy-Connection", "Transfer-Encoding", "Content-Length"])
values = st.sampled_from(["", "a", "1.2.3.4", "close", "keep-alive", "X-Custom, close",
                          "x-forwarded-for", "TE, X-Request-ID", "chunked", "3", " spaced ",
                          "t\tab", "caf\xe9", "h.example:80", "a=1; b=2"])
targets = st.sampled_from(["/", "/a%20b?q=1", "/x#f", "*", "http://abs.example/p?x",
                           "/%41?%zz"])


# (Heads the front refuses are skipped, about three in four: expected.)
@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(method=st.sampled_from(["GET", "HEAD", "POST", "OPTIONS"]), target=targets,
       version=st.sampled_from(["HTTP/1.1", "HTTP/1.0"]),
       fields=st.lists(st.tuples(names, values), max_size=8),
       forwarding=st.sampled_from(FORWARDINGS), trusted=st.booleans())
def test_any_head_the_front_takes_relays_as_the_environ_had_it(method, target, version, fields,
                                                               forwarding, trusted):
    data = ("%s %s %s\r\n" % (method, target, version)
            + "".join("%s: %s\r\n" % field for field in fields) + "\r\n").encode("latin-1")
    reader = RequestReader()
    reader.receive_data(data)
    request = reader.next_request()
    assume(request is not None and request.refusal is None)
    head = request.head
    expected, hop = environ_variables(head, forwarding, trusted)
    relay = relay_of(head, forwarding, trusted)
    assert ids_made(relay.variables()) == ids_made(expected)
    variables, _ = decode_head_request(relay.payload("c", True))
    variables.pop("zc_lb.request_class")
    assert without_room(variables) == relay.variables()
    assert ids_made(relay.all_variables()) == ids_made({**expected, **hop})
    # The mapping answers some keys from the head itself: as the environ.
    environ = ids_made({**expected, **hop})
    for key in list(environ) + ["HTTP_HOST", "HTTP_NOPE", "REMOTE_USER"]:
        assert ids_made({key: relay.get(key, "-")}) == {key: environ.get(key, "-")}, key
