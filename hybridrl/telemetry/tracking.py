"""The wandb sink (``trainer.loggers`` holds ``wandb``): metrics and sample tables of a run in a
wandb run.

wandb is an optional dependency (``pip install 'hybridrl[wandb]'``), imported only when asked for.
The run is offline (written under ``<run>/wandb``, to upload later with ``wandb sync``) unless
``WANDB_API_KEY`` is set; a ``WANDB_MODE`` the user sets wins over both. Its id is kept in
``<run>/wandb_run_id``, so that a resumed run continues the same wandb run. Every line is logged
with its ``step`` as the x axis (``define_metric``), so the steps a resumed run computes again do
not clash with wandb's own step counter.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

RUN_ID_FILE = "wandb_run_id"
INSTALL = "pip install 'hybridrl[wandb]'"


def import_wandb():
    """The ``wandb`` module; an ImportError of one line saying how to install it."""
    try:
        import wandb
    except ImportError:
        raise ImportError(
            f"the wandb logger needs the wandb package: {INSTALL} (or remove wandb from "
            "trainer.loggers; the others are jsonl, tensorboard)"
        ) from None
    return wandb


def wandb_mode(environ: Mapping[str, str] = os.environ) -> str | None:
    """None where the user set ``WANDB_MODE`` (wandb reads it), else online with an API key and
    offline without one."""
    if environ.get("WANDB_MODE"):
        return None
    return "online" if environ.get("WANDB_API_KEY") else "offline"


def plain(config: Any) -> Any:
    """``config`` as JSON data (what JSON cannot hold, such as a callable, becomes its text)."""
    return json.loads(json.dumps(config, default=str))


class WandbSink:
    """One wandb run per training run, in ``run_dir/wandb``; ``name``, ``project`` and ``config``
    (the run's config as a dict) are shown by wandb."""

    def __init__(self, run_dir: str | os.PathLike, project: str, name: str, config: Any = None):
        wandb = import_wandb()
        run_dir = Path(run_dir)
        id_file = run_dir / RUN_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else ""
        if not run_id:
            run_id = secrets.token_hex(4)  # wandb ids: lowercase letters and digits
            id_file.write_text(run_id + "\n")
        mode = wandb_mode()
        self._wandb = wandb
        self.run = wandb.init(
            project=project,
            name=name,
            config=plain(config) if config is not None else None,
            dir=str(run_dir),
            id=run_id,
            resume="allow",
            reinit="create_new",  # a run of its own, beside any the caller has open
            **({"mode": mode} if mode else {}),
        )
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self.run.log({**scalars, "step": step})

    def table(self, step: int, key: str, columns: list[str], rows: list[list]) -> None:
        self.run.log({key: self._wandb.Table(columns=columns, data=rows), "step": step})

    def close(self) -> None:
        self.run.finish()
