"""Rollout-to-training importance correction (``algorithms/rollout_correction.py``): hand-computed
weights for each level and mode, the gap metrics, the wiring in the learner's ``train_step`` and the
config checks."""

import math
from types import SimpleNamespace

import pytest
import torch

from hybridrl.algorithms.rollout_correction import (
    WEIGHT_KEY,
    importance_weights,
    mismatch_metrics,
    rollout_correction,
    weighted_policy_loss,
)
from hybridrl.config import Config
from hybridrl.config.loader import ConfigError, load_config
from hybridrl.learner.learner import Learner
from hybridrl.learner.shaping import RewardShaper
from hybridrl.protocol import Batch, Sample
from hybridrl.telemetry import PhaseTimer

LN2, LN3 = math.log(2.0), math.log(3.0)


def alg(**kw):
    base = dict(
        rollout_is="token",
        rollout_is_mode="truncate",
        rollout_is_threshold=2.0,
        rollout_is_threshold_lower=None,
        rollout_is_batch_normalize=False,
        rollout_bypass=False,
    )
    return SimpleNamespace(**{**base, **kw})


# one row of three valid tokens (old - rollout = 0, ln 3, -ln 2) and one padding column with junk
# values
OLD = torch.tensor([[0.0, LN3 - 1.0, -LN2 - 2.0, 7.0]])
ROLL = torch.tensor([[0.0, -1.0, -2.0, -9.0]])
MASK = torch.tensor([[1, 1, 1, 0]])


def test_token_truncate():
    w, m = importance_weights(OLD, ROLL, MASK, alg())
    assert torch.allclose(w, torch.tensor([[1.0, 2.0, 0.5, 0.0]]))  # min(rho, 2); padding 0
    assert m["rollout_corr/is_weight_mean"] == pytest.approx((1 + 3 + 0.5) / 3)
    assert m["rollout_corr/is_weight_max"] == pytest.approx(3.0)
    assert m["rollout_corr/is_weight_used_mean"] == pytest.approx((1 + 2 + 0.5) / 3)
    assert m["rollout_corr/truncated_frac"] == pytest.approx(1 / 3)
    assert m["rollout_corr/masked_frac"] == 0.0


def test_token_mask_default_and_explicit_lower():
    w, m = importance_weights(OLD, ROLL, MASK, alg(rollout_is_mode="mask"))  # [1/2, 2]
    assert torch.allclose(w, torch.tensor([[1.0, 0.0, 0.5, 0.0]]))
    assert m["rollout_corr/masked_frac"] == pytest.approx(1 / 3)
    w, m = importance_weights(
        OLD,
        ROLL,
        MASK,
        alg(rollout_is_mode="mask", rollout_is_threshold=4.0, rollout_is_threshold_lower=0.6),
    )
    assert torch.allclose(w, torch.tensor([[1.0, 3.0, 0.0, 0.0]]))
    assert m["rollout_corr/masked_frac"] == pytest.approx(1 / 3)


# row 0: log-ratios ln2, ln2 (rho = 4); row 1: -ln2, 0 (rho = 1/2); row 2: +60 over two tokens
# (clamped)
SEQ_OLD = torch.tensor([[LN2, LN2, 5.0], [-LN2, 0.0, 0.0], [30.0, 30.0, 0.0]])
SEQ_ROLL = torch.zeros(3, 3)
SEQ_MASK = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 0]])


def test_sequence_truncate():
    w, m = importance_weights(
        SEQ_OLD, SEQ_ROLL, SEQ_MASK, alg(rollout_is="sequence", rollout_is_threshold=3.0)
    )
    assert torch.allclose(w, torch.tensor([[3.0, 3.0, 0.0], [0.5, 0.5, 0.0], [3.0, 3.0, 0.0]]))
    assert m["rollout_corr/is_weight_max"] == pytest.approx(
        math.exp(20.0), rel=1e-5
    )  # clamped, finite
    assert m["rollout_corr/truncated_frac"] == pytest.approx(4 / 6)


def test_sequence_mask_drops_whole_sequences():
    w, m = importance_weights(
        SEQ_OLD,
        SEQ_ROLL,
        SEQ_MASK,
        alg(rollout_is="sequence", rollout_is_mode="mask", rollout_is_threshold=5.0),
    )  # [0.2, 5]
    assert torch.allclose(w, torch.tensor([[4.0, 4.0, 0.0], [0.5, 0.5, 0.0], [0.0, 0.0, 0.0]]))
    assert m["rollout_corr/masked_frac"] == pytest.approx(2 / 6)


def test_gap_metrics():
    m = mismatch_metrics(OLD, ROLL, MASK)
    assert m["rollout_corr/logp_gap_mean"] == pytest.approx((LN3 + LN2) / 3)
    assert m["rollout_corr/logp_gap_max"] == pytest.approx(LN3)
    assert m["rollout_corr/kl_k1"] == pytest.approx((-LN3 + LN2) / 3)
    assert m["rollout_corr/kl_k3"] == pytest.approx(((3 - 1 - LN3) + (0.5 - 1 + LN2)) / 3)


