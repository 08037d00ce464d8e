"""hybridrl/algorithms: advantage estimators (GRPO, Dr.GRPO, RLOO, REINFORCE++, GAE) and their
helpers, checked against values worked out by hand (the arithmetic is in the comments). Losses and
KL are in test_losses.py."""

from __future__ import annotations

import math
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch

from hybridrl.algorithms import (
    ADVANTAGES,
    compute_advantages,
    group_rows,
    masked_whiten,
    token_level_scores,
)
from hybridrl.config import AlgorithmConfig
from hybridrl.protocol import Batch


def cfg(**kw) -> AlgorithmConfig:
    """The typed config the trainer passes, with these tests' defaults; unknown keys fail."""
    base = dict(
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
        norm_adv_by_std=True,
        advantage="grpo",
        gamma=1.0,
        lam=1.0,
        behav_imp_weight_cap=None,
    )
    return AlgorithmConfig(**(base | kw))


def adv_batch(rewards, uids, resp_len=3, mask=None):
    """Outcome rewards placed at each row's last valid token, as the reward step does."""
    n = len(rewards)
    mask = torch.ones(n, resp_len, dtype=torch.long) if mask is None else torch.tensor(mask)
    tlr = token_level_scores(torch.tensor(rewards, dtype=torch.float32), mask)
    return Batch({"token_level_rewards": tlr, "response_mask": mask}, {"uid": uids})


def close(t: torch.Tensor, expected, atol=1e-6) -> bool:
    return torch.allclose(
        t.detach().double(), torch.tensor(expected, dtype=torch.float64), atol=atol, rtol=1e-6
    )


def adv(name, batch, c=None):
    return ADVANTAGES.get(name)(batch, c or cfg())["advantages"]


# --- helpers --------------------------------------------------------------------------------------
def test_token_level_scores_at_last_valid_token():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1], [0, 1, 1, 0]])
    out = token_level_scores(torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]), mask)
    assert out.tolist() == [[0, 0, 1, 0], [2, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 4], [0, 0, 5, 0]]


def test_masked_whiten_shift_mean_false_adds_the_mean_back():
    # valid [1, 2, 6]: mean 3, deviations -2 -1 3, unbiased var (4 + 1 + 9)/2 = 7, std 2.645751
    # shift_mean=False (veRL/TRL): (x - 3)/2.645751 + 3 = [2.244071, 2.622036, 4.133893]; padding
    #   stays 0
    x, m = torch.tensor([[1.0, 2.0, 6.0, 50.0]]), torch.tensor([[1, 1, 1, 0]])
    s = math.sqrt(7.0)
    assert masked_whiten(x, m, shift_mean=False)[0].tolist() == pytest.approx(
        [3 - 2 / s, 3 - 1 / s, 3 + 3 / s, 0.0], abs=1e-6
    )
    assert masked_whiten(x, m)[0].tolist() == pytest.approx([-2 / s, -1 / s, 3 / s, 0.0], abs=1e-6)
    # one valid token: the variance is taken as 0, so the output is the mean, i.e. the value itself
    assert masked_whiten(
        torch.tensor([[5.0, 1.0]]), torch.tensor([[1, 0]]), shift_mean=False
    ).tolist() == [[5.0, 0.0]]


def test_whiten_shift_mean_reaches_the_estimators():
    # reinforce_pp_baseline on scores [1, 0, 0, 0] (one group): centred [.75, -.25, -.25, -.25] on 1
    # token each, mean 0, unbiased var (.5625 + 3*.0625)/3 = .25, std .5 -> [1.5, -.5, -.5, -.5];
    # the mean is 0, so shift_mean=False changes nothing here. reinforce_pp on the same batch: G =
    # scores, mean .25, var .25 -> (G - .25)/.5 = [1.5, -.5, -.5, -.5], and + .25 with
    # shift_mean=False.
    b = adv_batch([1, 0, 0, 0], ["g"] * 4, resp_len=1)
    assert adv("reinforce_pp", b)[:, 0].tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-6)
    got = adv("reinforce_pp", b, cfg(whiten_shift_mean=False))[:, 0].tolist()
    assert got == pytest.approx([1.75, -0.25, -0.25, -0.25], abs=1e-6)
    assert adv("reinforce_pp_baseline", b, cfg(whiten_shift_mean=False))[
        :, 0
    ].tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-6)
    # gae with V = 0, gamma = lam = 1: A = G, so it whitens like reinforce_pp
    g = Batch(b.tensors | {"values": torch.zeros(4, 1)}, b.meta)
    assert adv("gae", g, cfg(whiten_shift_mean=False))[:, 0].tolist() == pytest.approx(
        [1.75, -0.25, -0.25, -0.25], abs=1e-6
    )
    assert AlgorithmConfig().whiten_shift_mean is True


