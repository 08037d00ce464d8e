"""Shared prompts in packed micro-batches: a group's samples share one copy of their prompt.

Why: GRPO-style steps draw several responses per prompt (8 in W1), and the learner's forwards
(reference, old log-probs, the update's forward and backward) would otherwise compute the same
prompt tokens once per sample. With W1-long's 9-token prompts and ~22-token responses that is a
quarter of the tokens fed to the model. Here the samples of a group with identical real prompt ids
are laid out in one packed row as ``prompt, response 1, response 2, ...``: each response token
attends to the shared prompt and to its own response (a block mask given to the model as a 4-D
boolean attention mask), with the position ids it would have alone. Every response token's output,
and the gradient reaching every weight, is then the same quantity as with one copy of the prompt
per sample (to float rounding: other matmul shapes); the prompt's activations receive the sum of
the gradients of all the responses that read them.

Units: a group whose responses do not fit one row is split into units (best-fit decreasing of the
response lengths under a row capacity, each unit with its own copy of the prompt), then the units
are packed into rows and micro-batches like single sequences (``parallel/packing.py``:
``pack_micro_batches``). The capacity is the cheapest, by the plain packing's cost model (positions
fed times ``1 + width x key_cost``), of the one plain packing would choose and the wider
``ROW_CANDIDATES``: short sequences (W1: a 9-token prompt, 5-token answers) share only in rows wider
than the longest sample, while long ones already share within it.

Not used (the plain packed layout instead) with a variable-length attention kernel (it takes the
sequence boundaries from position ids, one sequence per start), or a mixture-of-experts model
(routing replay maps each sample's tokens to its own positions).
"""

from __future__ import annotations

import torch

from hybridrl.parallel.packing import (
    ROW_CANDIDATES,
    PackedLayout,
    best_fit_decreasing,
    choose_capacity,
    gather_positions,
    is_varlen,
    pack_micro_batches,
)
from hybridrl.protocol import Batch

# a micro-batch's column with shared prompts: where each sample's response starts in its row
PACK_RESP = "pack_resp"


def can_share(model) -> bool:
    """Whether ``model``'s forward can take shared prompts (see the module docstring)."""
    from hybridrl.learner.moe import is_moe

    return not is_varlen(model) and not is_moe(model)


def prompt_groups(batch: Batch) -> list[list[int]]:
    """Rows whose real prompt ids are identical, in order of first appearance."""
    P = batch["prompts"].shape[1]
    real = batch["attention_mask"][:, :P].bool()
    groups: dict[tuple[int, ...], list[int]] = {}
    for b, (ids, keep) in enumerate(zip(batch["prompts"].tolist(), real.tolist())):
        key = tuple(i for i, k in zip(ids, keep) if k)
        groups.setdefault(key, []).append(b)
    return list(groups.values())


def worth_sharing(batch: Batch) -> bool:
    """Whether any two rows share a prompt."""
    return len(prompt_groups(batch)) < len(batch)


def shared_plans(
    batch: Batch, token_budget: int, key_cost: float
) -> list[tuple[list[int], list[int], list[int], list[int]]]:
    """Micro-batches as ``(rows of batch, packed row, prompt offset, response offset)``, one entry
    per sample: each unit's prompt at ``prompt offset`` of its packed row, the unit's responses
    back to back after it."""
    attn = batch["attention_mask"]
    P = batch["prompts"].shape[1]
    plens = attn[:, :P].sum(-1).tolist()
    rlens = attn[:, P:].sum(-1).tolist()
    groups = prompt_groups(batch)
    plain = choose_capacity([p + r for p, r in zip(plens, rlens)], token_budget, key_cost)
    best = None
    for cap in [plain] + [c for c in ROW_CANDIDATES if plain < c <= token_budget]:
        units = _units(groups, plens, rlens, cap)
        lengths = [plens[u[0]] + sum(rlens[r] for r in u) for u in units]
        cost = len(best_fit_decreasing(lengths, cap)) * cap * (1.0 + cap * key_cost)
        if best is None or cost < best[0]:
            best = (cost, cap, units, lengths)
    _, cap, units, lengths = best
    out = []
    for plan in pack_micro_batches(lengths, token_budget, capacity=cap, key_cost=key_cost):
        docs, rows, offsets, resp = [], [], [], []
        for u, row, offset in zip(plan.docs, plan.rows, plan.offsets):
            start = offset + plens[units[u][0]]
            for r in units[u]:
                docs.append(r)
                rows.append(row)
                offsets.append(offset)
                resp.append(start)
                start += rlens[r]
        out.append((docs, rows, offsets, resp))
    return out


