# Two entry points on a fresh machine: `make demo` and `make test`.
# Each creates the virtual environment with pinned dependencies on first use, in two steps: the runtime pins
# (requirements.txt) and the package, which is all `make demo` needs; then, for the targets that test, lint or
# benchmark, the dev pins on top (requirements-dev.txt: test tools, transformers, the optional loggers).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
RUNTIME := $(VENV)/.runtime
DEV := $(VENV)/.dev

.PHONY: demo test test-fast lint format bench bench-trl fuzz venv venv-runtime clean

# The runtime environment: the pins `bigbatch train` needs and the package itself (editable).
venv-runtime: $(RUNTIME)

# The development environment: the runtime one plus the dev pins (changing requirements-dev.txt re-runs only this).
venv: $(DEV)

$(RUNTIME): pyproject.toml requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -r requirements.txt
	$(BIN)/python -m pip install --quiet --no-deps -e .
	touch $(RUNTIME)

$(DEV): $(RUNTIME) requirements-dev.txt
	$(BIN)/python -m pip install --quiet -r requirements-dev.txt
	touch $(DEV)

demo: $(RUNTIME)
	$(BIN)/bigbatch train

# Everything, slow tests included, across both cores (pytest-xdist: a test file's tests on one worker, so its
# module fixtures are built once), one thread each; the 20 slowest are listed at the end.
test: $(DEV)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=20

# The inner loop: every test not marked slow, unit and integration (see README.md for its time on 2 CPU cores);
# tests over 1 s are listed at the end as candidates for @pytest.mark.slow.
test-fast: $(DEV)
	$(BIN)/python -m pytest -q -m "not slow"

# Lint, format and type checks (pinned in requirements-dev.txt, configured in pyproject.toml); CI runs them too.
# `make format` rewrites the files the format check would refuse.
lint: $(DEV)
	$(BIN)/ruff check src tests benchmarks examples docs
	$(BIN)/ruff format --check src tests benchmarks examples docs
	$(BIN)/mypy

format: $(DEV)
	$(BIN)/ruff format src tests benchmarks examples docs
	$(BIN)/ruff check --fix src tests benchmarks examples docs

bench: $(DEV)
	$(BIN)/python benchmarks/run_all.py

# bigbatch beside TRL: DPO beside its DPOTrainer (benchmarks/trl_dpo.py), GRPO's loss types beside its GRPOTrainer
# (benchmarks/trl_grpo.py). TRL goes into .bench/trl, never into .venv: its own dependencies (transformers,
# accelerate, datasets) are already the dev pins.
TRL_VERSION := 1.16.0
.bench/trl/trl-$(TRL_VERSION).dist-info: | $(DEV)
	$(BIN)/python -m pip install --quiet --no-deps --target .bench/trl trl==$(TRL_VERSION)

bench-trl: $(DEV) .bench/trl/trl-$(TRL_VERSION).dist-info
	PYTHONPATH=.bench/trl $(BIN)/python benchmarks/trl_dpo.py
	PYTHONPATH=.bench/trl $(BIN)/python benchmarks/trl_grpo.py

# Differential fuzzer (tests/support/fuzz.py): bigbatch's training step against one naive giant batch.
# `make fuzz` runs CI's fixed seeds, `make fuzz N=200` 200 random seeds, `make fuzz SEED=1234` one seed.
fuzz: $(DEV)
	OMP_NUM_THREADS=1 $(BIN)/python tests/support/fuzz.py $(if $(SEED),--seed $(SEED) --verbose,$(if $(N),--n $(N)))

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
