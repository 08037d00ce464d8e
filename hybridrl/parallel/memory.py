"""Training-memory estimator: bytes per device for one training step of a causal LM.

``estimate(model, layout)`` returns the bytes each device holds for a model
(a transformers ``PretrainedConfig`` of a decoder such as Qwen2/Llama, or a
mixture of experts (Qwen2-MoE, Qwen3-MoE, Mixtral: ``parallel/memory_moe.py`` has
what experts and expert parallelism change), or only a parameter count Ψ) under a
``Layout``; ``hybridrl memory`` prints it (``parallel/memory_cli.py``).

Notation: Ψ parameters (Ψ_t of them trainable: Ψ, or the LoRA adapters),
N = ``world_size``, p = bytes of ``param_dtype`` (4 fp32, 2 bf16), n =
``micro_batch_tokens``, L layers, h hidden size, I intermediate size (``inter``),
H / K attention / key-value heads, d = h / H head dim, V vocabulary, T
sequence length (``seq_len``; default min(n, max positions)), a = p bytes
per activation element.

States (ZeRO, Rajbhandari et al. 1910.02054). "master" = 4Ψ_t when the parameters
are not fp32 and ``master_fp32`` (mixed precision keeps fp32 master weights),
else 0; Adam m and v are fp32 under mixed precision (4Ψ_t each), else in
the parameter dtype (pΨ_t each).

* weights    = pΨ                  (/N with ``sharding="full"``)
* gradients  = pΨ_t                (/N with ``grad_op`` and ``full``)
* optimizer  = master + m + v      (/N with ``optim``, ``grad_op``, ``full``)

so mixed-precision Adam is 2Ψ + 2Ψ + 12Ψ = 16Ψ per replica, and per device
ZeRO-1 (``optim``) 4Ψ + 12Ψ/N, ZeRO-2 (``grad_op``) 2Ψ + 14Ψ/N, ZeRO-3
(``full``) 16Ψ/N. With LoRA (``lora_rank`` r > 0) Ψ_t = Σ_layers r·(in+out)
over q, k, v, o, gate, up, down (an MoE layer: over its shared expert's gate, up,
down, if any; the routed experts stay frozen); the frozen base keeps only its
weights.
With ``cpu_offload`` the (sharded) weights, gradients and optimizer states
live in host memory (their device is "cpu"), as FSDP2's CPUOffloadPolicy does.

Activations (what autograd saves for backward in the micro-batch; counted
tensor by tensor for transformers' Qwen2 decoder layer under SDPA with a
padding mask, which this module was calibrated against), bytes per token:

* per layer  = 2·(4h + 2ah + 4)             two RMSNorms: fp32 input, normalised, weighted
                                             output, 1/rms
             + a·(2h + 2h)                   q and o-input (SDPA output); k and v after
                                             repeat_kv (H heads)
             + 4H + a·T                      SDPA logsumexp and the (float) attention mask row
             + 4a·I                          MLP: gate, silu(gate), up, silu(gate)·up (an MoE
                                             layer: top-k routing's, parallel/memory_moe.py)
             + (4 + a)·(H + K)·d + 4(H + K)  Qwen3's q/k norms: input, normalised, 1/rms
             + 7a·r (LoRA)                   the adapters' low-rank activations
* head       = 4h + 2ah + 4 + a·V + 3·4V     final norm, logits, fp32 log-softmax, softmax
                                             (entropy), dlogits
* backward   = a·(h + I)                     the gradients of a hidden state and an MLP
                                             intermediate in flight during a layer's backward
                                             (calibrated against the live-tensor peak measured
                                             by bench/memory.py)

  activations = n·(L·per_layer + head + backward)
  with activation checkpointing: n·(L·a·h + per_layer + head + backward)
  (only each layer's input is kept; one layer is recomputed at a time).

Workspace: with ``full`` sharding the all-gathered parameters of two layers
(the current one and the prefetched next) plus one layer's unsharded
gradients before reduce-scatter: 2·p·P_layer + p·P_layer (P_layer parameters
of one decoder layer); 0 otherwise. It and the activations are always on the
device. A bare parameter count gives no activations or workspace (a config
is needed for the shapes).

Total on the device = the terms whose device is the accelerator; host =
the offloaded ones. These are tensor bytes: on CPU with glibc's default
malloc the process RSS peak is 1.3-2.6x higher (heap fragmentation after the
mmap threshold rises; bench/memory.py), with the threshold pinned
(``MALLOC_MMAP_THRESHOLD_=131072``) it is within a few percent.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from hybridrl.parallel.memory_moe import MoECost, split_states

SHARDING = ("none", "optim", "grad_op", "full")
DTYPE_BYTES = {"fp32": 4, "bf16": 2}
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


@dataclass
class Layout:
    world_size: int = 1
    sharding: str = "none"  # none | optim (ZeRO-1) | grad_op (ZeRO-2) | full (ZeRO-3)
    param_dtype: str = "fp32"  # fp32 | bf16
    master_fp32: bool = True  # with bf16 params: keep an fp32 master copy (mixed precision)
    cpu_offload: bool = False
    lora_rank: int = 0
    activation_checkpointing: bool = False
    micro_batch_tokens: int = 8192
    seq_len: int | None = None  # padded row width; default min(micro_batch_tokens, max positions)
    ep_size: int = 1  # expert parallelism: ranks that split each MoE layer's experts

    def __post_init__(self):
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.sharding not in SHARDING:
            raise ValueError(
                f"sharding must be one of {', '.join(SHARDING)}, got {self.sharding!r}"
            )
        if self.param_dtype not in DTYPE_BYTES:
            raise ValueError(
                f"param_dtype must be one of {', '.join(DTYPE_BYTES)}, got {self.param_dtype!r}"
            )
        if self.lora_rank < 0:
            raise ValueError(f"lora_rank must be >= 0, got {self.lora_rank}")
        if self.micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens must be >= 1, got {self.micro_batch_tokens}")
        if self.seq_len is not None and self.seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {self.seq_len}")
        if self.ep_size < 1 or self.world_size % self.ep_size:
            raise ValueError(
                f"ep_size must be >= 1 and divide world_size {self.world_size}, got {self.ep_size}"
            )


@dataclass
class Shape:
    """The dimensions of a decoder-only transformer that the estimate needs (``moe``: its experts,
    None for a dense one)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool
    o_bias: bool
    max_positions: int
    qk_norm: bool = False  # Qwen3: RMSNorms of q and k per head (head_dim weights each)
    moe: MoECost | None = None

    @classmethod
    def from_config(cls, cfg) -> Shape:
        """The shape of a transformers ``PretrainedConfig``, as the model spec reads it
        (``models/spec.py``)."""
        from hybridrl.models.spec import ModelSpec

        s = ModelSpec.from_config(cfg)
        return cls(
            layers=s.num_layers,
            hidden=s.hidden_size,
            intermediate=s.intermediate_size,
            heads=s.num_heads,
            kv_heads=s.num_kv_heads,
            head_dim=s.head_dim,
            vocab=s.vocab_size,
            tied=s.tie_word_embeddings,
            qkv_bias=s.attn_bias,
            o_bias=s.o_bias,
            max_positions=s.max_positions,
            qk_norm=s.qk_norm,
            moe=MoECost.of(s.moe) if s.moe is not None else None,
        )

    def attention_params(self) -> int:
        """A layer's attention and its two norms."""
        h, d = self.hidden, self.head_dim
        q, kv = self.heads * d, self.kv_heads * d
        attn = (
            h * q
            + 2 * h * kv
            + q * h
            + (q + 2 * kv if self.qkv_bias else 0)
            + (h if self.o_bias else 0)
        )
        return attn + 2 * h + (2 * d if self.qk_norm else 0)

    @property
    def moe_layers(self) -> int:
        return self.moe.moe_layers if self.moe else 0

    def layer_params(self, ep_size: int = 1) -> int:
        """The largest decoder layer's parameters (an MoE layer's with E / ``ep_size`` experts:
        what one layer holds gathered)."""
        dense = self.attention_params() + 3 * self.hidden * self.intermediate
        if not self.moe_layers:
            return dense
        moe = self.attention_params() + self.moe.layer_params(self.hidden)
        experts = self.moe.expert_params(self.hidden) // self.moe_layers
        return max(
            moe - experts + experts // ep_size, dense if self.moe_layers < self.layers else 0
        )

    def params(self) -> int:
        emb = self.vocab * self.hidden
        dense = self.attention_params() + 3 * self.hidden * self.intermediate
        moe = self.attention_params() + self.moe.layer_params(self.hidden) if self.moe else 0
        layers = (self.layers - self.moe_layers) * dense + self.moe_layers * moe
        return emb * (1 if self.tied else 2) + layers + self.hidden

    def expert_params(self) -> int:
        """Ψ_e: the routed experts (0 for a dense model)."""
        return self.moe.expert_params(self.hidden) if self.moe else 0

    def lora_params(self, r: int) -> int:
        """Σ r·(in+out) over the Linear modules LoRA adapts: q, k, v, o in every layer; gate, up
        and down in a dense layer's MLP and in an MoE layer's shared expert (width I_s). The routed
        experts are fused tensors, not Linear modules, and stay frozen."""
        h = self.hidden
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = r * ((h + q) + 2 * (h + kv) + (q + h))
        shared = self.moe.shared_inter if self.moe else 0
        dense_mlp, moe_mlp = 3 * r * (h + self.intermediate), 3 * r * (h + shared) if shared else 0
        return (
            self.layers * attn
            + (self.layers - self.moe_layers) * dense_mlp
            + self.moe_layers * moe_mlp
        )


