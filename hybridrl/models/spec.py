"""The model spec: the one reader of a decoder's transformers config. The native engine builds its
model from it, the memory estimator counts its parameters and activations, FLOP accounting counts
its matmuls; none of them reads the config's fields itself.

Decoder families differ only in a few switches (biases on the attention projections, a norm on q
and k) and in their MLP: dense, or a mixture of experts. Each family the engine runs is one entry
of :data:`DECODER_FAMILIES` (and of :data:`MOE_FAMILIES` for its experts); adding a family is
adding an entry. A config of another family is still read, by the field names most decoders share
(``attention_bias``, ``mlp_bias``, ``num_experts`` ...), with ``family`` None: the estimates work
for it, the engine refuses it (:meth:`ModelSpec.require_family`).

Fields differ between model types and may be absent or None, so each is the first of its names
that the config has and is not None.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace


def _get(cfg, *names: str, default=None):
    """The first of ``names`` that ``cfg`` has and is not None; ``default`` otherwise."""
    return next((getattr(cfg, n) for n in names if getattr(cfg, n, None) is not None), default)


def _flag(name: str, default: bool = False) -> Callable[[object], bool]:
    return lambda cfg: bool(_get(cfg, name, default=default))


def _never(cfg) -> bool:
    return False


@dataclass(frozen=True)
class DecoderFamily:
    """The attention switches of one ``model_type``, and what the learner may do with it."""

    attn_bias: Callable[[object], bool]  # q/k/v projections carry a bias
    o_bias: Callable[[object], bool]  # the output projection carries a bias
    qk_norm: bool  # RMSNorm on each head's q and k (Qwen3)
    mlp_bias: Callable[[object], bool] = _flag("mlp_bias")
    # the learner may compile its decoder layers (actor.compile): their compiled forward and
    # backward were checked against eager (tests/test_compile_layers.py)
    compiles: bool = False


# model_type -> attention switches; the MLP is dense unless MOE_FAMILIES lists the type
DECODER_FAMILIES: dict[str, DecoderFamily] = {
    "qwen2": DecoderFamily(lambda cfg: True, _never, qk_norm=False, compiles=True),
    "qwen3": DecoderFamily(_flag("attention_bias"), _flag("attention_bias"), qk_norm=True),
    "llama": DecoderFamily(_flag("attention_bias"), _flag("attention_bias"), qk_norm=False),
    "qwen2_moe": DecoderFamily(_flag("qkv_bias", True), _never, qk_norm=False),
    "qwen3_moe": DecoderFamily(_flag("attention_bias"), _flag("attention_bias"), qk_norm=True),
    "mixtral": DecoderFamily(_never, _never, qk_norm=False),
}
# a family the table does not list: the field names most decoders share
GENERIC_FAMILY = DecoderFamily(
    lambda cfg: bool(_get(cfg, "attention_bias", "qkv_bias", default=False)),
    _flag("attention_bias"),
    qk_norm=False,
)


@dataclass(frozen=True)
class MoEShape:
    """One model's mixture-of-experts layout."""

    num_experts: int
    top_k: int
    intermediate: int  # of each routed expert
    shared_intermediate: int  # 0: no shared expert
    normalise: bool  # top-k weights divided by their sum
    sparse_layers: tuple[bool, ...]  # per decoder layer: MoE block (True) or dense MLP
    cast_weights: bool = True  # dispatch weights cast to the activations' dtype (Qwen) or fp32

    @property
    def moe_layers(self) -> int:
        return sum(self.sparse_layers)


def _qwen_sparse(cfg, experts: int) -> tuple[bool, ...]:
    """Qwen-MoE: layer i is sparse unless listed in ``mlp_only_layers`` or off the
    ``decoder_sparse_step`` grid."""
    only = set(getattr(cfg, "mlp_only_layers", None) or ())
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    return tuple(
        i not in only and experts > 0 and (i + 1) % step == 0 for i in range(cfg.num_hidden_layers)
    )


def _qwen_moe(cfg) -> MoEShape:
    """Qwen3-MoE and Qwen2-MoE (which adds a shared expert, and leaves norm_topk_prob off by
    default)."""
    return MoEShape(
        num_experts=cfg.num_experts,
        top_k=cfg.num_experts_per_tok,
        intermediate=cfg.moe_intermediate_size,
        shared_intermediate=_get(cfg, "shared_expert_intermediate_size", default=0),
        normalise=bool(cfg.norm_topk_prob),
        sparse_layers=_qwen_sparse(cfg, cfg.num_experts),
    )


def _mixtral(cfg) -> MoEShape:
    return MoEShape(
        num_experts=cfg.num_local_experts,
        top_k=cfg.num_experts_per_tok,
        intermediate=cfg.intermediate_size,
        shared_intermediate=0,
        normalise=True,  # always renormalised
        sparse_layers=(True,) * cfg.num_hidden_layers,
    )


