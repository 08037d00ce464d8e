"""Which passes a learning step runs: the reference (a KL term reads it), the critic (the advantage
estimator needs values), and the separate old-log-prob forward, which an on-policy step takes from
the update's own first forward instead.
"""

from __future__ import annotations

import torch

from hybridrl.algorithms import ADVANTAGES
from hybridrl.config import Config
from hybridrl.learner.update import is_single_pass


def needs_reference(cfg: Config) -> bool:
    """A KL term reads the reference: the loss's (``kl_coef``) or the reward's
    (``kl_reward_coef``)."""
    return cfg.algorithm.kl_coef > 0 or cfg.algorithm.kl_reward_coef > 0


def needs_critic(cfg: Config) -> bool:
    return getattr(ADVANTAGES.get(cfg.algorithm.advantage), "needs_values", False)


def needs_sum_pi_squared(cfg: Config) -> bool:
    """The advantage estimator reads the old policy's sum_v π(v)² (the optimal token baselines):
    the old-log-prob pass adds it as ``sum_pi_squared``."""
    return getattr(ADVANTAGES.get(cfg.algorithm.advantage), "needs_sum_pi_squared", False)


def reuses_old_log_probs(cfg: Config, batch_size: int) -> bool:
    """Whether the update takes the old log-probs from its own first forward, not a separate pass.

    On-policy (one epoch over one mini-batch of the whole batch) that forward computes the same
    numbers as the pass. The pass still runs when something reads them before the update: the KL
    penalty in the reward (it shapes the advantages), the rollout correction's weights (an input
    of the loss) and the optimal token baselines (with sum_pi_squared); the train-rollout gap
    metrics read them after the update. ``rollout_bypass`` has
    no pass to skip; ``actor.reuse_old_log_probs: never`` keeps the pass (A/B tests)."""
    alg = cfg.algorithm
    return (
        cfg.actor.reuse_old_log_probs == "auto"
        and is_single_pass(cfg.actor, batch_size)
        and alg.kl_reward_coef == 0
        and alg.rollout_is is None
        and not alg.rollout_bypass
        and not needs_sum_pi_squared(cfg)
    )


def dropout_in_training(model) -> bool:
    """Whether a training-mode forward is random (a dropout layer, or attention dropout in the
    config)."""
    config = getattr(model, "config", None)
    return (
        any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())
        or float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0
    )
