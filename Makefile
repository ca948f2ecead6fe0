# vigil: `make test` and `make demo` work on a fresh Debian machine with Python 3.11; each
# bootstraps what it needs (.venv, pip installs, Debian packages for the real programs).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
PYTEST_ARGS ?=
# pytest-xdist workers: one per core, at most 4 (each worker may start its own PostgreSQL, Slurm
# cluster or aggregator processes). Whole files go to one worker (--dist loadfile), so a module's
# fixtures are made once. PYTEST_WORKERS=0 runs the suite in one process.
PYTEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ "$$n" -gt 4 ] && n=4; echo $$n)

.PHONY: test test-all demo bench lint typecheck typecheck-all system-packages clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,torch]'
	touch $(STAMP)

venv: $(STAMP)

system-packages:
	./scripts/ensure-system-packages.sh

lint: $(STAMP)
	$(BIN)/ruff check .

typecheck: $(STAMP)
	$(BIN)/mypy

# The tests, benchmarks and scripts too (~15 s more, so in `make test-all` only).
typecheck-all: $(STAMP)
	$(BIN)/mypy
	$(BIN)/mypy tests bench scripts

# The full-length simulations (marked slow, ~10 min) run in `make test-all`; `make test` runs every
# shipped scenario trimmed to its deadlines.
# Both build the container image in the background meanwhile (where root, buildah and debootstrap
# are there; ~3 min cold, bounded by `timeout 900`, log in build/image.log): pytest is mostly one
# busy core per worker, and tests/deploy/test_image.py, scheduled last, waits for the build's status file. A build
# still running when pytest ends (the image test deselected, pytest crashed) is stopped; after a
# Ctrl-C of make itself the 900 s limit ends it.
IMAGE_STATUS := $(CURDIR)/build/image.status
define pytest_with_image
	./scripts/build-image.sh --background
	VIGIL_IMAGE_BUILD_STATUS=$(IMAGE_STATUS) $(BIN)/pytest -q -n $(PYTEST_WORKERS) --dist loadfile $(1) $(PYTEST_ARGS); \
	  rc=$$?; ./scripts/build-image.sh --stop; exit $$rc
endef

test: $(STAMP) system-packages lint typecheck
	$(call pytest_with_image,-m "not slow")

test-all: $(STAMP) system-packages lint typecheck-all
	$(call pytest_with_image,)

# The demo needs only vigil's runtime dependencies (not the test toolchain): a venv of its own,
# with pip's progress shown so a first run does not look stuck.
DEMO_VENV  := .venv-demo
DEMO_STAMP := $(DEMO_VENV)/.installed-stamp

$(DEMO_STAMP): pyproject.toml
	@echo "make demo: creating $(DEMO_VENV) and installing vigil's runtime dependencies (about a minute the first time)"
	$(PYTHON) -m venv $(DEMO_VENV)
	$(DEMO_VENV)/bin/pip install --progress-bar on -e .
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(DEMO_VENV)/bin/vigil demo

bench: $(STAMP)
	$(BIN)/python -m bench.run
	$(BIN)/python -m bench.bench_loadgen
	$(BIN)/python -m bench.bench_fleet_memory
	$(BIN)/python -m bench.bench_group_testing

clean:
	rm -rf $(VENV) $(DEMO_VENV) .pytest_cache .mypy_cache .ruff_cache