def _activation_terms(s: Shape, lay: Layout) -> dict[str, int]:
    """Bytes of the activation terms (see the module docstring for the formulas)."""
    a = DTYPE_BYTES[lay.param_dtype]
    n = lay.micro_batch_tokens
    T = lay.seq_len or min(n, s.max_positions)
    h, inter = s.hidden, s.intermediate
    norm = 4 * h + 2 * a * h + 4
    attn = 2 * norm + a * 4 * h + 4 * s.heads + a * T + 4 * a * lay.lora_rank
    if s.qk_norm:  # Qwen3's per-head q/k RMSNorms: their input, normalised value and 1/rms
        q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
        attn += (4 + a) * (q + kv) + 4 * (s.heads + s.kv_heads)
    lora_mlp = 3 * a * lay.lora_rank  # the adapters' r-wide activations of gate, up, down
    dense = attn + 4 * a * inter + lora_mlp
    moe = attn
    if s.moe:  # the routed experts' activations; adapters only on a shared expert
        moe += s.moe.mlp_activation(h, a) + (lora_mlp if s.moe.shared_inter else 0)
    head = norm + a * s.vocab + 3 * 4 * s.vocab
    backward = a * (h + max(inter if s.moe_layers < s.layers else 0, _routed_width(s)))
    if lay.activation_checkpointing:
        layers = n * (s.layers * a * h + max(dense if s.moe_layers < s.layers else 0, moe))
    else:
        layers = n * ((s.layers - s.moe_layers) * dense + s.moe_layers * moe)
    return {"layers": layers, "head": n * head, "backward": n * backward}


