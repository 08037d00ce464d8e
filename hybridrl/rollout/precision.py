"""The native engine's dtype (``rollout.dtype``): the weights and KV cache it holds, whatever the
model it was built from. Log-probs are always computed in fp32 (the runner returns fp32 logits, the
sampler works on them).

``auto``: on CUDA, and for a model that is not fp32, the model's own dtype (the engine follows what
it is given); on a CPU, :func:`hybridrl.parallel.precision.decide` with a forward-only measurement
on the model: bf16 where the CPU has native bf16 matmuls and they pay for this model's shape.
``fp32`` / ``bf16`` force it. Weights synced later (from an fp32 actor) are cast on load
(``ModelRunner.load_weights`` copies in place).
"""

from __future__ import annotations

import logging

import torch

from hybridrl.parallel.precision import Precision, cpu_precision

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def engine_precision(setting: str | None, model) -> Precision:
    """The engine's dtype for ``model`` at ``rollout.dtype = setting`` (None: the model's own)."""
    p = next(model.parameters())
    if setting is None:
        return Precision(p.dtype, "the model's dtype")
    if setting in DTYPES:
        return Precision(DTYPES[setting], f"rollout.dtype={setting}")
    if setting != "auto":
        raise ValueError(f"rollout.dtype must be auto, fp32 or bf16, got {setting!r}")
    if p.device.type != "cpu":
        return Precision(p.dtype, f"rollout.dtype=auto on {p.device.type}: the model's dtype")
    if p.dtype != torch.float32:
        return Precision(p.dtype, "rollout.dtype=auto: the model's dtype")
    return cpu_precision("auto", model, train=False, key="rollout.dtype")


def resolve_engine_dtype(setting: str | None, model) -> torch.dtype:
    """``engine_precision`` for ``rollout.dtype = setting`` (None: the model's own), logged."""
    prec = engine_precision(setting, model)
    if setting is not None:
        log.info(prec.describe("rollout", autocast=False))
    return prec.dtype
