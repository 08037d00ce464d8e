"""One policy-gradient step on a scored batch, shared by the synchronous driver and the asynchronous
learner: reference and old (proximal) log-probs (the rollout's under ``algorithm.rollout_bypass``) -> rollout
correction weights and metrics -> values -> token-level rewards -> advantages ->
critic update -> policy update.

``actor`` / ``reference`` / ``critic`` are role handles (WorkerGroups or RoleViews, whose DP_COMPUTE
methods return one result per rank) or the role workers themselves, called in-process.
"""
from __future__ import annotations

from hybridrl.algorithms import compute_advantages
from hybridrl.algorithms.rollout_correction import bypass_old_log_probs, rollout_correction
from hybridrl.protocol import Batch
from hybridrl.trainers.metrics import mean_over_ranks


def learn(actor, reference, critic, batch: Batch, shape, cfg, timer) -> tuple[Batch, dict[str, float]]:
    with timer.phase("reference"):
        batch |= reference.compute_ref_log_prob(batch)
    if cfg.algorithm.rollout_bypass:  # the rollout's log-probs are the old policy: no forward
        batch |= bypass_old_log_probs(batch)
    else:
        with timer.phase("old_log_prob"):
            batch |= actor.compute_log_prob(batch)
    batch, correction = rollout_correction(batch, cfg.algorithm)
    if critic is not None:
        with timer.phase("values"):
            batch |= critic.compute_values(batch)
    with timer.phase("advantage"):
        batch, metrics = shape(batch)
        batch = compute_advantages(batch, cfg.algorithm)
    metrics |= correction
    if critic is not None:
        with timer.phase("critic_update"):
            metrics |= mean_over_ranks(critic.update_critic(batch))
    with timer.phase("update"):
        metrics |= mean_over_ranks(actor.update_policy(batch))
    return batch, metrics
