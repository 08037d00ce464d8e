#!/usr/bin/env bash
# The GPU checks, prepared for a lent GPU machine (the `device` tool's `run`), in one call of about
# 8 minutes on an H200 (the steps' time limits add up to 690 s, the vLLM step's 120 of them; the
# steps before it took under 5 minutes):
#   run(command="bash bench/gpu_check.sh", timeout_s=600)
# Needs the machine's python3 to have torch (CUDA), transformers, peft, safetensors, pytest and
# hybridrl's other core dependencies (pyyaml, tqdm, matplotlib, numpy); no Ray (the local controller
# runs every role in this process). A missing module stops the script at once, naming it.
# Everything lands in $OUT (./gpu_check_out when unset):
#   gpu.txt                  the GPU, driver, torch and transformers versions
#   grpo_gpu.json            a short GRPO run on the GPU (W1: examples/arith_grpo.yaml, the built-in
#                            small model, native engine, bf16): step times and where each role ran
#                            in which precision (rollout engine: device, dtype, KV cache; training:
#                            device, parameter and optimizer-state dtypes, autocast), checked
#   grpo_gpu.log             its log (the precision lines say what was chosen and why)
#   test_vllm_gpu.log        where vllm imports: the real-engine tests (tests/test_vllm_engine.py:
#                            generation and log-probs against transformers, weight syncs, LoRA, two
#                            threads, and 5 GRPO steps sync and async through rollout.backend=vllm)
#                            on the GPU; where it does not, one line saying so
#   test_cuda.log            the GPU tests (-k cuda): tests/test_cuda.py (seeded sampling, weight
#                            updates, memory release, the KV pool from free memory, an actor step,
#                            bf16 placement of the rollout worker and the one-GPU learner) and the
#                            cuda cases of the logits, greedy, bf16 and speculative-sampling tests
#   rollout_cuda_quick.json  bench/rollout.py --quick --device cuda (every scenario, quick sizes)
#   rollout_cuda.json        bench/rollout.py --device cuda --only fixed,fixed_tiny,mixed,prefix
#                            (full sizes)
# It fails loudly and early: no CUDA device, a missing module or a failed GRPO check exits 1 before
# the longer steps run. Each later step has its own time limit, so a hang in one still leaves the
# others' results.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 \
  TOKENIZERS_PARALLELISM=false
unset HYBRIDRL_AUTO_PRECISION  # `auto` must decide as on a user's GPU
PY=${PYTHON:-python3}
fail() { echo "gpu_check FAILED: $*" | tee -a "$OUT/FAILED" >&2; exit 1; }

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import torch, transformers
print('torch', torch.__version__, '| transformers', transformers.__version__,
      '| cuda available:', torch.cuda.is_available())"; } 2>&1 | tee "$OUT/gpu.txt"

echo "== preflight"
timeout 60 $PY - <<'EOF' || fail "preflight (see above)"
import importlib
import sys

import torch

if not torch.cuda.is_available():
    sys.exit("no CUDA device visible to torch (CUDA_VISIBLE_DEVICES, driver, or a CPU-only torch)")
missing = []
for name in ("transformers", "peft", "safetensors", "yaml", "tqdm", "matplotlib", "numpy", "pytest"):
    try:
        importlib.import_module(name)
    except ImportError:
        missing.append(name)
if missing:
    sys.exit(f"missing python modules: {', '.join(missing)}")
