"""Compute precision: on CUDA bf16 where the GPU has native bf16 (compute capability >= 8.0); on the
CPU bf16 where this CPU runs bf16 matmuls natively and it pays for this model.

On a GPU (:func:`cuda_precision`) ``auto`` is bf16 on Ampere and newer (A100, H100, H200, L4 ...)
and fp32 on older GPUs, whose bf16 is emulated; no measurement is needed. Training there is
autocast too (one GPU, ``fsdp.strategy=none``: ``torch.autocast("cuda", dtype=torch.bfloat16)`` over
fp32 parameters, gradients and optimizer state) or FSDP2's bf16 parameters with fp32 reduction
(world size > 1, ``parallel/fsdp.py``).

A CPU with AMX (``amx_bf16``) runs a bf16 matmul several times faster than an fp32 one; one with
only ``avx512_bf16`` a little faster; one with neither emulates bf16 and is slower (fp16 on a CPU is
slower still, so it is never offered). Whether bf16 pays for a model also depends on its size: the
tiny W1 model is dominated by element-wise work and the casts autocast adds, and runs slower in bf16
even on AMX. So ``auto`` picks bf16 only when (1) ``/proc/cpuinfo`` names a native bf16 matmul
instruction and (2) a measurement says so: one decoder layer of the model itself, copied, run in
fp32 and in bf16 alternately on 256 synthetic tokens (forward + backward for actor, critic and
reference, which follows the actor so that their log-probs agree at equal weights; forward only for
the rollout engine), best of a few alternating runs, must be at least ``MIN_SPEEDUP`` faster in
bf16. ``torch.backends.cpu.get_cpu_capability()`` is not enough: it reports ``AVX512`` on an AMX
machine.

Training in bf16 on a CPU is autocast (``torch.autocast("cpu", dtype=torch.bfloat16)``):
parameters, gradients and optimizer state stay fp32 (the master weights); matmuls run in bf16; the
loss math casts the logits to fp32 first (``learner/logprob.py``). The rollout engine in bf16 holds
bf16 weights and KV and reports fp32 log-probs (``rollout/engine_dtype.py``).

``HYBRIDRL_AUTO_PRECISION=fp32|bf16`` fixes what ``auto`` resolves to (CPU and CUDA) without
measuring: for reproducible runs and for the test suite, whose exactness checks compare with fp32
references.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger(__name__)

# below this the gain is within run-to-run noise on a shared machine; fp32 is then the safer choice
MIN_SPEEDUP = 1.3
BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # native bf16 matmul instructions, best first
ENV_OVERRIDE = "HYBRIDRL_AUTO_PRECISION"
# a micro-batch's worth for W1; the probe then takes 0.1-0.5 s for the built-in sizes
PROBE_TOKENS = 256


@dataclass(frozen=True)
class Precision:
    """The compute dtype a role runs in, and why (the reason goes into the log line)."""

    dtype: torch.dtype
    reason: str

    @property
    def bf16(self) -> bool:
        return self.dtype == torch.bfloat16

    def describe(self, what: str, autocast: bool = True) -> str:
        name = "bf16 autocast" if self.bf16 and autocast else "bf16" if self.bf16 else "fp32"
        return f"{what} precision: {name} ({self.reason})"


# --- what the CPU offers --------------------------------------------------------------------------
def cpu_bf16_support(cpuinfo: str | Path = "/proc/cpuinfo") -> str | None:
    """The best native bf16 matmul instruction set of this CPU (``amx_bf16`` or ``avx512_bf16``), or
    None (no such flag, or no ``/proc/cpuinfo`` to read: bf16 is then assumed emulated, i.e.
    slow)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return None
    flags = next(
        (line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")),
        [],
    )
    return next((f for f in BF16_FLAGS if f in flags), None)


def best_times(
    fns: dict[str, Callable[[], object]],
    budget_s: float = 0.2,
    min_reps: int = 3,
    max_reps: int = 25,
) -> dict[str, float]:
    """Fewest CPU seconds of each function (this process's CPU time, ``time.process_time``), run
    alternately (after one warm-up each) for about ``budget_s`` of it (at least ``min_reps``
    rounds). CPU time, not wall time: on a shared machine the wall time of a run mostly measures the
    other processes (with the load at 4 per core here, wall-time probes judged the small model's
    1.5x bf16 gain as 1.0x); alternating makes what is left of the load (caches, memory bandwidth)
    hit every variant alike, and the fewest is the least disturbed run."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    start = time.process_time()
    for rep in range(max_reps):
        if rep >= min_reps and time.process_time() - start > budget_s:
            break
        for k, fn in fns.items():
            t0 = time.process_time()
            fn()
            times[k].append(time.process_time() - t0)
    return {k: min(v) for k, v in times.items()}


def matmul_speedup(n: int = 512) -> float:
    """fp32 time over bf16 time of an n x n matmul (this CPU's raw bf16 gain, for the log line)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a16, b16 = a.bfloat16(), b.bfloat16()
    t = best_times({"fp32": lambda: a @ b, "bf16": lambda: a16 @ b16}, budget_s=0.05)
    return t["fp32"] / t["bf16"]


def _layer_call(model: nn.Module):
    """``fn(h)`` running a copy of the model's first decoder layer on hidden states ``h`` (batch,
    seq, hidden), or None when the model is not a transformers decoder with a rotary embedding (then
    the matmul probe is used)."""
    from hybridrl.parallel.fsdp import decoder_layers

    base = getattr(model, getattr(model, "base_model_prefix", ""), None) or model
    base = getattr(base, "model", base)  # a PEFT wrapper's inner transformers model
    rotary = getattr(base, "rotary_emb", None)
    try:
        layer = copy.deepcopy(decoder_layers(model)[0]).float()
    except (ValueError, TypeError, RuntimeError):
        return None
    if rotary is None:
        return None

    def run(h: torch.Tensor):
        pos = torch.arange(h.shape[1]).unsqueeze(0).expand(h.shape[0], -1)
        cos, sin = rotary(h, pos)
        out = layer(h, position_embeddings=(cos.float(), sin.float()), attention_mask=None)
        return out[0] if isinstance(out, tuple) else out

    return run, layer


def model_speedup(model: nn.Module, train: bool) -> float:
    """fp32 time over bf16-autocast time of one decoder layer of ``model`` (a copy) on
    ``PROBE_TOKENS`` tokens: forward + backward when ``train``, forward only otherwise. Falls back
    to :func:`matmul_speedup`."""
    found = _layer_call(model)
    config = getattr(model, "config", None)
    hidden = getattr(config, "hidden_size", None)
    if found is None or hidden is None:
        return matmul_speedup()
    run, layer = found
    layer.requires_grad_(train)
    h = torch.randn(PROBE_TOKENS // 32, 32, hidden, requires_grad=train)

    def step(bf16: bool):
        with (
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16),
            torch.set_grad_enabled(train),
        ):
            out = run(h)
        if train:
            out.float().sum().backward()

    t = best_times({"fp32": lambda: step(False), "bf16": lambda: step(True)})
    return t["fp32"] / t["bf16"]


class _SpeedupCache:
    """Measured speed-ups by layer shape, per process: actor, reference and critic of one process
    share a shape (the critic's trunk is the policy's), and a measurement takes up to a second for a
    larger model, so each shape is measured once, and the three roles reach the same verdict. The
    thread count is part of the key (the gain depends on it)."""

    def __init__(self) -> None:
        self._seen: dict[tuple, float] = {}

    def get(self, model: nn.Module, train: bool) -> float:
        c = getattr(model, "config", None)
        key = (
            getattr(c, "model_type", None),
            getattr(c, "hidden_size", None),
            getattr(c, "intermediate_size", None),
            getattr(c, "num_attention_heads", None),
            getattr(c, "num_key_value_heads", None),
            train,
            torch.get_num_threads(),
        )
        if key not in self._seen:
            self._seen[key] = model_speedup(model, train)
        return self._seen[key]


SPEEDUPS = _SpeedupCache()


# --- the decision ---------------------------------------------------------------------------------
def decide(
    setting: str,
    *,
    support: Callable[[], str | None],
    speedup: Callable[[], float],
    key: str = "fsdp.mixed_precision",
    env: str | None = None,
    threshold: float = MIN_SPEEDUP,
) -> Precision:
    """The CPU compute precision for ``setting`` (``auto``, ``fp32``, ``bf16``). ``support()`` names
    the CPU's native bf16 instruction set (or None) and ``speedup()`` measures bf16's gain; both are
    called only when ``auto`` needs them. ``env``: the ``HYBRIDRL_AUTO_PRECISION`` value, which
    fixes what ``auto`` means."""
    if setting not in ("auto", "fp32", "bf16"):
        raise ValueError(f"{key} must be auto, fp32 or bf16, got {setting!r}")
    if setting == "fp32":
        return Precision(torch.float32, f"{key}=fp32")
    if setting == "bf16":
        found = support()
        note = (
            f"CPU {found}"
            if found
            else "this CPU has no native bf16 matmul (amx_bf16, avx512_bf16): expect it slower"
        )
        return Precision(torch.bfloat16, f"{key}=bf16; {note}")
    if env:
        if env not in ("fp32", "bf16"):
            raise ValueError(f"{ENV_OVERRIDE} must be fp32 or bf16, got {env!r}")
        return Precision(
            torch.bfloat16 if env == "bf16" else torch.float32, f"{key}=auto, {ENV_OVERRIDE}={env}"
        )
    found = support()
    if found is None:
        return Precision(
            torch.float32, f"{key}=auto: this CPU has no native bf16 matmul (amx_bf16, avx512_bf16)"
        )
    gain = speedup()
    if gain >= threshold:
        return Precision(
            torch.bfloat16,
            f"{key}=auto: CPU {found}, bf16 measured {gain:.2f}x fp32 on one layer of this model",
        )
    return Precision(
        torch.float32,
        f"{key}=auto: CPU {found}, but bf16 measured only {gain:.2f}x fp32 on one layer of this "
        "model "
        f"(needs {threshold:g}x)",
    )


def cpu_precision(setting: str, model: nn.Module, *, train: bool, key: str) -> Precision:
    """:func:`decide` with this CPU's flags and a measurement on ``model`` (cached per process and
    shape)."""
    return decide(
        setting,
        support=cpu_bf16_support,
        speedup=lambda: SPEEDUPS.get(model, train),
        key=key,
        env=os.environ.get(ENV_OVERRIDE) or None,
    )


def cuda_bf16_native(device: torch.device | str | None = None) -> bool:
    """Whether the GPU runs bf16 matmuls natively (compute capability >= 8.0: Ampere and newer)."""
    return torch.cuda.get_device_capability(device)[0] >= 8


def cuda_precision(
    setting: str, *, key: str, device: torch.device | str | None = None, env: str | None = None
) -> Precision:
    """The CUDA compute precision for ``setting`` (``auto``, ``fp32``, ``bf16``): ``auto`` is bf16
    where the GPU has native bf16 (:func:`cuda_bf16_native`), else fp32; ``env`` (the
    ``HYBRIDRL_AUTO_PRECISION`` value, default: read from the environment) fixes what ``auto``
    means, as on the CPU."""
    if setting not in ("auto", "fp32", "bf16"):
        raise ValueError(f"{key} must be auto, fp32 or bf16, got {setting!r}")
    if setting == "fp32":
        return Precision(torch.float32, f"{key}=fp32 on cuda")
    native = cuda_bf16_native(device)
    name = torch.cuda.get_device_name(device)
    if setting == "bf16":
        note = "" if native else f"; {name} has no native bf16 (compute capability < 8.0): slow"
        return Precision(torch.bfloat16, f"{key}=bf16 on cuda{note}")
    if env is None:
        env = os.environ.get(ENV_OVERRIDE) or None
    if env:
        if env not in ("fp32", "bf16"):
            raise ValueError(f"{ENV_OVERRIDE} must be fp32 or bf16, got {env!r}")
        return Precision(
            torch.bfloat16 if env == "bf16" else torch.float32,
            f"{key}=auto on cuda, {ENV_OVERRIDE}={env}",
        )
    if native:
        return Precision(torch.bfloat16, f"{key}=auto on cuda: {name} has native bf16")
    return Precision(
        torch.float32, f"{key}=auto on cuda: {name} has no native bf16 (compute capability < 8.0)"
    )


# --- autocast -------------------------------------------------------------------------------------
_ATTR = "_hybridrl_autocast_dtype"
_DEVICE_ATTR = "_hybridrl_autocast_device"


def set_autocast(
    model: nn.Module, dtype: torch.dtype | None, device_type: str = "cpu"
) -> nn.Module:
    """Mark ``model``'s forwards to run under autocast to ``dtype`` on ``device_type`` (``cpu`` or
    ``cuda``; None: as they are)."""
    object.__setattr__(model, _ATTR, dtype)
    object.__setattr__(model, _DEVICE_ATTR, device_type)
    return model


def autocast_dtype(model: nn.Module) -> torch.dtype | None:
    return getattr(model, _ATTR, None)


def autocast_device(model: nn.Module) -> str:
    """The device type ``model``'s autocast mark is for (``cpu`` when unmarked)."""
    return getattr(model, _DEVICE_ATTR, "cpu")


def autocast(model: nn.Module):
    """The context a forward of ``model`` runs in: bf16 autocast (CPU or CUDA) when the model is
    marked for it."""
    dtype = autocast_dtype(model)
    return nullcontext() if dtype is None else torch.autocast(autocast_device(model), dtype=dtype)
