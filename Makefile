# Two commands for a fresh machine: `make train` (the default job) and `make test`.
# Both create .venv on first use: torch 2.13.0 (CPU wheel) first, then hybridrl and its dependencies.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
CONFIG  ?= examples/arith_grpo.yaml
ARGS    ?=
PYTEST_ARGS ?=

.PHONY: train test test-all lint venv clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

venv: $(BIN)/.installed

train: venv
	$(BIN)/hybridrl train $(CONFIG) $(ARGS)

test: venv
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test-all: venv
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf runs checkpoints .pytest_cache
