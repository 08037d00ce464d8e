"""Token log-probs of responses under a causal LM, in micro-batches under a token budget.

Layout (veRL-style): ``input_ids = prompts (left-padded) ++ responses
(right-padded)``, ``attention_mask`` marks real tokens, ``response_mask``
marks real response tokens. Log-prob of response token t comes from the
logits at position P + t - 1.

Data parallel (world size > 1, FSDP2): every rank must run the same number of
forwards (each one all-gathers the sharded layers), so :func:`dp_micro_batches`
pads a rank's list with *dummy* micro-batches (one row, ``response_mask`` all
zero) up to the largest count over the ranks; their outputs are dropped.

Packing (``actor.packing``, ``parallel/packing.py``): instead of length groups, a micro-batch holds
whole sequences packed into rows (best-fit decreasing), with each sequence's row and offset in the
columns ``pack_row`` and ``pack_offset``; :func:`response_outputs` runs the packed forward and
gathers each response token's output back to the ``(B, R)`` layout, so everything after the forward
(filters, log-probs, losses, metrics) sees the same tensors as unpacked.

Distribution: log-probs are taken under the distribution the rollout samples from, the logits
filtered by the rollout's temperature, top-k, top-p and min-p (:func:`sampling_of`), with the
sampler's own filter code (``sampling.py``). The engine's behaviour log-probs and these are
then the same quantity, and at equal weights an importance ratio between them is 1. The entropy is
that distribution's too (see docs/algorithms.md, "Filtered log-probs").

Precision: the forward runs under the model's autocast mark (CPU bf16, ``parallel/precision.py``);
its logits are cast to fp32 before any log-softmax, so log-probs, ratios and the KL are fp32 math.
"""

from __future__ import annotations

import torch

from hybridrl.algorithms.masking import zero_pad
from hybridrl.learner.moe import ROUTING, moe_forward
from hybridrl.learner.prefix_share import (
    PACK_RESP,
    can_share,
    shared_forward,
    shared_plans,
    shared_tokens,
    worth_sharing,
)
from hybridrl.parallel import distributed
from hybridrl.parallel.packing import (
    attention_key_cost,
    gather_positions,
    pack_micro_batches,
    packed_forward,
    response_positions,
)
from hybridrl.parallel.precision import autocast
from hybridrl.protocol import Batch
from hybridrl.sampling import SamplingParams, filtered_log_softmax

# a packed micro-batch's columns: each sequence's row and first position in the packed rows
PACK_ROW, PACK_OFFSET = "pack_row", "pack_offset"


def sampling_of(rollout_cfg) -> SamplingParams:
    """The rollout's sampling distribution (``rollout.*``), whose filters the trainer applies. The
    rollout config has no ``min_p`` key: rollouts sample with SamplingParams' default (0, off), and
    so does this."""
    return SamplingParams.of(rollout_cfg)


def _as_sampling(sampling) -> SamplingParams:
    """A number is a temperature without filters (0: the raw softmax, as for greedy rollouts)."""
    return (
        SamplingParams(temperature=float(sampling))
        if isinstance(sampling, (int, float))
        else sampling
    )


def length_buckets(lengths: torch.Tensor, token_budget: int) -> list[torch.Tensor]:
    """Row indices in groups of similar length (shortest first) whose padded size, rows x longest,
    stays within ``token_budget`` (at least one row each): long-tailed lengths are not all padded to
    the longest."""
    order = torch.argsort(lengths, stable=True)
    groups, start = [], 0
    for end in range(1, len(order) + 1):
        if end == len(order) or (end + 1 - start) * int(lengths[order[end]]) > token_budget:
            groups.append(order[start:end])
            start = end
    return groups


def trim(mb: Batch) -> Batch:
    """``mb`` without the columns that are padding in every row (the prompts' common left padding,
    the responses' common right padding). Positions come from the attention mask: the outputs are
    unchanged."""
    P, R = mb["prompts"].shape[1], mb["responses"].shape[1]
    attn = mb["attention_mask"]
    # the responses' real length, not the loss mask's count: a 0 inside a loss mask (a tool's
    # output) is still a token whose successors are trained
    p, r = int(attn[:, :P].sum(-1).max()), max(1, int(attn[:, P:].sum(-1).max()))
    if (p, r) == (P, R):
        return mb
    out = {}
    for key, t in mb.tensors.items():
        if key in ("input_ids", "attention_mask", ROUTING):  # routing: per input token
            out[key] = t[:, P - p : P + r]
        elif key == "prompts":
            out[key] = t[:, P - p :]
        # response-shaped: log-probs, masks, advantages, versions ...
        elif t.dim() >= 2 and t.shape[1] == R:
            out[key] = t[:, :r]
        else:
            out[key] = t
    return Batch(out, mb.meta)


