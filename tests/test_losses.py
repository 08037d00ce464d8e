"""hybridrl/algorithms: policy losses (PPO clip, dual clip, GSPO, decoupled PPO), value loss, loss
aggregation, KL estimators and controllers, registries; checked against values worked out by hand
(arithmetic in comments). Advantage estimators are in test_algorithms.py."""

from __future__ import annotations

import math

import pytest
import torch
from test_algorithms import cfg, close

from hybridrl.algorithms import (
    ADVANTAGES,
    KL_ESTIMATORS,
    LOSS_AGG,
    POLICY_LOSSES,
    AdaptiveKLController,
    AggTotals,
    FixedKLController,
    agg_totals,
    apply_kl_penalty,
    kl_penalty,
    masked_mean,
    value_loss,
)
from hybridrl.config import AlgorithmConfig
from hybridrl.protocol import Batch


# --- PPO clip loss -------------------------------------------------------------------------
def loss_mb(logp, old, adv, mask=None, rollout=None):
    mask = torch.ones_like(logp) if mask is None else mask
    return Batch(
        {
            "old_log_probs": old,
            "rollout_log_probs": old if rollout is None else rollout,
            "advantages": adv,
            "response_mask": mask,
        }
    )


def ppo(ratios, advs, mask=None, name="ppo_clip", **kw):
    ratio = torch.tensor(ratios, dtype=torch.float64)
    logp = ratio.log().unsqueeze(0)
    old = torch.zeros_like(logp)
    a = torch.tensor(advs, dtype=torch.float64).unsqueeze(0)
    mask = None if mask is None else torch.tensor(mask, dtype=torch.float64).unsqueeze(0)
    return POLICY_LOSSES.get(name)(logp, loss_mb(logp, old, a, mask), cfg(**kw))


def test_ppo_clip_per_token_by_hand():
    # eps_low 0.2 -> lower bound 0.8; eps_high 0.28 -> upper bound 1.28; dual clip c = 3 (not
    #   reached here)
    # loss = max(-A r, -A clip(r, 0.8, 1.28))
    ratios = [1.1, 1.5, 0.5, 1.1, 1.5, 0.5, 0.9, 1.28]
    advs = [2.0, 2.0, 2.0, -1.0, -1.0, -1.0, 1.0, 1.0]
    expected = [
        -2.2,  # r=1.1 inside, A=+2: -2*1.1
        -2.56,  # r=1.5 above, A=+2: max(-3.0, -2*1.28=-2.56) = -2.56 (clipped high)
        -1.0,  # r=0.5 below, A=+2: max(-1.0, -2*0.8=-1.6) = -1.0 (not clipped: pessimistic bound)
        1.1,  # r=1.1 inside, A=-1: 1.1
        1.5,  # r=1.5 above, A=-1: max(1.5, 1.28) = 1.5 (not clipped; dual bound 3 not reached)
        0.8,  # r=0.5 below, A=-1: max(0.5, 0.8) = 0.8 (clipped low)
        -0.9,  # r=0.9 inside, A=+1
        -1.28,  # r=1.28 at the bound: equal either way
    ]
    loss, metrics = ppo(ratios, advs)
    assert torch.allclose(loss[0], torch.tensor(expected, dtype=torch.float64), atol=1e-9)
    # clipped tokens: index 1 (high) and 5 (low) -> 1/8 each, 2/8 in all
    assert metrics["actor/clip_frac"] == pytest.approx(2 / 8)
    assert metrics["actor/clip_frac_low"] == pytest.approx(1 / 8)
    assert metrics["actor/clip_frac_high"] == pytest.approx(1 / 8)
    assert metrics["actor/dual_clip_frac"] == 0.0
    assert metrics["actor/ratio_mean"] == pytest.approx(sum(ratios) / 8)
    assert metrics["actor/ratio_max"] == pytest.approx(1.5) and metrics[
        "actor/ratio_min"
    ] == pytest.approx(0.5)
    # k1: mean(old - logp) = -mean(log r)
    assert metrics["actor/approx_kl_old"] == pytest.approx(-sum(math.log(r) for r in ratios) / 8)
    # k3: mean((r - 1) - log r)
    assert metrics["actor/approx_kl_old_k3"] == pytest.approx(
        sum(r - 1 - math.log(r) for r in ratios) / 8
    )


