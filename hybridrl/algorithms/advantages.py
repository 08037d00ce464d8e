"""Advantage estimators: ``fn(batch, cfg) -> {"advantages": (B, R), ...}``, zero on padding;
``cfg`` is the ``AlgorithmConfig``.

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

An estimator declares what the driver must provide with attributes, never by
its name: ``needs_values`` (the critic role and a ``values`` column),
``needs_greedy_baseline`` (one greedy sample per prompt, scored, as a per-row
``baseline_rewards`` column) and ``min_group_size`` (checked at config time).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from hybridrl.algorithms.masking import as_bool, zero_pad
from hybridrl.protocol import Batch
from hybridrl.registry import Registry, option

ADVANTAGES = Registry("advantage estimator")


# --- helpers -----------------------------------------------------------------------------------
def overlong_penalty(
    lengths: torch.Tensor, max_len: int, buffer: int, factor: float
) -> torch.Tensor:
    """DAPO (2503.14476) soft overlong punishment: 0 up to max_len - buffer, then linear down to
    -factor at max_len."""
    if buffer <= 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    expected = max_len - buffer
    return (-(lengths.float() - expected) / buffer * factor).clamp(min=-factor, max=0.0)


def token_level_scores(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(B,) scores -> (B, R): each score at its row's last valid token, 0 elsewhere.

    A row with no valid token is all zero (its score has nowhere to go).
    """
    mask = as_bool(response_mask)
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


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8, shift_mean: bool = True
) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) with the mean and the unbiased variance over valid tokens; 0 on
    padding.

    As veRL's ``masked_whiten`` (Bessel-corrected variance, eps inside the sqrt).
    ``shift_mean=False`` adds the mean back after scaling, (x - mean) / sqrt(var + eps) + mean,
    exactly as veRL and TRL define it (the unscaled mean, not mean / std): the spread becomes 1 but
    the batch keeps its mean, so a batch of mostly good samples keeps mostly positive advantages.
    With a single valid token the variance is taken as 0 (veRL raises ValueError), so the output is
    0 (the mean with ``shift_mean=False``); with none the output is all zero.
    """
    m = as_bool(mask)
    xd = zero_pad(x, m).double()
    n = m.sum()
    if n == 0:
        return torch.zeros_like(x)
    mean = xd.sum() / n
    sq = zero_pad((xd - mean).square(), m).sum()
    var = sq / (n - 1) if n > 1 else torch.zeros((), dtype=xd.dtype, device=xd.device)
    out = (xd - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return zero_pad(out, m).to(x.dtype)


def _whiten(x: torch.Tensor, mask: torch.Tensor, cfg) -> torch.Tensor:
    """``masked_whiten`` with the estimator config's ``whiten_shift_mean``."""
    return masked_whiten(x, mask, shift_mean=cfg.whiten_shift_mean)


def group_rows(uids: Sequence) -> list[list[int]]:
    """The row indices of each group (rows sharing a uid), groups in order of first appearance."""
    groups: dict = defaultdict(list)
    for i, u in enumerate(uids):
        groups[u].append(i)
    return list(groups.values())


def group_normalise(
    scores: torch.Tensor, uids: list, norm_by_std: bool, eps: float = 1e-6
) -> torch.Tensor:
    """(score - group mean) [/ (group std + eps)] per uid.

    Conventions follow veRL's ``core_algos``: the std is the unbiased one,
    and a group of size one gets mean 0 and std 1 (its advantage is its score).
    """
    if len(uids) != scores.shape[0]:
        raise ValueError(f"group_normalise: {len(uids)} uids for {scores.shape[0]} scores")
    sd = scores.double()
    out = torch.empty_like(sd)
    for rows in group_rows(uids):
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
        return zero_pad(batch["token_level_rewards"], mask).sum(-1)
    if "rewards" in batch:
        r = batch["rewards"]
        return r.float() if not r.is_floating_point() else r
    raise KeyError("advantage estimator needs 'token_level_rewards' (B, R) in the batch")


