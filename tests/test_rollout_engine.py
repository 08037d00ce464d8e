"""Native engine against transformers: logits, greedy tokens, preemption, prefix sharing, RL
controls (in fp32; the engine in bf16: test_rollout_bf16.py)."""

import threading
import time
from types import SimpleNamespace

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from hybridrl.config import RolloutConfig
from hybridrl.protocol import Sample
from hybridrl.rollout import ROLLOUT_BACKENDS, SamplingParams
from hybridrl.rollout.backends.native import NativeRollout
from hybridrl.rollout.block_manager import BlockManager
from hybridrl.rollout.model_runner import ModelRunner
from hybridrl.rollout.sequence import Sequence

torch.set_num_threads(1)
COMMON = dict(
    vocab_size=40,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    max_position_embeddings=128,
)
ARCHS = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=24)),
    "llama": (LlamaConfig, LlamaForCausalLM, dict(attention_bias=True, mlp_bias=True)),
}


# the checks that matter on a GPU also run there (bench/gpu_check.sh selects them with -k cuda)
DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
    ),
]


class Tok:
    eos_token_id, pad_token_id = 2, 0


def model(arch="qwen2", seed=0, **kw):
    cfg_cls, cls, extra = ARCHS[arch]
    torch.manual_seed(seed)
    m = cls(cfg_cls(**{**COMMON, **extra, **kw})).eval()
    with torch.no_grad():  # non-trivial biases and norms, so every weight matters
        for name, p in m.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return m


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 40, (n,), generator=g).tolist() for n in lengths]


def reqs(ps):
    return [Sample(prompt_ids=p, uid=f"u{i}") for i, p in enumerate(ps)]


def rcfg(backend="native", **kw):
    # ``kw``: the backend's options (hf takes only dtype and max_batch_size); fp32 unless a test
    # asks otherwise: the exactness checks compare with transformers' fp32 forward
    native = {"kv_cache_bytes": 4 << 20, "block_size": 4} if backend == "native" else {}
    return RolloutConfig(backend=backend, backend_options={**native, "dtype": "fp32", **kw})


def greedy(n, **kw):
    p = SamplingParams(temperature=0, max_new_tokens=n, **kw)
    p.ignore_eos = True
    return p


@pytest.mark.parametrize("keep", [True, False], ids=["kept-context", "gather-every-step"])
@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("device", DEVICES)
def test_prefill_and_decode_logits_match_transformers(arch, keep, device):
    m = model(arch).to(device)
    runner = ModelRunner(m.config, device=device, block_size=4, hf_model=m, keep_gathered=keep)
    runner.allocate_kv(64)
    bm = BlockManager(64, 4)
    seqs = [Sequence(f"s{i}", p, SamplingParams(), 0) for i, p in enumerate(prompts([7, 12, 1, 5]))]
    for s in seqs:
        bm.allocate(s)
    worst = 0.0
    with torch.no_grad():
        # step 1: prefill three sequences, the 12-token one only in part (chunked)
        qs = [7, 6, 1]
        out = runner.execute(seqs[:3], qs, all_logits=True)
        off = 0
        for s, q in zip(seqs[:3], qs):
            ref = m(torch.tensor([s.token_ids[:q]], device=device)).logits[0]
            worst = max(worst, (out[off : off + q] - ref).abs().max().item())
            s.num_computed = q
            off += q
        # then mixed steps: decodes, the rest of the chunked prompt, a new prefill
        g = torch.Generator().manual_seed(1)
        for step in range(6):
            batch, qs = [], []
            for s in seqs if step else seqs[:3]:
                if s.num_computed == len(s):
                    s.token_ids.append(int(torch.randint(3, 40, (1,), generator=g)))
                    bm.append_slots(s, len(s))
                batch.append(s)
                qs.append(len(s) - s.num_computed)
            last = runner.execute(batch, qs)
            for i, s in enumerate(batch):
                ref = m(torch.tensor([s.token_ids], device=device)).logits[0, -1]
                worst = max(worst, (last[i] - ref).abs().max().item())
                s.num_computed = len(s)
    assert worst <= 1e-4