def test_masked_whiten_by_hand():
    # valid [1, 2, 3] (the 100 is padding): mean 2, unbiased var ((1)+(0)+(1))/2 = 1 -> [-1, 0, 1,
    # 0]
    out = masked_whiten(torch.tensor([[1.0, 2.0, 3.0, 100.0]]), torch.tensor([[1, 1, 1, 0]]))
    assert out[0].tolist() == pytest.approx([-1.0, 0.0, 1.0, 0.0], abs=1e-6)
    # one valid token: variance taken as 0 -> 0; none: all zero, no NaN
    assert masked_whiten(torch.tensor([[5.0, 1.0]]), torch.tensor([[1, 0]])).tolist() == [
        [0.0, 0.0]
    ]
    assert masked_whiten(torch.tensor([[5.0, 1.0]]), torch.tensor([[0, 0]])).tolist() == [
        [0.0, 0.0]
    ]


# --- GRPO / Dr.GRPO -------------------------------------------------------------------------------
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
    # interleaved: a, b, a, b. Group a = [1, 0] -> mean .5, unbiased std = sqrt(.5) = 0.70711 ->
    #   ±0.70711
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
    # KL in the reward: token rewards [-.1, .2, 1] and [0, -.2, 0] -> scores 1.1 and -0.2 -> ±(0.65
    # / 0.919239) = ±0.707107
    tlr = torch.tensor([[-0.1, 0.2, 1.0], [0.0, -0.2, 0.0]])
    b = Batch({"token_level_rewards": tlr, "response_mask": torch.ones(2, 3)}, {"uid": ["g", "g"]})
    assert torch.allclose(adv("grpo", b)[:, 0], torch.tensor([0.707107, -0.707107]), atol=1e-5)


def test_grpo_falls_back_to_a_rewards_column():
    b = Batch(
        {"rewards": torch.tensor([1.0, 0.0, 0.0, 1.0]), "response_mask": torch.ones(4, 2)},
        {"uid": ["g"] * 4},
    )
    assert torch.allclose(
        adv("grpo", b)[:, 0], torch.tensor([0.866025, -0.866025, -0.866025, 0.866025]), atol=1e-5
    )


def test_compute_advantages_with_real_config():
    out = compute_advantages(adv_batch([1, 0, 0, 1], ["g"] * 4), AlgorithmConfig())
    assert torch.allclose(
        out["advantages"][:, 0], torch.tensor([0.866025, -0.866025, -0.866025, 0.866025]), atol=1e-5
    )
    # recomputing replaces the column instead of failing the union
    again = compute_advantages(out, AlgorithmConfig())
    assert torch.equal(again["advantages"], out["advantages"])


# --- RLOO -----------------------------------------------------------------------------------------
def test_rloo_by_hand():
    # group g [1, 0, 0, 1]: A_0 = 1 - (0 + 0 + 1)/3 = 2/3, A_1 = 0 - (1 + 0 + 1)/3 = -2/3
    # group h [2, 4]: 2 - 4 = -2, 4 - 2 = 2; singleton s [5]: no baseline -> 5
    b = adv_batch([1, 0, 2, 0, 1, 4, 5], ["g", "g", "h", "g", "g", "h", "s"])
    expected = [2 / 3, -2 / 3, -2.0, -2 / 3, 2 / 3, 2.0, 5.0]
    a = adv("rloo", b, cfg(advantage="rloo"))
    assert a[:, 0].tolist() == pytest.approx(expected, abs=1e-6)
    assert torch.equal(a[:, 0:1].expand(7, 3), a)
    assert torch.equal(adv("rloo", adv_batch([3, 3, 3], ["g"] * 3)), torch.zeros(3, 3))


