"""Sequence packing and data-parallel balancing (``parallel/packing.py``): best-fit decreasing and
Karmarkar-Karp on hand cases; packed micro-batches never split a sequence; the packed forward gives
the unpacked log-probs, entropies, values and gradients (fp32, tiny Qwen2, long-tailed lengths),
so a packed update trains to the same weights; the SFT warm start's packed loss equals its
length-grouped one; balancing leaves one rank untouched, and a packed, balanced update on 2 gloo
ranks equals one process on the reordered batch.

The two ranks are two subprocesses running this file (``python tests/test_packing.py rank ...``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from rank_processes import launch_ranks, wait_ranks

from hybridrl.config import Config
from hybridrl.controller import WorkerContext
from hybridrl.learner.logprob import (
    PACK_OFFSET,
    PACK_ROW,
    batch_map,
    micro_batches,
    response_log_probs,
)
from hybridrl.learner.update import first_epoch_minibatches
from hybridrl.models.loading import load_model
from hybridrl.parallel.batch_balance import (
    balance_for_ranks,
    balanced_order,
    balanced_positions,
    chunk_sizes,
    fill_shares,
    imbalance,
    karmarkar_karp,
)
from hybridrl.parallel.packing import (
    ROW_WIDEN,
    best_fit_decreasing,
    pack_micro_batches,
    packed_layout,
    plan_rows,
)
from hybridrl.protocol import Batch

TOL = 1e-5
WORLD = 2


# --- the algorithms -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "lengths,capacity,bins",
    [
        # 5 | 4 | 3 open bins; 2 fills the 4's bin exactly, 1 the 5's, the last 1 joins the 3
        ([5, 4, 3, 2, 1, 1], 6, [[0, 4], [1, 3], [2, 5]]),
        ([7, 7, 7], 10, [[0], [1], [2]]),
        ([2, 6, 4, 5, 3], 10, [[1, 2], [3, 4, 0]]),
        # longer than the capacity: a bin of its own, nothing joins it
        ([12, 3, 3], 10, [[0], [1, 2]]),
        ([], 4, []),
    ],
)
def test_best_fit_decreasing_by_hand(lengths, capacity, bins):
    assert best_fit_decreasing(lengths, capacity) == bins


def test_best_fit_takes_the_tightest_bin():
    # 7 | 4 + 4 leave free spaces 3 and 2: the 2 goes to the tighter second bin (first fit would
    # put it with the 7)
    assert best_fit_decreasing([7, 4, 4, 2], 10) == [[0], [1, 2, 3]]
    assert best_fit_decreasing([6, 5, 5, 4, 4, 4], 10) == [[0, 3], [1, 2], [4, 5]]


def test_rows_widen_when_that_saves_padding():
    # seven 6s at capacity 20: 3 + 3 + 1 per row, 3 rows 18 wide (54 positions for 42 tokens);
    # rows of 24 (within 1.25 x 20) take 4 + 3: 2 rows, 48 positions
    bins, width = plan_rows([6] * 7, 20)
    assert (len(bins), width) == (2, 24)
    # never narrower than the longest sequence (30: then one row of 34 instead of two of 30)
    assert plan_rows([30, 2, 2], 20) == ([[0, 1, 2]], 34)
    # already without padding: as it is
    assert plan_rows([5, 5, 5, 5], 10) == ([[0, 1], [2, 3]], 10)


@pytest.mark.parametrize(
    "lengths,k,sums",
    [
        # the textbook case where differencing is not optimal: 8-7, 6-5 -> {1, 1, 4} -> 2
        ([8, 7, 6, 5, 4], 2, [14, 16]),
        # 8 | 7 + 4 | 6 + 5: the best largest set (11) there is
        ([4, 5, 6, 7, 8], 3, [8, 11, 11]),
        ([10, 10, 10, 1, 1, 1], 3, [11, 11, 11]),
        ([1, 1], 4, [0, 0, 1, 1]),
    ],
)
def test_karmarkar_karp_by_hand(lengths, k, sums):
    sets = karmarkar_karp(lengths, k)
    assert sorted(sum(lengths[i] for i in s) for s in sets) == sums
    assert sorted(i for s in sets for i in s) == list(range(len(lengths)))


def test_karmarkar_karp_equal_sizes():
    lengths = [100, 90, 3, 2, 2, 1, 1, 1]
    sets = karmarkar_karp(lengths, 2, equal_size=True)
    assert [len(s) for s in sets] == [4, 4]
    # (the best equal-size split is 103 / 97: the method is a heuristic, close to it)
    assert sorted(sum(lengths[i] for i in s) for s in sets) == [96, 104]
    # 7 items on 3 ranks: sizes 3, 2, 2 (one filler), in the order Batch.chunk sizes parts
    order = balanced_order([9, 1, 8, 2, 7, 3, 5], 3)
    assert sorted(order) == list(range(7))
    assert chunk_sizes(7, 3) == [3, 2, 2]


def long_tailed_lengths(n: int, seed: int) -> list[int]:
    """W3-like: 90% short, 10% several times longer."""
    g = torch.Generator().manual_seed(seed)
    short = torch.randint(6, 40, (n,), generator=g)
    long = torch.randint(100, 200, (n,), generator=g)
    return torch.where(torch.rand(n, generator=g) < 0.1, long, short).tolist()


def test_balanced_order_evens_the_ranks_chunks():
    lengths = long_tailed_lengths(256, seed=3)
    lengths.sort(reverse=True)  # the worst case for contiguous chunks
    for k in (2, 3, 4):
        order = balanced_order(lengths, k)
        assert sorted(order) == list(range(len(lengths)))
        starts = [sum(chunk_sizes(len(order), k)[:r]) for r in range(k + 1)]
        per_rank = [sum(lengths[i] for i in order[a:b]) for a, b in zip(starts, starts[1:])]
        before = [sum(lengths[a:b]) for a, b in zip(starts, starts[1:])]
        assert imbalance(per_rank) <= 0.01 < imbalance(before), (per_rank, before)


# --- packed micro-batches -------------------------------------------------------------------------
def make_batch(n: int = 16, prompt_len: int = 8, resp_len: int = 40, seed: int = 0) -> Batch:
    """Left-padded prompts ++ right-padded responses with long-tailed response lengths (most short,
    a few near ``resp_len``)."""
    g = torch.Generator().manual_seed(seed)
    vocab = 17
    p_len = torch.randint(2, prompt_len + 1, (n,), generator=g)
    r_len = torch.randint(1, 9, (n,), generator=g)
    long = r_len[:: max(1, n // 3)]
    long[:] = torch.randint(resp_len - 8, resp_len + 1, (len(long),), generator=g)
    prompts = torch.randint(3, vocab, (n, prompt_len), generator=g)
    responses = torch.randint(3, vocab, (n, resp_len), generator=g)
    pmask = (torch.arange(prompt_len) >= prompt_len - p_len[:, None]).long()
    rmask = (torch.arange(resp_len) < r_len[:, None]).long()
    prompts, responses = prompts * pmask, responses * rmask
    loss_mask = rmask.clone()
    loss_mask[0, 1] = 0  # a token not trained on inside a response: its successors still are
    adv = torch.randn(n, 1, generator=g).expand(n, resp_len) * rmask
    return Batch(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": torch.cat([pmask, rmask], 1),
            "response_mask": loss_mask,
            "advantages": adv.contiguous(),
        }
    )


def test_no_sequence_is_split_and_rows_fit():
    lengths = long_tailed_lengths(200, seed=1)
    budget = 1024
    plans = pack_micro_batches(lengths, budget)
    capacity = int(budget * ROW_WIDEN)  # the widest a row may get
    assert sorted(d for p in plans for d in p.docs) == list(range(len(lengths)))
    for p in plans:
        rows: dict[int, list[tuple[int, int]]] = {}
        for d, r, o in zip(p.docs, p.rows, p.offsets):
            rows.setdefault(r, []).append((o, o + lengths[d]))
        width = max(end for spans in rows.values() for _, end in spans)
        assert len(rows) * width <= max(budget, width)
        for spans in rows.values():
            spans.sort()
            assert spans[-1][1] <= capacity
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # back to back, no overlap
    real = sum(lengths)
    fed = sum(
        len(set(p.rows)) * max(o + lengths[d] for d, o in zip(p.docs, p.offsets)) for p in plans
    )
    assert 1 - real / fed <= 0.05  # long-tailed: almost no padding left


def test_unpacked_micro_batches_keep_the_token_budget_with_masked_observations():
    """A multi-turn row's loss mask is 0 on tool output, but every token is fed: the width of a
    micro-batch comes from the tokens, not from the tokens trained on."""
    batch = make_batch(n=16, resp_len=64, seed=2)
    observation = torch.zeros_like(batch["response_mask"])
    observation[:, 4:60] = 1  # most of each long response is a tool's output
    batch.tensors["response_mask"] = batch["response_mask"] * (1 - observation)
    mbs, order = micro_batches(batch, 128, packing=False)
    assert sorted(order.tolist()) == list(range(len(batch)))
    for mb in mbs:
        assert len(mb) == 1 or mb["input_ids"].numel() <= 128, (len(mb), mb["input_ids"].shape)


def test_packed_rows_hold_each_sequence_whole():
    batch = make_batch()
    mbs, order = micro_batches(batch, 128, packing=True)
    assert sorted(order.tolist()) == list(range(len(batch)))
    for mb in mbs:
        attn = mb["attention_mask"]
        layout = packed_layout(attn, mb[PACK_ROW], mb[PACK_OFFSET])
        packed = layout.scatter(mb["input_ids"], attn, -1).view(-1)
        pos = layout.position_ids(attn).view(-1)
        for b in range(len(mb)):
            tokens = mb["input_ids"][b][attn[b].bool()]
            start = int(mb[PACK_ROW][b]) * layout.width + int(mb[PACK_OFFSET][b])
            assert torch.equal(packed[start : start + len(tokens)], tokens)
            assert torch.equal(pos[start : start + len(tokens)], torch.arange(len(tokens)))


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m, _ = load_model(Config(), None)
    return m


def log_probs(model, batch: Batch, packing: bool, budget: int = 128):
    """(log-probs, entropy) of every row with micro-batches as the learner cuts them."""

    def both(m, mb):
        logp, ent = response_log_probs(m, mb, 1.0, with_entropy=True)
        return torch.stack([logp, ent])

    def fn_logp(m, mb):
        return both(m, mb)[0]

    def fn_ent(m, mb):
        return both(m, mb)[1]

    return (
        batch_map(model, batch, budget, fn_logp, packing),
        batch_map(model, batch, budget, fn_ent, packing),
    )


def test_packed_log_probs_equal_unpacked(model):
    batch = make_batch()
    logp, ent = log_probs(model, batch, packing=False)
    plogp, pent = log_probs(model, batch, packing=True)
    assert (logp != 0).sum() > 100  # a real comparison
    assert (plogp - logp).abs().max() <= TOL and (pent - ent).abs().max() <= TOL
    # the check can fail: attention across the sequences of a row (a plain causal 4-D mask, the
    # same per-sequence positions) changes the outputs
    mb = max(micro_batches(batch, 128, packing=True)[0], key=lambda m: len(m) - m[PACK_ROW].max())
    assert len(mb) > int(mb[PACK_ROW].max()) + 1  # a row holds several sequences
    layout = packed_layout(mb["attention_mask"], mb[PACK_ROW], mb[PACK_OFFSET])
    ids = layout.scatter(mb["input_ids"], mb["attention_mask"], 0)
    pos = layout.position_ids(mb["attention_mask"])
    causal = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).tril()
    causal = causal.expand(ids.shape[0], 1, -1, -1)
    with torch.no_grad():
        a = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        b = model(input_ids=ids, position_ids=pos, attention_mask=causal, use_cache=False).logits
    assert (a - b).abs().max() > 100 * TOL


def test_one_row_layout_of_varlen_kernels_gives_the_same_outputs(model):
    """The layout a flash-attention model gets (every sequence back to back in one row) holds each
    sequence whole and, run here through SDPA's block-diagonal mask, gives the unpacked outputs."""
    from hybridrl.parallel.packing import gather_positions, is_varlen, response_positions

    assert not is_varlen(model)  # CPU: SDPA, several rows
    batch = make_batch(n=8, seed=12)
    mb = micro_batches(batch, 128, packing=True)[0][0]
    attn = mb["attention_mask"]
    layout = packed_layout(attn, mb[PACK_ROW], mb[PACK_OFFSET], one_row=True)
    assert layout.n_rows == 1 and layout.width == int(attn.sum())  # no padding at all
    ids, pos = layout.scatter(mb["input_ids"], attn, 0), layout.position_ids(attn)
    with torch.no_grad():
        out = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        got = gather_positions(out, response_positions(layout, attn, mb["responses"].shape[1]))
        P = attn.shape[1] - mb["responses"].shape[1]
        ref = model(
            input_ids=mb["input_ids"],
            attention_mask=attn,
            position_ids=(attn.cumsum(-1) - 1).clamp(min=0),
            use_cache=False,
        ).logits[:, P - 1 : -1]
    mask = mb["response_mask"].bool()
    assert (got[mask] - ref[mask]).abs().max() <= TOL


