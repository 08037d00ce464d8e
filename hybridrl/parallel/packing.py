"""Sequence packing and data-parallel token balancing.

**Packing.** A micro-batch padded to its longest row wastes compute on padding, and long-tailed
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

Row width. Rows hold at least ``MIN_ROW_TOKENS`` (128, at most the token budget) or the longest
sequence, whichever is more: short sequences (W1's are 7-18 tokens) then share rows instead of each
being padded to the longest, and long ones (W3's reach 200) set the width themselves. The width is
then fitted (:func:`plan_rows`): among the row counts best-fit decreasing reaches with rows up to
``ROW_WIDEN`` (1.25) times that capacity, the one with the fewest padded tokens, each at the
smallest width that still holds it. Rows of exactly the capacity leave about half a row of padding
per micro-batch; a few percent wider rows leave almost none. Wider rows cost more only in the
attention, which on CPU (SDPA with the block-diagonal mask) is dense over the row: on the tiny
model the attention of a 256-token row is about a quarter of the cost of a token, so rows are not
made wider than the padding they save.

**Balancing.** Data-parallel ranks each take a contiguous share of the step's rows. With long-tailed
lengths, one rank can get most of the long sequences and the others wait for it. The
*Karmarkar-Karp* largest-differencing method partitions the sequences into k sets of (nearly) equal
token sums, with equal set sizes when asked; :func:`balanced_order` turns that into a permutation
of the rows after which each rank's contiguous chunk is one set.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# attention implementations whose kernel takes variable-length sequences: the packed micro-batch
# goes in as one row (no padding at all), the sequence starts read from the position ids
# packed rows hold at least this many tokens (unless the token budget is smaller): short sequences
# share rows, so the width of a micro-batch is not that of its longest sequence (see row_capacity)
MIN_ROW_TOKENS = 128
# rows may grow this much past the capacity when that saves padding (plan_rows)
ROW_WIDEN = 1.25
VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3", "kernels-community/flash-attn")


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


def karmarkar_karp(lengths: Sequence[int], k: int, equal_size: bool = False) -> list[list[int]]:
    """``k`` sets of item indices with nearly equal length sums (largest differencing method).

    Each item starts as a partial solution (k sets, the item in one of them); the two partial
    solutions with the largest spread (largest sum minus smallest) are merged by pairing the
    largest set of one with the smallest of the other, until one remains. ``equal_size``: the
    items are taken in sorted groups of k, one per set, so that set sizes differ by at most one
    (zero-length fillers complete the last group and are dropped). Deterministic."""
    if k < 1:
        raise ValueError(f"karmarkar_karp: k must be >= 1, got {k}")
    items = [(int(n), i) for i, n in enumerate(lengths)]
    if equal_size:
        items += [(0, -1)] * (-len(items) % k)
        items.sort()
        starts = [items[j : j + k] for j in range(0, len(items), k)]
        states = [[(n, [i] if i >= 0 else []) for n, i in group] for group in starts]
    else:
        states = [[(n, [i])] + [(0, [])] * (k - 1) for n, i in items]
    heap = []
    for count, state in enumerate(states):
        sums = [s for s, _ in state]
        heapq.heappush(heap, (-(max(sums) - min(sums)), count, state))
    count = len(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        a = sorted(a, key=lambda s: -s[0])
        b = sorted(b, key=lambda s: s[0])
        merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, b)]
        sums = [s for s, _ in merged]
        heapq.heappush(heap, (-(max(sums) - min(sums)), count, merged))
        count += 1
    final = heap[0][2] if heap else [(0, [])] * k
    return [sorted(items_) for _, items_ in final]


def balanced_order(lengths: Sequence[int], k: int) -> list[int]:
    """A permutation of the rows after which ``Batch.chunk(k)`` gives every part (nearly) the same
    token sum: a Karmarkar-Karp partition with equal set sizes, the larger sets first (``chunk``
    gives the first ``n % k`` parts one row more), each set in its original row order."""
    sets = karmarkar_karp(lengths, k, equal_size=True)
    sets.sort(key=lambda s: -len(s))  # stable: among equal sizes the partition's own order
    return [i for s in sets for i in s]


def imbalance(tokens: Sequence[float]) -> float:
    """max / mean - 1 of the token counts per rank (0: perfectly even, or no tokens)."""
    mean = sum(tokens) / len(tokens) if tokens else 0.0
    return max(tokens) / mean - 1.0 if mean > 0 else 0.0


def chunk_sizes(n: int, k: int) -> list[int]:
    """The part sizes of ``Batch.chunk(k)`` on ``n`` rows."""
    size, rem = divmod(n, k)
    return [size + (1 if r < rem else 0) for r in range(k)]


# --- micro-batches of packed rows --------------------------------------------------------------
@dataclass
class PackedMicroBatch:
    """The sequences of one micro-batch (indices into the packed batch), the row each one is in and
    its first position in that row."""

    docs: list[int]
    rows: list[int]
    offsets: list[int]


def row_capacity(lengths: Sequence[int], token_budget: int, min_row: int = MIN_ROW_TOKENS) -> int:
    """The row capacity packing aims at: ``min_row`` tokens (at most the budget), or the longest
    sequence when it is longer (see the module docstring)."""
    return max([int(n) for n in lengths] + [min(min_row, token_budget), 1])


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
    """``(bins, width)``: the rows of :func:`best_fit_decreasing` with the fewest padded tokens
    (rows x width) over row counts from what ``capacity`` needs down to what ``widen`` x
    ``capacity`` allows, each at the smallest width that fits that many rows.

    Why: rows of exactly ``capacity`` leave on average half a row of padding (the last row, and
    every row's gap when the longest sequence sets the capacity); one row fewer, each a few
    percent wider, often packs with almost none, and a wider row only costs attention in
    proportion."""
    total = sum(int(n) for n in lengths)
    longest = max([int(n) for n in lengths] + [1])
    capacity = max(capacity, longest)  # a row holds at least the longest sequence
    bins, width = best_fit_decreasing(lengths, capacity), capacity
    fewest = -(-total // max(int(capacity * widen), 1))
    best = (len(bins) * capacity, bins, width)
    for rows in range(len(bins), max(fewest, 1) - 1, -1):
        found = _fewest_width(lengths, rows, max(longest, -(-total // rows)), int(capacity * widen))
        if found is not None:
            fed = len(found[0]) * found[1]
            best = min(best, (fed, found[0], found[1]), key=lambda x: (x[0], x[2]))
    return best[1], best[2]


def pack_micro_batches(
    lengths: Sequence[int], token_budget: int, capacity: int | None = None
) -> list[PackedMicroBatch]:
    """Sequences of ``lengths`` packed into rows by best-fit decreasing (:func:`plan_rows` from
    ``capacity``, default :func:`row_capacity`), the rows (fullest first) cut into micro-batches of
    ``token_budget // width`` rows (at least one), so that rows x width stays within the budget."""
    capacity = capacity or row_capacity(lengths, token_budget)
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
    """Whether the model's attention kernel takes variable-length sequences in one row."""
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None) in VARLEN_ATTENTION


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


