"""Asynchronous vs synchronous training: samples/s and held-out accuracy after the same samples.

    python bench/async_vs_sync.py [--quick] [--steps N] [--tasks w3,w1] [--ablation] [--out FILE]

Both modes run in this one process, one after the other, from the same warm start (trained first and
cached; it stops at the example's ``sft.target_accuracy``, so the accuracies start from the same
level on any CPU; ``warm_start`` in each run's result records its steps and accuracy), with the same
model, batch shape and number of trained samples:

* sync:  ``trainer.mode=sync``, local backend, the whole machine for each phase in turn, with 1 and
  with 2 torch threads (``--sync-threads``); the faster of the two is the baseline;
* async: ``trainer.mode=async``, Ray, the rollout on one core (1 thread), the learner with 1 thread
  (the other core) and with 2 (it also takes the rollout core's idle time;
  ``--async-learner-threads``); the faster of the two counts; decoupled PPO,
  ``asynchronous.max_staleness`` 1.

samples/s = trained samples / the steps' wall time (evaluation excluded); accuracy = sampled (T = 1)
held-out accuracy after training. ``--ablation`` adds W3 runs with max_staleness 0, 1, 4, 8 under
decoupled PPO and under plain PPO (``ppo_clip``). Prints one JSON object and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = {
    "w3": ROOT / "examples" / "reverse_async.yaml",
    "w1": ROOT / "examples" / "arith_grpo.yaml",
}


def async_layout(learner_threads: int = 1) -> list[str]:
    """Ray: the rollout (generation and scoring) on one core (1 thread), the learner with
    ``learner_threads`` threads (2: it also uses the time the rollout core idles, at the price of
    sharing a core while the rollout runs)."""
    return [
        "trainer.mode=async",
        "controller.backend=ray",
        "controller.num_threads=1",
        f"controller.pools={{train: {{cpus_per_worker: 1, num_threads: {learner_threads}}}, gen: "
        f"{{cpus_per_worker: 1}}}}",
        "controller.placement={learner: train, rollout: gen}",
    ]


ASYNC = async_layout()
SYNC = ["trainer.mode=sync", "controller.backend=local"]


def run(
    task: str, mode: list[str], steps: int, eval_size: int, runs_dir: Path, name: str, extra=()
) -> dict:
    import ray
    import torch

    from hybridrl.config import Config, load_config
    from hybridrl.driver import loop

    overrides = [
        *mode,
        f"trainer.total_steps={steps}",
        "trainer.eval_every=0",
        f"trainer.save_every={steps}",
        f"task.eval_size={eval_size}",
        f"trainer.runs_dir={runs_dir}",
        f"trainer.name={name}",
        "trainer.progress=false",
        "trainer.loggers=[jsonl]",
        *extra,
    ]
    cfg = load_config(Config, str(EXAMPLES[task]), overrides)
    torch.set_num_threads(cfg.controller.num_threads)
    try:
        summary = loop.train(cfg)
    finally:
        if ray.is_initialized():
            ray.shutdown()
    rows = [
        json.loads(line)
        for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    ]
    steps_rows = [r for r in rows if r["step"] > 0]
    seconds = sum(r["timing/step"] - r.get("timing/eval", 0.0) for r in steps_rows)
    samples = steps * cfg.trainer.prompts_per_step * cfg.trainer.samples_per_prompt
    out = {
        "samples_per_s": samples / seconds,
        "seconds": seconds,
        "accuracy_before": summary["accuracy_before"],
        "accuracy": summary["accuracy_after"],
        "greedy_accuracy": summary["greedy_accuracy_after"],
    }
    sft_record = Path(summary["warm_start"]) / "sft.json" if summary.get("warm_start") else None
    if sft_record is not None and sft_record.is_file():
        rec = json.loads(sft_record.read_text())
        out["warm_start"] = {
            k: rec.get(k) for k in ("steps", "accuracy", "target_accuracy", "target_met")
        }
    if cfg.trainer.mode == "async":

        def mean(key: str) -> float:
            return sum(r.get(key, 0.0) for r in steps_rows) / len(steps_rows)

        hist = sorted(
            {
                k
                for r in steps_rows
                for k in r
                if k.startswith("async/staleness_") and k[-1].isdigit()
            }
        )
        out |= {
            "staleness_hist": {k.rsplit("_", 1)[1]: round(mean(k), 4) for k in hist},
            "trainer_idle_frac": mean("async/trainer_idle_frac"),
            "rollout_idle_frac": mean("async/rollout_idle_frac"),
            "partial_frac": mean("async/partial_frac"),
            "staleness_mean": mean("async/staleness_mean"),
        }
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer steps and a smaller evaluation")
    p.add_argument("--steps", type=int, help="RL steps per run (default 40, --quick 10)")
    p.add_argument("--tasks", default="w3,w1")
    p.add_argument(
        "--ablation",
        action="store_true",
        help="W3: max_staleness 0/1/4/8 x decoupled PPO / plain PPO",
    )
    p.add_argument(
        "--sync-threads",
        default="1,2",
        help="sync baselines to run (torch threads); the faster one counts",
    )
    p.add_argument(
        "--async-learner-threads",
        default="1,2",
        help="async layouts to run (the learner's torch threads); the faster one counts",
    )
    p.add_argument(
        "--sync-disaggregated",
        action="store_true",
        help="also run sync on async's placement "
        "(rollout and learner on one core each, taking turns)",
    )
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    steps = args.steps or (10 if args.quick else 40)
    eval_size = 256 if args.quick else 1024
    runs_dir = Path("runs") / "bench_async"
    result: dict = {"steps": steps, "eval_size": eval_size}
    t0 = time.perf_counter()
    threads = [int(x) for x in args.sync_threads.split(",")]
    learner_threads = [int(x) for x in args.async_learner_threads.split(",")]
    tasks = [t for t in args.tasks.split(",") if t]  # --tasks "": the ablation only
    for task in tasks:
        syncs = {
            n: run(
                task,
                [*SYNC, f"controller.num_threads={n}"],
                steps,
                eval_size,
                runs_dir,
                f"{task}_sync{n}",
            )
            for n in threads
        }
        best = max(
            threads, key=lambda n: syncs[n]["samples_per_s"]
        )  # the baseline: the faster sync layout
        s = syncs[best]
        asyncs = {
            n: run(task, async_layout(n), steps, eval_size, runs_dir, f"{task}_async{n}")
            for n in learner_threads
        }
        best_a = max(
            learner_threads, key=lambda n: asyncs[n]["samples_per_s"]
        )  # each mode in its faster layout
        a = asyncs[best_a]
        result[task] = {
            "speedup": a["samples_per_s"] / s["samples_per_s"],
            "accuracy_sync": s["accuracy"],
            "accuracy_async": a["accuracy"],
            "sync_threads": best,
            "async_learner_threads": best_a,
            "sync": s,
            "async": a,
            "sync_by_threads": {str(n): syncs[n]["samples_per_s"] for n in threads},
            "async_by_learner_threads": {
                str(n): asyncs[n]["samples_per_s"] for n in learner_threads
            },
        }
        if args.sync_disaggregated:  # async's placement, taking turns: what overlapping alone gains
            d = run(
                task,
                [*ASYNC, "trainer.mode=sync"],
                steps,
                eval_size,
                runs_dir,
                f"{task}_sync_disagg",
            )
            result[task] |= {
                "sync_disaggregated": d,
                "speedup_vs_sync_disaggregated": a["samples_per_s"] / d["samples_per_s"],
            }
    if args.ablation:
        result["ablation"] = {}
        for loss in ("decoupled_ppo", "ppo_clip"):
            for k in (0, 1, 4, 8):
                extra = [f"asynchronous.max_staleness={k}", f"algorithm.policy_loss={loss}"]
                result["ablation"][f"{loss}/k{k}"] = run(
                    "w3", ASYNC, steps, eval_size, runs_dir, f"w3_{loss}_k{k}", extra
                )
    result["wall_seconds"] = time.perf_counter() - t0
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    for key, r in result.get("ablation", {}).items():
        print(
            f"ablation {key:18} {r['samples_per_s']:7.1f} samples/s  accuracy {r['accuracy']:.3f}  "
            f"staleness {r['staleness_mean']:.2f}",
            file=sys.stderr,
        )
    print("\ntask  sync samples/s  async samples/s  speedup  acc sync  acc async", file=sys.stderr)
    for task in tasks:
        r = result[task]
        print(
            f"{task:4}  {r['sync']['samples_per_s']:14.1f}  {r['async']['samples_per_s']:15.1f}  "
            f"{r['speedup']:6.2f}x"
            f"  {r['accuracy_sync']:8.3f}  {r['accuracy_async']:9.3f}",
            file=sys.stderr,
        )
    return result


if __name__ == "__main__":
    main()
