"""Advantage estimators: ``fn(batch, cfg) -> {"advantages": (B, R), ...}``, zero on padding.

Inputs are the (B, R) response-token tensors ``token_level_rewards`` (the score at
the row's last valid token, minus a KL penalty when KL is in the reward),
``response_mask`` (1 = real token) and, for GAE, ``values``; samples of one
prompt share a ``uid`` (group id) and groups are found by uid, never by
position in the batch. Every returned per-token tensor is zero on padding and
does not depend on what the inputs hold there.

Conventions follow veRL's ``core_algos``: the group std is the unbiased one
with eps added to the std, a group of size one has mean 0 and std 1, and
whitening uses the masked mean and the unbiased masked variance over the
valid tokens of the whole batch.
"""
from __future__ import annotations

from collections import defaultdict

import torch

from hybridrl.protocol import Batch
from hybridrl.registry import Registry

ADVANTAGES = Registry("advantage estimator")


# --- helpers -----------------------------------------------------------------------------------
def _bool(mask: torch.Tensor) -> torch.Tensor:
    return mask.bool() if mask.dtype != torch.bool else mask


def _masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` with padded positions set to 0 (``where``, so inf/NaN in padding cannot leak)."""
    return torch.where(_bool(mask), x, torch.zeros((), dtype=x.dtype, device=x.device))


def token_level_scores(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(B,) scores -> (B, R): each score at its row's last valid token, 0 elsewhere.

    A row with no valid token is all zero (its score has nowhere to go).
    """
    mask = _bool(response_mask)
    scores = scores.to(torch.get_default_dtype()) if not scores.is_floating_point() else scores
    out = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
    if mask.numel() == 0:
        return out
    pos = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask, pos, torch.full_like(pos, -1)).max(dim=1).values  # (B,), -1 when empty
    has = last >= 0
    rows = torch.nonzero(has).flatten()
    out[rows, last[rows]] = scores[rows]
    return out


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) with the mean and the unbiased variance over valid tokens; 0 on padding.

    As veRL's ``masked_whiten`` (shift_mean=True, Bessel-corrected variance, eps inside the sqrt).
    With a single valid token the variance is taken as 0 (veRL would divide by zero), so the
    output is 0; with none the output is all zero.
    """
    m = _bool(mask)
    xd = _masked(x, m).double()
    n = m.sum()
    if n == 0:
        return torch.zeros_like(x)
    mean = xd.sum() / n
    sq = _masked((xd - mean).square(), m).sum()
    var = sq / (n - 1) if n > 1 else torch.zeros((), dtype=xd.dtype, device=xd.device)
    out = (xd - mean) * torch.rsqrt(var + eps)
    return _masked(out, m).to(x.dtype)


def _groups(uids: list) -> dict:
    groups: dict = defaultdict(list)
    for i, u in enumerate(uids):
        groups[u].append(i)
    return groups


def group_normalise(scores: torch.Tensor, uids: list, norm_by_std: bool, eps: float = 1e-6) -> torch.Tensor:
    """(score - group mean) [/ (group std + eps)] per uid.

    Conventions follow veRL's ``core_algos``: the std is the unbiased one,
    and a group of size one gets mean 0 and std 1 (its advantage is its score).
    """
    if len(uids) != scores.shape[0]:
        raise ValueError(f"group_normalise: {len(uids)} uids for {scores.shape[0]} scores")
    sd = scores.double()
    out = torch.empty_like(sd)
    for rows in _groups(uids).values():
        idx = torch.tensor(rows, device=sd.device)
        s = sd[idx]
        if len(rows) == 1:
            mean, std = torch.zeros((), dtype=sd.dtype), torch.ones((), dtype=sd.dtype)
        else:
            mean, std = s.mean(), s.std()
        out[idx] = (s - mean) / (std + eps) if norm_by_std else s - mean
    return out.to(scores.dtype if scores.is_floating_point() else torch.float32)


def group_mean_baseline(scores: torch.Tensor, uids: list) -> torch.Tensor:
    """score - group mean per uid; a group of size one keeps its score (mean 0, veRL)."""
    return group_normalise(scores, uids, norm_by_std=False)


def _sequence_scores(batch: Batch) -> torch.Tensor:
    """(B,) outcome score per row: ``token_level_rewards`` summed over valid tokens.

    Falls back to a (B,) ``rewards`` column when the batch has no ``token_level_rewards``.
    """
    mask = batch["response_mask"]
    if "token_level_rewards" in batch:
        return _masked(batch["token_level_rewards"], mask).sum(-1)
    if "rewards" in batch:
        r = batch["rewards"]
        return r.float() if not r.is_floating_point() else r
    raise KeyError("advantage estimator needs 'token_level_rewards' (B, R) in the batch")


def _broadcast(seq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) -> (B, R) on valid tokens, 0 on padding."""
    return _masked(seq.unsqueeze(-1).expand(mask.shape), mask)


# --- estimators ------------------------------------------------------------------------------------
@ADVANTAGES.register("grpo")
def grpo_advantage(batch: Batch, cfg) -> dict[str, torch.Tensor]:
    """GRPO outcome advantage (Shao et al. 2402.03300): (r - mean_g) / (std_g + 1e-6), broadcast to tokens.

    ``cfg.norm_adv_by_std=False`` drops the std division (Dr.GRPO, Liu et al. 2503.20783).
    """
    adv = group_normalise(_sequence_scores(batch), batch["uid"], getattr(cfg, "norm_adv_by_std", True))
    return {"advantages": _broadcast(adv, batch["response_mask"])}


@ADVANTAGES.register("dr_grpo")
def dr_grpo_advantage(batch: Batch, cfg) -> dict[str, torch.Tensor]:
    """Dr.GRPO (Liu et al. 2503.20783): r - mean_g, never divided by the std."""
    adv = group_normalise(_sequence_scores(batch), batch["uid"], norm_by_std=False)
    return {"advantages": _broadcast(adv, batch["response_mask"])}


@ADVANTAGES.register("rloo")
def rloo_advantage(batch: Batch, cfg) -> dict[str, torch.Tensor]:
    """RLOO (Ahmadian et al. 2402.14740): A_i = r_i - mean_{j != i} r_j = n/(n-1) (r_i - mean_g).

    A group of size one has no baseline: A = r (as veRL).
    """
    scores = _sequence_scores(batch)
    sd = scores.double()
    out = sd.clone()
    for rows in _groups(batch["uid"]).values():
        if len(rows) > 1:
            idx = torch.tensor(rows, device=sd.device)
            s = sd[idx]
            out[idx] = (s * len(rows) - s.sum()) / (len(rows) - 1)
    return {"advantages": _broadcast(out.to(scores.dtype), batch["response_mask"])}


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma G_{t+1} over valid tokens; the sum restarts after a padded position (veRL); 0 on padding."""
    m = _bool(mask)
    r = _masked(rewards, m)
    out = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0]) if r.shape[1] else None
    for t in reversed(range(r.shape[1])):
        running = r[:, t] + gamma * running
        running = torch.where(m[:, t], running, torch.zeros_like(running))
        out[:, t] = running
    return out


@ADVANTAGES.register("reinforce_pp")
def reinforce_pp_advantage(batch: Batch, cfg) -> dict[str, torch.Tensor]:
    """REINFORCE++ (Hu 2501.03262): discounted returns G_t, whitened over the batch's valid tokens.

    Also returns ``returns`` (the unwhitened G).
    """
    mask = batch["response_mask"]
    returns = discounted_returns(batch["token_level_rewards"], mask, getattr(cfg, "gamma", 1.0))
    return {"advantages": masked_whiten(returns, mask), "returns": returns}


@ADVANTAGES.register("reinforce_pp_baseline")
def reinforce_pp_baseline_advantage(batch: Batch, cfg) -> dict[str, torch.Tensor]:
    """REINFORCE++-baseline (Hu 2501.03262): (r - group mean) broadcast to tokens, whitened over the batch."""
    mask = batch["response_mask"]
    centred = group_mean_baseline(_sequence_scores(batch), batch["uid"])
    return {"advantages": masked_whiten(_broadcast(centred, mask), mask)}


@ADVANTAGES.register("gae")
def gae_advantage(batch: Batch, cfg) -> dict[str, torch.Tensor]:
    """GAE (Schulman et al. 1506.02438): delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1}.

    ``values[:, t]`` is the value of the state before response token t. "t+1" is the next valid
    token (padded positions are skipped, as veRL does), and the value after the last valid token
    is 0. ``returns = A + V`` (unwhitened, the critic's target); ``advantages = masked_whiten(A)``.
    """
    m = _bool(batch["response_mask"])
    r = _masked(batch["token_level_rewards"], m)
    v = _masked(batch["values"], m).to(r.dtype)
    gamma, lam = getattr(cfg, "gamma", 1.0), getattr(cfg, "lam", 1.0)
    adv = torch.zeros_like(r)
    next_v = torch.zeros_like(r[:, 0]) if r.shape[1] else None
    next_a = torch.zeros_like(next_v) if next_v is not None else None
    for t in reversed(range(r.shape[1])):
        delta = r[:, t] + gamma * next_v - v[:, t]
        a = delta + gamma * lam * next_a
        valid = m[:, t]
        next_v = torch.where(valid, v[:, t], next_v)
        next_a = torch.where(valid, a, next_a)
        adv[:, t] = torch.where(valid, a, torch.zeros_like(a))
    returns = _masked(adv + v, m)
    return {"advantages": masked_whiten(adv, m), "returns": returns}


gae_advantage.needs_values = True  # the driver creates the critic role for estimators that say so


def compute_advantages(batch: Batch, cfg) -> Batch:
    """The batch plus every tensor the estimator named by ``cfg.advantage`` returns (``advantages``, maybe ``returns``).

    A returned column replaces a column of the same name (advantages can be recomputed).
    An estimator may also return a bare tensor, taken as ``advantages``.
    """
    out = ADVANTAGES.get(cfg.advantage)(batch, cfg)
    if isinstance(out, torch.Tensor):
        out = {"advantages": out}
    return Batch({**batch.tensors, **out}, batch.meta)
