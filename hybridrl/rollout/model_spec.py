"""What the native runner needs to know about a model, read from its transformers config.

Decoder families differ only in a few switches (biases on the attention projections, a norm on q
and k) and in their MLP: dense, or a mixture of experts (``moe_block.py``). Each supported
``model_type`` is one entry of :data:`DECODER_FAMILIES`; adding a family is adding an entry. The
engine's one model definition (``decoder.py``) reads only the :class:`ModelSpec` built here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybridrl.rollout.moe_block import MOE_FAMILIES, MoEShape


def _flag(name: str, default: bool = False) -> Callable[[object], bool]:
    return lambda cfg: bool(getattr(cfg, name, default))


def _never(cfg) -> bool:
    return False


@dataclass(frozen=True)
class DecoderFamily:
    """The attention switches of one ``model_type``."""

    attn_bias: Callable[[object], bool]  # q/k/v projections carry a bias
    o_bias: Callable[[object], bool]  # the output projection carries a bias
    qk_norm: bool  # RMSNorm on each head's q and k (Qwen3)
    mlp_bias: Callable[[object], bool] = _flag("mlp_bias")


# model_type -> attention switches; the MLP is dense unless MOE_FAMILIES lists the type
DECODER_FAMILIES: dict[str, DecoderFamily] = {
    "qwen2": DecoderFamily(lambda cfg: True, _never, qk_norm=False),
    "qwen3": DecoderFamily(_flag("attention_bias"), _flag("attention_bias"), qk_norm=True),
    "llama": DecoderFamily(_flag("attention_bias"), _flag("attention_bias"), qk_norm=False),
    "qwen2_moe": DecoderFamily(_flag("qkv_bias", True), _never, qk_norm=False),
    "qwen3_moe": DecoderFamily(_flag("attention_bias"), _flag("attention_bias"), qk_norm=True),
    "mixtral": DecoderFamily(_never, _never, qk_norm=False),
}


@dataclass
class ModelSpec:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_eps: float
    tie_word_embeddings: bool
    attn_bias: bool
    mlp_bias: bool
    qk_norm: bool
    o_bias: bool
    max_positions: int
    moe: MoEShape | None = None  # None: every layer has a dense MLP

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe.sparse_layers) if self.moe is not None else 0

    def is_sparse(self, layer: int) -> bool:
        return self.moe is not None and self.moe.sparse_layers[layer]

    @staticmethod
    def from_config(cfg) -> ModelSpec:
        mt = getattr(cfg, "model_type", "")
        family = DECODER_FAMILIES.get(mt)
        if family is None:
            raise ValueError(
                f"native rollout supports {', '.join(sorted(DECODER_FAMILIES))} models, not {mt!r}"
            )
        heads = cfg.num_attention_heads
        moe = MOE_FAMILIES[mt](cfg) if mt in MOE_FAMILIES else None
        return ModelSpec(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            intermediate_size=cfg.intermediate_size,
            rms_eps=cfg.rms_norm_eps,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            attn_bias=family.attn_bias(cfg),
            mlp_bias=family.mlp_bias(cfg),
            qk_norm=family.qk_norm,
            o_bias=family.o_bias(cfg),
            max_positions=getattr(cfg, "max_position_embeddings", 4096),
            moe=moe if moe is not None and any(moe.sparse_layers) else None,
        )


def default_inv_freq(cfg, head_dim: int) -> tuple[torch.Tensor, float]:
    rp = getattr(cfg, "rope_parameters", None) or {}
    rope_type = rp.get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(
            f"rope type {rope_type!r} needs the live model's rotary embedding (pass hf_model)"
        )
    theta = rp.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)), 1.0