def gradients(model, batch: Batch, packing: bool) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model.train()
    mbs, _ = micro_batches(batch, 128, packing=packing)
    for mb in mbs:
        logp, ent = response_log_probs(model, mb, 1.0, with_entropy=True)
        # the update's objective: a mean over the response tokens
        loss = -(logp * mb["advantages"]).sum() - 0.01 * ent.sum()
        (loss / batch["response_mask"].sum()).backward()
    out = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


def test_packed_gradients_equal_unpacked(model):
    batch = make_batch(seed=4)
    ref, got = gradients(model, batch, False), gradients(model, batch, True)
    assert max(g.abs().max().item() for g in ref.values()) > 1e-3
    assert max((ref[k] - got[k]).abs().max().item() for k in ref) <= TOL


def learner(packing: bool, world: int = 1, rank: int = 0, port: int | None = None, gae=False):
    from hybridrl.learner import Learner

    cfg = Config()
    cfg.actor.ppo_minibatch_size = 8
    cfg.actor.micro_batch_tokens = 96
    cfg.actor.packing = packing
    cfg.algorithm.entropy_coef = 0.01
    if gae:
        cfg.algorithm.advantage = "gae"
    ctx = WorkerContext(
        rank=rank, world_size=world, role="learner", pool="p", master_port=port, num_threads=1
    )
    return Learner(ctx, cfg, None)


