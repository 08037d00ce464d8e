"""The losses of hybridrl/algorithms/losses_more.py (cispo, gmpo, clip_cov, kl_cov, sapo), the
token-sum aggregation, the abs / straight-through KL estimators and gspo_token's clamp at e^10, each
against values worked out by hand (arithmetic in comments, checked in float64 with plain math, not
with the code under test), plus the contract every policy loss keeps (zero on padding and blind to
it, finite for extreme log-ratios)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_algorithms import cfg, close
from test_algorithms_props import SETTINGS, loss_inputs, with_garbage

from hybridrl.algorithms import LOSS_AGG, POLICY_LOSSES, agg_totals, kl_penalty
from hybridrl.config import AlgorithmConfig
from hybridrl.protocol import Batch

# the losses added beside the PPO family (the veRL-parity ones too: test_verl_parity.py)
NEW_LOSSES = [
    "cispo",
    "gmpo",
    "clip_cov",
    "kl_cov",
    "sapo",
    "reinforce",
    "dro",
    "dppo_tv",
    "dppo_kl",
]
D = torch.float64


def mb_of(logp, old, adv, mask=None):
    mask = torch.ones_like(logp) if mask is None else mask
    return Batch(
        {"old_log_probs": old, "rollout_log_probs": old, "advantages": adv, "response_mask": mask}
    )


def t(x):
    return torch.tensor(x, dtype=D)


def run(name, logp, mb, c, **kw):
    lp = logp.detach().clone().requires_grad_(True)
    loss, metrics = POLICY_LOSSES.get(name)(lp, mb, c, **kw)
    loss.sum().backward()
    return loss.detach(), lp.grad, metrics


# --- CISPO ----------------------------------------------------------------------------------------
def cispo_case():
    # ratios [1.5, .5, 1.1, 2], A [1, 1, -2, -1]; logp = old + ln r = [-.594535, -2.693147,
    # -.404690, -.806853]
    old = t([[-1.0, -2.0, -0.5, -1.5]])
    logp = old + t([[1.5, 0.5, 1.1, 2.0]]).log()
    return logp, mb_of(logp, old, t([[1.0, 1.0, -2.0, -1.0]]))


def test_cispo_by_hand():
    # default: no lower bound, upper 1 + .28 -> weights [1.28, .5, 1.1, 1.28]; loss = -w A logp
    # [-1.28 * -.594535, -.5 * -2.693147, 2.2 * -.404690, -1.28 * -.806853 (A = -1: +1.28 * logp)]
    logp, mb = cispo_case()
    loss, grad, m = run(
        "cispo", logp, mb, cfg(policy_loss_options={"clip_low": None, "clip_high": 0.28})
    )
    assert close(loss, [[0.7610047, 1.3465736, -0.8903176, -1.0327716]])
    # gradient -w A: every token keeps one, even the clipped ones (ppo_clip gives token 0 none)
    assert close(grad, [[-1.28, -0.5, 2.2, 1.28]])
    assert m["actor/clip_frac_high"] == pytest.approx(2 / 4) and m["actor/clip_frac_low"] == 0.0
    assert m["actor/clip_frac"] == pytest.approx(2 / 4)
    assert m["actor/is_weight_mean"] == pytest.approx((1.28 + 0.5 + 1.1 + 1.28) / 4)
    # lower bound .8: token 1's weight .5 -> .8: loss .8 * 2.693147 = 2.154518, gradient -.8
    loss, grad, m = run(
        "cispo", logp, mb, cfg(policy_loss_options={"clip_low": 0.2, "clip_high": 0.28})
    )
    assert close(loss, [[0.7610047, 2.1545177, -0.8903176, -1.0327716]])
    assert close(grad, [[-1.28, -0.8, 2.2, 1.28]])
    assert m["actor/clip_frac_low"] == pytest.approx(1 / 4) and m[
        "actor/clip_frac"
    ] == pytest.approx(3 / 4)
    with pytest.raises(ValueError, match="policy_loss_options.clip_low"):
        run("cispo", logp, mb, cfg(policy_loss_options={"clip_low": 1.5}))


# --- GMPO -----------------------------------------------------------------------------------------
def test_gmpo_by_hand():
    # eps .4 / .4 in log space
    # row 0: l = [.1, .6], A = 1 -> min(l, clip(l)) = [.1, .4] (token 1 clipped high) -> mean .25 ->
    #   s = e^.25 = 1.284025
    #        loss -1.284025 on both tokens
    # row 1: l = [-.6, .2, .5], A = -2 -> max(l, clip(l)) = [-.4 (clipped low), .2, .5 (kept:
    #   pessimistic)] -> mean .1
    #        s = e^.1 = 1.105171, loss 2 * 1.105171 = 2.210342
    # row 2: l = [.3, (pad) 7], A = [.5, (pad) 9] -> s = e^.3 -> loss -.5 * 1.349859 = -.674929
    lr = t([[0.1, 0.6, 0.0], [-0.6, 0.2, 0.5], [0.3, 7.0, 0.0]])
    mask = t([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    adv = t([[1.0, 1.0, 0.0], [-2.0, -2.0, -2.0], [0.5, 9.0, 0.0]])
    old = torch.full((3, 3), -1.0, dtype=D)
    loss, grad, m = run(
        "gmpo",
        old + lr,
        mb_of(old + lr, old, adv, mask),
        cfg(policy_loss_options={"log_clip_low": 0.4, "log_clip_high": 0.4}),
    )
    assert close(
        loss, [[-1.284025, -1.284025, 0], [2.210342, 2.210342, 2.210342], [-0.674929, 0, 0]]
    )
    # d(-A s)/dlogp_t = -A s / |y| on unclipped tokens; loss.sum() holds each row's loss |y| times
    # -> -A s
    assert close(grad, [[-1.284025, 0, 0], [0, 2.210342, 2.210342], [-0.674929, 0, 0]])
    assert m["actor/clip_frac_high"] == pytest.approx(1 / 6) and m[
        "actor/clip_frac_low"
    ] == pytest.approx(1 / 6)
    assert m["actor/seq_ratio_max"] == pytest.approx(math.exp(0.3))
    # the arithmetic mean (GRPO-like) would differ: e^.1 and e^.4 do not average to e^.25
    assert loss[0, 0].item() != pytest.approx(-(math.exp(0.1) + math.exp(0.4)) / 2)


# --- Clip-Cov -------------------------------------------------------------------------------------
def cov_case(log_ratios, adv):
    # logp = [-.5, -1, -2, -2.5]: mean -1.5, centred [1, .5, -.5, -1]
    logp = t([[-0.5, -1.0, -2.0, -2.5]])
    return logp, mb_of(logp, logp - t([log_ratios]), t([adv]))


def test_clip_cov_by_hand():
    # A = [3, 1, -1, -3] (mean 0) -> cov = A * centred logp = [3, .5, .5, 3]; candidates in (1, 5):
    #   tokens 0 and 3
    # all ratios 1: PPO loss -A = [-3, -1, 1, 3]; ratio .5 -> n = int(.5 * 4) = 2: both candidates
    #   cut (loss 0, no grad)
    logp, mb = cov_case([0.0] * 4, [3.0, 1.0, -1.0, -3.0])
    c = cfg(policy_loss_options={"ratio": 0.5, "lb": 1.0, "ub": 5.0})
    loss, grad, m = run("clip_cov", logp, mb, c)
    assert close(loss, [[0, -1, 1, 0]]) and close(grad, [[0, -1, 1, 0]])
    assert m["actor/cov_clip_frac"] == pytest.approx(2 / 4)
    assert m["actor/cov_mean"] == pytest.approx((3 + 0.5 + 0.5 + 3) / 4)
    # lb 3.5: no candidate -> plain PPO
    loss, _, m = run(
        "clip_cov", logp, mb, cfg(policy_loss_options={"ratio": 0.5, "lb": 3.5, "ub": 5.0})
    )
    assert close(loss, [[-3, -1, 1, 3]]) and m["actor/cov_clip_frac"] == 0.0
    # token 0 at ratio 1.5 (A = 3 > 0) is already cut by the PPO clip (1 + .28): loss -3 * 1.28 =
    # -3.84, it is no candidate, so only token 3 is cut even though n = 2
    logp, mb = cov_case([math.log(1.5), 0.0, 0.0, 0.0], [3.0, 1.0, -1.0, -3.0])
    loss, grad, m = run("clip_cov", logp, mb, c)
    assert close(loss, [[-3.84, -1, 1, 0]]) and close(grad, [[0, -1, 1, 0]])
    assert m["actor/clip_frac_high"] == pytest.approx(1 / 4) and m[
        "actor/cov_clip_frac"
    ] == pytest.approx(1 / 4)
    with pytest.raises(ValueError, match="lb .5.0. must be below ub .1.0."):
        run("clip_cov", logp, mb, cfg(policy_loss_options={"lb": 5.0, "ub": 1.0}))


def test_clip_cov_random_draw_is_seeded():
    # n = int(.25 * 4) = 1 of the two candidates (tokens 0 and 3)
    logp, mb = cov_case([0.0] * 4, [3.0, 1.0, -1.0, -3.0])
    c = cfg(policy_loss_options={"ratio": 0.25, "lb": 1.0, "ub": 5.0, "seed": 0})
    picks = set()
    for seed in range(16):
        loss, _, m = run("clip_cov", logp, mb, c, generator=torch.Generator().manual_seed(seed))
        cut = (loss[0] == 0).nonzero().flatten().tolist()
        assert (
            len(cut) == 1 and cut[0] in (0, 3) and m["actor/cov_clip_frac"] == pytest.approx(1 / 4)
        )
        again, _, _ = run("clip_cov", logp, mb, c, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(loss, again)
        picks.add(cut[0])
    assert picks == {0, 3}  # the draw is random, not always the first candidate
    # without a generator: derived from the seed option and the data; the global RNG is neither used
    # nor moved
    state = torch.get_rng_state()
    first, _, _ = run("clip_cov", logp, mb, c)
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(123)
    assert torch.equal(run("clip_cov", logp, mb, c)[0], first)
    by_seed = {
        tuple(
            run("clip_cov", logp, mb, cfg(policy_loss_options={"ratio": 0.25, "seed": s}))[0][
                0
            ].tolist()
        )
        for s in range(16)
    }
    assert len(by_seed) == 2  # the seed option changes the draw


# --- KL-Cov ---------------------------------------------------------------------------------------
def test_kl_cov_by_hand():
    # A = [3, 1, -1, -2]: mean .25, centred [2.75, .75, -1.25, -2.25]; logp centred [1, .5, -.5, -1]
    # cov = [2.75, .375, .625, 2.25]; log-ratios l = [.2, -.1, .3, .1]
    # loss -A e^l = [-3.664208, -.904837, 1.349859, 2.210342], + |l| on the top-k tokens (coef 1)
    logp, mb = cov_case([0.2, -0.1, 0.3, 0.1], [3.0, 1.0, -1.0, -2.0])
    # k = int(.25 * 4) = 1: token 0 (cov 2.75): -3.664208 + .2; gradient -3 e^.2 + sign(.2) =
    # -2.664208
    loss, grad, m = run("kl_cov", logp, mb, cfg(policy_loss_options={"ratio": 0.25, "coef": 1.0}))
    assert close(loss, [[-3.464208, -0.904837, 1.349859, 2.210342]])
    assert close(grad, [[-2.664208, -0.904837, 1.349859, 2.210342]])
    assert m["actor/kl_cov_frac"] == pytest.approx(1 / 4) and m[
        "actor/kl_cov_abs"
    ] == pytest.approx(0.2)
    # k = 2: tokens 0 and 3 (cov 2.25): token 3 2.210342 + .1, gradient 2 e^.1 + 1 = 3.210342
    loss, grad, _ = run("kl_cov", logp, mb, cfg(policy_loss_options={"ratio": 0.5, "coef": 1.0}))
    assert close(loss, [[-3.464208, -0.904837, 1.349859, 2.310342]])
    assert close(grad, [[-2.664208, -0.904837, 1.349859, 3.210342]])
    # the default ratio (2e-3) still penalises one token (at least one)
    assert run("kl_cov", logp, mb, AlgorithmConfig())[2]["actor/kl_cov_frac"] == pytest.approx(
        1 / 4
    )


# --- SAPO -----------------------------------------------------------------------------------------
def test_sapo_by_hand():
    # f(r) = sigmoid(tau (r - 1)) 4 / tau; tau 1 for A > 0, 1.05 otherwise; loss -f A; grad -A w r,
    #   w = 4 s (1 - s)
    # r = 1,   A = 1:  s = .5 -> f = 2 -> loss -2; w = 1 -> grad -1 (the plain policy gradient)
    # r = 1.5, A = 1:  s = sigmoid(.5) = .622459 -> f = 2.489837; w = .940015 -> grad -1.410022
    # r = .5,  A = -1: s = sigmoid(-.525) = .371685 -> f = 1.415938 -> loss +1.415938; w = .934140
    #   -> grad .467070
    # r = 2,   A = -1: s = sigmoid(1.05) = .740774 -> f = 2.822000; w = .768110 -> grad 1.536220
    old = torch.zeros(1, 4, dtype=D)
    logp = t([[1.0, 1.5, 0.5, 2.0]]).log()
    loss, grad, m = run(
        "sapo",
        logp,
        mb_of(logp, old, t([[1.0, 1.0, -1.0, -1.0]])),
        cfg(policy_loss_options={"tau_pos": 1.0, "tau_neg": 1.05}),
    )
    assert close(loss, [[-2.0, -2.489837, 1.415938, 2.822000]])
    assert close(grad, [[-1.0, -1.410022, 0.467070, 1.536220]])
    assert m["actor/gate_weight_mean"] == pytest.approx(
        (1 + 0.940015 + 0.934140 + 0.768110) / 4, abs=1e-6
    )
    assert m["actor/gate_weight_min"] == pytest.approx(0.768110, abs=1e-6)
    with pytest.raises(ValueError, match="policy_loss_options.tau_neg"):
        run("sapo", logp, mb_of(logp, old, t([[1.0] * 4])), cfg(policy_loss_options={"tau_neg": 0}))


# --- gspo_token: the e^10 bound, as veRL ----------------------------------------------------------
def test_gspo_token_clamps_combined_log_ratio_at_10():
    # A = -1 (the unclipped branch -A s is the larger): row 0 log-ratios [12, 12] -> s_i = e^12,
    # capped at e^10 = 22026.466 with no gradient; row 1 [8, 9.5] -> mean 8.75 < 10: value e^8.75 =
    # 6310.688, gradient -A s = 6310.688 per token
    old = torch.zeros(2, 2, dtype=D)
    logp = t([[12.0, 12.0], [8.0, 9.5]])
    loss, grad, _ = run("gspo_token", logp, mb_of(logp, old, -torch.ones(2, 2, dtype=D)), cfg())
    assert close(loss, [[22026.465795, 22026.465795], [6310.688108, 6310.688108]], atol=1e-5)
    assert close(grad, [[0.0, 0.0], [6310.688108, 6310.688108]], atol=1e-5)


# --- token-sum ------------------------------------------------------------------------------------
def test_token_sum_micro_batches_and_ranks_add_up():
    # valid losses 1 + 2 + 3 + 4 + 5 = 15; no division, whatever the totals say
    loss = t([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [7.0, 5.0, 7.0]]).requires_grad_(True)
    mask = t([[1, 1, 1], [1, 0, 0], [0, 1, 0]])
    f = LOSS_AGG.get("token-sum")
    whole = f(loss, mask, agg_totals(mask, 5))
    assert whole.item() == 15.0
    # two micro-batches, or two data-parallel ranks each holding some rows and its own totals: the
    # sum is the whole (ranks' gradients are summed, not averaged)
    assert (
        f(loss[:1], mask[:1], agg_totals(mask[:1], 5)).item()
        + f(loss[1:], mask[1:], agg_totals(mask[1:])).item()
        == 15.0
    )
    whole.backward()
    assert loss.grad.tolist() == mask.tolist()  # d/dloss_t = 1 on valid tokens, 0 on padding


# --- KL estimators --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name,value,grad",
    [
        # delta = logp - ref = [.5, -1, 0, -2]
        ("abs", [0.5, 1.0, 0.0, 2.0], [1.0, -1.0, 0.0, -1.0]),
        ("k1+", [0.5, -1.0, 0.0, -2.0], [0.5, -1.0, 0.0, -2.0]),  # value k1, gradient of k2 = delta
        ("k2+", [0.125, 0.5, 0.0, 2.0], [0.5, -1.0, 0.0, -2.0]),  # k2 itself
        # value k3 = e^-delta - 1 + delta: e^-.5 - .5 = .106531, e - 2 = .718282, 0, e^2 - 3 =
        # 4.389056; gradient delta (k3's own gradient would be 1 - e^-delta = [.393469, -1.718282,
        # 0, -6.389056])
        ("k3+", [0.1065307, 0.7182818, 0.0, 4.3890561], [0.5, -1.0, 0.0, -2.0]),
    ],
)
def test_kl_estimators_abs_and_straight_through(name, value, grad):
    logp = t([-1.0, -2.0, -0.5, -3.0]).requires_grad_(True)
    ref = t([-1.5, -1.0, -0.5, -1.0])
    out = kl_penalty(name, logp, ref)
    out.sum().backward()
    assert close(out, value) and close(logp.grad, grad)


# --- config ---------------------------------------------------------------------------------------
def test_algorithm_config_rejects_bad_values():
    from hybridrl.config import Config
    from hybridrl.config.loader import ConfigError, load_config

    for loss, bad in (
        ("sapo", "tau_pos=0"),
        ("clip_cov", "ratio=0"),
        ("kl_cov", "ratio=1.5"),
        ("gmpo", "log_clip_low=0"),
        ("cispo", "clip_low=2"),
        ("cispo", "ratio=0.1"),  # clip_cov's option, not cispo's
    ):
        key = bad.partition("=")[0]
        with pytest.raises(ConfigError, match=f"'algorithm.policy_loss_options.{key}'"):
            load_config(
                Config,
                None,
                [f"algorithm.policy_loss={loss}", f"algorithm.policy_loss_options.{bad}"],
            )
    with pytest.raises(ConfigError):
        load_config(Config, None, ["algorithm.loss_agg=token_sum"])
    with pytest.raises(ConfigError, match="lb .6.0. must be below ub .5.0."):
        load_config(
            Config, None, ["algorithm.policy_loss=clip_cov", "algorithm.policy_loss_options.lb=6"]
        )
    # a loss that declares no options takes none
    with pytest.raises(ConfigError, match="'ppo_clip' declares no options, got ratio"):
        load_config(Config, None, ["algorithm.policy_loss_options.ratio=0.1"])
    # a key that moved under a plug-in's options is refused in one line naming the new key
    with pytest.raises(ConfigError, match="use 'algorithm.policy_loss_options.lb'"):
        load_config(Config, None, ["algorithm.clip_cov_lb=1"])
    assert (
        load_config(Config, None, ["algorithm.loss_agg=token-sum"]).algorithm.loss_agg
        == "token-sum"
    )


# --- the contract every policy loss keeps ---------------------------------------------------------
@SETTINGS
@given(loss_inputs(scale=3.0), st.integers(0, 1000))
def test_new_losses_zero_on_padding_and_blind_to_it(inputs, seed):
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
    options = {
        "clip_cov": {"ratio": 0.3, "lb": 0.0},
        "kl_cov": {"ratio": 0.3},
        "dro": {"beta": 0.5},
    }
    for name in NEW_LOSSES:
        c = cfg(policy_loss_options=options.get(name, {}))
        loss, grad, metrics = run(name, logp, mb, c)
        loss2, grad2, metrics2 = run(name, dirty_logp, dirty, c)
        assert torch.isfinite(loss).all() and torch.isfinite(grad).all(), name
        assert (loss[~mask.bool()] == 0).all() and (grad[~mask.bool()] == 0).all(), name
        assert torch.equal(loss, loss2) and torch.equal(grad, grad2), name
        assert metrics == metrics2 and all(math.isfinite(v) for v in metrics.values()), name
        if "actor/clip_frac" in metrics:
            assert metrics["actor/clip_frac"] == pytest.approx(
                metrics["actor/clip_frac_low"] + metrics["actor/clip_frac_high"]
            )


LOOSE = {"clip_cov": {"ratio": 0.3}, "kl_cov": {"ratio": 0.3}, "dro": {"beta": 0.5}}


@SETTINGS
@given(loss_inputs(), st.lists(st.floats(20.5, 1e4), min_size=1, max_size=4))
def test_new_losses_finite_for_extreme_log_ratios(inputs, deltas):
    logp, mb = inputs
    g = torch.Generator().manual_seed(0)
    pick = torch.tensor(deltas, dtype=D)[torch.randint(len(deltas), logp.shape, generator=g)]
    sign = torch.where(torch.rand(logp.shape, generator=g) < 0.5, -1.0, 1.0).double()
    far = mb["old_log_probs"] + sign * pick
    for name in NEW_LOSSES:
        c = cfg(policy_loss_options=LOOSE.get(name, {}))
        loss, grad, metrics = run(name, far, mb, c)
        assert torch.isfinite(loss).all() and torch.isfinite(grad).all(), name
        assert all(math.isfinite(v) for v in metrics.values()), name


PLUGIN = """
from dataclasses import dataclass

