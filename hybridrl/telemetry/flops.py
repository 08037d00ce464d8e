"""Model FLOPs utilisation (MFU) per phase: analytic FLOPs of a dense decoder over a measured peak.

**FLOPs.** A forward pass of a dense decoder (Qwen2, Qwen3, Llama as built here) costs, per token at
position ``t`` (0-based) of a sequence, ``2 × P_matmul + 4 × L × H × d_head × (t + 1)``:

* ``P_matmul``: the parameters that take part in a matmul, i.e. per layer the q, k, v and o
  projections (``h × (H + 2 × KV) × d_head + H × d_head × h``) and the gated MLP (``3 × h × I``),
  times ``L`` layers, plus the output head (``h × vocab`` for a causal LM, ``h × num_labels`` for
  the critic's value head). The embedding lookup is no matmul: tied embeddings change the parameter
  count, not the FLOPs (the head's matmul runs either way). Biases, norms, rotary embeddings, the
  activation, softmax and residual adds are element-wise and not counted (well under 1% here).
* the attention scores ``Q K^T`` and the weighted values ``A V``: ``2 × d_head`` FLOPs each per
  head, layer and attended key. **Convention: causal**, the token at position ``t`` attends
  ``t + 1`` keys, so a sequence of ``T`` tokens costs ``4 × L × H × d_head × T (T + 1) / 2`` here,
  about half of what a kernel computing the full ``T × T`` score matrix executes. Grouped-query
  attention shares the keys and values, not the score work: the term has ``H`` (query heads), not
  ``KV``.

Only real tokens count (``attention_mask``), never padding: MFU is useful work, not what the padded
kernels executed. A token the passes compute once for several rows counts once: with packed
micro-batches a group's samples share one copy of their prompt (``learner/prefix_share.py``), so a
phase's FLOPs are scaled by the share of the rows' tokens the update actually computed (its
``perf/tokens_fed`` less padding); counting every row's prompt overstated the work, and the MFU,
by as much as the rows' prompts are shared. A training token costs 3 × its forward (the backward
computes gradients of the inputs and of the weights, each about a forward); activation
checkpointing's recomputed forward is not counted (model FLOPs, not hardware FLOPs), and with LoRA
the frozen weights get no weight gradients, so the 3 × overstates an adapter update (about 2 ×).

Checked against ``torch.utils.flop_counter.FlopCounterMode`` on the tiny built-in model's eager
forward (fp32, ``attn_implementation="eager"``; the counter has no formula for the CPU SDPA kernels,
so it cannot check the default attention, which is why the count used is this analytic one): the
matmul part (``aten.mm`` + ``aten.addmm``) agrees exactly; the counter's attention part
(``aten.bmm``) equals this module's term with ``causal=False``, since eager attention multiplies
the full masked ``T × T`` matrix (``tests/test_flops.py``).

**Peak.** :func:`peak_flops` is the device's matmul peak in the dtype the phase runs in (fp32, or
bf16 under CPU autocast / FSDP2's bf16 parameters: :func:`compute_dtype`), once per process and
(device, dtype, thread count): on a CPU a measured roofline (square matmuls for about 0.2 s, the
fastest of the runs, wall clock like the phase timers, at this process's torch thread count), on a
GPU a table of known dense peaks by device name (tensor cores for bf16 and TF32, none for plain
fp32), measured like the CPU's when the device is not in the table. **MFU ≤ 1 by construction**: a
peak is the fastest rate seen, so load on the machine only ever makes a measurement too low (a
median or a single run taken while another process computes is far below what the device does
once it is free); when a phase then runs faster than the peak, the peak was underestimated and is
raised to that phase's rate (:func:`utilisation`), whose MFU is then 1.

**Per rank.** With several learner ranks each runs its contiguous share of the rows, all in
lockstep: a phase's FLOPs are divided by the world size and set against one rank's peak, so
``perf/mfu_*`` is the mean rank's utilisation of its own device (and ``perf/tokens_per_s_*`` a
rank's tokens per second). The rollout's figures are its rank 0's own tokens and busy time.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import torch

TRAIN_FACTOR = 3  # forward + backward (input and weight gradients)
# phases of the learning step and whether they train (the update) or only run forwards
LEARNER_PHASES = {"reference": False, "old_log_prob": False, "values": False, "update": True}

# dense (no sparsity) matmul peaks in TFLOP/s by a whole word (or words) of
# torch.cuda.get_device_name(): (bf16 tensor cores, tf32 tensor cores, fp32 without tensor cores).
# First match wins, so the more specific names come first; an unlisted GPU is measured.
GPU_PEAKS_TFLOPS = (
    ("H200", (989.0, 494.0, 67.0)),
    ("H100 PCIe", (756.0, 378.0, 51.0)),
    ("H100 NVL", (835.0, 418.0, 60.0)),
    ("H100", (989.0, 494.0, 67.0)),
    ("GH200", (989.0, 494.0, 67.0)),
    ("A100", (312.0, 156.0, 19.5)),
    ("L40S", (362.0, 183.0, 91.6)),
    ("L4", (121.0, 60.0, 30.3)),
    ("A10G", (70.0, 35.0, 31.2)),
    ("A10", (125.0, 62.5, 31.2)),
)


@dataclass(frozen=True)
class DecoderShape:
    """What the FLOPs of a dense decoder depend on (read from a transformers config)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    head_out: int  # output features of the last matmul: vocab (causal LM) or num_labels (critic)

    @classmethod
    def from_config(cls, config, head_out: int | None = None) -> DecoderShape:
        """As the model spec reads ``config`` (``models/spec.py``)."""
        from hybridrl.models.spec import ModelSpec

        return cls.from_spec(ModelSpec.from_config(config), head_out)

    @classmethod
    def from_spec(cls, s, head_out: int | None = None) -> DecoderShape:
        """From a :class:`~hybridrl.models.spec.ModelSpec` (``head_out`` None: its vocabulary)."""
        return cls(
            hidden=s.hidden_size,
            layers=s.num_layers,
            heads=s.num_heads,
            kv_heads=s.num_kv_heads,
            head_dim=s.head_dim,
            intermediate=s.intermediate_size,
            head_out=s.vocab_size if head_out is None else head_out,
        )

    @classmethod
    def from_model(cls, model) -> DecoderShape:
        """The shape of a causal LM, or of a token-classification model (the critic: its head has
        ``num_labels`` outputs)."""
        config = model.config
        lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        return cls.from_config(
            config, None if lm_head is not None else getattr(config, "num_labels", 1)
        )

    @property
    def matmul_params(self) -> int:
        """Parameters that take part in a matmul per token: projections, MLP, output head."""
        h, d = self.hidden, self.head_dim
        attn = h * (self.heads + 2 * self.kv_heads) * d + self.heads * d * h
        return self.layers * (attn + 3 * h * self.intermediate) + h * self.head_out

    def attention_flops(self, length: int, causal: bool = True) -> int:
        """Scores and weighted values of one sequence of ``length`` tokens, all layers."""
        keys = length * (length + 1) // 2 if causal else length * length
        return 4 * self.layers * self.heads * self.head_dim * keys

    def forward_flops(self, lengths, causal: bool = True) -> int:
        """Forward FLOPs of sequences of the given real lengths (one int per sequence)."""
        lengths = [int(n) for n in lengths]
        matmul = 2 * self.matmul_params * sum(lengths)
        return matmul + sum(self.attention_flops(n, causal) for n in lengths)


