"""The options veRL users set, each against numbers worked out by hand (the arithmetic is in the
comments and redone with plain ``math`` in the test, never with the code under test): the KL
estimator abs+, GMPO's rollout weights, the rollout correction's batch normalisation and float64
weights, bypass mode with sequence-level and IcePop weights, KL-Cov's |log-ratio| metric, GDPO,
RLOO's group of one, GPG, the optimal token baselines, and the losses reinforce, dro, dppo_tv and
dppo_kl (with the contract every policy loss keeps)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from test_algorithms import cfg, close

from hybridrl.algorithms import ADVANTAGES, LOSS_AGG, POLICY_LOSSES, agg_totals, kl_penalty
from hybridrl.algorithms.rollout_correction import (
    WEIGHT_KEY,
    importance_weights,
    weighted_policy_loss,
)
from hybridrl.config import Config
from hybridrl.config.loader import ConfigError, load_config
from hybridrl.protocol import Batch

D = torch.float64


def t(x, dtype=D):
    return torch.tensor(x, dtype=dtype)


def mb_of(logp, old, adv, mask=None, **extra):
    mask = torch.ones_like(logp) if mask is None else mask
    cols = {"old_log_probs": old, "rollout_log_probs": old, "advantages": adv}
    return Batch(cols | {"response_mask": mask} | extra)


def run(name, logp, mb, c):
    lp = logp.detach().clone().requires_grad_(True)
    loss, metrics = POLICY_LOSSES.get(name)(lp, mb, c)
    loss.sum().backward()
    return loss.detach(), lp.grad, metrics


# --- KL estimator abs+ ----------------------------------------------------------------------------
def test_kl_abs_plus_reads_abs_and_pulls_like_k2():
    # delta = logp - ref = [.5, -1, 0, -2]: value |delta| = [.5, 1, 0, 2]; gradient that of
    # delta^2 / 2, i.e. delta (abs's own gradient would be sign(delta) = [1, -1, 0, -1])
    logp = t([-1.0, -2.0, -0.5, -3.0]).requires_grad_(True)
    ref = t([-1.5, -1.0, -0.5, -1.0])
    out = kl_penalty("abs+", logp, ref)
    out.sum().backward()
    assert close(out, [0.5, 1.0, 0.0, 2.0]) and close(logp.grad, [0.5, -1.0, 0.0, -2.0])
    assert load_config(Config, None, ["algorithm.kl_estimator=abs+"]).algorithm.kl_estimator


# --- GMPO's rollout weights -----------------------------------------------------------------------
def test_gmpo_takes_the_geometric_mean_of_the_rollout_weights_per_row():
    # every log-ratio 0 (s_i = 1), A = 1 on row 0, -2 on row 1; weights row 0 [4, 1] -> g = sqrt(4 *
    # 1) = 2 -> loss -1 * 1 * 2 = -2 on both tokens; row 1 [0 (dropped), 1] -> g = exp((ln 1e-10 +
    # ln(1 + 1e-10)) / 2) = 1e-5 -> loss 2 * 1e-5
    old = torch.full((2, 2), -1.0, dtype=D)
    weights = t([[4.0, 1.0], [0.0, 1.0]])
    mb = mb_of(old, old, t([[1.0, 1.0], [-2.0, -2.0]]), **{WEIGHT_KEY: weights})
    c = cfg(policy_loss_options={"log_clip_low": 0.4, "log_clip_high": 0.4})
    loss, grad, _ = run("gmpo", old, mb, c)
    assert close(loss, [[-2.0, -2.0], [2e-5, 2e-5]], atol=1e-10)
    # d loss_i / d logp_t = -A g / |y| per token; loss.sum() counts each row twice -> -A g
    assert close(grad, [[-2.0, -2.0], [2e-5, 2e-5]], atol=1e-10)
    # the learner does not weight the tokens a second time (arithmetically: -8 and -2)
    gmpo = POLICY_LOSSES.get("gmpo")
    assert torch.equal(weighted_policy_loss(loss, mb, gmpo), loss)
    assert close(weighted_policy_loss(loss, mb, POLICY_LOSSES.get("ppo_clip"))[0], [-8.0, -2.0])


def test_gmpo_keeps_the_row_sign_and_counts_only_gradient_cuts():
    # the conventions table's choices where veRL's geo_mean differs. A = [1, -1, 1] (row mean
    # 1/3 > 0), every l_t = .6 > eps .4: the row's sign clips all three to .4 -> loss -(1/3) e^.4
    # (veRL's per-token sign keeps token 1 at .6: -(1/3) e^((.4 + .6 + .4) / 3)). l = -.6 with
    # A_i > 0 is out of range but its clip does not bind: not counted (veRL counts it)
    old = torch.full((2, 3), -1.0, dtype=D)
    lr = t([[0.6, 0.6, 0.6], [-0.6, 0.0, 0.0]])
    adv = t([[1.0, -1.0, 1.0], [1.0, 1.0, 1.0]])
    c = cfg(policy_loss_options={"log_clip_low": 0.4, "log_clip_high": 0.4})
    loss, _, m = run("gmpo", old + lr, mb_of(old + lr, old, adv), c)
    assert loss[0, 0].item() == pytest.approx(-math.exp(0.4) / 3)
    assert loss[1, 0].item() == pytest.approx(-math.exp(-0.2))
    assert m["actor/clip_frac_high"] == pytest.approx(3 / 6) and m["actor/clip_frac_low"] == 0.0


# --- rollout correction: batch normalisation, float64 ---------------------------------------------
def alg(**kw):
    base = dict(
        rollout_is="token",
        rollout_is_mode="truncate",
        rollout_is_threshold=4.0,
        rollout_is_threshold_lower=None,
        rollout_is_batch_normalize=True,
        rollout_bypass=False,
    )
    return cfg(**(base | kw))


LN2 = math.log(2.0)
# row 0: old - rollout = [ln 2, 0] (sum ln 2), row 1: [-ln 2, pad], row 2: empty
OLD = t([[LN2 - 1.0, -1.0], [-LN2 - 1.0, 5.0], [3.0, 3.0]])
ROLL = t([[-1.0, -1.0], [-1.0, -9.0], [-2.0, -2.0]])
MASK = torch.tensor([[1, 1], [1, 0], [0, 0]])


def test_batch_normalize_token_level_divides_by_the_token_mean():
    # rho = [2, 1, .5] on the valid tokens, mean 3.5 / 3 -> [12/7, 6/7, 3/7]
    w, m = importance_weights(OLD, ROLL, MASK, alg())
    assert close(w, [[12 / 7, 6 / 7], [3 / 7, 0.0], [0.0, 0.0]])
    assert m["rollout_corr/batch_norm_factor"] == pytest.approx(3.5 / 3)
    w, m = importance_weights(OLD, ROLL, MASK, alg(rollout_is_batch_normalize=False))
    assert close(w, [[2.0, 1.0], [0.5, 0.0], [0.0, 0.0]])
    assert "rollout_corr/batch_norm_factor" not in m


def test_batch_normalize_sequence_level_counts_each_sequence_once():
    # rho_0 = 2 (two tokens), rho_1 = .5 (one token); the mean over sequences is 1.25 (a token
    # mean, 4.5 / 3 = 1.5, would weigh row 0 twice) -> [1.6, .4]
    w, m = importance_weights(OLD, ROLL, MASK, alg(rollout_is="sequence"))
    assert close(w, [[1.6, 1.6], [0.4, 0.0], [0.0, 0.0]])
    assert m["rollout_corr/batch_norm_factor"] == pytest.approx(1.25)


def test_batch_normalize_after_the_mask_and_never_by_zero():
    # mask mode [.6, 1.5]: rho [2, 1, .5] -> [0, 1, 0], mean 1/3 -> [0, 3, 0]
    c = alg(rollout_is_mode="mask", rollout_is_threshold=1.5, rollout_is_threshold_lower=0.6)
    w, _ = importance_weights(OLD, ROLL, MASK, c)
    assert close(w, [[0.0, 3.0], [0.0, 0.0], [0.0, 0.0]])
    # every token dropped: the weights stay 0, no division by 0
    c = alg(rollout_is_mode="mask", rollout_is_threshold=0.9, rollout_is_threshold_lower=0.8)
    w, m = importance_weights(OLD, ROLL, MASK, c)
    assert torch.equal(w, torch.zeros_like(w)) and m["rollout_corr/batch_norm_factor"] == 1.0


def test_importance_weights_keep_float64():
    # old - rollout = 1e-9: exp in float64 is 1 + 1e-9; float32 would round it to 1 exactly
    old, roll = t([[-1.0 + 1e-9, -2.0]]), t([[-1.0, -2.0]])
    for level in ("token", "sequence"):
        # the switches of the weights alone (no batch normalisation)
        c = SimpleNamespace(
            rollout_is=level,
            rollout_is_mode="truncate",
            rollout_is_threshold=4.0,
            rollout_is_threshold_lower=None,
            rollout_is_batch_normalize=False,
        )
        w, _ = importance_weights(old, roll, torch.tensor([[1, 0]]), c)
        assert w.dtype == torch.float64
        assert abs(w[0, 0].item() - math.exp(1e-9)) < 1e-15 and w[0, 0].item() != 1.0
    w, _ = importance_weights(old.float(), roll.float(), torch.tensor([[1, 1]]), alg())
    assert w.dtype == torch.float32


# --- bypass mode: the current policy's weight, sequence level and IcePop --------------------------
def bypass_case():
    # mu = old = -1 everywhere (bypass: old_log_probs are the rollout's); logp - mu per row:
    # [.2, .1], [.5, .4], [-.3, -.5]; A = 1, -1, 2
    lr = t([[0.2, 0.1], [0.5, 0.4], [-0.3, -0.5]])
    mu = torch.full((3, 2), -1.0, dtype=D)
    adv = t([[1.0, 1.0], [-1.0, -1.0], [2.0, 2.0]])
    return mu + lr, mb_of(mu + lr, mu, adv)


def test_bypass_sequence_level_icepop_weights_by_the_current_policy():
    # rho_i = exp(sum lr): e^.3 = 1.349859 (kept in [.5, 2]), e^.9 = 2.459603 (above), e^-.8 =
    # .449329 (below) -> w = [1.349859, 0, 0]; loss_t = -w A logp: row 0 logp = [-.8, -.9] ->
    # [1.079887, 1.214873]; gradient -w A (w carries none)
    logp, mb = bypass_case()
    c = alg(
        rollout_bypass=True,
        rollout_is="sequence",
        rollout_is_mode="mask",
        rollout_is_threshold=2.0,
        rollout_is_threshold_lower=0.5,
        rollout_is_batch_normalize=False,
    )
    loss, grad, m = run("reinforce", logp, mb, c)
    e3 = math.exp(0.3)
    assert close(loss, [[0.8 * e3, 0.9 * e3], [0.0, 0.0], [0.0, 0.0]])
    assert close(grad, [[-e3, -e3], [0.0, 0.0], [0.0, 0.0]])
    assert m["rollout_corr/masked_frac"] == pytest.approx(4 / 6)
    # k1 of the current policy against the rollout: mean(mu - logp) = -(.3 + .9 - .8) / 6
    assert m["actor/approx_kl_old"] == pytest.approx(-0.4 / 6)


def test_bypass_token_level_icepop_and_truncation():
    # token rho = e^lr: [1.221403, 1.105171], [1.648721, 1.491825], [.740818, .606531]; IcePop
    # [.7, 1.5] drops 1.648721 and .606531
    logp, mb = bypass_case()
    c = alg(
        rollout_bypass=True,
        rollout_is_mode="mask",
        rollout_is_threshold=1.5,
        rollout_is_threshold_lower=0.7,
        rollout_is_batch_normalize=False,
    )
    _, grad, _ = run("reinforce", logp, mb, c)
    e = math.exp
    assert close(grad, [[-e(0.2), -e(0.1)], [0.0, e(0.4)], [-2 * e(-0.3), 0.0]])
    # truncate at 1.2 with batch normalisation over the micro-batch: w = [1.2, e^.1, 1.2, 1.2,
    # e^-.3, e^-.5], divided by their mean
    c = alg(rollout_bypass=True, rollout_is_threshold=1.2)
    _, grad, m = run("reinforce", logp, mb, c)
    w = [1.2, e(0.1), 1.2, 1.2, e(-0.3), e(-0.5)]
    mean = sum(w) / 6
    expected = [[-w[0] / mean, -w[1] / mean], [w[2] / mean, w[3] / mean]]
    expected.append([-2 * w[4] / mean, -2 * w[5] / mean])
    assert close(grad, expected)
    assert m["rollout_corr/batch_norm_factor"] == pytest.approx(mean)


def test_bypass_weights_need_the_reinforce_loss():
    ok = load_config(
        Config,
        None,
        [
            "algorithm.rollout_bypass=true",
            "algorithm.rollout_is=sequence",
            "algorithm.policy_loss=reinforce",
        ],
    )
    assert ok.algorithm.rollout_is == "sequence"
    with pytest.raises(ConfigError, match="count it twice") as err:
        load_config(Config, None, ["algorithm.rollout_bypass=true", "algorithm.rollout_is=token"])
    assert "\n" not in str(err.value)


# --- KL-Cov's veRL ppo_kl -------------------------------------------------------------------------
def test_kl_cov_logs_the_mean_abs_log_ratio_over_all_valid_tokens():
    # log-ratios [.1, -.2, .3, -.4] valid, 5.0 on a padded token: mean |.| = 1.0 / 4 = .25 (veRL's
    # actor/ppo_kl for kl_cov); the penalised tokens alone give kl_cov_abs
    logp = t([[-0.5, -1.0, -2.0, -2.5, -1.0]])
    old = logp - t([[0.1, -0.2, 0.3, -0.4, 5.0]])
    mask = t([[1, 1, 1, 1, 0]])
    _, _, m = run("kl_cov", logp, mb_of(logp, old, t([[3.0, 1.0, -1.0, -3.0, 0.0]]), mask), cfg())
    assert m["actor/approx_kl_old_abs"] == pytest.approx(0.25)


# --- GDPO -----------------------------------------------------------------------------------------
def sample_std(xs):
    mean = sum(xs) / len(xs)
    return math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))


def test_gdpo_normalises_each_component_then_whitens_the_weighted_sum():
    # group a (rows 0-2): fmt [1, 0, 1], acc [0, 0, 1]; group b (rows 3-4): fmt [1, 1], acc [1, 0];
    # weights fmt 1, acc 2. Per component: (r - mean_g) / (std_g + 1e-6), std unbiased
    fmt, acc = [1.0, 0.0, 1.0, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0, 0.0]
    groups = [[0, 1, 2], [3, 4]]

    def normalised(xs):
        out = [0.0] * 5
        for g in groups:
            vals = [xs[i] for i in g]
            mean, std = sum(vals) / len(vals), sample_std(vals)
            for i in g:
                out[i] = (xs[i] - mean) / (std + 1e-6)
        return out

    total = [f + 2 * a for f, a in zip(normalised(fmt), normalised(acc))]
    # row lengths 1, 2, 1, 3, 1: the whitening is over valid tokens, so row 3 counts three times
    lengths = [1, 2, 1, 3, 1]
    tokens = [total[i] for i in range(5) for _ in range(lengths[i])]
    mean = sum(tokens) / len(tokens)
    var = sum((x - mean) ** 2 for x in tokens) / (len(tokens) - 1)
    expected = [[(total[i] - mean) / math.sqrt(var + 1e-8)] for i in range(5)]
    mask = torch.tensor([[1 if j < n else 0 for j in range(3)] for n in lengths])
    batch = Batch(
        {
            "token_level_rewards": torch.zeros(5, 3),
            "response_mask": mask,
            "reward/fmt": torch.tensor(fmt),
            "reward/acc": torch.tensor(acc),
        },
        {"uid": ["a", "a", "a", "b", "b"]},
    )
    c = cfg(
        advantage="gdpo",
        advantage_options={"reward_keys": ["fmt", "acc"], "reward_weights": [1.0, 2.0]},
    )
    out = ADVANTAGES.get("gdpo")(batch, c)["advantages"]
    assert close(out[:, :1], expected, atol=1e-5)
    assert close(out * (1 - mask), torch.zeros(5, 3).tolist())  # 0 on padding
    assert close(out[3], [expected[3][0]] * 3, atol=1e-5)
    # a missing component names the columns there are
    with pytest.raises(KeyError, match="reward/acc"):
        ADVANTAGES.get("gdpo")(batch, cfg(advantage_options={"reward_keys": ["fmt", "len"]}))


def test_gdpo_config_needs_its_components():
    with pytest.raises(ConfigError, match="advantage_options.: reward_keys is required"):
        load_config(Config, None, ["algorithm.advantage=gdpo"])
    with pytest.raises(ConfigError, match="one weight per component"):
        load_config(
            Config,
            None,
            [
                "algorithm.advantage=gdpo",
                "algorithm.advantage_options.reward_keys=[fmt,acc]",
                "algorithm.advantage_options.reward_weights=[1.0]",
            ],
        )


# --- RLOO's group of one --------------------------------------------------------------------------
def rloo_batch():
    # group a [1, 0, .5], b alone [2]
    mask = torch.ones(4, 2, dtype=torch.long)
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 0.5], [0.0, 2.0]])
    return Batch({"token_level_rewards": rewards, "response_mask": mask}, {"uid": list("aaab")})


def test_rloo_group_of_one_rule():
    # a: A_i = r_i - mean of the others: 1 - .25 = .75, 0 - .75 = -.75, .5 - .5 = 0
    score = ADVANTAGES.get("rloo")(rloo_batch(), cfg(advantage_options={"group_of_one": "score"}))[
        "advantages"
    ]
    assert close(score[:, 0], [0.75, -0.75, 0.0, 2.0])
    zero = ADVANTAGES.get("rloo")(rloo_batch(), cfg(advantage_options={"group_of_one": "zero"}))[
        "advantages"
    ]
    assert close(zero[:, 0], [0.75, -0.75, 0.0, 0.0])
    assert close(ADVANTAGES.get("rloo")(rloo_batch(), cfg())["advantages"], score.tolist())


# --- GPG ------------------------------------------------------------------------------------------
def test_gpg_by_hand():
    # rewards a [1, 0, 0], b [1, 3], c [2]: B = 6 rows, 4 non-zero -> alpha = 1.5
    # a: mean 1/3 -> [2/3, -1/3, -1/3] * 1.5 = [1, -.5, -.5]; b: mean 2 -> [-1.5, 1.5]; c (alone:
    # mean 0) -> 3
    rewards = torch.tensor([[1.0], [0.0], [0.0], [1.0], [3.0], [2.0]])
    batch = Batch(
        {"token_level_rewards": rewards, "response_mask": torch.ones(6, 1)},
        {"uid": list("aaabbc")},
    )
    out = ADVANTAGES.get("gpg")(batch, cfg())["advantages"]
    assert close(out[:, 0], [1.0, -0.5, -0.5, -1.5, 1.5, 3.0])


# --- optimal token baselines ----------------------------------------------------------------------
def otb_batch(mask, rewards, pi, sum_pi_sq, uids, **extra):
    return Batch(
        {
            "token_level_rewards": t(rewards, torch.float32),
            "response_mask": torch.tensor(mask),
            "old_log_probs": t(pi).log(),
            "sum_pi_squared": t(sum_pi_sq),
        }
        | extra,
        {"uid": uids},
    )


# rows 0 and 1 share a group, row 2 is alone. w_t = 1 - 2 pi_t + sum pi^2:
#   row 0: pi [.5, .5, .5], sum pi^2 [.5, .5, .5] -> w [.5, .5, .5], W = [.5, 1, 1.5], G = [1, 1, 1]
#   row 1: pi [.25, .5], sum pi^2 [.25, .5] -> w [.75, .5], W = [.75, 1.25], G = [3, 3]
# b_0 = (1 * .5 + 3 * .75) / (.5 + .75) = 2.2; b_1 = (1 * 1 + 3 * 1.25) / (1 + 1.25) = 4.75 / 2.25
# position 2: only row 0, the unique longest, reaches it: its baseline there is 0 (zero tail)
B1 = 4.75 / 2.25
OTB_EXPECTED = [[1 - 2.2, 1 - B1, 1.0], [3 - 2.2, 3 - B1, 0.0], [5.0, 5.0, 5.0]]


def test_optimal_token_baseline_by_hand():
    batch = otb_batch(
        [[1, 1, 1], [1, 1, 0], [1, 1, 1]],
        [[0, 0, 1], [0, 3, 0], [0, 0, 5]],
        [[0.5, 0.5, 0.5], [0.25, 0.5, 0.9], [0.3, 0.3, 0.3]],
        [[0.5, 0.5, 0.5], [0.25, 0.5, 0.9], [0.3, 0.3, 0.3]],
        ["a", "a", "c"],
    )
    out = ADVANTAGES.get("optimal_token_baseline")(batch, cfg())
    assert close(out["advantages"], OTB_EXPECTED, atol=1e-6)
    assert close(out["returns"], [[1, 1, 1], [3, 3, 0], [5, 5, 5]])
    # squared rollout weights scale w: row 1's by 4 -> W = [3, 5]; b_0 = (.5 + 9) / 3.5, b_1 = 16/6
    weights = torch.ones(3, 3, dtype=D)
    weights[1] = 2.0
    out = ADVANTAGES.get("optimal_token_baseline")(
        batch | Batch({"rollout_is_weights": weights}), cfg()
    )
    b0, b1 = 9.5 / 3.5, 16 / 6
    assert close(out["advantages"][:2], [[1 - b0, 1 - b1, 1.0], [3 - b0, 3 - b1, 0.0]], atol=1e-6)


def test_tir_optimal_token_baseline_lines_up_the_valid_tokens():
    # the same rows with a masked (tool) token inside row 0 at position 1 and one in row 1 at
    # position 0: by valid tokens the rows are the case above; by position they would not be
    batch = otb_batch(
        [[1, 0, 1, 1], [0, 1, 1, 0], [1, 1, 1, 0]],
        [[0, 0, 0, 1], [0, 0, 3, 0], [0, 0, 5, 0]],
        [[0.5, 0.9, 0.5, 0.5], [0.9, 0.25, 0.5, 0.9], [0.3, 0.3, 0.3, 0.9]],
        [[0.5, 0.1, 0.5, 0.5], [0.1, 0.25, 0.5, 0.9], [0.3, 0.3, 0.3, 0.9]],
        ["a", "a", "c"],
    )
    out = ADVANTAGES.get("tir_optimal_token_baseline")(batch, cfg())["advantages"]
    e = OTB_EXPECTED
    expected = [
        [e[0][0], 0.0, e[0][1], e[0][2]],
        [0.0, e[1][0], e[1][1], 0.0],
        [5.0, 5.0, 5.0, 0.0],
    ]
    assert close(out, expected, atol=1e-6)
    by_position = ADVANTAGES.get("optimal_token_baseline")(batch, cfg())["advantages"]
    assert not close(by_position, expected, atol=1e-3)
    assert ADVANTAGES.get("optimal_token_baseline").needs_sum_pi_squared


# --- the log-prob losses --------------------------------------------------------------------------
def test_reinforce_by_hand():
    # loss -A logp, gradient -A
    logp, old = t([[-1.0, -2.0, -0.5]]), t([[-1.1, -2.0, -0.2]])
    loss, grad, m = run("reinforce", logp, mb_of(logp, old, t([[1.0, -2.0, 0.5]])), alg())
    assert close(loss, [[1.0, -4.0, 0.25]]) and close(grad, [[-1.0, 2.0, -0.5]])
    assert m["actor/approx_kl_old"] == pytest.approx((-0.1 + 0.0 + 0.3) / 3)


def test_dro_by_hand():
    # beta .5: loss -(A logp - .25 (logp - old)^2), gradient -A + .5 (logp - old)
    # token 0: logp -1, old -1.2, A 1: -(-1 - .25 * .04) = 1.01; gradient -1 + .1 = -.9
    # token 1: logp -2, old -1.5, A -2: -(4 - .25 * .25) = -3.9375; gradient 2 - .25 = 1.75
    logp, old = t([[-1.0, -2.0]]), t([[-1.2, -1.5]])
    loss, grad, m = run(
        "dro", logp, mb_of(logp, old, t([[1.0, -2.0]])), cfg(policy_loss_options={"beta": 0.5})
    )
    assert close(loss, [[1.01, -3.9375]]) and close(grad, [[-0.9, 1.75]])
    assert m["actor/approx_kl_old"] == pytest.approx((-0.2 + 0.5) / 2)
    with pytest.raises(ValueError, match="beta is required"):
        run("dro", logp, mb_of(logp, old, t([[1.0, -2.0]])), cfg())
    with pytest.raises(ConfigError, match="policy_loss_options.: beta is required"):
        load_config(Config, None, ["algorithm.policy_loss=dro"])


def probs_case(p_old, p, adv):
    logp, old = t([p]).log(), t([p_old]).log()
    return logp, mb_of(logp, old, t([adv]))


def test_dppo_tv_by_hand():
    # eps .15 both sides, c = 3. (p_old -> p, A):
    # 0: .5 -> .6, A 1: +.1 inside; ratio 1.2: loss -1.2 ln .6 = .612990, gradient -1.2
    # 1: .5 -> .7, A 1: +.2 outside: 0
    # 2: .01 -> .05, A 1: +.04 inside (PPO would clip its ratio 5); truncated at 3: -3 ln .05
    # 3: .5 -> .3, A -1: -.2 outside: 0
    # 4: .5 -> .4, A -1: -.1 inside; ratio .8: loss .8 ln .4, gradient .8
    # 5: .5 -> .9, A -1: a rise is not limited for A <= 0; ratio 1.8: loss 1.8 ln .9, gradient 1.8
    logp, mb = probs_case(
        [0.5, 0.5, 0.01, 0.5, 0.5, 0.5],
        [0.6, 0.7, 0.05, 0.3, 0.4, 0.9],
        [1.0, 1.0, 1.0, -1.0, -1.0, -1.0],
    )
    c = cfg(clip_ratio_low=0.15, clip_ratio_high=0.15, clip_ratio_c=3.0)
    loss, grad, m = run("dppo_tv", logp, mb, c)
    ln = math.log
    assert close(loss, [[-1.2 * ln(0.6), 0.0, -3 * ln(0.05), 0.0, 0.8 * ln(0.4), 1.8 * ln(0.9)]])
    assert close(grad, [[-1.2, 0.0, -3.0, 0.0, 0.8, 1.8]])
    assert m["actor/clip_frac"] == pytest.approx(2 / 6)
    assert m["actor/clip_frac_high"] == pytest.approx(1 / 6)
    assert m["actor/clip_frac_low"] == pytest.approx(1 / 6)
    assert m["actor/ratio_truncated_frac"] == pytest.approx(1 / 6)
    # no bound on the ratio (clip_ratio_c null): token 2 keeps its weight 5
    _, grad, _ = run(
        "dppo_tv", logp, mb, cfg(clip_ratio_low=0.15, clip_ratio_high=0.15, clip_ratio_c=None)
    )
    assert grad[0, 2].item() == pytest.approx(-5.0)


def bkl(p_old, p):
    return p_old * math.log(p_old / p) + (1 - p_old) * math.log((1 - p_old) / (1 - p))


def test_dppo_kl_by_hand():
    # eps .05. binary KL(.5 || .6) = .5 ln(.5/.6) + .5 ln(.5/.4) = .020411 (inside);
    # KL(.5 || .7) = KL(.5 || .3) = .5 ln(.5/.7) + .5 ln(.5/.3) = .087177 (outside)
    assert bkl(0.5, 0.6) < 0.05 < bkl(0.5, 0.7) == pytest.approx(bkl(0.5, 0.3))
    # 0: .5 -> .6, A 1: inside; loss -1.2 ln .6
    # 1: .5 -> .7, A 1: outside and rising: 0
    # 2: .5 -> .3, A 1: outside but falling (the bound binds only in A's direction); loss -.6 ln .3
    # 3: .5 -> .3, A -1: outside and falling: 0
    logp, mb = probs_case([0.5] * 4, [0.6, 0.7, 0.3, 0.3], [1.0, 1.0, 1.0, -1.0])
    loss, grad, m = run("dppo_kl", logp, mb, cfg(clip_ratio_low=0.05, clip_ratio_high=0.05))
    assert close(loss, [[-1.2 * math.log(0.6), 0.0, -0.6 * math.log(0.3), 0.0]])
    assert close(grad, [[-1.2, 0.0, -0.6, 0.0]])
    assert m["actor/clip_frac"] == pytest.approx(2 / 4)


# --- seq-mean-token-sum-norm ----------------------------------------------------------------------
def test_seq_mean_token_sum_norm_divides_by_sequences_times_length():
    # veRL 0.9: sum over valid tokens / (non-empty sequences * L). Rows sum 3 and 4, one empty row,
    # L = 5: 7 / (2 * 5) = .7 (dividing by L alone would give 1.4)
    loss = t([[1.0, 2.0, 9.0], [4.0, 0.0, 0.0], [8.0, 8.0, 8.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    out = LOSS_AGG.get("seq-mean-token-sum-norm")(loss, mask, agg_totals(mask, 5))
    assert out.item() == pytest.approx(0.7)


# --- the old-log-prob pass feeds the optimal token baselines --------------------------------------
class FixedLogits(torch.nn.Module):
    """A model whose logits are given: (B, P + R, V)."""

    def __init__(self, logits):
        super().__init__()
        self.logits = logits
        self.anchor = torch.nn.Parameter(torch.zeros(()))

    def forward(self, input_ids, attention_mask, position_ids, use_cache):
        return SimpleNamespace(logits=self.logits)


def test_sum_pi_squared_of_the_old_policy_and_its_pass():
    from hybridrl.learner.logprob import response_sum_pi_squared
    from hybridrl.learner.passes import needs_sum_pi_squared, reuses_old_log_probs

    # one prompt token, two response tokens; the logits predicting them are log [.5, .25, .25]
    # (sum p^2 = .25 + .0625 + .0625 = .375) and log [.5, .5, 0] (.5); the second is padding
    half = [math.log(0.5), math.log(0.25), math.log(0.25)]
    logits = t([[half, [0.0, 0.0, -math.inf], [9.0, 9.0, 9.0]]], torch.float32)
    mb = Batch(
        {
            "input_ids": torch.tensor([[1, 0, 2]]),
            "attention_mask": torch.ones(1, 3, dtype=torch.long),
            "responses": torch.tensor([[0, 2]]),
            "response_mask": torch.tensor([[1, 0]]),
        }
    )
    out = response_sum_pi_squared(FixedLogits(logits), mb)
    assert close(out, [[0.375, 0.0]])
    mb = Batch({**mb.tensors, "response_mask": torch.tensor([[1, 1]])})
    assert close(response_sum_pi_squared(FixedLogits(logits), mb), [[0.375, 0.5]])
    # the estimator reads them before the update: the separate old-log-prob pass runs
    cfg_otb = load_config(Config, None, ["algorithm.advantage=optimal_token_baseline"])
    assert needs_sum_pi_squared(cfg_otb) and not reuses_old_log_probs(cfg_otb, 1)
    assert reuses_old_log_probs(load_config(Config, None, []), 1)
    with pytest.raises(ConfigError, match="rollout_bypass"):
        load_config(
            Config,
            None,
            ["algorithm.advantage=tir_optimal_token_baseline", "algorithm.rollout_bypass=true"],
        )
    with pytest.raises(ConfigError, match=r"actor.pp_size > 1 does not provide"):
        load_config(
            Config,
            "examples/arith_grpo.yaml",
            ["algorithm.advantage=optimal_token_baseline", "actor.pp_size=2"],
        )
