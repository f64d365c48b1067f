"""playback/zodbapp.py: a page per path in a real ZEO server's database;
a request loads what its connection's cache lacks, and says so."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from zc_lb.playback import zodbapp  # noqa: E402
from zc_lb.testing import free_port, stop_process, wait_for_port  # noqa: E402


@pytest.fixture
def zeo(tmp_path):
    filename = str(tmp_path / "Data.fs")
    assert zodbapp.populate(filename, ["/a", "/b", "/a", "/caf\xc3\xa9"]) == 3
    address = "127.0.0.1:%d" % free_port()
    with open(tmp_path / "zeo.log", "w") as log:
        process = zodbapp.start_server(filename, address, log)
    try:
        wait_for_port(address, process, 30)
        yield address
    finally:
        stop_process(process)


def get(app, path):
    said = {}
    environ = {"PATH_INFO": path, "REQUEST_METHOD": "GET"}
    body = b"".join(app(environ, lambda status, headers: said.update(
        status=status, headers=dict(headers))))
    return said["status"], int(said["headers"]["X-Cache-Misses"]), environ.get("zc_lb.cache"), body


def test_a_page_is_loaded_once_per_connection_then_served_from_its_cache(zeo):
    app = zodbapp.make_app(zeo, cache_signal=True, worker_id="w1")
    before = zodbapp.server_loads(zeo)
    status, loads, said, body = get(app, "/a")
    assert status == "200 OK" and body == b"/a: %d bytes\n" % (zodbapp.PARTS * zodbapp.PART_SIZE)
    assert loads >= 1 + zodbapp.PARTS and said == "miss"  # (and the root and the tree)
    assert get(app, "/a")[1:3] == (0, "hit")  # one thread: the same connection
    assert get(app, "/caf\xc3\xa9")[0] == "200 OK"
    assert get(app, "/nowhere")[0] == "404 Not Found"
    assert zodbapp.server_loads(zeo) - before >= loads + zodbapp.PARTS + 1


def test_the_app_needs_the_zeo_servers_address():
    with pytest.raises(ValueError, match="HOST:PORT"):
        zodbapp.make_app("nowhere")
    with pytest.raises(ValueError, match="ZC_LB_ZODBAPP_ZEO"):
        zodbapp.app_from_environment({})
