"""The native engine on mixture-of-experts models (Qwen3-MoE, Qwen2-MoE with its shared expert,
Mixtral) against transformers: logits, greedy tokens, the recorded routing (also through the prefix
cache, forks and preemption), the format the hf backend gives, the expert bias of weight sync, and
two GRPO steps with R3 replay on the routing the native engine recorded."""

import json
from pathlib import Path

import pytest
import torch
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from hybridrl.config import RolloutConfig
from hybridrl.moe.routing import NOT_ROUTED, ROUTING_DTYPE, record
from hybridrl.protocol import Sample
from hybridrl.rollout import SamplingParams
from hybridrl.rollout.backends.hf import HFRollout
from hybridrl.rollout.backends.native import NativeRollout
from hybridrl.rollout.block_manager import BlockManager
from hybridrl.rollout.model_runner import ModelRunner
from hybridrl.rollout.sequence import Sequence

torch.set_num_threads(1)
COMMON = dict(
    vocab_size=40,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    num_experts_per_tok=2,
)
ARCHS = {
    # layer 0 dense (mlp_only_layers): a mixed stack, routing of the MoE layers only
    "qwen3_moe": (
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        dict(
            head_dim=16,
            num_experts=6,
            moe_intermediate_size=24,
            intermediate_size=40,
            norm_topk_prob=True,
            mlp_only_layers=[0],
        ),
    ),
    "qwen2_moe": (
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        dict(
            num_experts=6,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=36,
            intermediate_size=40,
        ),
    ),
    "mixtral": (MixtralConfig, MixtralForCausalLM, dict(num_local_experts=5, intermediate_size=24)),
}


class Tok:
    eos_token_id, pad_token_id = 2, 0


def model(arch, seed=0):
    cfg_cls, cls, extra = ARCHS[arch]
    torch.manual_seed(seed)
    m = cls(cfg_cls(**{**COMMON, **extra})).eval()
    with torch.no_grad():  # routers that discriminate, biases and norms that matter
        for name, p in m.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 1.0)
            elif name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return m


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 40, (n,), generator=g).tolist() for n in lengths]


def reqs(ps):
    return [Sample(prompt_ids=p, uid=f"u{i}") for i, p in enumerate(ps)]


def rcfg(backend="native", **kw):
    # (``kw``: the backend's options; hf takes only dtype and max_batch_size)
    native = {"kv_cache_bytes": 4 << 20, "block_size": 4} if backend == "native" else {}
    return RolloutConfig(backend=backend, backend_options={**native, "dtype": "fp32", **kw})


def greedy(n):
    p = SamplingParams(temperature=0, max_new_tokens=n)
    p.ignore_eos = True
    return p


def hf_routing(m, ids):
    """transformers' top-k ids (tokens, MoE layers, k) over one full forward of ``ids``."""
    with torch.no_grad(), record(m) as rec:
        m(torch.tensor([ids]))
    return rec.forwards()[0]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_prefill_and_decode_logits_and_routing_match_transformers(arch):
    m = model(arch)
    runner = ModelRunner(m.config, block_size=4, hf_model=m)
    runner.allocate_kv(64)
    bm = BlockManager(64, 4)
    seqs = [Sequence(f"s{i}", p, SamplingParams(), 0) for i, p in enumerate(prompts([7, 12, 5]))]
    for s in seqs:
        bm.allocate(s)
    worst = 0.0
    with torch.no_grad():
        qs = [7, 6, 5]  # the 12-token prompt in two chunks
        out = runner.execute(seqs, qs, all_logits=True)
        off = 0
        for s, q in zip(seqs, qs):
            ref = m(torch.tensor([s.token_ids[:q]])).logits[0]
            worst = max(worst, (out[off : off + q] - ref).abs().max().item())
            s.num_computed = q
            off += q
        g = torch.Generator().manual_seed(1)
        for _ in range(5):  # decodes, with the rest of the chunked prompt in the first
            qs = []
            for s in seqs:
                if s.num_computed == len(s):
                    s.token_ids.append(int(torch.randint(3, 40, (1,), generator=g)))
                    bm.append_slots(s, len(s))
                qs.append(len(s) - s.num_computed)
            last = runner.execute(seqs, qs)
            for i, s in enumerate(seqs):
                ref = m(torch.tensor([s.token_ids])).logits[0, -1]
                worst = max(worst, (last[i] - ref).abs().max().item())
                s.num_computed = len(s)
    assert worst <= 1e-4
    for s in seqs:
        got = runner.read_routing(s.block_table, len(s))
        assert got.dtype == ROUTING_DTYPE and (got >= 0).all()
        assert torch.equal(got, hf_routing(m, s.token_ids))


def check_routing(m, samples):
    for s in samples:
        full = s.prompt_ids + s.response_ids
        assert s.routing.shape[0] == len(full)
        assert (s.routing[-1] == NOT_ROUTED).all()  # the last token is never fed
        assert torch.equal(s.routing[:-1], hf_routing(m, full[:-1]))


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_tokens_and_routing_match_transformers(arch):
    m = model(arch)
    ps = prompts([3, 9, 14, 6])
    samples = NativeRollout(m, Tok(), rcfg()).generate(reqs(ps), greedy(12))
    for p, s in zip(ps, samples):
        ref = m.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, pad_token_id=0)
        assert s.response_ids == ref[0, len(p) :].tolist()
    check_routing(m, samples)