# --- peak -----------------------------------------------------------------------------------------
_PEAKS: dict[tuple, float] = {}


def compute_dtype(model) -> torch.dtype:
    """The dtype a model's matmuls run in: bf16 under CPU autocast (``parallel/precision.py``) or
    FSDP2's bf16 parameters (``parallel/fsdp.py``), else its parameters' dtype."""
    from hybridrl.parallel.precision import autocast_dtype

    dtype = autocast_dtype(model)
    if dtype is not None:
        return dtype
    try:  # FSDP2 mixed precision: the gathered parameters' dtype
        policy = model._get_fsdp_state()._mp_policy
        if policy.param_dtype is not None:
            return policy.param_dtype
    except (AttributeError, RuntimeError):
        pass
    return next(model.parameters()).dtype


def measure_matmul_flops(
    device: torch.device,
    dtype: torch.dtype,
    n: int = 1024,
    budget_s: float = 0.2,
    min_reps: int = 3,
) -> float:
    """The best FLOP/s of ``n × n`` matmuls in ``dtype`` on ``device`` over about ``budget_s``
    seconds of wall clock (after one warm-up; at least ``min_reps`` runs): load only slows a run
    down, so the fastest run is the closest to the device's peak."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    a @ b
    sync()
    rates, start = [], time.perf_counter()
    while len(rates) < min_reps or time.perf_counter() - start < budget_s:
        t0 = time.perf_counter()
        a @ b
        sync()
        rates.append(2 * n**3 / max(time.perf_counter() - t0, 1e-9))
    return max(rates)


def _gpu_table_peak(device: torch.device, dtype: torch.dtype) -> float | None:
    name = torch.cuda.get_device_name(device)
    for key, (bf16, tf32, fp32) in GPU_PEAKS_TFLOPS:
        if re.search(rf"\b{re.escape(key)}\b", name):  # "L4" is not "L40"
            if dtype in (torch.bfloat16, torch.float16):
                return bf16 * 1e12
            return (tf32 if torch.backends.cuda.matmul.allow_tf32 else fp32) * 1e12
    return None


def _peak_key(device: torch.device | str, dtype: torch.dtype) -> tuple:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device), dtype, torch.get_num_threads()


def peak_flops(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> float:
    """This process's matmul peak in FLOP/s on ``device`` in ``dtype`` (cached per device, dtype
    and torch thread count): the GPU table, else a measured roofline (1024² matmuls on a CPU,
    4096² on a GPU), raised by any faster rate a phase achieved since (:func:`utilisation`)."""
    device = torch.device(device)
    key = _peak_key(device, dtype)
    if key not in _PEAKS:
        peak = _gpu_table_peak(device, dtype) if device.type == "cuda" else None
        if peak is None:
            peak = measure_matmul_flops(device, dtype, n=4096 if device.type == "cuda" else 1024)
        _PEAKS[key] = peak
    return _PEAKS[key]


def utilisation(flops_per_s: float, device: torch.device | str, dtype: torch.dtype) -> float:
    """MFU of a phase that ran at ``flops_per_s``: its share of the peak, which is at least this
    rate (a phase that outran the measured peak shows the peak was measured too low, on a loaded
    machine, and raises it for later phases)."""
    peak = max(peak_flops(device, dtype), flops_per_s)
    _PEAKS[_peak_key(device, dtype)] = peak
    return flops_per_s / peak


def _device_of(model) -> torch.device:
    """Where a model computes: a sharded model's parameters may be CPU-offloaded."""
    from hybridrl.parallel.distributed import compute_device
    from hybridrl.parallel.fsdp import is_sharded

    return compute_device() if is_sharded(model) else next(model.parameters()).device


