# The two commands a new user needs: `make demo` (runs the main job) and `make test` (runs the tests).
# Each installs what it needs first, into the current Python environment.
PYTHON ?= python3
CONFIG ?= deploy/local.yaml

.PHONY: install demo serve test test-fast test-reliability lint proto bench-engine bench-transfer bench-soak

.install-stamp: pyproject.toml scripts/install.sh
	bash scripts/install.sh
	touch $@

install: .install-stamp

demo: .install-stamp
	$(PYTHON) -m pdcluster demo

serve: .install-stamp
	$(PYTHON) -m pdcluster serve --config $(CONFIG)

test: .install-stamp
	$(PYTHON) -m pytest -q

# The failure-injection tests alone (killed actors, cancelled streams, Redis outage, fuzzing), all marked slow.
test-reliability: .install-stamp
	$(PYTHON) -m pytest -q tests/test_failover.py tests/test_reliability.py tests/test_fuzz.py

test-fast: .install-stamp
	$(PYTHON) -m pytest -q -m "not slow"

lint: .install-stamp
	ruff check . && mypy engine kv_transfer pdcluster router prefill_workers decode_workers

bench-engine: .install-stamp
	pdcluster bench engine

bench-soak: .install-stamp
	$(PYTHON) -m pdcluster bench soak --streams 32 --minutes 10

bench-transfer: .install-stamp
	pdcluster bench transfer

proto: .install-stamp
	$(PYTHON) scripts/gen_proto.py
