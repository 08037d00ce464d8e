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
- ``rollout_is_threshold`` (upper), ``rollout_is_threshold_lower`` (mask mode; null: 1/upper). Mask
  mode with both bounds is IcePop's ``[lo, hi]`` (veRL's ``rollout_is_threshold: "lo_hi"``).
- ``rollout_is_batch_normalize``: the weights are divided by their mean, so that they average 1.
- ``rollout_bypass``: μ serves as the old policy; the actor's old-log-prob forward is skipped. With
  ``rollout_is`` on, the weight is that of the current policy, sg[π_θ]/μ, computed in the loss for
  each micro-batch (:func:`current_policy_weights`); only a loss that declares ``bypass_is`` (the
  ``reinforce`` loss) takes it, since a ratio loss's ratio already is π_θ/μ there.

The weight is detached and multiplies the per-token policy loss (``learner/learner.py``), unless
the loss declares ``weighs_rollout`` and applies the weights itself (``gmpo``: their geometric mean
per row); dropped tokens still count in the aggregation's denominators, as ``decoupled_ppo``'s cap
does. The
train-rollout gap metrics are logged whenever both log-probs exist, with the correction on or off
(after the update on a step that takes the old log-probs from the update's own forward,
``Learner.train_step``; the weights, an input of the loss, keep the separate pass).
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


# --- batch normalisation: (weights, mask) -> the mean the weights are divided by -----------------
def _token_mean(w: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return masked_mean(w, m)


def _sequence_mean(w: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    # one weight per sequence: each non-empty row counts once, whatever its length
    rows = m.any(-1)
    per_row = masked_mean(w, m, dim=-1)
    return per_row[rows].mean() if rows.any() else torch.zeros((), dtype=w.dtype)


BATCH_MEANS = {"token": _token_mean, "sequence": _sequence_mean}
# a mean at or below this (every weight dropped) leaves the weights as they are
BATCH_MEAN_MIN = 1e-8


def lower_threshold(cfg) -> float:
    lower = cfg.rollout_is_threshold_lower
    return 1.0 / cfg.rollout_is_threshold if lower is None else lower


def _floating(x: torch.Tensor) -> torch.Tensor:
    return x if x.is_floating_point() else x.float()


def importance_weights(
    old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, cfg
) -> tuple[torch.Tensor, dict[str, float]]:
    """The detached weights (B, R) of ``cfg.rollout_is`` / ``rollout_is_mode`` (0 on padding and on
    dropped tokens), divided by their mean with ``rollout_is_batch_normalize``, and their metrics:
    the raw ρ's mean and max over valid tokens, the mean weight used (before the normalisation), the
    share of valid tokens truncated (ρ > upper, truncate mode) or dropped (mask mode), and the mean
    divided by (``batch_norm_factor``, 1 when off). The weights keep the inputs' floating dtype (the
    wider of the two): float64 log-probs give float64 weights."""
    m = mask.bool()
    old, rollout = _floating(old), _floating(rollout)
    dtype = torch.promote_types(old.dtype, rollout.dtype)
    old, rollout = old.to(dtype), rollout.to(dtype)
    rho = torch.exp(LEVELS[cfg.rollout_is](old, rollout, m))
    upper = cfg.rollout_is_threshold
    weights, dropped = MODES[cfg.rollout_is_mode](rho, m, lower_threshold(cfg), upper)
    f = rho.dtype
    factor = torch.ones((), dtype=f)
    if cfg.rollout_is_batch_normalize:
        mean = BATCH_MEANS[cfg.rollout_is](weights, m)
        factor = mean if mean > BATCH_MEAN_MIN else factor
    metrics = {
        "rollout_corr/is_weight_mean": masked_mean(rho, m).item(),
        "rollout_corr/is_weight_max": masked_max(rho, m),
        "rollout_corr/is_weight_used_mean": masked_mean(weights, m).item(),
        # kept tokens above the cap: only truncation keeps them (mask mode drops them, so this is 0
        # there)
        "rollout_corr/truncated_frac": masked_mean(((rho > upper) & m & ~dropped).to(f), m).item(),
        "rollout_corr/masked_frac": masked_mean(dropped.to(f), m).item(),
    }
    if cfg.rollout_is_batch_normalize:
        metrics["rollout_corr/batch_norm_factor"] = factor.item()
    return (weights / factor).detach(), metrics


def current_policy_weights(
    logp: torch.Tensor, mb: Batch, cfg
) -> tuple[torch.Tensor, dict[str, float]]:
    """``rollout_bypass`` with ``rollout_is``: the weights of the current policy against the rollout
    (old_log_probs is μ there), sg[π_θ]/μ, for one micro-batch, as :func:`importance_weights` makes
    them (level, mode, thresholds, batch normalisation over the micro-batch). No gradient flows
    through them."""
    return importance_weights(logp.detach(), mb["old_log_probs"], mb["response_mask"], cfg)


def mismatch_metrics(
    old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """The train-rollout gap on valid tokens: mean and max |old - rollout|, and KL(rollout || train)
    estimated from the rollout's own samples (k1 = mean(μ - old); k3 = mean(r - 1 - log r), r =
    old/μ, >= 0)."""
    m = mask.bool()
    d = torch.where(m, _floating(old) - _floating(rollout), 0.0)
    d = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
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


def weighted_policy_loss(pg: torch.Tensor, mb: Batch, loss_fn=None) -> torch.Tensor:
    """The per-token policy loss times the micro-batch's rollout weights (unchanged when there are
    none, or when ``loss_fn``, the policy loss that made ``pg``, declares ``weighs_rollout``: it has
    applied them itself)."""
    if WEIGHT_KEY not in mb or getattr(loss_fn, "weighs_rollout", False):
        return pg
    return pg * mb[WEIGHT_KEY].to(pg.dtype)


def _takes_bypass_weights(alg) -> bool:
    from hybridrl.algorithms.losses import POLICY_LOSSES  # lazy: the config imports this module

    try:
        return getattr(POLICY_LOSSES.get(alg.policy_loss), "bypass_is", False)
    except KeyError:  # an unknown name is reported by the plug-in check
        return True


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
    if alg.rollout_bypass and alg.rollout_is is not None and not _takes_bypass_weights(alg):
        raise ValueError(
            f"algorithm.rollout_bypass with rollout_is and policy_loss {alg.policy_loss}: the "
            "old policy is the rollout's, so the loss's ratio already is pi/pi_rollout and a "
            "weight would count it twice; use policy_loss=reinforce (weighted by the current "
            "policy's pi/pi_rollout) or turn rollout_is off"
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
