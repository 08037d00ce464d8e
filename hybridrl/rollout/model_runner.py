"""The native engine's runner: the model (``decoder.py``), its KV and routing pools, and one step's
execution, for Qwen2 / Qwen3 / Llama and their mixture-of-experts siblings (Qwen2-MoE, Qwen3-MoE,
Mixtral).

The model is an ``nn.Module`` whose parameters load by their transformers names (``weights.py``),
from a live state dict or a safetensors checkpoint; q/k/v and gate/up are packed into one matrix
each, so a layer is four matmuls. The step's tokens of all sequences are packed into one flat
(T, hidden) batch with no padding for every matmul; only attention pads, to the step's longest
query and context (``paged_attention.py``). The KV pool is one tensor per K and V of shape
(layers, kv_heads, slots, head_dim), slot = block * block_size + offset. Plain torch: CPU here,
CUDA unchanged.

Mixture-of-experts models also record routing: next to the KV pool lies a routing pool of shape
(slots, MoE layers, k), int16, and every forward writes the experts each MoE layer chose for a
token at that token's KV slot. Routing thus lives and dies with the KV: a prompt prefix served
from the prefix cache brings its tokens' routing in its blocks, a fork's copied block copies it,
and a recomputed token (after a preemption or a weight update) overwrites it. ``read_routing``
gathers a sequence's routing through its block table before its blocks are freed.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from hybridrl.models.spec import ModelSpec
from hybridrl.moe.routing import NOT_ROUTED, ROUTING_DTYPE
from hybridrl.rollout.decoder import CausalLM
from hybridrl.rollout.kv_capacity import bytes_per_block
from hybridrl.rollout.layers import rope_tables
from hybridrl.rollout.sequence import Sequence
from hybridrl.rollout.step_inputs import StepInputs, StepPreparation
from hybridrl.rollout.weights import WeightMap


class ModelRunner(StepPreparation):
    def __init__(
        self,
        config,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        block_size: int = 16,
        hf_model=None,
        keep_gathered: bool | None = None,
    ):
        self.config = config
        self.spec = s = ModelSpec.from_config(config).require_family("native rollout")
        self.device = torch.device(device)
        self.dtype = dtype
        self.block_size = block_size
        self.model = CausalLM(s, device=self.device, dtype=dtype)
        self.weights = WeightMap(self.model)
        self.routing_pool: torch.Tensor | None = None  # (slots, MoE layers, k) expert ids
        self.records_routing = s.moe is not None
        rot = getattr(getattr(hf_model, "model", None), "rotary_emb", None)
        if rot is not None:
            inv_freq, scaling = (
                rot.inv_freq.detach().float().cpu(),
                float(getattr(rot, "attention_scaling", 1.0)),
            )
        else:
            inv_freq, scaling = default_inv_freq(config, s.head_dim)
        # + room for speculative lookahead
        self.cos_table, self.sin_table = rope_tables(
            inv_freq, scaling, s.max_positions + 64, device=self.device, dtype=dtype
        )
        self.k_cache = self.v_cache = None
        self.num_blocks = 0
        self._kbuf = self._vbuf = None
        # Keep each layer's gathered context between decode steps over the same batch and only
        # append the new token: on a CPU the per-step gather costs about as much as a small model's
        # matmuls. Off on CUDA.
        self.keep_gathered = self.device.type == "cpu" if keep_gathered is None else keep_gathered
        self._layer_bufs: list | None = None
        self._last_batch: tuple | None = None  # (blocks per row, {seq_id: row}) of the kept buffers
        if hf_model is not None:
            self.load_weights(hf_model.state_dict().items(), strict=True)

    # --- weights ----------------------------------------------------------------
    @property
    def embed(self) -> torch.Tensor:
        """The embedding matrix (the head too when tied)."""
        return self.model.model.embed_tokens.weight

    def optional_weight_names(self) -> set[str]:
        """Names a weight sync may carry besides :meth:`named_weights` (the routers' bias)."""
        return self.weights.optional_names()

    def named_weights(self) -> dict[str, torch.Tensor]:
        """The live weights by transformers name (views into the packed parameters; a tied head is
        the embedding)."""
        return self.weights.named_weights()

    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], strict: bool = False
    ) -> int:
        """Copy tensors (transformers names) into the live weights in place; the number loaded.
        ``strict``: all of the model's weights must come (a KeyError names the missing ones)."""
        return self.weights.load(named_tensors, strict=strict)

    def load_safetensors(self, path: str) -> int:
        """Load a whole checkpoint (every ``*.safetensors`` under ``path``); a KeyError names any
        weight it lacks or the model does not have."""
        from pathlib import Path

        from safetensors.torch import load_file

        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors under {path!r}")
        tensors = (item for f in files for item in load_file(str(f)).items())
        return self.load_weights(tensors, strict=True)

    # --- KV pool ------------------------------------------------------------------
    def bytes_per_block(self) -> int:
        routing = self._routing_width() * torch.iinfo(ROUTING_DTYPE).bits // 8
        return bytes_per_block(self.spec, self.block_size, self.dtype, routing)

    def allocate_kv(self, num_blocks: int) -> None:
        s = self.spec
        shape = (s.num_layers, s.num_kv_heads, num_blocks * self.block_size, s.head_dim)
        # zeros: masked slots stay finite
        self.k_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.v_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.num_blocks = num_blocks
        if s.moe is not None:
            self.routing_pool = torch.full(
                (num_blocks * self.block_size, s.num_moe_layers, s.moe.top_k),
                NOT_ROUTED,
                device=self.device,
                dtype=ROUTING_DTYPE,
            )

    def _routing_width(self) -> int:
        """Expert ids stored per token slot (0 for a dense model)."""
        s = self.spec
        return s.num_moe_layers * s.moe.top_k if s.moe is not None else 0

    def read_routing(self, block_table: list[int], num_tokens: int) -> torch.Tensor:
        """(num_tokens, MoE layers, k) int16 on the CPU: the routing recorded at the first
        ``num_tokens`` positions of a sequence with ``block_table``."""
        bs = self.block_size
        pos = torch.arange(num_tokens)
        slots = torch.tensor(block_table, dtype=torch.long)[pos // bs] * bs + pos % bs
        return self.routing_pool.index_select(0, slots.to(self.device)).cpu()

    def free_kv(self) -> None:
        self.k_cache = self.v_cache = self._kbuf = self._vbuf = self._layer_bufs = (
            self._last_batch
        ) = self.routing_pool = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        bs = self.block_size
        off = torch.arange(bs)
        src = (
            (torch.tensor([p[0] for p in pairs]).unsqueeze(1) * bs + off).flatten().to(self.device)
        )
        dst = (
            (torch.tensor([p[1] for p in pairs]).unsqueeze(1) * bs + off).flatten().to(self.device)
        )
        for cache in (self.k_cache, self.v_cache):
            cache.index_copy_(2, dst, cache.index_select(2, src))
        if self.routing_pool is not None:
            self.routing_pool.index_copy_(0, dst, self.routing_pool.index_select(0, src))
        self._last_batch = None

    # --- gather buffers (paged_attention.py) ------------------------------------------
    def _gather_buf(self, name: str, numel: int) -> torch.Tensor:
        buf = getattr(self, name)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(int(numel * 1.25) + 1, device=self.device, dtype=self.dtype)
            setattr(self, name, buf)
        return buf[:numel]

    def gather_targets(
        self, li: int, numel: int, persistent: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Where layer ``li`` gathers its K/V context: its own kept buffers, or the shared scratch
        buffers."""
        if not persistent:
            return self._gather_buf("_kbuf", numel), self._gather_buf("_vbuf", numel)
        if self._layer_bufs is None:
            self._layer_bufs = [None] * self.spec.num_layers
        if self._layer_bufs[li] is None or self._layer_bufs[li][0].numel() < numel:
            size = int(numel * 1.25) + 1
            self._layer_bufs[li] = (
                torch.empty(size, device=self.device, dtype=self.dtype),
                torch.empty(size, device=self.device, dtype=self.dtype),
            )
        kb, vb = self._layer_bufs[li]
        return kb[:numel], vb[:numel]

    # --- forward ------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, x: StepInputs, logits_index: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (float32) at ``logits_index`` (default: each sequence's last new token)."""
        logits, routed = self.model(x, self, x.last_index if logits_index is None else logits_index)
        if routed:  # at the tokens' KV slots, next to their K/V
            self.routing_pool.index_copy_(0, x.slots, torch.stack(routed, 1).to(ROUTING_DTYPE))
        return logits

    def execute(
        self, seqs: list[Sequence], num_tokens: list[int], all_logits: bool = False
    ) -> torch.Tensor:
        x = self.prepare(seqs, num_tokens)
        idx = torch.arange(x.input_ids.shape[0], device=self.device) if all_logits else None
        return self.forward(x, idx)


def default_inv_freq(cfg, head_dim: int) -> tuple[torch.Tensor, float]:
    rp = getattr(cfg, "rope_parameters", None) or {}
    rope_type = rp.get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(
            f"rope type {rope_type!r} needs the live model's rotary embedding (pass hf_model)"
        )
    theta = rp.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)), 1.0