def _routed_width(s: Shape) -> int:
    """The MLP intermediate width of one token in an MoE layer (k experts)."""
    return s.moe.top_k * s.moe.inter if s.moe_layers else 0


def estimate(model, layout: Layout | None = None) -> dict:
    """Bytes per device for ``model`` (a transformers config or a parameter count) under ``layout``.

    Returns a dict with ints ``weights``, ``gradients``, ``optimizer``, ``states`` (their sum),
    ``activations`` and ``workspace`` (None for a bare parameter count), ``total`` (all terms),
    ``device_total`` / ``host_total`` (split by where each term lives), ``device`` (term ->
    "accelerator" or "cpu"), ``breakdown`` (optimizer master/m/v and activation parts),
    ``n_params``, ``trainable_params`` and ``layout``.
    """
    lay = layout or Layout()
    shape = None
    if isinstance(model, (int, float)) and not isinstance(model, bool):
        psi = int(model)
        if psi <= 0:
            raise ValueError(f"parameter count must be positive, got {model}")
    else:
        shape = Shape.from_config(model)
        psi = shape.params()
    if lay.lora_rank and shape is None:
        raise ValueError(
            "a LoRA estimate needs a model config (the adapter sizes depend on the layer shapes)"
        )
    psi_e = shape.expert_params() if shape is not None else 0
    if lay.ep_size > 1:
        if not psi_e:
            raise ValueError("ep_size > 1 needs a mixture-of-experts config")
        shape.moe.check_ep(lay.ep_size, lay.world_size)
    trainable = shape.lora_params(lay.lora_rank) if lay.lora_rank else psi
    trained_e = 0 if lay.lora_rank else psi_e  # the experts' share of the trained parameters
    N, p = lay.world_size, DTYPE_BYTES[lay.param_dtype]
    mixed = lay.param_dtype != "fp32" and lay.master_fp32
    shard_w = N if lay.sharding == "full" else 1
    shard_g = N if lay.sharding in ("grad_op", "full") else 1
    shard_o = N if lay.sharding != "none" else 1
    adapters = trainable if lay.lora_rank else 0
    weights = split_states(p * (psi - psi_e + adapters), p * psi_e, shard_w, lay)
    gradients = split_states(p * (trainable - trained_e), p * trained_e, shard_g, lay)
    state_bytes = 4 if mixed else p

    def optim(per_param: int) -> int:
        return split_states(
            per_param * (trainable - trained_e), per_param * trained_e, shard_o, lay
        )

    opt = {"master": optim(4 if mixed else 0), "m": optim(state_bytes), "v": optim(state_bytes)}
    optimizer = sum(opt.values())
    acts = workspace = None
    breakdown = {"optimizer": opt}
    if shape is not None:
        parts = _activation_terms(shape, lay)
        acts = sum(parts.values())
        breakdown["activations"] = parts
        workspace = (
            3 * p * shape.layer_params(lay.ep_size) if lay.sharding == "full" and N > 1 else 0
        )
        if psi_e:
            breakdown["experts"] = {
                "params": psi_e,
                "params_per_ep_rank": psi_e // lay.ep_size,
                "active_params_per_token": psi - psi_e + psi_e * shape.moe.top_k // shape.moe.count,
            }
    where_states = "cpu" if lay.cpu_offload else "accelerator"
    device = {
        "weights": where_states,
        "gradients": where_states,
        "optimizer": where_states,
        "activations": "accelerator",
        "workspace": "accelerator",
    }
    terms = {
        "weights": weights,
        "gradients": gradients,
        "optimizer": optimizer,
        "activations": acts or 0,
        "workspace": workspace or 0,
    }
    return {
        "n_params": psi,
        "expert_params": psi_e,
        "trainable_params": trainable,
        "layout": asdict(lay),
        "weights": weights,
        "gradients": gradients,
        "optimizer": optimizer,
        "states": weights + gradients + optimizer,
        "activations": acts,
        "workspace": workspace,
        "total": sum(terms.values()),
        "device_total": sum(v for k, v in terms.items() if device[k] == "accelerator"),
        "host_total": sum(v for k, v in terms.items() if device[k] == "cpu"),
        "device": device,
        "breakdown": breakdown,
    }
