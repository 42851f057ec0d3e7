# Two entry points on a fresh machine: `make demo` and `make test`.
# Each creates the virtual environment with pinned dependencies on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint format bench fuzz venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml requirements.txt requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -r requirements-dev.txt
	$(BIN)/python -m pip install --quiet --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/bigbatch train

test: $(STAMP)
	$(BIN)/python -m pytest -q

# The inner loop: every test not marked slow, unit and integration (under 2 minutes on 2 CPU cores).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

# Lint, format and type checks (pinned in requirements-dev.txt, configured in pyproject.toml); CI runs them too.
# `make format` rewrites the files the format check would refuse.
lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff format src tests benchmarks examples
	$(BIN)/ruff check --fix src tests benchmarks examples

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py

# Differential fuzzer (tests/support/fuzz.py): bigbatch's training step against one naive giant batch.
# `make fuzz` runs CI's fixed seeds, `make fuzz N=200` 200 random seeds, `make fuzz SEED=1234` one seed.
fuzz: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python tests/support/fuzz.py $(if $(SEED),--seed $(SEED) --verbose,$(if $(N),--n $(N)))

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