# --- balancing the data-parallel ranks' shares ---------------------------------------------------
def balance_for_ranks(batch, ranks: int, enabled: bool = True):
    """``(batch, metrics)``: with ``enabled`` and more than one data-parallel rank, the batch's rows
    reordered (:func:`balanced_order` over each row's real tokens) so that each rank's contiguous
    chunk (``Batch.chunk(ranks)``, as the learner's per-row passes and updates cut it) holds an
    equal token count; otherwise the batch as it is. ``perf/dp_token_imbalance``: max / mean - 1
    of the tokens per rank, after the reordering (0 with one rank).

    The reordering only decides which rank computes which rows: the update over the reordered
    batch on k ranks equals the single-process update over the reordered batch (the mini-batch
    shuffle is drawn over global rows), and one rank is left untouched."""
    lengths = batch["attention_mask"].sum(-1).tolist() if len(batch) else []
    if enabled and ranks > 1 and len(batch) > 1:
        order = balanced_order(lengths, ranks)
        batch, lengths = batch.index(order), [lengths[i] for i in order]
    bounds = [0]
    for size in chunk_sizes(len(lengths), max(ranks, 1)):
        bounds.append(bounds[-1] + size)
    per_rank = [float(sum(lengths[a:b])) for a, b in zip(bounds, bounds[1:])]
    return batch, {"perf/dp_token_imbalance": imbalance(per_rank)}