def _broadcast(seq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) -> (B, R) on valid tokens, 0 on padding."""
    return zero_pad(seq.unsqueeze(-1).expand(mask.shape), mask)


# --- estimators -----------------------------------------------------------------------------------
@ADVANTAGES.register("grpo")
def grpo_advantage(batch: Batch, cfg) -> dict[str, torch.Tensor]:
    """GRPO outcome advantage (Shao et al. 2402.03300): (r - mean_g) / (std_g + 1e-6), broadcast
    to tokens.

    ``cfg.norm_adv_by_std=False`` drops the std division: that is ``dr_grpo``.
    """
    return _group_outcome_advantage(batch, norm_by_std=cfg.norm_adv_by_std)


@ADVANTAGES.register("dr_grpo")
def dr_grpo_advantage(batch: Batch, cfg) -> dict[str, torch.Tensor]:
    """Dr.GRPO (Liu et al. 2503.20783): r - mean_g, never divided by the std; ``grpo`` with
    ``norm_adv_by_std=False`` whatever the config says."""
    return _group_outcome_advantage(batch, norm_by_std=False)


def _group_outcome_advantage(batch: Batch, norm_by_std: bool) -> dict[str, torch.Tensor]:
    """The one implementation of ``grpo`` and ``dr_grpo``: the group-normalised outcome score of
    each row on every valid token."""
    adv = group_normalise(_sequence_scores(batch), batch["uid"], norm_by_std)
    return {"advantages": _broadcast(adv, batch["response_mask"])}


# rloo: the advantage of a sample alone in its group, (its score) -> advantage
RLOO_GROUP_OF_ONE = {"score": lambda s: s, "zero": torch.zeros_like}


@dataclass
class RlooOptions:
    group_of_one: Literal["score", "zero"] = option(
        "score",
        "the advantage of a sample alone in its group, which has no other sample to leave out: "
        "score (A = r, veRL's rloo) or zero (A = 0, veRL's rloo_vectorized)",
    )


@ADVANTAGES.register("rloo")
def rloo_advantage(batch: Batch, cfg) -> dict[str, torch.Tensor]:
    """RLOO (Ahmadian et al. 2402.14740): A_i = r_i - mean_{j != i} r_j = n/(n-1) (r_i - mean_g).

    A group of size one has no other sample to leave out; the option ``group_of_one`` decides:
    ``score`` gives A = r (no baseline: veRL's ``rloo``), ``zero`` gives A = 0 (the sample teaches
    nothing without a comparison: veRL's ``rloo_vectorized``).
    """
    scores = _sequence_scores(batch)
    sd = scores.double()
    out = sd.clone()
    alone = RLOO_GROUP_OF_ONE[cfg.options(RlooOptions, "advantage").group_of_one]
    for rows in group_rows(batch["uid"]):
        idx = torch.tensor(rows, device=sd.device)
        s = sd[idx]
        out[idx] = (s * len(rows) - s.sum()) / (len(rows) - 1) if len(rows) > 1 else alone(s)
    return {"advantages": _broadcast(out.to(scores.dtype), batch["response_mask"])}


rloo_advantage.options = RlooOptions


@dataclass
class GdpoOptions:
    reward_keys: list[str] = option(
        [],
        "the reward components normalised one by one, each read from the batch column "
        "reward/<key> (a number a reward function returns beside its score, or a reward "
        "function's name when there are several)",
    )
    reward_weights: list[float] | None = option(
        None, "the weight of each component in the sum (null: 1 each)"
    )

    def __post_init__(self):
        if not self.reward_keys:
            raise ValueError(
                "reward_keys is required: the reward components to normalise one by one "
                "(numbers the reward function returns beside its score)"
            )
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_keys):
            raise ValueError(
                f"reward_weights has {len(self.reward_weights)} entries for "
                f"{len(self.reward_keys)} reward_keys: give one weight per component (or null "
                "for 1 each)"
            )


@ADVANTAGES.register("gdpo")
def gdpo_advantage(batch: Batch, cfg) -> dict[str, torch.Tensor]:
    """GDPO (group reward-decoupled normalisation, arXiv:2601.05242, as veRL's ``gdpo``): each
    reward component k is group-normalised on its own, A_k,i = (r_k,i - mean_g r_k) / (std_g r_k +
    1e-6) (no division with ``norm_adv_by_std: false``; a group of one: mean 0, std 1), the
    components are summed with their weights, A_i = sum_k w_k A_k,i, broadcast to the row's tokens
    and whitened over the batch's valid tokens (``masked_whiten``, always mean 0).

    Normalising each component before the sum keeps a component with a large spread (a length
    bonus) from drowning one with a small spread (correctness). Component k is the batch column
    ``reward/<k>`` (the option ``reward_keys``), weights ``reward_weights`` (null: 1 each).
    As veRL, the components replace ``token_level_rewards``: a KL penalty in the reward does not
    enter.
    """
    o = cfg.options(GdpoOptions, "advantage")
    mask, uids = batch["response_mask"], batch["uid"]
    weights = o.reward_weights or [1.0] * len(o.reward_keys)
    total = None
    for key, weight in zip(o.reward_keys, weights):
        column = f"reward/{key}"
        if column not in batch:
            have = sorted(k for k in batch.tensors if k.startswith("reward/"))
            raise KeyError(
                f"gdpo: no batch column {column!r} for reward_keys entry {key!r} "
                f"(the reward columns: {', '.join(have) or 'none'}); a reward function returns "
                "it beside its score, e.g. {'score': ..., " + repr(key) + ": ...}"
            )
        part = weight * group_normalise(batch[column].double(), uids, cfg.norm_adv_by_std)
        total = part if total is None else total + part
    return {"advantages": masked_whiten(_broadcast(total, mask), mask).float()}


gdpo_advantage.options = GdpoOptions


@ADVANTAGES.register("gpg")
def gpg_advantage(batch: Batch, cfg) -> dict[str, torch.Tensor]:
    """GPG (Chu et al. 2504.02546, as veRL's ``gpg``): A_i = alpha (r_i - mean_g r), alpha = B / M
    with B the batch's rows and M those whose score r_i is not 0 (at least 1); a group of one has
    mean 0. No std division: alpha rescales the whole batch so that rows scoring 0 (which, with a
    0/1 reward, carry no signal of their own) do not shrink the gradient. Pair it with
    ``policy_loss: reinforce`` for the paper's objective (veRL's ``gpg`` loss).
    """
    scores = _sequence_scores(batch)
    sd = scores.double()
    alpha = len(sd) / max(int(torch.count_nonzero(sd)), 1)
    centred = group_mean_baseline(sd, batch["uid"]).double()
    return {"advantages": _broadcast((alpha * centred).to(scores.dtype), batch["response_mask"])}


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma G_{t'} where t' is the next *valid* token; 0 on padding.

    A masked position inside a response (a tool or environment token of a multi-turn trajectory)
    adds no reward, applies no discount and does not reset the running return: it is passed through
    unchanged, so the tokens before a tool call still see the outcome after it. This is veRL's
    REINFORCE++ since 0.9.0 (older veRL reset the return to 0 there, which gave every token before a
    tool call a return of 0).
    """
    m = as_bool(mask)
    r = zero_pad(rewards, m)
    out = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0]) if r.shape[1] else None
    for t in reversed(range(r.shape[1])):
        running = torch.where(m[:, t], r[:, t] + gamma * running, running)
        out[:, t] = torch.where(m[:, t], running, torch.zeros_like(running))
    return out


