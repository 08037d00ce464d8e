"""``data.epochs``: the number of RL steps that covers that many passes over the training rows."""

from __future__ import annotations

from hybridrl.config import Config


def steps_for_epochs(cfg: Config, task) -> int | None:
    """``ceil(data.epochs * n / trainer.prompts_per_step)`` for ``n`` training rows
    (``task.num_rows``, a :class:`~hybridrl.data.DatasetTask`); None when ``data.epochs`` is null
    (``trainer.total_steps`` decides). A step draws ``prompts_per_step`` prompts; with dynamic
    sampling (``algorithm.filter_groups``) a step may draw more, so the run passes over the data
    more often than ``data.epochs``."""
    epochs = cfg.data.epochs
    if epochs is None:
        return None
    return -(-epochs * task.num_rows // cfg.trainer.prompts_per_step)
