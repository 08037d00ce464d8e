"""bench/moe.py's fine-grained variant of tiny_moe (``--experts``, ``--top-k``): the saved random
init has the asked shape with tiny_moe's active width, a fixed-step warm start of it is cached
apart from tiny_moe's, and the native engine records k experts per token for it (what the replay
measurement reads)."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from hybridrl.config import Config, load_config
from hybridrl.models.factory import model_size_config
from hybridrl.models.loading import load_model, make_task
from hybridrl.protocol import prompt_sample
from hybridrl.rollout.backends.native import NativeRollout
from hybridrl.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_moe", ROOT / "bench" / "moe.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


MOE = load_bench()


def example() -> Config:
    cfg = load_config(Config, str(MOE.EXAMPLE), [])
    cfg.sft.batch_size = 4
    return cfg


def args(workdir: Path, experts: int, k: int = 4) -> argparse.Namespace:
    return argparse.Namespace(experts=experts, top_k=k, moe_intermediate=0, workdir=str(workdir))


def test_no_variant_leaves_the_config_alone(tmp_path):
    cfg = example()
    assert MOE.fine_grained(cfg, args(tmp_path, 0)) is None
    assert cfg.model.path is None and not any(tmp_path.iterdir())


def test_variant_shape_active_width_and_routing(tmp_path):
    cfg = example()
    shape = MOE.fine_grained(cfg, args(tmp_path, 16, k=4))
    model, tok = load_model(cfg, cfg.model.path)
    c = model.config
    base = model_size_config("tiny_moe", tok)
    assert (c.num_experts, c.num_experts_per_tok, c.norm_topk_prob) == (16, 4, True)
    assert shape["moe_intermediate_size"] == c.moe_intermediate_size == 128
    # active expert width per token as tiny_moe's (2 x 256), everything else the same
    assert 4 * c.moe_intermediate_size == base.num_experts_per_tok * base.moe_intermediate_size
    assert (c.hidden_size, c.num_hidden_layers) == (base.hidden_size, base.num_hidden_layers)
    # a second call reuses the saved init (same weights)
    again = example()
    MOE.fine_grained(again, args(tmp_path, 16, k=4))
    other = AutoModelForCausalLM.from_pretrained(again.model.path)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))

    engine = NativeRollout(model, tok, cfg.rollout)
    engine.update_weights([(n, p.detach()) for n, p in model.named_parameters()], 0)
    samples = engine.generate(
        [prompt_sample(make_task(cfg).prompt(0), tok)],
        SamplingParams(n=2, max_new_tokens=3, seed=0),
    )
    routing = torch.as_tensor(samples[0].routing)
    assert routing.shape[-2:] == (c.num_hidden_layers, 4)
    real = routing[(routing >= 0).all(-1).all(-1)]
    assert len(real) and int(real.max()) < 16
    assert all(len(set(row.tolist())) == 4 for row in real.view(-1, 4))  # k distinct experts


def test_fixed_step_warm_start_is_cached_per_variant(tmp_path):
    cfg = example()
    MOE.fine_grained(cfg, args(tmp_path, 16, k=4))
    out = Path(MOE.warm_start(cfg, 2, str(tmp_path)))
    assert out.name == "warmstart-tiny_moe-e16-k4-i128-s0-2"
    assert json.loads((out / "sft.json").read_text())["steps"] == 2
    assert AutoModelForCausalLM.from_pretrained(out).config.num_experts == 16