@ADVANTAGES.register("reinforce_pp")
def reinforce_pp_advantage(batch: Batch, cfg) -> dict[str, torch.Tensor]:
    """REINFORCE++ (Hu 2501.03262): discounted returns G_t, whitened over the batch's valid tokens.

    G passes through masked positions inside a response (see ``discounted_returns``), as veRL since
    0.9.0. Also returns ``returns`` (the unwhitened G).
    """
    mask = batch["response_mask"]
    returns = discounted_returns(batch["token_level_rewards"], mask, cfg.gamma)
    return {"advantages": _whiten(returns, mask, cfg), "returns": returns}


@ADVANTAGES.register("reinforce_pp_baseline")
def reinforce_pp_baseline_advantage(batch: Batch, cfg) -> dict[str, torch.Tensor]:
    """REINFORCE++-baseline (Hu 2501.03262): (r - group mean) broadcast to tokens, whitened over the
    batch."""
    mask = batch["response_mask"]
    centred = group_mean_baseline(_sequence_scores(batch), batch["uid"])
    return {"advantages": _whiten(_broadcast(centred, mask), mask, cfg)}


@ADVANTAGES.register("gae")
def gae_advantage(batch: Batch, cfg) -> dict[str, torch.Tensor]:
    """GAE (Schulman et al. 1506.02438): delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma
    lam A_{t+1}.

    ``values[:, t]`` is the value of the state before response token t. "t+1" is the next valid
    token (padded positions are skipped, as veRL does), and the value after the last valid token
    is 0. ``returns = A + V`` (unwhitened, the critic's target); ``advantages = masked_whiten(A)``.
    """
    m = as_bool(batch["response_mask"])
    r = zero_pad(batch["token_level_rewards"], m)
    v = zero_pad(batch["values"], m).to(r.dtype)
    gamma, lam = cfg.gamma, cfg.lam
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
    returns = zero_pad(adv + v, m)
    return {"advantages": _whiten(adv, m, cfg), "returns": returns}


