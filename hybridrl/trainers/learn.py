"""One policy-gradient step on a scored batch, shared by the synchronous driver and the asynchronous
learner: reference and old (proximal) log-probs (the rollout's under ``algorithm.rollout_bypass``; none
before an on-policy update, which takes them from its own forward) -> rollout correction weights and
metrics -> values -> token-level rewards -> advantages -> critic update -> policy update.

``actor`` / ``reference`` / ``critic`` are role handles (WorkerGroups or RoleViews, whose DP_COMPUTE
methods return one result per rank) or the role workers themselves, called in-process.
"""

from __future__ import annotations

from hybridrl.algorithms import compute_advantages
from hybridrl.algorithms.rollout_correction import bypass_old_log_probs, rollout_correction
from hybridrl.protocol import Batch
from hybridrl.trainers.metrics import mean_over_ranks
from hybridrl.training.update import is_single_pass


def reuses_old_log_probs(cfg, batch_size: int) -> bool:
    """Whether the policy update takes the old log-probs from its own first forward instead of a separate pass.

    On-policy (one epoch over one mini-batch of the whole, global, batch) that forward runs the weights the
    samples are scored against, on the same micro-batches as the pass would (``training/update.py``), so the
    pass would compute the same numbers. It still runs when something reads them before the update: the KL
    penalty in the reward (it shapes the advantages) and the rollout correction's weights (an input of the
    loss). The train-rollout gap metrics read them after the update. ``rollout_bypass`` has no pass to skip;
    ``actor.reuse_old_log_probs: never`` keeps the pass (A/B tests)."""
    alg = cfg.algorithm
    return (
        cfg.actor.reuse_old_log_probs == "auto"
        and is_single_pass(cfg.actor, batch_size)
        and alg.kl_reward_coef == 0
        and alg.rollout_is is None
        and not alg.rollout_bypass
    )


def learn(
    actor, reference, critic, batch: Batch, shape, cfg, timer
) -> tuple[Batch, dict[str, float]]:
    reuse = reuses_old_log_probs(cfg, len(batch))
    with timer.phase("reference"):
        batch |= reference.compute_ref_log_prob(batch)
    if cfg.algorithm.rollout_bypass:  # the rollout's log-probs are the old policy: no forward
        batch |= bypass_old_log_probs(batch)
    elif not reuse:
        with timer.phase("old_log_prob"):
            batch |= actor.compute_log_prob(batch)
    correction = {}
    if not reuse:
        batch, correction = rollout_correction(batch, cfg.algorithm)
    if critic is not None:
        with timer.phase("values"):
            batch |= critic.compute_values(batch)
    with timer.phase("advantage"):
        batch, metrics = shape(batch)
        batch = compute_advantages(batch, cfg.algorithm)
    if critic is not None:
        with timer.phase("critic_update"):
            metrics |= mean_over_ranks(critic.update_critic(batch))
    with timer.phase("update"):
        metrics |= mean_over_ranks(actor.update_policy(batch))
    if reuse:  # the update's first forward computed them: the gap metrics come now (no weights: rollout_is is off)
        batch |= actor.old_log_probs_of_last_update(batch)
        batch, correction = rollout_correction(batch, cfg.algorithm)
    return batch, metrics | correction