def update_batch(lrn, batch: Batch) -> Batch:
    """``batch`` with what the policy loss reads (old log-probs from this learner, a reference)."""
    old = lrn.compute_log_prob(batch)["old_log_probs"]
    return batch | Batch({"old_log_probs": old, "ref_log_probs": old * 0.9})


def weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_packed_update_trains_the_same_weights():
    batch = make_batch(n=16, seed=5)
    plain, packed = learner(False), learner(True)
    m0 = plain.update_actor(update_batch(plain, batch))
    m1 = packed.update_actor(update_batch(packed, batch))
    w0, w1 = weights(plain.model), weights(packed.model)
    assert max((w0[k] - w1[k]).abs().max().item() for k in w0) <= TOL
    assert m0["actor/updates"] == m1["actor/updates"] == 2
    assert abs(m0["actor/pg_loss"] - m1["actor/pg_loss"]) <= TOL
    assert m1["perf/padding_fraction"] < m0["perf/padding_fraction"]
    # the same real tokens, fewer positions fed
    real = [m["perf/tokens_fed"] * (1 - m["perf/padding_fraction"]) for m in (m0, m1)]
    assert real[0] == pytest.approx(real[1]) and real[0] > 0
    assert m1["perf/tokens_fed"] < m0["perf/tokens_fed"]


