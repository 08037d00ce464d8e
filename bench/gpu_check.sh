#!/usr/bin/env bash
# The GPU checks, prepared for a lent GPU machine (the `device` tool's `run`), in one call of about
# 8 minutes:
#   run(command="bash bench/gpu_check.sh", timeout_s=600)
# Nothing to install: that machine's python3 has torch, transformers, peft, safetensors and pytest
# (no Ray, so only Ray-free checks run). Everything lands in $OUT (./gpu_check_out when unset):
#   gpu.txt                  the GPU, driver, torch and transformers versions
#   test_cuda.log            the GPU tests (-k cuda): tests/test_cuda.py (seeded sampling, weight
#                            updates, memory release, the KV pool from free memory, an actor step)
#                            and the cuda cases of the logits, greedy, bf16 and
#                            speculative-sampling tests
#   rollout_cuda_quick.json  bench/rollout.py --quick --device cuda (every scenario, quick sizes)
#   rollout_cuda.json        bench/rollout.py --device cuda --only fixed,fixed_tiny,mixed,prefix
#                            (full sizes)
# Each step has its own time limit, so a hang in one still leaves the others' results.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 \
  TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import torch, transformers
print('torch', torch.__version__, '| transformers', transformers.__version__,
      '| cuda available:', torch.cuda.is_available())"; } 2>&1 | tee "$OUT/gpu.txt"

echo "== GPU tests"
timeout 240 $PY -m pytest -q -p no:cacheprovider -o addopts="" -k cuda \
  tests/test_cuda.py tests/test_rollout_engine.py tests/test_rollout_bf16.py \
  tests/test_rollout_spec.py 2>&1 | tee "$OUT/test_cuda.log" | tail -15

echo "== bench/rollout.py --quick --device cuda"
timeout 240 $PY bench/rollout.py --quick --device cuda --threads 8 \
  --out "$OUT/rollout_cuda_quick.json" 2>&1 | tail -4

echo "== bench/rollout.py --device cuda (full sizes, no spec: its full warm starts take an hour)"
timeout 150 $PY bench/rollout.py --device cuda --threads 8 --only fixed,fixed_tiny,mixed,prefix \
  --out "$OUT/rollout_cuda.json" 2>&1 | tail -4
ls -l "$OUT"
