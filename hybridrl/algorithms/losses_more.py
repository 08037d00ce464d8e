"""More policy losses in the ``POLICY_LOSSES`` registry: CISPO, GMPO, Clip-Cov, KL-Cov and SAPO.

Same contract as ``losses.py``: ``fn(logp, mb, cfg) -> (per_token_loss (B, R), metrics)``, zero on
padding (and blind to what padded positions hold), every log-ratio clamped to +-20 before ``exp``,
aggregation left to ``algorithm.loss_agg``. Hyper-parameters are fields of ``cfg`` (the
``AlgorithmConfig``).

Clip-Cov and KL-Cov pick tokens by a statistic of the batch they see (the covariance between
log-prob and advantage, centred by the batch's means, and a share of its tokens). Here, as in veRL,
that batch is the micro-batch, so those two losses, unlike the others, depend on
``actor.micro_batch_tokens``.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from hybridrl.algorithms.losses import (
    POLICY_LOSSES,
    _clipped_surrogate,
    _log_ratio,
    _ratio_metrics,
)
from hybridrl.algorithms.masking import as_bool, masked_max, masked_mean, masked_min, zero_pad
from hybridrl.algorithms.rollout_correction import WEIGHT_KEY
from hybridrl.protocol import Batch
from hybridrl.registry import option

# gmpo: log(w + floor) keeps a dropped token's rollout weight (0) finite in the geometric mean
GMPO_WEIGHT_FLOOR = 1e-10


# --- helpers --------------------------------------------------------------------------------------
def _inputs(logp: torch.Tensor, mb: Batch):
    """Valid-token mask, clamped log-ratio logp - old (0 on padding), ratio and advantages (0 on
    padding)."""
    m = as_bool(mb["response_mask"])
    log_ratio = _log_ratio(logp, mb["old_log_probs"].to(logp.dtype), m)
    adv = zero_pad(mb["advantages"].to(logp.dtype), m)
    return m, log_ratio, torch.exp(log_ratio), adv


def _kl_and_ratio_metrics(
    log_ratio: torch.Tensor, ratio: torch.Tensor, m: torch.Tensor
) -> dict[str, float]:
    return {
        "actor/approx_kl_old": masked_mean(-log_ratio, m).item(),
        "actor/approx_kl_old_k3": masked_mean(torch.expm1(log_ratio) - log_ratio, m).item(),
        "actor/ratio_mean": masked_mean(ratio, m).item(),
        "actor/ratio_max": masked_max(ratio, m),
        "actor/ratio_min": masked_min(ratio, m),
    }


def _clip_metrics(
    low: torch.Tensor, high: torch.Tensor, m: torch.Tensor, dtype
) -> dict[str, float]:
    return {
        "actor/clip_frac_low": masked_mean(low.to(dtype), m).item(),
        "actor/clip_frac_high": masked_mean(high.to(dtype), m).item(),
        "actor/clip_frac": masked_mean((low | high).to(dtype), m).item(),
    }


# --- CISPO ----------------------------------------------------------------------------------------
@dataclass
class CispoOptions:
    clip_low: float | None = option(
        None,
        "the detached IS weight is >= 1 - clip_low (null: no lower bound, as the CISPO paper)",
        ge=0,
        le=1,
    )
    clip_high: float = option(0.28, "the detached IS weight is <= 1 + clip_high", ge=0)


@POLICY_LOSSES.register("cispo")
def cispo_loss(logp: torch.Tensor, mb: Batch, cfg) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1, 2506.13585): loss_t = -sg[clip(r_t, 1 - eps_low, 1 + eps_high)] A_t
    logp_t.

    A REINFORCE update weighted by a truncated, detached IS weight: unlike PPO no token loses its
    gradient; clipping only bounds the weight. ``clip_low`` None: no lower bound (the paper
    tunes only the upper one). The loss value is not on the ratio scale (it has log-probs in it);
    its gradient is -w A grad logp. Metrics: clip_frac_high / clip_frac_low = share of valid tokens
    whose weight was truncated from above / below (whatever the sign of A: the weight is truncated,
    not the objective).
    """
    o = cfg.options(CispoOptions, "policy_loss")
    low, high = o.clip_low, o.clip_high
    m, log_ratio, ratio, adv = _inputs(logp, mb)
    lo = None if low is None else 1.0 - low
    weight = ratio.clamp(min=lo, max=1.0 + high).detach()
    loss = zero_pad(-weight * adv * zero_pad(logp, m), m)
    with torch.no_grad():
        below = (ratio < lo) if lo is not None else torch.zeros_like(m)
        metrics = _clip_metrics(below & m, (ratio > 1.0 + high) & m, m, logp.dtype)
        metrics |= _kl_and_ratio_metrics(log_ratio, ratio, m)
        metrics["actor/is_weight_mean"] = masked_mean(weight, m).item()
    return loss, metrics


