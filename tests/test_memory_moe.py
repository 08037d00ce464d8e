"""The memory estimator on mixture-of-experts models (``parallel/memory_moe.py``): exact parameter
counts of Qwen3-MoE (tiny_moe), Qwen2-MoE (shared expert, a dense layer) and Mixtral; the
activations of top-k routing against what autograd saves; what expert parallelism changes per
device; bad layouts."""

from __future__ import annotations

import pytest
import torch
from transformers import MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

from hybridrl.parallel.memory import Layout, estimate
from hybridrl.parallel.memory_cli import main, resolve_model

SMALL = dict(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts_per_tok=2,
)


def real_counts(model) -> tuple[int, int]:
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return total, experts


def real_model(kind: str):
    """(config, model) of tiny_moe, a Qwen2-MoE with a shared expert and a dense first layer, or
    a Mixtral."""
    if kind == "tiny_moe":
        config = resolve_model("tiny_moe")
        from transformers import Qwen3MoeForCausalLM

        return config, Qwen3MoeForCausalLM(config)
    if kind == "qwen2_moe":
        config = Qwen2MoeConfig(
            **SMALL,
            num_experts=4,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            intermediate_size=48,
            mlp_only_layers=[0],
        )
        return config, Qwen2MoeForCausalLM(config)
    config = MixtralConfig(**SMALL, num_local_experts=4, intermediate_size=16)
    return config, MixtralForCausalLM(config)


@pytest.mark.parametrize("kind", ["tiny_moe", "qwen2_moe", "mixtral"])
def test_parameter_counts_match_the_real_models(kind):
    config, model = real_model(kind)
    r = estimate(config)
    assert (r["n_params"], r["expert_params"]) == real_counts(model)


@pytest.mark.parametrize("kind", ["tiny_moe", "qwen2_moe", "mixtral"])
def test_lora_on_moe_counts_the_adapters_peft_adds(kind):
    """LoRA on an MoE model adapts attention, dense MLPs and a shared expert, never the routed
    experts: the estimate's trainable parameters equal those of the real PEFT-wrapped model."""
    from hybridrl.learner.lora import LoraSettings, apply_lora, trainable_parameters

    config, model = real_model(kind)
    model = apply_lora(model, LoraSettings(rank=4))
    real = sum(p.numel() for p in trainable_parameters(model))
    est = estimate(config, Layout(lora_rank=4))
    assert est["trainable_params"] == real
    assert est["optimizer"] == 8 * real  # fp32 m and v of the adapters only


def test_tiny_moe_active_parameters_are_about_tiny():
    experts = estimate(resolve_model("tiny_moe"))["breakdown"]["experts"]
    tiny = estimate(resolve_model("tiny"))["n_params"]
    assert experts["active_params_per_token"] == pytest.approx(tiny, rel=0.01)


def test_activations_match_saved_tensors_of_a_tiny_moe_forward():
    """Top-k routing's activations (and Qwen3's q/k norms) equal what autograd saves, within 2 %
    (unique storages, parameters excluded)."""
    from hybridrl.models.factory import build_model
    from hybridrl.tasks import build_char_tokenizer

    torch.manual_seed(0)
    model = build_model("tiny_moe", build_char_tokenizer(), seed=0).train()
    rows, width = 16, 32
    ids = torch.randint(3, 17, (rows, width))
    attn = torch.ones_like(ids)
    attn[: rows // 2, :3] = 0
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
    layout = Layout(micro_batch_tokens=rows * width, seq_len=width)
    est = estimate(model.config, layout)["breakdown"]["activations"]
    assert sum(saved.values()) == pytest.approx(est["layers"] + est["head"], rel=0.02)


def test_expert_parallelism_per_device():
    config = resolve_model("tiny_moe")
    psi = estimate(config)["n_params"]
    psi_e = estimate(config)["expert_params"]
    dense = psi - psi_e
    # replicated weights (grad_op): the experts split over the EP group
    for ep in (1, 2, 4):
        r = estimate(config, Layout(world_size=4, sharding="grad_op", ep_size=ep))
        assert r["weights"] == 4 * dense + 4 * psi_e // ep
        assert r["gradients"] == 4 * psi // 4  # sharded over all ranks either way
        assert r["breakdown"]["experts"]["params_per_ep_rank"] == psi_e // ep
    # fully sharded: the states are Ψ / N per device with or without EP; one gathered layer
    # holds fewer experts
    full = [estimate(config, Layout(world_size=4, sharding="full", ep_size=ep)) for ep in (1, 4)]
    assert full[0]["states"] == pytest.approx(full[1]["states"], abs=8)
    assert full[1]["workspace"] < full[0]["workspace"]
    assert full[0]["activations"] == full[1]["activations"]  # an even load assumed


@pytest.mark.parametrize(
    "model,layout,match",
    [
        ("tiny_moe", dict(world_size=4, ep_size=3), "divide world_size 4"),
        ("tiny", dict(world_size=2, ep_size=2), "needs a mixture-of-experts config"),
        (1e9, dict(world_size=2, ep_size=2), "needs a mixture-of-experts config"),
    ],
)
def test_bad_layouts(model, layout, match):
    with pytest.raises(ValueError, match=match):
        estimate(resolve_model(model) if isinstance(model, str) else model, Layout(**layout))


def test_cli_prints_the_experts(capsys):
    assert main(["tiny_moe", "--world-size", "4", "--ep-size", "2", "--sharding", "full"]) == 0
    out = capsys.readouterr().out
    assert "experts 3,145,728 of the params (1,572,864 per EP rank at ep_size 2)" in out
    assert main(["tiny_moe", "--world-size", "4", "--ep-size", "3"]) == 2
