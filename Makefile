# Two commands on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch is pinned to the CPU build that this machine kind serves from a local file.
PIP := $(BIN)/pip install --disable-pip-version-check -q

.PHONY: demo test test-all bench venv clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(VENV)/.installed-core: pyproject.toml | $(BIN)/python
	$(PIP) torch==2.13.0
	$(PIP) -e '.[data,cli,report]'
	touch $@

$(VENV)/.installed-dev: pyproject.toml $(VENV)/.installed-core
	$(PIP) -e '.[dev]'
	touch $@

venv: $(VENV)/.installed-core

demo: $(VENV)/.installed-core
	$(BIN)/edgetrain demo

# One pytest worker per core (at most 4); tests/conftest.py gives each worker its share of the threads.
PYTEST := $(BIN)/python -m pytest -q -n auto --maxprocesses=4

test: $(VENV)/.installed-dev
	$(PYTEST)

test-all: $(VENV)/.installed-dev
	$(PYTEST) -m ''

bench: $(VENV)/.installed-dev
	$(BIN)/python bench/bench_budget.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache
