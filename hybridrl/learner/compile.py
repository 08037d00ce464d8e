"""Regional ``torch.compile`` of the learner's decoder layers (``actor.compile``).

Why: on a CPU in fp32 the learner's forwards and backwards are mostly matmuls (MKL, already near
the core's peak), and about a quarter of the rest is elementwise work between them (SwiGLU's silu
and product, RMSNorm, rotary, their backward) that eager PyTorch runs as one memory pass per op.
Inductor fuses those passes; the matmuls stay MKL calls, so the results are the same to fp32
rounding (the fused kernels round in another order; bf16 is never introduced). Under bf16
autocast the matmuls take a fraction of the time (AMX), so the elementwise passes weigh more and
fusing them pays more; the compiled layers are then as close to fp32 as the eager ones.

Regional: each decoder layer is compiled in place (``nn.Module.compile``), not the whole model.
The layers share one code object, so one graph serves all of them (a train graph and a no-grad
graph); the model keeps its modules, names and state dict (checkpoints, weight sync, LoRA names are
unchanged). Shapes are dynamic from the first compile, so packed micro-batches of other widths and
row counts reuse the graph. A one-row micro-batch compiles once more (a dimension of size 1 is
specialised; marking it unspecialised breaks the attention mask's broadcast head dimension).

Where it runs: only the families whose entry in the model spec's family table says so
(``models/spec.py``: ``DecoderFamily.compiles``, the families whose compiled forward and backward
we checked against eager), never on a model sharded with FSDP2 (the per-layer
FSDP hooks would have to be compiled with it: not measured), a pipeline stage, a LoRA policy or a
mixture-of-experts model (routing replay records inside the layer). ``auto`` adds what was measured
to pay: a CPU (fp32, or bf16 autocast, where the matmuls are fast and the elementwise passes
between them are most of the rest), hidden size at least :data:`AUTO_MIN_HIDDEN` (the built-in
``small``: docs/performance.md), and a C++ compiler on the path. The first step pays the compile
(minutes on two cores), which a run of hundreds of steps amortises. One log line says what runs
and why.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass

import torch
from torch import nn

from hybridrl.models.spec import DECODER_FAMILIES

log = logging.getLogger(__name__)

# auto: the smallest hidden size where compiling measured faster (bench/learner_speed.py)
AUTO_MIN_HIDDEN = 512


@dataclass(frozen=True)
class CompileChoice:
    on: bool
    reason: str

    def describe(self, what: str) -> str:
        return f"{what} decoder layers: {'compiled' if self.on else 'eager'} ({self.reason})"


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers (``model.model.layers`` of a transformers causal LM), or []."""
    base = getattr(model, getattr(model, "base_model_prefix", ""), None) or model
    layers = getattr(base, "layers", None)
    return list(layers) if isinstance(layers, nn.ModuleList) else []


def _has_compiler() -> bool:
    return any(shutil.which(c) for c in (os.environ.get("CXX", ""), "g++", "c++", "clang++") if c)


def _blocker(model: nn.Module) -> str | None:
    """Why ``model``'s layers are not compiled even when asked (None: nothing blocks)."""
    from hybridrl.learner.moe import is_moe
    from hybridrl.parallel.fsdp import is_sharded

    layers = decoder_layers(model)
    if not layers:
        return "no decoder layers found"
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    family = DECODER_FAMILIES.get(model_type)
    if family is None or not family.compiles:
        tested = ", ".join(name for name, f in DECODER_FAMILIES.items() if f.compiles)
        return f"{model_type} is not a tested family ({tested})"
    if is_sharded(model):
        return "sharded with FSDP2 (compiled per-layer hooks not measured)"
    if is_moe(model):
        return "mixture-of-experts routing is recorded inside the layers"
    if any("lora" in n for n, _ in model.named_modules()):
        return "LoRA adapters (not measured)"
    return None


def decide(setting: bool | str, model: nn.Module, device: torch.device) -> CompileChoice:
    """Whether ``model``'s decoder layers are compiled under ``actor.compile`` = ``setting``."""
    from hybridrl.parallel.precision import autocast_dtype

    if setting is False:
        return CompileChoice(False, "actor.compile=false")
    blocked = _blocker(model)
    if blocked is not None:
        return CompileChoice(False, blocked)
    if not _has_compiler():
        return CompileChoice(False, "no C++ compiler for inductor")
    if setting is True:
        return CompileChoice(True, "actor.compile=true")
    hidden = getattr(getattr(model, "config", None), "hidden_size", 0) or 0
    if device.type != "cpu":
        return CompileChoice(False, "auto: measured faster on a CPU only")
    precision = "fp32" if autocast_dtype(model) is None else "bf16 autocast"
    if hidden < AUTO_MIN_HIDDEN:
        return CompileChoice(False, f"auto: hidden size {hidden} < {AUTO_MIN_HIDDEN}")
    return CompileChoice(True, f"auto: CPU {precision}, hidden size {hidden} >= {AUTO_MIN_HIDDEN}")


def compile_layers(model: nn.Module, mode: str | None = None) -> nn.Module:
    """Compile each decoder layer in place (inductor, dynamic shapes, ``mode``: torch.compile's,
    None its default); returns ``model``. The learner uses the default mode: ``max-autotune``
    measured no faster on a CPU (docs/performance.md)."""
    for layer in decoder_layers(model):
        layer.compile(dynamic=True, mode=mode)
    return model


def maybe_compile(
    setting: bool | str, model: nn.Module, device: torch.device, what: str
) -> nn.Module:
    """``model`` with its layers compiled when :func:`decide` says so; logs the choice."""
    choice = decide(setting, model, device)
    log.info(choice.describe(what))
    return compile_layers(model) if choice.on else model
