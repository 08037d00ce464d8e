"""CPU precision (``parallel/precision.py``): the decision (injected capability and measurement),
the log line, and training / reference / critic steps under bf16 autocast against the same steps in
fp32.

Tolerances: bf16 keeps 8 significant bits (relative rounding 2^-9 per value); through the tiny
model's 4 layers a log-prob moves by about 3e-3 nats (measured here). Each bound below is set 5-25
times above what was measured, and the comparisons also check that bf16 really ran (the difference
is not zero).
"""

from __future__ import annotations

import logging

import pytest
import torch
from test_fsdp import make_batch

from hybridrl.config import Config
from hybridrl.controller import WorkerContext
from hybridrl.parallel import precision as training_precision

CTX = WorkerContext(rank=0, world_size=1, role="actor", pool="p", num_threads=1)


def never():
    raise AssertionError("called although the decision does not need it")


# --- the decision ---------------------------------------------------------------------------------
def test_supported_and_fast_gives_bf16():
    p = training_precision.decide("auto", support=lambda: "amx_bf16", speedup=lambda: 1.7)
    assert p.dtype == torch.bfloat16 and "amx_bf16" in p.reason and "1.70x" in p.reason


def test_supported_but_slow_gives_fp32():
    p = training_precision.decide("auto", support=lambda: "avx512_bf16", speedup=lambda: 1.1)
    assert p.dtype == torch.float32 and "only 1.10x" in p.reason and "1.3x" in p.reason


def test_unsupported_gives_fp32_without_measuring():
    p = training_precision.decide("auto", support=lambda: None, speedup=never)
    assert p.dtype == torch.float32 and "no native bf16" in p.reason


def test_forced_values_win_without_measuring():
    assert training_precision.decide("fp32", support=never, speedup=never).dtype == torch.float32
    forced = training_precision.decide("bf16", support=lambda: None, speedup=never)
    assert forced.dtype == torch.bfloat16 and "expect it slower" in forced.reason
    assert (
        training_precision.decide("auto", support=never, speedup=never, env="bf16").dtype
        == torch.bfloat16
    )
    assert (
        training_precision.decide("auto", support=never, speedup=never, env="fp32").dtype
        == torch.float32
    )
    with pytest.raises(ValueError, match="must be auto, fp32 or bf16"):
        training_precision.decide("fp16", support=never, speedup=never)
    with pytest.raises(ValueError, match="HYBRIDRL_AUTO_PRECISION"):
        training_precision.decide("auto", support=never, speedup=never, env="fp16")


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    def support(flags):
        f = tmp_path / "cpuinfo"
        f.write_text(f"processor\t: 0\nflags\t\t: fpu sse2 {flags}\n\nprocessor\t: 1\n")
        return training_precision.cpu_bf16_support(f)

    assert support("avx512f avx512_bf16 amx_tile amx_bf16") == "amx_bf16"
    assert support("avx512f avx512_bf16") == "avx512_bf16"
    assert support("avx2 avx512f") is None
    assert training_precision.cpu_bf16_support(tmp_path / "missing") is None


