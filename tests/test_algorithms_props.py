"""Property tests (hypothesis) for hybridrl/algorithms: masks respected (padding zero, results
independent of what padded positions hold), groups of size one, groups with equal rewards,
all-masked rows, extreme log-ratios, and identities between the algorithms (GAE with lambda = gamma
= 1, GSPO vs PPO, GSPO-token vs GSPO gradients, decoupled PPO vs PPO, micro-batch aggregation)."""

from __future__ import annotations

import math
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridrl.algorithms import (
    ADVANTAGES,
    KL_ESTIMATORS,
    LOSS_AGG,
    POLICY_LOSSES,
    AdaptiveKLController,
    agg_totals,
    apply_kl_penalty,
    masked_whiten,
    token_level_scores,
    value_loss,
)
from hybridrl.config import AlgorithmConfig
from hybridrl.protocol import Batch

SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
ESTIMATORS = [
    "grpo",
    "dr_grpo",
    "rloo",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "gae",
    "remax",
    "grpo_passk",
    "opo",
]
LOSSES = ["ppo_clip", "gspo", "gspo_token", "decoupled_ppo"]
GARBAGE = [1e6, -1e6, float("inf"), float("-inf"), float("nan"), 123.0]


def cfg(**kw) -> AlgorithmConfig:
    base = dict(
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
        norm_adv_by_std=True,
        gamma=0.9,
        lam=0.8,
        behav_imp_weight_cap=None,
    )
    return AlgorithmConfig(**(base | kw))


@st.composite
def masks(draw, min_rows=1, max_rows=6, max_len=6):
    """(B, R) 0/1 masks: right-padded (the usual layout) or with holes; rows may be empty."""
    b = draw(st.integers(min_rows, max_rows))
    r = draw(st.integers(1, max_len))
    if draw(st.booleans()):
        lengths = draw(st.lists(st.integers(0, r), min_size=b, max_size=b))
        rows = [[1] * n + [0] * (r - n) for n in lengths]
    else:
        rows = draw(
            st.lists(st.lists(st.integers(0, 1), min_size=r, max_size=r), min_size=b, max_size=b)
        )
    return torch.tensor(rows, dtype=torch.long)


@st.composite
def adv_batches(draw, uid_alphabet="abc"):
    mask = draw(masks())
    b, r = mask.shape
    scores = draw(
        st.lists(
            st.one_of(st.sampled_from([0.0, 1.0]), st.floats(-5, 5, allow_nan=False)),
            min_size=b,
            max_size=b,
        )
    )
    uids = draw(st.lists(st.sampled_from(uid_alphabet), min_size=b, max_size=b))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    tlr = token_level_scores(torch.tensor(scores), mask)
    if draw(st.booleans()):  # a per-token KL penalty in the reward
        tlr = tlr - 0.1 * torch.rand(b, r, generator=g) * mask
    values = torch.randn(b, r, generator=g)
    greedy = {
        u: draw(st.sampled_from([0.0, 1.0, -0.5])) for u in uid_alphabet
    }  # one greedy reward per prompt
    return Batch(
        {
            "token_level_rewards": tlr,
            "values": values,
            "response_mask": mask,
            "baseline_rewards": torch.tensor([greedy[u] for u in uids]),
        },
        {"uid": uids},
    )


