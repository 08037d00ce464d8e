"""W4 (a calculator the model calls): what RL gains over the warm start, and synchronous against
asynchronous training with a slow tool.

    python bench/agentic.py [--steps N] [--sft-steps N] [--eval-size N] [--threads N]
        [--max-staleness K] [--out FILE]

One warm start (``examples/calc_tool_grpo.yaml``: supervised on tool-using traces, the observation
masked out of the loss; trained once and cached under ``runs/bench_agentic/``), then two RL runs
from it in this process, one after the other, with the same model, batch shape, number of trained
samples and seed, and the ``calc_tool`` environment answering each call after a lognormal latency
(median 200 ms, shape 1: a long tail):

* sync:  ``trainer.mode=sync``: each step generates every trajectory, waiting for the slowest call,
  then trains (the baseline);
* async: ``trainer.mode=async`` (decoupled PPO, ``--max-staleness``, default 1): the rollout
  streams trajectories on a thread of its own while the learner trains; a trajectory waiting for
  its tool never holds up the others.

samples/s = trained samples / the steps' wall time (evaluation excluded). Accuracy is the sampled
(T = 1) held-out accuracy of full multi-turn trajectories: ``w4.accuracy_before`` after the warm
start, ``w4.accuracy_after`` after the synchronous run (both runs' in ``latency``). The latency
distribution is the environment's own (its seeded draws) and what the runs measured
(``env/step_s_*``). ``tito.extension_violations`` sums the runs' counts (0 expected: W4's
observations are plain text). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "calc_tool_grpo.yaml"
LATENCY = ["env.kwargs={latency_s: 0.2, latency: lognormal, sigma: 1.0}"]


def run(
    mode: str, steps: int, eval_size: int, runs_dir: Path, sft_steps: int, threads: int, k: int
) -> dict:
    import torch

    from hybridrl.config import Config, load_config
    from hybridrl.driver import asynchronous, sync

    cfg = load_config(
        Config,
        str(EXAMPLE),
        [
            f"trainer.mode={mode}",
            f"controller.num_threads={threads}",
            f"asynchronous.max_staleness={k}",
            *LATENCY,
            f"sft.steps={sft_steps}",
            f"sft.checkpoint={runs_dir / f'warmstart-{sft_steps}'}",
            f"trainer.total_steps={steps}",
            "trainer.eval_every=0",
            f"trainer.save_every={steps}",
            f"task.eval_size={eval_size}",
            f"trainer.runs_dir={runs_dir}",
            f"trainer.name=w4_{mode}",
            "trainer.progress=false",
            "trainer.loggers=[jsonl]",
        ],
    )
    torch.set_num_threads(cfg.controller.num_threads)
    summary = {"sync": sync.train, "async": asynchronous.train}[mode](cfg)
    rows = [
        json.loads(line)
        for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    ]
    trained = [r for r in rows if r["step"] > 0]
    seconds = sum(r["timing/step"] - r.get("timing/eval", 0.0) for r in trained)
    samples = steps * cfg.trainer.prompts_per_step * cfg.trainer.samples_per_prompt

    def mean(key: str) -> float:
        return sum(r.get(key, 0.0) for r in trained) / len(trained)

    return {
        "samples_per_s": samples / seconds,
        "seconds": seconds,
        "accuracy_before": summary["accuracy_before"],
        "accuracy": summary["accuracy_after"],
        "greedy_accuracy_before": summary["greedy_accuracy_before"],
        "greedy_accuracy": summary["greedy_accuracy_after"],
        "reward_mean": mean("reward/mean"),
        "env_step_s_mean": mean("env/step_s_mean"),
        "env_step_s_max": max(r.get("env/step_s_max", 0.0) for r in rows),
        "env_turns_mean": mean("env/turns_mean"),
        "env_errors": sum(r.get("env/errors", 0.0) for r in rows),
        "env_timeouts": sum(r.get("env/timeouts", 0.0) for r in rows),
        "extension_violations": sum(r.get("tito/extension_violations", 0.0) for r in rows),
        **({"staleness_mean": mean("async/staleness_mean")} if mode == "async" else {}),
    }


def latency_distribution(draws: int = 10_000) -> dict:
    """Percentiles of calc_tool's seeded latency over ``draws`` calls (the bench's settings)."""
    from hybridrl.envs.calc_tool import CalcToolEnv
    from hybridrl.tasks import Prompt

    env = CalcToolEnv(latency_s=0.2, latency="lognormal", sigma=1.0)
    xs = []
    for i in range(draws):
        env.prompt = Prompt(uid=f"calc-{i:06d}", text="", answer="", task_id="calc")
        xs.append(env.delay(f"<call>{i % 97}*{i % 89}</call>"))
    xs.sort()

    def q(p: float) -> float:
        return round(xs[min(len(xs) - 1, math.floor(p * len(xs)))], 4)

    return {
        "kind": "lognormal, median 0.2 s, sigma 1.0",
        "mean_s": round(sum(xs) / len(xs), 4),
        "p50_s": q(0.5),
        "p90_s": q(0.9),
        "p99_s": q(0.99),
        "max_s": round(xs[-1], 4),
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30, help="RL steps per run")
    p.add_argument("--sft-steps", type=int, default=1200, help="warm-start steps")
    p.add_argument("--eval-size", type=int, default=512, help="held-out prompts per evaluation")
    p.add_argument("--threads", type=int, default=1, help="torch threads (controller.num_threads)")
    p.add_argument("--max-staleness", type=int, default=1, help="async: asynchronous.max_staleness")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    runs_dir = Path("runs") / "bench_agentic"
    t0 = time.perf_counter()
    common = (
        args.steps,
        args.eval_size,
        runs_dir,
        args.sft_steps,
        args.threads,
        args.max_staleness,
    )
    s = run("sync", *common)
    a = run("async", *common)
    result = {
        "command": " ".join(["python bench/agentic.py", *(sys.argv[1:] if argv is None else argv)]),
        "steps": args.steps,
        "sft_steps": args.sft_steps,
        "eval_size": args.eval_size,
        "w4": {
            "accuracy_before": s["accuracy_before"],
            "accuracy_after": s["accuracy"],
            "gain_points": 100 * (s["accuracy"] - s["accuracy_before"]),
            "greedy_accuracy_before": s["greedy_accuracy_before"],
            "greedy_accuracy_after": s["greedy_accuracy"],
        },
        "latency": {
            "sync_samples_per_s": s["samples_per_s"],
            "async_samples_per_s": a["samples_per_s"],
            "speedup": a["samples_per_s"] / s["samples_per_s"],
            "accuracy_sync": s["accuracy"],
            "accuracy_async": a["accuracy"],
            "accuracy_gap_points": 100 * abs(s["accuracy"] - a["accuracy"]),
            "tool_latency": latency_distribution(),
            "sync": s,
            "async": a,
        },
        "tito": {"extension_violations": s["extension_violations"] + a["extension_violations"]},
        "wall_seconds": time.perf_counter() - t0,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
