"""The native engine's mixture-of-experts block (Qwen3-MoE, Qwen2-MoE, Mixtral).

A block is an ``nn.Module`` whose parameters carry their transformers names (``layers.py``): the
router ``mlp.gate.weight`` (E, H), the fused experts ``mlp.experts.gate_up_proj`` (E, 2I, H) and
``mlp.experts.down_proj`` (E, H, I), and, for Qwen2-MoE, a shared expert (the dense MLP, gate and
up packed into one projection) whose output is scaled by ``sigmoid(shared_expert_gate(x))``.

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
weights are transposed views of them (``hf_transposed``). Each token then sums its k weighted
expert outputs with one ``index_add_`` where that sum is reproducible (on a CPU it adds in index
order; on a GPU, with k <= 2, the two terms added to zero commute), and otherwise in slot order
after undoing the sort.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridrl.models.spec import MoEShape
from hybridrl.rollout.layers import MLP, EngineModule, Linear, frozen

BIAS_NAME = "expert_bias"


class Router(EngineModule):
    """The family's router: ``weight`` (E, H) under ``mlp.gate.weight``, and the balancing bias
    ``expert_bias`` (fp32, zero) that a weight sync may send; once it has, selection adds it."""

    def __init__(self, shape: MoEShape, hidden: int, *, device, dtype):
        super().__init__()
        self.shape = shape
        self.weight = frozen(shape.num_experts, hidden, fill=0.0, device=device, dtype=dtype)
        self.register_buffer(
            BIAS_NAME, torch.zeros(shape.num_experts, device=device, dtype=torch.float32)
        )
        getattr(self, BIAS_NAME).weight_loader = self._load_bias
        self.has_bias = False  # set once weight sync sends an expert bias

    def _load_bias(self, buf: torch.Tensor, tensor: torch.Tensor, shard, name: str) -> None:
        if tuple(buf.shape) != tuple(tensor.shape):
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} != {tuple(buf.shape)}")
        buf.copy_(tensor)
        self.has_bias = True  # selection now adds the bias

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, k) expert ids and dispatch weights, as the family's router chooses them."""
        probs = torch.softmax(F.linear(x, self.weight).float(), dim=-1)
        if self.has_bias:
            ids = (probs + getattr(self, BIAS_NAME)).topk(self.shape.top_k, dim=-1).indices
            weights = probs.gather(-1, ids)
        else:
            weights, ids = probs.topk(self.shape.top_k, dim=-1)
        if self.shape.normalise:
            weights = weights / weights.sum(-1, keepdim=True)
        return ids, weights.to(x.dtype) if self.shape.cast_weights else weights


class Experts(EngineModule):
    """The routed experts' matrices, stored transposed (module docstring): ``gate_up_t``
    (E, H, 2I) and ``down_t`` (E, I, H), named ``experts.gate_up_proj`` (E, 2I, H) and
    ``experts.down_proj`` (E, H, I) by transformers."""

    def __init__(self, shape: MoEShape, hidden: int, *, device, dtype):
        super().__init__()
        kw = dict(fill=0.0, device=device, dtype=dtype)
        E, inter = shape.num_experts, shape.intermediate
        self.gate_up_proj = frozen(E, hidden, 2 * inter, **kw)
        self.down_proj = frozen(E, inter, hidden, **kw)
        self.gate_up_proj.hf_transposed = self.down_proj.hf_transposed = True

    def forward(
        self, x: torch.Tensor, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every (token, slot) assignment's expert output (T * k, H), grouped by expert, and the
        flat assignment index of each row."""
        T, k = ids.shape
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()
        experts = [e for e, n in enumerate(counts) if n]
        sizes = [counts[e] for e in experts]
        xs = x.index_select(0, order // k)
        hidden = x.new_empty(T * k, self.gate_up_proj.shape[2])
        for e, rows, out in zip(experts, xs.split(sizes), hidden.split(sizes)):
            torch.mm(rows, self.gate_up_proj[e], out=out)
        g, u = hidden.chunk(2, -1)
        act = F.silu(g).mul_(u)
        ys = x.new_empty(T * k, x.shape[1])
        for e, rows, out in zip(experts, act.split(sizes), ys.split(sizes)):
            torch.mm(rows, self.down_proj[e], out=out)
        return ys, order


class MoEBlock(EngineModule):
    """One decoder layer's sparse MLP over a flat (T, H) batch of normalised hidden states."""

    def __init__(self, shape: MoEShape, hidden: int, *, device, dtype):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        S = shape.shared_intermediate
        self.shape = shape
        self.gate = Router(shape, hidden, **kw)
        self.experts = Experts(shape, hidden, **kw)
        self.shared_expert = MLP(hidden, S, bias=False, **kw) if S else None
        self.shared_expert_gate = Linear(hidden, 1, bias=False, **kw) if S else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's output (T, H) and the chosen expert ids (T, k)."""
        ids, weights = self.gate(x)
        ys, order = self.experts(x, ids)
        # a reproducible sum either way (module docstring)
        k = ids.shape[1]
        out = combine(ys, weights, order, in_slot_order=x.device.type != "cpu" and k > 2)
        out = out.to(x.dtype)
        if self.shared_expert is not None:
            out += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
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
