"""The saving step with and without ``trainer.async_save``: how long the step is held up.

    python bench/checkpoint_save.py [--repeats 5] [--out FILE] [key=value ...]

The built-in small model (``model.name=small``, local backend, no warm start) after one AdamW step
(so the optimizer has its moments): a checkpoint is its weights, tokenizer, optimizer state and RNG
(``model/``), ``trainer.json``, ``config.yaml`` and ``manifest.json``. Saves alternate between the
two settings (sync, async, async, sync, ...) into a fresh run directory each, so both see the same
machine load:

* ``sync``: :func:`~hybridrl.driver.checkpoint.save_checkpoint`, the whole save in the step;
* ``async``: :meth:`~hybridrl.driver.checkpointer.Checkpointer.save` returns once the state is
  snapshotted (``save_step_s``); ``background_s`` is the time from its return until the checkpoint
  is complete (written, fsynced, hashed, renamed), which training overlaps.

Prints one JSON object: per setting the median seconds, ``step_ratio`` = median sync save / median
async save step, the checkpoint's bytes, and the machine's thread count.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybridrl.config import Config, load_config  # noqa: E402
from hybridrl.driver.checkpoint import save_checkpoint  # noqa: E402
from hybridrl.driver.checkpointer import Checkpointer  # noqa: E402
from hybridrl.driver.placement import build_roles  # noqa: E402

STATE = {"prompt_cursor": 0, "reference_path": None, "before": {"eval/accuracy": 0.0}}


def optimizer_step(learner) -> None:
    loss = sum((p.float() ** 2).sum() for p in learner.model.parameters())
    loss.backward()
    learner.optimizer.step()
    learner.optimizer.zero_grad()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--repeats", type=int, default=5, help="saves of each setting")
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("overrides", nargs="*", help="config key=value")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ckpt-bench-"))
    cfg = load_config(
        Config,
        None,
        [
            "model.name=small",
            "sft.enabled=false",
            "controller.num_threads=1",
            "trainer.keep_checkpoints=1",
            f"trainer.runs_dir={work}",
            *args.overrides,
        ],
    )
    import torch

    roles = build_roles(cfg, None, None)
    try:
        roles.learner.apply_all(optimizer_step)
        times: dict[str, list[float]] = {"sync": [], "async": [], "background": []}
        size = 0
        for k in range(args.repeats):
            for setting in ("sync", "async") if k % 2 == 0 else ("async", "sync"):
                run_dir = work / f"{setting}-{k}"
                t0 = time.perf_counter()
                if setting == "sync":
                    ckpt = save_checkpoint(run_dir, 1, roles, STATE | {"step": 1}, cfg)
                    times["sync"].append(time.perf_counter() - t0)
                    size = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
                    continue
                saver = Checkpointer(run_dir, roles, cfg)
                saver.background = True
                saver.save(1, STATE | {"step": 1})
                t1 = time.perf_counter()
                saver.close()
                times["async"].append(t1 - t0)
                times["background"].append(time.perf_counter() - t1)
    finally:
        roles.shutdown()
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {
        "model": cfg.model.name,
        "checkpoint_bytes": size,
        "repeats": args.repeats,
        "sync_save_s": round(med["sync"], 4),
        "async_save_step_s": round(med["async"], 4),
        "async_background_s": round(med["background"], 4),
        "step_ratio": round(med["sync"] / med["async"], 2),
        "threads": torch.get_num_threads(),
        "all": {k: [round(x, 4) for x in v] for k, v in times.items()},
    }
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
