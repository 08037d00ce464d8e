"""Loss aggregation: ``fn(loss (B, R), mask, totals) -> scalar``.

``totals`` are the totals of the whole mini-batch (one optimizer step), not of the micro-batch
being aggregated, so every mode is a sum of per-row terms divided by a mini-batch constant and
the micro-batch results of gradient accumulation add up exactly to the mini-batch loss.
Padded positions never contribute; the seq-mean modes average over non-empty rows (veRL).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridrl.algorithms.masking import as_bool, zero_pad
from hybridrl.registry import Registry

LOSS_AGG = Registry("loss aggregation")


@dataclass
class AggTotals:
    """Mini-batch totals: valid tokens, non-empty rows, and the fixed length of
    seq-mean-token-sum-norm."""

    n_tokens: float
    n_seqs: float
    norm_len: float


def agg_totals(mask: torch.Tensor, norm_len: float | None = None) -> AggTotals:
    """Totals of a mini-batch's ``response_mask``; ``norm_len`` None: the mask's width (veRL's
    default)."""
    m = as_bool(mask)
    return AggTotals(
        n_tokens=float(m.sum().item()),
        n_seqs=float(m.any(-1).sum().item()),
        norm_len=float(mask.shape[-1] if norm_len is None else norm_len),
    )


def _row_sums(loss: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m = as_bool(mask)
    return zero_pad(loss, m).sum(-1), m.sum(-1)


def _div(x: torch.Tensor, d: float) -> torch.Tensor:
    return x / d if d > 0 else x * 0.0  # an empty mini-batch: 0 (the numerator is 0 too), never NaN


@LOSS_AGG.register("token-mean")
def token_mean(loss: torch.Tensor, mask: torch.Tensor, totals: AggTotals) -> torch.Tensor:
    """sum over valid tokens / n_tokens."""
    return _div(_row_sums(loss, mask)[0].sum(), totals.n_tokens)


@LOSS_AGG.register("seq-mean-token-sum")
def seq_mean_token_sum(loss: torch.Tensor, mask: torch.Tensor, totals: AggTotals) -> torch.Tensor:
    """sum_i (sum_t loss_it) / n_seqs."""
    return _div(_row_sums(loss, mask)[0].sum(), totals.n_seqs)


@LOSS_AGG.register("seq-mean-token-mean")
def seq_mean_token_mean(loss: torch.Tensor, mask: torch.Tensor, totals: AggTotals) -> torch.Tensor:
    """sum_i (mean_t loss_it) / n_seqs; an empty row contributes 0."""
    sums, counts = _row_sums(loss, mask)
    return _div((sums / counts.clamp(min=1).to(sums.dtype)).sum(), totals.n_seqs)


@LOSS_AGG.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(
    loss: torch.Tensor, mask: torch.Tensor, totals: AggTotals
) -> torch.Tensor:
    """sum over valid tokens / (n_seqs * norm_len) (Dr.GRPO, Liu et al. 2503.20783): the mean over
    the sequences of each sequence's summed loss, divided by a fixed length.

    The same division as veRL 0.9's ``agg_loss`` (the non-empty sequences of the global batch times
    its ``loss_scale_factor``); veRL before 0.9 divided by the length only, so its scale grew with
    the batch size. veRL's length defaults to the mask's width, ours to
    ``rollout.max_new_tokens`` (``agg_totals``' ``norm_len``).
    """
    return _div(_row_sums(loss, mask)[0].sum(), totals.n_seqs * totals.norm_len)


@LOSS_AGG.register("token-sum")
def token_sum(loss: torch.Tensor, mask: torch.Tensor, totals: AggTotals) -> torch.Tensor:
    """sum over valid tokens, no division. Needs no totals: micro-batches and data-parallel ranks
    (whose gradients are summed) add up to the mini-batch's sum by themselves. Its scale grows with
    the number of tokens per optimizer step, so the learning rate has to be scaled to match."""
    return _row_sums(loss, mask)[0].sum()
