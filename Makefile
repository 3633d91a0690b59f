# prefect-launch: `make demo` runs the product, `make test` passes the tests.
# Both create .venv themselves; nothing needs to be installed by hand.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test venv system-deps bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,postgres]'
	touch $(STAMP)

venv: $(STAMP)

# Chromium for the dashboard's browser test; PostgreSQL for the store's tests.
system-deps:
	@bash scripts/system-deps.sh

demo: venv
	@bash scripts/demo.sh

test: venv system-deps
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# Each benchmark runs our path and stock Prefect's in one run and ends with one JSON line.
bench: venv
	$(BIN)/python bench/dispatch.py
	$(BIN)/python bench/metrics_overhead.py
	$(BIN)/python bench/dashboard.py

clean:
	rm -rf $(VENV) .launch