def _units(
    groups: list[list[int]], plens: list[int], rlens: list[int], cap: int
) -> list[list[int]]:
    """Each group's rows split into units of one prompt copy and the responses that fit ``cap``
    with it (best-fit decreasing of the response lengths)."""
    units: list[list[int]] = []
    for g in groups:
        room = max(cap - plens[g[0]], 1)
        units += [[g[i] for i in b] for b in best_fit_decreasing([rlens[r] for r in g], room)]
    return units


def shared_layout(
    attn: torch.Tensor, n_prompt: int, rows: torch.Tensor, offsets: torch.Tensor, resp: torch.Tensor
) -> PackedLayout:
    """Where each real token goes: prompt token i of sample b at ``offsets[b] + i`` of row
    ``rows[b]`` (the same place for every sample of the unit), response token t at
    ``resp[b] + t``; ``index`` is the position the token has in its own sequence."""
    plen = attn[:, :n_prompt].sum(-1)
    rlen = attn[:, n_prompt:].sum(-1)
    n_rows = int(rows.max()) + 1
    width = max(1, int(torch.maximum(offsets + plen, resp + rlen).max()))
    index = (attn.cumsum(-1) - 1).clamp(min=0)
    col = torch.where(
        index < plen[:, None], offsets[:, None] + index, resp[:, None] + index - plen[:, None]
    )
    return PackedLayout(n_rows, width, rows[:, None] * width + col, index)


def shared_mask(
    layout: PackedLayout, attn: torch.Tensor, n_prompt: int, rows: torch.Tensor, offsets
) -> torch.Tensor:
    """(n_rows, 1, width, width) bool: a token sees the earlier tokens of its unit's prompt and of
    its own response; a padding position sees itself only (no row of the mask is empty)."""
    n = layout.n_rows * layout.width
    real = attn.bool()
    dev = attn.device
    unit = torch.full((n,), -1, dtype=torch.long, device=dev)
    part = torch.full((n,), -1, dtype=torch.long, device=dev)
    unit_of = (rows * layout.width + offsets)[:, None].expand_as(attn)
    in_prompt = layout.index < attn[:, :n_prompt].sum(-1, keepdim=True)
    sample = torch.arange(1, attn.shape[0] + 1, device=dev)[:, None].expand_as(attn)
    unit[layout.flat[real]] = unit_of[real]
    part[layout.flat[real]] = torch.where(in_prompt, 0, sample)[real]
    unit, part = unit.view(layout.n_rows, layout.width), part.view(layout.n_rows, layout.width)
    pos = torch.arange(layout.width, device=dev)
    causal = pos[None, :] <= pos[:, None]
    same_unit = (unit[:, :, None] == unit[:, None, :]) & (unit[:, :, None] >= 0)
    readable = (part[:, None, :] == 0) | (part[:, :, None] == part[:, None, :])
    mask = same_unit & readable & causal
    mask |= torch.eye(layout.width, dtype=torch.bool, device=dev)  # padding: itself
    return mask[:, None]


def shared_forward(model, mb: Batch, rows, offsets, resp, pad_id: int = 0) -> torch.Tensor:
    """(B, R, D): the model's output at the position that predicts each response token (the
    unit's last prompt token for the first, the sample's previous response token after it)."""
    input_ids, attn = mb["input_ids"], mb["attention_mask"]
    n_prompt = mb["prompts"].shape[1]
    R = mb["responses"].shape[1]
    layout = shared_layout(attn, n_prompt, rows, offsets, resp)
    mask = shared_mask(layout, attn, n_prompt, rows, offsets)
    out = model(
        input_ids=layout.scatter(input_ids, attn, pad_id),
        position_ids=layout.position_ids(attn),
        attention_mask=mask,
        use_cache=False,
    ).logits
    t = torch.arange(R, device=attn.device)
    last_prompt = layout.flat[:, n_prompt - 1]
    idx = torch.where(t == 0, last_prompt[:, None], (rows * layout.width + resp)[:, None] + t - 1)
    return gather_positions(out, idx.clamp(0, layout.n_rows * layout.width - 1))


def shared_tokens(mb: Batch, rows, offsets, resp) -> tuple[int, int]:
    """(token positions fed, real ones among them): each shared prompt counted once."""
    attn = mb["attention_mask"]
    layout = shared_layout(attn, mb["prompts"].shape[1], rows, offsets, resp)
    return layout.n_rows * layout.width, int(layout.flat[attn.bool()].unique().numel())