def hf_greedy(m, prompt, n):
    out = m.generate(
        torch.tensor([prompt], device=m.device), max_new_tokens=n, do_sample=False, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
@pytest.mark.parametrize("device", DEVICES)
def test_greedy_generation_matches_transformers(arch, device):
    m = model(arch).to(device)
    ps = prompts([3, 9, 14, 6])
    samples = NativeRollout(m, Tok(), rcfg()).generate(reqs(ps), greedy(20))
    for p, s in zip(ps, samples):
        assert s.response_ids == hf_greedy(m, p, 20)
        assert s.status == "truncated" and s.versions == [0] * 20


def test_tiny_pool_preempts_and_gives_the_same_tokens():
    m = model()
    ps = prompts([5, 8, 3, 11, 7, 6])
    big = NativeRollout(m, Tok(), rcfg()).generate(reqs(ps), greedy(24))
    eng = NativeRollout(m, Tok(), rcfg(), num_blocks=14)  # 14 blocks x 4 tokens for 6 x ~33 tokens
    small = eng.generate(reqs(ps), greedy(24))
    assert eng.stats()["engine/preemptions"] > 0
    assert [s.response_ids for s in small] == [s.response_ids for s in big]


def test_a_request_the_pool_can_never_hold_fails_when_added():
    m = model()
    per_block = ModelRunner(m.config, block_size=4, hf_model=m).bytes_per_block()
    eng = NativeRollout(m, Tok(), rcfg(kv_cache_bytes=8 * per_block))  # 8 blocks: 32 KV slots
    assert eng.engine.num_blocks == 8
    ps = prompts([5, 10, 9])
    # 10 + 24 tokens: 33 KV slots (the last token is never written), 9 blocks
    with pytest.raises(ValueError) as err:
        eng.generate(reqs(ps), greedy(24))
    msg = str(err.value)
    assert "\n" not in msg
    for part in (
        "request 'u1'",
        "10-token prompt",
        "max_new_tokens 24",
        "needs 9 blocks",
        "8 blocks of 4 tokens",
        "rollout.backend_options.kv_cache_bytes",
        "kv_cache_memory_fraction on CUDA",
        "a shorter rollout.max_new_tokens",
        "shorter prompts",
    ):
        assert part in msg
    # raised before any step, and no prompt of the call was queued
    assert eng.stats()["engine/steps"] == 0 and not eng.engine.has_unfinished()
    with pytest.raises(ValueError, match="request 'x'.*needs 9 blocks"):
        eng.engine.add_request("x", ps[1], greedy(24))
    assert not eng.engine.has_unfinished()
    # a group of 8 samples reserves the prompt's 3 blocks plus one per forked sample at admission
    with pytest.raises(ValueError, match="group of 8 samples reserves 10"):
        eng.engine.add_request("g", ps[1], SamplingParams(max_new_tokens=2, n=8))
    # those that fit (the 9-token prompt fills the pool exactly) still generate, the same tokens as
    # a large pool's, a group sharing its prompt by preemption
    good = reqs([ps[0], ps[2]])
    out = eng.generate(good, greedy(24))
    big = NativeRollout(m, Tok(), rcfg()).generate(good, greedy(24))
    assert [s.response_ids for s in out] == [s.response_ids for s in big]
    assert all(len(s.response_ids) == 24 for s in out)
    group = eng.generate(reqs([ps[0]]), SamplingParams(max_new_tokens=24, n=4, seed=1))
    assert len(group) == 4 and all(s.response_ids for s in group)


def test_n_samples_share_the_prompt_prefill():
    m = model()
    eng = NativeRollout(m, Tok(), rcfg())
    ps = prompts([6, 10, 13])
    p = SamplingParams(temperature=1.0, max_new_tokens=8, n=8, seed=0)
    out = eng.generate(reqs(ps), p)
    st = eng.stats()
    assert len(out) == 24 and [s.uid for s in out] == [f"u{i}" for i in range(3) for _ in range(8)]
    assert st["engine/prompt_tokens"] == 8 * sum(map(len, ps))
    assert st["engine/prompt_tokens_computed"] == sum(map(len, ps))  # G-fold reduction
    assert len({tuple(s.response_ids) for s in out[:8]}) > 1  # the samples differ


def test_log_probs_are_the_tempered_sampling_distribution():
    m = model()
    eng = ROLLOUT_BACKENDS.get("native")(m, Tok(), rcfg())
    p = SamplingParams(temperature=0.7, max_new_tokens=6, n=2, seed=3)
    p.return_raw_log_probs = True
    for s in eng.generate(reqs(prompts([5, 7])), p):
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        logits = m(ids).logits[0, len(s.prompt_ids) - 1 : -1]
        tok = torch.tensor(s.response_ids)[:, None]
        want = torch.log_softmax(logits / 0.7, -1).gather(1, tok).squeeze(1)
        raw = torch.log_softmax(logits, -1).gather(1, tok).squeeze(1)
        assert torch.allclose(torch.tensor(s.log_probs), want, atol=1e-4)
        assert torch.allclose(torch.tensor(s.metadata["raw_log_probs"]), raw, atol=1e-4)


def test_seeded_generation_is_reproducible():
    m = model()
    p = SamplingParams(temperature=1.0, max_new_tokens=10, n=3, seed=7)
    a = NativeRollout(m, Tok(), rcfg()).generate(reqs(prompts([4, 9])), p)
    b = NativeRollout(m, Tok(), rcfg(max_num_batched_tokens=5)).generate(reqs(prompts([4, 9])), p)
    assert [s.response_ids for s in a] == [s.response_ids for s in b]


def test_update_weights_changes_logits_and_invalidates_prefix_cache():
    old, new = model(seed=0), model(seed=1)
    eng = NativeRollout(old, Tok(), rcfg())
    ps = prompts([9, 13])  # full blocks get cached
    eng.generate(reqs(ps), greedy(4))
    eng.stats()
    eng.update_weights(iter(new.state_dict().items()), version=3)
    out = eng.generate(reqs(ps), greedy(12))
    st = eng.stats()
    assert st["engine/prompt_tokens_computed"] == sum(map(len, ps))  # nothing stale served
    for p, s in zip(ps, out):
        assert s.response_ids == hf_greedy(new, p, 12) and s.versions == [3] * 12
    runner = eng.engine.runner
    s = Sequence("x", ps[0], SamplingParams(), 0)
    eng.engine.bm.allocate(s)
    q = (
        len(s) - s.num_computed
    )  # full blocks come from the prefix cache, filled under the new weights
    with torch.no_grad():
        got = runner.execute([s], [q], all_logits=True)
        assert (got - new(torch.tensor([ps[0]])).logits[0, -q:]).abs().max() <= 1e-4
    eng.engine.bm.deallocate(s)


def step_gate(eng, after_tokens):
    """Hold the generating thread once the engine has produced ``after_tokens`` tokens,
    until ``go`` is set, so the test's control call lands mid-generation however the OS
    schedules the two threads."""
    gate = SimpleNamespace(reached=threading.Event(), go=threading.Event())
    inner = eng.engine.step

    def step():
        n = inner()
        if eng.engine.stats_acc["tokens"] >= after_tokens and not gate.reached.is_set():
            gate.reached.set()
            assert gate.go.wait(30)
        return n

    eng.engine.step = step
    return gate


def test_pause_update_resume_stamps_versions():
    m, new = model(seed=0), model(seed=1)
    eng = NativeRollout(m, Tok(), rcfg())
    result = {}
    t = threading.Thread(
        target=lambda: result.setdefault("out", eng.generate(reqs(prompts([4, 6])), greedy(100)))
    )
    gate = step_gate(eng, after_tokens=10)
    t.start()
    assert gate.reached.wait(30)
    eng.pause()
    gate.go.set()
    frozen = eng.engine.stats_acc["tokens"]
    time.sleep(0.05)
    assert eng.engine.stats_acc["tokens"] == frozen  # a paused engine does not step
    eng.update_weights(iter(new.state_dict().items()), version=1)
    eng.resume()
    t.join(30)
    for s in result["out"]:
        assert len(s.response_ids) == 100 and s.status == "truncated"
        assert s.versions == sorted(s.versions) and s.versions[0] == 0 and s.versions[-1] == 1


def test_abort_from_another_thread_and_before_start():
    m = model()
    eng = NativeRollout(m, Tok(), rcfg())
    eng.abort(["u1"])
    result = {}
    t = threading.Thread(
        target=lambda: result.setdefault("out", eng.generate(reqs(prompts([4, 5, 6])), greedy(110)))
    )
    gate = step_gate(eng, after_tokens=10)
    t.start()
    assert gate.reached.wait(30)
    eng.abort(["u2"])
    gate.go.set()
    t.join(30)
    out = result["out"]
    assert [s.status for s in out] == ["truncated", "aborted", "aborted"]
    assert out[1].response_ids == [] and 0 < len(out[2].response_ids) < 110
    assert eng.engine.bm.num_free == eng.engine.num_blocks


def test_release_memory_and_wake_up():
    m = model()
    eng = NativeRollout(m, Tok(), rcfg())
    ps = prompts([5, 9])
    a = eng.generate(reqs(ps), greedy(8))
    eng.release_memory()
    assert eng.engine.runner.k_cache is None
    eng.wake_up()
    b = eng.generate(reqs(ps), greedy(8))
    assert [s.response_ids for s in a] == [s.response_ids for s in b]


def test_stop_token_ids_and_max_tokens():
    m = model()
    eng = NativeRollout(m, Tok(), rcfg())
    ps = prompts([5])
    free = eng.generate(reqs(ps), greedy(12))[0].response_ids
    stop = free[4]
    out = eng.generate(
        reqs(ps), SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=(stop,))
    )[0]
    assert out.response_ids == free[: free.index(stop) + 1] and out.status == "finished"