torch.ones(1, device="cuda").add_(1)  # the device really runs kernels
print("ok:", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
EOF

echo "== GRPO on the GPU (W1, small model, native engine, bf16)"
RUNS=$(mktemp -d)
timeout 150 $PY - "$OUT/grpo_gpu.json" "$RUNS" <<'EOF' 2>&1 | tee "$OUT/grpo_gpu.log" | tail -25
import json
import logging
import math
import statistics
import sys
import time

import torch

from hybridrl.config import Config, load_config
from hybridrl.learner import learner as learner_mod
from hybridrl.parallel.precision import autocast_device, autocast_dtype
from hybridrl.rollout import worker as worker_mod
from hybridrl.telemetry.sinks import METRICS_FILE

out_path, runs = sys.argv[1], sys.argv[2]
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
lines = []


class Keep(logging.Handler):
    def emit(self, record):
        if "precision" in record.getMessage():
            lines.append(record.getMessage())


logging.getLogger("hybridrl").addHandler(Keep())
built = {}  # the workers this process builds (local controller)
for key, cls in (("learner", learner_mod.Learner), ("rollout", worker_mod.RolloutWorker)):
    init = cls.__init__

    def wrapped(self, *a, _init=init, _key=key, **k):
        _init(self, *a, **k)
        built[_key] = self

    cls.__init__ = wrapped

steps = 6
cfg = load_config(Config, "examples/arith_grpo.yaml", [
    "model.name=small", "rollout.backend=native", "rollout.backend_options.dtype=bf16",
    "fsdp.strategy=none", "fsdp.mixed_precision=bf16", "sft.enabled=false",
    f"trainer.total_steps={steps}", "trainer.eval_every=0", "trainer.save_every=0",
    "trainer.loggers=[jsonl]", "trainer.progress=false", "trainer.log_samples_every=0",
    "trainer.name=gpu_grpo_check", f"trainer.runs_dir={runs}", "task.heldout_size=128",
    "controller.backend=local", "controller.num_threads=8",
])  # fmt: skip
from hybridrl.driver import loop  # noqa: E402

t0 = time.perf_counter()
summary = loop.train(cfg)
wall = time.perf_counter() - t0
records = [json.loads(x) for x in open(f"{summary['run_dir']}/{METRICS_FILE}")]
records = [r for r in records if "timing/step" in r]
step_s = [r["timing/step"] for r in records]
learner, rollout = built["learner"], built["rollout"]
eng = rollout.backend.engine
param = next(learner.model.parameters())
opt_dtypes = sorted({str(v.dtype) for s in learner.optimizer.state.values()
                     for k, v in s.items() if torch.is_tensor(v) and k != "step"})  # fmt: skip
report = {
    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    "steps": len(step_s),
    "step_time_s": {
        "first": step_s[0] if step_s else None,
        "median_after_first": statistics.median(step_s[1:]) if len(step_s) > 1 else None,
        "all": step_s,
    },
    "wall_s": wall,
    "rollout": {
        "backend": cfg.rollout.backend,
        "device": str(eng.device),
        "dtype": str(eng.dtype),
        "kv_cache": f"{eng.runner.k_cache.device} {eng.runner.k_cache.dtype} {eng.num_blocks} blocks",
        "tokens_per_s": [r.get("engine/tokens_per_s") for r in records],
    },
    "training": {
        "device": str(param.device),
        "param_dtype": str(param.dtype),
        "optimizer_state_dtypes": opt_dtypes,
        "autocast": f"{autocast_device(learner.model)} {autocast_dtype(learner.model)}",
    },
    "precision_log": lines,
    "reward_mean": [r.get("reward/mean") for r in records],
    "pg_loss": [r.get("actor/pg_loss") for r in records],
}
problems = [
    msg for ok, msg in [
        (len(step_s) == steps, f"{len(step_s)} of {steps} steps logged"),
        (eng.device.type == "cuda", f"rollout engine on {eng.device}"),
        (eng.runner.k_cache.device.type == "cuda", "KV cache not on the GPU"),
        (eng.dtype == torch.bfloat16, f"rollout dtype {eng.dtype}"),
        (param.device.type == "cuda", f"training parameters on {param.device}"),
        (param.dtype == torch.float32, f"master weights {param.dtype}"),
        (opt_dtypes == ["torch.float32"], f"optimizer state {opt_dtypes}"),
        (autocast_dtype(learner.model) == torch.bfloat16
         and autocast_device(learner.model) == "cuda", "training not under CUDA bf16 autocast"),
        (all(isinstance(x, float) and math.isfinite(x) for x in report["pg_loss"]),
         "a non-finite policy loss"),
    ] if not ok
]  # fmt: skip
report["problems"] = problems
with open(out_path, "w") as f:
    json.dump(report, f, indent=1)
print(json.dumps(report, indent=1))
sys.exit(f"GRPO check: {'; '.join(problems)}" if problems else 0)
EOF
status=${PIPESTATUS[0]}
rm -rf "$RUNS"
[ "$status" -eq 0 ] || fail "GRPO on the GPU (exit $status; see $OUT/grpo_gpu.log)"

echo "== vLLM on the GPU (the real-engine tests, GRPO steps included)"
if $PY -c "import vllm" 2>/dev/null; then
  timeout 120 $PY -m pytest -q -p no:cacheprovider -o addopts="" -m vllm tests/test_vllm_engine.py \
    2>&1 | tee "$OUT/test_vllm_gpu.log" | tail -8
else
  echo "vllm is not installed in $PY: skipped (pip install -e '.[vllm]' torch==<its torch>)" \
    | tee "$OUT/test_vllm_gpu.log"
fi

echo "== GPU tests"
timeout 180 $PY -m pytest -q -p no:cacheprovider -o addopts="" -k cuda \
  tests/test_cuda.py tests/test_rollout_engine.py tests/test_rollout_bf16.py \
  tests/test_rollout_spec.py 2>&1 | tee "$OUT/test_cuda.log" | tail -15

echo "== bench/rollout.py --quick --device cuda"
timeout 120 $PY bench/rollout.py --quick --device cuda --threads 8 \
  --out "$OUT/rollout_cuda_quick.json" 2>&1 | tail -4

echo "== bench/rollout.py --device cuda (full sizes, no spec: its full warm starts take an hour)"
timeout 60 $PY bench/rollout.py --device cuda --threads 8 --only fixed,fixed_tiny,mixed,prefix \
  --out "$OUT/rollout_cuda.json" 2>&1 | tail -4
ls -l "$OUT"
