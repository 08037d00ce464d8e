"""Learning-rate warmup for the actor's optimizer (``actor.lr_warmup_steps``).

Why: RL starts from a warm start that has converged, with a fresh AdamW. Adam divides each
gradient by the root of its running second moment, which after one step is the gradient's own
size, so the first updates move every weight by about ``lr`` whatever its gradient, noise
included. A converged small model does not survive that at the learning rates that learn fast
(W4 at lr 1e-3: reward 0.59 to 0.08 after one step of four updates). Raising the rate linearly
over the first optimizer steps lets the second-moment estimate settle before the steps are full
size.

The factor is read from the optimizer's own step count (``state["step"]``, checkpointed with the
optimizer), so a resumed run continues the ramp where it was, with no scheduler state of its own.
"""

from __future__ import annotations

import torch


def optimizer_steps(optimizer: torch.optim.Optimizer) -> int:
    """Steps the optimizer has taken: the largest ``state["step"]`` of its parameters (0 before
    the first)."""
    steps = [float(s["step"]) for s in optimizer.state.values() if "step" in s]
    return int(max(steps, default=0))


def add_warmup(optimizer: torch.optim.Optimizer, warmup_steps: int) -> None:
    """Scale every parameter group's ``lr`` by ``min(1, (n + 1) / warmup_steps)`` before the
    optimizer's step ``n`` (counted from 0); nothing with ``warmup_steps`` 0."""
    if warmup_steps <= 0:
        return
    base = [group["lr"] for group in optimizer.param_groups]

    def ramp(opt, args, kwargs) -> None:
        factor = min(1.0, (optimizer_steps(opt) + 1) / warmup_steps)
        for group, lr in zip(opt.param_groups, base):
            group["lr"] = lr * factor

    optimizer.register_step_pre_hook(ramp)
