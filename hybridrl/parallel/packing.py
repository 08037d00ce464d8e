"""Sequence packing: whole sequences in rows, and the forward that keeps them apart.

A micro-batch padded to its longest row wastes compute on padding, and long-tailed
response lengths make that waste large. Packing places whole sequences (their real tokens: the
prompt without its left padding, then the response without its right padding) one after another in
rows of a fixed capacity, by *best-fit decreasing* (longest first, each into the row whose free
space it fills best), then cuts the rows into micro-batches under the token budget. A sequence is
never split across rows: its tokens only ever attend to themselves. Each packed row carries
per-sequence position ids that restart at 0; attention stays inside each sequence because the model
is called with those position ids and no 2-D attention mask, which transformers (5.x) reads as the
packed format: SDPA and eager attention get a block-diagonal causal mask, FlexAttention a block
mask, and flash attention the variable-length kernel with the sequence boundaries taken from the
position ids (for it the micro-batch is laid out as one row, see :func:`packed_forward`). The
detection needs ``use_cache=False``: with a KV cache transformers takes the position ids as plain
offsets and the sequences of a row would attend to each other.

Row width (:func:`choose_capacity`, :func:`plan_rows`). A wide row pads little but, with a dense
masked attention (SDPA on CPU), makes each token attend over the whole row; a row as long as the
longest sequence keeps attention cheap but leaves short, uniform sequences padded. The capacity is
the cheapest of the longest sequence and the powers of two above it (within the token budget),
counting each padded position at ``1 + width x key_cost``, where ``key_cost`` is what one more
attended key costs a token relative to its projections and MLP (about 1 / (6 x hidden); 0 with a
variable-length kernel). Then the width is fitted: rows of exactly the capacity leave about half a
row of padding per micro-batch, so packing also tries the fewest rows that rows up to ``ROW_WIDEN``
(1.25) times the capacity allow, each row count at the smallest width that best-fit decreasing
still fits, and keeps the layout with the fewest padded positions.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# balancing lived here first; a learner that still imports it from here keeps working
from hybridrl.parallel.batch_balance import balance_for_ranks  # noqa: F401

# row capacities tried above the longest sequence (within the token budget; choose_capacity)
ROW_CANDIDATES = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# rows may grow this much past the capacity when that saves padding (plan_rows)
ROW_WIDEN = 1.25
# attention implementations whose name holds this take variable-length sequences: the packed
# micro-batch goes in as one row (no padding at all), the sequence starts read from the position
# ids (flash_attention_2, flash_attention_3, kernels-community/flash-attn ...)
VARLEN_ATTENTION = "flash"


# --- the algorithms -------------------------------------------------------------------------------
def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of item indices whose lengths sum to at most ``capacity`` each (an item longer than
    ``capacity`` gets a bin of its own). Items are placed longest first, each into the bin with the
    least free space that still holds it (ties: the older bin); O(n log n)."""
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free space, bin index), sorted
    for i in order:
        n = int(lengths[i])
        at = bisect.bisect_left(free, (n, -1))
        if at < len(free):
            space, b = free.pop(at)
            bins[b].append(i)
            bisect.insort(free, (space - n, b))
        else:
            bins.append([i])
            if capacity > n:
                bisect.insort(free, (capacity - n, len(bins) - 1))
    return bins


# --- micro-batches of packed rows --------------------------------------------------------------
@dataclass
class PackedMicroBatch:
    """The sequences of one micro-batch (indices into the packed lengths, the batch's rows), the row
    each one is in and its first position in that row."""

    docs: list[int]
    rows: list[int]
    offsets: list[int]


def _fewest_width(lengths: Sequence[int], rows: int, lo: int, hi: int):
    """``(bins, c)``: best-fit decreasing at the smallest capacity c in [lo, hi] that packs into at
    most ``rows`` rows (binary search; the bin count falls as the capacity grows), or None when
    even ``hi`` needs more."""
    best = best_fit_decreasing(lengths, hi)
    if len(best) > rows:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        trial = best_fit_decreasing(lengths, mid)
        if len(trial) <= rows:
            best, hi = trial, mid
        else:
            lo = mid + 1
    return best, hi