gae_advantage.needs_values = True  # the driver creates the critic role for estimators that say so


@ADVANTAGES.register("remax")
def remax_advantage(batch: Batch, cfg) -> dict[str, torch.Tensor]:
    """ReMax (Li et al. 2310.10505): A_t = G_t - b(x), b(x) = the reward of one greedy response to
    the prompt.

    G_t is the reward-to-go sum_{k >= t} r_k over valid tokens (gamma is not used, as veRL's
    ``remax``); with an outcome-only reward it is r_i on every token, the paper's r(x, y_i) - r(x,
    y_greedy). The baseline comes from the per-row ``baseline_rewards`` column, which the driver
    fills because of ``needs_greedy_baseline``; it depends only on the prompt, so the gradient stays
    unbiased. Also returns ``returns`` (G).
    """
    if "baseline_rewards" not in batch:
        raise KeyError(
            "remax needs a (B,) 'baseline_rewards' column (the greedy response's reward per row); "
            "the trainer adds it for estimators with needs_greedy_baseline = True"
        )
    m = as_bool(batch["response_mask"])
    returns = discounted_returns(batch["token_level_rewards"], m, 1.0)
    base = batch["baseline_rewards"].to(returns.dtype)
    return {"advantages": zero_pad(returns - base.unsqueeze(-1), m), "returns": returns}


# the trainer generates and scores one greedy response per prompt
remax_advantage.needs_greedy_baseline = True


