"""Balancing the data-parallel ranks: each rank gets an equal share of the step's tokens.

Data-parallel ranks each take a contiguous share of the step's rows (``Batch.chunk``: the learner's
per-row passes, and within each mini-batch of the update the drawn rows that lie in the rank's
share). With long-tailed lengths one rank can get most of the long sequences, and since the ranks
meet at every forward and backward (FSDP's collectives), the others wait for it. The rows are
therefore reordered before any of that (:func:`balance_for_ranks`, ``trainer.balance_batch``), so
that each rank's share of every mini-batch of the update's first epoch holds nearly the same number
of tokens; the mini-batches keep the samples the unbalanced order would give them. The
*Karmarkar-Karp* largest-differencing method makes the partition where the ranks' shares have equal
sizes (one mini-batch of the whole batch: the share is the chunk); where a mini-batch's shares have
unequal sizes (the update draws its rows at random) the largest sequence goes first into the share
that misses the most tokens per free slot, and swaps between the fullest and the emptiest share
then even them out.

The reordering only decides which rank computes which rows: the update of the reordered batch on k
ranks equals the single-process update of the reordered batch (the mini-batch shuffle is drawn over
global rows, ``learner/update.py``), and one rank is left untouched.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence


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


def fill_shares(lengths: Sequence[int], sizes: Sequence[int]) -> list[list[int]]:
    """Item indices in ``len(sizes)`` sets of exactly ``sizes`` items with nearly equal length sums:
    Karmarkar-Karp when the sizes are those of ``chunk`` (differing by one at most, the larger
    first), else the largest item first into the set that misses the most tokens per free slot,
    then evened by swaps (:func:`evened`)."""
    k, n = len(sizes), len(lengths)
    if list(sizes) == chunk_sizes(n, k):
        sets = karmarkar_karp(lengths, k, equal_size=True)
        return sorted(sets, key=lambda s: -len(s))
    sets: list[list[int]] = [[] for _ in sizes]
    sums = [0] * k
    target = sum(int(x) for x in lengths) / k

    def need(r: int) -> float:  # tokens still missing per free slot: a share with few slots
        return (target - sums[r]) / (sizes[r] - len(sets[r]))  # needs the long sequences

    for i in sorted(range(n), key=lambda i: (-int(lengths[i]), i)):
        r = max((r for r in range(k) if len(sets[r]) < sizes[r]), key=lambda r: (need(r), -r))
        sets[r].append(i)
        sums[r] += int(lengths[i])
    return [sorted(s) for s in evened(sets, lengths)]


def evened(sets: list[list[int]], lengths: Sequence[int]) -> list[list[int]]:
    """``sets`` (item indices) with items swapped between the fullest and the emptiest set while a
    swap brings their sums closer: each time the pair whose length difference is nearest half the
    gap, so the set sizes stay. The greedy fill of unequal sizes ends where its last items leave it
    (a mini-batch's shares several times as uneven as swaps make them, on long-tailed lengths).
    Each swap lowers the sum of squared set sums, so this ends; deterministic."""
    sums = [sum(int(lengths[i]) for i in s) for s in sets]
    for _ in range(sum(len(s) for s in sets) ** 2):
        hi = max(range(len(sets)), key=lambda r: (sums[r], -r))
        lo = min(range(len(sets)), key=lambda r: (sums[r], r))
        gap = sums[hi] - sums[lo]
        low = sorted(sets[lo], key=lambda j: (int(lengths[j]), j))
        keys = [int(lengths[j]) for j in low]
        best = None  # (|gap - 2 delta|, a, b, delta)
        for a in sorted(sets[hi]):
            at = bisect.bisect_left(keys, int(lengths[a]) - gap / 2)
            for q in (at - 1, at):
                delta = int(lengths[a]) - keys[q] if 0 <= q < len(keys) else 0
                if 0 < delta < gap and (best is None or abs(gap - 2 * delta) < best[0]):
                    best = (abs(gap - 2 * delta), a, low[q], delta)
        if best is None:
            break
        _, a, b, delta = best
        sets[hi].remove(a)
        sets[lo].remove(b)
        sets[hi].append(b)
        sets[lo].append(a)
        sums[hi], sums[lo] = sums[hi] - delta, sums[lo] + delta
    return sets


def imbalance(tokens: Sequence[float]) -> float:
    """max / mean - 1 of the token counts per rank (0: perfectly even, or no tokens)."""
    mean = sum(tokens) / len(tokens) if tokens else 0.0
    return max(tokens) / mean - 1.0 if mean > 0 else 0.0


def chunk_sizes(n: int, k: int) -> list[int]:
    """The part sizes of ``Batch.chunk(k)`` on ``n`` rows."""
    size, rem = divmod(n, k)
    return [size + (1 if r < rem else 0) for r in range(k)]


def chunk_bounds(n: int, k: int) -> list[int]:
    """The first row of each part of ``Batch.chunk(k)``, then ``n``."""
    bounds = [0]
    for size in chunk_sizes(n, k):
        bounds.append(bounds[-1] + size)
    return bounds


def balanced_positions(
    lengths: Sequence[int], ranks: int, minibatches: Sequence[Sequence[int]]
) -> list[int]:
    """``order`` (``order[p]``: the row to put at position p) such that within every mini-batch
    (a set of positions) the rows at the positions in each rank's chunk have nearly equal token
    sums; a mini-batch keeps the rows it held (those at its positions)."""
    bounds = chunk_bounds(len(lengths), ranks)
    order = list(range(len(lengths)))
    for positions in minibatches:
        rows = sorted(int(p) for p in positions)
        slots = [[p for p in rows if bounds[r] <= p < bounds[r + 1]] for r in range(ranks)]
        sets = fill_shares([lengths[i] for i in rows], [len(s) for s in slots])
        for slot, chosen in zip(slots, sets):
            for p, j in zip(slot, chosen):
                order[p] = rows[j]
    return order


def balance_for_ranks(batch, ranks: int, enabled: bool = True, minibatches=None):
    """``(batch, metrics)``: with ``enabled`` and more than one data-parallel rank, the batch's rows
    reordered so that each rank's share of every mini-batch in ``minibatches`` (lists of positions;
    None: one mini-batch of the whole batch) holds nearly the same number of real tokens
    (:func:`balanced_positions`); otherwise the batch as it is.

    Metrics, after the reordering (0 with one rank): ``perf/dp_token_imbalance``, max / mean - 1
    of the tokens of each rank's chunk; ``perf/dp_token_imbalance_minibatch``, its mean over the
    mini-batches (of each rank's share of them)."""
    n = len(batch)
    lengths = batch["attention_mask"].sum(-1).tolist() if n else []
    minibatches = [list(range(n))] if minibatches is None else minibatches
    if enabled and ranks > 1 and n > 1:
        order = balanced_positions(lengths, ranks, minibatches)
        batch, lengths = batch.index(order), [lengths[i] for i in order]
    bounds = chunk_bounds(n, max(ranks, 1))

    def shares(positions) -> list[float]:
        return [
            float(sum(lengths[p] for p in positions if bounds[r] <= p < bounds[r + 1]))
            for r in range(max(ranks, 1))
        ]

    per_mini = [imbalance(shares(positions)) for positions in minibatches] or [0.0]
    return batch, {
        "perf/dp_token_imbalance": imbalance(shares(range(n))),
        "perf/dp_token_imbalance_minibatch": sum(per_mini) / len(per_mini),
    }
