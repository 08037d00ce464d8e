"""From sequence scores to the token-level rewards the advantage estimators read.

score at the last response token (+ DAPO's soft overlong punishment)
minus, when ``algorithm.kl_reward_coef`` > 0, a per-token KL penalty whose
weight a fixed or adaptive controller sets.
"""

from __future__ import annotations

from hybridrl.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    overlong_penalty,
    token_level_scores,
)
from hybridrl.config import AlgorithmConfig
from hybridrl.protocol import Batch


class RewardShaper:
    def __init__(self, alg: AlgorithmConfig, max_new_tokens: int, kl_value: float | None = None):
        self.alg, self.max_len = alg, max_new_tokens
        # a resumed run continues the adaptive coefficient
        coef = alg.kl_reward_coef if kl_value is None else kl_value
        self.kl = (
            AdaptiveKLController(coef, alg.kl_target, alg.kl_horizon)
            if alg.kl_ctrl == "adaptive"
            else FixedKLController(coef)
        )

    def __call__(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        lengths = batch["response_mask"].sum(-1)
        penalty = overlong_penalty(
            lengths, self.max_len, self.alg.overlong_buffer, self.alg.overlong_penalty
        )
        scores = token_level_scores(batch["rewards"] + penalty, batch["response_mask"])
        batch = batch | Batch({"token_level_scores": scores})
        metrics = {"reward/overlong_penalty": penalty.mean().item()}
        if self.alg.kl_reward_coef > 0:
            rewards, kl_metrics = apply_kl_penalty(batch, self.kl.value, self.alg.kl_estimator)
            self.kl.update(kl_metrics.get("kl/penalty_mean", 0.0), len(batch))
            metrics |= kl_metrics
        else:
            rewards = scores
        return batch | Batch({"token_level_rewards": rewards}), metrics
