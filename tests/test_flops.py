"""MFU telemetry: the analytic FLOPs against torch's flop counter, the cached peak, and the perf/*
metrics of a short real run."""

import json
import time

import pytest
import torch
from test_train_e2e import TINY_RUN
from torch.utils.flop_counter import FlopCounterMode
from transformers import Qwen2ForCausalLM

from hybridrl.config import Config, load_config
from hybridrl.models.factory import model_size_config
from hybridrl.models.loading import load_tokenizer
from hybridrl.telemetry import flops
from hybridrl.telemetry.flops import DecoderShape


def tiny_eager_model():
    config = model_size_config("tiny", load_tokenizer(load_config(Config, None, []), None))
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).float().eval()


def test_formula_matches_flop_counter():
    model = tiny_eager_model()
    shape = DecoderShape.from_model(model)
    B, T = 3, 21
    ids = torch.randint(0, model.config.vocab_size, (B, T))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(input_ids=ids, use_cache=False)
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    matmul = counts.get("aten.mm", 0) + counts.get("aten.addmm", 0)
    attention = counts.get("aten.bmm", 0)
    # the projections, MLP and head: exact up to a few percent (biases are not counted)
    assert matmul == pytest.approx(2 * shape.matmul_params * B * T, rel=0.02)
    # eager attention multiplies the whole masked T x T matrix: the non-causal term
    assert attention == pytest.approx(B * shape.attention_flops(T, causal=False), rel=0.02)
    total = counter.get_total_flops()
    assert total == pytest.approx(shape.forward_flops([T] * B, causal=False), rel=0.02)
    # the causal convention counts (T + 1) / 2 keys per token on average
    assert shape.attention_flops(T) * 2 == shape.layers * 4 * shape.heads * shape.head_dim * T * (
        T + 1
    )


def test_shape_of_the_critic_counts_its_one_output():
    from transformers import Qwen2ForTokenClassification

    config = tiny_eager_model().config
    config.num_labels = 1
    critic = DecoderShape.from_model(Qwen2ForTokenClassification(config))
    policy = DecoderShape.from_config(config)
    assert policy.matmul_params - critic.matmul_params == config.hidden_size * (
        config.vocab_size - 1
    )


def test_peak_is_measured_once_and_positive(monkeypatch):
    monkeypatch.setattr(flops, "_PEAKS", {})
    for dtype in (torch.float32, torch.bfloat16):
        t0 = time.perf_counter()
        first = flops.peak_flops("cpu", dtype)
        measured = time.perf_counter() - t0
        t0 = time.perf_counter()
        again = flops.peak_flops("cpu", dtype)
        cached = time.perf_counter() - t0
        assert first > 0 and again == first
        assert measured > 0.1 and cached < 1e-3


def test_mfu_stays_at_most_one_when_the_peak_was_measured_under_load(monkeypatch):
    """A peak measured while another process held the cores is far too low; a phase that then runs
    on a free machine outruns it. MFU stays <= 1: the phase's rate raises the peak, and the next
    phase is measured against the raised one."""
    from types import SimpleNamespace

    monkeypatch.setattr(flops, "_PEAKS", {})
    monkeypatch.setattr(flops, "measure_matmul_flops", lambda *a, **k: 1e6)  # 1 MFLOP/s: loaded
    model = tiny_eager_model()
    learner = SimpleNamespace(
        model=model,
        reference=SimpleNamespace(model=model),
        cfg=load_config(Config, None, []),
    )
    mask = torch.ones(8, 24, dtype=torch.long)
    shape = DecoderShape.from_model(model)
    ref_rate = shape.forward_flops([24] * 8) / 0.01
    out = flops.learner_perf(learner, {"timing/reference": 0.01, "timing/update": 1.0}, mask)
    assert out["perf/mfu_reference"] == pytest.approx(1.0)  # it set the peak
    # the update: 3 forwards' FLOPs in 100 x the time, against the peak the reference showed
    assert out["perf/mfu_update"] == pytest.approx(3 / 100, rel=1e-6)
    assert flops.peak_flops("cpu", torch.float32) == pytest.approx(ref_rate)


def test_mfu_counts_a_shared_prompt_once(monkeypatch):
    """With packed micro-batches a group's samples share one copy of their prompt: the update
    computes fewer tokens than its rows hold, and the FLOPs (and MFU) count what it computed."""
    from types import SimpleNamespace

    monkeypatch.setattr(flops, "_PEAKS", {})
    monkeypatch.setattr(flops, "measure_matmul_flops", lambda *a, **k: 1e15)  # never outrun
    model = tiny_eager_model()
    learner = SimpleNamespace(model=model, cfg=load_config(Config, None, []))
    mask = torch.ones(8, 24, dtype=torch.long)  # 8 samples of one 16-token prompt + 8 new tokens
    timing = {"timing/update": 1.0}
    every_row = flops.learner_perf(learner, timing, mask)["perf/mfu_update"]
    shared = flops.learner_perf(learner, timing, mask, computed_tokens=16 + 8 * 8)
    assert shared["perf/mfu_update"] == pytest.approx(every_row * 80 / 192)
    # the tokens per second stay the rows' tokens: what was trained on
    assert shared["perf/tokens_per_s_update"] == pytest.approx(192 * learner.cfg.actor.ppo_epochs)


def test_mfu_in_a_real_runs_metrics(tmp_path):
    from hybridrl.driver.loop import train

    cfg = load_config(
        Config,
        None,
        [
            *TINY_RUN,
            "trainer.eval_every=0",
            "trainer.save_every=0",
            f"sft.checkpoint={tmp_path / 'ws'}",
            f"trainer.runs_dir={tmp_path / 'runs'}",
        ],
    )
    train(cfg)
    lines = (tmp_path / "runs" / cfg.trainer.name / "metrics.jsonl").read_text().splitlines()
    steps = [r for r in map(json.loads, lines) if r["step"] > 0]
    assert steps
    for row in steps:
        # the default job: reference (kl_coef > 0), old log-probs from the update's forward
        for key in ("perf/mfu_update", "perf/mfu_reference", "perf/mfu_rollout"):
            assert 0 < row[key] <= 1, (key, row[key])
        assert row["perf/tokens_per_s_update"] > 0 and row["perf/tokens_per_s_reference"] > 0
        assert "perf/mfu_values" not in row  # GRPO has no critic
        if "timing/old_log_prob" in row:
            assert 0 < row["perf/mfu_old_log_prob"] <= 1
