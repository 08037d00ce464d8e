"""hybridrl/algorithms: advantage estimators, policy losses, value loss, loss aggregation, KL estimators and
controllers, checked against values worked out by hand (the arithmetic is in the comments)."""
from __future__ import annotations

import math
import os
import types

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch

from hybridrl.algorithms import (ADVANTAGES, KL_ESTIMATORS, LOSS_AGG, POLICY_LOSSES, AdaptiveKLController, AggTotals,
                                 FixedKLController, agg_totals, apply_kl_penalty, compute_advantages, kl_penalty,
                                 masked_mean, masked_whiten, token_level_scores, value_loss)
from hybridrl.config import AlgorithmConfig
from hybridrl.protocol import Batch


def cfg(**kw):
    base = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, norm_adv_by_std=True, advantage="grpo",
                gamma=1.0, lam=1.0, behav_imp_weight_cap=None)
    return types.SimpleNamespace(**(base | kw))


def adv_batch(rewards, uids, resp_len=3, mask=None):
    """Outcome rewards placed at each row's last valid token, as the reward step does."""
    n = len(rewards)
    mask = torch.ones(n, resp_len, dtype=torch.long) if mask is None else torch.tensor(mask)
    tlr = token_level_scores(torch.tensor(rewards, dtype=torch.float32), mask)
    return Batch({"token_level_rewards": tlr, "response_mask": mask}, {"uid": uids})


def close(t: torch.Tensor, expected, atol=1e-6) -> bool:
    return torch.allclose(t.detach().double(), torch.tensor(expected, dtype=torch.float64), atol=atol, rtol=1e-6)


def adv(name, batch, c=None):
    return ADVANTAGES.get(name)(batch, c or cfg())["advantages"]


# --- helpers ----------------------------------------------------------------------------------------
def test_token_level_scores_at_last_valid_token():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1], [0, 1, 1, 0]])
    out = token_level_scores(torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]), mask)
    assert out.tolist() == [[0, 0, 1, 0], [2, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 4], [0, 0, 5, 0]]


def test_masked_whiten_by_hand():
    # valid [1, 2, 3] (the 100 is padding): mean 2, unbiased var ((1)+(0)+(1))/2 = 1 -> [-1, 0, 1, 0]
    out = masked_whiten(torch.tensor([[1.0, 2.0, 3.0, 100.0]]), torch.tensor([[1, 1, 1, 0]]))
    assert out[0].tolist() == pytest.approx([-1.0, 0.0, 1.0, 0.0], abs=1e-6)
    # one valid token: variance taken as 0 -> 0; none: all zero, no NaN
    assert masked_whiten(torch.tensor([[5.0, 1.0]]), torch.tensor([[1, 0]])).tolist() == [[0.0, 0.0]]
    assert masked_whiten(torch.tensor([[5.0, 1.0]]), torch.tensor([[0, 0]])).tolist() == [[0.0, 0.0]]


# --- GRPO / Dr.GRPO -------------------------------------------------------------------------------------
def test_grpo_hand_computed_group():
    # rewards [1, 0, 0, 1]: mean = 2/4 = 0.5
    # unbiased variance = ((.5)^2 * 4) / (4 - 1) = 1/3 -> std = 0.57735
    # advantage = ±0.5 / (0.57735 + 1e-6) = ±0.866024
    out = compute_advantages(adv_batch([1, 0, 0, 1], ["g"] * 4), cfg())
    a = out["advantages"]
    assert a.shape == (4, 3)
    expected = torch.tensor([0.866025, -0.866025, -0.866025, 0.866025])
    assert torch.allclose(a, expected.unsqueeze(1).expand(4, 3), atol=1e-5)
    # the input columns are kept
    assert "token_level_rewards" in out and out["uid"] == ["g"] * 4