def micro_batches(
    batch: Batch,
    token_budget: int,
    packing: bool = False,
    key_cost: float = 0.0,
    share_prompts: bool = False,
) -> tuple[list[Batch], torch.Tensor]:
    """``(micro-batches, order)``: rows grouped by length (:func:`length_buckets`) and trimmed
    (:func:`trim`), or with ``packing`` whole sequences packed into rows
    (:func:`packed_micro_batches`, rows chosen with the model's ``key_cost``,
    ``parallel/packing.py``: ``attention_key_cost``), with ``share_prompts`` a group's samples
    sharing one copy of their prompt (``learner/prefix_share.py``); ``order`` lists the rows in the
    order the micro-batches hold them."""
    if packing and share_prompts and worth_sharing(batch):
        return shared_micro_batches(batch, token_budget, key_cost)
    if packing:
        return packed_micro_batches(batch, token_budget, key_cost)
    P = batch["prompts"].shape[1]
    # each row's padded width: the longest prompt plus its own response, every token of which is
    # fed, also those the loss mask leaves out (a multi-turn row's tool output)
    attn = batch["attention_mask"]
    lengths = attn[:, :P].sum(-1).max() + attn[:, P:].sum(-1)
    groups = length_buckets(lengths, token_budget)
    return [trim(batch.index(idx)) for idx in groups], torch.cat(groups) if groups else torch.zeros(
        0, dtype=torch.long
    )


def packed_micro_batches(
    batch: Batch, token_budget: int, key_cost: float = 0.0
) -> tuple[list[Batch], torch.Tensor]:
    """:func:`micro_batches` with packing: each sequence's real tokens (prompt without its left
    padding, response without its right padding) packed into rows (``parallel/packing.py``:
    ``pack_micro_batches``); each micro-batch is the batch's rows of its sequences, trimmed, with
    their ``pack_row`` and ``pack_offset``."""
    lengths = batch["attention_mask"].sum(-1).tolist()
    mbs, order = [], []
    for plan in pack_micro_batches(lengths, token_budget, key_cost=key_cost):
        where = Batch(
            {
                PACK_ROW: torch.tensor(plan.rows, dtype=torch.long),
                PACK_OFFSET: torch.tensor(plan.offsets, dtype=torch.long),
            }
        )
        mbs.append(trim(batch.index(plan.docs)) | where)
        order += plan.docs
    return mbs, torch.tensor(order, dtype=torch.long)


def shared_micro_batches(
    batch: Batch, token_budget: int, key_cost: float = 0.0
) -> tuple[list[Batch], torch.Tensor]:
    """:func:`packed_micro_batches` with each group's samples sharing one copy of their prompt
    (``learner/prefix_share.py``): the rows also carry ``pack_resp``, where each response
    starts."""
    mbs, order = [], []
    for docs, rows, offsets, resp in shared_plans(batch, token_budget, key_cost):
        where = Batch(
            {
                PACK_ROW: torch.tensor(rows, dtype=torch.long),
                PACK_OFFSET: torch.tensor(offsets, dtype=torch.long),
                PACK_RESP: torch.tensor(resp, dtype=torch.long),
            }
        )
        mbs.append(trim(batch.index(docs)) | where)
        order += docs
    return mbs, torch.tensor(order, dtype=torch.long)


def token_counts(mb: Batch) -> tuple[int, int]:
    """``(fed, real)``: the token positions a forward of ``mb`` computes (the packed rows x their
    width, or the micro-batch's padded rectangle) and the distinct real tokens among them (a
    shared prompt once)."""
    if PACK_RESP in mb:
        return shared_tokens(mb, mb[PACK_ROW], mb[PACK_OFFSET], mb[PACK_RESP])
    real = int(mb["attention_mask"].sum())
    if PACK_ROW not in mb:
        return mb["input_ids"].numel(), real
    lens = mb["attention_mask"].sum(-1)
    return (int(mb[PACK_ROW].max()) + 1) * int((mb[PACK_OFFSET] + lens).max()), real


def dummy_micro_batch(batch: Batch) -> Batch:
    """One row that contributes nothing: the first row of ``batch`` (zeros when it has none) with an
    all-zero ``response_mask`` and a full ``attention_mask``."""
    if len(batch):
        mb = batch.index(slice(0, 1))
        tensors = dict(mb.tensors)
    else:
        tensors = {
            k: torch.zeros((1,) + tuple(t.shape[1:]), dtype=t.dtype)
            for k, t in batch.tensors.items()
        }
        tensors["attention_mask"] = torch.ones_like(tensors["attention_mask"])
    tensors["response_mask"] = torch.zeros_like(tensors["response_mask"])
    return Batch(tensors)


def dp_micro_batches(
    batch: Batch,
    token_budget: int,
    pad_from: Batch | None = None,
    packing: bool = False,
    key_cost: float = 0.0,
    share_prompts: bool = False,
) -> tuple[list[Batch], int, torch.Tensor]:
    """``(micro-batches, n_real, order)``: :func:`micro_batches` of this rank's rows, padded with
    dummies (made from ``pad_from``, default ``batch``) to the largest count over the ranks (a
    collective when the world size is > 1; world size 1: no padding)."""
    mbs, order = (
        micro_batches(batch, token_budget, packing, key_cost, share_prompts)
        if len(batch)
        else ([], None)
    )
    n = len(mbs)
    if distributed.world_size() > 1:
        most = int(distributed.all_reduce([n], op="max")[0].item())
        mbs = mbs + [
            dummy_micro_batch(batch if pad_from is None else pad_from) for _ in range(most - n)
        ]
    return mbs, n, order


