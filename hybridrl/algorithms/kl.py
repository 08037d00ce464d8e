"""KL between the policy and the reference, per token (Schulman, "Approximating KL divergence"), and
KL in the reward.

With ``log_ratio = logp - ref_logp`` (samples drawn from the policy):
k1 = log_ratio, k2 = log_ratio^2 / 2, k3 = exp(-log_ratio) - 1 + log_ratio (>= 0, low variance;
clamped as veRL's low_var_kl), abs = |log_ratio|; k1+, k2+, k3+, abs+: the value of k1 / k2 / k3 /
abs with the gradient of k2 (straight-through, veRL's "+" modes, which take any estimator's name).
As a reward penalty: ``apply_kl_penalty`` with a fixed or adaptive coefficient (Ziegler et al.
1909.08593); as a loss term: the actor aggregates ``kl_penalty(...)`` itself.
"""

from __future__ import annotations

import torch

from hybridrl.protocol import Batch
from hybridrl.registry import Registry

KL_ESTIMATORS = Registry("KL estimator")
_CLAMP = 20.0  # keep exp() finite for far-off samples


@KL_ESTIMATORS.register("k1")
def k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return logp - ref_logp


@KL_ESTIMATORS.register("k2")
def k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logp - ref_logp).square()


@KL_ESTIMATORS.register("k3")
def k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    neg = (ref_logp - logp).clamp(-_CLAMP, _CLAMP)
    return (neg.exp() - 1 - neg).clamp(max=10.0)


@KL_ESTIMATORS.register("abs")
def kl_abs(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return (logp - ref_logp).abs()


# Straight-through ("+") estimators, as veRL's k1+ / k2+ / k3+: the value of the named estimator
# with the gradient of k2. As a loss term, E[grad k2] = grad KL(pi || ref) for samples from pi (the
# on-policy case), while the gradients of k1 and k3 are biased; the value keeps the chosen
# estimator's reading.
def _straight_through(
    value: torch.Tensor, logp: torch.Tensor, ref_logp: torch.Tensor
) -> torch.Tensor:
    grad_path = k2(logp, ref_logp)
    # (g - g) is exactly 0: the value is unchanged
    return value.detach() + (grad_path - grad_path.detach())


@KL_ESTIMATORS.register("k1+")
def k1_plus(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return _straight_through(k1(logp, ref_logp), logp, ref_logp)


@KL_ESTIMATORS.register("k2+")
def k2_plus(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    # the same as k2, value and gradient
    return _straight_through(k2(logp, ref_logp), logp, ref_logp)


@KL_ESTIMATORS.register("k3+")
def k3_plus(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return _straight_through(k3(logp, ref_logp), logp, ref_logp)


@KL_ESTIMATORS.register("abs+")
def abs_plus(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    # reads |log_ratio| (a loss term that logs like "abs") and pulls like k2: the gradient of
    # |log_ratio| is its sign alone, the same push however close the policy is to the reference
    return _straight_through(kl_abs(logp, ref_logp), logp, ref_logp)


def kl_penalty(name: str, logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return KL_ESTIMATORS.get(name)(logp, ref_logp)


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, coef: float):
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


class AdaptiveKLController:
    """Ziegler et al. 1909.08593: err = clip(kl / target - 1, -0.2, 0.2); coef *= 1 + err * n_steps
    / horizon.

    ``current_kl`` must be measured the way ``target`` is meant (e.g. ``kl/penalty_mean`` of
    ``apply_kl_penalty``, the per-sequence summed KL, as the paper's target of nats per sample).
    """

    def __init__(self, init_coef: float, target: float, horizon: float):
        if target <= 0 or horizon <= 0:
            raise ValueError(
                f"AdaptiveKLController needs target > 0 and horizon > 0, got {target}, {horizon}"
            )
        self.value, self.target, self.horizon = float(init_coef), float(target), float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        err = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + err * n_steps / self.horizon


def apply_kl_penalty(
    batch: Batch, coef: float, estimator: str
) -> tuple[torch.Tensor, dict[str, float]]:
    """token_level_rewards = token_level_scores - coef * kl(old_log_probs, ref_log_probs), 0 on
    padding.

    Metrics: ``kl/penalty_mean`` = mean over non-empty rows of the per-sequence SUMMED KL (nats per
    response, the quantity Ziegler et al.'s adaptive target refers to); ``kl/penalty_token_mean`` =
    mean over rows of the per-sequence token-mean KL (what veRL feeds its controller); ``kl/coef``.
    """
    mask = batch["response_mask"]
    m = mask.bool() if mask.dtype != torch.bool else mask
    scores = batch["token_level_scores"]
    zero = torch.zeros((), dtype=scores.dtype, device=scores.device)
    with torch.no_grad():
        kl = torch.where(
            m,
            kl_penalty(estimator, batch["old_log_probs"], batch["ref_log_probs"]).to(scores.dtype),
            zero,
        )
        rewards = torch.where(m, scores - coef * kl, zero)
        rows = m.any(-1)
        per_seq = kl.sum(-1)[rows]
        per_tok = (kl.sum(-1) / m.sum(-1).clamp(min=1))[rows]
        metrics = {
            "kl/penalty_mean": per_seq.mean().item() if rows.any() else 0.0,
            "kl/penalty_token_mean": per_tok.mean().item() if rows.any() else 0.0,
            "kl/coef": float(coef),
        }
    return rewards, metrics