cispo_loss.options = CispoOptions


# --- GMPO -----------------------------------------------------------------------------------------
@dataclass
class GmpoOptions:
    log_clip_low: float = option(
        0.4, "token log-ratios are clipped at -log_clip_low (log space; the paper's 0.4)", gt=0
    )
    log_clip_high: float = option(0.4, "token log-ratios are clipped at +log_clip_high", gt=0)


@POLICY_LOSSES.register("gmpo")
def gmpo_loss(logp: torch.Tensor, mb: Batch, cfg) -> tuple[torch.Tensor, dict[str, float]]:
    """GMPO (Zhao et al. 2507.20673): the geometric mean of the token terms instead of their
    arithmetic mean.

    With A_i = mean_t A_{i,t} and sgn = sign(A_i), each token's log-ratio l_t is clipped in log
    space, pessimistically for the sign of A_i: c_t = sgn min(sgn l_t, sgn clip(l_t, -eps_low,
    eps_high)) (for A > 0 min(l, clip(l)), for A < 0 max(l, clip(l))). The paper's (prod_t |min(r_t
    A, clip(r_t) A)|)^(1/|y|) sgn(A) is then A_i exp(mean_t c_t), so loss_i = -A_i exp(mean_t c_t),
    put on every valid token of row i. eps: ``log_clip_low`` / ``log_clip_high`` (0.4,
    i.e. r in [e^-0.4, e^0.4], the paper's wide range). The paper's 1/G sum_i is ``loss_agg:
    seq-mean-token-mean``. Metrics: clip_frac_high = valid tokens with A_i > 0 and l_t > eps_high,
    clip_frac_low = A_i < 0 and l_t < -eps_low (their gradient is 0); seq_ratio_* = exp(mean_t c_t)
    over non-empty rows.

    Rollout weights (``algorithm.rollout_is``) enter as their geometric mean over the row's valid
    tokens, g_i = exp(mean_t log(w_t + 1e-10)) (veRL's floor: a dropped token, w = 0, counts as
    1e-10, not as -inf), so loss_i = -A_i exp(mean_t c_t) g_i = -A_i exp(mean_t (c_t + log w_t)):
    the objective stays the geometric mean of the weighted token terms. The learner therefore does
    not multiply the tokens by w_t again (``weighs_rollout``).
    """
    o = cfg.options(GmpoOptions, "policy_loss")
    lo, hi = o.log_clip_low, o.log_clip_high
    m, log_ratio, ratio, _ = _inputs(logp, mb)
    adv_seq = masked_mean(mb["advantages"].to(logp.dtype), m, dim=-1)
    sgn = torch.sign(adv_seq).unsqueeze(-1)
    clipped = sgn * torch.minimum(sgn * log_ratio, sgn * log_ratio.clamp(-lo, hi))
    lengths = m.sum(-1).clamp(min=1).to(logp.dtype)
    seq_ratio = torch.exp(zero_pad(clipped, m).sum(-1) / lengths)  # |c_t| <= 20: finite
    loss_seq = -adv_seq * seq_ratio
    if WEIGHT_KEY in mb:
        log_w = torch.log(mb[WEIGHT_KEY].to(logp.dtype).detach() + GMPO_WEIGHT_FLOOR)
        loss_seq = loss_seq * torch.exp(zero_pad(log_w, m).sum(-1) / lengths)
    loss = zero_pad(loss_seq.unsqueeze(-1).expand(m.shape), m)
    with torch.no_grad():
        f = logp.dtype
        metrics = _clip_metrics(
            (sgn < 0) & (log_ratio < -lo) & m, (sgn > 0) & (log_ratio > hi) & m, m, f
        )
        metrics |= _kl_and_ratio_metrics(log_ratio, ratio, m)
        rows = m.any(-1)
        sr = seq_ratio[rows]
        metrics |= {
            "actor/seq_ratio_mean": sr.mean().item() if rows.any() else 0.0,
            "actor/seq_ratio_max": sr.max().item() if rows.any() else 0.0,
            "actor/seq_ratio_min": sr.min().item() if rows.any() else 0.0,
        }
    return loss, metrics


# the rollout weights are applied here, as a geometric mean per row
gmpo_loss.weighs_rollout = True
gmpo_loss.options = GmpoOptions