def test_routing_through_prefix_cache_forks_and_preemption():
    m = model("qwen2_moe")
    shared = prompts([10])[0]
    ps = [shared + [5], shared + [7, 8], shared]
    params = SamplingParams(temperature=1.0, max_new_tokens=16, n=3, seed=3)
    eng = NativeRollout(m, Tok(), rcfg(), num_blocks=24)  # too few blocks for 9 x ~27 tokens
    first = eng.generate(reqs(ps[:1]), params)  # its blocks enter the prefix cache
    rest = eng.generate([Sample(prompt_ids=p, uid=f"v{i}") for i, p in enumerate(ps)], params)
    stats = eng.stats()
    assert stats["engine/prefix_hit_rate"] > 0 and stats["engine/preemptions"] > 0
    check_routing(m, first + rest)


def test_a_fork_without_a_free_block_keeps_its_prompt_routing():
    """A sample forked when no block is free for its copy waits to be recomputed; with one new token
    it finishes before it ever runs, and its prompt's routing comes from its parent."""
    m = model("qwen3_moe")
    eng = NativeRollout(m, Tok(), rcfg())
    engine, real = eng.engine, eng.engine.runner.execute

    def execute_then_fill_the_pool(seqs, qs, all_logits=False):
        out = real(seqs, qs, all_logits)
        hog = Sequence("hog", [3] * (engine.bm.num_free * engine.bm.block_size), greedy(1), 0)
        engine.bm.allocate(hog)  # memory pressure: no block left for the forks' copies
        return out

    engine.runner.execute = execute_then_fill_the_pool
    params = greedy(1)
    params.n = 3
    out = eng.generate(reqs(prompts([6])), params)  # 6 tokens: a partial block to copy per fork
    assert len(out) == 3
    check_routing(m, out)


def test_speculative_decoding_keeps_tokens_and_routing():
    """Verification forwards write the routing of draft tokens that may be rejected; the rows that
    remain are those of the tokens finally fed."""
    target, draft = model("qwen3_moe"), model("mixtral", seed=1)
    ps = prompts([5, 9, 3])
    plain = NativeRollout(target, Tok(), rcfg()).generate(reqs(ps), greedy(14))
    eng = NativeRollout(target, Tok(), rcfg(num_speculative_tokens=3), draft_model=draft)
    spec = eng.engine.speculative
    spec.choose_k = lambda batch_size: spec.max_k  # speculate on every eligible step
    out = eng.generate(reqs(ps), greedy(14))
    st = eng.stats()
    assert st["engine/spec_steps"] > 0 and st["engine/spec_acceptance"] < 1
    assert [s.response_ids for s in out] == [s.response_ids for s in plain]
    check_routing(target, out)


def test_routing_has_the_hf_backend_format():
    m = model("qwen3_moe")
    p = [Sample(prompt_ids=prompts([8])[0], uid="a")]
    native = NativeRollout(m, Tok(), rcfg()).generate(p, greedy(6))[0]
    hf = HFRollout(m, Tok(), rcfg(backend="hf")).generate(p, greedy(6))[0]
    assert native.response_ids == hf.response_ids
    assert native.routing.dtype == hf.routing.dtype
    assert torch.equal(native.routing, hf.routing)


def test_synced_expert_bias_steers_the_selection():
    m = model("mixtral")
    eng = NativeRollout(m, Tok(), rcfg())
    sd = m.state_dict()
    bias = torch.zeros(5)
    bias[3] = 10.0  # expert 3 wins every selection
    names = [f"model.layers.{i}.mlp.gate.expert_bias" for i in range(3)]
    eng.update_weights(list(sd.items()) + [(n, bias) for n in names], version=1)
    s = eng.generate(reqs(prompts([6])), greedy(4))[0]
    assert ((s.routing[:-1] == 3).any(-1)).all()
    eng.update_weights(sd.items(), version=2)  # a later sync without the bias keeps the loaded one
    assert ((eng.generate(reqs(prompts([6])), greedy(4))[0].routing[:-1] == 3).any(-1)).all()


def test_bf16_engine_records_routing_that_mostly_agrees_with_fp32():
    m = model("qwen2_moe")
    ps = reqs(prompts([7, 12]))
    fp32 = NativeRollout(m, Tok(), rcfg()).generate(ps, greedy(8))
    bf16 = NativeRollout(m, Tok(), rcfg(dtype="bf16")).generate(ps, greedy(8))
    for a, b in zip(fp32, bf16):
        assert b.routing.dtype == ROUTING_DTYPE and b.routing.shape == a.routing.shape
        prompt = len(a.prompt_ids)  # same tokens: the routing differs only where bf16 rounds
        same = (a.routing[:prompt].sort(-1).values == b.routing[:prompt].sort(-1).values).all(-1)
        assert same.float().mean() > 0.8


def test_grpo_with_r3_on_the_native_engine(tmp_path):
    import hybridrl

    root = Path(__file__).resolve().parents[1]
    summary = hybridrl.train(
        root / "examples" / "arith_grpo_moe.yaml",
        overrides=[
            "rollout.backend=native",
            "moe.routing_replay=r3",
            "sft.steps=3",
            "sft.batch_size=16",
            "trainer.total_steps=2",
            "trainer.prompts_per_step=4",
            "trainer.samples_per_prompt=4",
            "actor.ppo_minibatch_size=16",
            "task.eval_size=8",
            "trainer.eval_every=0",
            "trainer.progress=false",
            "trainer.loggers=[jsonl]",
            "controller.num_threads=1",
            f"sft.checkpoint={tmp_path / 'ws'}",
            f"trainer.runs_dir={tmp_path / 'runs'}",
            "trainer.name=native_moe",
        ],
    )
    assert summary["steps"] == 2
    lines = [json.loads(x) for x in (tmp_path / "runs" / "native_moe" / "metrics.jsonl").open()]
    steps = [x for x in lines if "moe/max_mean" in x]
    assert len(steps) == 2
    # the trainer replays what the native engine recorded: its forward routes like the rollout
    assert all(x["moe/routing_changed_vs_rollout"] < 0.05 for x in steps)