def test_packed_critic_values_equal_unpacked():
    batch = make_batch(n=12, seed=6)
    plain, packed = learner(False, gae=True), learner(True, gae=True)
    v0 = plain.critic.values(batch)["values"]
    torch.nn.init.normal_(packed.critic.model.score.weight, std=0.1)
    torch.nn.init.normal_(plain.critic.model.score.weight, std=0.1)
    packed.critic.model.load_state_dict(plain.critic.model.state_dict())
    v0 = plain.critic.values(batch)["values"]
    v1 = packed.critic.values(batch)["values"]
    assert v0.abs().max() > 1e-3 and (v0 - v1).abs().max() <= TOL


def test_sft_packed_loss_and_gradients_equal_length_grouped(model):
    from hybridrl.driver.sft import MICRO_BATCHES

    g = torch.Generator().manual_seed(7)
    n, width = 12, 30
    lens = torch.where(
        torch.rand(n, generator=g) < 0.2, 28, torch.randint(4, 10, (n,), generator=g)
    )
    attn = (torch.arange(width) < lens[:, None]).long()
    ids = torch.randint(3, 17, (n, width), generator=g) * attn
    labels = torch.where(attn.bool() & (torch.arange(width) >= 3), ids, -100)

    def run(packing):
        model.zero_grad(set_to_none=True)
        total = 0.0
        for logits, targets in MICRO_BATCHES[packing](model, ids, attn, labels, 64):
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"
            )
            loss.backward()
            total += loss.item()
        return total, {k: p.grad.clone() for k, p in model.named_parameters()}

    (l0, g0), (l1, g1) = run(False), run(True)
    assert abs(l0 - l1) <= 1e-4 * abs(l0)
    assert max((g0[k] - g1[k]).abs().max().item() for k in g0) <= TOL


# --- balancing ------------------------------------------------------------------------------------
def test_balancing_leaves_one_rank_untouched():
    batch = make_batch()
    same, metrics = balance_for_ranks(batch, 1, True)
    assert all(torch.equal(same[k], batch[k]) for k in batch.tensors)
    assert metrics == {"perf/dp_token_imbalance": 0.0, "perf/dp_token_imbalance_minibatch": 0.0}


