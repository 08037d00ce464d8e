"""The run directory ``<runs_dir>/<name>``: config, metrics, TensorBoard, checkpoints, report,
summary."""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

from hybridrl.config import Config, dump_yaml

log = logging.getLogger(__name__)


def run_path(cfg: Config) -> Path:
    return Path(cfg.trainer.runs_dir) / cfg.trainer.name


def open_run_dir(cfg: Config, resume: bool) -> Path:
    """The run's directory. A fresh run never overwrites an earlier one: that one is moved aside
    first."""
    run_dir = run_path(cfg)
    if run_dir.exists() and not resume and any(run_dir.iterdir()):
        aside = run_dir.with_name(f"{run_dir.name}.{time.strftime('%Y%m%d-%H%M%S')}")
        run_dir.rename(aside)
        log.warning("moved the earlier run %s to %s (use --resume to continue it)", run_dir, aside)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_yaml(cfg))
    return run_dir


def write_summary(run_dir: Path, summary: dict) -> None:
    clean = {
        k: (None if isinstance(v, float) and not math.isfinite(v) else v)
        for k, v in summary.items()
    }
    (run_dir / "summary.json").write_text(json.dumps(clean, indent=1))