def plan_rows(
    lengths: Sequence[int], capacity: int, widen: float = ROW_WIDEN
) -> tuple[list[list[int]], int]:
    """``(bins, width)``: rows of :func:`best_fit_decreasing` with the fewest padded positions
    (rows x width): the row count ``capacity`` needs, and the fewest (and one more) that rows up
    to ``widen`` x ``capacity`` allow, each at the smallest width that still fits that many rows.

    Why: rows of exactly ``capacity`` leave on average half a row of padding (the last row, and
    every row's gap when the longest sequence sets the capacity); one row fewer, each a few
    percent wider, often packs with almost none, and a wider row only costs attention in
    proportion."""
    total = sum(int(n) for n in lengths)
    longest = max([int(n) for n in lengths] + [1])
    capacity = max(capacity, longest)  # a row holds at least the longest sequence
    widest = max(capacity, int(capacity * widen))
    at_capacity = len(best_fit_decreasing(lengths, capacity))
    fewest = len(best_fit_decreasing(lengths, widest))
    best = None
    for rows in sorted({fewest, fewest + 1, at_capacity}):
        top = capacity if rows >= at_capacity else widest
        found = _fewest_width(lengths, rows, min(top, max(longest, -(-total // rows))), top)
        if found is not None and (best is None or len(found[0]) * found[1] < best[0]):
            best = (len(found[0]) * found[1], found[0], found[1])
    return best[1], best[2]


def choose_capacity(lengths: Sequence[int], token_budget: int, key_cost: float) -> int:
    """The row capacity with the least estimated cost among the longest sequence and the
    ``ROW_CANDIDATES`` above it (within the budget): positions fed (rows x capacity of
    best-fit decreasing) times ``1 + capacity x key_cost``, ``key_cost`` being what attending to
    one more key costs a token relative to the rest of its forward (:func:`attention_key_cost`).
    Wide rows pad less but, with a dense masked attention, make every token attend over the whole
    row; short uniform sequences (W1) pad little to begin with and are best left in short rows."""
    longest = max([int(n) for n in lengths] + [1])
    options = [longest] + [c for c in ROW_CANDIDATES if longest < c <= token_budget]

    def cost(c: int) -> float:
        return len(best_fit_decreasing(lengths, c)) * c * (1.0 + c * key_cost)

    return min(options, key=lambda c: (cost(c), c))


def attention_key_cost(model) -> float:
    """What one more attended key costs a token relative to the rest of its forward: about
    2 x hidden multiply-adds against about 12 x hidden^2 for its projections and MLP, so
    1 / (6 x hidden); 0 for a variable-length kernel (one row, no masked-out work) or a model
    without a ``hidden_size``."""
    if is_varlen(model):
        return 0.0
    for module in model.modules():
        hidden = getattr(getattr(module, "config", None), "hidden_size", None)
        if hidden:
            return 1.0 / (6.0 * hidden)
    return 0.0


def pack_micro_batches(
    lengths: Sequence[int], token_budget: int, capacity: int | None = None, key_cost: float = 0.0
) -> list[PackedMicroBatch]:
    """Sequences of ``lengths`` packed into rows by best-fit decreasing (:func:`plan_rows` from
    ``capacity``, default :func:`choose_capacity` with ``key_cost``), the rows (fullest first) cut
    into micro-batches of ``token_budget // width`` rows (at least one), so that rows x width stays
    within the budget."""
    capacity = capacity or choose_capacity(lengths, token_budget, key_cost)
    bins, capacity = plan_rows(lengths, capacity)
    fill = [sum(int(lengths[i]) for i in b) for b in bins]
    bins = [bins[j] for j in sorted(range(len(bins)), key=lambda j: (-fill[j], j))]
    per_mb = max(1, token_budget // capacity)
    out = []
    for start in range(0, len(bins), per_mb):
        mb = PackedMicroBatch([], [], [])
        for row, b in enumerate(bins[start : start + per_mb]):
            offset = 0
            for i in b:
                mb.docs.append(i)
                mb.rows.append(row)
                mb.offsets.append(offset)
                offset += int(lengths[i])
        out.append(mb)
    return out


# --- the packed forward ---------------------------------------------------------------------------
def is_varlen(model) -> bool:
    """Whether the model's attention kernel takes variable-length sequences in one row: the first
    config found on the model or a wrapped module inside it (LoRA, FSDP) decides. A flash kernel
    must get one row: given several rows and no mask it would attend across the sequences."""
    for module in model.modules():
        impl = getattr(getattr(module, "config", None), "_attn_implementation", None)
        if impl is not None:
            return VARLEN_ATTENTION in str(impl)
    return False


@dataclass
class PackedLayout:
    """Where each real token of a ``(B, T)`` left/right-padded block goes in the packed
    ``(n_rows, width)`` tensors: ``flat[b, t]`` is its index in the flattened packed tensor (valid
    where ``attention_mask`` is 1), ``index[b, t]`` its position inside its sequence."""

    n_rows: int
    width: int
    flat: torch.Tensor
    index: torch.Tensor

    def scatter(self, values: torch.Tensor, attn: torch.Tensor, fill) -> torch.Tensor:
        """``values`` (B, T) at their packed places, ``fill`` elsewhere."""
        out = torch.full((self.n_rows * self.width,), fill, dtype=values.dtype)
        keep = attn.bool()
        out = out.to(values.device)
        out[self.flat[keep]] = values[keep]
        return out.view(self.n_rows, self.width)

    def position_ids(self, attn: torch.Tensor) -> torch.Tensor:
        """Per-sequence positions (restarting at 0); padding continues the row's own count, which
        can only follow the row's last sequence (causal attention: nothing real attends to it)."""
        base = torch.arange(self.width, device=attn.device).repeat(self.n_rows)
        base[self.flat[attn.bool()]] = self.index[attn.bool()]
        return base.view(self.n_rows, self.width)


def packed_layout(
    attn: torch.Tensor, rows: torch.Tensor, offsets: torch.Tensor, one_row: bool = False
) -> PackedLayout:
    """The layout of a micro-batch whose sequence b (its real tokens, where ``attn`` is 1) starts
    at ``offsets[b]`` of row ``rows[b]``; ``one_row``: every sequence back to back in a single row
    instead (variable-length kernels)."""
    lens = attn.sum(-1)
    if one_row:
        rows = torch.zeros_like(rows)
        offsets = lens.cumsum(0) - lens
    n_rows = int(rows.max()) + 1 if len(rows) else 1
    width = max(1, int((offsets + lens).max())) if len(rows) else 1
    index = (attn.cumsum(-1) - 1).clamp(min=0)
    flat = rows[:, None] * width + offsets[:, None] + index
    return PackedLayout(n_rows, width, flat, index)


def packed_forward(model, input_ids: torch.Tensor, attn: torch.Tensor, rows, offsets, pad_id: int):
    """``(outputs, layout)``: the model's per-position output (``.logits``) on the packed rows,
    ``(n_rows, width, D)``. Attention is kept inside each sequence by passing per-sequence position
    ids and no attention mask (see the module docstring); a flash-attention model gets one row."""
    layout = packed_layout(attn, rows, offsets, one_row=is_varlen(model))
    ids = layout.scatter(input_ids, attn, pad_id)
    pos = layout.position_ids(attn)
    out = model(input_ids=ids, position_ids=pos, attention_mask=None, use_cache=False).logits
    return out, layout


def response_positions(layout: PackedLayout, attn: torch.Tensor, resp_len: int) -> torch.Tensor:
    """(B, resp_len) indices into the flattened packed output: for response token t of sequence b,
    the position that predicts it, the token before it (the last prompt token for t = 0: prompts
    are left-padded, so column P - 1 is real). Positions past a sequence's response point at some
    real position; the caller masks them, as it masks padding unpacked."""
    first = layout.flat[:, attn.shape[1] - resp_len - 1]
    idx = first[:, None] + torch.arange(resp_len, device=attn.device)
    return idx.clamp(0, layout.n_rows * layout.width - 1)


def gather_positions(outputs: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``outputs`` (n_rows, width, D) at the flat indices ``idx`` (B, R): (B, R, D)."""
    flat = outputs.reshape(-1, outputs.shape[-1])
    return flat.index_select(0, idx.reshape(-1)).view(*idx.shape, outputs.shape[-1])
