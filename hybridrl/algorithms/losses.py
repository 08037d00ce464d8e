"""Policy losses: ``fn(logp, old_logp, advantages, mask, cfg) -> (per_token_loss, metrics)``.

``per_token_loss`` is zero where ``mask`` is 0; aggregation (token-mean) is
done by the caller so that micro-batches add up to the mini-batch's mean.
"""
from __future__ import annotations

import torch

from hybridrl.registry import Registry

POLICY_LOSSES = Registry("policy loss")
LOG_RATIO_CLAMP = 20.0  # a stale or broken sample cannot produce inf/NaN


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1)


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip_loss(logp, old_logp, advantages, mask, cfg):
    """PPO clipped surrogate (Schulman et al. 1707.06347) with separate low/high clip ranges:
    loss_t = max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high)), r_t = exp(logp_t - old_logp_t)."""
    mask = mask.to(logp.dtype)
    ratio = torch.exp((logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high)
    loss = torch.maximum(unclipped, clipped) * mask
    with torch.no_grad():
        is_clipped = (clipped > unclipped).to(logp.dtype)
        metrics = {
            "actor/clip_frac": masked_mean(is_clipped, mask).item(),
            "actor/ratio_mean": masked_mean(ratio, mask).item(),
            "actor/approx_kl_old": masked_mean(0.5 * (logp - old_logp).square(), mask).item(),
        }
    return loss, metrics