# --- REINFORCE++ ----------------------------------------------------------------------------------
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


def test_reinforce_pp_return_passes_through_masked_positions():
    # multi-turn: mask [1, 1, 0, 0, 1, 1, (pad) 0], the two 0s at t=2,3 are tool tokens holding junk
    # rewards 5 and 7. gamma .5, rewards [.1, 0, (5), (7), 0, 1, (9)]; a masked position adds
    # nothing, does not discount, does not reset: G_5 = 1, G_4 = 0 + .5*1 = .5, G_3 = G_2 = 0
    # (masked, the running .5 passes through), G_1 = 0 + .5*.5 = .25, G_0 = .1 + .5*.25 = .225.
    # (Resetting at the masked positions gave G_1 = 0, G_0 = .1.)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0]])
    b = Batch(
        {
            "token_level_rewards": torch.tensor([[0.1, 0.0, 5.0, 7.0, 0.0, 1.0, 9.0]]),
            "response_mask": mask,
        },
        {"uid": ["a"]},
    )
    out = ADVANTAGES.get("reinforce_pp")(b, cfg(gamma=0.5))
    assert out["returns"][0].tolist() == pytest.approx([0.225, 0.25, 0.0, 0.0, 0.5, 1.0, 0.0])
    # whitening the valid [.225, .25, .5, 1]: mean 1.975/4 = .49375; deviations -.26875 -.24375
    # .00625 .50625 squares .0722266 .0594141 .0000391 .2562891 = .3879688 -> unbiased var .1293229,
    # std .3596149
    std = math.sqrt(0.3879688 / 3)
    expected = [-0.26875 / std, -0.24375 / std, 0.0, 0.0, 0.00625 / std, 0.50625 / std, 0.0]
    assert out["advantages"][0].tolist() == pytest.approx(expected, abs=1e-5)


def test_reinforce_pp_baseline_by_hand():
    # scores [1, 0, 3], uids [a, a, b]: a mean .5 -> [.5, -.5]; b is a singleton: mean 0 -> 3
    # tokens (masks [1,1], [1,0], [1,1]): .5 .5 -.5 3 3 -> mean 6.5/5 = 1.3
    # deviations -.8 -.8 -1.8 1.7 1.7, squares .64 .64 3.24 2.89 2.89 = 10.3 -> var 10.3/4 = 2.575
    b = adv_batch([1, 0, 3], ["a", "a", "b"], resp_len=2, mask=[[1, 1], [1, 0], [1, 1]])
    std = math.sqrt(2.575)
    expected = [[-0.8 / std, -0.8 / std], [-1.8 / std, 0.0], [1.7 / std, 1.7 / std]]
    assert torch.allclose(adv("reinforce_pp_baseline", b), torch.tensor(expected), atol=1e-5)


# --- GAE ------------------------------------------------------------------------------------------
def test_gae_by_hand():
    # gamma .9, lam .5, mask [1, 1, 1, 0], r = [0, 0, 1, (pad) 9], V = [.5, .6, .8, (pad) 7]; V
    #   after t=2 is 0
    # t=2: delta = 1 + .9*0 - .8 = .2                  A_2 = .2
    # t=1: delta = 0 + .9*.8 - .6 = .12                A_1 = .12 + .45*.2 = .21
    # t=0: delta = 0 + .9*.6 - .5 = .04                A_0 = .04 + .45*.21 = .1345
    # returns = A + V = [.6345, .81, 1.0, 0]
    # whitening: mean .5445/3 = .1815; deviations -.047 .0285 .0185; squares sum .0033635 -> var
    #   .00168175
    b = Batch(
        {
            "token_level_rewards": torch.tensor([[0.0, 0.0, 1.0, 9.0]]),
            "values": torch.tensor([[0.5, 0.6, 0.8, 7.0]]),
            "response_mask": torch.tensor([[1, 1, 1, 0]]),
        },
        {"uid": ["a"]},
    )
    out = ADVANTAGES.get("gae")(b, cfg(gamma=0.9, lam=0.5))
    assert out["returns"][0].tolist() == pytest.approx([0.6345, 0.81, 1.0, 0.0], abs=1e-6)
    std = math.sqrt(0.00168175)
    assert out["advantages"][0].tolist() == pytest.approx(
        [-0.047 / std, 0.0285 / std, 0.0185 / std, 0.0], abs=1e-4
    )


