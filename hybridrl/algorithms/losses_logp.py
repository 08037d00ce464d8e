"""Policy losses on log π itself, ``-w_t A_t log π_θ(y_t)`` with a detached per-token weight w_t
(no ratio in the objective): REINFORCE, DRO, and DPPO's two trust regions, in the ``POLICY_LOSSES``
registry.

Same contract as ``losses.py``: ``fn(logp, mb, cfg) -> (per_token_loss (B, R), metrics)``, zero on
padding and blind to what padded positions hold; aggregation is ``algorithm.loss_agg``'s. Their
gradient is -w_t A_t ∇log π_θ(y_t); the loss value carries log-probs, so it is not on PPO's scale.
Metrics share the names of the other losses: ``actor/approx_kl_old`` is k1 = mean(log π_old −
log π_θ) (veRL's ``actor/ppo_kl``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridrl.algorithms.losses import POLICY_LOSSES, _clips, _log_ratio
from hybridrl.algorithms.masking import as_bool, masked_mean, zero_pad
from hybridrl.algorithms.rollout_correction import current_policy_weights
from hybridrl.protocol import Batch
from hybridrl.registry import option

# keeps log(1 - p) finite in DPPO's binary KL when p reaches 1 (veRL's constant)
BINARY_KL_EPS = 1e-8


def _inputs(logp: torch.Tensor, mb: Batch):
    """Valid-token mask, log π_θ, log π_old and the advantages, each 0 on padding."""
    m = as_bool(mb["response_mask"])
    old = zero_pad(mb["old_log_probs"].to(logp.dtype), m)
    adv = zero_pad(mb["advantages"].to(logp.dtype), m)
    return m, zero_pad(logp, m), old, adv


def _kl_metric(logp: torch.Tensor, old: torch.Tensor, m: torch.Tensor) -> dict[str, float]:
    return {"actor/approx_kl_old": masked_mean(-_log_ratio(logp.detach(), old, m), m).item()}


# --- REINFORCE ------------------------------------------------------------------------------------
@POLICY_LOSSES.register("reinforce")
def reinforce_loss(logp: torch.Tensor, mb: Batch, cfg) -> tuple[torch.Tensor, dict[str, float]]:
    """REINFORCE: ℓ_t = −w_t·A_t·log π_θ(y_t), no ratio and no clip (veRL's ``gpg`` loss, and its
    bypass mode's ``loss_type: reinforce``).

    w_t = 1, except under ``rollout_bypass`` with ``rollout_is`` on: then w_t is the rollout
    correction of the *current* policy, sg[π_θ]/μ, at the configured level (token or sequence),
    mode (truncate, or mask for IcePop's [lower, upper]) and batch normalisation (over the
    micro-batch), with μ = ``old_log_probs`` (the rollout's there). Its ``rollout_corr/*`` metrics
    are then logged per update, as veRL's bypass mode does. Without bypass the step's rollout
    weights multiply the loss as for any loss.
    """
    m, lp, old, adv = _inputs(logp, mb)
    metrics = _kl_metric(logp, old, m)
    loss = -adv * lp
    if cfg.rollout_bypass and cfg.rollout_is is not None:
        weights, is_metrics = current_policy_weights(lp, mb, cfg)
        loss = loss * weights.to(loss.dtype)
        metrics |= is_metrics
    return zero_pad(loss, m), metrics


# under rollout_bypass it weighs its tokens by the current policy's rollout correction
reinforce_loss.bypass_is = True


# --- DRO ------------------------------------------------------------------------------------------
@dataclass
class DroOptions:
    beta: float | None = option(
        None, "weight of the quadratic penalty (log pi - log pi_old)^2 / 2 (required)", gt=0
    )

    def __post_init__(self):
        if self.beta is None:
            raise ValueError("beta is required: the weight of dro's quadratic penalty, > 0")


@POLICY_LOSSES.register("dro")
def dro_loss(logp: torch.Tensor, mb: Batch, cfg) -> tuple[torch.Tensor, dict[str, float]]:
    """DRO (Direct Reward Optimisation, as veRL's ``dro`` loss): ℓ_t = −(A_t·log π_θ(y_t) −
    β/2·(log π_θ(y_t) − log π_old(y_t))²), β = the option ``beta``.

    The policy gradient plus a quadratic pull back to the old policy, whose gradient β·(log π_θ −
    log π_old) is 0 on-policy and grows with the step: a soft trust region in place of a clip. The
    log-ratio here is not clamped (the square stays finite), as veRL.
    """
    beta = cfg.options(DroOptions, "policy_loss").beta
    m, lp, old, adv = _inputs(logp, mb)
    loss = -(adv * lp - 0.5 * beta * (lp - old).square())
    return zero_pad(loss, m), _kl_metric(logp, old, m)


dro_loss.options = DroOptions


# --- DPPO -----------------------------------------------------------------------------------------
def _dppo(logp: torch.Tensor, mb: Batch, cfg, inside) -> tuple[torch.Tensor, dict[str, float]]:
    """The DPPO loss with the trust region ``inside(logp, old, A, eps_low, eps_high)`` -> bool
    (B, R).

    ℓ_t = −A_t·sg[min(ρ_t, c)]·log π_θ(y_t)·1[inside_t], c = ``clip_ratio_c`` (null: no bound).
    """
    low, high, c = _clips(cfg)
    m, lp, old, adv = _inputs(logp, mb)
    log_ratio = _log_ratio(lp, old, m)
    with torch.no_grad():
        ratio = torch.exp(log_ratio)
        weight = ratio if c is None else ratio.clamp(max=c)
        keep = inside(lp.detach(), old, adv, low, high) & m
    loss = zero_pad(-adv * weight * lp * keep.to(lp.dtype), m)
    with torch.no_grad():
        f, out = lp.dtype, m & ~keep
        truncated = (ratio > c) & keep if c is not None else torch.zeros_like(keep)
        metrics = {
            # the tokens outside the trust region on the side of their advantage (no gradient)
            "actor/clip_frac_high": masked_mean((out & (adv > 0)).to(f), m).item(),
            "actor/clip_frac_low": masked_mean((out & (adv <= 0)).to(f), m).item(),
            "actor/clip_frac": masked_mean(out.to(f), m).item(),
            # kept tokens whose weight was bounded at c (veRL's pg_clipfrac_lower here)
            "actor/ratio_truncated_frac": masked_mean(truncated.to(f), m).item(),
        } | _kl_metric(logp, old, m)
    return loss, metrics


def _probs(logp: torch.Tensor) -> torch.Tensor:
    # at most 1: a log-prob a rounding error above 0 still gives a probability
    return logp.exp().clamp(max=1.0)


def _inside_tv(logp, old, adv, low, high):
    # A > 0 may raise p by at most eps_high, A <= 0 lower it by at most eps_low
    diff = _probs(logp) - _probs(old)
    return torch.where(adv > 0, diff <= high, diff >= -low)


def binary_kl(logp: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """KL(Bernoulli(p_old) ‖ Bernoulli(p)) = p_old (log p_old − log p) + (1 − p_old) log((1 −
    p_old)/(1 − p)) from the log-probs, the second term with ``BINARY_KL_EPS`` added to both sides
    of the fraction, as veRL."""
    p, p_old = _probs(logp), _probs(old)
    rest = (1 - p_old) * torch.log((1 - p_old + BINARY_KL_EPS) / (1 - p + BINARY_KL_EPS))
    return p_old * (old - logp) + rest


def _inside_kl(logp, old, adv, low, high):
    # the bound binds only in the advantage's direction: A > 0 raising p, A <= 0 lowering it
    kl, p, p_old = binary_kl(logp, old), _probs(logp), _probs(old)
    return torch.where(adv > 0, (kl <= high) | (p <= p_old), (kl <= low) | (p >= p_old))


@POLICY_LOSSES.register("dppo_tv")
def dppo_tv_loss(logp: torch.Tensor, mb: Batch, cfg) -> tuple[torch.Tensor, dict[str, float]]:
    """DPPO-Binary-TV (arXiv:2602.04879, as veRL's ``dppo_tv``): the trust region is on the sampled
    token's probability, not on its ratio: a token with A_t > 0 keeps its gradient while
    π_θ(y_t) − π_old(y_t) ≤ ε_h, one with A_t ≤ 0 while it is ≥ −ε_l; outside it the loss is 0.
    ℓ_t = −A_t·sg[min(ρ_t, c)]·log π_θ(y_t) inside (ρ truncated at c = ``clip_ratio_c``, in place of
    the dual clip; null: not truncated). ε_l, ε_h are ``clip_ratio_low`` / ``clip_ratio_high`` read
    as probability differences (the paper's 0.15). A change of a rare token's probability from 1e-5
    to 1e-3 is a ratio of 100 but a TV step of 0.001: kept here, clipped by PPO.

    Metrics: clip_frac_high / clip_frac_low (valid tokens outside the region with A > 0 / A ≤ 0),
    clip_frac, ratio_truncated_frac (kept tokens with ρ > c), approx_kl_old.
    """
    return _dppo(logp, mb, cfg, _inside_tv)


@POLICY_LOSSES.register("dppo_kl")
def dppo_kl_loss(logp: torch.Tensor, mb: Batch, cfg) -> tuple[torch.Tensor, dict[str, float]]:
    """DPPO-Binary-KL (arXiv:2602.04879, as veRL's ``dppo_kl``): ``dppo_tv`` with the trust region
    measured by the binary KL of the sampled token, KL(Bern(π_old(y_t)) ‖ Bern(π_θ(y_t))) (see
    :func:`binary_kl`): a token with A_t > 0 keeps its gradient while that KL is ≤ ε_h or its
    probability has not risen, one with A_t ≤ 0 while it is ≤ ε_l or its probability has not fallen.
    ε from ``clip_ratio_low`` / ``clip_ratio_high`` (the paper's 0.05). Loss and metrics as
    ``dppo_tv``.
    """
    return _dppo(logp, mb, cfg, _inside_kl)
