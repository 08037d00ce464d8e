"""Policy losses: ``fn(logp, mb, cfg) -> (per_token_loss (B, R), metrics)``; and the clipped value
loss.

``logp`` (B, R) is the current policy's log-prob of each response token; ``mb`` is the micro-batch
with ``old_log_probs`` (the proximal / old policy), ``rollout_log_probs`` (the behaviour policy that
sampled the tokens), ``advantages`` and ``response_mask``. ``per_token_loss`` is zero where the mask
is 0; aggregation to a scalar is the caller's (``hybridrl.algorithms.aggregation``), so that
micro-batches add up to the mini-batch's loss. Every log-ratio is clamped to +-20 before ``exp``,
so a stale or broken sample cannot produce inf/NaN, in the loss or in its gradient.

``cfg`` is the ``AlgorithmConfig``; these losses read ``clip_ratio_low``, ``clip_ratio_high``,
``clip_ratio_c`` (dual clip for A < 0; None or 0 disables it) and ``behav_imp_weight_cap``.
"""

from __future__ import annotations

import torch

from hybridrl.algorithms.masking import as_bool, masked_max, masked_mean, masked_min, zero_pad
from hybridrl.protocol import Batch
from hybridrl.registry import Registry

POLICY_LOSSES = Registry("policy loss")
LOG_RATIO_CLAMP = 20.0  # a stale or broken sample cannot produce inf/NaN
# gspo_token: veRL's upper bound on the token-level combined log-ratio
GSPO_TOKEN_LOG_RATIO_MAX = 10.0


# --- helpers -----------------------------------------------------------------------------------
def _clips(cfg) -> tuple[float, float, float | None]:
    low, high, c = cfg.clip_ratio_low, cfg.clip_ratio_high, cfg.clip_ratio_c or None
    if c is not None and c <= 1.0:
        raise ValueError(f"clip_ratio_c (dual clip) must be > 1 or null, got {c}")
    return low, high, c