def test_stop_strings_with_a_real_tokenizer():
    from hybridrl.models.factory import build_model
    from hybridrl.tasks.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    m = build_model("tiny", tok, 0)
    eng = NativeRollout(m, tok, rcfg())
    p = SamplingParams(temperature=1.0, max_new_tokens=30, seed=0, n=8)
    p.stop, p.ignore_eos = ["7"], True
    for s in eng.generate(reqs([[tok.bos_token_id, 3, 4, 13, 5, 15]]), p):
        text = tok.decode(s.response_ids)
        assert (s.status == "finished" and text.endswith("7") and "7" not in text[:-1]) or (
            s.status == "truncated" and "7" not in text
        )


def test_kept_context_survives_leaving_and_reordered_sequences():
    m = model()
    runner = ModelRunner(m.config, block_size=4, hf_model=m)
    runner.allocate_kv(128)
    bm = BlockManager(128, 4)
    seqs = [
        Sequence(f"s{i}", p, SamplingParams(), 0) for i, p in enumerate(prompts([5, 9, 3, 7, 6]))
    ]
    for s in seqs:
        bm.allocate(s)
    runner.execute(seqs, [len(s) for s in seqs])
    for s in seqs:
        s.num_computed = len(s)
    g = torch.Generator().manual_seed(2)
    live, worst, reused = list(seqs), 0.0, 0
    with torch.no_grad():
        for step in range(12):
            if step in (3, 6):
                live.pop(1)  # a sequence leaves the batch: its row becomes a masked hole
            if step == 8:
                live = live[::-1]
            for s in live:
                s.token_ids.append(int(torch.randint(3, 40, (1,), generator=g)))
                bm.append_slots(s, len(s))
            x = runner.prepare(live, [1] * len(live))
            reused += x.reuse
            out = runner.forward(x)
            for i, s in enumerate(live):
                worst = max(
                    worst,
                    (out[i] - m(torch.tensor([s.token_ids])).logits[0, -1]).abs().max().item(),
                )
                s.num_computed = len(s)
    assert reused >= 6 and worst <= 1e-4


