"""hybridrl/algorithms: GRPO advantages, the PPO clip loss and the KL estimators, checked against
values worked out by hand."""
from __future__ import annotations

import math
import os
import types

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch

from hybridrl.algorithms import ADVANTAGES, KL_ESTIMATORS, POLICY_LOSSES, compute_advantages, kl_penalty, masked_mean
from hybridrl.config import AlgorithmConfig
from hybridrl.protocol import Batch


def cfg(**kw):
    base = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, norm_adv_by_std=True, advantage="grpo")
    return types.SimpleNamespace(**(base | kw))


def adv_batch(rewards, uids, resp_len=3, mask=None):
    n = len(rewards)
    mask = torch.ones(n, resp_len, dtype=torch.long) if mask is None else torch.tensor(mask)
    return Batch({"rewards": torch.tensor(rewards, dtype=torch.float32), "response_mask": mask}, {"uid": uids})


# --- GRPO advantages ----------------------------------------------------------------
def test_grpo_hand_computed_group():
    # rewards [1, 0, 0, 1]: mean = 2/4 = 0.5
    # unbiased variance = ((.5)^2 * 4) / (4 - 1) = 1/3 -> std = 0.57735
    # advantage = ±0.5 / 0.57735 = ±0.866025
    out = compute_advantages(adv_batch([1, 0, 0, 1], ["g"] * 4), cfg())
    adv = out["advantages"]
    assert adv.shape == (4, 3)
    expected = torch.tensor([0.866025, -0.866025, -0.866025, 0.866025])
    assert torch.allclose(adv, expected.unsqueeze(1).expand(4, 3), atol=1e-5)
    # the input columns are kept
    assert "rewards" in out and out["uid"] == ["g"] * 4


def test_grpo_equal_rewards_give_zero():
    # rewards [1, 1, 1]: mean 1, std 0 -> (1 - 1) / (0 + eps) = 0
    adv = ADVANTAGES.get("grpo")(adv_batch([1, 1, 1], ["g"] * 3), cfg())
    assert torch.equal(adv, torch.zeros(3, 3))
    adv = ADVANTAGES.get("grpo")(adv_batch([0, 0], ["g"] * 2), cfg())
    assert torch.equal(adv, torch.zeros(2, 3))


def test_grpo_group_of_one_is_its_score():
    # veRL convention: a singleton group has mean 0 and std 1 -> (0.7 - 0) / (1 + 1e-6) ≈ 0.7
    adv = ADVANTAGES.get("grpo")(adv_batch([0.7, -2.0], ["a", "b"]), cfg())
    assert torch.allclose(adv[:, 0], torch.tensor([0.7, -2.0]), atol=1e-5)
    adv = ADVANTAGES.get("grpo")(adv_batch([0.7], ["a"]), cfg(norm_adv_by_std=False))
    assert torch.allclose(adv[:, 0], torch.tensor([0.7]), atol=1e-6)


def test_grpo_groups_by_uid_not_position():
    # interleaved: a, b, a, b. Group a = [1, 0] -> mean .5, unbiased std = sqrt(.5) = 0.70711 -> ±0.70711
    # group b = [3, 3] -> 0. Positional grouping into pairs would give different numbers.
    adv = ADVANTAGES.get("grpo")(adv_batch([1, 3, 0, 3], ["a", "b", "a", "b"]), cfg())
    assert torch.allclose(adv[:, 0], torch.tensor([0.707107, 0.0, -0.707107, 0.0]), atol=1e-5)
    # a permutation of the rows permutes the advantages
    perm = [2, 0, 3, 1]
    b = adv_batch([1, 3, 0, 3], ["a", "b", "a", "b"])
    adv_p = ADVANTAGES.get("grpo")(b[perm], cfg())
    assert torch.allclose(adv_p, adv[perm])


def test_dr_grpo_is_reward_minus_mean():
    # Dr.GRPO: no std division. group [1, 0, 0, 1] -> r - .5 = [.5, -.5, -.5, .5];
    # group [2, 5, 8] -> mean 5 -> [-3, 0, 3]
    b = adv_batch([1, 0, 2, 0, 1, 5, 8], ["x", "x", "y", "x", "x", "y", "y"])
    adv = ADVANTAGES.get("grpo")(b, cfg(norm_adv_by_std=False))
    assert torch.allclose(adv[:, 0], torch.tensor([0.5, -0.5, -3.0, -0.5, 0.5, 0.0, 3.0]), atol=1e-6)


def test_grpo_masked_tokens_get_zero():
    mask = [[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]]
    adv = ADVANTAGES.get("grpo")(adv_batch([1, 0, 0, 1], ["g"] * 4, mask=mask), cfg())
    m = torch.tensor(mask, dtype=torch.bool)
    assert (adv[~m] == 0).all()
    assert torch.allclose(adv[0, :2], torch.full((2,), 0.866025), atol=1e-5)
    assert torch.allclose(adv[3], torch.full((3,), 0.866025), atol=1e-5)


def test_compute_advantages_with_real_config():
    out = compute_advantages(adv_batch([1, 0, 0, 1], ["g"] * 4), AlgorithmConfig())
    assert torch.allclose(out["advantages"][:, 0], torch.tensor([0.866025, -0.866025, -0.866025, 0.866025]), atol=1e-5)


# --- PPO clip loss -------------------------------------------------------------------------
def ppo(ratios, advs, mask=None, **kw):
    ratio = torch.tensor(ratios, dtype=torch.float64)
    logp = ratio.log().unsqueeze(0)
    old = torch.zeros_like(logp)
    adv = torch.tensor(advs, dtype=torch.float64).unsqueeze(0)
    mask = torch.ones_like(logp) if mask is None else torch.tensor(mask, dtype=torch.float64).unsqueeze(0)
    return POLICY_LOSSES.get("ppo_clip")(logp, old, adv, mask, cfg(**kw))


