"""Load balancing of the experts: two auxiliary losses and the auxiliary-loss-free bias.

* :func:`switch_aux_loss` (Switch Transformer): per layer ``E * sum_e f_e * P_e`` with ``f_e`` the
  fraction of the layer's (token, slot) assignments that went to expert ``e`` and ``P_e`` the mean
  router probability of ``e``. ``f`` is a count (no gradient); the gradient flows through ``P``,
  pushing probability away from busy experts. It is 1 for a perfectly even router.
* :func:`router_z_loss` (ST-MoE): the mean of ``logsumexp(logits)^2``, which keeps router logits
  small (bf16-friendly) without changing which expert wins.
* :class:`ExpertBias` (DeepSeek-V3's auxiliary-loss-free balancing): a per-expert bias added to the
  router probabilities *for selection only*; the dispatch weights still come from the unbiased
  probabilities (:func:`~hybridrl.moe.routing.gate_weights`). After every optimizer step the bias
  moves by ``rate * sign(mean load - load)``: overloaded experts become less likely to be picked,
  idle ones more. It touches no gradient.

The bias is a non-trainable parameter ``expert_bias`` of each router, so it travels with the
weights: it is sharded with its layer, saved in checkpoints, and sent to the rollout by weight sync
(the ``hf`` backend attaches it on first receipt), where it shapes the routing the rollout records.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridrl.moe.routing import gate_layers, gate_weights, moe_gates

BIAS_NAME = "expert_bias"


def switch_aux_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """One layer's Switch load-balancing loss over tokens ``logits`` (N, E) dispatched to ``ids``
    (N, k); 0 for no tokens."""
    n_experts = logits.shape[-1]
    if logits.shape[0] == 0:
        return logits.sum() * 0.0
    counts = torch.bincount(ids.reshape(-1).long(), minlength=n_experts).to(torch.float32)
    fraction = counts / counts.sum()
    mean_prob = torch.softmax(logits.float(), dim=-1).mean(0)
    return n_experts * (fraction * mean_prob).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """One layer's router z-loss over tokens ``logits`` (N, E); 0 for no tokens."""
    if logits.shape[0] == 0:
        return logits.sum() * 0.0
    return torch.logsumexp(logits.float(), dim=-1).pow(2).mean()


def _biased_selection(gate: nn.Module, args, out: tuple) -> tuple:
    """Forward hook: re-select the top-k with the gate's bias added to the probabilities; the
    weights of the chosen experts come from the unbiased probabilities."""
    logits = out[0]
    scores = torch.softmax(logits.float(), dim=-1) + getattr(gate, BIAS_NAME).float()
    ids = scores.topk(gate.top_k, dim=-1).indices
    return logits, gate_weights(gate, logits, ids), ids


def attach_bias(gate: nn.Module) -> nn.Parameter:
    """Give ``gate`` a zero ``expert_bias`` (no gradient) and the hook that selects with it;
    idempotent."""
    if hasattr(gate, BIAS_NAME):
        return getattr(gate, BIAS_NAME)
    weight = gate.weight
    bias = nn.Parameter(
        torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device),
        requires_grad=False,
    )
    gate.register_parameter(BIAS_NAME, bias)
    # registered before any recording or replay hook: those see the biased choice
    gate.register_forward_hook(_biased_selection)
    return bias


def attach_biases(model: nn.Module) -> None:
    for gate in moe_gates(model):
        attach_bias(gate)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor of ``t``'s local values (a sharded DTensor's own shard)."""
    return t.to_local() if hasattr(t, "to_local") else t


class ExpertBias:
    """The bias update of every router of a model (or of the part a pipeline rank holds).
    ``loads`` (layers of the whole model, E) are the tokens each expert received since the last
    update (summed over ranks by the caller)."""

    def __init__(self, model: nn.Module, rate: float):
        self.gates = gate_layers(model)
        self.rate = rate

    @staticmethod
    def delta(loads: torch.Tensor, rate: float) -> torch.Tensor:
        """``rate * sign(mean load - load)`` per layer and expert."""
        loads = loads.to(torch.float32)
        return rate * torch.sign(loads.mean(-1, keepdim=True) - loads)

    @torch.no_grad()
    def update(self, loads: torch.Tensor) -> None:
        step = self.delta(loads, self.rate)
        for layer, gate in self.gates:
            bias = getattr(gate, BIAS_NAME)
            full = step[layer].to(_local(bias).device)
            local = _local(bias)
            if local.shape != full.shape:  # a shard of the experts: this rank's slice
                offset = _shard_offset(bias)
                full = full[offset : offset + local.shape[0]]
            local.add_(full)

    def values(self) -> torch.Tensor:
        """(layers held, E): the current biases of the routers held, in layer order (full,
        gathered when sharded)."""
        out = []
        for _, gate in self.gates:
            bias = getattr(gate, BIAS_NAME)
            full = bias.full_tensor() if hasattr(bias, "full_tensor") else bias
            out.append(full.detach().float().cpu())
        return torch.stack(out)


def _shard_offset(t) -> int:
    """The first row of a dim-0-sharded DTensor held by this rank (torch's chunking: ceil-sized
    chunks in rank order)."""
    mesh = t.device_mesh
    rank, size = mesh.get_local_rank(), mesh.size()
    chunk = -(-t.shape[0] // size)
    return min(rank * chunk, t.shape[0])
