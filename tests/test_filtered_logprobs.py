"""The trainer's log-probs are those of the distribution the rollout samples from: at equal weights
the behaviour log-probs a backend reports and the recomputed ones (``learner/logprob.py``) agree,
for every sampling setting (temperature, top-k, top-p, min-p and combinations)."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from hybridrl.config import RolloutConfig
from hybridrl.learner.logprob import response_log_probs, sampling_of
from hybridrl.protocol import Sample, samples_to_batch
from hybridrl.rollout import ROLLOUT_BACKENDS, SamplingParams

NATIVE = {"kv_cache_bytes": 4 << 20, "block_size": 4}  # the native engine: a small KV pool

torch.set_num_threads(1)
PAD = 0


class Tok:
    eos_token_id, pad_token_id = 2, PAD


def tiny_model(seed=0):
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=48,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        max_position_embeddings=128,
    )
    m = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # sharper logits than the default init, so that every filter drops tokens
        m.lm_head.weight.mul_(8.0)
    return m


SETTINGS = {
    "t1": dict(temperature=1.0),
    "t0.7": dict(temperature=0.7),
    "greedy": dict(temperature=0.0),
    "top_k": dict(temperature=1.0, top_k=4),
    "top_p": dict(temperature=1.0, top_p=0.8),
    "min_p": dict(temperature=1.0, min_p=0.1),
    "t0.6-top_k-top_p": dict(temperature=0.6, top_k=6, top_p=0.9),
    "t1.3-top_p-min_p": dict(temperature=1.3, top_p=0.7, min_p=0.05),
    "all": dict(temperature=0.8, top_k=5, top_p=0.85, min_p=0.02),
}
BACKENDS = ["native", "hf"]


def generate(backend, model, kw):
    cfg = RolloutConfig(backend=backend, backend_options=NATIVE if backend == "native" else {})
    eng = ROLLOUT_BACKENDS.get(backend)(model, Tok(), cfg)
    n = 1 if kw.get("temperature") == 0 else 3  # hf refuses n > 1 without sampling
    params = SamplingParams(max_new_tokens=8, n=n, seed=5, **kw)
    g = torch.Generator().manual_seed(1)
    reqs = [
        Sample(prompt_ids=torch.randint(3, 48, (n,), generator=g).tolist(), uid=f"u{i}")
        for i, n in enumerate([3, 6, 9])
    ]
    return eng.generate(reqs, params), params


def check_agreement(backend, kw, model=None):
    model = model or tiny_model()
    samples, params = generate(backend, model, kw)
    batch = samples_to_batch(samples, PAD)
    with torch.no_grad():
        logp, ent = response_log_probs(model, batch, params, with_entropy=True)
    mask = batch["response_mask"].bool()
    assert mask.sum() >= 12
    assert torch.isfinite(logp).all() and torch.isfinite(ent).all()
    gap = (logp - batch["rollout_log_probs"]).abs()[mask]
    return gap.max().item(), (logp, batch)


CASES = [pytest.param(b, s, id=f"{b}-{s}") for b in BACKENDS for s in SETTINGS]


@pytest.mark.parametrize("backend,setting", CASES)
def test_recomputed_log_probs_equal_the_behaviour_log_probs(backend, setting):
    gap, _ = check_agreement(backend, SETTINGS[setting])
    assert gap < 1e-5, gap


@pytest.mark.parametrize("setting", ["t1", "greedy"])
def test_hf_ignores_the_checkpoints_generation_defaults(setting):
    """A checkpoint's generation_config (here a repetition penalty and a suppressed token) must not
    reshape what the hf backend samples from: the trainer never applies it, so the behaviour
    log-probs would drift."""
    model = tiny_model()
    model.generation_config.repetition_penalty = 3.0
    model.generation_config.suppress_tokens = [5]
    gap, _ = check_agreement("hf", SETTINGS[setting], model)
    assert gap < 1e-5, gap


def test_filters_change_the_log_probs():
    """Not vacuous: with top-k the filtered log-probs differ from the temperature-only ones."""
    model = tiny_model()
    samples, params = generate("native", model, SETTINGS["top_k"])
    batch = samples_to_batch(samples, PAD)
    with torch.no_grad():
        filtered = response_log_probs(model, batch, params)[0]
        tempered = response_log_probs(model, batch, params.temperature)[0]
    mask = batch["response_mask"].bool()
    assert (filtered - tempered)[
        mask
    ].min() > 1e-3  # renormalised over 4 tokens: every log-prob rises


def test_sampling_of_takes_the_rollout_filters():
    p = sampling_of(RolloutConfig(temperature=0.5, top_k=3, top_p=0.9))
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (0.5, 3, 0.9, 0.0)


def test_a_sampled_token_outside_the_recomputed_filter_keeps_a_finite_log_prob():
    """Rounding can move a sampled token just past a filter's edge in the trainer's
    forward; it stays in the support (finite log-prob, finite entropy and gradients)
    instead of becoming -inf."""
    from hybridrl.sampling import filtered_log_softmax

    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]], requires_grad=True)
    params = SamplingParams(temperature=1.0, top_k=2)
    lp = filtered_log_softmax(logits, params, torch.tensor([2]))
    assert torch.isfinite(lp[0, :3]).all() and torch.isinf(lp[0, 3])
    want = torch.log_softmax(logits[0, :3], -1)
    assert torch.allclose(lp[0, :3], want)
    lp[0, 2].backward()
    assert torch.isfinite(logits.grad).all()


def test_chunked_filtering_equals_the_sampler_rows(monkeypatch):
    """The trainer filters its (many) rows in chunks; each chunk gives what the
    sampler gives for those rows."""
    from hybridrl import sampling as sampler
    from hybridrl.sampling import SamplingTensors, filtered_log_softmax, processed_logprobs

    torch.manual_seed(0)
    logits = torch.randn(3, 7, 50) * 3
    params = SamplingParams(temperature=0.9, top_k=10, top_p=0.8, min_p=0.05)
    want = processed_logprobs(
        logits.reshape(21, 50), SamplingTensors.for_params(params, 21, torch.device("cpu"))
    )
    monkeypatch.setattr(
        sampler, "FILTER_CHUNK_ELEMENTS", 50 * 4
    )  # chunks of 4 rows, the last one shorter
    got = filtered_log_softmax(logits, params)
    assert torch.equal(got.reshape(21, 50), want)
    assert torch.isinf(want).any() and torch.isfinite(want).any()
