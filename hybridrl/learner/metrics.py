"""Per-step metrics from a scored batch or the step's samples, and their mean over ranks."""

from __future__ import annotations

from collections import defaultdict

import torch

from hybridrl.algorithms.advantages import group_rows
from hybridrl.protocol import Batch, Sample


def batch_metrics(batch: Batch) -> dict[str, float]:
    width = batch["responses"].shape[1]  # lengths count every response token, trained on or not
    rewards, lengths = batch["rewards"], batch["attention_mask"][:, -width:].sum(-1).float()
    extras = {k: batch[k].mean().item() for k in batch.tensors if k.startswith("reward/")}
    if "baseline_rewards" in batch:  # ReMax's greedy responses (rollout/group_hooks.py)
        extras["reward/greedy_baseline_mean"] = batch["baseline_rewards"].mean().item()
    # the share of groups whose rewards differ: the others have zero advantage
    groups, scores = group_rows(batch.meta["uid"]), rewards.tolist()
    informative = sum(len({scores[i] for i in g}) > 1 for g in groups) / max(len(groups), 1)
    nonfinite, timeouts = "reward_nonfinite" in batch, "reward_timeouts" in batch
    return (
        extras
        | {
            "reward/mean": rewards.mean().item(),
            "reward/std": rewards.std().item() if len(rewards) > 1 else 0.0,
            "rollout/informative_frac": informative,
            "reward/errors": batch["reward_errors"].sum().item(),
            "reward/nonfinite": batch["reward_nonfinite"].sum().item() if nonfinite else 0.0,
            "reward/timeouts": batch["reward_timeouts"].sum().item() if timeouts else 0.0,
            "response/length_mean": lengths.mean().item(),
            "response/length_max": lengths.max().item(),
            "response/truncated_frac": sum(s == "truncated" for s in batch["status"]) / len(batch),
            "advantage/abs_mean": batch["advantages"].abs().sum().item()
            / max(batch["response_mask"].sum().item(), 1),
        }
        | task_metrics(batch)
    )


def task_metrics(batch: Batch) -> dict[str, float]:
    """``reward/task/<task_id>``: the mean reward of each task's samples, when the batch holds more
    than one task (a multi-task run)."""
    tasks = batch.meta.get("task_id", [])
    if len(set(tasks)) < 2:
        return {}
    rewards = batch["rewards"].tolist()
    out: dict[str, list[float]] = defaultdict(list)
    for task, r in zip(tasks, rewards):
        out[task].append(r)
    return {f"reward/task/{t}": sum(v) / len(v) for t, v in out.items()}


def mean_over_ranks(per_rank: list[dict[str, float]] | dict[str, float]) -> dict[str, float]:
    """The mean of each metric over the ranks that report it (a single dict: a worker called
    in-process). A rank may lack a key: e.g. no sample of some task reached it."""
    if isinstance(per_rank, dict):
        return per_rank
    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for d in per_rank:
        for k, v in d.items():
            sums[k] += v
            counts[k] += 1
    return {k: v / counts[k] for k, v in sums.items()}


def staleness_metrics(
    batch: Batch, version: int, max_staleness: int
) -> tuple[dict[str, float], list[int]]:
    """Per sample: staleness = ``version`` - the oldest version among its tokens; a histogram over
    0..max_staleness (``async/staleness_<k>``: fraction of samples), mean / max, and the fraction of
    partial samples (interrupted by a weight update: tokens of more than one version)."""
    stamps, mask = batch["versions"], batch["response_mask"].bool()
    big = torch.iinfo(stamps.dtype).max
    oldest = torch.where(mask, stamps, big).min(-1).values
    oldest = torch.where(oldest == big, version, oldest)  # empty responses count as fresh
    newest = torch.where(mask, stamps, -1).max(-1).values
    lag = (version - oldest).tolist()
    n = max(len(lag), 1)
    top = max(max_staleness, max(lag, default=0))
    out = {f"async/staleness_{k}": sum(x == k for x in lag) / n for k in range(top + 1)}
    out |= {
        "async/staleness_mean": sum(lag) / n,
        "async/staleness_max": float(max(lag, default=0)),
        "async/partial_frac": ((newest > oldest) & mask.any(-1)).float().mean().item(),
    }
    return out, lag


def reward_failures(samples: list[Sample]) -> tuple[int, int, str | None]:
    """``(failed, scored, first error)``: how many of the step's samples had a reward that failed
    (``rollout/scoring.py``) or an environment that failed (multi-turn: its reward is then 0),
    out of how many, and the first failure's message."""
    failed = [
        s for s in samples if s.reward_extras.get("reward_errors") or s.metadata.get("env_error")
    ]
    first = next(
        (s.metadata.get("reward_error") or s.metadata.get("env_error_message") for s in failed),
        None,
    )
    return len(failed), len(samples), first
