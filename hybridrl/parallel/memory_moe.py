"""The mixture-of-experts part of the memory estimate (``parallel/memory.py``): how many of a
model's parameters are routed experts, what expert parallelism leaves of them on a device, and the
activations that top-k routing saves for backward.

Notation as in ``memory.py``, plus E experts per MoE layer, k experts per token (top-k), I_e one
expert's intermediate size, L_moe MoE layers (the others keep a dense MLP of width I), I_s a
shared expert's width (Qwen2-MoE; 0 without), ``ep`` = ``Layout.ep_size``.

* parameters per MoE layer = E·3h·I_e (experts) + E·h (router) + 3h·I_s + h (shared expert and
  its gate, when present); the experts' share Ψ_e = L_moe·E·3h·I_e.
* states: the dense part (Ψ − Ψ_e) as for a dense model over N ranks. The experts are split over
  the ``ep`` ranks of an EP group (Ψ_e / ep each), and whatever ZeRO shards is sharded further
  over the N / ep ranks that hold the same experts: with ``full`` sharding Ψ_e / N per device
  either way, so EP saves state only where a term is replicated (``none``, and the weights of
  ``optim`` / ``grad_op``).
* workspace (``full``): one layer gathered holds its dense parameters and E / ep experts.
* activations per MoE layer and token, in place of the dense MLP's 4a·I: each of the k (token,
  expert) pairs saves the expert's input row and its weighted output (2a·h) and the expert MLP's
  four intermediates (4a·I_e); the router saves its logits and fp32 probabilities ((a + 4)·E).
  A shared expert adds 4a·I_s. With EP the rows a rank computes are those routed to its experts:
  the same count on average when the load is even, more on a rank whose experts are busier (the
  estimate assumes an even load).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class MoECost:
    """The mixture-of-experts dimensions of a decoder (see the module docstring)."""

    count: int  # E
    top_k: int  # k
    inter: int  # I_e
    moe_layers: int  # L_moe
    shared_inter: int = 0  # I_s

    @classmethod
    def of(cls, shape) -> MoECost:
        """From the model spec's :class:`~hybridrl.models.spec.MoEShape`."""
        return cls(
            count=shape.num_experts,
            top_k=shape.top_k,
            inter=shape.intermediate,
            moe_layers=shape.moe_layers,
            shared_inter=shape.shared_intermediate,
        )

    def layer_params(self, hidden: int) -> int:
        """One MoE layer's MLP: experts, router, shared expert and its gate."""
        shared = 3 * hidden * self.shared_inter + hidden if self.shared_inter else 0
        return self.count * 3 * hidden * self.inter + self.count * hidden + shared

    def expert_params(self, hidden: int) -> int:
        """Ψ_e: the routed experts' parameters over all MoE layers."""
        return self.moe_layers * self.count * 3 * hidden * self.inter

    def mlp_activation(self, hidden: int, a: int) -> int:
        """Bytes per token saved by one MoE layer's MLP for backward."""
        k = self.top_k
        return (
            k * (2 * a * hidden + 4 * a * self.inter)
            + (a + 4) * self.count
            + 4 * a * (self.shared_inter)
        )

    def check_ep(self, ep_size: int, world_size: int) -> None:
        if ep_size > 1 and (world_size % ep_size or self.count % ep_size):
            raise ValueError(
                f"ep_size {ep_size} must divide the world size ({world_size}) and the experts "
                f"per layer ({self.count})"
            )


def split_states(bytes_dense: float, bytes_experts: float, shards: int, layout) -> int:
    """Per-device bytes of one state term: the dense part over ``shards`` ranks (1: replicated,
    N: sharded), the experts' part over ``ep`` and, where the term is sharded, the remaining
    N / ep."""
    ep = layout.ep_size
    expert_shards = ep * (layout.world_size // ep if shards > 1 else 1)
    return math.ceil(bytes_dense / shards) + math.ceil(bytes_experts / expert_shards)