@ADVANTAGES.register("grpo_passk")
def grpo_passk_advantage(batch: Batch, cfg) -> dict[str, torch.Tensor]:
    """GRPO for pass@k (Tang et al. 2503.19595, as veRL's ``grpo_passk``): per group only the best
    sample gets an advantage, r_max - r_second, on every token; all others get 0.

    This is the leave-one-out baseline of max_j r_j: for sample i it is max_j r_j - max_{j != i}
    r_j, which is 0 unless i is the unique best. Ties for the best therefore give the whole group 0.
    With ``cfg.norm_adv_by_std`` (veRL's default, not in the paper) it is divided by (std_g + 1e-6),
    std unbiased. A group needs at least two samples (``min_group_size``).
    """
    scores = _sequence_scores(batch)
    sd = scores.double()
    out = torch.zeros_like(sd)
    for rows in group_rows(batch["uid"]):
        if len(rows) < 2:
            uid = batch["uid"][rows[0]]
            raise ValueError(
                f"grpo_passk needs at least 2 samples per group; group {uid!r} has {len(rows)} "
                "(set trainer.samples_per_prompt >= 2)"
            )
        idx = torch.tensor(rows, device=sd.device)
        s = sd[idx]
        top = torch.topk(s, 2)
        adv = top.values[0] - top.values[1]
        if cfg.norm_adv_by_std:
            adv = adv / (s.std() + 1e-6)
        out[idx[top.indices[0]]] = adv
    return {"advantages": _broadcast(out.to(scores.dtype), batch["response_mask"])}


# checked against trainer.samples_per_prompt when the config loads
grpo_passk_advantage.min_group_size = 2


@ADVANTAGES.register("opo")
def opo_advantage(batch: Batch, cfg) -> dict[str, torch.Tensor]:
    """OPO (Hao et al. 2505.23585): A_i = r_i - b_g, b_g = sum_i |y_i| r_i / sum_i |y_i| over the
    group.

    The length-weighted mean is the paper's optimal baseline E[|grad log pi|^2 r] / E[|grad log
    pi|^2] with the squared gradient norm taken as proportional to the response length. A group of
    size one gets baseline 0 (A = r), as veRL's ``opo`` and our other group estimators; a group
    whose responses are all empty has nothing to train and gets 0 (where veRL would divide by zero).
    """
    mask = as_bool(batch["response_mask"])
    scores = _sequence_scores(batch)
    sd, lengths = scores.double(), mask.sum(-1).double()
    out = sd.clone()
    for rows in group_rows(batch["uid"]):
        if len(rows) > 1:
            idx = torch.tensor(rows, device=sd.device)
            total = lengths[idx].sum()
            base = (
                (lengths[idx] * sd[idx]).sum() / total
                if total > 0
                else torch.zeros((), dtype=sd.dtype)
            )
            out[idx] = sd[idx] - base
    return {"advantages": _broadcast(out.to(scores.dtype), mask)}


# --- optimal token baselines -------------------------------------------------------------------
OTB_EPS = 1e-8  # keeps the baseline's denominator positive where no sample has weight (veRL's)


def _otb_inputs(batch: Batch):
    """Per-token rewards-to-go G_t (over valid tokens, passing through masked ones), and the
    cumulative path-variance proxy W_t = sum_{j <= t} w_j over valid tokens, with w_j = 1 - 2 pi_j
    + sum_v pi_v^2 (the squared norm of the score function of token j's softmax; pi_j =
    exp(old_log_probs), sum_v pi_v^2 = ``sum_pi_squared``), times the squared rollout weight when
    the batch has ``rollout_is_weights``. Both (B, R) in float64, 0 on padding."""
    if "sum_pi_squared" not in batch:
        raise KeyError(
            "the optimal token baselines need a (B, R) 'sum_pi_squared' column, which the "
            "learner's old-log-prob pass adds for estimators with needs_sum_pi_squared (there is "
            "no such pass with algorithm.rollout_bypass, nor with a pipelined policy)"
        )
    m = as_bool(batch["response_mask"])
    r = zero_pad(batch["token_level_rewards"].double(), m)
    returns = r.flip(-1).cumsum(-1).flip(-1)
    w = 1 - 2 * batch["old_log_probs"].double().exp() + batch["sum_pi_squared"].double()
    if "rollout_is_weights" in batch:
        w = w * batch["rollout_is_weights"].double().square()
    return m, zero_pad(returns, m), zero_pad(w, m).cumsum(-1)