def test_ppo_dual_clip_by_hand():
    # A = -1, eps 0.2/0.28, c = 3:
    # r = 4: max(4, 1.28) = 4 -> min(4, 3) = 3 (dual clip)
    # r = 2: max(2, 1.28) = 2 -> min(2, 3) = 2
    # A = +1, r = 4: max(-4, -1.28) = -1.28 (the dual clip is for A < 0 only)
    loss, m = ppo([4.0, 2.0, 4.0], [-1.0, -1.0, 1.0])
    assert loss[0].tolist() == pytest.approx([3.0, 2.0, -1.28])
    assert m["actor/dual_clip_frac"] == pytest.approx(1 / 3)
    assert m["actor/clip_frac_high"] == pytest.approx(1 / 3) and m["actor/clip_frac_low"] == 0.0
    # disabled (None or 0): r = 4, A = -1 -> 4
    for off in (None, 0):
        loss, m = ppo([4.0], [-1.0], clip_ratio_c=off)
        assert loss.item() == pytest.approx(4.0) and m["actor/dual_clip_frac"] == 0.0
    with pytest.raises(ValueError, match="clip_ratio_c"):
        ppo([1.0], [1.0], clip_ratio_c=0.9)
    # the dual-clipped token has no gradient
    logp = torch.tensor([[math.log(4.0)]], dtype=torch.float64, requires_grad=True)
    loss, _ = POLICY_LOSSES.get("ppo_clip")(
        logp,
        loss_mb(
            logp, torch.zeros(1, 1, dtype=torch.float64), -torch.ones(1, 1, dtype=torch.float64)
        ),
        cfg(),
    )
    loss.sum().backward()
    assert logp.grad.item() == 0.0


def test_ppo_separate_low_and_high_clip():
    # r = 1.25 with A>0: clipped at 1.2 when eps_high=0.2, untouched when eps_high=0.28
    loss, m = ppo([1.25], [1.0], clip_ratio_high=0.2)
    assert (
        loss.item() == pytest.approx(-1.2)
        and m["actor/clip_frac"] == 1.0
        and m["actor/clip_frac_high"] == 1.0
    )
    loss, m = ppo([1.25], [1.0], clip_ratio_high=0.28)
    assert loss.item() == pytest.approx(-1.25) and m["actor/clip_frac"] == 0.0
    # r = 0.75 with A<0: clipped at 0.8 when eps_low=0.2 (loss 0.8), untouched with eps_low=0.3
    # (loss 0.75)
    loss, m = ppo([0.75], [-1.0], clip_ratio_low=0.2)
    assert (
        loss.item() == pytest.approx(0.8)
        and m["actor/clip_frac"] == 1.0
        and m["actor/clip_frac_low"] == 1.0
    )
    loss, m = ppo([0.75], [-1.0], clip_ratio_low=0.3)
    assert loss.item() == pytest.approx(0.75) and m["actor/clip_frac"] == 0.0


def test_ppo_masked_tokens_contribute_zero():
    loss, m = ppo([1.5, 1.5, 0.5], [2.0, 2.0, -1.0], mask=[1, 0, 0])
    assert loss[0].tolist() == pytest.approx([-2.56, 0.0, 0.0])
    # clip_frac over the 1 real token (clipped) -> 1.0
    assert m["actor/clip_frac"] == 1.0
    # NaN-free and zero everywhere when everything is masked
    loss, m = ppo([1.5, 0.5], [1.0, 1.0], mask=[0, 0])
    assert loss.abs().sum() == 0 and m["actor/clip_frac"] == 0.0
    assert all(math.isfinite(v) for v in m.values())


def test_ppo_gradient_is_zero_where_clipped():
    # d loss / d logp = -A r inside the trust region, 0 where the clip is active
    logp = torch.tensor([[math.log(1.1), math.log(1.5)]], dtype=torch.float64, requires_grad=True)
    a = torch.tensor([[2.0, 2.0]], dtype=torch.float64)
    loss, _ = POLICY_LOSSES.get("ppo_clip")(
        logp, loss_mb(logp, torch.zeros(1, 2, dtype=torch.float64), a), cfg()
    )
    loss.sum().backward()
    assert logp.grad[0].tolist() == pytest.approx([-2.2, 0.0])


