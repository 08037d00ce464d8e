"""Speculative decoding inside the engine: greedy equality, exact
distribution on a real model, auto-off."""

import copy
import itertools

import pytest
import torch
from test_rollout_engine import DEVICES
from test_rollout_sampler import chi2_pvalue
from transformers import Qwen2Config, Qwen2ForCausalLM

from hybridrl.config import RolloutConfig
from hybridrl.protocol import Sample
from hybridrl.rollout import SamplingParams
from hybridrl.rollout.backends.native import NativeRollout

torch.set_num_threads(1)


class Tok:
    eos_token_id, pad_token_id = 2, 0


def qwen(vocab, hidden, layers, seed, scale=1.0):
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=2 * hidden,
        max_position_embeddings=64,
    )
    m = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        m.model.embed_tokens.weight.mul_(scale)  # sharper next-token distributions
    return m


def rcfg(**kw):
    return RolloutConfig(
        backend="native",
        backend_options={
            "kv_cache_bytes": 16 << 20,
            "block_size": 4,
            "max_batch_size": 8192,
            "max_num_batched_tokens": 8192,
            "num_speculative_tokens": 3,
            **kw,
        },
    )


def always_speculate(spec):
    """Bypass the cost model: speculate on every eligible step with the longest
    proposal, whatever it costs."""
    spec.choose_k = lambda batch_size: spec.max_k


def test_greedy_speculative_equals_plain_greedy():
    target, draft = qwen(40, 64, 2, 0, 8.0), qwen(40, 32, 1, 1, 8.0)
    ps = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [3]]
    req = [Sample(prompt_ids=p, uid=f"r{i}") for i, p in enumerate(ps)]
    params = SamplingParams(temperature=0, max_new_tokens=25)
    params.ignore_eos = True
    plain = NativeRollout(target, Tok(), rcfg()).generate(req, params)
    spec_eng = NativeRollout(target, Tok(), rcfg(), draft_model=draft)
    always_speculate(spec_eng.engine.speculative)
    spec = spec_eng.generate(req, params)
    assert [s.response_ids for s in spec] == [s.response_ids for s in plain]
    assert all(
        torch.allclose(torch.tensor(a.log_probs), torch.tensor(b.log_probs), atol=1e-5)
        for a, b in zip(spec, plain)
    )
    st = spec_eng.stats()
    assert st["engine/spec_steps"] > 0 and 0 <= st["engine/spec_acceptance"] <= 1


def test_greedy_speculation_with_admissions_in_the_same_step_equals_plain_greedy():
    """Three seats, six requests of different lengths: rounds share their forward
    passes with admitted prompts."""
    target, draft = qwen(40, 64, 2, 0, 8.0), qwen(40, 32, 1, 1, 8.0)
    ps = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [3], [8, 8, 8, 8, 8, 8, 8, 8, 8], [4, 5], [7, 7]]

    def run(**kw):
        eng = NativeRollout(target, Tok(), rcfg(max_batch_size=3), **kw).engine
        if eng.speculative is not None:
            always_speculate(eng.speculative)
        for i, p in enumerate(ps):
            params = SamplingParams(temperature=0, max_new_tokens=5 + 4 * i)
            params.ignore_eos = True
            eng.add_request(f"r{i}", p, params)
        while eng.has_unfinished():
            eng.step()
        return [eng.finished[f"r{i}"][0].completion_ids for i in range(len(ps))], eng.stats()

    plain, _ = run()
    spec, st = run(draft_model=draft)
    assert spec == plain and st["engine/spec_steps"] > 0