def test_lora_adapter_sync_merges_into_the_fused_weights():
    m = model()
    eng = NativeRollout(m, Tok(), rcfg())
    ps = prompts([6, 9])
    mod = "model.layers.0.self_attn.k_proj"
    w0 = m.state_dict()[mod + ".weight"].clone()
    g = torch.Generator().manual_seed(3)
    for version in (1, 2):  # the second sync replaces the first adapter, it does not add to it
        a, b = torch.randn(4, w0.shape[1], generator=g), torch.randn(w0.shape[0], 4, generator=g)
        eng.update_weights(
            iter(
                [
                    (mod + ".lora_A", a),
                    (mod + ".lora_B", b),
                    (mod + ".lora_scaling", torch.tensor(0.5)),
                ]
            ),
            version,
        )
        with torch.no_grad():
            m.state_dict()[mod + ".weight"].copy_(w0 + 0.5 * b @ a)
        out = eng.generate(reqs(ps), greedy(10))
        assert [s.response_ids for s in out] == [hf_greedy(m, p, 10) for p in ps]


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_weights_load_from_a_safetensors_checkpoint(arch, tmp_path):
    m = model(arch)
    m.save_pretrained(tmp_path)
    runner = ModelRunner(
        m.config, block_size=4
    )  # no live model: weights by name from the checkpoint files
    assert runner.load_safetensors(str(tmp_path)) > 0
    runner.allocate_kv(16)
    bm = BlockManager(16, 4)
    s = Sequence("x", prompts([11])[0], SamplingParams(), 0)
    bm.allocate(s)
    with torch.no_grad():
        got = runner.execute([s], [len(s)], all_logits=True)
        assert (got - m(torch.tensor([s.token_ids])).logits[0]).abs().max() <= 1e-4