@pytest.mark.parametrize("name", ["ppo_clip", "gspo", "gspo_token", "decoupled_ppo"])
@pytest.mark.parametrize("delta", [25.0, -25.0, 80.0, -1e4])
def test_extreme_log_ratio_is_finite(name, delta):
    logp = torch.tensor([[delta, 0.0]], requires_grad=True)
    old = torch.zeros(1, 2)
    for a in (torch.tensor([[1.0, -1.0]]), torch.tensor([[-1.0, 1.0]])):
        for c in (None, 3.0):
            for rollout in (old, torch.tensor([[-delta, 30.0]])):
                loss, m = POLICY_LOSSES.get(name)(
                    logp, loss_mb(logp, old, a, rollout=rollout), cfg(clip_ratio_c=c)
                )
                assert torch.isfinite(loss).all() and all(math.isfinite(v) for v in m.values())
                logp.grad = None
                loss.sum().backward()
                assert torch.isfinite(logp.grad).all()


def test_ppo_with_real_config():
    # AlgorithmConfig defaults: clip 0.2 / 0.2 -> r=1.25, A=1 clipped at 1.2
    logp = torch.tensor([[math.log(1.25)]])
    loss, m = POLICY_LOSSES.get("ppo_clip")(
        logp, loss_mb(logp, torch.zeros(1, 1), torch.ones(1, 1)), AlgorithmConfig()
    )
    assert loss.item() == pytest.approx(-1.2) and m["actor/clip_frac"] == 1.0