@pytest.mark.parametrize("device", DEVICES)
def test_speculative_sampling_matches_the_target_distribution_on_a_real_model(device):
    V, L, N = 6, 3, 6000
    target, draft = qwen(V, 32, 2, 0, 6.0).to(device), qwen(V, 32, 1, 5, 6.0).to(device)
    prompt = [1, 4, 2]
    eng = NativeRollout(target, Tok(), rcfg(), draft_model=draft, spec_max_batch=10**6)
    always_speculate(eng.engine.speculative)
    params = SamplingParams(temperature=1.0, max_new_tokens=L, n=N, seed=11)
    params.ignore_eos = True
    out = eng.generate([Sample(prompt_ids=prompt, uid="r")], params)
    st = eng.stats()
    assert st["engine/spec_steps"] > 0 and st["engine/spec_acceptance"] < 0.95
    toks = torch.tensor([s.response_ids for s in out])
    counts = torch.bincount(sum(toks[:, i] * V ** (L - 1 - i) for i in range(L)), minlength=V**L)
    # exact target probabilities of every 3-token continuation
    paths = torch.tensor(list(itertools.product(range(V), repeat=L)), device=device)
    with torch.no_grad():
        logits = target(
            torch.cat([torch.tensor(prompt, device=device).expand(len(paths), -1), paths], 1)
        ).logits
    lp = (
        torch.log_softmax(logits[:, len(prompt) - 1 : -1], -1)
        .gather(2, paths[:, :, None])
        .squeeze(2)
        .sum(1)
    )
    assert chi2_pvalue(counts, lp.double().exp().cpu()) > 1e-3


def test_speculation_turns_itself_off_at_large_batch():
    target, draft = qwen(40, 64, 2, 0), qwen(40, 32, 1, 1)
    eng = NativeRollout(target, Tok(), rcfg(), draft_model=draft, spec_max_batch=4)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, n=8, seed=0)
    params.ignore_eos = True
    eng.generate([Sample(prompt_ids=[3, 4, 5], uid="r")], params)
    assert eng.stats()["engine/spec_steps"] == 0


def test_speculation_turns_itself_off_when_it_does_not_pay():
    target, draft = qwen(40, 64, 2, 0), qwen(40, 32, 1, 1)
    eng = NativeRollout(target, Tok(), rcfg(), draft_model=draft)
    spec = eng.engine.speculative
    # a disagreeing draft, and a compute-bound target (a step's seconds grow with its tokens)
    spec.alpha, spec.plain, spec.verify, spec.t_draft = 0.05, (1, 1.0), (4, 3.0), 0.1
    spec.probe_every = 10**9  # no probes: the decision alone
    params = SamplingParams(temperature=1.0, max_new_tokens=40, seed=0)
    params.ignore_eos = True
    eng.generate([Sample(prompt_ids=[3, 4, 5], uid="r")], params)
    assert eng.stats()["engine/spec_steps"] == 0


def test_a_draft_that_did_not_follow_a_cached_prefix_prefills_it_itself():
    """Draft = a copy of the target, greedy: every proposal must be accepted, also after a
    prefix-cache hit on blocks the target computed while the draft was not following (speculation
    off). Reading the draft KV it never wrote accepted 0.29 of the proposals here."""
    target = qwen(40, 64, 2, 0)  # unscaled: the context matters to every next token
    eng = NativeRollout(target, Tok(), rcfg(), draft_model=copy.deepcopy(target))
    spec = eng.engine.speculative
    params = SamplingParams(temperature=0, max_new_tokens=16)
    params.ignore_eos = True
    shared = list(range(5, 25))  # five full blocks
    spec.max_batch = 0  # speculation off: the draft neither speculates nor follows the plain steps
    eng.generate([Sample(prompt_ids=shared + [3], uid="a")], params)
    eng.stats()
    spec.max_batch = 32
    always_speculate(spec)
    out = eng.generate([Sample(prompt_ids=shared + [4, 4], uid="b")], params)[0]
    st = eng.stats()
    assert st["engine/prompt_tokens_computed"] == 2  # the shared blocks came from the prefix cache
    assert st["engine/spec_steps"] > 0 and st["engine/spec_acceptance"] == 1.0
    with (
        torch.no_grad()
    ):  # the greedy choices are not near-ties, so kernel rounding cannot flip an argmax
        logits = target(torch.tensor([out.prompt_ids + out.response_ids])).logits[
            0, len(out.prompt_ids) - 1 : -1
        ]
    top2 = logits.topk(2, -1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-3