def with_garbage(t: torch.Tensor, mask: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """``t`` with its padded positions replaced by garbage (huge, inf, NaN ...)."""
    idx = torch.randint(len(GARBAGE), t.shape, generator=g)
    junk = torch.tensor(GARBAGE, dtype=t.dtype)[idx]
    return torch.where(mask.bool(), t, junk)


def est(name, batch, **kw):
    return ADVANTAGES.get(name)(batch, cfg(**kw))


def has_singleton(uids: list) -> bool:
    return any(uids.count(u) == 1 for u in uids)


def estimators_for(batch):
    """ESTIMATORS that accept ``batch``; an estimator with ``min_group_size`` must reject smaller
    groups (and does)."""
    out = []
    for name in ESTIMATORS:
        if getattr(ADVANTAGES.get(name), "min_group_size", 1) > 1 and has_singleton(batch["uid"]):
            with pytest.raises(ValueError, match="samples per group"):
                est(name, batch)
        else:
            out.append(name)
    return out


# --- advantages -----------------------------------------------------------------------------------
@SETTINGS
@given(adv_batches(), st.integers(0, 1000))
def test_advantages_zero_on_padding_and_blind_to_it(batch, seed):
    g = torch.Generator().manual_seed(seed)
    mask = batch["response_mask"]
    dirty = Batch(
        {
            "token_level_rewards": with_garbage(batch["token_level_rewards"], mask, g),
            "values": with_garbage(batch["values"], mask, g),
            "response_mask": mask,
            "baseline_rewards": batch["baseline_rewards"],
        },
        batch.meta,
    )
    for name in estimators_for(batch):
        clean, noisy = est(name, batch), est(name, dirty)
        assert "advantages" in clean and (name != "gae" or "returns" in clean)
        for key, t in clean.items():
            assert t.shape == mask.shape and torch.isfinite(t).all(), (name, key)
            assert (t[~mask.bool()] == 0).all(), (name, key)
            assert torch.equal(t, noisy[key]), (name, key)


@SETTINGS
@given(adv_batches(), st.randoms(use_true_random=False))
def test_advantages_follow_uids_not_positions(batch, rnd):
    perm = list(range(len(batch)))
    rnd.shuffle(perm)
    for name in estimators_for(batch):
        a, p = est(name, batch), est(name, batch[perm])
        for key in a:
            assert torch.allclose(p[key], a[key][perm], atol=1e-5), (name, key)


@SETTINGS
@given(adv_batches(uid_alphabet="abcdefghijklmnop"))
def test_groups_of_size_one(batch):
    uids = [f"u{i}" for i in range(len(batch))]  # every row its own group
    b = Batch(batch.tensors, {"uid": uids})
    m = batch["response_mask"].bool()
    r = (batch["token_level_rewards"] * m).sum(-1, keepdim=True).expand(m.shape) * m
    # grpo: mean 0, std 1 (veRL) -> r / (1 + 1e-6); dr_grpo and rloo: r
    assert torch.allclose(est("grpo", b)["advantages"], r / (1 + 1e-6), atol=1e-6)
    assert torch.allclose(est("dr_grpo", b)["advantages"], r, atol=1e-6)
    assert torch.allclose(est("grpo", b, norm_adv_by_std=False)["advantages"], r, atol=1e-6)
    assert torch.allclose(est("rloo", b)["advantages"], r, atol=1e-6)
    assert torch.allclose(
        est("opo", b)["advantages"], r, atol=1e-6
    )  # baseline 0, as the other group estimators


@SETTINGS
@given(masks(), st.lists(st.floats(-3, 3, allow_nan=False), min_size=3, max_size=3), st.data())
def test_groups_with_equal_rewards_get_zero(mask, group_scores, data):
    uids = data.draw(st.lists(st.sampled_from("abc"), min_size=len(mask), max_size=len(mask)))
    scores = torch.tensor([group_scores["abc".index(u)] for u in uids])
    b = Batch(
        {"token_level_rewards": token_level_scores(scores, mask), "response_mask": mask},
        {"uid": uids},
    )
    # rows that cannot hold their reward (empty) carry a score of 0 into their group: give them
    # their own group
    nonempty = mask.bool().any(-1)
    b = Batch(
        b.tensors,
        {
            "uid": [
                u if ne else f"empty{i}" for i, (u, ne) in enumerate(zip(uids, nonempty.tolist()))
            ]
        },
    )
    sizes = {u: b["uid"].count(u) for u in b["uid"]}
    multi = torch.tensor([sizes[u] > 1 for u in b["uid"]]).unsqueeze(-1)
    for name in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "opo") + (
        ("grpo_passk",) if bool(multi.all()) else ()
    ):
        a = est(name, b)["advantages"]
        if name == "reinforce_pp_baseline":
            if all(sizes[u] > 1 or not ne for u, ne in zip(b["uid"], nonempty.tolist())):
                assert torch.allclose(a, torch.zeros_like(a), atol=1e-6)
        else:
            assert torch.allclose(a * multi, torch.zeros_like(a), atol=1e-5), name


