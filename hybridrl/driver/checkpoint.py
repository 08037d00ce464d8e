"""Trainer checkpoints: ``<run>/checkpoints/step_NNNNNN/`` with ``model/``, ``critic/``,
``trainer.json`` and ``config.yaml``.

``model/`` is the policy in transformers format (plus ``train_state.pt``: optimizer and RNG);
``critic/`` the same for the value model when the run has one.

Written to a temporary directory and renamed when complete, so a crash
mid-save leaves the previous checkpoint loadable; the last K are kept.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from hybridrl.config import Config, dump_yaml

PREFIX = "step_"


def save_checkpoint(run_dir: Path, step: int, roles, trainer_state: dict, cfg: Config) -> Path:
    root = run_dir / "checkpoints"
    final, tmp = root / f"{PREFIX}{step:06d}", root / f".tmp-{PREFIX}{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # critic: when there is one
    roles.learner.save_checkpoint(str(tmp / "model"), str(tmp / "critic"))
    (tmp / "trainer.json").write_text(json.dumps({"step": step, **trainer_state}, indent=1))
    (tmp / "config.yaml").write_text(dump_yaml(cfg))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in list_checkpoints(run_dir)[: -cfg.trainer.keep_checkpoints]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run_dir: Path) -> list[Path]:
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    done = [
        p for p in root.iterdir() if p.name.startswith(PREFIX) and (p / "trainer.json").is_file()
    ]
    return sorted(done, key=lambda p: int(p.name[len(PREFIX) :]))


def latest_checkpoint(run_dir: Path) -> tuple[Path, dict] | None:
    ckpts = list_checkpoints(run_dir)
    if not ckpts:
        return None
    return ckpts[-1], json.loads((ckpts[-1] / "trainer.json").read_text())