# --- GSPO -----------------------------------------------------------------------------------------
def gspo_inputs():
    # row 0: log-ratios [.1, .3] -> mean .2 -> s = e^.2 = 1.221403; A = [1, 1] -> A_0 = 1
    # row 1: log-ratios [-.1, 0, .1] -> mean 0 -> s = 1; A = [-2, -2, -2] -> A_1 = -2
    # row 2: log-ratios [.05, (pad) 7] -> s = e^.05 = 1.051271; A = [.5, (pad) 9] -> A_2 = .5
    lr = torch.tensor([[0.1, 0.3, 0.0], [-0.1, 0.0, 0.1], [0.05, 7.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.float64)
    a = torch.tensor([[1.0, 1.0, 0.0], [-2.0, -2.0, -2.0], [0.5, 9.0, 0.0]], dtype=torch.float64)
    old = torch.full((3, 3), -1.0, dtype=torch.float64)
    logp = (old + lr).requires_grad_(True)
    return logp, loss_mb(logp, old, a, mask)


def test_gspo_by_hand():
    # eps .2/.2: row 0: max(-1.221403, -1.2) = -1.2 (clipped high); row 1: max(2*1, 2*1) = 2;
    # row 2: -.5 * 1.051271 = -.525636 (inside)
    logp, mb = gspo_inputs()
    loss, m = POLICY_LOSSES.get("gspo")(logp, mb, cfg(clip_ratio_high=0.2))
    assert close(loss, [[-1.2, -1.2, 0.0], [2.0, 2.0, 2.0], [-0.525636, 0.0, 0.0]])
    assert m["actor/seq_ratio_mean"] == pytest.approx((math.exp(0.2) + 1 + math.exp(0.05)) / 3)
    assert m["actor/seq_ratio_max"] == pytest.approx(math.exp(0.2))
    assert m["actor/seq_ratio_min"] == pytest.approx(1.0)
    # tokens in clipped sequences: row 0's 2 of 6 valid tokens; 1 sequence of 3
    assert m["actor/clip_frac_high"] == pytest.approx(2 / 6) and m["actor/clip_frac_low"] == 0.0
    assert m["actor/seq_clip_frac"] == pytest.approx(1 / 3)
    # gradient: d loss_i / d logp_t = -A_i s_i / |y_i| per token of row i, summed over the row's
    #   |y_i| tokens
    # loss.sum() counts loss_i |y_i| times -> d/dlogp_t = -A_i s_i (row 0 clipped -> 0)
    loss.sum().backward()
    assert close(logp.grad, [[0, 0, 0], [2.0, 2.0, 2.0], [-0.525636, 0, 0]])


def test_gspo_token_by_hand():
    # same inputs; every token's ratio value is its row's s_i, clipped per token with its own A_t
    logp, mb = gspo_inputs()
    loss, m = POLICY_LOSSES.get("gspo_token")(logp, mb, cfg(clip_ratio_high=0.2))
    assert close(loss, [[-1.2, -1.2, 0.0], [2.0, 2.0, 2.0], [-0.525636, 0.0, 0.0]])
    loss.sum().backward()
    # d/dlogp_t (-A_t sg[s_i] exp(logp_t - sg[logp_t])) = -A_t s_i: [0 (clipped)], [2, 2, 2],
    # [-.525636]
    assert close(logp.grad, [[0, 0, 0], [2.0, 2.0, 2.0], [-0.525636, 0, 0]])
    assert m["actor/clip_frac_high"] == pytest.approx(2 / 6)


# --- decoupled PPO --------------------------------------------------------------------------------
def test_decoupled_ppo_by_hand():
    # token 0: prox - mu = ln 2 -> w = 2; u = 1.1; A = 1 -> 2 * max(-1.1, -1.1) = -2.2
    # token 1: prox - mu = ln .5 -> w = .5; u = 1.5; A = 1 -> .5 * max(-1.5, -1.2) = -.6 (clipped
    #   high at 1.2)
    # token 2: w = 1, u = .5, A = -1 -> max(.5, .8) = .8 (clipped low)
    prox = torch.tensor([[-1.0, -1.0, -1.0]], dtype=torch.float64)
    mu = prox - torch.tensor([[math.log(2.0), math.log(0.5), 0.0]], dtype=torch.float64)
    logp = prox + torch.tensor([[math.log(1.1), math.log(1.5), math.log(0.5)]], dtype=torch.float64)
    a = torch.tensor([[1.0, 1.0, -1.0]], dtype=torch.float64)
    loss, m = POLICY_LOSSES.get("decoupled_ppo")(
        logp, loss_mb(logp, prox, a, rollout=mu), cfg(clip_ratio_high=0.2)
    )
    assert loss[0].tolist() == pytest.approx([-2.2, -0.6, 0.8])
    assert m["actor/behav_weight_mean"] == pytest.approx((2 + 0.5 + 1) / 3)
    assert m["actor/behav_weight_max"] == pytest.approx(2.0)
    assert m["actor/behav_capped_frac"] == 0.0
    assert m["actor/clip_frac_high"] == pytest.approx(1 / 3) and m[
        "actor/clip_frac_low"
    ] == pytest.approx(1 / 3)
    # cap 1.5: token 0 (w = 2 > 1.5) is dropped (weight 0), as AReaL; the others are unchanged
    loss, m = POLICY_LOSSES.get("decoupled_ppo")(
        logp, loss_mb(logp, prox, a, rollout=mu), cfg(clip_ratio_high=0.2, behav_imp_weight_cap=1.5)
    )
    assert loss[0].tolist() == pytest.approx([0.0, -0.6, 0.8])
    assert m["actor/behav_capped_frac"] == pytest.approx(1 / 3)
    # the gradient flows through u only: d/dlogp_0 (-w u A) = -w u A = -2.2 (no cap)
    logp = logp.detach().requires_grad_(True)
    loss, _ = POLICY_LOSSES.get("decoupled_ppo")(
        logp, loss_mb(logp, prox, a, rollout=mu), cfg(clip_ratio_high=0.2)
    )
    loss.sum().backward()
    assert logp.grad[0].tolist() == pytest.approx([-2.2, 0.0, 0.0])


# --- value loss -----------------------------------------------------------------------------------
def test_value_loss_by_hand():
    # clip .2
    # tok 0: V=1, V_old=.5, G=2: (1-2)^2 = 1; clip(1, .3, .7) = .7 -> (.7-2)^2 = 1.69 -> .5 * 1.69 =
    #   .845 (clipped)
    # tok 1: V=1, V_old=.9, G=0: 1; clip(1, .7, 1.1) = 1 -> 1 -> .5 (not clipped)
    # tok 2: V=0, V_old=1, G=.5: .25; clip(0, .8, 1.2) = .8 -> .09 -> .5 * .25 = .125 (not clipped)
    # tok 3: padding -> 0
    v = torch.tensor([[1.0, 1.0, 0.0, 5.0]], requires_grad=True)
    old = torch.tensor([[0.5, 0.9, 1.0, 0.0]])
    g = torch.tensor([[2.0, 0.0, 0.5, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, m = value_loss(v, old, g, mask, 0.2)
    assert loss[0].tolist() == pytest.approx([0.845, 0.5, 0.125, 0.0])
    assert m["critic/vf_clip_frac"] == pytest.approx(1 / 3)
    assert m["critic/vpred_mean"] == pytest.approx(2 / 3)
    loss.sum().backward()
    # clipped token: no gradient to V; others (V - G)
    assert v.grad[0].tolist() == pytest.approx([0.0, 1.0, -0.5, 0.0])
    # clip disabled: .5 (V - G)^2 everywhere
    loss, m = value_loss(v, old, g, mask, None)
    assert (
        loss[0].tolist() == pytest.approx([0.5, 0.5, 0.125, 0.0])
        and m["critic/vf_clip_frac"] == 0.0
    )


# --- aggregation ----------------------------------------------------------------------------------
def test_aggregation_modes_by_hand():
    # rows: [1, 2, 3] (3 tokens), [4] (1 token), [] (empty); norm_len 4
    # n_tokens 4, n_seqs 2 (the empty row does not count)
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [7.0, 7.0, 7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    t = agg_totals(mask, 4)
    assert t == AggTotals(n_tokens=4.0, n_seqs=2.0, norm_len=4.0)
    expected = {
        "token-mean": (6 + 4) / 4,  # 2.5
        "token-sum": 6 + 4,  # 10, no division
        "seq-mean-token-sum": (6 + 4) / 2,  # 5
        "seq-mean-token-mean": (6 / 3 + 4 / 1) / 2,  # 3
        "seq-mean-token-sum-norm": (6 + 4) / (2 * 4),  # 1.25
    }
    assert set(LOSS_AGG.names()) == set(expected)
    for name, value in expected.items():
        assert LOSS_AGG.get(name)(loss, mask, t).item() == pytest.approx(value), name
    # norm_len None: the mask's width (3) -> 10 / (2 * 3)
    assert LOSS_AGG.get("seq-mean-token-sum-norm")(
        loss, mask, agg_totals(mask)
    ).item() == pytest.approx(10 / 6)
    # an empty mini-batch: 0, not NaN
    empty = torch.zeros(2, 3)
    for name in expected:
        out = LOSS_AGG.get(name)(loss[:2], empty, agg_totals(empty, 4))
        assert out.item() == 0.0


def test_aggregation_micro_batches_add_up():
    # rows 0-1 and row 2 as two micro-batches with the mini-batch totals: their sum is the whole
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [7.0, 5.0, 7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 1, 1]])
    t = agg_totals(mask, 5)
    for name in LOSS_AGG.names():
        f = LOSS_AGG.get(name)
        whole = f(loss, mask, t)
        parts = f(loss[:2], mask[:2], t) + f(loss[2:], mask[2:], t)
        assert parts.item() == pytest.approx(whole.item()), name


# --- KL estimators --------------------------------------------------------------------------------
def test_kl_estimators_by_hand():
    logp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64)
    ref = torch.tensor([-1.5, -1.0, -0.5], dtype=torch.float64)
    # log_ratio = logp - ref = [0.5, -1.0, 0.0]
    assert kl_penalty("k1", logp, ref).tolist() == pytest.approx([0.5, -1.0, 0.0])
    # k2 = log_ratio^2 / 2 = [0.125, 0.5, 0]
    assert kl_penalty("k2", logp, ref).tolist() == pytest.approx([0.125, 0.5, 0.0])
    # k3 = exp(ref - logp) - (ref - logp) - 1:
    #   ref-logp = -0.5: e^-0.5 + 0.5 - 1 = 0.6065307 - 0.5 = 0.1065307
    #   ref-logp = +1.0: e^1 - 1 - 1 = 0.7182818
    #   equal -> 0
    assert kl_penalty("k3", logp, ref).tolist() == pytest.approx(
        [0.1065307, 0.7182818, 0.0], abs=1e-6
    )


def test_k3_nonnegative_and_finite():
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(1000, generator=g) * 5
    ref = torch.randn(1000, generator=g) * 5
    k3 = KL_ESTIMATORS.get("k3")(logp, ref)
    assert (k3 >= 0).all() and torch.isfinite(k3).all()
    assert torch.equal(KL_ESTIMATORS.get("k3")(logp, logp), torch.zeros(1000))
    # far-off samples stay finite, with finite gradients
    lp = torch.tensor([-100.0, 100.0], requires_grad=True)
    out = KL_ESTIMATORS.get("k3")(lp, torch.zeros(2))
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(lp.grad).all()


def test_apply_kl_penalty_by_hand():
    # scores at the last valid token: [0, 0, 1] and [0, 2, (pad) 0]
    # k1 = old - ref = [.5, 0, -.5] and [-1, 0, (pad)]; coef .1
    # rewards = scores - .1 k1 = [-.05, 0, 1.05] and [.1, 2, 0]
    # per-sequence summed KL: 0 and -1 -> mean -.5; per-sequence token mean: 0 and -.5 -> mean -.25
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    b = Batch(
        {
            "token_level_scores": torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0], [0.0, 0.0, 0.0]]),
            "old_log_probs": torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, 9.0], [3.0, 3.0, 3.0]]),
            "ref_log_probs": torch.tensor([[-1.5, -1.0, -0.5], [-1.0, -2.0, 0.0], [0.0, 0.0, 0.0]]),
            "response_mask": mask,
        }
    )
    rewards, m = apply_kl_penalty(b, 0.1, "k1")
    assert close(rewards, [[-0.05, 0.0, 1.05], [0.1, 2.0, 0.0], [0.0, 0.0, 0.0]])
    assert m["kl/penalty_mean"] == pytest.approx(-0.5)
    assert m["kl/penalty_token_mean"] == pytest.approx(-0.25)
    assert m["kl/coef"] == pytest.approx(0.1)