def _otb_baseline(returns: torch.Tensor, w_cum: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """b_t = sum_i G_i,t W_i,t / (sum_i W_i,t + eps) over a group's rows (N, T), one per column."""
    return (returns * w_cum * valid).sum(0) / ((w_cum * valid).sum(0) + OTB_EPS)


def _zero_tail(base: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """A group's baselines (N, T) with the unique longest row's baseline set to 0 from the second
    longest length on: past it no other sample of the group is left to estimate a baseline from,
    so that row's tail gets its return unbaselined (veRL's ``handle_zero_tail``)."""
    ordered = torch.sort(lengths).values
    longest, second = int(ordered[-1]), int(ordered[-2])
    rows = (lengths == longest).nonzero().flatten()
    if rows.numel() == 1 and longest > second:
        base = base.clone()
        base[rows[0], second:] = 0
    return base


@ADVANTAGES.register("optimal_token_baseline")
def optimal_token_baseline_advantage(batch: Batch, cfg) -> dict[str, torch.Tensor]:
    """Optimal token baseline (veRL's ``optimal_token_baseline``): A_i,t = G_i,t - b_t with a
    baseline per position t of each group, b_t = sum_i G_i,t W_i,t / (sum_i W_i,t + 1e-8), the
    variance-minimising baseline E[G W] / E[W] under the proxy W_i,t (see ``_otb_inputs``) for the
    squared gradient norm of the path so far.

    Positions are the response positions as they are (columns of the batch): in a multi-turn row
    with masked tokens, use ``tir_optimal_token_baseline``. A group of one gets no baseline (A = G);
    the unique longest row of a group gets 0 from the second longest length on (``_zero_tail``).
    Needs the old policy's log-probs and ``sum_pi_squared`` of the old-log-prob pass
    (``needs_sum_pi_squared``); ``returns`` = G.
    """
    m, returns, w_cum = _otb_inputs(batch)
    base = torch.zeros_like(returns)
    lengths = m.sum(-1)
    for rows in group_rows(batch["uid"]):
        if len(rows) < 2:
            continue
        idx = torch.tensor(rows)
        group = _otb_baseline(returns[idx], w_cum[idx], m[idx].double())
        base[idx] = _zero_tail(group.expand(len(rows), -1), lengths[idx])
    dtype = batch["token_level_rewards"].dtype
    adv = zero_pad(returns - base, m)
    return {"advantages": adv.to(dtype), "returns": returns.to(dtype)}


@ADVANTAGES.register("tir_optimal_token_baseline")
def tir_optimal_token_baseline_advantage(batch: Batch, cfg) -> dict[str, torch.Tensor]:
    """The optimal token baseline over each row's *valid* tokens (veRL's
    ``tir_optimal_token_baseline``, for multi-turn rows whose tool and environment tokens are
    masked): the k-th valid token of every row of a group shares b_k, so a row's turns line up with
    the others' by the tokens the policy produced, not by position. Otherwise as
    ``optimal_token_baseline``; rows with no valid token are left out of their group.
    """
    m, returns, w_cum = _otb_inputs(batch)
    lengths = m.sum(-1)
    width = int(lengths.max()) if lengths.numel() else 0
    # each row's valid tokens moved to its front, in order
    g_c = returns.new_zeros(len(m), width)
    w_c = returns.new_zeros(len(m), width)
    for i in range(len(m)):
        g_c[i, : lengths[i]] = returns[i, m[i]]
        w_c[i, : lengths[i]] = w_cum[i, m[i]]
    valid_c = torch.arange(width).expand(len(m), -1) < lengths.unsqueeze(-1)
    base = torch.zeros_like(g_c)
    non_empty = [i for i in range(len(m)) if lengths[i] > 0]
    uids = [batch["uid"][i] for i in non_empty]
    for rows in group_rows(uids):
        if len(rows) < 2:
            continue
        idx = torch.tensor([non_empty[j] for j in rows])
        group = _otb_baseline(g_c[idx], w_c[idx], valid_c[idx].double())
        base[idx] = _zero_tail(group.expand(len(rows), -1), lengths[idx])
    adv = torch.zeros_like(returns)
    for i in range(len(m)):
        adv[i, m[i]] = (g_c[i] - base[i])[: lengths[i]]
    dtype = batch["token_level_rewards"].dtype
    return {"advantages": adv.to(dtype), "returns": returns.to(dtype)}


# the old-log-prob pass adds sum_pi_squared, and runs before the advantages (the config check
# refuses the layouts whose pass cannot: Config._validate_estimator)
for _otb in (optimal_token_baseline_advantage, tir_optimal_token_baseline_advantage):
    _otb.needs_sum_pi_squared = True


def compute_advantages(batch: Batch, cfg) -> Batch:
    """The batch plus every tensor the estimator named by ``cfg.advantage`` returns (``advantages``,
    maybe ``returns``).

    A returned column replaces a column of the same name (advantages can be recomputed).
    An estimator may also return a bare tensor, taken as ``advantages``. A multi-turn trajectory
    split into parts counts once (:func:`once_per_trajectory`).
    """
    estimator = ADVANTAGES.get(cfg.advantage)
    out = _columns(estimator(batch, cfg))
    if "returns" not in out:
        out["advantages"] = once_per_trajectory(estimator, batch, cfg, out["advantages"])
    if getattr(cfg, "task_norm", False):
        out["advantages"] = task_normalized(
            out["advantages"], batch["response_mask"], batch["task_id"]
        )
    return Batch({**batch.tensors, **out}, batch.meta)


def _columns(out) -> dict[str, torch.Tensor]:
    return {"advantages": out} if isinstance(out, torch.Tensor) else dict(out)


def once_per_trajectory(estimator, batch: Batch, cfg, adv: torch.Tensor) -> torch.Tensor:
    """``adv`` where every trajectory counts once in its group's statistics. A multi-turn trajectory
    whose chat template rewrote the conversation is split into parts, rows that share the
    ``trajectory`` metadata (each carries the trajectory's reward); the estimator then sees each
    trajectory once, as its first row in the batch, and every part gets that row's advantage on
    its valid tokens. Estimators that return ``returns`` (rewards-to-go along each row's tokens:
    gae, reinforce_pp, remax ...) keep every row: their advantage is not one number per row."""
    ids = batch.meta.get("trajectory")
    if ids is None:
        return adv
    first: dict = {}
    of = [first.setdefault((i,) if t is None else t, i) for i, t in enumerate(ids)]
    if len(first) == len(ids):
        return adv
    reps = list(first.values())
    once = _columns(estimator(batch.index(reps), cfg))["advantages"]
    mask = batch["response_mask"][reps].to(once.dtype)
    per_row = (once * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # one number per row
    where = {row: k for k, row in enumerate(reps)}
    return _broadcast(per_row[[where[r] for r in of]], batch["response_mask"]).to(adv.dtype)


def task_normalized(adv: torch.Tensor, mask: torch.Tensor, task_ids: list[str]) -> torch.Tensor:
    """Task-level advantage normalisation (AgentRL, 2510.04206): each task's advantages are
    whitened over that task's valid tokens in the batch, (A - mean_task) / std_task, so that a task
    whose rewards are easy to come by does not outweigh the others in a multi-task run. The
    statistics are :func:`masked_whiten`'s (unbiased variance, eps inside the square root); a task
    with one valid token gets 0."""
    out = torch.zeros_like(adv)
    for task in dict.fromkeys(task_ids):
        rows = torch.tensor([t == task for t in task_ids], dtype=torch.bool)
        out[rows] = masked_whiten(adv[rows], mask[rows])
    return out
