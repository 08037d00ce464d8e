"""vllm / sglang adapters.

Here (no CUDA, neither package installed): lazy registration, the error for a missing package, and
the translation logic against small stand-ins for the two third-party packages put into
``sys.modules``. The stand-ins decode with a real transformers model loaded from the directory the
adapter saved, so tokens, log-probs and weight updates are checked against transformers. The test
at the end runs only where SGLang is installed; the real vLLM is tested in test_vllm_engine.py.
"""

import sys
import types

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from hybridrl.config import RolloutConfig
from hybridrl.protocol import Sample
from hybridrl.rollout import ROLLOUT_BACKENDS, SamplingParams
from hybridrl.rollout.base import WeightSyncError
from hybridrl.rollout.sequence import request_seed

torch.set_num_threads(1)
EOS = 2
BACKENDS = ["vllm", "sglang"]


def tiny(seed=0):
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=40,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        eos_token_id=EOS,
        tie_word_embeddings=True,
        initializer_range=0.5,
    )  # large weights: outputs that depend on them
    return Qwen2ForCausalLM(cfg).eval()


# --- stand-ins for the third-party packages -------------------------------------------------------
class Core:
    """A transformers model loaded from the adapter's directory, decoding
    without a cache, recording calls."""

    def __init__(self, path, kwargs):
        self.kwargs, self.calls = kwargs, []
        self.model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()

    @torch.no_grad()
    def decode(self, prompt, temperature, max_tokens, seed, stop_ids, ignore_eos):
        g = torch.Generator().manual_seed(seed if seed is not None else 1234)
        ids, out, logps = list(prompt), [], []
        for _ in range(max_tokens):
            logits = self.model(torch.tensor([ids])).logits[0, -1].float()
            if temperature == 0:
                tok, lp = int(logits.argmax()), torch.log_softmax(logits, -1)
            else:
                lp = torch.log_softmax(logits / temperature, -1)
                tok = int(torch.multinomial(lp.exp(), 1, generator=g))
            ids.append(tok), out.append(tok), logps.append(float(lp[tok]))
            if tok in (stop_ids or []) or (tok == EOS and not ignore_eos):
                return out, logps, "stop"
        return out, logps, "length"

    def load(self, named):
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, t in named:
                if name in params:
                    params[name].copy_(t)
        self.calls.append(("load", len(named)))


def fake_vllm():
    mod = types.ModuleType("vllm")

    class SamplingParams:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    class LLM:
        def __init__(self, model, **kwargs):
            self.core = Core(model, kwargs)
            self.model = types.SimpleNamespace(load_weights=lambda it: self.core.load(list(it)))
            shutdown = types.SimpleNamespace(shutdown=lambda: self.core.calls.append(("shutdown",)))
            self.llm_engine = types.SimpleNamespace(engine_core=shutdown)

        def generate(self, prompts, sampling_params, use_tqdm=True):
            outs = []
            for p, sp in zip(prompts, sampling_params):
                comps = []
                for j in range(sp.n):  # child seeds as vLLM derives them
                    ids, lps, reason = self.core.decode(
                        p["prompt_token_ids"],
                        sp.temperature,
                        sp.max_tokens,
                        None if sp.seed is None else sp.seed + j,
                        sp.stop_token_ids,
                        sp.ignore_eos,
                    )
                    comps.append(
                        types.SimpleNamespace(
                            index=j,
                            token_ids=ids,
                            finish_reason=reason,
                            logprobs=[
                                {t: types.SimpleNamespace(logprob=x)} for t, x in zip(ids, lps)
                            ],
                        )
                    )
                outs.append(
                    types.SimpleNamespace(outputs=comps[::-1])
                )  # any order: the adapter sorts by index
            return outs

        def apply_model(self, func):
            return [func(self.model)]

        def reset_prefix_cache(self):
            self.core.calls.append(("reset",))

        def sleep(self, level=1):
            self.core.calls.append(("sleep", level))

        def wake_up(self, tags=None):
            self.core.calls.append(("wake_up",))

    mod.LLM, mod.SamplingParams = LLM, SamplingParams
    # a CUDA platform: sleep mode on (the real CPU build is tested in test_vllm_engine.py)
    platform = types.SimpleNamespace(is_sleep_mode_available=lambda: True, is_cpu=lambda: False)
    mod.platforms = types.ModuleType("vllm.platforms")
    mod.platforms.current_platform = platform
    return mod