def test_gae_skips_padded_positions():
    # gamma = lam = 1, mask [1, 0, 1], r [0, (pad) 5, 1], V [.5, (pad) 9, .8]
    # t=2: delta = 1 - .8 = .2 -> A_2 = .2; t=1 padded: skipped; t=0: delta = 0 + .8 - .5 = .3 ->
    #   A_0 = .3 + .2 = .5
    b = Batch(
        {
            "token_level_rewards": torch.tensor([[0.0, 5.0, 1.0]]),
            "values": torch.tensor([[0.5, 9.0, 0.8]]),
            "response_mask": torch.tensor([[1, 0, 1]]),
        },
        {"uid": ["a"]},
    )
    out = ADVANTAGES.get("gae")(b, cfg())
    assert out["returns"][0].tolist() == pytest.approx([1.0, 0.0, 1.0])
    # whitening [.5, .2]: mean .35, unbiased var (.15^2 * 2)/1 = .045 -> ±.15/.212132 = ±.707107
    assert out["advantages"][0].tolist() == pytest.approx([0.707107, 0.0, -0.707107], abs=1e-5)


def test_compute_advantages_adds_gae_returns():
    b = Batch(
        {
            "token_level_rewards": torch.tensor([[0.0, 1.0], [0.0, 0.0]]),
            "values": torch.zeros(2, 2),
            "response_mask": torch.ones(2, 2),
        },
        {"uid": ["a", "b"]},
    )
    out = compute_advantages(b, cfg(advantage="gae"))
    assert out["returns"].tolist() == [[1.0, 1.0], [0.0, 0.0]]
    assert "advantages" in out and "values" in out


# --- ReMax ----------------------------------------------------------------------------------------
def test_remax_by_hand():
    # A_t = G_t - b(prompt), G_t = reward-to-go over valid tokens (gamma ignored), b from
    #   'baseline_rewards'.
    # row 0 (a): token rewards [-.1, .2, 1] (KL in the reward) -> G = [1.1, 1.2, 1.0]; b .5 -> [.6,
    #   .7, .5]
    # row 1 (a): [0, 0, (pad) 9], mask [1, 1, 0] -> G = [0, 0, 0]; b .5 -> [-.5, -.5, 0 (pad)]
    # row 2 (a): [0, (tool token) 7, 1], mask [1, 0, 1] -> G = [1, 0, 1] (passes the hole); b .5 ->
    #   [.5, 0, .5]
    # row 3 (b): outcome 2 at the end, b = 2 (greedy scored as well) -> 0 everywhere
    tlr = torch.tensor([[-0.1, 0.2, 1.0], [0.0, 0.0, 9.0], [0.0, 7.0, 1.0], [0.0, 0.0, 2.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 1], [1, 1, 1]])
    b = Batch(
        {
            "token_level_rewards": tlr,
            "response_mask": mask,
            "baseline_rewards": torch.tensor([0.5, 0.5, 0.5, 2.0]),
        },
        {"uid": ["a", "a", "a", "b"]},
    )
    out = ADVANTAGES.get("remax")(b, cfg(gamma=0.5))
    assert close(
        out["advantages"], [[0.6, 0.7, 0.5], [-0.5, -0.5, 0.0], [0.5, 0.0, 0.5], [0.0, 0.0, 0.0]]
    )
    assert close(
        out["returns"], [[1.1, 1.2, 1.0], [0.0, 0.0, 0.0], [1.0, 0.0, 1.0], [2.0, 2.0, 2.0]]
    )
    assert getattr(ADVANTAGES.get("remax"), "needs_greedy_baseline", False)
    assert not any(
        getattr(ADVANTAGES.get(n), "needs_greedy_baseline", False)
        for n in ADVANTAGES.names()
        if n != "remax"
    )