def response_outputs(model, mb: Batch) -> torch.Tensor:
    """(B, R, D): the model's output (``.logits``) at the position that predicts each response
    token, P + t - 1; a packed micro-batch (``pack_row`` in it) runs the packed forward and is
    gathered back to this layout. Under the model's autocast mark (``parallel/precision.py``)."""
    input_ids, attn = mb["input_ids"], mb["attention_mask"]
    resp_len = mb["responses"].shape[1]
    # MoE: replays the micro-batch's recorded routing when marked, notes loads and router logits
    with autocast(model), moe_forward(model, mb):  # bf16 matmuls when the model is marked for it
        if PACK_RESP in mb:  # shared prompts
            return shared_forward(model, mb, mb[PACK_ROW], mb[PACK_OFFSET], mb[PACK_RESP])
        if PACK_ROW in mb:
            out, layout = packed_forward(
                model, input_ids, attn, mb[PACK_ROW], mb[PACK_OFFSET], pad_id=0
            )
            return gather_positions(out, response_positions(layout, attn, resp_len))
        position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
        logits = model(
            input_ids=input_ids, attention_mask=attn, position_ids=position_ids, use_cache=False
        ).logits
    return logits[:, -resp_len - 1 : -1]


def response_log_probs(
    model, mb: Batch, sampling: SamplingParams | float = 1.0, with_entropy: bool = False
):
    """(log_probs, entropy or None), each (B, R), zero where ``response_mask`` is 0, under the
    distribution ``sampling`` describes (a SamplingParams, or a bare temperature)."""
    responses = mb["responses"]
    # the loss math (log-softmax, ratios, KL) stays fp32
    logits = response_outputs(model, mb).float()
    logp_all = filtered_log_softmax(logits, _as_sampling(sampling), responses)
    mask = mb["response_mask"]
    # zero_pad is a where, not a product: a padding position's token may be filtered out
    # (-inf * 0 is NaN)
    logp = zero_pad(logp_all.gather(-1, responses.unsqueeze(-1)).squeeze(-1), mask)
    entropy = None
    if with_entropy:
        # filtered tokens have p = 0 and log p = -inf; their term is 0 (and so is its gradient)
        ent = -(logp_all.exp() * logp_all.masked_fill(torch.isinf(logp_all), 0.0)).sum(-1)
        entropy = zero_pad(ent, mask)
    return logp, entropy


def response_sum_pi_squared(model, mb: Batch, sampling: SamplingParams | float = 1.0):
    """(B, R): sum_v π(v)² of the distribution ``sampling`` describes at each response position,
    zero where ``response_mask`` is 0 (the optimal token baselines' path-variance proxy reads it
    with the sampled token's π)."""
    logits = response_outputs(model, mb).float()
    probs = filtered_log_softmax(logits, _as_sampling(sampling), mb["responses"]).exp()
    return zero_pad(probs.square().sum(-1), mb["response_mask"])


def model_device(model) -> torch.device:
    """Where a micro-batch must go: the compute device (a sharded model's parameters may be
    CPU-offloaded)."""
    from hybridrl.parallel.fsdp import is_sharded

    return distributed.compute_device() if is_sharded(model) else next(model.parameters()).device


@torch.no_grad()
def batch_map(model, batch: Batch, token_budget: int, fn, packing: bool = False) -> torch.Tensor:
    """``cat(fn(model, mb))`` over this rank's micro-batches (on the model's device, result on the
    CPU), packed with ``packing``; the ranks of a sharded model run in lockstep (dummy
    micro-batches pad the shorter ranks)."""
    model.eval()
    device = model_device(model)
    key_cost = attention_key_cost(model) if packing else 0.0
    share = packing and can_share(model)
    mbs, n_real, order = dp_micro_batches(batch, token_budget, None, packing, key_cost, share)
    out = torch.zeros(tuple(batch["responses"].shape), dtype=torch.float32)
    row = 0
    for i, mb in enumerate(mbs):
        part = fn(model, mb.to(device) if device.type != "cpu" else mb)
        if i < n_real:  # back to the batch's rows and full response width
            out[order[row : row + part.shape[0]], : part.shape[1]] = part.float().cpu()
            row += part.shape[0]
    return out


def batch_log_probs(
    model,
    batch: Batch,
    token_budget: int,
    sampling: SamplingParams | float = 1.0,
    packing: bool = False,
) -> torch.Tensor:
    return batch_map(
        model,
        batch,
        token_budget,
        lambda m, mb: response_log_probs(m, mb, sampling)[0],
        packing=packing,
    )
