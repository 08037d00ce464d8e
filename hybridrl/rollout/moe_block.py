"""The native engine's mixture-of-experts block (Qwen3-MoE, Qwen2-MoE, Mixtral).

A block holds its weights as plain tensors under their transformers names, like the rest of the
runner: the router ``mlp.gate.weight`` (E, H), the fused experts ``mlp.experts.gate_up_proj``
(E, 2I, H) and ``mlp.experts.down_proj`` (E, H, I), and, for Qwen2-MoE, a shared expert (gate and
up fused into one (2S, H) matrix, as in the dense MLP) whose output is scaled by
``sigmoid(shared_expert_gate(x))``.

Routing follows each family's router exactly (so the recorded ids are the ones transformers would
pick): softmax over the router logits in fp32, top-k, the top-k weights renormalised to sum 1 when
the family does (:class:`MoEFamily`). An ``expert_bias`` sent by weight sync (the trainer's
auxiliary-loss-free balancing, ``hybridrl/moe/balance.py``) is added to the probabilities for the
*selection* only; the dispatch weights stay the unbiased probabilities.

Dispatch groups the step's (token, slot) assignments by expert with one stable sort and runs each
expert that got tokens as two matmuls over its contiguous slice (the flat token batch never pads to
the busiest expert), written straight into two step buffers, with one SiLU-and-product over all
slices in between. The experts' matrices are stored transposed, (E, H, 2I) and (E, I, H), so each
slice is a plain row-major product: on a CPU that runs 10 to 40 % faster than the transposed
product ``F.linear`` does, at the few rows per expert of a decode step; the transformers-shaped
names are views of them. Each token then sums its k weighted expert outputs with one ``index_add_``
where that sum is reproducible (on a CPU it adds in index order; on a GPU, with k <= 2, the two
terms added to zero commute), and otherwise in slot order after undoing the sort.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

BIAS_NAME = "expert_bias"


@dataclass(frozen=True)
class MoEShape:
    """One model's MoE layout, read from its transformers config."""

    num_experts: int
    top_k: int
    intermediate: int  # of each routed expert
    shared_intermediate: int  # 0: no shared expert
    normalise: bool  # top-k weights divided by their sum
    cast_weights: bool  # dispatch weights cast to the activations' dtype (Qwen) or kept fp32
    sparse_layers: tuple[bool, ...]  # per decoder layer: MoE block (True) or dense MLP


def _qwen_sparse(cfg) -> tuple[bool, ...]:
    """Qwen-MoE: layer i is sparse unless listed in ``mlp_only_layers`` or off the
    ``decoder_sparse_step`` grid."""
    only = set(getattr(cfg, "mlp_only_layers", None) or ())
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    return tuple(
        i not in only and cfg.num_experts > 0 and (i + 1) % step == 0
        for i in range(cfg.num_hidden_layers)
    )


def _qwen3_moe(cfg) -> MoEShape:
    return MoEShape(
        num_experts=cfg.num_experts,
        top_k=cfg.num_experts_per_tok,
        intermediate=cfg.moe_intermediate_size,
        shared_intermediate=0,
        normalise=bool(cfg.norm_topk_prob),
        cast_weights=True,
        sparse_layers=_qwen_sparse(cfg),
    )


def _qwen2_moe(cfg) -> MoEShape:
    return MoEShape(
        num_experts=cfg.num_experts,
        top_k=cfg.num_experts_per_tok,
        intermediate=cfg.moe_intermediate_size,
        shared_intermediate=cfg.shared_expert_intermediate_size,
        normalise=bool(cfg.norm_topk_prob),  # off by default in this family
        cast_weights=True,
        sparse_layers=_qwen_sparse(cfg),
    )


def _mixtral(cfg) -> MoEShape:
    return MoEShape(
        num_experts=cfg.num_local_experts,
        top_k=cfg.num_experts_per_tok,
        intermediate=cfg.intermediate_size,
        shared_intermediate=0,
        normalise=True,  # always renormalised
        cast_weights=False,
        sparse_layers=(True,) * cfg.num_hidden_layers,
    )


# model_type -> how its config describes the experts
MOE_FAMILIES: dict[str, Callable[[object], MoEShape]] = {
    "qwen3_moe": _qwen3_moe,
    "qwen2_moe": _qwen2_moe,
    "mixtral": _mixtral,
}


