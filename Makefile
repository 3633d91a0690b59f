# prefect-launch: `make demo` runs the product, `make test` passes the tests.
# Both create .venv themselves; nothing needs to be installed by hand.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Python's default: processes write and reuse bytecode caches. Where the environment sets
# PYTHONDONTWRITEBYTECODE, every agent, flow and CLI process the tests start compiles the project's
# sources again (~0.3 s of CPU each) and pytest rewrites every test module on each run.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: demo test test-fast venv system-deps bench dashboard clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,postgres,sessions]'
	touch $(STAMP)

venv: $(STAMP)

# Chromium for the dashboard's browser test; PostgreSQL for the store's tests.
system-deps:
	@bash scripts/system-deps.sh

# DB=postgres: the Prefect server and the metrics store on a private PostgreSQL (installed when missing).
# AUTH=1: the gateway in front of the server, an admin and two users (keys printed once); see docs/security.md.
DB ?= sqlite
AUTH ?= 0
demo: venv
	@if [ "$(DB)" = postgres ]; then bash scripts/system-deps.sh; fi
	@DB=$(DB) AUTH=$(AUTH) bash scripts/demo.sh

# One test file per worker at a time, heaviest first (tests/file_order.py). The suite is CPU-bound (its Prefect servers, agents and flow runs):
# a worker per CPU, at least 2 (the e2e tests also wait on agents and servers) and at most 4 (each worker
# runs its own Prefect server and browser); PYTEST_WORKERS=N sets it.
PYTEST_WORKERS ?= $(shell $(PY) -c "import os; print(max(2, min(4, len(os.sched_getaffinity(0)))))")
PYTEST_ARGS ?= -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=30
test: venv system-deps
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# The pure tests alone: no Prefect server, agent, Docker, browser or PostgreSQL (the `server` marker,
# set in tests/conftest.py; tests/README.md), so no system-deps. Under a minute on 2 cores.
FAST_ARGS ?= -n 2 --durations=10
test-fast: venv
	$(BIN)/python -m pytest -q -m "not server" $(FAST_ARGS)

# Each benchmark runs our path and stock Prefect's in one run and ends with one JSON line.
bench: venv
	$(BIN)/python bench/dispatch.py
	$(BIN)/python bench/metrics_overhead.py
	$(BIN)/python bench/dashboard.py
	$(BIN)/python bench/idle_load.py

# The queue monitor alone, against the server in PREFECT_API_URL.
dashboard: venv
	$(BIN)/python -m prefect_launch.dashboard.serve --server.address 127.0.0.1 --server.port 8501 --server.headless true

clean:
	rm -rf $(VENV) .launch