@SETTINGS
@given(masks(), st.integers(0, 1000))
def test_all_masked_batch_is_zero_not_nan(mask, seed):
    g = torch.Generator().manual_seed(seed)
    zero = torch.zeros_like(mask)
    b = Batch(
        {
            "token_level_rewards": torch.randn(mask.shape, generator=g),
            "values": torch.randn(mask.shape, generator=g),
            "response_mask": zero,
            "baseline_rewards": torch.randn(len(mask), generator=g),
        },
        {"uid": ["a"] * len(mask)},
    )
    for name in estimators_for(b):
        for t in est(name, b).values():
            assert torch.equal(t, torch.zeros_like(t)), name


@SETTINGS
@given(adv_batches())
def test_gae_lambda_gamma_one_is_reward_to_go_minus_value(batch):
    m = batch["response_mask"].bool()
    r = batch["token_level_rewards"] * m
    v = batch["values"] * m
    out = est("gae", batch, gamma=1.0, lam=1.0)
    # reward-to-go over valid tokens: sum_{k >= t} r_k
    rtg = r.flip(-1).cumsum(-1).flip(-1) * m
    assert torch.allclose(out["returns"], rtg, atol=1e-5)
    assert torch.allclose(out["advantages"], masked_whiten(rtg - v, m), atol=1e-4)
    # REINFORCE++ with gamma 1 gives the same reward-to-go, for any mask: a masked position inside a
    # row passes the running return through (rewards there are not counted), so holes change nothing
    assert torch.allclose(est("reinforce_pp", batch, gamma=1.0)["returns"], rtg, atol=1e-5)
    # and ReMax is that reward-to-go minus the prompt's greedy reward, on valid tokens only
    remax = est("remax", batch, gamma=0.3)  # gamma is not used by ReMax
    assert torch.allclose(remax["returns"], rtg, atol=1e-5)
    assert torch.allclose(
        remax["advantages"], (rtg - batch["baseline_rewards"].unsqueeze(-1)) * m, atol=1e-5
    )


@SETTINGS
@given(adv_batches())
def test_gae_returns_are_advantages_plus_values(batch):
    m = batch["response_mask"].bool()
    out = est("gae", batch, gamma=0.9, lam=0.7)
    # unwhiten: returns - V is the raw GAE; whitening it must give the advantages
    raw = (out["returns"] - batch["values"]) * m
    assert torch.allclose(out["advantages"], masked_whiten(raw, m), atol=1e-4)