def test_grpo_equal_rewards_give_zero():
    # rewards [1, 1, 1]: mean 1, std 0 -> (1 - 1) / (0 + eps) = 0
    assert torch.equal(adv("grpo", adv_batch([1, 1, 1], ["g"] * 3)), torch.zeros(3, 3))
    assert torch.equal(adv("grpo", adv_batch([0, 0], ["g"] * 2)), torch.zeros(2, 3))


def test_grpo_group_of_one_is_its_score():
    # veRL convention: a singleton group has mean 0 and std 1 -> (0.7 - 0) / (1 + 1e-6) ≈ 0.7
    a = adv("grpo", adv_batch([0.7, -2.0], ["a", "b"]))
    assert torch.allclose(a[:, 0], torch.tensor([0.7, -2.0]), atol=1e-5)
    a = adv("grpo", adv_batch([0.7], ["a"]), cfg(norm_adv_by_std=False))
    assert torch.allclose(a[:, 0], torch.tensor([0.7]), atol=1e-6)


def test_grpo_groups_by_uid_not_position():
    # interleaved: a, b, a, b. Group a = [1, 0] -> mean .5, unbiased std = sqrt(.5) = 0.70711 -> ±0.70711
    # group b = [3, 3] -> 0. Positional grouping into pairs would give different numbers.
    a = adv("grpo", adv_batch([1, 3, 0, 3], ["a", "b", "a", "b"]))
    assert torch.allclose(a[:, 0], torch.tensor([0.707107, 0.0, -0.707107, 0.0]), atol=1e-5)
    # a permutation of the rows permutes the advantages
    perm = [2, 0, 3, 1]
    b = adv_batch([1, 3, 0, 3], ["a", "b", "a", "b"])
    assert torch.allclose(adv("grpo", b[perm]), a[perm])


def test_dr_grpo_is_reward_minus_mean():
    # Dr.GRPO: no std division. group x [1, 0, 0, 1] -> r - .5 = [.5, -.5, -.5, .5];
    # group y [2, 5, 8] -> mean 5 -> [-3, 0, 3]
    b = adv_batch([1, 0, 2, 0, 1, 5, 8], ["x", "x", "y", "x", "x", "y", "y"])
    expected = torch.tensor([0.5, -0.5, -3.0, -0.5, 0.5, 0.0, 3.0])
    assert torch.allclose(adv("grpo", b, cfg(norm_adv_by_std=False))[:, 0], expected, atol=1e-6)
    # "dr_grpo" never divides, whatever norm_adv_by_std says
    assert torch.allclose(adv("dr_grpo", b, cfg(norm_adv_by_std=True))[:, 0], expected, atol=1e-6)
    assert torch.allclose(adv("dr_grpo", adv_batch([0.7], ["a"]))[:, 0], torch.tensor([0.7]))


def test_grpo_masked_tokens_get_zero():
    mask = [[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]]
    # the all-masked row 3 cannot hold its reward: scores are [1, 0, 0, 1] -> same numbers as above
    a = adv("grpo", adv_batch([1, 0, 7, 1], ["g"] * 4, mask=mask))
    m = torch.tensor(mask, dtype=torch.bool)
    assert (a[~m] == 0).all()
    assert torch.allclose(a[0, :2], torch.full((2,), 0.866025), atol=1e-5)
    assert torch.allclose(a[3], torch.full((3,), 0.866025), atol=1e-5)


def test_grpo_sums_token_level_rewards():
    # KL in the reward: token rewards [-.1, .2, 1] and [0, -.2, 0] -> scores 1.1 and -0.2 -> ±(0.65 / 0.919239) = ±0.707107
    tlr = torch.tensor([[-0.1, 0.2, 1.0], [0.0, -0.2, 0.0]])
    b = Batch({"token_level_rewards": tlr, "response_mask": torch.ones(2, 3)}, {"uid": ["g", "g"]})
    assert torch.allclose(adv("grpo", b)[:, 0], torch.tensor([0.707107, -0.707107]), atol=1e-5)


