"""Old log-probs from the update's own forward against a separate pass: step time of the default
job.

    python bench/old_log_prob.py [--steps 10] [--warmup 2] [--out FILE] [key=value ...]

The default job (W1, tiny Qwen2, 32 prompts x 8 samples: the config's defaults) with
``actor.ppo_minibatch_size=256``: one optimizer step per batch, on-policy, so
``actor.reuse_old_log_probs: auto`` takes the old log-probs from the update's forward and ``never``
runs the separate pass. One session (warm start, roles, evaluation before training) then runs the
driver's step (the feed's: generate into the buffer, the learner's train_step, weight sync) with the
two settings alternating step by step (auto, never, never, auto, auto, never, ...): both see the
same machine load and the same policy, since the two give the same weights bit for bit
(``tests/test_reuse_old_log_probs.py``). The first ``--warmup`` steps are not counted, then
``--steps`` of each. Extra ``key=value`` arguments override the config (e.g. ``sft.steps=50`` for a
quick run).

Prints one JSON object: per setting the median step time and the median ``old_log_prob`` and
``update`` phases, and ``step_ratio`` = median step (never) / median step (auto).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybridrl.config import Config, load_config  # noqa: E402
from hybridrl.driver.loop import Feed  # noqa: E402
from hybridrl.driver.session import open_session  # noqa: E402

SETTINGS = ("auto", "never")


def order(n_pairs: int) -> list[str]:
    """auto, never, never, auto, ...: each setting goes first in every other pair."""
    return [s for k in range(n_pairs) for s in (SETTINGS if k % 2 == 0 else SETTINGS[::-1])]


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def set_reuse(learner, setting: str) -> None:
    """On every learner rank: the setting its next ``train_step`` reads."""
    learner.cfg.actor.reuse_old_log_probs = setting


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=10, help="counted steps of each setting")
    ap.add_argument("--warmup", type=int, default=2, help="steps run first and not counted")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    ap.add_argument("overrides", nargs="*", help="config key=value")
    args = ap.parse_args()
    runs = Path(tempfile.mkdtemp(prefix="bench_old_log_prob_"))
    cfg = load_config(
        Config,
        None,
        [
            "actor.ppo_minibatch_size=256",
            "task.eval_size=8",
            "trainer.progress=false",
            "trainer.loggers=[jsonl]",
            f"trainer.runs_dir={runs}",
            *args.overrides,
        ],
    )
    session = open_session(cfg, resume=False)
    rows: dict[str, list[dict]] = {s: [] for s in SETTINGS}
    feed = Feed(session)  # the driver's: the rollout fills the buffer, the learner takes it
    try:
        feed.start()
        plan = ["auto"] * args.warmup + order(args.steps)
        for step, setting in enumerate(plan):
            session.roles.learner.apply_all(set_reuse, setting)  # in the learner's own config
            session.timer.pop()
            t0 = time.perf_counter()
            metrics = feed.train_step(step)["metrics"]
            feed.sync_weights(step + 1)
            seconds = time.perf_counter() - t0
            session.timer.pop()
            assert metrics["actor/old_log_prob_reused"] == float(setting == "auto"), (
                setting,
                metrics,
            )
            if step >= args.warmup:
                rows[setting].append(
                    {
                        "step": seconds,
                        "old_log_prob": metrics.get("timing/old_log_prob", 0.0),
                        "update": metrics.get("timing/update", 0.0),
                        "response_length": metrics["response/length_mean"],
                    }
                )
    finally:
        feed.close()
        session.logger.close()
        session.roles.shutdown()
    out = {
        "config": ["actor.ppo_minibatch_size=256", *args.overrides],
        "steps_each": args.steps,
        "warmup": args.warmup,
        "warm_start": session.warm,
        "commit": subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
    }
    for s in SETTINGS:
        out[s] = {
            f"{k}_median_s": round(median([r[k] for r in rows[s]]), 4)
            for k in ("step", "old_log_prob", "update")
        }
        out[s]["response_length_mean"] = round(
            statistics.fmean(r["response_length"] for r in rows[s]), 2
        )
    out["step_ratio"] = round(
        out["never"]["step_median_s"] / max(out["auto"]["step_median_s"], 1e-9), 3
    )
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
