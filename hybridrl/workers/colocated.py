"""Colocated roles taking turns on one device: the fused worker of a pool that holds trained roles and the
rollout (``controller/colocated.py`` holds the generic fusion).

Two phases, switched lazily by the next call:

* ``rollout`` (a call into the rollout): the trained roles' parameters and optimizer states move to CPU
  memory, then the rollout engine's KV pool is re-allocated (``wake_up``);
* ``train`` (a call into actor / reference / critic): the KV pool is freed (``release_memory``; running
  sequences are preempted and recomputed later), then the training state comes back to the device.

The rollout model's own weights stay on the device. On a CPU-only rank everything already lives in host
memory: moving is skipped and only the KV pool is released / re-allocated.
"""

from __future__ import annotations

import torch

from hybridrl.controller.colocated import FusedWorker

TRAINED = ("actor", "reference", "critic")


@torch.no_grad()
def move_training_state(part, device: torch.device) -> None:
    """Parameters (and optimizer states: exp_avg, exp_avg_sq ...) of a trained role to ``device``."""
    model = getattr(part, "model", None)
    if model is None:
        return
    model.to(
        device
    )  # FSDP2 keeps the sharded parameters' identity, so the optimizer still refers to them
    optimizer = getattr(part, "optimizer", None)
    for state in optimizer.state.values() if optimizer is not None else ():
        for key, value in state.items():
            if torch.is_tensor(value) and key != "step":  # Adam's step counter stays on the CPU
                state[key] = value.to(device, non_blocking=True)


class ColocatedWorker(FusedWorker):
    def __init__(self, ctx, parts):
        super().__init__(ctx, parts)
        self.phase = "train"
        self.moves = 0  # device round trips of the training state (for tests / metrics)
        dev = next(
            (p.dist.device for r, p in self.parts.items() if r in TRAINED and hasattr(p, "dist")),
            None,
        )
        self.device = dev or torch.device("cpu")

    def before_call(self, role: str) -> None:
        want = "rollout" if role == "rollout" else "train" if role in TRAINED else self.phase
        if want == self.phase:
            return
        trained = [p for r, p in self.parts.items() if r in TRAINED]
        engine = getattr(self.parts.get("rollout"), "engine", None)
        if want == "rollout":
            if self.device.type != "cpu":
                for part in trained:
                    move_training_state(part, torch.device("cpu"))
                torch.cuda.empty_cache()
            if engine is not None:
                engine.wake_up()
        else:
            if engine is not None:
                engine.release_memory()
            if self.device.type != "cpu":
                torch.cuda.empty_cache()
                for part in trained:
                    move_training_state(part, self.device)
        self.moves += 1
        self.phase = want
