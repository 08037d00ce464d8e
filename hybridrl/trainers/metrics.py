"""Per-step metrics computed from a scored batch."""

from __future__ import annotations

from collections import defaultdict

from hybridrl.protocol import Batch


def batch_metrics(batch: Batch) -> dict[str, float]:
    rewards, lengths = batch["rewards"], batch["response_mask"].sum(-1).float()
    return {
        "reward/mean": rewards.mean().item(),
        "reward/std": rewards.std().item() if len(rewards) > 1 else 0.0,
        "reward/errors": batch["reward_errors"].sum().item(),
        "response/length_mean": lengths.mean().item(),
        "response/length_max": lengths.max().item(),
        "response/truncated_frac": sum(s == "truncated" for s in batch["status"]) / len(batch),
        "advantage/abs_mean": batch["advantages"].abs().sum().item()
        / max(batch["response_mask"].sum().item(), 1),
    }


def mean_over_ranks(per_rank: list[dict[str, float]] | dict[str, float]) -> dict[str, float]:
    """The mean of each metric over the ranks' results (a single dict: a worker called in-process)."""
    if isinstance(per_rank, dict):
        return per_rank
    sums: dict[str, float] = defaultdict(float)
    for d in per_rank:
        for k, v in d.items():
            sums[k] += v / len(per_rank)
    return dict(sums)
