"""Rollout-to-training importance correction: the engine that sampled the tokens (μ,
``rollout_log_probs``) and the trainer's forward of the same weights (π_old, ``old_log_probs``)
differ by numerics (precision, kernels, batch shape), so the samples are slightly off-policy even in
synchronous training.

Switches (``algorithm.*``, see docs/algorithms.md, "Rollout correction"):

- ``rollout_is``: ``null`` (off), ``token`` or ``sequence``: the level of the importance weight
  ρ = π_old/μ. Token: ρ_t = exp(old_t − μ_t). Sequence: ρ_i = exp(Σ_t (old_t − μ_t)) over the row's
  valid tokens, the same for each of its tokens. Log-ratios are clamped to ±20 before ``exp``.
- ``rollout_is_mode``: ``truncate`` (TIS): w = min(ρ, upper); ``mask`` (MIS): w = ρ inside
  [lower, upper], 0 outside (those tokens, or whole sequences, leave the loss).
- ``rollout_is_threshold`` (upper), ``rollout_is_threshold_lower`` (mask mode; null: 1/upper).
- ``rollout_bypass``: μ serves as the old policy; the actor's old-log-prob forward is skipped.

The weight is detached and multiplies the per-token policy loss (``learner/learner.py``); dropped
tokens still count in the aggregation's denominators, as ``decoupled_ppo``'s cap does. The
train-rollout gap metrics are logged whenever both log-probs exist, with the correction on or off
(after the update on a step that takes the old log-probs from the update's own forward,
``learner/step.py``; the weights, an input of the loss, keep the separate pass).
"""

from __future__ import annotations

import torch

from hybridrl.algorithms.masking import masked_max, masked_mean
from hybridrl.protocol import Batch

LOG_RATIO_CLAMP = 20.0  # exp stays finite for any sequence length
WEIGHT_KEY = "rollout_is_weights"
# losses that already weight each token by pi_prox / mu: a second rollout weight would apply it
# twice
BEHAVIOUR_WEIGHTED_LOSSES = ("decoupled_ppo",)