def test_grpo_falls_back_to_a_rewards_column():
    b = Batch({"rewards": torch.tensor([1.0, 0.0, 0.0, 1.0]), "response_mask": torch.ones(4, 2)}, {"uid": ["g"] * 4})
    assert torch.allclose(adv("grpo", b)[:, 0], torch.tensor([0.866025, -0.866025, -0.866025, 0.866025]), atol=1e-5)


def test_compute_advantages_with_real_config():
    out = compute_advantages(adv_batch([1, 0, 0, 1], ["g"] * 4), AlgorithmConfig())
    assert torch.allclose(out["advantages"][:, 0], torch.tensor([0.866025, -0.866025, -0.866025, 0.866025]), atol=1e-5)
    # recomputing replaces the column instead of failing the union
    again = compute_advantages(out, AlgorithmConfig())
    assert torch.equal(again["advantages"], out["advantages"])


# --- RLOO ---------------------------------------------------------------------------------------------------
def test_rloo_by_hand():
    # group g [1, 0, 0, 1]: A_0 = 1 - (0 + 0 + 1)/3 = 2/3, A_1 = 0 - (1 + 0 + 1)/3 = -2/3
    # group h [2, 4]: 2 - 4 = -2, 4 - 2 = 2; singleton s [5]: no baseline -> 5
    b = adv_batch([1, 0, 2, 0, 1, 4, 5], ["g", "g", "h", "g", "g", "h", "s"])
    expected = [2 / 3, -2 / 3, -2.0, -2 / 3, 2 / 3, 2.0, 5.0]
    a = adv("rloo", b, cfg(advantage="rloo"))
    assert a[:, 0].tolist() == pytest.approx(expected, abs=1e-6)
    assert torch.equal(a[:, 0:1].expand(7, 3), a)
    assert torch.equal(adv("rloo", adv_batch([3, 3, 3], ["g"] * 3)), torch.zeros(3, 3))


# --- REINFORCE++ ---------------------------------------------------------------------------------------------
def test_reinforce_pp_by_hand():
    # gamma 0.5. row 0 (3 tokens, score 1 at t=2): G = [0.25, 0.5, 1]
    #            row 1 (2 tokens, score 2 at t=1): G = [1, 2, (pad) 0]
    # valid G: 0.25 .5 1 1 2 -> mean 4.75/5 = 0.95; deviations -.7 -.45 .05 .05 1.05
    # squares .49 .2025 .0025 .0025 1.1025 = 1.8 -> unbiased var 1.8/4 = .45, std .670820
    b = adv_batch([1, 2], ["a", "b"], mask=[[1, 1, 1], [1, 1, 0]])
    out = ADVANTAGES.get("reinforce_pp")(b, cfg(gamma=0.5))
    assert close(out["returns"], [[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]])
    std = math.sqrt(0.45)
    expected = [[-0.7 / std, -0.45 / std, 0.05 / std], [0.05 / std, 1.05 / std, 0.0]]
    assert torch.allclose(out["advantages"], torch.tensor(expected), atol=1e-5)


def test_reinforce_pp_return_restarts_after_padding():
    # gamma 1, mask [1, 0, 1], rewards [0, (pad) 5, 1]: G_2 = 1, G_1 = 0 (padding), G_0 = 0 + G_1 = 0
    b = Batch({"token_level_rewards": torch.tensor([[0.0, 5.0, 1.0]]), "response_mask": torch.tensor([[1, 0, 1]])},
              {"uid": ["a"]})
    assert ADVANTAGES.get("reinforce_pp")(b, cfg())["returns"].tolist() == [[0.0, 0.0, 1.0]]