def test_remax_without_baseline_column_names_it():
    with pytest.raises(KeyError, match="baseline_rewards"):
        adv("remax", adv_batch([1, 0], ["a", "a"]))


# --- GRPO pass@k ----------------------------------------------------------------------------------
def test_grpo_passk_by_hand():
    # group h [.2, .9, .5]: only the best (row 1) gets .9 - .5 = .4
    #   std: mean 1.6/3 = .533333, deviations -.333333 .366667 -.033333, squares .111111 .134444
    #   .001111 = .246667,
    #   unbiased var .123333, std .351188 -> .4 / (.351188 + 1e-6) = 1.138986
    # group g [0, 1, .5, 1]: two best tie -> max - second = 0 for everyone
    b = adv_batch([0.2, 0, 0.9, 1, 0.5, 0.5, 1], ["h", "g", "h", "g", "h", "g", "g"])
    a = adv("grpo_passk", b)
    assert a[:, 0].tolist() == pytest.approx(
        [0.0, 0.0, 0.4 / (math.sqrt(0.246667 / 2) + 1e-6), 0.0, 0.0, 0.0, 0.0], abs=1e-5
    )
    assert torch.equal(a[:, 0:1].expand_as(a), a)
    a = adv("grpo_passk", b, cfg(norm_adv_by_std=False))
    assert a[:, 0].tolist() == pytest.approx([0.0, 0.0, 0.4, 0.0, 0.0, 0.0, 0.0], abs=1e-6)


def test_grpo_passk_rejects_a_group_of_one():
    with pytest.raises(ValueError, match="at least 2 samples per group; group 's' has 1"):
        adv("grpo_passk", adv_batch([1, 0, 1], ["g", "g", "s"]))


# --- OPO ------------------------------------------------------------------------------------------
def test_opo_by_hand():
    # group g: lengths [1, 2, 3], scores [1, 0, 1] -> b = (1*1 + 2*0 + 3*1) / 6 = 2/3 -> A = [1/3,
    #   -2/3, 1/3]
    # (here the plain group mean is 2/3 too; group h tells the two baselines apart)
    # group h: lengths [3, 1], scores [0, 1] -> b = (0 + 1) / 4 = .25 -> A = [-.25, .75] (mean
    #   baseline: .5)
    # singleton s: baseline 0 -> A = 2; group e: two empty rows -> nothing to train, 0 (no NaN)
    mask = [[1, 0, 0], [1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 0, 0], [1, 1, 0], [0, 0, 0], [0, 0, 0]]
    b = adv_batch([1, 0, 1, 0, 1, 2, 5, 5], ["g", "g", "g", "h", "h", "s", "e", "e"], mask=mask)
    a = adv("opo", b)
    assert close(
        a,
        [
            [1 / 3, 0, 0],
            [-2 / 3, -2 / 3, 0],
            [1 / 3, 1 / 3, 1 / 3],
            [-0.25] * 3,
            [0.75, 0, 0],
            [2.0, 2.0, 0.0],
            [0, 0, 0],
            [0, 0, 0],
        ],
    )


# --- estimator requirements checked when the config loads -----------------------------------------
def test_config_rejects_what_an_estimator_cannot_get():
    from hybridrl.config import Config, ConfigError, load_config

    # the greedy baseline is a group hook of both modes (tests/test_async.py)
    load_config(Config, None, ["algorithm.advantage=remax", "trainer.mode=async"])
    with pytest.raises(
        ConfigError, match=r"grpo_passk needs trainer.samples_per_prompt >= 2, got 1"
    ):
        load_config(
            Config,
            None,
            [
                "algorithm.advantage=grpo_passk",
                "trainer.samples_per_prompt=1",
                "actor.ppo_minibatch_size=32",
            ],
        )
    for name in ("remax", "grpo_passk", "opo"):
        assert (
            load_config(Config, None, [f"algorithm.advantage={name}"]).algorithm.advantage == name
        )


def test_group_rows_lists_each_uid_in_order_of_first_appearance():
    assert group_rows(["b", "a", "b", "c", "a"]) == [[0, 2], [1, 4], [3]]
    assert group_rows([]) == []