@SETTINGS
@given(masks(), st.integers(0, 1000))
def test_token_level_scores_and_whiten(mask, seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(len(mask), generator=g)
    out = token_level_scores(scores, mask)
    m = mask.bool()
    nonempty = m.any(-1)
    assert torch.allclose(out.sum(-1), scores * nonempty)
    assert (out[~m] == 0).all()
    for i in torch.nonzero(nonempty).flatten().tolist():
        last = max(j for j in range(mask.shape[1]) if m[i, j])
        assert out[i, last] == scores[i]
    x = torch.randn(mask.shape, generator=g, dtype=torch.float64) * 3 + 1
    w = masked_whiten(x, m)
    n = int(m.sum())
    assert torch.isfinite(w).all() and (w[~m] == 0).all()
    if n >= 2:
        vals = w[m]
        assert abs(vals.mean().item()) < 1e-6
        assert vals.var().item() == pytest.approx(1.0, rel=1e-4)  # unbiased


# --- policy losses --------------------------------------------------------------------------------
@st.composite
def loss_inputs(draw, scale=1.0):
    mask = draw(masks())
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    shape = mask.shape
    old = -torch.rand(shape, generator=g, dtype=torch.float64) * 3
    logp = old + torch.randn(shape, generator=g, dtype=torch.float64) * 0.3 * scale
    rollout = old + torch.randn(shape, generator=g, dtype=torch.float64) * 0.3 * scale
    adv = torch.randn(shape, generator=g, dtype=torch.float64)
    return logp, Batch(
        {
            "old_log_probs": old,
            "rollout_log_probs": rollout,
            "advantages": adv * mask,
            "response_mask": mask,
        }
    )


def run_loss(name, logp, mb, c):
    lp = logp.detach().clone().requires_grad_(True)
    loss, metrics = POLICY_LOSSES.get(name)(lp, mb, c)
    loss.sum().backward()
    return loss.detach(), lp.grad, metrics


@SETTINGS
@given(
    loss_inputs(), st.integers(0, 1000), st.sampled_from([None, 3.0]), st.sampled_from([None, 1.5])
)
def test_losses_zero_on_padding_and_blind_to_it(inputs, seed, dual, cap):
    logp, mb = inputs
    g = torch.Generator().manual_seed(seed)
    mask = mb["response_mask"]
    dirty = Batch(
        {
            k: with_garbage(t, mask, g) if k != "response_mask" else mask
            for k, t in mb.tensors.items()
        }
    )
    dirty_logp = with_garbage(logp, mask, g)
    c = cfg(clip_ratio_c=dual, behav_imp_weight_cap=cap)
    for name in LOSSES:
        loss, grad, metrics = run_loss(name, logp, mb, c)
        loss2, grad2, metrics2 = run_loss(name, dirty_logp, dirty, c)
        assert torch.isfinite(loss).all() and torch.isfinite(grad).all(), name
        assert (loss[~mask.bool()] == 0).all() and (grad[~mask.bool()] == 0).all(), name
        assert torch.equal(loss, loss2) and torch.equal(grad, grad2), name
        assert metrics == metrics2 and all(math.isfinite(v) for v in metrics.values()), name
        assert metrics["actor/clip_frac"] == pytest.approx(
            metrics["actor/clip_frac_low"] + metrics["actor/clip_frac_high"]
        )


@SETTINGS
@given(
    loss_inputs(),
    st.lists(st.floats(20.5, 1e4), min_size=1, max_size=4),
    st.sampled_from([None, 3.0]),
    st.sampled_from(sorted(LOSS_AGG.names())),
)
def test_extreme_log_ratios_finite(inputs, deltas, dual, agg):
    logp, mb = inputs
    g = torch.Generator().manual_seed(0)
    shape = logp.shape
    # |logp - old| > 20 on random tokens, both signs, and a behaviour policy far off too
    pick = torch.tensor(deltas, dtype=torch.float64)[torch.randint(len(deltas), shape, generator=g)]
    sign = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0).double()
    logp = mb["old_log_probs"] + sign * pick
    mb = Batch(mb.tensors | {"rollout_log_probs": mb["old_log_probs"] - sign * pick})
    totals = agg_totals(mb["response_mask"], 7)
    for name in LOSSES:
        lp = logp.clone().requires_grad_(True)
        loss, metrics = POLICY_LOSSES.get(name)(lp, mb, cfg(clip_ratio_c=dual))
        scalar = LOSS_AGG.get(agg)(loss, mb["response_mask"], totals)
        scalar.backward()
        assert torch.isfinite(loss).all() and torch.isfinite(scalar), name
        assert torch.isfinite(lp.grad).all(), name
        assert all(math.isfinite(v) for v in metrics.values()), name