def test_the_measurement_runs_on_a_copy_of_a_layer():
    from hybridrl.models.factory import build_model
    from hybridrl.tasks.tokenizer import build_char_tokenizer

    model = build_model("tiny", build_char_tokenizer(), 0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for train in (True, False):
        gain = training_precision.model_speedup(model, train)
        assert 0.05 < gain < 50  # a ratio of two timings, whatever this machine makes of it
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


# --- the workers ----------------------------------------------------------------------------------
def make_cfg(precision: str) -> Config:
    cfg = Config()
    cfg.actor.ppo_minibatch_size = 4
    cfg.actor.micro_batch_tokens = 32
    cfg.algorithm.entropy_coef = 0.01
    cfg.fsdp.mixed_precision = precision
    return cfg


def make_learner(cfg: Config):
    from hybridrl.learner import Learner

    return Learner(CTX, cfg, None)


def dist_env():
    from hybridrl.parallel import distributed

    return distributed.init_distributed(CTX)


@pytest.mark.parametrize("gain,want", [(2.0, "bf16 autocast"), (1.1, "fp32")])
def test_auto_logs_the_choice_and_marks_the_model(monkeypatch, caplog, gain, want):
    monkeypatch.delenv(training_precision.ENV_OVERRIDE, raising=False)
    monkeypatch.setattr(training_precision, "cpu_bf16_support", lambda: "amx_bf16")
    monkeypatch.setattr(training_precision.SPEEDUPS, "get", lambda model, train: gain)
    with caplog.at_level(logging.INFO, logger="hybridrl.parallel.fsdp"):
        actor = make_learner(make_cfg("auto"))
    lines = [r.getMessage() for r in caplog.records if "training precision" in r.getMessage()]
    assert lines == [
        f"training precision: {want} (fsdp.mixed_precision=auto: CPU amx_bf16, "
        + (
            f"bf16 measured {gain:.2f}x fp32 on one layer of this model)"
            if gain > 1.3
            else f"but bf16 measured only {gain:.2f}x fp32 on one layer of this model (needs 1.3x))"
        )
    ]
    assert training_precision.autocast_dtype(actor.model) == (
        torch.bfloat16 if gain > 1.3 else None
    )


def test_actor_reference_and_critic_share_one_measurement_and_its_verdict(monkeypatch):
    calls = []
    monkeypatch.delenv(training_precision.ENV_OVERRIDE, raising=False)
    monkeypatch.setattr(training_precision, "cpu_bf16_support", lambda: "amx_bf16")
    monkeypatch.setattr(training_precision, "SPEEDUPS", training_precision._SpeedupCache())
    monkeypatch.setattr(
        training_precision, "model_speedup", lambda model, train: calls.append(train) or 1.5
    )
    cfg = make_cfg("auto")
    cfg.algorithm.advantage = "gae"  # the learner then holds a critic, and a reference (kl_coef)
    learner = make_learner(cfg)
    models = [learner.model, learner.reference.model, learner.critic.model]
    assert calls == [True]  # one forward + backward measurement per process and layer shape
    assert all(training_precision.autocast_dtype(m) == torch.bfloat16 for m in models)


@pytest.fixture(scope="module")
def steps():
    """One update_actor of the same policy on the same batch in fp32 and in bf16 (forced)."""
    out = {}
    for precision in ("fp32", "bf16"):
        actor = make_learner(make_cfg(precision))
        before = {n: p.detach().clone() for n, p in actor.model.named_parameters()}
        batch = out.get("batch") or make_batch(make_learner(make_cfg("fp32")))
        shuffle = torch.Generator()  # the update's mini-batch generator before the update draws
        shuffle.set_state(actor.actor.shuffle.get_state())
        logp = actor.compute_log_prob(batch)["old_log_probs"]
        metrics = actor.update_actor(batch)
        out |= {
            "batch": batch,
            "shuffle": shuffle,
            precision: dict(actor=actor, before=before, logp=logp, metrics=metrics),
        }
    return out


def test_bf16_log_probs_are_fp32_and_close_to_fp32(steps):
    a, b = steps["fp32"]["logp"], steps["bf16"]["logp"]
    assert a.dtype == b.dtype == torch.float32
    diff = (a - b).abs().max().item()
    assert 0 < diff <= 0.02, diff  # measured 3e-3 nats


def test_bf16_step_changes_weights_and_keeps_fp32_master_weights(steps):
    run = steps["bf16"]
    actor = run["actor"]
    assert training_precision.autocast_dtype(actor.model) == torch.bfloat16
    moved = max(
        (p.detach() - run["before"][n]).abs().max().item()
        for n, p in actor.model.named_parameters()
    )
    assert moved > 1e-5
    assert all(p.dtype == torch.float32 for p in actor.model.parameters())
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in actor.model.parameters())
    states = [
        t
        for st in actor.optimizer.state.values()
        for k, t in st.items()
        if k in ("exp_avg", "exp_avg_sq")
    ]
    assert states and all(t.dtype == torch.float32 for t in states)


def test_bf16_step_loss_is_close_to_the_fp32_step(steps):
    f, b = steps["fp32"]["metrics"], steps["bf16"]["metrics"]
    assert f["actor/updates"] == b["actor/updates"] == 3
    # entropy ~2.8, KL to the reference ~3e-3, pg loss ~0.8: measured gaps 2e-5, 2e-5, 2e-4
    assert b["actor/entropy"] == pytest.approx(f["actor/entropy"], abs=0.01)
    assert b["actor/kl_ref"] == pytest.approx(f["actor/kl_ref"], abs=0.002)
    assert b["actor/pg_loss"] == pytest.approx(f["actor/pg_loss"], abs=0.005)
    assert b["actor/pg_loss"] != f["actor/pg_loss"]

    # the update goes the same way: Adam's first steps are about lr * sign(grad), so compare
    # directions
    def delta(run):
        return torch.cat(
            [
                (p.detach() - run["before"][n]).flatten()
                for n, p in run["actor"].model.named_parameters()
            ]
        )

    cos = torch.nn.functional.cosine_similarity(
        delta(steps["fp32"]), delta(steps["bf16"]), dim=0
    ).item()
    assert cos > 0.9, cos  # measured 0.998


def test_reference_and_critic_in_bf16(steps, caplog):
    from hybridrl.learner.critic import Critic
    from hybridrl.learner.reference import Reference

    batch = steps["batch"]
    with caplog.at_level(logging.INFO, logger="hybridrl.parallel.fsdp"):
        ref16 = Reference(make_cfg("bf16"), None, dist_env())
    assert any(
        "reference / log-prob precision: bf16 autocast (fsdp.mixed_precision=bf16" in r.getMessage()
        for r in caplog.records
    )
    ref32 = Reference(make_cfg("fp32"), None, dist_env())
    r16, r32 = (ref.log_probs(batch, steps["shuffle"])["ref_log_probs"] for ref in (ref16, ref32))
    assert r16.dtype == torch.float32 and 0 < (r16 - r32).abs().max().item() <= 0.02
    # equal weights, equal precision: the reference reproduces the actor's log-probs exactly (KL 0
    # at the start), on any CPU: both group the rows as the update's first epoch does, so each
    # row's bf16 matmuls have the same shapes (a whole-batch grouping differs in the last bit on
    # AVX2-only CPUs)
    assert torch.equal(r16, steps["bf16"]["logp"])
    metrics, values = {}, {}
    for precision in ("fp32", "bf16"):
        critic = Critic(make_cfg(precision), None, dist_env())
        metrics[precision] = critic.update(batch)
        values[precision] = critic.values(batch)["values"]
        assert all(p.dtype == torch.float32 for p in critic.model.parameters())
    assert (
        values["bf16"].dtype == torch.float32
        and (values["bf16"] - values["fp32"]).abs().max().item() <= 0.01
    )  # measured 3e-4
    assert metrics["bf16"]["critic/vf_loss"] == pytest.approx(
        metrics["fp32"]["critic/vf_loss"], rel=0.05
    )