def test_gap_metrics_are_logged_with_the_correction_off_and_weights_only_with_it_on():
    batch = Batch({"old_log_probs": OLD, "rollout_log_probs": ROLL, "response_mask": MASK})
    out, m = rollout_correction(batch, alg(rollout_is=None))
    assert (
        WEIGHT_KEY not in out
        and "rollout_corr/kl_k3" in m
        and "rollout_corr/is_weight_mean" not in m
    )
    out, m = rollout_correction(batch, alg())
    assert (
        torch.allclose(out[WEIGHT_KEY], torch.tensor([[1.0, 2.0, 0.5, 0.0]]))
        and "rollout_corr/is_weight_mean" in m
    )


def test_weighted_policy_loss():
    pg = torch.tensor([[1.0, -2.0, 3.0, 0.0]])
    assert torch.equal(weighted_policy_loss(pg, Batch({"x": pg})), pg)
    mb = Batch({WEIGHT_KEY: torch.tensor([[1.0, 2.0, 0.0, 0.0]])})
    assert torch.equal(weighted_policy_loss(pg, mb), torch.tensor([[1.0, -4.0, 0.0, 0.0]]))


# --- wiring in the learner's train_step -----------------------------------------------------------
class StubLearner:
    """What ``Learner.train_step`` reads of its learner, without a model: the old log-probs are
    ``OLD``, the update records the batch it is given."""

    def __init__(self, cfg: Config):
        self.cfg, self.calls, self.updated = cfg, [], None
        self.timer, self.reference, self.critic = PhaseTimer(), None, None
        self.shape = RewardShaper(cfg.algorithm, cfg.rollout.max_new_tokens)
        self.tokenizer = SimpleNamespace(pad_token_id=0)
        self.moe, self.rank = None, 0
        # one process: the policy's rows are the whole batch
        self.actor = SimpleNamespace(shuffle=torch.Generator(), replicas=1, rows=lambda f, b: f(b))

    take_samples = Learner.take_samples

    def compute_log_prob(self, batch):
        self.calls.append("old")
        return Batch({"old_log_probs": OLD})

    def policy_loss(self, mb, totals):  # never called: the stub's update does not run micro-batches
        raise AssertionError("policy_loss called")

    def update_actor(self, batch):
        self.updated = batch
        return {"actor/pg_loss": 0.0}

    def old_log_probs_of_last_update(self, batch):
        # an on-policy step takes them from the update's forward
        self.calls.append("taken")
        return Batch({"old_log_probs": OLD})


def run_step(**alg_kw):
    cfg = Config()
    for k, v in alg_kw.items():
        setattr(cfg.algorithm, k, v)
    sample = Sample(
        prompt_ids=[1, 2],
        response_ids=[4, 5, 6, 7],
        log_probs=ROLL[0].tolist(),
        loss_mask=MASK[0].tolist(),
        status="finished",
        uid="a",
        reward=0.0,
        reward_extras={"reward_errors": 0.0},
    )
    learner = StubLearner(cfg)
    out = Learner.train_step(learner, 0, [sample])
    return learner, out["metrics"]


def test_train_step_applies_the_weights_and_logs_the_gap():
    learner, metrics = run_step(rollout_is="token", rollout_is_threshold=2.0)
    assert learner.calls == ["old"]
    assert torch.allclose(learner.updated[WEIGHT_KEY], torch.tensor([[1.0, 2.0, 0.5, 0.0]]))
    assert metrics["rollout_corr/logp_gap_max"] == pytest.approx(LN3)
    learner, metrics = run_step()
    # off: no weights, the gap still measured
    assert WEIGHT_KEY not in learner.updated and "rollout_corr/kl_k3" in metrics


def test_bypass_skips_the_old_log_prob_forward():
    learner, metrics = run_step(rollout_bypass=True)
    assert learner.calls == []
    assert torch.equal(learner.updated["old_log_probs"], ROLL)


# --- config checks --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides,words",
    [
        (["algorithm.rollout_is=token", "algorithm.policy_loss=decoupled_ppo"], "already weights"),
        (["algorithm.rollout_is=token", "algorithm.rollout_bypass=true"], "count it twice"),
        (
            ["algorithm.rollout_bypass=true", "trainer.mode=async"],
            "proximal policy would be the behaviour",
        ),
        (["algorithm.rollout_is=token", "algorithm.rollout_is_threshold_lower=0.5"], "mask only"),
        (
            [
                "algorithm.rollout_is=token",
                "algorithm.rollout_is_mode=mask",
                "algorithm.rollout_is_threshold=0.8",
            ],
            "below",
        ),
        (["algorithm.rollout_is=tokens"], "token"),
    ],
)
def test_config_rejects_combinations_that_cannot_work(overrides, words):
    with pytest.raises(ConfigError, match=words) as err:
        load_config(Config, None, overrides)
    assert "\n" not in str(err.value)


def test_config_accepts_each_mode():
    for level in ("token", "sequence"):
        for mode in ("truncate", "mask"):
            cfg = load_config(
                Config, None, [f"algorithm.rollout_is={level}", f"algorithm.rollout_is_mode={mode}"]
            )
            assert (cfg.algorithm.rollout_is, cfg.algorithm.rollout_is_mode) == (level, mode)
    assert load_config(Config, None, ["algorithm.rollout_bypass=true"]).algorithm.rollout_bypass