@SETTINGS
@given(masks(), st.integers(0, 1000), st.floats(0.01, 0.3))
def test_gspo_with_equal_token_ratios_is_ppo(mask, seed, eps):
    g = torch.Generator().manual_seed(seed)
    b, r = mask.shape
    # every token of row i has the same log-ratio delta_i and the same advantage A_i
    delta = (torch.randn(b, 1, generator=g, dtype=torch.float64) * 0.4).expand(b, r)
    a = torch.randn(b, 1, generator=g, dtype=torch.float64).expand(b, r) * mask
    old = -torch.rand(b, r, generator=g, dtype=torch.float64)
    logp = old + delta
    mb = Batch(
        {"old_log_probs": old, "rollout_log_probs": old, "advantages": a, "response_mask": mask}
    )
    c = cfg(clip_ratio_low=eps, clip_ratio_high=eps * 1.4, clip_ratio_c=None)
    ppo, _, _ = run_loss("ppo_clip", logp, mb, c)
    for name in ("gspo", "gspo_token"):
        loss, _, _ = run_loss(name, logp, mb, c)
        assert torch.allclose(loss, ppo, atol=1e-9), name


@SETTINGS
@given(loss_inputs(), st.sampled_from(sorted(LOSS_AGG.names())), st.floats(1e-3, 0.3))
def test_gspo_token_gradient_equals_gspo_with_sequence_advantages(inputs, agg, eps):
    logp, mb = inputs
    m = mb["response_mask"].bool()
    # advantages constant over each sequence
    seq_a = torch.randn(len(m), 1, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    mb = Batch(mb.tensors | {"advantages": seq_a.expand(m.shape) * m})
    c = cfg(clip_ratio_low=eps, clip_ratio_high=eps)
    totals = agg_totals(m, 9)
    grads, values = [], []
    for name in ("gspo", "gspo_token"):
        lp = logp.clone().requires_grad_(True)
        loss, _ = POLICY_LOSSES.get(name)(lp, mb, c)
        out = LOSS_AGG.get(agg)(loss, m, totals)
        out.backward()
        grads.append(lp.grad)
        values.append(out.item())
    assert torch.allclose(grads[0], grads[1], atol=1e-10)
    assert values[0] == pytest.approx(values[1], abs=1e-10)


@SETTINGS
@given(loss_inputs(scale=3.0), st.sampled_from([None, 3.0]), st.sampled_from([None, 1.0, 4.0]))
def test_decoupled_ppo_with_behaviour_equal_proximal_is_ppo(inputs, dual, cap):
    logp, mb = inputs
    mb = Batch(
        mb.tensors | {"rollout_log_probs": mb["old_log_probs"]}
    )  # mu = prox -> w = 1 (never above a cap >= 1)
    c = cfg(clip_ratio_c=dual, behav_imp_weight_cap=cap)
    l1, g1, m1 = run_loss("ppo_clip", logp, mb, c)
    l2, g2, m2 = run_loss("decoupled_ppo", logp, mb, c)
    assert torch.equal(l1, l2) and torch.equal(g1, g2)
    assert {k: m2[k] for k in m1} == m1
    assert m2["actor/behav_capped_frac"] == 0.0


@SETTINGS
@given(loss_inputs(scale=3.0), st.floats(1.01, 3.0))
def test_decoupled_ppo_is_weighted_ppo_on_kept_tokens(inputs, cap):
    logp, mb = inputs
    m = mb["response_mask"].bool()
    w = torch.exp(mb["old_log_probs"] - mb["rollout_log_probs"])
    ppo, _, _ = run_loss("ppo_clip", logp, mb, cfg())
    dec, _, metrics = run_loss("decoupled_ppo", logp, mb, cfg(behav_imp_weight_cap=cap))
    kept = m & (w <= cap)
    assert torch.allclose(dec, torch.where(kept, w * ppo, torch.zeros_like(ppo)), atol=1e-12)
    assert metrics["actor/behav_capped_frac"] == pytest.approx(
        (m & ~kept).sum().item() / max(m.sum().item(), 1)
    )


# --- value loss -----------------------------------------------------------------------------------
@SETTINGS
@given(masks(), st.integers(0, 1000), st.floats(0.01, 2.0))
def test_value_loss_properties(mask, seed, clip):
    g = torch.Generator().manual_seed(seed)
    m = mask.bool()
    v, old, ret = (torch.randn(mask.shape, generator=g, dtype=torch.float64) for _ in range(3))
    loss, metrics = value_loss(v, old, ret, mask, clip)
    plain, _ = value_loss(v, old, ret, mask, None)
    assert torch.isfinite(loss).all() and (loss[~m] == 0).all()
    assert torch.allclose(plain, 0.5 * (v - ret).square() * m)
    assert (loss >= plain - 1e-12).all()
    inside = (v - old).abs() <= clip
    assert torch.allclose(loss[inside], plain[inside])
    dirty, _ = value_loss(
        with_garbage(v, mask, g), with_garbage(old, mask, g), with_garbage(ret, mask, g), mask, clip
    )
    assert torch.equal(loss, dirty)
    assert all(math.isfinite(x) for x in metrics.values())


# --- aggregation ----------------------------------------------------------------------------------
@SETTINGS
@given(masks(max_rows=8), st.integers(0, 1000), st.data())
def test_micro_batches_sum_to_the_mini_batch(mask, seed, data):
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    b = len(mask)
    cuts = (
        sorted(set(data.draw(st.lists(st.integers(1, max(b - 1, 1)), max_size=4)))) if b > 1 else []
    )
    bounds = [0] + [c for c in cuts if 0 < c < b] + [b]
    totals = agg_totals(mask, data.draw(st.sampled_from([None, 5, 16])))
    for name in LOSS_AGG.names():
        f = LOSS_AGG.get(name)
        whole = f(loss, mask, totals)
        parts = sum(f(loss[s:e], mask[s:e], totals) for s, e in zip(bounds, bounds[1:]))
        assert torch.isfinite(whole)
        assert parts.item() == pytest.approx(whole.item(), abs=1e-9), name
        # padding never contributes
        assert f(with_garbage(loss, mask, g), mask, totals).item() == pytest.approx(
            whole.item(), abs=1e-9
        ), name
        # a constant per-token loss c averages to c in the mean modes
        if totals.n_tokens and name in ("token-mean", "seq-mean-token-mean"):
            assert f(torch.full(mask.shape, 2.5), mask, totals).item() == pytest.approx(2.5)


# --- KL -------------------------------------------------------------------------------------------
@SETTINGS
@given(masks(), st.integers(0, 1000), st.sampled_from(["k1", "k2", "k3"]), st.floats(0.0, 1.0))
def test_apply_kl_penalty_properties(mask, seed, estimator, coef):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(mask.shape, generator=g) * 4
    ref = -torch.rand(mask.shape, generator=g) * 4
    scores = token_level_scores(torch.randn(len(mask), generator=g), mask)
    b = Batch(
        {
            "token_level_scores": scores,
            "old_log_probs": old,
            "ref_log_probs": ref,
            "response_mask": mask,
        }
    )
    rewards, metrics = apply_kl_penalty(b, coef, estimator)
    kl = KL_ESTIMATORS.get(estimator)(old, ref)
    assert torch.allclose(rewards, (scores - coef * kl) * mask, atol=1e-6)
    assert (rewards[~mask.bool()] == 0).all()
    dirty = Batch(
        {
            k: with_garbage(t, mask, g) if k != "response_mask" else mask
            for k, t in b.tensors.items()
        }
    )
    rewards2, metrics2 = apply_kl_penalty(dirty, coef, estimator)
    assert torch.equal(rewards, rewards2) and metrics == metrics2
    if estimator != "k1":
        assert metrics["kl/penalty_mean"] >= 0
    no_kl, _ = apply_kl_penalty(b, 0.0, estimator)
    assert torch.equal(no_kl, scores * mask)


@SETTINGS
@given(st.lists(st.floats(0.0, 50.0), min_size=1, max_size=20), st.integers(1, 512))
def test_adaptive_kl_controller_moves_towards_target(kls, n_steps):
    ctl = AdaptiveKLController(0.1, 6.0, 10_000)
    for kl in kls:
        before = ctl.value
        ctl.update(kl, n_steps)
        step = 0.2 * n_steps / 10_000
        assert before * (1 - step) - 1e-15 <= ctl.value <= before * (1 + step) + 1e-15
        assert (ctl.value > before) == (kl > 6.0) or kl == 6.0 or ctl.value == before
