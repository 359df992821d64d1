# cairn — developer commands. `make test` and `make demo` work on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# `make demo` installs only what the demo runs (cairn and JAX), under its own stamp in the same venv.
DEMO_STAMP := $(VENV)/.installed-demo
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8
export JAX_PLATFORMS ?= cpu

.PHONY: install test test-fast demo lint bench docs wheel stress clean

# Azurite, the Azure Blob emulator the object-store tests run against (Node; installed only where
# npm is; without it those tests skip, saying so). fake-gcs-server comes with the dev extra.
AZURITE_VERSION := 3.35.0
AZURITE := $(VENV)/node/node_modules/.bin/azurite-blob
NPM := $(shell command -v npm 2>/dev/null)

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# The distribution was named `cairn` until 0.3.0: a venv made then loses that name first.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip uninstall -q -y cairn 2>/dev/null || true
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

$(DEMO_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip uninstall -q -y cairn 2>/dev/null || true
	$(BIN)/pip install -q -e '.[jax]'
	touch $(DEMO_STAMP)

$(AZURITE): | $(STAMP)
ifneq ($(NPM),)
	$(NPM) install --prefix $(VENV)/node --no-audit --no-fund --loglevel=error azurite@$(AZURITE_VERSION)
else
	@echo "make: npm not found, so Azurite is not installed and the Azure tests will skip"
endif

install: $(STAMP) $(AZURITE)

test: install
	$(BIN)/python -m pytest -q $(ARGS)

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow" $(ARGS)

demo: $(DEMO_STAMP)
	$(BIN)/python examples/demo.py $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python -m benchmarks.run $(ARGS)

# The documentation site, warnings as errors, into site/ (its code blocks run in tests/package/test_docs.py).
docs: $(STAMP)
	$(BIN)/pip install -q -e '.[docs]'
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# The sdist and wheel, built into dist/, checked (twine), and the wheel installed into a clean venv
# for a smoke test without JAX (.ci/wheel; CI runs it after the tests).
wheel: $(STAMP)
	bash .ci/wheel $(BIN)/python

# The slow cases at full size, and the property tests exploring at random (tests/conftest.py).
stress: install
	CAIRN_STRESS=1 $(BIN)/python -m pytest -q -m "slow or property" tests $(ARGS)

clean:
	rm -rf $(VENV) build dist site src/*.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