def test_reinforce_pp_baseline_by_hand():
    # scores [1, 0, 3], uids [a, a, b]: a mean .5 -> [.5, -.5]; b is a singleton: mean 0 -> 3
    # tokens (masks [1,1], [1,0], [1,1]): .5 .5 -.5 3 3 -> mean 6.5/5 = 1.3
    # deviations -.8 -.8 -1.8 1.7 1.7, squares .64 .64 3.24 2.89 2.89 = 10.3 -> var 10.3/4 = 2.575
    b = adv_batch([1, 0, 3], ["a", "a", "b"], resp_len=2, mask=[[1, 1], [1, 0], [1, 1]])
    std = math.sqrt(2.575)
    expected = [[-0.8 / std, -0.8 / std], [-1.8 / std, 0.0], [1.7 / std, 1.7 / std]]
    assert torch.allclose(adv("reinforce_pp_baseline", b), torch.tensor(expected), atol=1e-5)


# --- GAE ---------------------------------------------------------------------------------------------------------
def test_gae_by_hand():
    # gamma .9, lam .5, mask [1, 1, 1, 0], r = [0, 0, 1, (pad) 9], V = [.5, .6, .8, (pad) 7]; V after t=2 is 0
    # t=2: delta = 1 + .9*0 - .8 = .2                  A_2 = .2
    # t=1: delta = 0 + .9*.8 - .6 = .12                A_1 = .12 + .45*.2 = .21
    # t=0: delta = 0 + .9*.6 - .5 = .04                A_0 = .04 + .45*.21 = .1345
    # returns = A + V = [.6345, .81, 1.0, 0]
    # whitening: mean .5445/3 = .1815; deviations -.047 .0285 .0185; squares sum .0033635 -> var .00168175
    b = Batch({"token_level_rewards": torch.tensor([[0.0, 0.0, 1.0, 9.0]]), "values": torch.tensor([[0.5, 0.6, 0.8, 7.0]]),
               "response_mask": torch.tensor([[1, 1, 1, 0]])}, {"uid": ["a"]})
    out = ADVANTAGES.get("gae")(b, cfg(gamma=0.9, lam=0.5))
    assert out["returns"][0].tolist() == pytest.approx([0.6345, 0.81, 1.0, 0.0], abs=1e-6)
    std = math.sqrt(0.00168175)
    assert out["advantages"][0].tolist() == pytest.approx([-0.047 / std, 0.0285 / std, 0.0185 / std, 0.0], abs=1e-4)


def test_gae_skips_padded_positions():
    # gamma = lam = 1, mask [1, 0, 1], r [0, (pad) 5, 1], V [.5, (pad) 9, .8]
    # t=2: delta = 1 - .8 = .2 -> A_2 = .2; t=1 padded: skipped; t=0: delta = 0 + .8 - .5 = .3 -> A_0 = .3 + .2 = .5
    b = Batch({"token_level_rewards": torch.tensor([[0.0, 5.0, 1.0]]), "values": torch.tensor([[0.5, 9.0, 0.8]]),
               "response_mask": torch.tensor([[1, 0, 1]])}, {"uid": ["a"]})
    out = ADVANTAGES.get("gae")(b, cfg())
    assert out["returns"][0].tolist() == pytest.approx([1.0, 0.0, 1.0])
    # whitening [.5, .2]: mean .35, unbiased var (.15^2 * 2)/1 = .045 -> ±.15/.212132 = ±.707107
    assert out["advantages"][0].tolist() == pytest.approx([0.707107, 0.0, -0.707107], abs=1e-5)


def test_compute_advantages_adds_gae_returns():
    b = Batch({"token_level_rewards": torch.tensor([[0.0, 1.0], [0.0, 0.0]]), "values": torch.zeros(2, 2),
               "response_mask": torch.ones(2, 2)}, {"uid": ["a", "b"]})
    out = compute_advantages(b, cfg(advantage="gae"))
    assert out["returns"].tolist() == [[1.0, 1.0], [0.0, 0.0]]
    assert "advantages" in out and "values" in out


# --- PPO clip loss -------------------------------------------------------------------------
def loss_mb(logp, old, adv, mask=None, rollout=None):
    mask = torch.ones_like(logp) if mask is None else mask
    return Batch({"old_log_probs": old, "rollout_log_probs": old if rollout is None else rollout,
                  "advantages": adv, "response_mask": mask})