class MoEBlock:
    """One decoder layer's sparse MLP over a flat (T, H) batch of normalised hidden states."""

    def __init__(self, shape: MoEShape, hidden: int, *, device, dtype):
        kw = dict(device=device, dtype=dtype)
        E, inter, S = shape.num_experts, shape.intermediate, shape.shared_intermediate
        self.shape = shape
        self.router = torch.zeros(E, hidden, **kw)
        # transposed for row-major products (module docstring); gate_up / down: the hf layout
        self.gate_up_t = torch.zeros(E, hidden, 2 * inter, **kw)
        self.down_t = torch.zeros(E, inter, hidden, **kw)
        self.gate_up = self.gate_up_t.transpose(1, 2)  # (E, 2I, H) view
        self.down = self.down_t.transpose(1, 2)  # (E, H, I) view
        self.bias = torch.zeros(E, device=device, dtype=torch.float32)
        self.has_bias = False  # set once weight sync sends an expert bias
        self.shared_gu = torch.zeros(2 * S, hidden, **kw) if S else None
        self.shared_down = torch.zeros(hidden, S, **kw) if S else None
        self.shared_gate = torch.zeros(1, hidden, **kw) if S else None

    def name_map(self, prefix: str) -> dict[str, torch.Tensor]:
        """Live tensors by transformers name under ``prefix`` (``model.layers.{i}.mlp.``)."""
        m = {
            prefix + "gate.weight": self.router,
            prefix + "experts.gate_up_proj": self.gate_up,
            prefix + "experts.down_proj": self.down,
        }
        S = self.shape.shared_intermediate
        if S:
            m[prefix + "shared_expert.gate_proj.weight"] = self.shared_gu[:S]
            m[prefix + "shared_expert.up_proj.weight"] = self.shared_gu[S:]
            m[prefix + "shared_expert.down_proj.weight"] = self.shared_down
            m[prefix + "shared_expert_gate.weight"] = self.shared_gate
        return m

    def optional_names(self, prefix: str) -> dict[str, torch.Tensor]:
        """Weights a sync may carry but need not: the balancing bias (zero until it comes)."""
        return {prefix + "gate." + BIAS_NAME: self.bias}

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, k) expert ids and dispatch weights, as the family's router chooses them."""
        logits = F.linear(x, self.router)
        probs = torch.softmax(logits.float(), dim=-1)
        if self.has_bias:
            ids = (probs + self.bias).topk(self.shape.top_k, dim=-1).indices
            weights = probs.gather(-1, ids)
        else:
            weights, ids = probs.topk(self.shape.top_k, dim=-1)
        if self.shape.normalise:
            weights = weights / weights.sum(-1, keepdim=True)
        return ids, weights.to(x.dtype) if self.shape.cast_weights else weights

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's output (T, H) and the chosen expert ids (T, k)."""
        ids, weights = self.route(x)
        T, k = ids.shape
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.shape.num_experts).tolist()
        experts = [e for e, n in enumerate(counts) if n]
        sizes = [counts[e] for e in experts]
        xs = x.index_select(0, order // k)
        hidden = x.new_empty(T * k, self.gate_up_t.shape[2])
        for e, rows, out in zip(experts, xs.split(sizes), hidden.split(sizes)):
            torch.mm(rows, self.gate_up_t[e], out=out)
        g, u = hidden.chunk(2, -1)
        act = F.silu(g).mul_(u)
        ys = x.new_empty(T * k, x.shape[1])
        for e, rows, out in zip(experts, act.split(sizes), ys.split(sizes)):
            torch.mm(rows, self.down_t[e], out=out)
        # a reproducible sum either way (module docstring)
        out = combine(ys, weights, order, in_slot_order=x.device.type != "cpu" and k > 2)
        out = out.to(x.dtype)
        if self.shared_gu is not None:
            g, u = F.linear(x, self.shared_gu).chunk(2, -1)
            shared = F.linear(F.silu(g) * u, self.shared_down)
            out += torch.sigmoid(F.linear(x, self.shared_gate)) * shared
        return out, ids


def combine(
    ys: torch.Tensor, weights: torch.Tensor, order: torch.Tensor, *, in_slot_order: bool
) -> torch.Tensor:
    """Each token's weighted sum of its k expert outputs: ``ys`` (T * k, H) in expert-sorted order
    (``order``: the flat (token, slot) index of each row), ``weights`` (T, k). ``in_slot_order``
    undoes the sort and sums each token's slots in slot order (fixed on any device); otherwise one
    ``index_add_`` sums in sorted order (fixed on a CPU, and on a GPU for k <= 2)."""
    T, k = weights.shape
    if in_slot_order:
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return (ys.index_select(0, inverse).view(T, k, -1) * weights.unsqueeze(-1)).sum(1)
    ys = ys * weights.flatten().index_select(0, order).unsqueeze(1)
    out = torch.zeros(T, ys.shape[1], device=ys.device, dtype=ys.dtype)
    return out.index_add_(0, order // k, ys)