# --- levels: (old, rollout, mask) -> per-token log-weight (B, R), 0 on padding --------------------
def _token_level(old: torch.Tensor, rollout: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return torch.where(m, old - rollout, 0.0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _sequence_level(old: torch.Tensor, rollout: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    seq = (
        torch.where(m, old - rollout, 0.0)
        .sum(-1, keepdim=True)
        .clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    )
    return torch.where(m, seq.expand_as(old), 0.0)


LEVELS = {"token": _token_level, "sequence": _sequence_level}


# --- modes: (rho, mask, lower, upper) -> (weight used, dropped) -----------------------------------
def _truncate(rho: torch.Tensor, m: torch.Tensor, lower: float, upper: float):
    return torch.where(m, rho.clamp(max=upper), 0.0), torch.zeros_like(m)


def _mask(rho: torch.Tensor, m: torch.Tensor, lower: float, upper: float):
    keep = m & (rho >= lower) & (rho <= upper)
    return torch.where(keep, rho, 0.0), m & ~keep


MODES = {"truncate": _truncate, "mask": _mask}


def lower_threshold(cfg) -> float:
    lower = cfg.rollout_is_threshold_lower
    return 1.0 / cfg.rollout_is_threshold if lower is None else lower


def importance_weights(
    old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, cfg
) -> tuple[torch.Tensor, dict[str, float]]:
    """The detached weights (B, R) of ``cfg.rollout_is`` / ``rollout_is_mode`` (0 on padding and on
    dropped tokens) and their metrics: the raw ρ's mean and max over valid tokens, the mean weight
    used, and the share of valid tokens truncated (ρ > upper, truncate mode) or dropped (mask
    mode)."""
    m = mask.bool()
    old, rollout = old.float(), rollout.float()
    rho = torch.exp(LEVELS[cfg.rollout_is](old, rollout, m))
    upper = cfg.rollout_is_threshold
    weights, dropped = MODES[cfg.rollout_is_mode](rho, m, lower_threshold(cfg), upper)
    f = rho.dtype
    metrics = {
        "rollout_corr/is_weight_mean": masked_mean(rho, m).item(),
        "rollout_corr/is_weight_max": masked_max(rho, m),
        "rollout_corr/is_weight_used_mean": masked_mean(weights, m).item(),
        # kept tokens above the cap: only truncation keeps them (mask mode drops them, so this is 0
        # there)
        "rollout_corr/truncated_frac": masked_mean(((rho > upper) & m & ~dropped).to(f), m).item(),
        "rollout_corr/masked_frac": masked_mean(dropped.to(f), m).item(),
    }
    return weights.detach(), metrics


def mismatch_metrics(
    old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """The train-rollout gap on valid tokens: mean and max |old - rollout|, and KL(rollout || train)
    estimated from the rollout's own samples (k1 = mean(μ - old); k3 = mean(r - 1 - log r), r =
    old/μ, >= 0)."""
    m = mask.bool()
    d = torch.where(m, old.float() - rollout.float(), 0.0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return {
        "rollout_corr/logp_gap_mean": masked_mean(d.abs(), m).item(),
        "rollout_corr/logp_gap_max": masked_max(d.abs(), m),
        "rollout_corr/kl_k1": masked_mean(-d, m).item(),
        "rollout_corr/kl_k3": masked_mean(torch.expm1(d) - d, m).item(),
    }


def rollout_correction(batch: Batch, cfg) -> tuple[Batch, dict[str, float]]:
    """``batch`` with ``rollout_is_weights`` added when ``cfg.rollout_is`` is set, and the step's
    metrics. Needs ``old_log_probs`` and ``rollout_log_probs``. Under ``rollout_bypass`` they are
    the same tensor, so there is no gap to measure and no metric."""
    if cfg.rollout_bypass:
        return batch, {}
    old, rollout, mask = batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"]
    metrics = mismatch_metrics(old, rollout, mask)
    if cfg.rollout_is is not None:
        weights, is_metrics = importance_weights(old, rollout, mask, cfg)
        batch = batch | Batch({WEIGHT_KEY: weights})
        metrics |= is_metrics
    return batch, metrics


def bypass_old_log_probs(batch: Batch) -> Batch:
    """``rollout_bypass``: the rollout's log-probs serve as the old policy (no forward)."""
    return Batch({"old_log_probs": batch["rollout_log_probs"].clone()})


def weighted_policy_loss(pg: torch.Tensor, mb: Batch) -> torch.Tensor:
    """The per-token policy loss times the micro-batch's rollout weights (unchanged when there are
    none)."""
    return pg * mb[WEIGHT_KEY].to(pg.dtype) if WEIGHT_KEY in mb else pg


def validate(cfg) -> None:
    """Reject, at config time, switch combinations that cannot work (``cfg`` is the whole
    Config)."""
    alg = cfg.algorithm
    if alg.rollout_is is not None and alg.policy_loss in BEHAVIOUR_WEIGHTED_LOSSES:
        raise ValueError(
            f"algorithm.rollout_is with policy_loss {alg.policy_loss}: that loss already weights "
            "each token by "
            "pi_prox/pi_rollout; use one of the two (e.g. policy_loss=ppo_clip)"
        )
    if alg.rollout_bypass and alg.rollout_is is not None:
        raise ValueError(
            "algorithm.rollout_bypass with rollout_is: the old policy is then the rollout's, so "
            "every weight "
            "would be 1; turn one of them off"
        )
    if alg.rollout_bypass and alg.policy_loss in BEHAVIOUR_WEIGHTED_LOSSES:
        raise ValueError(
            f"algorithm.rollout_bypass with policy_loss {alg.policy_loss}: the proximal policy "
            "would be the "
            "behaviour policy (weight 1); use ppo_clip, or recompute the proximal log-probs"
        )
    if alg.rollout_is_threshold_lower is not None and alg.rollout_is_mode != "mask":
        raise ValueError(
            "algorithm.rollout_is_threshold_lower applies to rollout_is_mode=mask only "
            f"(truncate caps at the upper threshold); got mode {alg.rollout_is_mode}"
        )
    if alg.rollout_is_mode == "mask" and lower_threshold(alg) >= alg.rollout_is_threshold:
        raise ValueError(
            f"algorithm.rollout_is_threshold_lower ({lower_threshold(alg)}; null means 1/upper) "
            "must be below "
            f"rollout_is_threshold ({alg.rollout_is_threshold}) in mask mode"
        )
