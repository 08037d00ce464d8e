"""Masked tensor helpers shared by the advantage estimators, the policy losses, the loss
aggregation and the rollout correction.

``mask`` marks the valid positions (1 or True); padding never contributes, whatever it holds:
positions are dropped with ``torch.where``, never by multiplying with the mask, so an inf or a NaN
in the padding cannot leak into a sum (inf * 0 is NaN).
"""

from __future__ import annotations

import torch


def as_bool(mask: torch.Tensor) -> torch.Tensor:
    """``mask`` as a boolean tensor (returned as is when it already is one)."""
    return mask.bool() if mask.dtype != torch.bool else mask


def zero_pad(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` with the positions outside ``mask`` set to 0."""
    return torch.where(as_bool(mask), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over ``mask`` (all of it, or along ``dim``); 0 where nothing is valid."""
    m = as_bool(mask)
    xs = zero_pad(x, m)
    if dim is None:
        return xs.sum() / m.sum().clamp(min=1).to(x.dtype)
    return xs.sum(dim) / m.sum(dim).clamp(min=1).to(x.dtype)


def masked_max(x: torch.Tensor, mask: torch.Tensor) -> float:
    """The largest valid element of ``x``; 0.0 when nothing is valid."""
    m = as_bool(mask)
    return x[m].max().item() if m.any() else 0.0


def masked_min(x: torch.Tensor, mask: torch.Tensor) -> float:
    """The smallest valid element of ``x``; 0.0 when nothing is valid."""
    m = as_bool(mask)
    return x[m].min().item() if m.any() else 0.0