# --- metrics --------------------------------------------------------------------------------------
def learner_perf(
    learner,
    timing: dict[str, float],
    attention_mask: torch.Tensor,
    computed_tokens: float | None = None,
) -> dict[str, float]:
    """``perf/mfu_<phase>`` and ``perf/tokens_per_s_<phase>`` of the learner's model phases that ran
    this step (``timing/<phase>`` present): the phase's forward FLOPs over the real tokens of the
    step's batch (× 3 × ``actor.ppo_epochs`` for the update), per rank, over the phase's seconds
    and the rank's peak in the dtype the phase's model runs in. ``computed_tokens``: the distinct
    tokens one epoch of the update computed over all ranks (a shared prompt once), which scales
    every phase's FLOPs (the passes group the rows alike); None: every row's tokens. ``learner``:
    a :class:`~hybridrl.learner.learner.Learner` (its policy ``model``, ``reference`` and
    ``critic``; a phase whose model it lacks is skipped)."""
    from hybridrl.parallel import distributed

    reference, critic = getattr(learner, "reference", None), getattr(learner, "critic", None)
    models = {
        "reference": getattr(reference, "model", None),
        "old_log_prob": getattr(learner, "model", None),
        "values": getattr(critic, "model", None),
        "update": getattr(learner, "model", None),
    }
    epochs, world_size = learner.cfg.actor.ppo_epochs, distributed.world_size()
    out: dict[str, float] = {}
    lengths = attention_mask.sum(-1).tolist()
    tokens = sum(lengths)
    computed = min(1.0, computed_tokens / tokens) if computed_tokens and tokens else 1.0
    for phase, train in LEARNER_PHASES.items():
        seconds, model = timing.get(f"timing/{phase}"), models[phase]
        if not seconds or model is None or not tokens:
            continue
        passes = TRAIN_FACTOR * epochs if train else 1
        flops = DecoderShape.from_model(model).forward_flops(lengths) * computed
        flops *= passes / world_size
        out[f"perf/mfu_{phase}"] = utilisation(
            flops / seconds, _device_of(model), compute_dtype(model)
        )
        out[f"perf/tokens_per_s_{phase}"] = tokens * (epochs if train else 1) / world_size / seconds
    return out


def rollout_perf(stats: dict[str, float], backend) -> dict[str, float]:
    """``perf/mfu_rollout`` from a native engine's ``stats()``: the forward FLOPs of its generated
    and prefilled (computed, not prefix-cached) tokens over its busy time (the seconds inside
    engine steps, ``engine/generated_tokens / engine/tokens_per_s``). Only the matmul part is
    counted (the engine's stats do not say at which context each token ran; at W1's lengths the
    attention term is about 1% of the total): a lower bound. A speculative decoder's draft model
    and rejected tokens are not counted either. Empty for backends without token counts or engine
    runner (``hf``, external engines) and for a call that generated nothing."""
    runner = getattr(getattr(backend, "engine", None), "runner", None)
    generated = stats.get("engine/generated_tokens", 0.0)
    rate = stats.get("engine/tokens_per_s", 0.0)
    if runner is None or not generated or not rate:
        return {}
    tokens = generated + stats.get("engine/prompt_tokens_computed", 0.0)
    shape = DecoderShape.from_spec(runner.spec)  # the spec the engine was built from
    flops = 2 * shape.matmul_params * tokens
    return {
        "perf/mfu_rollout": utilisation(flops / (generated / rate), runner.device, runner.dtype)
    }
