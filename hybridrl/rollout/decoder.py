"""The native engine's model: one decoder definition for every supported family (Qwen2, Qwen3,
Llama, Qwen2-MoE, Qwen3-MoE, Mixtral), built from a :class:`~hybridrl.models.spec.ModelSpec`.

The families differ only through the spec's switches (biases, q/k norm, which layers are MoE
blocks and how their routers normalise), so there is one ``CausalLM`` and no class per family. The
module tree mirrors transformers' (``model.embed_tokens``, ``model.layers.{i}.self_attn``,
``model.layers.{i}.mlp``, ``model.norm``, ``lm_head``), with q/k/v packed into ``qkv_proj`` and
gate/up into ``gate_up_proj``: a parameter's name is its transformers name once the packed module
replaces the original one (``weights.py`` maps between the two).

The model holds parameters and the forward; the KV pool, the routing pool and the step's inputs
belong to the runner (``model_runner.py``), which passes itself as the pool.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridrl.models.spec import ModelSpec
from hybridrl.rollout.layers import (
    MLP,
    Attention,
    Embedding,
    EngineModule,
    Linear,
    RMSNorm,
    mirror_attributes,
)
from hybridrl.rollout.moe_block import MoEBlock


class DecoderLayer(EngineModule):
    def __init__(self, spec: ModelSpec, index: int, *, device, dtype):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        H = spec.hidden_size
        self.input_layernorm = RMSNorm(H, spec.rms_eps, **kw)
        self.self_attn = Attention(spec, index, **kw)
        self.post_attention_layernorm = RMSNorm(H, spec.rms_eps, **kw)
        self.sparse = spec.is_sparse(index)
        self.mlp = (
            MoEBlock(spec.moe, H, **kw)
            if self.sparse
            else MLP(H, spec.intermediate_size, bias=spec.mlp_bias, **kw)
        )

    def forward(self, h: torch.Tensor, x, pool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The residual stream after this layer, and the experts each token chose (MoE layers)."""
        h = self.self_attn(self.input_layernorm(h), h, x, pool)
        if self.sparse:
            out, ids = self.mlp(self.post_attention_layernorm(h))
            return h.add_(out), ids
        return self.mlp(self.post_attention_layernorm(h), h), None


class DecoderModel(EngineModule):
    def __init__(self, spec: ModelSpec, *, device, dtype):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.embed_tokens = Embedding(spec.vocab_size, spec.hidden_size, **kw)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, **kw) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_eps, **kw)


class CausalLM(EngineModule):
    """Decoder and head; ``forward`` runs one engine step over the runner's paged KV pool."""

    def __init__(self, spec: ModelSpec, *, device, dtype):
        super().__init__()
        self.spec = spec
        self.model = DecoderModel(spec, device=device, dtype=dtype)
        self.lm_head = Linear(
            spec.hidden_size, spec.vocab_size, bias=False, device=device, dtype=dtype
        )
        if spec.tie_word_embeddings:  # one parameter under both names
            self.lm_head.weight = self.model.embed_tokens.weight
        mirror_attributes(self)

    def forward(
        self, x, pool, logits_index: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Logits (float32) at the flat token indices ``logits_index`` of the step inputs ``x``,
        and each MoE layer's (T, k) expert ids."""
        m = self.model
        h = m.embed_tokens(x.input_ids)
        routed = []
        for layer in m.layers:
            h, ids = layer(h, x, pool)
            if ids is not None:
                routed.append(ids)
        return self.lm_head(m.norm(h[logits_index])).float(), routed
