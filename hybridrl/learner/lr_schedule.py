"""The learning-rate schedule of a trained role's optimizer (``actor.lr_schedule`` and its keys;
the critic's the same): a linear warmup, then constant, linear or cosine decay to
``min_lr_ratio`` x ``lr`` at the run's last optimizer step.

Why the warmup: RL starts from a warm start that has converged, with a fresh AdamW. Adam divides
each gradient by the root of its running second moment, which after one step is the gradient's own
size, so the first updates move every weight by about ``lr`` whatever its gradient, noise
included. A converged small model does not survive that at the learning rates that learn fast
(W4 at lr 1e-3: reward 0.59 to 0.08 after one step of four updates). Raising the rate linearly
over the first optimizer steps lets the second-moment estimate settle before the steps are full
size.

The factor is read from the optimizer's own step count (``state["step"]``, checkpointed with the
optimizer), so a resumed run continues the schedule where it was, with no scheduler state of its
own. The run's length in optimizer steps is planned from the config (:func:`planned_steps`): RL
steps x mini-batches per step x epochs. A step that trains fewer samples (dynamic sampling's
filter) takes fewer optimizer steps, so the decay then ends a little later than the run; it never
goes below the floor.
"""

from __future__ import annotations

import math

import torch

SCHEDULES = ("constant", "linear", "cosine")


def optimizer_steps(optimizer: torch.optim.Optimizer) -> int:
    """Steps the optimizer has taken: the largest ``state["step"]`` of its parameters (0 before
    the first)."""
    steps = [float(s["step"]) for s in optimizer.state.values() if "step" in s]
    return int(max(steps, default=0))


def lr_factor(step: int, schedule: str, warmup: int, total: int, floor: float) -> float:
    """The factor on ``lr`` for optimizer step ``step`` (from 0): ``(step + 1) / warmup`` during the
    warmup, then from 1 down to ``floor`` over the steps left until ``total`` (constant: 1)."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return 1.0
    done = min(1.0, (step - warmup) / (total - warmup))
    if schedule == "linear":
        return 1.0 - (1.0 - floor) * done
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * done))


def planned_steps(cfg, section) -> int:
    """Optimizer steps a run takes: ``trainer.total_steps`` x the mini-batches of a step's samples
    x ``section.ppo_epochs`` (``section``: the role's config, actor or critic)."""
    samples = cfg.trainer.prompts_per_step * cfg.trainer.samples_per_prompt
    per_step = math.ceil(samples / section.ppo_minibatch_size) * section.ppo_epochs
    return cfg.trainer.total_steps * per_step


def add_lr_schedule(optimizer: torch.optim.Optimizer, section, total: int) -> None:
    """Set every parameter group's ``lr`` to its configured value x :func:`lr_factor` before each
    optimizer step. ``section``: the role's config (``lr_schedule``, ``lr_warmup_steps``, or
    ``lr_warmup_ratio`` of ``total`` when the steps are 0, ``min_lr_ratio``); nothing for a
    constant schedule without warmup."""
    warmup = section.lr_warmup_steps or round(section.lr_warmup_ratio * total)
    if section.lr_schedule == "constant" and warmup <= 0:
        return
    base = [group["lr"] for group in optimizer.param_groups]

    schedule, floor = section.lr_schedule, section.min_lr_ratio

    def scale(opt, args, kwargs) -> None:
        f = lr_factor(optimizer_steps(opt), schedule, warmup, total, floor)
        for group, lr in zip(opt.param_groups, base):
            group["lr"] = lr * f

    optimizer.register_step_pre_hook(scale)
