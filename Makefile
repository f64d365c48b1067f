# zc-lb: everything a person or CI needs, from a fresh machine.
#
#   make run    set up, then start the demo: an LB on 127.0.0.1:8080 in
#               front of 4 local workers (no ZooKeeper needed)
#   make test   set up, then run the whole test suite
#   make bench  set up, then run the benchmarks (ratios, side by side)
#   make soak   set up, then ten minutes at half capacity, watching for leaks
#   make docs   write docs/reference/settings.rst and cli.rst from the code
#
# Each compiles zc_lb.COMPILED first (make compile: mypyc, from the same
# source); make test runs the suite on it, then those modules' tests on the source.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
APT_PACKAGES := zookeeper haproxy wrk systemd logrotate chromium chromium-driver gcc python3-dev

# The modules of zc_lb.COMPILED (the routing pool, the HTTP head's parsing
# and checks, ejection, the worker protocol, the front server's client
# connections, the LB's forwarding and the worker's serving), compiled by
# mypyc from the same source, read from that one list; the shared library
# holds their code, the other .so files are small shims.  ZC_LB_PURE=1
# runs the source instead.
COMPILED_SOURCES := $(shell $(PYTHON) -c "import ast; print(' '.join('src/zc_lb/%s.py' % m.replace('.', '/') for m in next(ast.literal_eval(n.value) for n in ast.parse(open('src/zc_lb/__init__.py').read()).body if isinstance(n, ast.Assign) and getattr(n.targets[0], 'id', '') == 'COMPILED')))")
EXT_SUFFIX := $(shell $(PYTHON) -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
COMPILED := src/zc_lb/_compiled__mypyc$(EXT_SUFFIX)
# their tests, run once more on the source (the simulator's golden results
# in test_compiled.py stand for the simulator's tests)
SOURCE_TESTS := tests/test_pool.py tests/test_affinity.py tests/test_classstats.py \
	tests/test_locality.py tests/test_slowstart.py tests/test_relearn.py \
	tests/test_compiled.py tests/test_h1.py tests/test_httpparse.py \
	tests/test_forwarding.py tests/test_classifier.py tests/test_http_corpus.py \
	tests/test_outlier.py tests/test_frames.py tests/test_protocol.py \
	tests/test_connection.py tests/test_front.py tests/test_lb.py tests/test_links.py \
	tests/test_worker.py tests/test_threads.py tests/test_hardening.py tests/test_relay.py

.PHONY: run test bench soak setup sysdeps venv compile zookeeper mypy docs clean

run: venv
	@$(MAKE) --no-print-directory compile || echo "zc-lb: could not compile; running the source"
	$(VENV)/bin/zc-lb demo

test: setup
	ZC_LB_EXPECT_BUILD=compiled $(PY) -m pytest -q -n 3 --dist loadfile --no-loadscope-reorder tests
	ZC_LB_PURE=1 ZC_LB_EXPECT_BUILD=source $(PY) -m pytest -q -n 3 --dist loadfile --no-loadscope-reorder $(SOURCE_TESTS)

bench: setup
	$(PY) -m benchmarks.bench

soak: venv compile
	$(PY) -m benchmarks.soak

# Everything the suite and the benchmarks need.  The Debian packages and
# the venv come at once (both wait mostly on downloads), then the compile.
setup:
	@$(MAKE) --no-print-directory -j2 sysdeps venv
	@$(MAKE) --no-print-directory compile

compile: venv $(COMPILED)

$(COMPILED): $(COMPILED_SOURCES) setup.py
	ZC_LB_COMPILE=1 $(PY) setup.py -q build_ext --inplace
	touch $@

mypy: venv
	$(VENV)/bin/mypy  # on the typed modules pyproject.toml lists

# The reference pages written from the code (the settings table, the
# parsers): run after changing a setting or an option, and commit them;
# tests/test_docs.py fails while they differ.
docs: venv
	$(PY) docs/gen_reference.py

venv: $(STAMP)

$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,playback,simulations,paste,zodb]'
	touch $(STAMP)

# Debian packages the tests and benchmarks use: a real ZooKeeper server,
# HAProxy 2.6 for comparisons, wrk for load, systemd and logrotate to check
# the units and the logrotate snippet in etc/, chromium and its driver for
# the status page's browser test.
sysdeps:
	@missing=""; for p in $(APT_PACKAGES); do \
	  dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq \
	    --no-install-recommends $$missing; \
	fi

# A ZooKeeper for trying zc-lb by hand: 127.0.0.1:2181, data under .zk/,
# in the foreground (Ctrl-C stops it).  The tests start their own.
zookeeper: sysdeps
	mkdir -p .zk
	@echo "ZooKeeper on 127.0.0.1:2181, data in .zk/, log in .zk/zookeeper.log; Ctrl-C stops it"
	exec java -Xmx256m -Dorg.slf4j.simpleLogger.logFile=.zk/zookeeper.log \
	  -cp /usr/share/java/zookeeper.jar:/usr/share/java/slf4j-simple.jar \
	  org.apache.zookeeper.server.ZooKeeperServerMain etc/zoo.cfg

clean:
	rm -rf $(VENV) .zk src/*.egg-info .pytest_cache .mypy_cache build src/zc_lb/*.so
