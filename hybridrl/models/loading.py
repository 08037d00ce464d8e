"""What every role builds the same way: the task, the tokenizer and the model."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from hybridrl.config import Config
from hybridrl.data import DatasetTask
from hybridrl.models import load_model_and_tokenizer
from hybridrl.tasks import TASKS, Task
from hybridrl.tasks.mix import MixedTask


def make_task(cfg: Config) -> Task:
    """The prompt source: a :class:`~hybridrl.data.DatasetTask` over ``data.train_files`` when set
    (cheap: it checks the paths, and reads the files on its first prompt), else the registered task
    ``task.name``."""
    if cfg.data.train_files:
        return DatasetTask(cfg)
    if cfg.task.mix:
        return MixedTask(cfg.task.mix, seed=cfg.trainer.seed, heldout_size=cfg.task.heldout_size)
    return TASKS.get(cfg.task.name)(seed=cfg.trainer.seed, heldout_size=cfg.task.heldout_size)


def load_tokenizer(cfg: Config, model_path: str | None):
    """The checkpoint's own tokenizer when it has one, else the task's."""
    if model_path and (Path(model_path) / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    return make_task(cfg).tokenizer()


def load_model(cfg: Config, model_path: str | None):
    """(model, tokenizer) from ``model_path``, or the built-in ``cfg.model.name`` from its seed."""
    return load_model_and_tokenizer(
        model_path, cfg.model.name, cfg.model.seed, make_task(cfg).tokenizer()
    )
