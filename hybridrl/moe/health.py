"""Routing health: is every expert used, is any layer collapsing onto a few experts, and how stable
is the routing from one policy version to the next and from the rollout to the trainer.

Per layer and step (``moe/layer<l>/...``): each expert's share of the (token, slot) assignments
(``load/<e>``), the busiest expert's load over the mean (``max_mean``: 1 is perfectly even, E/k
means every token goes to the same k experts), the entropy of the load distribution in nats
(``load_entropy``, at most ln E) and the number of experts that got no token (``empty``). Over all
layers: the worst ``moe/max_mean``, ``moe/empty_experts`` in total and the routing-change fractions
(computed by the caller, :mod:`hybridrl.learner.moe`).

Alerts: a layer whose ``max_mean`` passes ``moe.health_max_mean_threshold``, or an expert that has
been empty ``moe.health_empty_steps`` steps in a row, logs a warning and sets
``moe/alert_imbalance`` / ``moe/alert_dead_expert`` to 1 for that step.
"""

from __future__ import annotations

import logging
import math

import torch

log = logging.getLogger(__name__)


def load_stats(counts: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per layer of ``counts`` (layers, E): ``fraction`` (layers, E), ``max_mean``, ``entropy`` and
    ``empty`` (layers,). A layer with no tokens has fraction 0, max_mean 0 (no load, no
    imbalance) and entropy 0."""
    counts = counts.to(torch.float64)
    total = counts.sum(-1, keepdim=True)
    fraction = torch.where(total > 0, counts / total.clamp(min=1), torch.zeros_like(counts))
    mean = counts.mean(-1)
    max_mean = torch.where(mean > 0, counts.max(-1).values / mean.clamp(min=1e-12), 0.0)
    plogp = torch.where(fraction > 0, fraction * fraction.log(), torch.zeros_like(fraction))
    return {
        "fraction": fraction,
        "max_mean": max_mean,
        "entropy": -plogp.sum(-1),
        "empty": (counts == 0).sum(-1),
    }


class RoutingHealth:
    """Per-step load metrics and alerts; keeps how many steps each expert has been empty."""

    def __init__(self, max_mean_threshold: float, empty_steps: int):
        self.threshold, self.empty_steps = max_mean_threshold, empty_steps
        self.empty_for: torch.Tensor | None = None  # (layers, E) consecutive empty steps

    def step(self, counts: torch.Tensor) -> dict[str, float]:
        """The metrics of one step's expert ``counts`` (layers, E) over real tokens."""
        stats = load_stats(counts)
        n_layers, n_experts = counts.shape
        metrics: dict[str, float] = {}
        for layer in range(n_layers):
            prefix = f"moe/layer{layer}"
            for e in range(n_experts):
                metrics[f"{prefix}/load/{e}"] = float(stats["fraction"][layer, e])
            metrics[f"{prefix}/max_mean"] = float(stats["max_mean"][layer])
            metrics[f"{prefix}/load_entropy"] = float(stats["entropy"][layer])
            metrics[f"{prefix}/empty"] = float(stats["empty"][layer])
        metrics["moe/max_mean"] = float(stats["max_mean"].max())
        metrics["moe/load_entropy_min"] = float(stats["entropy"].min())
        metrics["moe/load_entropy_max_possible"] = math.log(n_experts)
        metrics["moe/empty_experts"] = float(stats["empty"].sum())
        return metrics | self._alerts(counts, stats)

    def _alerts(self, counts: torch.Tensor, stats: dict) -> dict[str, float]:
        empty = counts == 0
        if self.empty_for is None or self.empty_for.shape != counts.shape:
            self.empty_for = torch.zeros(counts.shape, dtype=torch.long)
        self.empty_for = torch.where(empty, self.empty_for + 1, torch.zeros_like(self.empty_for))
        over = (stats["max_mean"] > self.threshold).nonzero().flatten().tolist()
        if over:
            log.warning(
                "MoE routing imbalance: layer(s) %s send their busiest expert more than %.2f x the "
                "mean load (max/mean %s); consider moe.aux_loss_coef or moe.bias_update_rate",
                over,
                self.threshold,
                [round(float(stats["max_mean"][i]), 2) for i in over],
            )
        dead = (self.empty_for >= self.empty_steps).nonzero().tolist()
        if dead:
            log.warning(
                "MoE dead experts: (layer, expert) %s received no token for %d steps or more",
                dead,
                self.empty_steps,
            )
        return {
            "moe/alert_imbalance": float(bool(over)),
            "moe/alert_dead_expert": float(bool(dead)),
        }
