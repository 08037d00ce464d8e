"""The native engine's model as modules (``rollout/decoder.py``, ``rollout/weights.py``): its
weights are exactly the transformers checkpoint's names for every family, the loader names any
weight it lacks or does not know, and the views ``named_weights`` hands out alias the parameters
the forward reads (an in-place update is seen by the next step)."""

import pytest
import torch
from torch import nn
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from hybridrl.rollout import SamplingParams
from hybridrl.rollout.block_manager import BlockManager
from hybridrl.rollout.layers import Linear, mirror_attributes
from hybridrl.rollout.model_runner import ModelRunner
from hybridrl.rollout.sequence import Sequence

torch.set_num_threads(1)
COMMON = dict(
    vocab_size=40,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=40,
    max_position_embeddings=64,
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
FAMILIES = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=16)),
    "llama": (LlamaConfig, LlamaForCausalLM, dict(attention_bias=True, mlp_bias=True)),
    "llama_tied": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=True)),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(**MOE, mlp_only_layers=[0])),
    "qwen2_moe": (
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        dict(**MOE, shared_expert_intermediate_size=24),
    ),
    "mixtral": (MixtralConfig, MixtralForCausalLM, dict(num_local_experts=4)),
}


def hf_model(family, seed=0):
    cfg_cls, cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    m = cls(cfg_cls(**{**COMMON, **extra})).eval()
    with torch.no_grad():  # routers that discriminate, norms and biases that matter
        for name, p in m.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 1.0)
            elif name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return m


def checkpoint(m):
    """The transformers names and tensors of ``m``'s checkpoint (the rotary buffer is not a
    weight)."""
    return {n: t for n, t in m.state_dict().items() if not n.endswith("rotary_emb.inv_freq")}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_model_holds_exactly_the_checkpoint_names_of_each_family(family):
    m = hf_model(family)
    runner = ModelRunner(m.config, block_size=4)  # unloaded
    ckpt = checkpoint(m)
    assert set(runner.named_weights()) == set(ckpt)
    assert runner.load_weights(ckpt.items(), strict=True) == len(ckpt)
    for name, view in runner.named_weights().items():
        assert torch.equal(view, ckpt[name]), name


@pytest.mark.parametrize("family", ["qwen3", "qwen2_moe"])
def test_a_missing_or_unknown_weight_is_named(family):
    m = hf_model(family)
    runner = ModelRunner(m.config, block_size=4)
    ckpt = checkpoint(m)
    dropped = "model.layers.1.self_attn.k_proj.weight"  # one shard of a packed parameter
    with pytest.raises(KeyError, match=f"1 weight.*not loaded.*{dropped}"):
        runner.load_weights([(n, t) for n, t in ckpt.items() if n != dropped], strict=True)
    # the packed parameter's own name is not a transformers name
    for bad in ("model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.extra.weight"):
        with pytest.raises(KeyError, match=f"no weight named '{bad}'"):
            runner.load_weights([(bad, torch.zeros(1))])
    with pytest.raises(ValueError, match="model.norm.weight: shape"):
        runner.load_weights([("model.norm.weight", torch.zeros(3))])


def logits(runner, ids):
    runner.allocate_kv(32)
    bm = BlockManager(32, 4)
    seq = Sequence("s", ids, SamplingParams(), 0)
    bm.allocate(seq)
    return runner.execute([seq], [len(ids)], all_logits=True)


@pytest.mark.parametrize(
    "family,name",
    [
        ("qwen3", "model.layers.1.self_attn.v_proj.weight"),
        ("llama", "model.layers.0.mlp.up_proj.bias"),
        ("llama_tied", "lm_head.weight"),
        ("qwen2_moe", "model.layers.1.mlp.experts.down_proj"),
        ("qwen2_moe", "model.layers.0.mlp.shared_expert.gate_proj.weight"),
    ],
)
def test_an_in_place_update_through_named_weights_is_seen_by_the_next_forward(family, name):
    m = hf_model(family)
    runner = ModelRunner(m.config, block_size=4, hf_model=m)
    ids = [5, 9, 3, 17, 11, 30]
    with torch.no_grad():
        ref = m(torch.tensor([ids])).logits[0]
    assert (logits(runner, ids) - ref).abs().max() < 1e-4
    view = runner.named_weights()[name]
    params = {p.data_ptr() for p in runner.model.parameters()}
    assert any(view.untyped_storage().data_ptr() == p for p in params)  # a view, not a copy
    with torch.no_grad():
        delta = torch.randn(view.shape, generator=torch.Generator().manual_seed(1))
        view.add_(delta)
        m.get_parameter(name).add_(delta)
        ref2 = m(torch.tensor([ids])).logits[0]
    assert (ref2 - ref).abs().max() > 1e-3  # the update matters
    assert (logits(runner, ids) - ref2).abs().max() < 1e-4


def test_a_mirrored_attribute_follows_a_reassigned_parameter():
    lin = Linear(4, 3, bias=False, device="cpu", dtype=torch.float32)
    mirror_attributes(lin)
    assert lin.__dict__["weight"] is lin.weight  # found without nn.Module.__getattr__
    new = nn.Parameter(torch.ones(3, 4), requires_grad=False)
    lin.weight = new  # nn.Module.__setattr__ drops the mirror
    assert lin.weight is new and "weight" not in lin.__dict__
    assert torch.equal(lin(torch.ones(1, 4)), torch.full((1, 3), 4.0))