def test_kl_controllers_by_hand():
    fixed = FixedKLController(0.05)
    fixed.update(100.0, 256)
    assert fixed.value == 0.05
    # target 6, horizon 10000, n_steps 256
    # kl 9: err = clip(9/6 - 1 = .5, -.2, .2) = .2 -> coef *= 1 + .2 * 256 / 10000 = 1.00512
    ctl = AdaptiveKLController(0.1, 6.0, 10000)
    ctl.update(9.0, 256)
    assert ctl.value == pytest.approx(0.1 * 1.00512)
    # kl 5.4: err = 5.4/6 - 1 = -.1 -> coef *= 1 - .1 * 256 / 10000 = .99744
    ctl.update(5.4, 256)
    assert ctl.value == pytest.approx(0.1 * 1.00512 * 0.99744)
    # kl 0: err = clip(-1) = -.2 -> coef *= 1 - .2 * 256 / 10000 = .99488
    ctl = AdaptiveKLController(0.1, 6.0, 10000)
    ctl.update(0.0, 256)
    assert ctl.value == pytest.approx(0.1 * 0.99488)
    with pytest.raises(ValueError):
        AdaptiveKLController(0.1, 0.0, 10)


# --- registries / helpers -------------------------------------------------------------------------
def test_registry_lookups():
    assert {"grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"} <= set(
        ADVANTAGES.names()
    )
    assert {
        "ppo_clip",
        "gspo",
        "gspo_token",
        "decoupled_ppo",
        "cispo",
        "gmpo",
        "clip_cov",
        "kl_cov",
        "sapo",
    } <= set(POLICY_LOSSES.names())
    assert {"k1", "k2", "k3", "abs", "k1+", "k2+", "k3+"} <= set(KL_ESTIMATORS.names())
    assert POLICY_LOSSES.get("hybridrl.algorithms.losses:ppo_clip_loss") is POLICY_LOSSES.get(
        "ppo_clip"
    )