def ppo(ratios, advs, mask=None, name="ppo_clip", **kw):
    ratio = torch.tensor(ratios, dtype=torch.float64)
    logp = ratio.log().unsqueeze(0)
    old = torch.zeros_like(logp)
    a = torch.tensor(advs, dtype=torch.float64).unsqueeze(0)
    mask = None if mask is None else torch.tensor(mask, dtype=torch.float64).unsqueeze(0)
    return POLICY_LOSSES.get(name)(logp, loss_mb(logp, old, a, mask), cfg(**kw))


def test_ppo_clip_per_token_by_hand():
    # eps_low 0.2 -> lower bound 0.8; eps_high 0.28 -> upper bound 1.28; dual clip c = 3 (not reached here)
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
    assert metrics["actor/ratio_max"] == pytest.approx(1.5) and metrics["actor/ratio_min"] == pytest.approx(0.5)
    # k1: mean(old - logp) = -mean(log r)
    assert metrics["actor/approx_kl_old"] == pytest.approx(-sum(math.log(r) for r in ratios) / 8)
    # k3: mean((r - 1) - log r)
    assert metrics["actor/approx_kl_old_k3"] == pytest.approx(sum(r - 1 - math.log(r) for r in ratios) / 8)


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
    loss, _ = POLICY_LOSSES.get("ppo_clip")(logp, loss_mb(logp, torch.zeros(1, 1, dtype=torch.float64),
                                                          -torch.ones(1, 1, dtype=torch.float64)), cfg())
    loss.sum().backward()
    assert logp.grad.item() == 0.0


def test_ppo_separate_low_and_high_clip():
    # r = 1.25 with A>0: clipped at 1.2 when eps_high=0.2, untouched when eps_high=0.28
    loss, m = ppo([1.25], [1.0], clip_ratio_high=0.2)
    assert loss.item() == pytest.approx(-1.2) and m["actor/clip_frac"] == 1.0 and m["actor/clip_frac_high"] == 1.0
    loss, m = ppo([1.25], [1.0], clip_ratio_high=0.28)
    assert loss.item() == pytest.approx(-1.25) and m["actor/clip_frac"] == 0.0
    # r = 0.75 with A<0: clipped at 0.8 when eps_low=0.2 (loss 0.8), untouched with eps_low=0.3 (loss 0.75)
    loss, m = ppo([0.75], [-1.0], clip_ratio_low=0.2)
    assert loss.item() == pytest.approx(0.8) and m["actor/clip_frac"] == 1.0 and m["actor/clip_frac_low"] == 1.0
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
    loss, _ = POLICY_LOSSES.get("ppo_clip")(logp, loss_mb(logp, torch.zeros(1, 2, dtype=torch.float64), a), cfg())
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
                loss, m = POLICY_LOSSES.get(name)(logp, loss_mb(logp, old, a, rollout=rollout), cfg(clip_ratio_c=c))
                assert torch.isfinite(loss).all() and all(math.isfinite(v) for v in m.values())
                logp.grad = None
                loss.sum().backward()
                assert torch.isfinite(logp.grad).all()


def test_ppo_with_real_config():
    # AlgorithmConfig defaults: clip 0.2 / 0.2 -> r=1.25, A=1 clipped at 1.2
    logp = torch.tensor([[math.log(1.25)]])
    loss, m = POLICY_LOSSES.get("ppo_clip")(logp, loss_mb(logp, torch.zeros(1, 1), torch.ones(1, 1)), AlgorithmConfig())
    assert loss.item() == pytest.approx(-1.2) and m["actor/clip_frac"] == 1.0