def test_fill_shares_with_unequal_sizes():
    # sizes 3 and 1: the 1-slot share misses the most per slot, so it takes the 9 (9 vs 6; the
    # lightest-first rule would give 12 vs 3)
    assert fill_shares([1, 9, 2, 3], [3, 1]) == [[0, 2, 3], [1]]
    # the greedy fill gives the 2-slot share the 10 and the 9 (19 vs 13); swapping the 9 with the
    # 5 evens the shares (15 vs 17), the best two slots can hold
    assert fill_shares([9, 3, 5, 3, 2, 10], [4, 2]) == [[0, 1, 3, 4], [2, 5]]
    # sizes as chunk gives them: Karmarkar-Karp with equal sizes
    assert fill_shares([8, 7, 6, 5], [2, 2]) == karmarkar_karp([8, 7, 6, 5], 2, equal_size=True)


def test_balanced_positions_even_every_minibatch_and_keep_its_rows():
    # W3's shape: 256 rows, mini-batches of 64 drawn at random, 2 ranks
    lengths = long_tailed_lengths(256, seed=11)
    minis = first_epoch_minibatches(256, torch.Generator().manual_seed(5), 64)
    order = balanced_positions(lengths, 2, minis)
    assert sorted(order) == list(range(256))
    for positions in minis:
        assert sorted(order[p] for p in positions) == sorted(positions)  # the same rows
        shares = [
            sum(lengths[order[p]] for p in positions if (p < 128) == (r == 0)) for r in (0, 1)
        ]
        before = [sum(lengths[p] for p in positions if (p < 128) == (r == 0)) for r in (0, 1)]
        assert imbalance(shares) <= max(0.1, imbalance(before)), (shares, before)

    # on average far more even than the rows as they came
    def mean_imb(rows):
        out = []
        for positions in minis:
            shares = [
                sum(lengths[rows[p]] for p in positions if (p < 128) == (r == 0)) for r in (0, 1)
            ]
            out.append(imbalance(shares))
        return sum(out) / len(out)

    assert mean_imb(order) < 0.01 < 0.1 < mean_imb(list(range(256)))


def test_balancing_two_ranks_evens_tokens():
    batch = make_batch(n=32, seed=8)
    _, before = balance_for_ranks(batch, 2, False)
    moved, after = balance_for_ranks(batch, 2, True)
    assert after["perf/dp_token_imbalance"] < before["perf/dp_token_imbalance"]
    assert after["perf/dp_token_imbalance"] <= 0.03
    rows = sorted(moved["input_ids"].tolist())
    assert rows == sorted(batch["input_ids"].tolist())  # a permutation of the rows


# --- 2 gloo ranks ---------------------------------------------------------------------------------
def rank_main(rank: int, port: int, workdir: str) -> None:
    from hybridrl.parallel.distributed import teardown_distributed

    torch.set_num_threads(1)
    work = Path(workdir)
    batch = Batch(torch.load(work / "batch.pt", weights_only=True))
    lrn = learner(True, WORLD, rank, port)
    part = batch.chunk(WORLD)[rank]
    logp = lrn.compute_log_prob(part)["old_log_probs"]
    metrics = lrn.update_actor(part | Batch({"old_log_probs": logp, "ref_log_probs": logp * 0.9}))
    from hybridrl.parallel.fsdp import full_state_dict

    state = {k: v.clone() for k, v in full_state_dict(lrn.model).items()}
    lrn.close()
    teardown_distributed()
    if rank == 0:
        torch.save({"weights": state, "metrics": metrics}, work / "ranks.pt")


@pytest.mark.slow
def test_two_rank_packed_balanced_update_equals_one_process(tmp_path):
    single = learner(True)
    batch = make_batch(n=16, seed=9)
    minis = first_epoch_minibatches(
        len(batch), single.actor.shuffle, single.cfg.actor.ppo_minibatch_size
    )
    batch, balance = balance_for_ranks(batch, WORLD, True, minis)
    assert balance["perf/dp_token_imbalance_minibatch"] <= 0.1
    torch.save(batch.tensors, tmp_path / "batch.pt")
    procs = launch_ranks(__file__, WORLD, tmp_path)
    metrics = single.update_actor(update_batch(single, batch))
    ref = weights(single.model)
    wait_ranks(procs, timeout=300)
    got = torch.load(tmp_path / "ranks.pt", weights_only=False)
    assert max((ref[k] - got["weights"][k]).abs().max().item() for k in ref) <= TOL
    # (the padding fraction differs: each rank packs its own rows)
    for key in ("actor/pg_loss", "actor/entropy", "actor/updates"):
        assert abs(metrics[key] - got["metrics"][key]) <= TOL, key


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "rank":
    rank_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
