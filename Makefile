# vigil: `make test` and `make demo` work on a fresh Debian machine with Python 3.11; each
# bootstraps what it needs (.venv, pip installs, Debian packages for the real programs).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: test test-all demo bench lint typecheck system-packages clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

system-packages:
	./scripts/ensure-system-packages.sh

lint: $(STAMP)
	$(BIN)/ruff check .

typecheck: $(STAMP)
	$(BIN)/mypy

# The full-length simulations (marked slow, ~10 min) run in `make test-all`; `make test` runs every
# shipped scenario trimmed to its deadlines.
test: $(STAMP) system-packages lint typecheck
	$(BIN)/pytest -q -m "not slow" $(PYTEST_ARGS)

test-all: $(STAMP) system-packages lint typecheck
	$(BIN)/pytest -q $(PYTEST_ARGS)

demo: $(STAMP)
	$(BIN)/vigil demo

bench: $(STAMP)
	$(BIN)/python -m bench.run

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