def fake_sglang():
    mod = types.ModuleType("sglang")

    class Engine:
        def __init__(self, model_path, **kwargs):
            self.core = Core(model_path, kwargs)

        def generate(self, input_ids, sampling_params, return_logprob=False):
            outs = []
            for p, sp in zip(input_ids, sampling_params):
                ids, lps, reason = self.core.decode(
                    p,
                    sp["temperature"],
                    sp["max_new_tokens"],
                    sp.get("sampling_seed"),
                    sp["stop_token_ids"],
                    sp["ignore_eos"],
                )
                meta = {
                    "finish_reason": {"type": reason},
                    "output_token_logprobs": [(x, t, None) for t, x in zip(ids, lps)],
                }
                outs.append({"output_ids": ids, "meta_info": meta})
            return outs

        def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
            self.core.load(list(named_tensors))

        def flush_cache(self):
            self.core.calls.append(("reset",))

        def release_memory_occupation(self):
            self.core.calls.append(("sleep", 1))

        def resume_memory_occupation(self):
            self.core.calls.append(("wake_up",))

        def shutdown(self):
            pass

    mod.Engine = Engine
    return mod


@pytest.fixture
def make(monkeypatch):
    def build(name, model, **options):
        mod = {"vllm": fake_vllm, "sglang": fake_sglang}[name]()
        monkeypatch.setitem(sys.modules, name, mod)
        if name == "vllm":
            monkeypatch.setitem(sys.modules, "vllm.platforms", mod.platforms)
        eng = ROLLOUT_BACKENDS.get(name)(
            model, None, RolloutConfig(backend=name, backend_options=options)
        )
        return eng, eng.engine.core

    return build


def reqs(k=2):
    return [Sample(prompt_ids=[1, 5 + i, 7, 9], uid=f"u{i}", task_id="t") for i in range(k)]


@torch.no_grad()
def ref_logps(model, prompt, resp, temperature):
    logits = model(torch.tensor([prompt + resp])).logits[0, len(prompt) - 1 : -1].float()
    return (
        torch.log_softmax(logits / (temperature or 1.0), -1)
        .gather(-1, torch.tensor(resp)[:, None])
        .squeeze(-1)
    )


# --- here -----------------------------------------------------------------------------------------
def test_importing_hybridrl_imports_neither_engine():
    import hybridrl.rollout.worker  # noqa: F401

    assert {"vllm", "sglang"} <= set(ROLLOUT_BACKENDS.names())
    assert "vllm" not in sys.modules and "sglang" not in sys.modules


@pytest.mark.parametrize("name", BACKENDS)
def test_missing_package_says_what_to_install(monkeypatch, name):
    monkeypatch.setitem(sys.modules, name, None)  # as if not installed, even where it is
    with pytest.raises(ImportError, match=rf"pip install .*{name}.*usable here: hf, native"):
        ROLLOUT_BACKENDS.get(name)(tiny(), None, RolloutConfig(backend=name))


def test_sampling_params_translation(make):
    eng, core = make(
        "vllm",
        tiny(),
        gpu_memory_utilization=0.3,
        tensor_parallel_size=2,
        engine_kwargs={"dtype": "bfloat16"},
    )
    assert core.kwargs["gpu_memory_utilization"] == 0.3 and core.kwargs["tensor_parallel_size"] == 2
    assert (
        core.kwargs["dtype"] == "bfloat16" and core.kwargs["logprobs_mode"] == "processed_logprobs"
    )
    assert core.kwargs["enable_sleep_mode"] and core.kwargs["skip_tokenizer_init"]
    sp = eng.sampling_params(
        SamplingParams(
            temperature=0.7, top_p=0.9, max_new_tokens=5, n=4, stop_token_ids=(3,), min_p=0.1
        ),
        11,
    )
    assert (sp.n, sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.max_tokens, sp.seed) == (
        4,
        0.7,
        0.9,
        -1,
        0.1,
        5,
        11,
    )
    assert (sp.stop_token_ids, sp.stop, sp.logprobs, sp.detokenize, sp.ignore_eos) == (
        [3],
        None,
        0,
        False,
        False,
    )
    sg, core = make("sglang", tiny(), enable_prefix_caching=False)
    assert (
        core.kwargs["disable_radix_cache"]
        and core.kwargs["enable_memory_saver"]
        and core.kwargs["dtype"] == "float32"
    )
    d = sg.sampling_params(SamplingParams(top_k=5, stop=("x",), ignore_eos=True), 9)
    assert d == dict(
        max_new_tokens=16,
        temperature=1.0,
        top_p=1.0,
        top_k=5,
        min_p=0.0,
        ignore_eos=True,
        stop=["x"],
        stop_token_ids=None,
        sampling_seed=9,
    )
    assert "sampling_seed" not in sg.sampling_params(SamplingParams(), None)