def _log_ratio(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """a - b on valid tokens (0 on padding), clamped to +-LOG_RATIO_CLAMP."""
    return zero_pad(a - b, mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _clipped_surrogate(
    ratio: torch.Tensor, adv: torch.Tensor, low: float, high: float, c: float | None
):
    """Per-token PPO loss max(-A r, -A clip(r, 1-low, 1+high)), then, for A < 0, min(that, -A c)
    (dual clip).

    Returns the loss and the boolean indicators (clipped low, clipped high, dual-clipped).
    """
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1 - low, 1 + high)
    loss = torch.maximum(pg1, pg2)
    with torch.no_grad():
        # the clip is active (gradient 0) exactly when pg2 > pg1: A > 0 above 1+high, A < 0 below
        # 1-low
        clipped_low = (adv < 0) & (ratio < 1 - low)
        clipped_high = (adv > 0) & (ratio > 1 + high)
    if c is not None:
        pg3 = -adv * c
        dual = (adv < 0) & (loss > pg3)
        loss = torch.where(adv < 0, torch.minimum(loss, pg3), loss)
    else:
        dual = torch.zeros_like(clipped_low)
    return loss, clipped_low, clipped_high, dual.detach()


def _ratio_metrics(
    log_ratio: torch.Tensor, ratio: torch.Tensor, mask, low, high, dual
) -> dict[str, float]:
    m = as_bool(mask)
    f = ratio.dtype
    lo, hi = masked_mean(low.to(f), m).item(), masked_mean(high.to(f), m).item()
    return {
        "actor/clip_frac_low": lo,
        "actor/clip_frac_high": hi,
        "actor/clip_frac": masked_mean((low | high).to(f), m).item(),
        "actor/dual_clip_frac": masked_mean(dual.to(f), m).item(),
        # KL(old || current) from tokens sampled by old: k1 = old - logp (veRL's ppo_kl), and
        # k3 = (r - 1) - log r (>= 0, lower variance) alongside
        "actor/approx_kl_old": masked_mean(-log_ratio, m).item(),
        "actor/approx_kl_old_k3": masked_mean(torch.expm1(log_ratio) - log_ratio, m).item(),
        "actor/ratio_mean": masked_mean(ratio, m).item(),
        "actor/ratio_max": masked_max(ratio, m),
        "actor/ratio_min": masked_min(ratio, m),
    }


# --- PPO ------------------------------------------------------------------------------------------
@POLICY_LOSSES.register("ppo_clip")
def ppo_clip_loss(logp: torch.Tensor, mb: Batch, cfg) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate (Schulman et al. 1707.06347) with DAPO's separate low/high clip and
    dual clip (Ye et al. 1912.09729).

    r_t = exp(logp_t - old_t); loss_t = max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high));
    for A_t < 0 loss_t = min(loss_t, -A_t c) with c = clip_ratio_c. Metrics: clip_frac_low = share
    of valid tokens with A < 0 and r < 1 - eps_low, clip_frac_high = A > 0 and r > 1 + eps_high (the
    tokens whose clip is active, veRL's pg_clipfrac split by side; clip_frac = their sum),
    dual_clip_frac = A < 0 and the dual bound active; approx_kl_old = k1 = mean(old - logp) as
    veRL's ppo_kl (k3 in approx_kl_old_k3).
    """
    mask = mb["response_mask"]
    low, high, c = _clips(cfg)
    log_ratio = _log_ratio(logp, mb["old_log_probs"].to(logp.dtype), mask)
    ratio = torch.exp(log_ratio)
    adv = zero_pad(mb["advantages"].to(logp.dtype), mask)
    loss, cl, ch, dual = _clipped_surrogate(ratio, adv, low, high, c)
    loss = zero_pad(loss, mask)
    with torch.no_grad():
        metrics = _ratio_metrics(log_ratio, ratio, mask, cl, ch, dual)
    return loss, metrics


# --- GSPO -----------------------------------------------------------------------------------------
def _seq_log_ratio(logp, old, mask):
    """(B,) length-normalised sequence log-ratio mean_t(logp - old) over valid tokens (0 for an
    empty row), clamped."""
    m = as_bool(mask)
    lengths = m.sum(-1).clamp(min=1).to(logp.dtype)
    return (zero_pad(logp - old, m).sum(-1) / lengths).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _seq_metrics(seq_ratio, token_log_ratio, mask, cl, ch) -> dict[str, float]:
    m = as_bool(mask)
    rows = m.any(-1)
    f = seq_ratio.dtype
    sr = seq_ratio.detach()[rows]
    bcast = lambda x: x.unsqueeze(-1).expand(m.shape).to(f)  # noqa: E731
    tr = torch.exp(token_log_ratio.detach())
    return {
        # share of valid tokens in clipped sequences (what the GSPO paper compares with GRPO)
        "actor/clip_frac_low": masked_mean(bcast(cl), m).item(),
        "actor/clip_frac_high": masked_mean(bcast(ch), m).item(),
        "actor/clip_frac": masked_mean(bcast(cl | ch), m).item(),
        "actor/seq_clip_frac": (cl | ch)[rows].to(f).mean().item() if rows.any() else 0.0,
        "actor/seq_ratio_mean": sr.mean().item() if rows.any() else 0.0,
        "actor/seq_ratio_max": sr.max().item() if rows.any() else 0.0,
        "actor/seq_ratio_min": sr.min().item() if rows.any() else 0.0,
        "actor/approx_kl_old": masked_mean(-token_log_ratio.detach(), m).item(),
        "actor/ratio_mean": masked_mean(tr, m).item(),
        "actor/ratio_max": masked_max(tr, m),
        "actor/ratio_min": masked_min(tr, m),
    }


@POLICY_LOSSES.register("gspo")
def gspo_loss(logp: torch.Tensor, mb: Batch, cfg) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO (Zheng et al. 2507.18071), sequence level: s_i = exp(mean_t(logp - old)), A_i = mean_t
    A_{i,t}, loss_i = max(-A_i s_i, -A_i clip(s_i, 1 - eps_low, 1 + eps_high)) on every valid token
    of row i.

    Differs from veRL: veRL's "gspo" is the GSPO-token form (see "gspo_token"); here the gradient
    flows through s_i itself. No dual clip. The paper's objective is this loss with loss_agg
    "seq-mean-token-mean" (1/G sum_i loss_i); the paper uses eps of 3e-4 / 4e-4.
    """
    mask = mb["response_mask"]
    m = as_bool(mask)
    low, high, _ = _clips(cfg)
    old = mb["old_log_probs"].to(logp.dtype)
    seq_lr = _seq_log_ratio(logp, old, m)
    s = torch.exp(seq_lr)
    adv_seq = masked_mean(mb["advantages"].to(logp.dtype), m, dim=-1)
    loss_seq, cl, ch, _ = _clipped_surrogate(s, adv_seq, low, high, None)
    loss = zero_pad(loss_seq.unsqueeze(-1).expand(m.shape), m)
    with torch.no_grad():
        metrics = _seq_metrics(s, _log_ratio(logp, old, m), m, cl, ch)
    return loss, metrics


@POLICY_LOSSES.register("gspo_token")
def gspo_token_loss(logp: torch.Tensor, mb: Batch, cfg) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO-token (2507.18071 eq. 13): s_{i,t} = sg[s_i] exp(logp_t - sg[logp_t]) (value s_i,
    gradient of a token-level ratio), loss_t = max(-A_t s_{i,t}, -A_t clip(s_{i,t}, 1 - eps_low, 1 +
    eps_high)) with the per-token advantages. With advantages constant over a sequence its gradient
    equals GSPO's. No dual clip. As veRL's "gspo", log s_{i,t} is clamped from above at
    GSPO_TOKEN_LOG_RATIO_MAX (10) before exp: s_{i,t} <= e^10, and a token beyond the bound gets no
    gradient (its sequence is far off-policy).
    """
    mask = mb["response_mask"]
    m = as_bool(mask)
    low, high, _ = _clips(cfg)
    old = mb["old_log_probs"].to(logp.dtype)
    seq_lr = _seq_log_ratio(logp, old, m).detach()
    lp = zero_pad(logp, m)
    tok_lr = (seq_lr.unsqueeze(-1) + lp - lp.detach()).clamp(max=GSPO_TOKEN_LOG_RATIO_MAX)
    s_tok = torch.exp(tok_lr)  # value min(s_i, e^10)
    adv = zero_pad(mb["advantages"].to(logp.dtype), m)
    loss, cl_t, ch_t, _ = _clipped_surrogate(s_tok, adv, low, high, None)
    loss = zero_pad(loss, m)
    with torch.no_grad():
        s = torch.exp(seq_lr)
        metrics = _seq_metrics(
            s,
            _log_ratio(logp, old, m),
            m,
            torch.zeros_like(s, dtype=torch.bool),
            torch.zeros_like(s, dtype=torch.bool),
        )
        f = logp.dtype
        # clipping is decided per token here (the sign of A_t can vary along a sequence)
        metrics["actor/clip_frac_low"] = masked_mean(cl_t.to(f), m).item()
        metrics["actor/clip_frac_high"] = masked_mean(ch_t.to(f), m).item()
        metrics["actor/clip_frac"] = masked_mean((cl_t | ch_t).to(f), m).item()
        rows = m.any(-1)
        metrics["actor/seq_clip_frac"] = (
            ((cl_t | ch_t) & m).any(-1)[rows].to(f).mean().item() if rows.any() else 0.0
        )
    return loss, metrics


# --- decoupled PPO (AReaL) ------------------------------------------------------------------------
@POLICY_LOSSES.register("decoupled_ppo")
def decoupled_ppo_loss(logp: torch.Tensor, mb: Batch, cfg) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled PPO (AReaL, Fu et al. 2505.24298): behaviour mu = rollout_log_probs, proximal =
    old_log_probs.

    w = exp(prox - mu) (no gradient), u = exp(logp - prox), loss = w * max(-A u, -A clip(u, 1 -
    eps_low, 1 + eps_high)) (= -w min(u A, clip(u) A)), plus the dual clip for A < 0 when
    clip_ratio_c is set, as AReaL's c_clip. With ``behav_imp_weight_cap`` set, tokens with w > cap
    get weight 0 (dropped from the loss but still counted by the aggregation's denominators), as
    AReaL does. With mu = prox it is exactly "ppo_clip". Metrics: behav_weight_mean / max over valid
    tokens before the cap, behav_capped_frac the dropped share.
    """
    mask = mb["response_mask"]
    m = as_bool(mask)
    low, high, c = _clips(cfg)
    prox = mb["old_log_probs"].to(logp.dtype)
    behav_lr = _log_ratio(prox, mb["rollout_log_probs"].to(logp.dtype), m).detach()
    w = torch.exp(behav_lr)
    cap = cfg.behav_imp_weight_cap
    keep = m & (w <= cap) if cap is not None else m
    w_used = zero_pad(w, keep)
    log_ratio = _log_ratio(logp, prox, m)
    u = torch.exp(log_ratio)
    adv = zero_pad(mb["advantages"].to(logp.dtype), m)
    pg, cl, ch, dual = _clipped_surrogate(u, adv, low, high, c)
    loss = zero_pad(pg * w_used, m)
    with torch.no_grad():
        metrics = _ratio_metrics(log_ratio, u, m, cl, ch, dual)
        f = logp.dtype
        metrics |= {
            "actor/behav_weight_mean": masked_mean(w, m).item(),
            "actor/behav_weight_max": masked_max(w, m),
            "actor/behav_capped_frac": masked_mean((m & ~keep).to(f), m).item(),
            # k1 of mu vs prox: mean(mu - prox)
            "actor/behav_approx_kl": masked_mean(-behav_lr, m).item(),
        }
    return loss, metrics


# --- critic ---------------------------------------------------------------------------------------
def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss (as veRL / TRL): 0.5 max((V - G)^2, (clip(V, V_old - c, V_old + c) -
    G)^2), 0 on padding.

    ``clip`` None or 0 disables the clipped branch (0.5 (V - G)^2). vf_clip_frac = share of valid
    tokens where the clipped branch is the larger one.
    """
    m = as_bool(mask)
    v = zero_pad(values, m)
    g = zero_pad(returns.to(v.dtype), m)
    l1 = (v - g).square()
    if clip:
        old = zero_pad(old_values.to(v.dtype), m)
        v_clipped = torch.maximum(torch.minimum(v, old + clip), old - clip)
        l2 = (v_clipped - g).square()
        loss = 0.5 * torch.maximum(l1, l2)
        clipped = l2 > l1
    else:
        loss = 0.5 * l1
        clipped = torch.zeros_like(m)
    loss = zero_pad(loss, m)
    with torch.no_grad():
        metrics = {
            "critic/vf_clip_frac": masked_mean(clipped.to(v.dtype), m).item(),
            "critic/vpred_mean": masked_mean(v.detach(), m).item(),
        }
    return loss, metrics
