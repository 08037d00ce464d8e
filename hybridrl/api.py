"""The Python entry point: a run from Python objects as well as config.

    import hybridrl

    def short(completions, **kwargs):          # a TRL-style batched reward function
        return [1.0 if len(c) < 20 else 0.0 for c in completions]

    summary = hybridrl.train(
        "examples/chat_math_grpo.yaml",           # a YAML path, a dict, a Config, or None
        overrides={"trainer.total_steps": 10},    # dotted keys, as on the command line
        reward_funcs=["math_verify", short],      # names, dotted paths or callables
        train_dataset=[{"prompt": [{"role": "user", "content": "2+3?"}], "answer": "5"}],
    )

A dataset given as an object (a ``datasets.Dataset`` or a list of dicts) is written once to
``<runs_dir>/datasets/<content hash>/dataset.parquet`` and the run reads it from there like any
``data.train_files``: the saved ``config.yaml`` names it, so the run can be resumed from the
command line. Callables are kept as objects; ``config.yaml`` records a function by its dotted path
``module:name`` when it has one, else as ``<python: name>`` (a lambda, or a function defined in a
notebook), which only the Python API can supply again on resume.

It runs with the ``local`` backend in the calling process (a notebook works), or on Ray when
``controller.backend=ray``, where callables travel to the workers by pickling (cloudpickle sends a
notebook's functions by value).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hybridrl.config import (
    Config,
    ConfigError,
    apply_overrides,
    from_dict,
    load_config,
    to_dict,
)
from hybridrl.driver.resume import Resume

log = logging.getLogger(__name__)


def train(
    config: str | Path | Mapping | Config | None = None,
    *,
    overrides: Mapping[str, Any] | Sequence[str] = (),
    reward_funcs: Callable | str | Sequence[Callable | str] | None = None,
    reward_weights: Sequence[float] | None = None,
    train_dataset: Any = None,
    eval_dataset: Any = None,
    resume: bool | Resume = False,
) -> dict:
    """Train and return the run's summary (accuracies before and after, run directory, ...).

    ``config``: a YAML file, a nested dict, a :class:`Config`, or None (the defaults).
    ``overrides``: ``{"trainer.total_steps": 10}`` or ``["trainer.total_steps=10"]``.
    ``reward_funcs``: replaces ``task.reward_fn``; ``reward_weights``: ``task.reward_weights``.
    ``train_dataset`` / ``eval_dataset``: a ``datasets.Dataset``, a list of dicts, or a path;
    they replace ``data.train_files`` / ``data.val_files``. ``resume``: True continues the run from
    its latest checkpoint; ``Resume(checkpoint=PATH)`` from a chosen one (:class:`Resume`). Raises
    :class:`ConfigError` (one line) for a bad configuration, before any work starts.
    """
    cfg = make_config(
        config,
        overrides,
        reward_funcs=reward_funcs,
        reward_weights=reward_weights,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
    )
    return run(cfg, resume=resume)


def make_config(
    config: str | Path | Mapping | Config | None = None,
    overrides: Mapping[str, Any] | Sequence[str] = (),
    *,
    reward_funcs=None,
    reward_weights=None,
    train_dataset=None,
    eval_dataset=None,
) -> Config:
    """The validated :class:`Config` :func:`train` would run (see there)."""
    items = _override_strings(overrides)
    cfg = _load(config, items)
    given = [
        (key, data, stem)
        for key, data, stem in (
            ("data.train_files", train_dataset, "dataset"),
            ("data.val_files", eval_dataset, "eval"),
        )
        if data is not None
    ]
    if given:  # loaded again with the data's paths, so that the run's name follows the data
        runs_dir = cfg.trainer.runs_dir
        items += [f"{k}={json.dumps(_data_path(d, runs_dir, stem))}" for k, d, stem in given]
        cfg = _load(config, items)
    if reward_funcs is not None:
        fns = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        cfg.task.reward_fn = fns
    if reward_weights is not None:
        cfg.task.reward_weights = [float(w) for w in reward_weights]
    try:
        cfg.task.validate()
    except ValueError as e:
        raise ConfigError(f"config 'task': {e}") from None
    from hybridrl.checks import check_config

    check_config(cfg)
    return cfg


def run(cfg: Config, resume: bool | Resume = False) -> dict:
    """Run a validated config (the command line's ``hybridrl train`` does the same): the steps
    that cover ``data.epochs``, then the driver of ``trainer.mode``, restarted from the last
    checkpoint after a worker died or a rollout call timed out, up to ``trainer.max_restarts``
    times (``driver/restarts.py``; past it :class:`RestartsExhaustedError`, one line)."""
    import torch

    from hybridrl.driver import loop
    from hybridrl.driver.restarts import run_with_restarts

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if isinstance(resume, Resume) and resume.checkpoint:  # the run goes on in that run's directory
        where = Path(resume.checkpoint).resolve()
        run_dir = where if (where / "checkpoints").is_dir() else where.parent.parent
        if run_dir != (Path(cfg.trainer.runs_dir) / cfg.trainer.name).resolve():
            log.info("--resume-from: the run goes on in %s", run_dir)
        cfg.trainer.runs_dir, cfg.trainer.name = str(run_dir.parent), run_dir.name
    if cfg.data.epochs is not None:
        from hybridrl.data import steps_for_epochs
        from hybridrl.models.loading import make_task

        cfg.trainer.total_steps = steps_for_epochs(cfg, make_task(cfg))
        log.info("data.epochs=%d: %d steps", cfg.data.epochs, cfg.trainer.total_steps)
    torch.set_num_threads(cfg.controller.num_threads)
    return run_with_restarts(loop.train, cfg, resume)


def _override_strings(overrides: Mapping[str, Any] | Sequence[str]) -> list[str]:
    if isinstance(overrides, Mapping):  # values as YAML (JSON is YAML): lists, None, strings
        return [f"{k}={json.dumps(v)}" for k, v in overrides.items()]
    if isinstance(overrides, str):
        raise ConfigError(f"overrides must be a dict or a list of 'key=value' strings, not the "
                          f"string {overrides!r}")  # fmt: skip
    return list(overrides)


def _load(config, items: list[str]) -> Config:
    if isinstance(config, Config):
        data = to_dict(config)
        data["task"]["reward_fn"] = config.task.reward_fn  # callables stay objects
        return from_dict(Config, apply_overrides(data, items, Config))
    if isinstance(config, Mapping):
        return from_dict(Config, apply_overrides(dict(config), items, Config))
    if config is not None and not isinstance(config, (str, Path)):
        raise ConfigError(
            f"config must be a YAML path, a dict, a hybridrl Config or None, not "
            f"{type(config).__name__}"
        )
    return load_config(Config, str(config) if config is not None else None, items)


def _data_path(data: Any, runs_dir: str, stem: str) -> str:
    """A path as it is; a ``datasets.Dataset`` or list of dicts saved as parquet under its
    content hash (the same data is written once)."""
    if isinstance(data, (str, Path)):
        return str(data)
    from datasets import Dataset

    if isinstance(data, Sequence) and not isinstance(data, Dataset):
        if not all(isinstance(row, Mapping) for row in data):
            raise ConfigError(f"{stem}: a list of rows must hold dicts (one per row)")
        data = Dataset.from_list([dict(row) for row in data])
    if not isinstance(data, Dataset):
        raise ConfigError(
            f"{stem}: a dataset is a datasets.Dataset, a list of dicts or a path, not "
            f"{type(data).__name__}"
        )
    folder = Path(runs_dir) / "datasets"
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=folder, suffix=".parquet", delete=False) as tmp:
        data.to_parquet(tmp.name)
    digest = hashlib.sha256(Path(tmp.name).read_bytes()).hexdigest()[:16]
    out = folder / digest / f"{stem}.parquet"
    out.parent.mkdir(exist_ok=True)
    os.replace(tmp.name, out)
    return str(out.resolve())