from hybridrl.algorithms.losses import POLICY_LOSSES
from hybridrl.registry import option


@dataclass
class ScaledOptions:
    scale: float = option(1.0, "multiplies ppo_clip's loss", gt=0)


def scaled_ppo(logp, mb, cfg):
    loss, metrics = POLICY_LOSSES.get("ppo_clip")(logp, mb, cfg)
    return loss * cfg.options(ScaledOptions, "policy_loss").scale, metrics


scaled_ppo.options = ScaledOptions
"""


def test_a_plugin_by_dotted_path_declares_its_own_options(tmp_path):
    """A loss loaded from a file declares an options dataclass: the config checks its keys and
    bounds when it loads, and the loss reads the values."""
    from hybridrl.config import Config
    from hybridrl.config.loader import ConfigError, load_config

    path = tmp_path / "my_loss.py"
    path.write_text(PLUGIN)
    loss = f"algorithm.policy_loss={path}:scaled_ppo"
    cfg = load_config(Config, None, [loss, "algorithm.policy_loss_options.scale=3"])
    logp = t([[-1.0, -2.0]])
    mb = mb_of(logp, t([[-1.1, -2.2]]), t([[1.0, -1.0]]))
    scaled, _, _ = run(f"{path}:scaled_ppo", logp, mb, cfg.algorithm)
    plain, _, _ = run("ppo_clip", logp, mb, cfg.algorithm)
    assert close(scaled, (3 * plain).tolist())
    with pytest.raises(ConfigError, match="policy_loss_options.scal'.*did you mean"):
        load_config(Config, None, [loss, "algorithm.policy_loss_options.scal=3"])
    with pytest.raises(ConfigError, match="policy_loss_options.scale' must be > 0"):
        load_config(Config, None, [loss, "algorithm.policy_loss_options.scale=0"])


def test_hybridrl_config_lists_each_plugins_options():
    from hybridrl.config_reference import describe

    text = describe("algorithm.policy_loss_options")
    assert "with policy_loss cispo: clip_low (float | null, default `null`)" in text
    assert "with policy_loss ppo_clip" not in text  # declares none
    assert "with advantage rloo: group_of_one ('score' | 'zero', default `score`)" in describe(
        "algorithm.advantage_options"
    )
