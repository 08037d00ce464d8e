"""Advantage estimators: ``fn(batch, cfg) -> advantages (B, R)``, zero on padding.

Samples of one prompt share a ``uid`` (group id); groups are found by uid,
never by position in the batch.
"""
from __future__ import annotations

from collections import defaultdict

import torch

from hybridrl.protocol import Batch
from hybridrl.registry import Registry

ADVANTAGES = Registry("advantage estimator")


def group_normalise(scores: torch.Tensor, uids: list, norm_by_std: bool, eps: float = 1e-6) -> torch.Tensor:
    """(score - group mean) [/ (group std + eps)] per uid.

    Conventions follow veRL's ``core_algos``: the std is the unbiased one,
    and a group of size one gets mean 0 and std 1 (its advantage is its score).
    """
    groups: dict = defaultdict(list)
    for i, u in enumerate(uids):
        groups[u].append(i)
    scores = scores.double()
    out = torch.empty_like(scores)
    for rows in groups.values():
        idx = torch.tensor(rows)
        s = scores[idx]
        if len(rows) == 1:
            mean, std = torch.zeros(()), torch.ones(())
        else:
            mean, std = s.mean(), s.std()
        out[idx] = (s - mean) / (std + eps) if norm_by_std else s - mean
    return out.float()


@ADVANTAGES.register("grpo")
def grpo_advantage(batch: Batch, cfg) -> torch.Tensor:
    """GRPO outcome advantage, broadcast to every response token (Shao et al. 2402.03300)."""
    adv = group_normalise(batch["rewards"], batch["uid"], cfg.norm_adv_by_std)
    return adv.unsqueeze(-1) * batch["response_mask"].float()


def compute_advantages(batch: Batch, cfg) -> Batch:
    """Adds ``advantages`` (B, R) with the estimator named by ``cfg.advantage``."""
    adv = ADVANTAGES.get(cfg.advantage)(batch, cfg)
    return batch.union(Batch({"advantages": adv}))
