# Two entry points on a fresh machine: `make demo` and `make test`.
# Each creates the virtual environment with pinned dependencies on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench venv clean

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

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
