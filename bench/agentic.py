"""W4 (a calculator the model calls): what RL gains over the warm start, and synchronous against
asynchronous training with a slow tool.

    python bench/agentic.py [--steps N] [--sft-steps N] [--eval-size N] [--threads N] [--seed S]
        [--latency-steps N] [--latency-prompts B] [--max-staleness K] [--sigma S]
        [--tool-timeout SECONDS] [--only gain|latency] [--out FILE]

One warm start (``examples/calc_tool_grpo.yaml``: supervised on tool-using traces, the observation
masked out of the loss, until the example's ``sft.target_accuracy`` on held-out episodes run with
the tool, or exactly ``--sft-steps`` steps; trained once per seed and thread count and cached under
``runs/bench_agentic/``; its ``sft.json`` is reported as ``warm_start``), then three RL runs from it
in this process, one after the other, all with the example's learning settings:

* gain: ``trainer.mode=sync`` with the example's batch (32 prompts x 8 trajectories, groups whose
  rewards are all equal dropped and more prompts sampled), ``--steps`` steps, the tool answering at
  once (its latency plays no part in what is learned). Sampled (T = 1) and greedy held-out
  accuracy of full multi-turn trajectories before and after: ``w4.accuracy_before`` /
  ``w4.accuracy_after``.
* latency, sync and async: the shape of a user with a slow tool, ``--latency-prompts`` prompts x 8
  trajectories per step (small steps: the wait for a step's slowest call is most of a synchronous
  step), ``--latency-steps`` steps each, the same number of trained samples (every group trained:
  no group filtering in either), and ``calc_tool`` answering each call after a lognormal latency
  (median 200 ms, shape ``--sigma``, default 1.5: a long tail). Each call has a deadline,
  ``env.step_timeout_s`` = ``--tool-timeout`` (5 s, 25 medians, as a client of a search API sets
  one): a call past it ends its trajectory with reward 0 (``env/timeouts``), the same calls in both
  runs since the latencies are seeded by prompt and call. sync waits for every trajectory's chain
  of calls, then trains; async (``trainer.mode=async``, decoupled PPO, ``--max-staleness``) keeps
  admitting prompts while trajectories wait on the tool, and trains on what has finished.
  ``latency.speedup`` = async / sync trained samples per second (trained samples / the steps' wall
  time, evaluation excluded); the held-out accuracy of both after their runs is reported next to
  it (their evaluations call the slow tool too, under the same deadline).

``--only`` runs one of the two parts (the other's figures are then null).

The latency distribution is the environment's own (its seeded draws, with the share past the
deadline) and what the runs measured (``env/step_s_*``, ``env/timeouts``).
``tito.extension_violations`` sums the runs' counts (0 expected: W4's observations are plain text).
Prints one JSON object.
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
MEDIAN_S = 0.2


def run(name: str, mode: str, steps: int, overrides: list[str], common: list[str]) -> dict:
    """One RL run from the cached warm start; its throughput, accuracy and environment figures."""
    import torch

    from hybridrl.config import Config, load_config
    from hybridrl.driver import loop

    cfg = load_config(
        Config,
        str(EXAMPLE),
        [
            *common,
            f"trainer.mode={mode}",
            f"trainer.total_steps={steps}",
            "trainer.eval_every=0",
            f"trainer.save_every={steps}",
            f"trainer.name=w4_{name}",
            "trainer.progress=false",
            "trainer.loggers=[jsonl]",
            *overrides,
        ],
    )
    torch.set_num_threads(cfg.controller.num_threads)
    summary = loop.train(cfg)
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
        "samples": samples,
        "samples_per_s": samples / seconds,
        "seconds": seconds,
        "accuracy_before": summary["accuracy_before"],
        "accuracy": summary["accuracy_after"],
        "greedy_accuracy_before": summary["greedy_accuracy_before"],
        "greedy_accuracy": summary["greedy_accuracy_after"],
        "reward_first_5": sum(r.get("reward/mean", 0.0) for r in trained[:5]) / 5,
        "reward_last_5": sum(r.get("reward/mean", 0.0) for r in trained[-5:]) / 5,
        "env_step_s_mean": mean("env/step_s_mean"),
        "env_step_s_max": max(r.get("env/step_s_max", 0.0) for r in rows),
        "env_turns_mean": mean("env/turns_mean"),
        "env_errors": sum(r.get("env/errors", 0.0) for r in rows),
        "env_timeouts": sum(r.get("env/timeouts", 0.0) for r in rows),
        "extension_violations": sum(r.get("tito/extension_violations", 0.0) for r in rows),
        **(
            {
                "staleness_mean": mean("async/staleness_mean"),
                "trainer_idle_frac": mean("async/trainer_idle_frac"),
            }
            if mode == "async"
            else {}
        ),
    }


def latency_distribution(
    sigma: float, draws: int = 10_000, deadline_s: float | None = None
) -> dict:
    """Percentiles of calc_tool's seeded latency over ``draws`` calls (the bench's settings), and
    the share of calls past ``deadline_s``."""
    from hybridrl.envs.calc_tool import CalcToolEnv
    from hybridrl.tasks import Prompt

    env = CalcToolEnv(latency_s=MEDIAN_S, latency="lognormal", sigma=sigma)
    xs = []
    for i in range(draws):
        env.prompt = Prompt(uid=f"calc-{i:06d}", text="", answer="", task_id="calc")
        xs.append(env.delay(f"<call>{i % 97}*{i % 89}</call>"))
    xs.sort()

    def q(p: float) -> float:
        return round(xs[min(len(xs) - 1, math.floor(p * len(xs)))], 4)

    return {
        "kind": f"lognormal, median {MEDIAN_S} s, sigma {sigma}",
        "mean_s": round(sum(xs) / len(xs), 4),
        "p50_s": q(0.5),
        "p90_s": q(0.9),
        "p99_s": q(0.99),
        "max_s": round(xs[-1], 4),
        "deadline_s": deadline_s,
        "past_deadline_frac": None
        if deadline_s is None
        else round(sum(x > deadline_s for x in xs) / len(xs), 4),
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=80, help="RL steps of the gain run")
    p.add_argument(
        "--sft-steps",
        type=int,
        help="a fixed number of warm-start steps (default: the example's held-out target)",
    )
    p.add_argument("--eval-size", type=int, default=512, help="held-out prompts per evaluation")
    p.add_argument("--threads", type=int, default=1, help="torch threads (controller.num_threads)")
    p.add_argument("--seed", type=int, default=0, help="trainer.seed of the RL runs")
    p.add_argument("--latency-steps", type=int, default=40, help="steps of each latency run")
    p.add_argument("--latency-prompts", type=int, default=8, help="prompts per latency-run step")
    p.add_argument("--max-staleness", type=int, default=2, help="async: asynchronous.max_staleness")
    p.add_argument("--sigma", type=float, default=1.5, help="the tool latency's lognormal shape")
    p.add_argument(
        "--tool-timeout", type=float, default=5.0, help="latency runs: env.step_timeout_s, seconds"
    )
    p.add_argument("--only", choices=["gain", "latency"], help="run one part only")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    runs_dir = Path("runs") / "bench_agentic"
    # the warm start's outcome depends on the seed and, through the matmul kernels, the threads
    warm = runs_dir / (
        f"warmstart-{args.sft_steps}"
        if args.sft_steps
        else f"warmstart-target-s{args.seed}-t{args.threads}"
    )
    common = [
        f"controller.num_threads={args.threads}",
        *([f"sft.steps={args.sft_steps}"] if args.sft_steps else []),
        f"sft.checkpoint={warm}",
        f"task.eval_size={args.eval_size}",
        f"trainer.runs_dir={runs_dir}",
        f"trainer.seed={args.seed}",
    ]
    slow = [
        f"env.kwargs={{latency_s: {MEDIAN_S}, latency: lognormal, sigma: {args.sigma}}}",
        f"trainer.prompts_per_step={args.latency_prompts}",
        f"asynchronous.max_staleness={args.max_staleness}",
        f"env.step_timeout_s={args.tool_timeout}",  # the per-call deadline, the same in both
        "algorithm.filter_groups=false",  # the async stream trains every group: so does sync
    ]
    t0 = time.perf_counter()
    g = s = a = None
    if args.only != "latency":
        g = run("gain", "sync", args.steps, ["env.kwargs={latency_s: 0.0}"], common)
    if args.only != "gain":
        s = run("sync", "sync", args.latency_steps, slow, common)
        a = run("async", "async", args.latency_steps, slow, common)
    result = {
        "command": " ".join(["python bench/agentic.py", *(sys.argv[1:] if argv is None else argv)]),
        "steps": args.steps,
        "seed": args.seed,
        "sft_steps": args.sft_steps,
        "threads": args.threads,
        "warm_start": json.loads((warm / "sft.json").read_text()),
        "eval_size": args.eval_size,
        "w4": None
        if g is None
        else {
            "accuracy_before": g["accuracy_before"],
            "accuracy_after": g["accuracy"],
            "gain_points": 100 * (g["accuracy"] - g["accuracy_before"]),
            "greedy_accuracy_before": g["greedy_accuracy_before"],
            "greedy_accuracy_after": g["greedy_accuracy"],
            "greedy_gain_points": 100 * (g["greedy_accuracy"] - g["greedy_accuracy_before"]),
            "run": g,
        },
        "latency": None
        if s is None
        else {
            "steps": args.latency_steps,
            "prompts_per_step": args.latency_prompts,
            "max_staleness": args.max_staleness,
            "sync_samples_per_s": s["samples_per_s"],
            "async_samples_per_s": a["samples_per_s"],
            "speedup": a["samples_per_s"] / s["samples_per_s"],
            "accuracy_sync": s["accuracy"],
            "accuracy_async": a["accuracy"],
            "accuracy_gap_points": 100 * abs(s["accuracy"] - a["accuracy"]),
            "tool_latency": latency_distribution(args.sigma, deadline_s=args.tool_timeout),
            "sync": s,
            "async": a,
        },
        "tito": {
            "extension_violations": sum(x["extension_violations"] for x in (g, s, a) if x),
        },
        "wall_seconds": time.perf_counter() - t0,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
