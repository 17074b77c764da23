# The two commands a new user needs: `make demo` (runs the main job) and `make test` (runs the tests).
# Each installs what it needs first, into the current Python environment.
PYTHON ?= python3
CONFIG ?= deploy/local.yaml

.PHONY: install demo serve test test-fast lint proto bench-engine bench-transfer

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

test-fast: .install-stamp
	$(PYTHON) -m pytest -q -m "not slow"

lint: .install-stamp
	ruff check . && mypy engine kv_transfer pdcluster router prefill_workers decode_workers

bench-engine: .install-stamp
	pdcluster bench engine

bench-transfer: .install-stamp
	pdcluster bench transfer

proto: .install-stamp
	$(PYTHON) scripts/gen_proto.py