def test_ppo_clip_per_token_by_hand():
    # eps_low 0.2 -> lower bound 0.8; eps_high 0.28 -> upper bound 1.28.
    # loss = max(-A r, -A clip(r, 0.8, 1.28))
    ratios = [1.1, 1.5, 0.5, 1.1, 1.5, 0.5, 0.9, 1.28]
    advs = [2.0, 2.0, 2.0, -1.0, -1.0, -1.0, 1.0, 1.0]
    expected = [
        -2.2,  # r=1.1 inside, A=+2: -2*1.1
        -2.56,  # r=1.5 above, A=+2: max(-3.0, -2*1.28=-2.56) = -2.56 (clipped)
        -1.0,  # r=0.5 below, A=+2: max(-1.0, -2*0.8=-1.6) = -1.0 (not clipped: pessimistic bound)
        1.1,  # r=1.1 inside, A=-1: 1.1
        1.5,  # r=1.5 above, A=-1: max(1.5, 1.28) = 1.5 (not clipped)
        0.8,  # r=0.5 below, A=-1: max(0.5, 0.8) = 0.8 (clipped)
        -0.9,  # r=0.9 inside, A=+1
        -1.28,  # r=1.28 at the bound: equal either way
    ]
    loss, metrics = ppo(ratios, advs)
    assert torch.allclose(loss[0], torch.tensor(expected, dtype=torch.float64), atol=1e-9)
    # clipped tokens: index 1 and 5 -> 2/8
    assert metrics["actor/clip_frac"] == pytest.approx(2 / 8)
    assert metrics["actor/ratio_mean"] == pytest.approx(sum(ratios) / 8)


def test_ppo_separate_low_and_high_clip():
    # r = 1.25 with A>0: clipped at 1.2 when eps_high=0.2, untouched when eps_high=0.28
    loss, m = ppo([1.25], [1.0], clip_ratio_high=0.2)
    assert loss.item() == pytest.approx(-1.2) and m["actor/clip_frac"] == 1.0
    loss, m = ppo([1.25], [1.0], clip_ratio_high=0.28)
    assert loss.item() == pytest.approx(-1.25) and m["actor/clip_frac"] == 0.0
    # r = 0.75 with A<0: clipped at 0.8 when eps_low=0.2 (loss 0.8), untouched with eps_low=0.3 (loss 0.75)
    loss, m = ppo([0.75], [-1.0], clip_ratio_low=0.2)
    assert loss.item() == pytest.approx(0.8) and m["actor/clip_frac"] == 1.0
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


def test_ppo_gradient_is_zero_where_clipped():
    # d loss / d logp = -A r inside the trust region, 0 where the clip is active
    logp = torch.tensor([[math.log(1.1), math.log(1.5)]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[2.0, 2.0]], dtype=torch.float64)
    loss, _ = POLICY_LOSSES.get("ppo_clip")(logp, torch.zeros_like(logp), adv, torch.ones_like(logp), cfg())
    loss.sum().backward()
    assert logp.grad[0].tolist() == pytest.approx([-2.2, 0.0])


@pytest.mark.parametrize("delta", [25.0, -25.0, 80.0, -1e4])
def test_ppo_extreme_log_ratio_is_finite(delta):
    logp = torch.tensor([[delta, 0.0]], requires_grad=True)
    old = torch.zeros(1, 2)
    adv = torch.tensor([[1.0, -1.0]])
    adv_neg = torch.tensor([[-1.0, 1.0]])
    for a in (adv, adv_neg):
        loss, m = POLICY_LOSSES.get("ppo_clip")(logp, old, a, torch.ones(1, 2), cfg())
        assert torch.isfinite(loss).all() and all(math.isfinite(v) for v in m.values())
        logp.grad = None
        loss.sum().backward()
        assert torch.isfinite(logp.grad).all()


def test_ppo_with_real_config():
    # AlgorithmConfig defaults: clip 0.2 / 0.2 -> r=1.25, A=1 clipped at 1.2
    logp = torch.tensor([[math.log(1.25)]])
    loss, m = POLICY_LOSSES.get("ppo_clip")(logp, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), AlgorithmConfig())
    assert loss.item() == pytest.approx(-1.2) and m["actor/clip_frac"] == 1.0


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


# --- registries / helpers ------------------------------------------------------------------------------
def test_registry_lookups():
    assert "grpo" in ADVANTAGES.names()
    assert "ppo_clip" in POLICY_LOSSES.names()
    assert {"k1", "k2", "k3"} <= set(KL_ESTIMATORS.names())
    assert POLICY_LOSSES.get("hybridrl.algorithms.losses:ppo_clip_loss") is POLICY_LOSSES.get("ppo_clip")


@pytest.mark.parametrize("registry,typo,suggestion", [(ADVANTAGES, "grp", "grpo"), (POLICY_LOSSES, "ppo_clp", "ppo_clip"),
                                                      (KL_ESTIMATORS, "kl3", "k3")])
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
    out = masked_mean(x, torch.zeros(2, 3))
    assert out.item() == 0.0 and not torch.isnan(out)
    # NaN-free even with inf-free but masked garbage; gradient flows only through real entries
    xg = x.clone().requires_grad_(True)
    masked_mean(xg, torch.tensor([[1, 0, 0], [0, 0, 1]])).backward()
    assert xg.grad.tolist() == [[0.5, 0, 0], [0, 0, 0.5]]
