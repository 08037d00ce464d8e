"""The mini-batch / micro-batch loop shared by every trained role (actor, critic).

One optimizer step per mini-batch of ``minibatch_size`` samples; each
mini-batch is cut into micro-batches under a token budget and the gradients
accumulate. ``loss_fn(mb, totals)`` returns the micro-batch's *contribution*
to the mini-batch loss (normalised by the mini-batch totals), so the sum over
micro-batches is exactly the mini-batch loss whatever the budget.

Data parallel (world size > 1): the driver gives rank r a contiguous chunk of
the step's batch (``Dispatch.DP_COMPUTE``). Every rank draws the same
permutation of the *global* batch (same generator state on every rank) and
cuts it into the same global mini-batches as one process would; a rank trains
on the rows of each mini-batch that lie in its chunk. The totals
(``AggTotals``) are all-reduced, so each rank's loss is its share of the
global mini-batch loss, and FSDP sums the gradients over ranks: the update
equals the single-process update on the same batch (up to float rounding).
Ranks with fewer micro-batches run dummy ones (no contribution) so that the
collectives line up. Metrics are token-weighted means over the global
mini-batch, identical on every rank.

Packing (``packing``, default the section's ``packing`` field, ``actor.packing``): the micro-batches
hold whole sequences packed into rows (``learner/logprob.py``, ``parallel/packing.py``) instead of
length groups; the loss functions see the same ``(rows, R)`` tensors either way. The share of the
token positions fed to the model that are padding is reported as ``perf/padding_fraction``, and
the positions fed (forward and backward, every epoch, all ranks) as ``perf/tokens_fed`` (the
actor's; ``perf/<prefix>_padding_fraction`` and ``perf/<prefix>_tokens_fed`` for another role),
over the real micro-batches of every rank (a dummy micro-batch is not counted: it exists for the
collectives, not for the data).

Non-finite updates: when a mini-batch's loss or its gradient norm (the clip's total norm, global
over ranks under FSDP; a loss that is non-finite on any rank counts on all of them) is NaN or inf,
the optimizer does not step: the gradients are dropped, ``<prefix>/skipped_updates`` counts it, and
the mini-batch's metrics are left out of the averages (``<prefix>/updates`` counts the steps taken).
Every rank decides alike. The caller's :class:`SkipCounter` (one per optimizer, kept across calls)
raises :class:`NonFiniteUpdateError` after ``alerts.max_nonfinite_in_a_row`` consecutive skipped
steps, so that the run stops instead of training on.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable

import torch

from hybridrl.algorithms import AggTotals, agg_totals
from hybridrl.learner.logprob import (
    batch_map,
    dp_micro_batches,
    model_device,
    token_counts,
)
from hybridrl.learner.prefix_share import can_share
from hybridrl.parallel import distributed
from hybridrl.parallel.fsdp import clip_grad_norm
from hybridrl.parallel.packing import attention_key_cost
from hybridrl.protocol import Batch

LossFn = Callable[[Batch, AggTotals], tuple[torch.Tensor, dict[str, float]]]


def perf_metric(prefix: str, what: str) -> str:
    """A role's update metric under ``perf/``: the actor's ``perf/<what>``, another role's
    ``perf/<prefix>_<what>``."""
    return f"perf/{what}" if prefix == "actor" else f"perf/{prefix}_{what}"


def packing_of(section, packing: bool | None) -> bool:
    """``packing`` when given, else the role config's ``packing`` field (absent: off)."""
    return bool(getattr(section, "packing", False) if packing is None else packing)


class NonFiniteUpdateError(RuntimeError):
    """Too many consecutive optimizer steps had a non-finite loss or gradient norm."""


class SkipCounter:
    """Consecutive skipped optimizer steps of one optimizer (its owner keeps it across updates);
    :meth:`skipped` raises :class:`NonFiniteUpdateError` at ``limit`` in a row (0: never)."""

    def __init__(self, limit: int, role: str):
        self.limit, self.role, self.in_a_row = limit, role, 0

    def skipped(self) -> None:
        self.in_a_row += 1
        if self.limit and self.in_a_row >= self.limit:
            raise NonFiniteUpdateError(
                f"{self.role}: {self.in_a_row} optimizer steps in a row skipped for a non-finite "
                f"loss or gradient norm (alerts.max_nonfinite_in_a_row={self.limit}): stopping"
            )

    def stepped(self) -> None:
        self.in_a_row = 0

    def step(self, optimizer, finite: bool) -> bool:
        """The optimizer steps when ``finite``, else its gradients are dropped and the skip counted
        (raising at the limit); returns ``finite``."""
        if finite:
            self.stepped()
            optimizer.step()
        else:
            optimizer.zero_grad(set_to_none=True)
            self.skipped()
        return finite


