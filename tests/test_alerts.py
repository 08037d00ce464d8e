"""Non-finite updates (skipped, counted, N in a row stop the run) and the training-health alerts
(telemetry/alerts.py) through the MetricsLogger: each rule fires on a constructed series and stays
quiet on a realistic one, the alerts.jsonl rows, once-per-streak logging, resume.

The 2-rank test runs this file as its ranks (`python tests/test_alerts.py rank ...`, gloo, CPU)."""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch
from rank_processes import launch_ranks, wait_ranks

from hybridrl.config import Config
from hybridrl.config.schema import AlertsConfig
from hybridrl.learner.update import MicroBatches, NonFiniteUpdateError, SkipCounter, run_updates
from hybridrl.protocol import Batch
from hybridrl.telemetry import Alerts, MetricsLogger, read_alerts, read_metrics

# --- non-finite updates ---------------------------------------------------------------------------
SECTION = SimpleNamespace(
    ppo_minibatch_size=2, ppo_epochs=1, micro_batch_tokens=10_000, grad_clip=1.0
)


def toy_batch(n: int = 4, d: int = 3) -> Batch:
    """``n`` rows of a 2-token prompt and a 2-token response (all real), and a feature ``x``."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 10, (n, 4), generator=g)
    return Batch(
        {
            "prompts": ids[:, :2],
            "responses": ids[:, 2:],
            "input_ids": ids,
            "attention_mask": torch.ones(n, 4, dtype=torch.long),
            "response_mask": torch.ones(n, 2, dtype=torch.long),
            "x": torch.randn(n, d, generator=g),
        }
    )


class ToyLoss:
    """A linear model's loss; the calls listed in ``nan_calls`` return NaN (one call per mini-batch
    here: the micro-batch budget holds a whole mini-batch)."""

    def __init__(self, model, nan_calls=()):
        self.model, self.nan_calls, self.calls = model, set(nan_calls), 0

    def __call__(self, mb, totals):
        loss = self.model(mb["x"]).pow(2).sum() / totals.n_seqs
        if self.calls in self.nan_calls:
            loss = loss * float("nan")
        self.calls += 1
        return loss, {"actor/pg_loss": loss.item(), "actor/entropy": 1.0}


def toy(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 1)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def update(model, opt, loss_fn, *, prefix="actor", skips=None, batch=None):
    return run_updates(
        MicroBatches(model, loss_fn, SECTION),
        opt,
        toy_batch() if batch is None else batch,
        SECTION,
        generator=torch.Generator().manual_seed(1),
        norm_len=2,
        prefix=prefix,
        skips=skips,
    )


def weights(model):
    return [p.detach().clone() for p in model.parameters()]


def test_nonfinite_loss_skips_the_step_and_is_counted():
    model, opt = toy()
    before = weights(model)
    # one mini-batch of 4 rows, its loss NaN: no optimizer step at all
    one = SimpleNamespace(**{**vars(SECTION), "ppo_minibatch_size": 4})
    m = run_updates(
        MicroBatches(model, ToyLoss(model, nan_calls={0}), one),
        opt,
        toy_batch(),
        one,
        generator=torch.Generator().manual_seed(1),
        norm_len=2,
        prefix="actor",
    )
    assert m["actor/skipped_updates"] == 1 and m["actor/updates"] == 0
    assert all(torch.equal(a, b) for a, b in zip(before, weights(model)))
    assert all(p.grad is None for p in model.parameters())
    assert not opt.state  # AdamW never stepped: no moments either
    # no step taken: the averaged metrics have no value (logged as null), the counters do
    assert math.isnan(m["actor/entropy"]) and math.isnan(m["actor/grad_norm"]), m


def test_skipped_step_leaves_the_other_metrics_finite_and_steps_the_rest():
    model, opt = toy()
    before = weights(model)
    m = update(model, opt, ToyLoss(model, nan_calls={1}))  # 2 mini-batches, the 2nd NaN
    assert m["actor/skipped_updates"] == 1 and m["actor/updates"] == 1
    assert all(math.isfinite(v) for v in m.values()), m
    assert m["actor/entropy"] == pytest.approx(1.0)  # averaged over the step taken only
    assert m["actor/grad_norm"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, weights(model)))
    # the same as training on the first mini-batch alone (the rows the shuffle puts first)
    ref_model, ref_opt = toy()
    rows = torch.randperm(4, generator=torch.Generator().manual_seed(1))[:2]
    r = update(ref_model, ref_opt, ToyLoss(ref_model), batch=toy_batch().index(rows))
    assert r["actor/updates"] == 1 and r["actor/skipped_updates"] == 0
    assert all(torch.allclose(a, b) for a, b in zip(weights(ref_model), weights(model)))


def test_nonfinite_gradient_from_a_parameter_hook_is_skipped():
    model, opt = toy()
    before = weights(model)
    handle = model.weight.register_hook(lambda g: torch.full_like(g, float("inf")))
    # the loss is finite, the gradient is not; a limit of 0 never stops
    m = update(model, opt, ToyLoss(model), skips=SkipCounter(0, "actor"))
    handle.remove()
    assert m["actor/skipped_updates"] == 2 and m["actor/updates"] == 0
    assert all(torch.equal(a, b) for a, b in zip(before, weights(model)))
    assert math.isnan(m["actor/pg_loss"]), m  # no step taken: no value


def test_nonfinite_in_a_row_raises_naming_the_role_across_calls():
    model, opt = toy()
    skips = SkipCounter(3, "critic")  # the owner's counter, kept across updates
    # 2 mini-batches (optimizer steps) per call
    update(model, opt, ToyLoss(model, nan_calls={1}), prefix="critic", skips=skips)  # 1 in a row
    update(model, opt, ToyLoss(model, nan_calls={0}), prefix="critic", skips=skips)  # 2, then good
    m = update(model, opt, ToyLoss(model, nan_calls={1}), prefix="critic", skips=skips)  # 1 again
    assert m["critic/skipped_updates"] == 1 and m["critic/updates"] == 1
    with pytest.raises(NonFiniteUpdateError) as err:  # 2, 3 in a row
        update(model, opt, ToyLoss(model, nan_calls={0, 1}), prefix="critic", skips=skips)
    msg = str(err.value)
    assert msg.startswith("critic: 3 optimizer steps in a row") and "\n" not in msg


def test_nonfinite_in_a_row_within_one_call_and_the_config_default():
    model, opt = toy()
    with pytest.raises(NonFiniteUpdateError, match=r"^actor: 3 optimizer steps in a row"):
        run_updates(
            # no counter given: 3 in a row, the config default
            MicroBatches(model, ToyLoss(model, nan_calls={0, 1, 2}), SECTION),
            opt,
            toy_batch(6),
            SECTION,
            generator=torch.Generator().manual_seed(1),
            norm_len=2,
            prefix="actor",
        )
    assert AlertsConfig().max_nonfinite_in_a_row == 3


def test_the_learner_and_its_critic_count_with_the_configured_limit():
    """The policy's and the critic's counters take ``alerts.max_nonfinite_in_a_row``."""
    from hybridrl.controller import WorkerContext
    from hybridrl.learner import Learner

    cfg = Config()
    cfg.alerts.max_nonfinite_in_a_row = 1
    cfg.algorithm.advantage = "gae"  # the learner builds a critic
    ctx = WorkerContext(rank=0, world_size=1, role="learner", pool="p", num_threads=1)
    learner = Learner(ctx, cfg, None)
    assert (learner.actor.skips.limit, learner.actor.skips.role) == (1, "actor")
    assert (learner.critic.skips.limit, learner.critic.skips.role) == (1, "critic")
    model, opt = toy()
    with pytest.raises(NonFiniteUpdateError, match="max_nonfinite_in_a_row=1"):
        update(model, opt, ToyLoss(model, nan_calls={0}), skips=learner.actor.skips)


WORLD = 2


def rank_main(rank: int, port: int, workdir: str) -> None:
    """A real FSDP2 learner on 2 ranks: the loss is NaN on rank 1 only (its first micro-batch):
    both ranks skip that step; then NaN on rank 0 only, every step: both ranks stop alike."""
    from hybridrl.controller import WorkerContext
    from hybridrl.learner import Learner
    from hybridrl.parallel.distributed import teardown_distributed

    torch.set_num_threads(1)
    cfg = Config()
    cfg.actor.ppo_minibatch_size = 4
    cfg.actor.micro_batch_tokens = 1  # one row per micro-batch: unequal counts, dummy micro-batches
    cfg.alerts.max_nonfinite_in_a_row = 2
    ctx = WorkerContext(
        rank=rank, world_size=WORLD, role="learner", pool="p", master_port=port, num_threads=1
    )
    learner = Learner(ctx, cfg, None)
    g = torch.Generator().manual_seed(0)  # the same batch on both ranks
    n, vocab = 8, learner.model.config.vocab_size
    ids = torch.randint(3, vocab, (n, 8), generator=g)
    batch = Batch(
        {
            "prompts": ids[:, :4],
            "responses": ids[:, 4:],
            "input_ids": ids,
            "attention_mask": torch.ones(n, 8, dtype=torch.long),
            "response_mask": torch.ones(n, 4),
            "advantages": torch.randn(n, 1, generator=g).expand(n, 4).contiguous(),
        }
    )
    part = batch.chunk(WORLD)[rank]
    part = part | learner.compute_log_prob(part)

    class Poisoned:  # the learner's counter (alerts.max_nonfinite_in_a_row = 2) applies
        def __init__(self, nan_rank: int, calls):
            self.nan_rank, self.calls, self.n = nan_rank, calls, 0

        def objective(self, logp, entropy, mb, totals):
            loss, metrics = learner.objective(logp, entropy, mb, totals)
            if rank == self.nan_rank and self.n in self.calls:
                loss = loss * float("nan")
            self.n += 1
            return loss, metrics

    out = {"first": learner.actor.update(part, Poisoned(1, {0}).objective)}
    try:
        learner.actor.update(part, Poisoned(0, set(range(100))).objective)
        out["error"] = None
    except NonFiniteUpdateError as e:
        out["error"] = str(e)
    learner.close()
    teardown_distributed()
    torch.save(out, Path(workdir) / f"rank{rank}.pt")


@pytest.mark.slow  # two gloo ranks (~25 s); the single-rank skip and stop run by default
def test_two_ranks_skip_and_stop_alike(tmp_path):
    logs = wait_ranks(launch_ranks(__file__, WORLD, tmp_path), timeout=300)
    assert len(logs) == WORLD
    first, second = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    for out in (first, second):
        m = out["first"]
        assert m["actor/skipped_updates"] == 1 and m["actor/updates"] == 1, m
        assert all(math.isfinite(v) for v in m.values()), m
        assert out["error"] is not None
        assert out["error"].startswith("actor: 2 optimizer steps in a row")
    assert first["first"] == second["first"]


# --- alerts ---------------------------------------------------------------------------------------
# a healthy run's metrics (every 10th step of a 200-step W1 GRPO run): reward/mean, reward/std,
# actor/entropy, actor/kl_ref, actor/approx_kl_old, actor/grad_norm
HEALTHY = [
    (0.4492, 0.4984, 0.4305, 0.01652, 0.008711, 2.514),
    (0.6172, 0.487, 0.2917, 0.05905, -0.0006924, 2.674),
    (0.5352, 0.4997, 0.4468, 0.04752, 0.01014, 3.269),
    (0.6836, 0.466, 0.2674, 0.04601, 0.0002393, 2.11),
    (0.5742, 0.4954, 0.3183, 0.05663, 0.006548, 3.526),
    (0.6719, 0.4705, 0.2735, 0.06127, 0.001455, 2.039),
    (0.6797, 0.4675, 0.2765, 0.07004, 0.00519, 1.714),
    (0.6914, 0.4628, 0.3096, 0.05824, 0.001351, 2.069),
    (0.582, 0.4942, 0.293, 0.0624, 0.004292, 2.558),
    (0.7148, 0.4524, 0.2157, 0.0485, 0.0008342, 3.09),
    (0.7656, 0.4244, 0.1824, 0.09916, -0.0006859, 2.783),
    (0.6719, 0.4705, 0.2783, 0.06834, 0.006305, 3.358),
    (0.7266, 0.4466, 0.2615, 0.04028, 0.002324, 1.738),
    (0.6992, 0.4595, 0.3613, 0.04673, 0.002608, 1.614),
    (0.7969, 0.4031, 0.1543, 0.04012, 0.003437, 1.743),
    (0.7891, 0.4088, 0.1877, 0.04643, 0.000485, 2.569),
    (0.8125, 0.3911, 0.1797, 0.09386, 0.002895, 2.624),
    (0.7266, 0.4466, 0.2655, 0.05337, -0.001116, 2.661),
    (0.7383, 0.4404, 0.2127, 0.07737, 0.002083, 2.752),
    (0.7852, 0.4115, 0.1588, 0.08912, 0.0006241, 3.386),
]
KEYS = (
    "reward/mean",
    "reward/std",
    "actor/entropy",
    "actor/kl_ref",
    "actor/approx_kl_old",
    "actor/grad_norm",
)


def healthy_rows(async_mode: bool = False):
    rows = []
    for i, values in enumerate(HEALTHY):
        row = dict(zip(KEYS, values)) | {"actor/skipped_updates": 0, "actor/updates": 2}
        if async_mode:  # staleness 0 or 1 under max_staleness=2
            row["async/staleness_max"] = float(i % 2)
        rows.append(row)
    return rows


def log_all(tmp_path, rows, config=None, max_staleness=0):
    """Log ``rows`` as steps 1, 2, ...; the metrics lines and the alert rows."""
    with MetricsLogger(
        tmp_path,
        tensorboard=False,
        alerts=config or AlertsConfig(),
        max_staleness=max_staleness,
    ) as logger:
        for step, row in enumerate(rows, 1):
            logger.log(step, row)
    return read_metrics(tmp_path), read_alerts(tmp_path)


def fired(lines, name):
    """The steps whose line has ``alert/<name>`` = 1."""
    return [r["step"] for r in lines if r.get(f"alert/{name}") == 1]


def test_quiet_on_a_healthy_run(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="hybridrl.telemetry.alerts"):
        lines, alerts = log_all(tmp_path, healthy_rows(async_mode=True), max_staleness=2)
    assert alerts == [] and not caplog.records
    assert not any(k.startswith("alert/") for r in lines for k in r)


def series(**changes):
    """The healthy rows with ``changes[key] = {row index: value}`` applied."""
    rows = healthy_rows()
    for key, at in changes.items():
        for i, v in at.items():
            rows[i][key.replace("__", "/")] = v
    return rows


@pytest.mark.parametrize(
    "name, rows, steps, value, threshold",
    [
        ("entropy_collapse", series(actor__entropy={12: 0.004}), [13], 0.004, 0.01),
        ("kl_ref_blowup", series(actor__kl_ref={5: 3.5}), [6], 3.5, 1.0),
        ("approx_kl_old_blowup", series(actor__approx_kl_old={7: 0.9}), [8], 0.9, 0.5),
        ("kl_ref_blowup", series(actor__kl_ref={5: math.inf}), [6], None, 1.0),
        ("reward_drop", series(reward__mean={15: 0.1}), [16], 0.7969 - 0.1, 0.5),
        ("nonfinite_updates", series(actor__skipped_updates={3: 2}), [4], 2.0, 0.0),
        (
            "reward_std_zero",
            series(reward__std={i: 0.0 for i in range(4, 12)}),
            [9, 10, 11, 12],
            5.0,
            5.0,
        ),
    ],
)
def test_rule_fires(tmp_path, name, rows, steps, value, threshold):
    lines, alerts = log_all(tmp_path, rows)
    assert fired(lines, name) == steps
    assert [a["alert"] for a in alerts] == [name]
    (row,) = alerts
    assert set(row) == {"step", "alert", "value", "threshold", "message"}
    assert row["step"] == steps[0] and row["threshold"] == pytest.approx(threshold)
    assert row["value"] == (None if value is None else pytest.approx(value))
    assert isinstance(row["message"], str) and "\n" not in row["message"]


def test_grad_norm_spike_against_the_running_median(tmp_path):
    rows = series(actor__grad_norm={2: 40.0, 14: 40.0})  # step 3: too little history yet
    lines, alerts = log_all(tmp_path, rows)
    assert fired(lines, "grad_norm_spike") == [15]
    history = [40.0 if i == 2 else v[5] for i, v in enumerate(HEALTHY[:14])]
    assert alerts[0]["value"] == 40.0
    assert alerts[0]["threshold"] == pytest.approx(10 * statistics.median(history))
    # a run whose grad norm is 0 on some steps (no informative group): zeros are not the scale
    rows = series(actor__grad_norm={i: 0.0 for i in range(0, 10)})
    lines, _ = log_all(tmp_path / "zeros", rows)
    assert fired(lines, "grad_norm_spike") == []


def test_staleness_at_bound(tmp_path):
    rows = healthy_rows(async_mode=True)
    for i in range(6, 14):
        rows[i]["async/staleness_max"] = 2.0
    lines, alerts = log_all(tmp_path, rows, max_staleness=2)
    assert fired(lines, "staleness_at_bound") == [11, 12, 13, 14]
    assert [(a["alert"], a["step"]) for a in alerts] == [("staleness_at_bound", 11)]
    # on-policy async (max_staleness 0): staleness is always at its bound, never an alert
    rows = [r | {"async/staleness_max": 0.0} for r in healthy_rows()]
    lines, alerts = log_all(tmp_path / "onpolicy", rows, max_staleness=0)
    assert alerts == [] and fired(lines, "staleness_at_bound") == []


def test_once_per_streak(tmp_path, caplog):
    low = {i: 0.001 for i in (3, 4, 5, 9, 10)}  # two streaks: steps 4-6 and 10-11
    with caplog.at_level(logging.WARNING, logger="hybridrl.telemetry.alerts"):
        lines, alerts = log_all(tmp_path, series(actor__entropy=low))
    assert fired(lines, "entropy_collapse") == [4, 5, 6, 10, 11]
    assert [(a["alert"], a["step"]) for a in alerts] == [
        ("entropy_collapse", 4),
        ("entropy_collapse", 10),
    ]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert warnings[0].startswith("alert entropy_collapse at step 4: actor/entropy = 0.001")
    # a step without the metric (e.g. an eval-only line) does not end the streak
    rows = series(actor__entropy={3: 0.001, 5: 0.001})
    del rows[4]["actor/entropy"]
    _, alerts = log_all(tmp_path / "gap", rows)
    assert [a["step"] for a in alerts] == [4]


def test_thresholds_zero_and_disabled(tmp_path):
    bad = series(actor__entropy={3: 0.0}, actor__kl_ref={4: 9.0}, reward__mean={6: -5.0})
    off = AlertsConfig(entropy_floor=0, kl_ref_max=0, reward_drop=0)
    lines, alerts = log_all(tmp_path, bad, off)
    assert alerts == [] and not any(k.startswith("alert/") for r in lines for k in r)
    lines, alerts = log_all(tmp_path / "disabled", bad, AlertsConfig(enabled=False))
    assert alerts == [] and not (tmp_path / "disabled" / "alerts.jsonl").exists()
    # no alerts config (other users of the logger): no alerts
    with MetricsLogger(tmp_path / "none", tensorboard=False) as logger:
        logger.log(1, {"actor/entropy": 0.0})
    assert read_alerts(tmp_path / "none") == []


def test_alert_metrics_reach_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path, alerts=AlertsConfig()) as logger:
        logger.log(1, {"actor/entropy": 0.001})
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert "alert/entropy_collapse" in acc.Tags()["scalars"]


def test_resume_truncates_and_replays(tmp_path):
    rows = series(actor__entropy={i: 0.001 for i in range(3, 8)}, reward__mean={})
    with MetricsLogger(tmp_path, tensorboard=False, alerts=AlertsConfig()) as logger:
        for step, row in enumerate(rows[:8], 1):
            logger.log(step, row)
    assert [a["step"] for a in read_alerts(tmp_path)] == [4]
    # a later alert row past the checkpoint (step 5) is dropped on resume
    with open(tmp_path / "alerts.jsonl", "a") as f:
        f.write(json.dumps({"step": 7, "alert": "kl_ref_blowup"}) + "\n")
    with MetricsLogger(tmp_path, tensorboard=False, alerts=AlertsConfig(), resume_step=5) as logger:
        # the entropy streak (steps 4-5) goes on: not logged again
        logger.log(6, rows[5])
        best = max(v[0] for v in HEALTHY[:5])  # known only from the replayed lines
        logger.log(7, rows[6] | {"reward/mean": best - 0.49})
        logger.log(8, rows[7] | {"reward/mean": best - 0.51})
    assert [(a["alert"], a["step"]) for a in read_alerts(tmp_path)] == [
        ("entropy_collapse", 4),
        ("reward_drop", 8),
    ]
    assert fired(read_metrics(tmp_path), "entropy_collapse") == [4, 5, 6, 7, 8]


def test_alerts_object_directly(tmp_path):
    alerts = Alerts(tmp_path, AlertsConfig())
    assert alerts.check(1, {"actor/entropy": float("nan")}) == {}
    assert alerts.check(2, {"actor/entropy": torch.tensor(0.0)}) == {"alert/entropy_collapse": 1.0}
    assert alerts.check(3, {"critic/skipped_updates": 1, "actor/skipped_updates": 0}) == {
        "alert/nonfinite_updates": 1.0
    }
    (_, row) = read_alerts(tmp_path)
    assert "critic/skipped_updates = 1" in row["message"] and "actor" not in row["message"]


if __name__ == "__main__":
    if sys.argv[1] == "rank":
        rank_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
        # as in test_fsdp.py: leave without the interpreter's exit (FSDP2's reference cycles keep
        # the gloo group's threads alive, which can abort it)
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(0)


def test_a_streak_on_an_infinite_value_is_not_logged_again_after_resume(tmp_path):
    """inf is written to metrics.jsonl as null: the replay takes the step's alert/<name> instead."""
    with MetricsLogger(tmp_path, tensorboard=False, alerts=AlertsConfig()) as logger:
        logger.log(1, {"actor/kl_ref": 0.01})
        logger.log(2, {"actor/kl_ref": float("inf")})
    assert [(a["alert"], a["step"]) for a in read_alerts(tmp_path)] == [("kl_ref_blowup", 2)]
    with MetricsLogger(tmp_path, tensorboard=False, alerts=AlertsConfig(), resume_step=2) as logger:
        logger.log(3, {"actor/kl_ref": float("inf")})  # the same streak goes on
    assert [(a["alert"], a["step"]) for a in read_alerts(tmp_path)] == [("kl_ref_blowup", 2)]
