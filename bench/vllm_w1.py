"""W1 trained through vLLM and through the native engine, from the same warm start.

    .venv-vllm/bin/python bench/vllm_w1.py [--steps 100] [--threads 2] [--out FILE]

Runs ``examples/arith_grpo.yaml`` (GRPO on 3-digit addition, the tiny model) twice in this process,
one backend after the other, with everything else equal: the cached warm start (trained first when
none exists), the seed, ``--steps`` GRPO steps, ``--threads`` torch threads. vLLM is its CPU build
in ``.venv-vllm`` (``make test-vllm`` builds it), fp32, eager; its KV cache is
``rollout.backend_options.kv_cache_bytes`` as the native engine's. Reports, per backend: sampled
(T = 1) held-out accuracy before and after, the gain, the median step time and its rollout phase
(generation and scoring), the median weight sync, and the largest train-rollout log-prob gap of any
step. Prints one JSON object; ``gain_gap`` is native's gain minus vLLM's (the goal: within 3
points).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(backend: str, steps: int, threads: int, runs_dir: Path) -> dict:
    from hybridrl.api import train

    overrides = [
        f"rollout.backend={backend}",
        f"trainer.total_steps={steps}",
        f"trainer.name=w1_{backend}",
        f"trainer.runs_dir={runs_dir}",
        "trainer.eval_every=0",
        "trainer.save_every=0",
        "trainer.progress=false",
        f"controller.num_threads={threads}",
    ]
    if backend == "vllm":
        overrides.append("rollout.backend_options.engine_kwargs={enforce_eager: true}")
    t0 = time.perf_counter()
    summary = train(ROOT / "examples" / "arith_grpo.yaml", overrides=overrides)
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").open()]
    rows = [r for r in rows if r.get("step", 0) > 0]

    def median(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    return {
        "accuracy_before": summary["accuracy_before"],
        "accuracy_after": summary["accuracy_after"],
        "gain_points": 100 * (summary["accuracy_after"] - summary["accuracy_before"]),
        "step_s": median("timing/step"),
        "rollout_s": median("timing/rollout"),
        "weight_sync_s": median("timing/weight_sync"),
        "logp_gap_max": max(r["rollout_corr/logp_gap_max"] for r in rows),
        "wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs-dir", default=str(ROOT / "runs" / "bench_vllm_w1"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = {"steps": args.steps, "threads": args.threads}
    for backend in ("native", "vllm"):
        out[backend] = run(backend, args.steps, args.threads, Path(args.runs_dir))
        print(json.dumps({backend: out[backend]}), file=sys.stderr, flush=True)
    out["gain_gap"] = out["native"]["gain_points"] - out["vllm"]["gain_points"]
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":  # vLLM spawns its engine processes, which import this module
    main()