@pytest.mark.parametrize("name", BACKENDS)
def test_generate_returns_samples_with_behaviour_log_probs(make, name):
    m = tiny()
    eng, _ = make(name, m)
    rs = reqs(3)
    greedy = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    first = eng.generate(rs[:1], greedy)[0]
    expect = m.generate(
        torch.tensor([rs[0].prompt_ids]),
        max_new_tokens=6,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    assert first.response_ids == expect[0, 4:].tolist() and first.status == "truncated"
    stop = first.response_ids[
        2
    ]  # a stop token the greedy path meets at its third token (or earlier)
    eng.abort(["u1"])
    eng.version = 3
    params = SamplingParams(temperature=0.8, max_new_tokens=6, n=2, seed=5, stop_token_ids=(stop,))
    out = eng.generate(rs, params)
    assert [s.uid for s in out] == ["u0", "u0", "u1", "u1", "u2", "u2"]
    assert [s.status for s in out[2:4]] == ["aborted"] * 2 and out[2].response_ids == []
    for s in out[:2] + out[4:]:
        assert len(s.response_ids) == len(s.log_probs) == len(s.versions) > 0 and set(
            s.versions
        ) == {3}
        assert s.status == ("finished" if s.response_ids[-1] in (stop, EOS) else "truncated")
        assert s.task_id == "t" and s.prompt_ids == rs[int(s.uid[1])].prompt_ids
        torch.testing.assert_close(
            torch.tensor(s.log_probs),
            ref_logps(m, s.prompt_ids, s.response_ids, 0.8),
            atol=1e-5,
            rtol=0,
        )
    again = eng.generate(rs, params)  # seeds are derived per request (and per sample): reproducible
    assert [s.response_ids for s in again] == [s.response_ids for s in out]
    assert eng.stats()["engine/tokens_per_s"] > 0


@pytest.mark.parametrize("name", BACKENDS)
def test_update_weights_streams_buckets_then_resets_the_prefix_cache(make, name):
    old, new = tiny(0), tiny(1)
    eng, core = make(name, old)
    eng.bucket_bytes = 40 * 32 * 4  # about one embedding matrix per bucket
    greedy = SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True)
    before = eng.generate(reqs(1), greedy)[0].response_ids
    state = list(new.state_dict().items())
    assert eng.update_weights(iter(state), version=7) == len(state)
    loads = [c for c in core.calls if c[0] == "load"]
    assert len(loads) > 3 and sum(c[1] for c in loads) == len(
        state
    )  # several buckets, every tensor once
    assert (
        core.calls[-1] == ("reset",) and core.calls.count(("reset",)) == 1
    )  # once, after the last bucket
    after = eng.generate(reqs(1), greedy)[0]
    expect = new.generate(
        torch.tensor([reqs(1)[0].prompt_ids]),
        max_new_tokens=5,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    assert after.response_ids == expect[0, 4:].tolist() != before and after.versions == [7] * 5
    assert torch.equal(
        old.model.embed_tokens.weight, new.model.embed_tokens.weight
    )  # the host mirror follows
    assert eng.stats()["engine/weight_sync_s"] > 0


@pytest.mark.parametrize("name", BACKENDS)
def test_lora_sync_merges_into_the_engine_without_accumulating(make, name):
    m = tiny()
    eng, core = make(name, m)
    w = "model.layers.0.self_attn.q_proj.weight"
    base = m.get_parameter(w).detach().clone()
    mod = w[: -len(".weight")]
    for v, seed in [(1, 0), (2, 1)]:
        g = torch.Generator().manual_seed(seed)
        a, b = torch.randn(4, 32, generator=g), torch.randn(32, 4, generator=g)
        eng.update_weights(
            iter(
                [
                    (mod + ".lora_A", a),
                    (mod + ".lora_B", b),
                    (mod + ".lora_scaling", torch.tensor(0.5)),
                ]
            ),
            v,
        )
        torch.testing.assert_close(core.model.get_parameter(w), base + 0.5 * b @ a)
    new_base = torch.randn_like(base)  # a full weight in the same sync becomes the new base
    full = [
        (n, new_base if n == w else t) for n, t in tiny().named_parameters()
    ]  # the base sync carries every weight
    eng.update_weights(
        iter(
            full
            + [
                (mod + ".lora_A", a),
                (mod + ".lora_B", b),
                (mod + ".lora_scaling", torch.tensor(0.5)),
            ]
        ),
        3,
    )
    torch.testing.assert_close(core.model.get_parameter(w), new_base + 0.5 * b @ a)


@pytest.mark.parametrize("name", BACKENDS)
def test_requests_are_seeded_by_their_id_not_their_position(make, name):
    eng, _ = make(name, tiny())
    rs = reqs(4)
    params = SamplingParams(temperature=1.0, max_new_tokens=5, n=2, seed=5, ignore_eos=True)
    seeds, inner = [], eng._generate

    def record(prompts, request_seeds, p):
        seeds.append({r.uid: s for r, s in zip(prompts, request_seeds)})
        return inner(prompts, request_seeds, p)

    eng._generate = record
    whole = eng.generate(rs, params)
    split = eng.generate(rs[:2], params) + eng.generate(rs[2:], params)  # two data-parallel ranks
    assert [s.response_ids for s in split] == [s.response_ids for s in whole]
    assert seeds[0] == {**seeds[1], **seeds[2]} == {r.uid: request_seed(5, r.uid) for r in rs}


@pytest.mark.parametrize("name", BACKENDS)
def test_an_incomplete_or_unknown_weight_sync_is_refused(make, name):
    m = tiny()
    eng, _ = make(name, m)
    state = list(tiny(1).state_dict().items())
    with pytest.raises(
        WeightSyncError, match=r"1 of its \d+ weights missing: \['model.norm.weight'\]"
    ):
        eng.update_weights(iter([(n, t) for n, t in state if n != "model.norm.weight"]), version=1)
    with pytest.raises(RuntimeError, match="last weight sync failed"):
        eng.generate(reqs(1), SamplingParams(max_new_tokens=2))
    with pytest.raises(WeightSyncError, match=r"does not have: \['model.extra.weight'\]"):
        eng.update_weights(iter(state + [("model.extra.weight", torch.zeros(2))]), version=1)
    assert eng.update_weights(iter(state), version=2) == len(state) and eng.version == 2
    assert len(eng.generate(reqs(1), SamplingParams(max_new_tokens=2))) == 1


@pytest.mark.parametrize("name", BACKENDS)
def test_memory_pause_and_unsupported_options(make, name):
    eng, core = make(name, tiny())
    eng.release_memory(), eng.wake_up()
    assert core.calls[-2:] == [("sleep", 1), ("wake_up",)]
    eng.pause()
    with pytest.raises(RuntimeError, match="paused"):
        eng.generate(reqs(1), SamplingParams())
    eng.resume()
    with pytest.raises(NotImplementedError, match="return_raw_log_probs"):
        eng.generate(reqs(1), SamplingParams(return_raw_log_probs=True))
    eng.close()


# --- only where the real package is installed (vLLM's: tests/test_vllm_engine.py) ----------------
@pytest.mark.parametrize("name", ["sglang"])
def test_real_engine_generation_and_weight_update(name):
    pytest.importorskip(name)
    m = tiny()
    eng = ROLLOUT_BACKENDS.get(name)(
        m, None, RolloutConfig(backend=name, backend_options={"gpu_memory_utilization": 0.2})
    )
    try:
        params = SamplingParams(temperature=1.0, max_new_tokens=8, n=4, seed=0, ignore_eos=True)
        out = eng.generate(reqs(2), params)
        assert len(out) == 8 and all(len(s.response_ids) == len(s.log_probs) == 8 for s in out)
        for s in out:  # behaviour log-probs under the sampled distribution (fp32 engine)
            torch.testing.assert_close(
                torch.tensor(s.log_probs),
                ref_logps(m, s.prompt_ids, s.response_ids, 1.0),
                atol=2e-3,
                rtol=0,
            )
        greedy = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
        before = eng.generate(reqs(1), greedy)[0].response_ids
        new = tiny(1)
        eng.update_weights(iter(new.state_dict().items()), version=1)
        after = eng.generate(reqs(1), greedy)[0]
        expect = new.generate(
            torch.tensor([reqs(1)[0].prompt_ids]),
            max_new_tokens=8,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        assert after.response_ids == expect[0, 4:].tolist() != before and after.versions == [1] * 8
        eng.release_memory(), eng.wake_up()
    finally:
        eng.close()