def _generic_moe(cfg) -> MoEShape | None:
    """The experts of a config the table does not list, by the Qwen-MoE / Mixtral field names;
    None for a dense one."""
    if _get(cfg, "n_routed_experts"):
        raise ValueError(
            "DeepSeek-style configs (n_routed_experts) are not supported; Qwen2-MoE, Qwen3-MoE "
            "and Mixtral are"
        )
    count = int(_get(cfg, "num_experts", "num_local_experts", default=0) or 0)
    if not count:
        return None
    return MoEShape(
        num_experts=count,
        top_k=int(_get(cfg, "num_experts_per_tok", default=2)),
        intermediate=int(_get(cfg, "moe_intermediate_size", "intermediate_size")),
        shared_intermediate=int(_get(cfg, "shared_expert_intermediate_size", default=0)),
        normalise=bool(_get(cfg, "norm_topk_prob", default=True)),
        sparse_layers=_qwen_sparse(cfg, count),
    )


@dataclass(frozen=True)
class MoEFamily:
    """One family's mixture of experts: how its config describes the experts, and its router, the
    transformers module (``mlp.gate``) whose top-k choice the routing hooks read and replace
    (``moe/routing.py``)."""

    shape: Callable[[object], MoEShape]
    router: str  # the router's class name
    # whether the router divides its top-k probabilities by their sum, read from the router
    normalises: Callable[[object], bool]
    cast_weights: bool  # dispatch weights cast to the router logits' dtype (Qwen) or kept fp32


def _router_flag(router) -> bool:
    return bool(router.norm_topk_prob)


# model_type -> its experts and router
MOE_FAMILIES: dict[str, MoEFamily] = {
    "qwen3_moe": MoEFamily(_qwen_moe, "Qwen3MoeTopKRouter", _router_flag, cast_weights=True),
    "qwen2_moe": MoEFamily(_qwen_moe, "Qwen2MoeTopKRouter", _router_flag, cast_weights=True),
    "mixtral": MoEFamily(_mixtral, "MixtralTopKRouter", lambda router: True, cast_weights=False),
}
# a router's class name -> its family; a class not listed here is not recognised as a router
ROUTER_FAMILIES: dict[str, MoEFamily] = {f.router: f for f in MOE_FAMILIES.values()}


@dataclass(frozen=True)
class ModelSpec:
    """A decoder's shape and switches (module docstring)."""

    model_type: str
    family: str | None  # model_type when DECODER_FAMILIES lists it, else None
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
        return self.moe.moe_layers if self.moe is not None else 0

    def is_sparse(self, layer: int) -> bool:
        return self.moe is not None and self.moe.sparse_layers[layer]

    def require_family(self, who: str) -> ModelSpec:
        """This spec, when its family is one the table lists; else ValueError naming them."""
        if self.family is None:
            raise ValueError(
                f"{who} supports {', '.join(sorted(DECODER_FAMILIES))} models, not "
                f"{self.model_type!r}"
            )
        return self

    @staticmethod
    def from_config(cfg) -> ModelSpec:
        """The spec of a transformers ``PretrainedConfig`` (or any object with its fields)."""
        h, layers, heads = (
            _get(cfg, "hidden_size"),
            _get(cfg, "num_hidden_layers"),
            _get(cfg, "num_attention_heads"),
        )
        inter, vocab = _get(cfg, "intermediate_size"), _get(cfg, "vocab_size")
        if None in (h, layers, heads, inter, vocab):
            raise ValueError(
                "config lacks hidden_size / num_hidden_layers / num_attention_heads / "
                "intermediate_size / vocab_size"
            )
        mt = getattr(cfg, "model_type", "") or ""
        family = DECODER_FAMILIES.get(mt, GENERIC_FAMILY)
        experts = MOE_FAMILIES.get(mt)
        if experts is not None:
            moe = replace(experts.shape(cfg), cast_weights=experts.cast_weights)
        else:
            moe = _generic_moe(cfg)
        return ModelSpec(
            model_type=mt,
            family=mt if mt in DECODER_FAMILIES else None,
            vocab_size=vocab,
            hidden_size=h,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=_get(cfg, "num_key_value_heads", default=heads),
            head_dim=_get(cfg, "head_dim", default=h // heads),
            intermediate_size=inter,
            rms_eps=_get(cfg, "rms_norm_eps", default=1e-6),
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            attn_bias=family.attn_bias(cfg),
            mlp_bias=family.mlp_bias(cfg),
            qk_norm=family.qk_norm,
            o_bias=family.o_bias(cfg),
            max_positions=_get(cfg, "max_position_embeddings", default=4096),
            moe=moe if moe is not None and any(moe.sparse_layers) else None,
        )