# --- Clip-Cov and KL-Cov --------------------------------------------------------------------------
def _token_cov(logp: torch.Tensor, adv: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """(A_t - mean A)(logp_t - mean logp) per valid token, means over the valid tokens; 0 on
    padding. No gradient."""
    lp = zero_pad(logp.detach(), m)
    return zero_pad((adv - masked_mean(adv, m)) * (lp - masked_mean(lp, m)), m)


def _n_selected(share: float, m: torch.Tensor) -> int:
    """int(share * valid tokens), at least 1 when there is a valid token (veRL's rule)."""
    n = int(m.sum().item())
    return max(int(share * n), 1) if n else 0


def _derived_generator(mb: Batch, seed: int) -> torch.Generator:
    """A generator seeded by ``seed`` and a hash of the micro-batch's valid old log-probs
    and advantages: a re-run or a resumed run cuts the same tokens, different micro-batches get
    different draws, and the global RNG is left alone."""
    m = as_bool(mb["response_mask"])
    data = torch.stack(
        [zero_pad(mb["old_log_probs"], m).double(), zero_pad(mb["advantages"], m).double()]
    )
    seed = zlib.crc32(data.cpu().numpy().tobytes(), int(seed) & 0xFFFFFFFF)
    return torch.Generator().manual_seed(seed)


def _random_subset(candidates: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
    """A boolean mask of min(k, #candidates) candidates drawn uniformly without replacement."""
    flat = candidates.flatten()
    idx = flat.nonzero().squeeze(-1)
    out = torch.zeros_like(flat)
    if k and idx.numel():
        perm = torch.randperm(idx.numel(), generator=generator)[:k].to(idx.device)
        out[idx[perm]] = True
    return out.view_as(candidates)


@dataclass
class ClipCovOptions:
    ratio: float = option(
        2e-4,
        "share of a micro-batch's valid tokens whose gradient is cut (at least one)",
        gt=0,
        le=1,
    )
    lb: float = option(1.0, "only tokens with covariance above this are candidates")
    ub: float = option(5.0, "only tokens with covariance below this are candidates (must be > lb)")
    seed: int = option(
        0,
        "seed of the random choice among candidates (mixed with a hash of the micro-batch)",
        ge=0,
        le=2**63 - 1,  # torch.Generator seeds are 64-bit
    )

    def __post_init__(self):
        if not self.lb < self.ub:
            raise ValueError(
                f"lb ({self.lb}) must be below ub ({self.ub}): the candidates have a covariance "
                "between the two"
            )


@POLICY_LOSSES.register("clip_cov")
def clip_cov_loss(
    logp: torch.Tensor, mb: Batch, cfg, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clip-Cov (Cui et al. 2505.22617, "The Entropy Mechanism of RL for Reasoning LMs").

    Per valid token, cov_t = (A_t - mean A)(logp_t - mean logp) over the micro-batch's valid tokens.
    Among the tokens with lb < cov_t < ub that the PPO clip has not already cut, n
    = max(int(ratio * N), 1) are drawn at random and their loss is set to 0 (no gradient):
    high- covariance tokens are the ones that drive entropy down. The others get the PPO loss with
    clip_ratio_low / clip_ratio_high (no dual clip), as veRL. The draw uses ``generator`` when
    given, else one derived from ``seed`` and the micro-batch (never the global RNG).
    Metrics: the PPO clip fractions, cov_clip_frac (share of valid tokens cut), cov_mean (mean of
    cov_t).
    """
    o = cfg.options(ClipCovOptions, "policy_loss")
    share, lb, ub = o.ratio, o.lb, o.ub
    low, high = cfg.clip_ratio_low, cfg.clip_ratio_high
    m, log_ratio, ratio, adv = _inputs(logp, mb)
    loss, cl, ch, dual = _clipped_surrogate(ratio, adv, low, high, None)
    with torch.no_grad():
        cov = _token_cov(logp, adv, m)
        candidates = m & ~(cl | ch) & (cov > lb) & (cov < ub)
        if generator is None:
            generator = _derived_generator(mb, o.seed)
        cut = _random_subset(candidates, _n_selected(share, m), generator)
    loss = zero_pad(
        torch.where(cut, torch.zeros((), dtype=loss.dtype, device=loss.device), loss), m
    )
    with torch.no_grad():
        metrics = _ratio_metrics(log_ratio, ratio, m, cl & m, ch & m, dual)
        metrics |= {
            "actor/cov_clip_frac": masked_mean(cut.to(logp.dtype), m).item(),
            "actor/cov_mean": masked_mean(cov, m).item(),
        }
    return loss, metrics


clip_cov_loss.options = ClipCovOptions


@dataclass
class KlCovOptions:
    ratio: float = option(
        2e-3,
        "share of a micro-batch's valid tokens, those of highest covariance, that get the KL "
        "penalty (at least one)",
        gt=0,
        le=1,
    )
    coef: float = option(1.0, "weight of |log pi - log pi_old| on the selected tokens", ge=0)


@POLICY_LOSSES.register("kl_cov")
def kl_cov_loss(logp: torch.Tensor, mb: Batch, cfg) -> tuple[torch.Tensor, dict[str, float]]:
    """KL-Cov (Cui et al. 2505.22617): loss_t = -A_t r_t, plus coef |logp_t - old_t| on the
    max(int(ratio * N), 1) valid tokens of largest cov_t (as in clip_cov), N the
    micro-batch's valid tokens. No ratio clip: the KL term on the high-covariance tokens is the
    trust region, as in the paper. Metrics: kl_cov_frac (share of valid tokens penalised), cov_mean,
    kl_cov_abs (mean |logp - old| over the penalised tokens), approx_kl_old_abs (mean |logp - old|
    over all valid tokens: what veRL logs as ``actor/ppo_kl`` for this loss), and the ratio /
    approx_kl metrics.
    """
    o = cfg.options(KlCovOptions, "policy_loss")
    share, coef = o.ratio, o.coef
    m, log_ratio, ratio, adv = _inputs(logp, mb)
    with torch.no_grad():
        cov = _token_cov(logp, adv, m)
        k = _n_selected(share, m)
        picked = torch.zeros_like(m)
        if k:
            top = cov.masked_fill(~m, float("-inf")).flatten().topk(k).indices
            picked.view(-1)[top] = True
    penalty = torch.where(
        picked, coef * log_ratio.abs(), torch.zeros((), dtype=logp.dtype, device=logp.device)
    )
    loss = zero_pad(-adv * ratio + penalty, m)
    with torch.no_grad():
        metrics = _kl_and_ratio_metrics(log_ratio, ratio, m)
        metrics |= {
            "actor/kl_cov_frac": masked_mean(picked.to(logp.dtype), m).item(),
            "actor/kl_cov_abs": masked_mean(log_ratio.abs(), picked).item(),
            "actor/approx_kl_old_abs": masked_mean(log_ratio.abs(), m).item(),
            "actor/cov_mean": masked_mean(cov, m).item(),
        }
    return loss, metrics


kl_cov_loss.options = KlCovOptions


# --- SAPO -----------------------------------------------------------------------------------------
@dataclass
class SapoOptions:
    tau_pos: float = option(1.0, "temperature of the soft gate for positive advantages", gt=0)
    tau_neg: float = option(
        1.05, "temperature of the soft gate for negative and zero advantages", gt=0
    )


@POLICY_LOSSES.register("sapo")
def sapo_loss(logp: torch.Tensor, mb: Batch, cfg) -> tuple[torch.Tensor, dict[str, float]]:
    """SAPO (Gao et al. 2511.20347): a soft gate instead of the hard clip,
    f(r) = sigmoid(tau (r - 1)) 4 / tau, loss_t = -f(r_t) A_t, with tau = tau_pos where A_t > 0
    and tau_neg elsewhere (1.0 / 1.05 as the paper: negative updates are damped faster).

    Its gradient is -A_t w_t r_t grad logp_t with w_t = 4 s (1 - s), s = sigmoid(tau (r_t - 1)): w =
    1 at r = 1 (the plain policy gradient on-policy), decaying smoothly as r leaves 1. The paper
    averages per sequence, then over sequences: ``loss_agg: seq-mean-token-mean``.
    Metrics: gate_weight_mean / gate_weight_min (w_t over valid tokens) and the ratio / approx_kl
    metrics.
    """
    o = cfg.options(SapoOptions, "policy_loss")
    tau_pos, tau_neg = o.tau_pos, o.tau_neg
    m, log_ratio, ratio, adv = _inputs(logp, mb)
    tau = torch.where(adv > 0, torch.full_like(adv, tau_pos), torch.full_like(adv, tau_neg))
    s = torch.sigmoid(tau * (ratio - 1.0))
    loss = zero_pad(-s * (4.0 / tau) * adv, m)
    with torch.no_grad():
        w = 4.0 * s * (1.0 - s)
        metrics = _kl_and_ratio_metrics(log_ratio, ratio, m)
        metrics |= {
            "actor/gate_weight_mean": masked_mean(w, m).item(),
            "actor/gate_weight_min": masked_min(w, m),
        }
    return loss, metrics


sapo_loss.options = SapoOptions