def minibatch_rows(
    n_local: int, generator: torch.Generator, minibatch_size: int
) -> list[torch.Tensor]:
    """This rank's rows (indices into its chunk of ``n_local`` rows) of each global mini-batch of
    one epoch.

    Rank r holds rows ``[offset_r, offset_r + n_local)`` of the global batch (DP_COMPUTE chunks are
    contiguous, in rank order). Consumes the generator exactly as the single-process shuffle does.
    """
    sizes = distributed.all_gather_ints(n_local)
    return chunk_minibatch_rows(sizes, distributed.rank(), generator, minibatch_size)


def chunk_minibatch_rows(
    sizes: list[int], position: int, generator: torch.Generator, minibatch_size: int
) -> list[torch.Tensor]:
    """The rows of chunk ``position`` (of contiguous chunks of ``sizes`` rows, indices into it) in
    each mini-batch of one shuffled epoch over all of them."""
    total, offset, n_local = sum(sizes), sum(sizes[:position]), sizes[position]
    perm = torch.randperm(total, generator=generator)
    out = []
    for start in range(0, total, minibatch_size):
        rows = perm[start : start + minibatch_size]
        out.append(rows[(rows >= offset) & (rows < offset + n_local)] - offset)
    return out


def first_epoch_minibatches(n: int, generator: torch.Generator, size: int) -> list[list[int]]:
    """The global rows of each mini-batch that the next :func:`run_updates` with ``generator``
    draws in its first epoch over ``n`` rows (as :func:`minibatch_rows`); the generator is only
    peeked at. Data-parallel balancing (``parallel/batch_balance.py``) evens the ranks' shares of
    these."""
    peek = torch.Generator()
    peek.set_state(generator.get_state())
    perm = torch.randperm(n, generator=peek).tolist()
    return [perm[i : i + size] for i in range(0, n, size)]


def first_epoch_map(
    model, batch: Batch, generator: torch.Generator, section, fn, packing: bool | None = None
) -> torch.Tensor:
    """``fn(model, mb)`` (B, R), no gradient, over the micro-batches that the next
    :func:`run_updates` with ``generator`` cuts in its first epoch: the same rows, grouped and
    trimmed alike, so each row's forward has the shapes of that update's forward. ``generator`` is
    only peeked at (a copy draws the permutation).

    Why: the old log-probs are then bit for bit the update's first forward on deterministic kernels
    (the ratio of the first mini-batch is exactly 1); a differently grouped batch changes the low
    bits of some rows (other padding widths and matmul shapes). A collective when the world size is
    > 1."""
    peek = torch.Generator()
    peek.set_state(generator.get_state())
    out = torch.zeros(tuple(batch["responses"].shape), dtype=torch.float32)
    pack = packing_of(section, packing)
    for rows in minibatch_rows(len(batch), peek, section.ppo_minibatch_size):
        out[rows] = batch_map(model, batch.index(rows), section.micro_batch_tokens, fn, pack)
    return out


def is_single_pass(section, total_rows: int) -> bool:
    """One epoch over one mini-batch: the update runs one forward per row, with the weights it
    started from."""
    return section.ppo_epochs == 1 and section.ppo_minibatch_size >= total_rows


def global_totals(mini: Batch, norm_len: float) -> AggTotals:
    t = agg_totals(mini["response_mask"], norm_len)
    n_tokens, n_seqs = distributed.all_reduce([t.n_tokens, t.n_seqs]).tolist()
    return AggTotals(n_tokens=n_tokens, n_seqs=n_seqs, norm_len=t.norm_len)


class MicroBatches:
    """The backward passes of a model that is not pipelined (one process, or FSDP2-sharded) over
    its rows of a mini-batch: micro-batches under ``section.micro_batch_tokens`` (packed rows with
    ``packing``; None: the section's ``packing`` field), each ``loss_fn(mb, totals)`` backward,
    gradients accumulated. A rank with fewer micro-batches than another runs dummy ones (no
    contribution) so that the collectives line up."""

    def __init__(self, model, loss_fn: LossFn, section, packing: bool | None = None):
        self.model, self.loss_fn, self.budget = model, loss_fn, section.micro_batch_tokens
        self.pack = packing_of(section, packing)
        self.key_cost = attention_key_cost(model) if self.pack else 0.0  # when packed rows pay off
        self.share_prompts = self.pack and can_share(model)  # a group's samples share one prompt
        self.fed = self.real = 0  # token positions fed to the model, and the real tokens among them

    def train(self) -> None:
        self.model.train()

    def minibatch_rows(self, n_local: int, generator, size: int) -> list[torch.Tensor]:
        return minibatch_rows(n_local, generator, size)

    def totals(self, mini: Batch, norm_len: float) -> AggTotals:
        return global_totals(mini, norm_len)

    def backward(self, mini: Batch, totals: AggTotals, batch: Batch) -> tuple[bool, dict]:
        """(every loss finite, the metrics summed token-weighted) of one mini-batch."""
        device = model_device(self.model)
        n_tokens = max(totals.n_tokens, 1.0)
        mbs, n_real, _ = dp_micro_batches(
            mini, self.budget, batch, self.pack, self.key_cost, self.share_prompts
        )
        sums: dict[str, float] = defaultdict(float)
        ok = torch.ones((), dtype=torch.bool, device=device)
        for i, mb in enumerate(mbs):
            if device.type != "cpu":
                mb = mb.to(device)
            loss, metrics = self.loss_fn(mb, totals)
            if i >= n_real:  # dummy: keeps the collectives in step, contributes nothing
                loss = loss * 0.0
            else:
                ok &= torch.isfinite(loss.detach()).all()
            loss.backward()
            if i < n_real:
                fed, real = token_counts(mb)
                self.fed, self.real = self.fed + fed, self.real + real
                share = float(mb["response_mask"].sum()) / n_tokens  # token-weighted mean
                for k, v in metrics.items():
                    sums[k] += v * share
            else:
                for k in metrics:
                    sums[k] += 0.0
        return bool(ok.item()), sums

    def clip_grad_norm(self, max_norm: float) -> float:
        return clip_grad_norm(self.model, max_norm)  # global over ranks: the same on every rank

    def metrics(self, prefix: str) -> dict[str, float]:
        fed, real = self.fed, self.real
        if distributed.world_size() > 1:
            fed, real = distributed.all_reduce([fed, real]).tolist()
        return {
            perf_metric(prefix, "padding_fraction"): 1.0 - real / fed if fed else 0.0,
            perf_metric(prefix, "tokens_fed"): fed,
        }


