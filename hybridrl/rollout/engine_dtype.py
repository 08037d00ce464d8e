"""The rollout engine's dtype (``rollout.backend_options.dtype``): the weights and KV cache it
holds, whatever the model it was built from. Log-probs are always computed in fp32 (the runner
returns fp32 logits, the sampler works on them).

``auto``: on CUDA bf16 where the GPU has native bf16 (compute capability >= 8.0), else fp32
(:func:`hybridrl.parallel.precision.cuda_precision`); on a CPU, for a model that is not fp32, the
model's own dtype, and for an fp32 one :func:`hybridrl.parallel.precision.decide` with a
forward-only measurement on the model: bf16 where the CPU has native bf16 matmuls and they pay for
this model's shape. ``fp32`` / ``bf16`` force it. Weights synced later (from an fp32 actor) are cast
on load (``ModelRunner.load_weights`` copies in place). The device is where the engine runs, which
need not be where the model it copies from lives (the rollout worker builds the engine on its GPU
from a model loaded on the CPU).
"""

from __future__ import annotations

import logging

import torch

from hybridrl.parallel.precision import Precision, cpu_precision, cuda_precision

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def engine_precision(
    setting: str | None, model, device: torch.device | str | None = None
) -> Precision:
    """The engine's dtype for ``model`` at ``rollout.backend_options.dtype = setting`` (None: the
    model's own) when it runs on ``device`` (None: the model's device)."""
    p = next(model.parameters())
    device = p.device if device is None else torch.device(device)
    if setting is None:
        return Precision(p.dtype, "the model's dtype")
    if setting in DTYPES:
        return Precision(
            DTYPES[setting], f"rollout.backend_options.dtype={setting} on {device.type}"
        )
    if setting != "auto":
        raise ValueError(
            f"rollout.backend_options.dtype must be auto, fp32 or bf16, got {setting!r}"
        )
    if device.type == "cuda":
        return cuda_precision("auto", key="rollout.backend_options.dtype", device=device)
    if device.type != "cpu":
        return Precision(
            p.dtype, f"rollout.backend_options.dtype=auto on {device.type}: the model's dtype"
        )
    if p.dtype != torch.float32:
        return Precision(p.dtype, "rollout.backend_options.dtype=auto: the model's dtype")
    return cpu_precision("auto", model, train=False, key="rollout.backend_options.dtype")


def resolve_engine_dtype(
    setting: str | None, model, device: torch.device | str | None = None
) -> torch.dtype:
    """``engine_precision`` for ``rollout.backend_options.dtype = setting`` (None: the model's
    own) on ``device``, logged."""
    prec = engine_precision(setting, model, device)
    if setting is not None:
        log.info(prec.describe("rollout", autocast=False))
    return prec.dtype
