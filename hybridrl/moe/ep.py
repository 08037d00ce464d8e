"""Expert parallelism (``moe.ep_size``): each rank of an EP group holds E / ep_size of a layer's
experts, and every MoE layer sends each (token, expert) pair to the rank that owns the expert and
brings the result back.

The transformers experts module (``mlp.experts``: fused ``gate_up_proj`` (E, 2I, H) and
``down_proj`` (E, H, I), ``forward(hidden_states, top_k_index, top_k_weights)``) keeps its class,
its parameter names and the router in front of it; :func:`install` only replaces its two
parameters by DTensors sharded on dim 0 over the EP mesh dimension (rank r of the group holds
experts ``r·E/ep .. (r+1)·E/ep - 1``) and its ``forward`` by :class:`ExpertParallelForward`:

1. **plan**: the (token, slot) pairs sorted by expert; their counts per expert exchanged with one
   small all-to-all, so that every rank knows how many rows it sends to and receives from each
   rank (uneven splits);
2. **dispatch**: the hidden states of the sorted pairs, all-to-all to the owners' ranks;
3. **compute**: each local expert runs its two matmuls on the rows it received, grouped by
   expert (the module's own ``_apply_gate`` joins gate and up, so the family's activation is
   kept);
4. **combine**: the outputs all-to-all back (the reverse splits), weighted by the router's
   top-k weights on the token's own rank and summed per token.

Both exchanges are :class:`AllToAll`, an autograd function whose backward is the reverse
all-to-all, so the gradient of an expert's weights sums the contributions of every rank's tokens,
each already scaled by the global loss normalisation (``learner/update.py``): with FSDP summing
over the remaining data-parallel dimension, the sum over all ranks is the single-process gradient.
The router's weights multiply on the token's rank, so its gradient never crosses ranks.

Every rank of an EP group must call every MoE layer's forward and backward the same number of times
(the learner's dummy micro-batches keep FSDP's collectives in step, which covers these too).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

# the fused experts parameters of transformers' MoE experts modules, by name
EXPERT_PARAMS = ("gate_up_proj", "down_proj")


# --- config -------------------------------------------------------------------------------------
def check_ep_size(ep_size: int, dp_size: int, n_experts: int | None) -> None:
    """``moe.ep_size`` must divide the learner's data-parallel size (its world size / actor.pp_size)
    and the number of experts (None: unknown, not checked); raises ValueError naming the values
    and what is allowed."""
    if ep_size == 1:
        return
    if ep_size < 1 or dp_size % ep_size:
        allowed = [d for d in range(1, dp_size + 1) if dp_size % d == 0]
        raise ValueError(
            f"moe.ep_size={ep_size} must divide the learner's data-parallel size {dp_size} "
            f"(world size / actor.pp_size; allowed: {', '.join(map(str, allowed))})"
        )
    if n_experts is not None and n_experts % ep_size:
        allowed = [d for d in range(1, dp_size + 1) if dp_size % d == 0 and n_experts % d == 0]
        raise ValueError(
            f"moe.ep_size={ep_size} must divide the number of experts per layer {n_experts} "
            f"(allowed with data-parallel size {dp_size}: {', '.join(map(str, allowed))})"
        )


def experts_per_layer(cfg) -> int | None:
    """The configured model's experts per MoE layer: the built-in's, or its config's as the model
    spec reads it (None when unreadable or dense)."""
    from hybridrl.models.factory import MOE_SIZES

    if cfg.model.path is None:
        return MOE_SIZES.get(cfg.model.name, {}).get("num_experts")
    from transformers import AutoConfig

    from hybridrl.models.spec import ModelSpec

    try:
        config = AutoConfig.from_pretrained(cfg.model.path, local_files_only=True)
        moe = ModelSpec.from_config(config).moe
    except (OSError, ValueError):
        return None
    return moe.num_experts if moe is not None else None


def check_config(cfg) -> None:
    """``moe.ep_size`` against the rest of the config (before any work): the learner's
    data-parallel size (world size / ``actor.pp_size``) and the model's experts must divide by it.
    Raises ValueError."""
    ep = cfg.moe.ep_size
    if ep <= 1:
        return
    pool = cfg.controller.pools[cfg.controller.placement["learner"]]
    world = pool.nodes * pool.workers_per_node
    check_ep_size(ep, world // max(cfg.actor.pp_size, 1), experts_per_layer(cfg))


# --- the exchange -------------------------------------------------------------------------------
class AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` with uneven splits along dim 0 and a gradient: the backward sends
    each row's gradient back to the rank it came from (the same exchange with the splits swapped).
    Works on gloo (CPU) and NCCL."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        dx = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(dx, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return dx, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group):
    return AllToAll.apply(x, out_splits, in_splits, group)


class Routes:
    """Where the (token, slot) pairs of one forward go: ``token`` (M,) each sorted pair's token,
    ``weight`` (M,) its router weight, ``send`` / ``recv`` the rows per peer rank, ``local``
    (ep, E_local) the received rows per (source rank, local expert)."""

    def __init__(self, top_k_index, top_k_weights, n_experts: int, ep: int, group):
        k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        self.token = order // k
        self.weight = top_k_weights.reshape(-1)[order]
        counts = torch.bincount(flat, minlength=n_experts)
        got = torch.empty_like(counts)
        dist.all_to_all_single(got, counts, group=group)  # even splits: E_local counts per peer
        per_local = n_experts // ep
        self.send = counts.view(ep, per_local).sum(1).tolist()
        self.local = got.view(ep, per_local)
        self.recv = self.local.sum(1).tolist()


def run_local_experts(module: nn.Module, x: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """The received rows ``x`` (ordered by source rank, then local expert) through their experts,
    returned in the same order. The experts' weights are this rank's shards (``to_local``)."""
    gate_up = _local(module.gate_up_proj)
    down = _local(module.down_proj)
    per_local = local.shape[1]
    expert_of_row = torch.arange(per_local, device=x.device).repeat(local.shape[0])
    expert_of_row = torch.repeat_interleave(expert_of_row, local.reshape(-1).to(x.device))
    regroup = torch.argsort(expert_of_row, stable=True)
    grouped = x[regroup]
    outs, start = [], 0
    for j, n in enumerate(local.sum(0).tolist()):
        if n:
            rows = grouped[start : start + n]
            outs.append(F.linear(module._apply_gate(F.linear(rows, gate_up[j])), down[j]))
            start += n
    if not outs:  # nothing received: keep the backward's exchange connected to this forward
        return x * 0
    out = torch.cat(outs)
    return out[torch.argsort(regroup)]


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


class ExpertParallelForward:
    """The replacement ``forward`` of one experts module under expert parallelism (see the module
    docstring); ``group`` is the EP process group."""

    def __init__(self, module: nn.Module, group, ep: int, n_experts: int):
        self.module, self.group, self.ep, self.n_experts = module, group, ep, n_experts
        self.sent_rows, self.received_rows = 0, 0  # since the last :func:`pop_traffic`

    def __call__(self, hidden_states, top_k_index, top_k_weights):
        routes = Routes(top_k_index, top_k_weights, self.n_experts, self.ep, self.group)
        self.sent_rows += len(routes.token)
        self.received_rows += sum(routes.recv)
        rows = all_to_all(hidden_states[routes.token], routes.recv, routes.send, self.group)
        out = run_local_experts(self.module, rows, routes.local)
        back = all_to_all(out, routes.send, routes.recv, self.group)
        weighted = back * routes.weight[:, None].to(back.dtype)
        final = torch.zeros_like(hidden_states)
        return final.index_add(0, routes.token, weighted.to(final.dtype))


# --- installing ---------------------------------------------------------------------------------
def experts_modules(model: nn.Module) -> list[nn.Module]:
    """The fused experts modules (transformers' MoE ``mlp.experts``), in layer order."""
    found = []
    for m in model.modules():
        params = [getattr(m, name, None) for name in EXPERT_PARAMS]
        if all(isinstance(p, nn.Parameter) and p.dim() == 3 for p in params):
            found.append(m)
    return found


def _check_layout(module: nn.Module) -> None:
    """Expert parallelism splits dim 0 of the standard fused layout: (E, 2I, H) and (E, H, I),
    no bias."""
    if getattr(module, "is_transposed", False) or getattr(module, "has_bias", False):
        raise ValueError(
            f"{type(module).__name__}: expert parallelism supports the fused (E, 2I, H) / "
            "(E, H, I) experts without bias (Qwen2-MoE, Qwen3-MoE, Mixtral)"
        )
    if not hasattr(module, "_apply_gate"):
        raise ValueError(f"{type(module).__name__}: no _apply_gate (not a transformers experts)")


def install(model: nn.Module, ep_mesh, ep: int) -> list[nn.Module]:
    """Shard every experts module of ``model`` over ``ep_mesh`` (1-D, the EP dimension of the
    learner's mesh) and give it the dispatching forward; returns the modules. Every rank must
    hold the same full weights (the built-in models are seeded, checkpoints are read alike)."""
    from torch.distributed.tensor import DTensor, Shard

    modules = experts_modules(model)
    if not modules:
        raise ValueError(f"moe.ep_size={ep}: {type(model).__name__} has no fused experts module")
    rank = ep_mesh.get_local_rank()
    group = ep_mesh.get_group()
    for module in modules:
        _check_layout(module)
        n_experts = module.gate_up_proj.shape[0]
        check_ep_size(ep, ep, n_experts)
        per_rank = n_experts // ep
        for name in EXPERT_PARAMS:
            full = getattr(module, name)
            mine = full.detach()[rank * per_rank : (rank + 1) * per_rank].clone()
            shard = DTensor.from_local(mine, ep_mesh, [Shard(0)], run_check=False)
            setattr(module, name, nn.Parameter(shard, requires_grad=full.requires_grad))
        forward = ExpertParallelForward(module, group, ep, n_experts)
        module.forward = forward
        module.hybridrl_ep = forward
    return modules


def pop_traffic(model: nn.Module) -> tuple[int, int]:
    """Rows this rank sent and received through the EP exchanges since the last call (all
    layers)."""
    sent = received = 0
    for m in experts_modules(model):
        d = getattr(m, "hybridrl_ep", None)
        if d is not None:
            sent, received = sent + d.sent_rows, received + d.received_rows
            d.sent_rows = d.received_rows = 0
    return sent, received


def traffic_metrics(model: nn.Module) -> dict[str, float]:
    """The EP exchanges since the last call, as step metrics: ``perf/ep_rows_sent`` and
    ``perf/ep_rows_received`` (per rank, mean over ranks; a row is one (token, expert) pair) and
    ``perf/ep_received_imbalance`` (max / mean - 1 of the rows each rank computed: how much longer
    the busiest rank's experts ran). ``{}`` for a model without EP; a collective otherwise (every
    rank of the learner calls it)."""
    if not any(hasattr(m, "hybridrl_ep") for m in experts_modules(model)):
        return {}
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, pop_traffic(model))
    recv = [r for _, r in per_rank]
    mean = sum(recv) / len(recv)
    return {
        "perf/ep_rows_sent": sum(s for s, _ in per_rank) / len(per_rank),
        "perf/ep_rows_received": mean,
        "perf/ep_received_imbalance": max(recv) / mean - 1 if mean else 0.0,
    }
