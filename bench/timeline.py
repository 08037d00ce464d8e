"""The three layouts on one figure: who runs what when, colocated, disaggregated and asynchronous.

    python bench/timeline.py [--steps 5] [--out-dir DIR] [--png docs/img/timeline_layouts.png]

Three short W1 runs (``examples/arith_grpo.yaml``: GRPO, tiny model, 32 prompts x 8 samples per
step) under the ``ray`` backend, one torch thread per worker process, from one warm start
(``sft.steps=3``, trained once into ``--out-dir``; the layouts' timing does not depend on its
quality):

* colocated: learner and rollout share one process on one pool and take turns;
* disaggregated: learner and rollout on pools of their own (one process each), synchronous;
* async: the same two pools, ``trainer.mode=async`` (``asynchronous.max_staleness`` 1).

Each run's ``timeline.jsonl`` is drawn as one Gantt panel (steps 2..N-1: the first step measures
the devices' peaks, the last one also evaluates and saves) and summarised over the same steps: the
mean step time, the learner's and the rollout's idle fractions (time in none of the role's spans /
step time) and the fraction of the time in which generation and training ran at once. Prints one
JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "arith_grpo.yaml"
TWO_POOLS = [
    "controller.pools={train: {cpus_per_worker: 1}, gen: {cpus_per_worker: 1}}",
    "controller.placement={learner: train, rollout: gen}",
]
LAYOUTS = {
    "colocated": ["controller.pools={global: {cpus_per_worker: 1}}"],
    "disaggregated": TWO_POOLS,
    "async": [*TWO_POOLS, "trainer.mode=async", "asynchronous.max_staleness=1"],
}


def run(name: str, layout: list[str], steps: int, out_dir: Path) -> Path:
    import ray

    from hybridrl.config import Config, load_config
    from hybridrl.driver import loop

    cfg = load_config(
        Config,
        str(EXAMPLE),
        [
            "controller.backend=ray",
            "controller.num_threads=1",
            *layout,
            "sft.steps=3",
            f"sft.checkpoint={out_dir / 'warm_start'}",
            f"trainer.total_steps={steps}",
            "trainer.eval_every=0",
            "trainer.save_every=0",
            "task.eval_size=32",
            f"trainer.runs_dir={out_dir / 'runs'}",
            f"trainer.name={name}",
            "trainer.progress=false",
            "trainer.loggers=[jsonl]",
        ],
    )
    try:
        summary = loop.train(cfg)
    finally:
        if ray.is_initialized():
            ray.shutdown()
    return Path(summary["run_dir"])


def by_role(rows: list[dict]) -> list[dict]:
    """The rows with each span's role as its worker: a colocated process's two roles apart."""
    return [r if r["role"] == "driver" else r | {"worker": r["role"], "pid": 0} for r in rows]


def layout_summary(rows: list[dict], steps: list[int]) -> dict:
    from hybridrl.telemetry.timeline import idle_fractions, overlap_fraction, step_windows

    rows = [r for r in rows if r["step"] in steps]
    windows = step_windows(rows)
    idle = idle_fractions(by_role(rows))
    return {
        "steps": steps,
        "step_s": round(sum(b - a for a, b in windows.values()) / len(windows), 3),
        "learner_idle_frac": round(idle.get(("learner", 0, 0), 1.0), 3),
        "rollout_idle_frac": round(idle.get(("rollout", 0, 0), 1.0), 3),
        "overlap_frac": round(overlap_fraction(rows), 3),
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5, help="RL steps per run (at least 3)")
    p.add_argument("--out-dir", type=Path, default=Path("/tmp/hybridrl_timeline"))
    p.add_argument("--png", type=Path, default=Path("bench_timeline.png"))
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="a subset of " + ",".join(LAYOUTS))
    args = p.parse_args(argv)
    if args.steps < 3:
        p.error(
            f"--steps must be at least 3 (the first and last steps are not drawn), got {args.steps}"
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    sys.path.insert(0, str(ROOT))
    from hybridrl.telemetry.profile_report import write_timeline
    from hybridrl.telemetry.timeline import read_timeline

    out, panels = {}, []
    steps = list(range(2, args.steps))
    for name in args.layouts.split(","):
        if name not in LAYOUTS:
            p.error(f"--layouts: unknown layout {name!r}; choose from {', '.join(LAYOUTS)}")
        rows = read_timeline(run(name, LAYOUTS[name], args.steps, args.out_dir))
        out[name] = layout_summary(rows, steps)
        s = out[name]
        title = (
            f"{name}: {s['step_s']:.2f} s/step, learner idle {s['learner_idle_frac']:.0%}, "
            f"rollout idle {s['rollout_idle_frac']:.0%}, generation || training "
            f"{s['overlap_frac']:.0%}"
        )
        panels.append((title, rows, steps))
    args.png.parent.mkdir(parents=True, exist_ok=True)
    out["png"] = str(write_timeline(args.png, panels))
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