@pytest.mark.parametrize(
    "registry,typo,suggestion",
    [
        (ADVANTAGES, "grp", "grpo"),
        (POLICY_LOSSES, "ppo_clp", "ppo_clip"),
        (KL_ESTIMATORS, "kl3", "k3"),
        (LOSS_AGG, "token_mean", "token-mean"),
    ],
)
def test_registry_unknown_name_suggests(registry, typo, suggestion):
    with pytest.raises(KeyError, match="did you mean") as e:
        registry.get(typo)
    assert suggestion in str(e.value)


def test_registry_unknown_without_close_match():
    with pytest.raises(KeyError) as e:
        POLICY_LOSSES.get("zzzzzzzz")
    assert "registered" in str(e.value)


def test_masked_mean():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    assert masked_mean(x, torch.tensor([[1, 1, 0], [0, 0, 1]])).item() == pytest.approx(
        (1 + 2 + 6) / 3
    )
    assert masked_mean(x, torch.tensor([[1, 1, 0], [0, 0, 0]]), dim=-1).tolist() == pytest.approx(
        [1.5, 0.0]
    )
    out = masked_mean(x, torch.zeros(2, 3))
    assert out.item() == 0.0 and not torch.isnan(out)
    # NaN in padding does not leak; gradient flows only through real entries
    assert masked_mean(torch.tensor([[1.0, float("nan")]]), torch.tensor([[1, 0]])).item() == 1.0
    xg = x.clone().requires_grad_(True)
    masked_mean(xg, torch.tensor([[1, 0, 0], [0, 0, 1]])).backward()
    assert xg.grad.tolist() == [[0.5, 0, 0], [0, 0, 0.5]]
