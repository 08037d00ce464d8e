"""Sampler and speculative rejection step: exactness checked by chi-square tests. No model."""

import itertools

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from hybridrl.rollout.spec_decode import accept_tokens
from hybridrl.sampling import (
    STREAM_DRAFT,
    SamplingParams,
    SamplingTensors,
    draw,
    processed_logprobs,
    sample,
    uniform,
)

torch.set_num_threads(1)


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square test of observed ``counts`` against expected
    ``probs`` (cells with p > 0)."""
    n = counts.sum()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a zero-probability outcome was drawn"
    exp = probs[keep].double() * n
    stat = ((counts[keep].double() - exp) ** 2 / exp).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def tensors(rows, params, seeds=None, counters=None):
    seeds = list(range(rows)) if seeds is None else seeds
    counters = [0] * rows if counters is None else counters
    return SamplingTensors.build([params] * rows, seeds, counters, torch.device("cpu"))


def test_uniform_is_uniform_and_deterministic():
    s = torch.arange(200_000)
    u = uniform(s, torch.zeros_like(s), 0)
    assert float(u.min()) > 0 and float(u.max()) < 1
    counts = torch.histc(u.float(), bins=20, min=0, max=1)
    assert chi2_pvalue(counts, torch.full((20,), 0.05)) > 1e-3
    assert torch.equal(u[:10], uniform(torch.arange(10), torch.zeros(10, dtype=torch.long), 0))
    assert not torch.equal(
        u[:10], uniform(torch.arange(10), torch.zeros(10, dtype=torch.long), STREAM_DRAFT)
    )


@pytest.mark.parametrize(
    "kw",
    [dict(top_k=3), dict(top_p=0.7), dict(min_p=0.2), dict(top_k=5, top_p=0.9, temperature=0.7)],
)
def test_filters_match_transformers(kw):
    torch.manual_seed(0)
    logits = torch.randn(6, 11) * 2
    p = SamplingParams(
        temperature=kw.get("temperature", 1.0), top_k=kw.get("top_k", 0), top_p=kw.get("top_p", 1.0)
    )
    p.min_p = kw.get("min_p", 0.0)
    ours = processed_logprobs(logits, tensors(6, p))
    ref = logits / p.temperature
    if p.top_k:
        ref = TopKLogitsWarper(p.top_k)(None, ref)
    if p.top_p < 1:
        ref = TopPLogitsWarper(p.top_p)(None, ref)
    if p.min_p:
        ref = MinPLogitsWarper(p.min_p)(None, ref)
    ref = torch.log_softmax(ref, -1)
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    fin = torch.isfinite(ref)
    assert torch.allclose(ours[fin], ref[fin], atol=1e-6)


def test_draw_matches_distribution():
    probs = torch.tensor([0.5, 0.0, 0.2, 0.25, 0.05])
    n = 40_000
    u = uniform(torch.arange(n), torch.zeros(n, dtype=torch.long), 0)
    tok = draw(probs.expand(n, 5), u)
    assert chi2_pvalue(torch.bincount(tok, minlength=5), probs) > 1e-3


def test_sample_logprobs_are_of_the_sampling_distribution():
    torch.manual_seed(1)
    logits = torch.randn(64, 9)
    p = SamplingParams(temperature=0.5, top_k=4)
    p.return_raw_log_probs = True
    st = tensors(64, p)
    tok, lp, raw = sample(logits, st)
    want = processed_logprobs(logits, st).gather(1, tok[:, None]).squeeze(1)
    assert torch.allclose(lp, want)
    assert torch.allclose(raw, torch.log_softmax(logits, -1).gather(1, tok[:, None]).squeeze(1))
    assert torch.isfinite(lp).all()


def test_greedy_rows_mixed_with_sampled():
    logits = torch.randn(4, 7)
    g, s = SamplingParams(temperature=0), SamplingParams(temperature=1.0)
    st = SamplingTensors.build([g, s, g, s], [0, 1, 2, 3], [0] * 4, torch.device("cpu"))
    tok, lp, _ = sample(logits, st)
    assert tok[0] == logits[0].argmax() and tok[2] == logits[2].argmax()
    assert torch.allclose(lp[0], torch.log_softmax(logits[0], -1).max())


def test_seeded_draw_independent_of_batch_composition():
    logits = torch.randn(8, 13)
    p = SamplingParams()
    full, _, _ = sample(logits, tensors(8, p, seeds=list(range(100, 108)), counters=[5] * 8))
    part, _, _ = sample(logits[3:5], tensors(2, p, seeds=[103, 104], counters=[5, 5]))
    assert torch.equal(full[3:5], part)


# --- speculative decoding: exact rejection sampling on a known Markov chain ------------------
V, K = 4, 3
P_CHAIN = torch.tensor(
    [[0.6, 0.2, 0.1, 0.1], [0.1, 0.1, 0.4, 0.4], [0.25, 0.25, 0.25, 0.25], [0.05, 0.05, 0.1, 0.8]]
)
Q_CHAIN = torch.tensor(
    [[0.2, 0.5, 0.2, 0.1], [0.4, 0.4, 0.1, 0.1], [0.1, 0.6, 0.2, 0.1], [0.7, 0.1, 0.1, 0.1]]
)


def spec_generate(n, length, rule="exact"):
    """Generate ``length`` tokens for ``n`` chains with speculative rounds;
    returns (n, length) tokens."""
    p = SamplingParams(temperature=1.0)
    seqs = [[0] for _ in range(n)]
    lp_chain, lq_chain = P_CHAIN.log(), Q_CHAIN.log()
    while min(len(s) for s in seqs) <= length:
        last = torch.tensor([s[-1] for s in seqs])
        base = torch.tensor([len(s) for s in seqs])
        st = tensors(n, p, seeds=list(range(n)), counters=base.tolist())
        xs, prev = [], last
        for i in range(K):
            x = draw(Q_CHAIN[prev], uniform(st.seeds, base + i, STREAM_DRAFT))
            xs.append(x)
            prev = x
        X = torch.stack(xs, 1)
        ctx = torch.cat([last[:, None], X], 1)  # token before each of the k+1 positions
        LP, LQ = lp_chain[ctx], lq_chain[ctx[:, :K]]
        if rule == "exact":
            tokens, n_acc = accept_tokens(X, LP, LQ, LP.clone(), st, base)
        else:  # the textbook shortcut: accept while the draft token is the target's argmax
            ok = LP[:, :K].argmax(-1) == X
            n_acc = ok.int().cumprod(1).sum(1)
            y = draw(
                LP.gather(1, n_acc.view(-1, 1, 1).expand(-1, 1, V)).squeeze(1).exp(),
                uniform(st.seeds, base + n_acc, 0),
            )
            tokens = torch.cat([X, X[:, :1]], 1).scatter_(1, n_acc[:, None], y[:, None])
        for s, t, a in zip(seqs, tokens.tolist(), n_acc.tolist()):
            s.extend(t[: a + 1])
    return torch.tensor([s[1 : length + 1] for s in seqs])


def chain_probs(length):
    probs = []
    for path in itertools.product(range(V), repeat=length):
        pr, prev = 1.0, 0
        for t in path:
            pr *= float(P_CHAIN[prev, t])
            prev = t
        probs.append(pr)
    return torch.tensor(probs)


def path_counts(toks, length):
    idx = sum(toks[:, i] * V ** (length - 1 - i) for i in range(length))
    return torch.bincount(idx, minlength=V**length)


def test_speculative_rejection_sampling_is_exact():
    toks = spec_generate(20_000, 3)
    assert chi2_pvalue(path_counts(toks, 3), chain_probs(3)) > 1e-3


def test_argmax_acceptance_is_not_sampling_from_the_target():
    toks = spec_generate(20_000, 3, rule="argmax")
    assert chi2_pvalue(path_counts(toks, 3), chain_probs(3)) < 1e-6


def test_speculative_greedy_is_exact_match():
    p = SamplingParams(temperature=0)
    st = tensors(2, p)
    LP = torch.log_softmax(torch.randn(2, K + 1, V), -1)
    X = LP[:, :K].argmax(-1).clone()
    X[1, 1] = (X[1, 1] + 1) % V  # second row: the draft is wrong at position 2
    tokens, n_acc = accept_tokens(X, LP, LP[:, :K], LP, st, torch.zeros(2, dtype=torch.long))
    assert n_acc.tolist() == [K, 1]
    assert torch.equal(tokens, LP.argmax(-1))


def test_top_p_one_row_keeps_its_tail_beside_top_p_rows():
    """A row's distribution must not depend on its neighbours: with a large vocabulary and a peaked
    distribution the float32 cumulative sum reaches 1.0 before the tail, and a top_p = 1.0 row that
    shares the step with a top_p < 1 row used to lose its tail tokens."""
    V = 151_936
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, V, generator=g) * 3.0
    logits[:, :8] += 30.0  # a few tokens hold nearly all the mass
    full, nucleus = SamplingParams(top_p=1.0), SamplingParams(top_p=0.9)
    st = SamplingTensors.build([full, nucleus], [0, 1], [0, 0], torch.device("cpu"))
    mixed = processed_logprobs(logits, st)
    alone = processed_logprobs(logits[:1], tensors(1, full))
    assert torch.isfinite(mixed[0]).all()  # top_p = 1: every token stays
    assert torch.equal(mixed[0], alone[0])
    assert torch.isinf(mixed[1]).any()  # the other row is filtered
