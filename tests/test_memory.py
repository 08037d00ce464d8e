"""Memory estimator: ZeRO formulas, monotonicity, CLI errors, a measured check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridrl.parallel.memory import Layout, Shape, estimate
from hybridrl.parallel.memory_cli import format_table, main, resolve_model

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9


def mixed(**kw) -> Layout:
    return Layout(param_dtype="bf16", master_fp32=True, **kw)


def test_mixed_precision_adam_is_16_psi():
    psi = 1_000_000
    r = estimate(psi, mixed())
    assert (r["weights"], r["gradients"], r["optimizer"]) == (2 * psi, 2 * psi, 12 * psi)
    assert r["breakdown"]["optimizer"] == {"master": 4 * psi, "m": 4 * psi, "v": 4 * psi}
    assert r["states"] == 16 * psi
    assert r["activations"] is None and r["total"] == 16 * psi  # a bare count has no shapes


def test_fp32_adam_has_no_master_copy():
    psi = 1_000_000
    r = estimate(psi, Layout(param_dtype="fp32"))
    assert (r["weights"], r["gradients"], r["optimizer"]) == (4 * psi, 4 * psi, 8 * psi)
    assert r["breakdown"]["optimizer"]["master"] == 0
    pure_bf16 = estimate(psi, Layout(param_dtype="bf16", master_fp32=False))
    assert pure_bf16["states"] == 8 * psi


def test_zero_paper_figure_1():
    """ZeRO (1910.02054) Figure 1: Ψ = 7.5B, N = 64, K = 12."""
    psi, n = 7_500_000_000, 64
    per_device = {
        s: estimate(psi, mixed(world_size=n, sharding=s))["states"]
        for s in ("none", "optim", "grad_op", "full")
    }
    assert per_device["none"] == 16 * psi == 120 * GB
    assert per_device["optim"] == 4 * psi + 12 * psi // n  # stage 1: 31.4 GB
    assert per_device["grad_op"] == 2 * psi + 14 * psi // n  # stage 2: 16.6 GB
    assert per_device["full"] == 16 * psi // n  # stage 3: 1.875 GB
    assert (
        round(per_device["optim"] / GB, 1) == 31.4 and round(per_device["grad_op"] / GB, 1) == 16.6
    )
    assert round(per_device["full"] / GB, 2) == 1.88


def test_70b_needs_1_12_tb_of_states():
    r = estimate(70e9, mixed())
    assert r["states"] == pytest.approx(1.12e12)
    assert r["states"] - r["breakdown"]["optimizer"]["master"] == pytest.approx(
        0.84e12
    )  # without the master copy
    assert "1.12 TB" in format_table(r)


def test_param_count_matches_the_real_models():
    from transformers import Qwen2ForCausalLM

    for size in ("tiny", "small"):
        with torch.device("meta"):
            model = Qwen2ForCausalLM(resolve_model(size))
        assert estimate(model.config)["n_params"] == sum(p.numel() for p in model.parameters())


def test_more_ranks_less_per_device():
    cfg = resolve_model("small")
    for sharding in ("optim", "grad_op", "full"):
        totals = [
            estimate(cfg, Layout(world_size=n, sharding=sharding))["states"] for n in (1, 2, 4, 8)
        ]
        assert totals == sorted(totals, reverse=True) and totals[0] > totals[-1], sharding
    assert (
        len({estimate(cfg, Layout(world_size=n))["states"] for n in (1, 2, 8)}) == 1
    )  # replicated


def test_activation_checkpointing_reduces_activations():
    cfg = resolve_model("small")
    for tokens in (512, 8192):
        off = estimate(cfg, Layout(micro_batch_tokens=tokens))["activations"]
        on = estimate(cfg, Layout(micro_batch_tokens=tokens, activation_checkpointing=True))[
            "activations"
        ]
        assert on < off
    small = estimate(cfg, Layout(micro_batch_tokens=1024))["activations"]
    assert estimate(cfg, Layout(micro_batch_tokens=4096))["activations"] == pytest.approx(
        4 * small, rel=0.05
    )


def test_lora_reduces_gradients_and_optimizer_states():
    cfg = resolve_model("tiny")
    s = Shape.from_config(cfg)
    r = 8
    h, i, kv = 128, 512, 2 * 32  # tiny: hidden 128, intermediate 512, 2 KV heads of 32
    by_hand = 4 * r * ((h + h) + 2 * (h + kv) + (h + h) + 2 * (h + i) + (i + h))
    assert s.lora_params(r) == by_hand
    full, lora = estimate(cfg, Layout()), estimate(cfg, Layout(lora_rank=r))
    assert lora["trainable_params"] == by_hand
    assert lora["optimizer"] == 8 * by_hand < full["optimizer"]
    assert lora["gradients"] == 4 * by_hand < full["gradients"]
    assert lora["weights"] > full["weights"]  # base + adapters


def test_offload_moves_states_to_host():
    cfg = resolve_model("small")
    r = estimate(cfg, Layout(cpu_offload=True, world_size=2, sharding="full"))
    assert r["device"]["weights"] == r["device"]["optimizer"] == "cpu"
    assert r["host_total"] == r["states"]
    assert r["device_total"] == r["activations"] + r["workspace"] and r["workspace"] > 0


def test_activation_formula_matches_saved_tensors_of_a_qwen2_forward():
    """The per-layer count equals what autograd saves (unique storages, parameters excluded)."""
    from hybridrl.models.factory import build_model
    from hybridrl.tasks import build_char_tokenizer

    torch.manual_seed(0)
    model = build_model("tiny", build_char_tokenizer(), seed=0).train()
    rows, width = 16, 32
    ids = torch.randint(3, 17, (rows, width))
    attn = torch.ones_like(ids)
    attn[: rows // 2, :3] = 0  # padding, as the actor's batches have
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            saved.setdefault(s.data_ptr(), s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(
            input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0)
        ).logits
        logp = torch.log_softmax(logits.float(), -1)
        (-(logp.exp() * logp).sum()).backward()
    est = estimate(model.config, Layout(micro_batch_tokens=rows * width, seq_len=width))[
        "breakdown"
    ]["activations"]
    assert sum(saved.values()) == pytest.approx(est["layers"] + est["head"], rel=0.02)


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["not-a-model"],
        ["/nonexistent/config.json"],
        ["7e9", "--sharding", "zero9"],
        ["7e9", "--world-size", "0"],
        ["7e9", "--lora-rank", "8"],
        ["7e9", "--dtype", "fp16"],
        ["-5"],
        ["small", "--micro-batch-tokens", "0"],
    ],
)
def test_cli_errors_return_2_with_one_line(argv, capsys):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("hybridrl memory: error:") and err.count("\n") == 1


def test_cli_prints_table(tmp_path, capsys):
    assert main(["70B", "--dtype", "bf16"]) == 0
    assert "1.12 TB" in capsys.readouterr().out
    resolve_model("tiny").save_pretrained(tmp_path)
    assert (
        main(
            [
                str(tmp_path),
                "--activation-checkpointing",
                "--world-size",
                "2",
                "--sharding",
                "full",
                "--json",
            ]
        )
        == 0
    )
    r = json.loads(capsys.readouterr().out)
    assert r["n_params"] == estimate(resolve_model("tiny"))["n_params"] and r["activations"] > 0
    assert main(["tiny", "--lora-rank", "4", "--offload"]) == 0
    assert "cpu" in capsys.readouterr().out


def test_measured_peak_of_tiny_model_within_35_percent():
    tokens, seq_len = 4096, 32
    env = dict(
        os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="131072", PYTHONPATH=str(ROOT)
    )
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "memory.py"),
            "--child",
            "--model",
            "tiny",
            "--tokens",
            str(tokens),
            "--seq-len",
            str(seq_len),
            "--micro-batches",
            "1",
            "--no-tensor-peak",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    measured = json.loads(proc.stdout.strip().splitlines()[-1])["rss_peak"]
    est = estimate(resolve_model("tiny"), Layout(micro_batch_tokens=tokens, seq_len=seq_len))[
        "total"
    ]
    assert est / measured == pytest.approx(1.0, abs=0.35), (est, measured)
