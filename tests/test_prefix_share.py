"""Shared prompts in packed micro-batches (``learner/prefix_share.py``): the samples of a group
share one copy of their prompt, and the log-probs, entropies and gradients equal the plain packed
forward's (fp32, tiny Qwen2, to float rounding) with fewer token positions fed."""

from __future__ import annotations

import random

import pytest
import torch

from hybridrl.config import Config
from hybridrl.learner.logprob import (
    micro_batches,
    response_log_probs,
    token_counts,
)
from hybridrl.learner.prefix_share import PACK_RESP, can_share, prompt_groups, shared_plans
from hybridrl.models.loading import load_model
from hybridrl.protocol import Sample, samples_to_batch

torch.set_num_threads(1)
TOL = 1e-5
BUDGET = 4096


def group_batch(seed: int = 0):
    """Groups of 4 samples per prompt (prompts of 3-7 tokens, responses of 1-40, one group with
    long responses that cannot share one row), in a shuffled order, and one prompt alone."""
    rng = random.Random(seed)
    samples = []
    for g in range(5):
        prompt = [1] + [rng.randrange(3, 15) for _ in range(rng.randrange(2, 7))]
        for _ in range(4):
            n = rng.randrange(30, 40) if g == 0 else rng.randrange(1, 12)
            response = [rng.randrange(3, 15) for _ in range(n)]
            samples.append(Sample(prompt_ids=prompt, response_ids=response, uid=f"g{g}"))
    samples.append(Sample(prompt_ids=[1, 5], response_ids=[6, 7, 8], uid="alone"))
    rng.shuffle(samples)
    return samples_to_batch(samples, pad_id=0)


@pytest.fixture(scope="module")
def model():
    cfg = Config()
    cfg.model.name = "tiny"
    return load_model(cfg, None)[0]


def forward(model, batch, share: bool, grad: bool):
    """(log-probs, entropies, gradients by name, micro-batches) over the batch's rows."""
    model.zero_grad(set_to_none=True)
    mbs, order = micro_batches(batch, BUDGET, True, 1 / 768, share)
    logp = torch.zeros(batch["responses"].shape)
    ent = torch.zeros(batch["responses"].shape)
    row = 0
    for mb in mbs:
        lp, en = response_log_probs(model, mb, 1.0, with_entropy=True)
        if grad:
            (lp.sum() + 0.1 * en.sum()).backward()
        rows = order[row : row + lp.shape[0]]
        logp[rows, : lp.shape[1]], ent[rows, : en.shape[1]] = lp.detach(), en.detach()
        row += lp.shape[0]
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp, ent, grads, mbs


def test_groups_are_rows_with_equal_prompts():
    batch = group_batch()
    groups = prompt_groups(batch)
    assert sorted(len(g) for g in groups) == [1, 4, 4, 4, 4, 4]
    for g in groups:
        assert len({batch.meta["uid"][i] for i in g}) == 1


def test_shared_prompts_give_the_plain_outputs_and_gradients(model):
    batch = group_batch()
    lp0, en0, g0, plain = forward(model, batch, False, True)
    lp1, en1, g1, shared = forward(model, batch, True, True)
    assert all(PACK_RESP in mb for mb in shared) and not any(PACK_RESP in mb for mb in plain)
    mask = batch["response_mask"].bool()
    assert mask.sum() > 100
    torch.testing.assert_close(lp1[mask], lp0[mask], rtol=0, atol=TOL)
    torch.testing.assert_close(en1[mask], en0[mask], rtol=0, atol=TOL)
    assert (lp1[~mask] == 0).all()
    assert g0.keys() == g1.keys()
    scale = max(g.abs().max().item() for g in g0.values())
    assert scale > 1e-2
    assert max((g1[k] - g0[k]).abs().max().item() for k in g0) <= TOL * scale
    # each group's prompt is fed fewer times: fewer positions, fewer distinct real tokens
    shared_counts = [token_counts(mb) for mb in shared]  # (fed, real) per micro-batch
    plain_counts = [token_counts(mb) for mb in plain]
    assert sum(f for f, _ in shared_counts) < sum(f for f, _ in plain_counts)
    assert sum(r for _, r in shared_counts) < int(batch["attention_mask"].sum())
    assert sum(r for _, r in plain_counts) == int(batch["attention_mask"].sum())


def test_a_group_too_long_for_one_row_is_split(model):
    """Group 0's four responses of 30-39 tokens need more than the row capacity the longest
    sequence sets: its samples go to several units, each with its own prompt copy."""
    batch = group_batch()
    plans = shared_plans(batch, BUDGET, 1 / 768)
    long_rows = [i for i, u in enumerate(batch.meta["uid"]) if u == "g0"]
    places = {
        (mb_i, row, offset)
        for mb_i, (docs, rows, offsets, _) in enumerate(plans)
        for d, row, offset in zip(docs, rows, offsets)
        if d in long_rows
    }
    assert len(places) > 1
    assert sorted(d for docs, *_ in plans for d in docs) == list(range(len(batch)))


def test_no_sharing_without_repeated_prompts_or_for_a_varlen_model(model):
    batch = group_batch()
    alone = batch.index(torch.tensor([batch.meta["uid"].index(f"g{g}") for g in range(5)]))
    mbs, _ = micro_batches(alone, BUDGET, True, 1 / 768, True)
    assert not any(PACK_RESP in mb for mb in mbs)
    assert can_share(model)
    impl = model.config._attn_implementation
    try:
        model.config._attn_implementation = "flash_attention_2"
        assert not can_share(model)
    finally:
        model.config._attn_implementation = impl