def sum_over_ranks(sums: dict[str, float]) -> dict[str, float]:
    """Metric sums of every rank added up, keys lined up first (a rank may lack some: a pipeline's
    metrics live on its last stages)."""
    keys = sorted(set().union(*distributed.all_gather_object(sorted(sums))))
    return dict(zip(keys, distributed.all_reduce([sums.get(k, 0.0) for k in keys]).tolist()))


def run_updates(
    passes,
    optimizer,
    batch: Batch,
    section,
    *,
    generator: torch.Generator,
    norm_len: float,
    prefix: str,
    skips: SkipCounter | None = None,
) -> dict[str, float]:
    """Train ``section.ppo_epochs`` passes over ``batch`` (this rank's rows, shuffled by
    ``generator``) in global mini-batches of ``section.ppo_minibatch_size``, gradients clipped at
    ``section.grad_clip`` (``section``: the role's config, ActorConfig or CriticConfig); metrics
    token-weighted and averaged over the optimizer steps taken, the same on every rank.

    ``passes`` runs a mini-batch's forward and backward passes on the model it wraps: a
    :class:`MicroBatches`, or a pipeline's ``PipelineRounds`` (``learner/pipeline_update.py``).
    It gives this rank's rows of each mini-batch, the mini-batch's global totals, ``backward``
    (whether every loss was finite, the metrics' sums), the clipped global gradient norm and its
    own ``perf/`` metrics; the loop around them, one for every form of model, is this function.

    A mini-batch with a non-finite loss or gradient norm is skipped (see the module docstring) and
    counted by ``skips`` (the owner's counter; None: a fresh one that stops at 3 in a row), which
    raises :class:`NonFiniteUpdateError` naming the role when too many come in a row."""
    skips = skips or SkipCounter(3, prefix)
    passes.train()
    sums: dict[str, float] = defaultdict(float)
    grad_norm, steps, skipped = 0.0, 0, 0
    for _ in range(section.ppo_epochs):
        for rows in passes.minibatch_rows(len(batch), generator, section.ppo_minibatch_size):
            mini = batch.index(rows)
            optimizer.zero_grad(set_to_none=True)
            totals = passes.totals(mini, norm_len)
            ok, mini_sums = passes.backward(mini, totals, batch)
            norm = passes.clip_grad_norm(section.grad_clip)
            finite = ok and math.isfinite(norm)
            if distributed.world_size() > 1:  # a loss that is non-finite on one rank skips on all
                finite = distributed.all_reduce([0.0 if finite else 1.0], op="max").item() == 0
            for k, v in mini_sums.items():  # the keys line up across ranks even when skipped
                sums[k] += v if finite else 0.0
            if skips.step(optimizer, finite):
                grad_norm, steps = grad_norm + norm, steps + 1
            else:
                skipped += 1
    # each rank summed its tokens' shares: the sum over ranks is the global mean
    if distributed.world_size() > 1:
        sums = sum_over_ranks(sums)
    # no step taken (all skipped): no value to report; NaN is logged as null ("no data")
    out = {k: v / steps if steps else math.nan for k, v in sums.items()}
    return (
        out
        | {
            f"{prefix}/grad_norm": grad_norm / steps if steps else math.nan,
            f"{prefix}/updates": steps,
            f"{prefix}/skipped_updates": skipped,
            f"{prefix}/lr": optimizer.param_groups[0]["lr"],  # the last step's (schedule applied)
        }
        | passes.metrics(prefix)
    )