# --- GSPO ----------------------------------------------------------------------------------------------------
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
    # gradient: d loss_i / d logp_t = -A_i s_i / |y_i| per token of row i, summed over the row's |y_i| tokens
    # loss.sum() counts loss_i |y_i| times -> d/dlogp_t = -A_i s_i (row 0 clipped -> 0)
    loss.sum().backward()
    assert close(logp.grad, [[0, 0, 0], [2.0, 2.0, 2.0], [-0.525636, 0, 0]])


def test_gspo_token_by_hand():
    # same inputs; every token's ratio value is its row's s_i, clipped per token with its own A_t
    logp, mb = gspo_inputs()
    loss, m = POLICY_LOSSES.get("gspo_token")(logp, mb, cfg(clip_ratio_high=0.2))
    assert close(loss, [[-1.2, -1.2, 0.0], [2.0, 2.0, 2.0], [-0.525636, 0.0, 0.0]])
    loss.sum().backward()
    # d/dlogp_t (-A_t sg[s_i] exp(logp_t - sg[logp_t])) = -A_t s_i: [0 (clipped)], [2, 2, 2], [-.525636]
    assert close(logp.grad, [[0, 0, 0], [2.0, 2.0, 2.0], [-0.525636, 0, 0]])
    assert m["actor/clip_frac_high"] == pytest.approx(2 / 6)


# --- decoupled PPO --------------------------------------------------------------------------------------------------
def test_decoupled_ppo_by_hand():
    # token 0: prox - mu = ln 2 -> w = 2; u = 1.1; A = 1 -> 2 * max(-1.1, -1.1) = -2.2
    # token 1: prox - mu = ln .5 -> w = .5; u = 1.5; A = 1 -> .5 * max(-1.5, -1.2) = -.6 (clipped high at 1.2)
    # token 2: w = 1, u = .5, A = -1 -> max(.5, .8) = .8 (clipped low)
    prox = torch.tensor([[-1.0, -1.0, -1.0]], dtype=torch.float64)
    mu = prox - torch.tensor([[math.log(2.0), math.log(0.5), 0.0]], dtype=torch.float64)
    logp = prox + torch.tensor([[math.log(1.1), math.log(1.5), math.log(0.5)]], dtype=torch.float64)
    a = torch.tensor([[1.0, 1.0, -1.0]], dtype=torch.float64)
    loss, m = POLICY_LOSSES.get("decoupled_ppo")(logp, loss_mb(logp, prox, a, rollout=mu), cfg(clip_ratio_high=0.2))
    assert loss[0].tolist() == pytest.approx([-2.2, -0.6, 0.8])
    assert m["actor/behav_weight_mean"] == pytest.approx((2 + 0.5 + 1) / 3)
    assert m["actor/behav_weight_max"] == pytest.approx(2.0)
    assert m["actor/behav_capped_frac"] == 0.0
    assert m["actor/clip_frac_high"] == pytest.approx(1 / 3) and m["actor/clip_frac_low"] == pytest.approx(1 / 3)
    # cap 1.5: token 0 (w = 2 > 1.5) is dropped (weight 0), as AReaL; the others are unchanged
    loss, m = POLICY_LOSSES.get("decoupled_ppo")(logp, loss_mb(logp, prox, a, rollout=mu),
                                                  cfg(clip_ratio_high=0.2, behav_imp_weight_cap=1.5))
    assert loss[0].tolist() == pytest.approx([0.0, -0.6, 0.8])
    assert m["actor/behav_capped_frac"] == pytest.approx(1 / 3)
    # the gradient flows through u only: d/dlogp_0 (-w u A) = -w u A = -2.2 (no cap)
    logp = logp.detach().requires_grad_(True)
    loss, _ = POLICY_LOSSES.get("decoupled_ppo")(logp, loss_mb(logp, prox, a, rollout=mu), cfg(clip_ratio_high=0.2))
    loss.sum().backward()
    assert logp.grad[0].tolist() == pytest.approx([-2.2, 0.0, 0.0])


