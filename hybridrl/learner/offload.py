"""The learner's training state off the device and back, for colocation (``sleep`` / ``wake``).

When the learner shares its device with the rollout, every model it holds (policy, reference,
critic) and their optimizers' states leave the device while the rollout generates. Which models the
learner holds and how a model with its optimizer moves is a concern of its own, apart from the
passes that use them; on a CPU rank everything already lives in host memory and nothing moves.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def move_training_state(model, optimizer, device: torch.device) -> None:
    """A model's parameters and its optimizer's states (exp_avg, exp_avg_sq ...) to ``device``."""
    # FSDP2 keeps the sharded parameters' identity: the optimizer still refers to them
    model.to(device)
    for state in optimizer.state.values() if optimizer is not None else ():
        for key, value in state.items():
            if torch.is_tensor(value) and key != "step":  # Adam's step counter stays on the CPU
                state[key] = value.to(device, non_blocking=True)


def held_models(learner) -> list[tuple]:
    """Every (model, optimizer or None) the learner holds."""
    held = [(learner.model, learner.optimizer)]
    held += [(learner.reference.model, None)] if learner.reference is not None else []
    held += [(learner.critic.model, learner.critic.optimizer)] if learner.critic is not None else []
    return held


def sleep(learner) -> None:
    """The training state to host memory, the device's cache emptied (a CPU rank: nothing)."""
    if learner.dist.device.type != "cpu":
        for model, optimizer in held_models(learner):
            move_training_state(model, optimizer, torch.device("cpu"))
        torch.cuda.empty_cache()


def wake(learner) -> None:
    """The training state back to the learner's device (a CPU rank: nothing)."""
    if learner.dist.device.type != "cpu":
        for model, optimizer in held_models(learner):
            move_training_state(model, optimizer, learner.dist.device)