# --- value loss -----------------------------------------------------------------------------------------------------
def test_value_loss_by_hand():
    # clip .2
    # tok 0: V=1, V_old=.5, G=2: (1-2)^2 = 1; clip(1, .3, .7) = .7 -> (.7-2)^2 = 1.69 -> .5 * 1.69 = .845 (clipped)
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
    assert loss[0].tolist() == pytest.approx([0.5, 0.5, 0.125, 0.0]) and m["critic/vf_clip_frac"] == 0.0


# --- aggregation ----------------------------------------------------------------------------------------------------
def test_aggregation_modes_by_hand():
    # rows: [1, 2, 3] (3 tokens), [4] (1 token), [] (empty); norm_len 4
    # n_tokens 4, n_seqs 2 (the empty row does not count)
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [7.0, 7.0, 7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    t = agg_totals(mask, 4)
    assert t == AggTotals(n_tokens=4.0, n_seqs=2.0, norm_len=4.0)
    expected = {
        "token-mean": (6 + 4) / 4,  # 2.5
        "seq-mean-token-sum": (6 + 4) / 2,  # 5
        "seq-mean-token-mean": (6 / 3 + 4 / 1) / 2,  # 3
        "seq-mean-token-sum-norm": (6 + 4) / (2 * 4),  # 1.25
    }
    assert set(LOSS_AGG.names()) == set(expected)
    for name, value in expected.items():
        assert LOSS_AGG.get(name)(loss, mask, t).item() == pytest.approx(value), name
    # norm_len None: the mask's width (3) -> 10 / (2 * 3)
    assert LOSS_AGG.get("seq-mean-token-sum-norm")(loss, mask, agg_totals(mask)).item() == pytest.approx(10 / 6)
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


# --- KL estimators ----------------------------------------------------------------------------------
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
    assert kl_penalty("k3", logp, ref).tolist() == pytest.approx([0.1065307, 0.7182818, 0.0], abs=1e-6)


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
    b = Batch({"token_level_scores": torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0], [0.0, 0.0, 0.0]]),
               "old_log_probs": torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, 9.0], [3.0, 3.0, 3.0]]),
               "ref_log_probs": torch.tensor([[-1.5, -1.0, -0.5], [-1.0, -2.0, 0.0], [0.0, 0.0, 0.0]]),
               "response_mask": mask})
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


# --- registries / helpers ------------------------------------------------------------------------------
def test_registry_lookups():
    assert {"grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"} <= set(ADVANTAGES.names())
    assert {"ppo_clip", "gspo", "gspo_token", "decoupled_ppo"} <= set(POLICY_LOSSES.names())
    assert {"k1", "k2", "k3"} <= set(KL_ESTIMATORS.names())
    assert POLICY_LOSSES.get("hybridrl.algorithms.losses:ppo_clip_loss") is POLICY_LOSSES.get("ppo_clip")


@pytest.mark.parametrize("registry,typo,suggestion", [(ADVANTAGES, "grp", "grpo"), (POLICY_LOSSES, "ppo_clp", "ppo_clip"),
                                                      (KL_ESTIMATORS, "kl3", "k3"), (LOSS_AGG, "token_mean", "token-mean")])
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
    assert masked_mean(x, torch.tensor([[1, 1, 0], [0, 0, 1]])).item() == pytest.approx((1 + 2 + 6) / 3)
    assert masked_mean(x, torch.tensor([[1, 1, 0], [0, 0, 0]]), dim=-1).tolist() == pytest.approx([1.5, 0.0])
    out = masked_mean(x, torch.zeros(2, 3))
    assert out.item() == 0.0 and not torch.isnan(out)
    # NaN in padding does not leak; gradient flows only through real entries
    assert masked_mean(torch.tensor([[1.0, float("nan")]]), torch.tensor([[1, 0]])).item() == 1.0
    xg = x.clone().requires_grad_(True)
    masked_mean(xg, torch.tensor([[1, 0, 0], [0, 0, 1]])).backward()
    assert xg.grad.tolist() == [[0.5, 0, 0], [0, 0, 0.5]]
