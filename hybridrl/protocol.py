"""The data that flows between roles: :class:`Sample` (one trajectory) and
:class:`Batch` (named tensors with a shared leading batch dimension, plus
per-sample metadata lists).

A ``Batch`` is what every worker method receives and returns. Workers add
columns (``old_log_probs``, ``ref_log_probs``, ``rewards``, ``advantages`` ...) and the driver
merges them back with :meth:`Batch.union`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Sample:
    """One generated trajectory, as a rollout backend returns it."""

    prompt_ids: list[int]
    response_ids: list[int]
    log_probs: list[float]  # behaviour log-prob of each response token
    versions: list[int]  # weight version that produced each response token
    status: str = "finished"  # finished | truncated | aborted
    uid: str = ""  # group id: all samples of one prompt share it
    task_id: str = ""
    reward: float = 0.0
    reward_info: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # prompt text, answer, engine stats ...


class Batch:
    """Named tensors (first dim = batch) and per-sample metadata lists."""

    def __init__(
        self, tensors: dict[str, torch.Tensor] | None = None, meta: dict[str, list] | None = None
    ):
        self.tensors: dict[str, torch.Tensor] = dict(tensors or {})
        self.meta: dict[str, list] = {k: list(v) for k, v in (meta or {}).items()}
        sizes = {k: t.shape[0] for k, t in self.tensors.items()} | {
            k: len(v) for k, v in self.meta.items()
        }
        if len(set(sizes.values())) > 1:
            raise ValueError(f"Batch columns disagree on batch size: {sizes}")

    # --- access -------------------------------------------------------------
    def __len__(self) -> int:
        for t in self.tensors.values():
            return t.shape[0]
        for v in self.meta.values():
            return len(v)
        return 0

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.meta

    def __getitem__(self, key):
        if isinstance(key, str):
            return self.tensors[key] if key in self.tensors else self.meta[key]
        return self.index(key)

    def __setitem__(self, key: str, value) -> None:
        if isinstance(value, torch.Tensor):
            self.tensors[key] = value
        else:
            self.meta[key] = list(value)

    def keys(self) -> list[str]:
        return list(self.tensors) + list(self.meta)

    def __repr__(self) -> str:
        cols = [f"{k}{tuple(t.shape)}" for k, t in self.tensors.items()] + list(self.meta)
        return f"Batch(len={len(self)}, {', '.join(cols)})"

    # --- operations ---------------------------------------------------------
    def index(self, idx) -> Batch:
        """Rows by slice, list of ints or bool/long tensor."""
        if isinstance(idx, slice):
            rows = list(range(len(self)))[idx]
        elif isinstance(idx, torch.Tensor):
            rows = (idx.nonzero().flatten() if idx.dtype == torch.bool else idx).tolist()
        else:
            rows = list(idx)
        ridx = torch.tensor(rows, dtype=torch.long)
        return Batch(
            {k: t.index_select(0, ridx) for k, t in self.tensors.items()},
            {k: [v[i] for i in rows] for k, v in self.meta.items()},
        )

    def select(self, *keys: str) -> Batch:
        missing = [k for k in keys if k not in self]
        if missing:
            raise KeyError(f"Batch has no column(s) {missing}; it has {self.keys()}")
        return Batch(
            {k: t for k, t in self.tensors.items() if k in keys},
            {k: v for k, v in self.meta.items() if k in keys},
        )

    def union(self, other: Batch) -> Batch:
        """Columns of both; a column present in both must hold equal values."""
        if len(self) and len(other) and len(self) != len(other):
            raise ValueError(f"cannot union batches of sizes {len(self)} and {len(other)}")
        tensors, meta = dict(self.tensors), dict(self.meta)
        for k, t in other.tensors.items():
            if k in tensors and not (tensors[k].shape == t.shape and torch.equal(tensors[k], t)):
                raise ValueError(f"union: column {k!r} differs between the batches")
            tensors[k] = t
        for k, v in other.meta.items():
            if k in meta and meta[k] != v:
                raise ValueError(f"union: metadata {k!r} differs between the batches")
            meta[k] = v
        return Batch(tensors, meta)

    def __or__(self, other: Batch) -> Batch:
        return self.union(other)

    def chunk(self, n: int) -> list[Batch]:
        """Split into ``n`` contiguous parts whose sizes differ by at most one."""
        if n < 1:
            raise ValueError(f"chunk: n must be >= 1, got {n}")
        size, rem = divmod(len(self), n)
        out, start = [], 0
        for i in range(n):
            end = start + size + (1 if i < rem else 0)
            out.append(self.index(slice(start, end)))
            start = end
        return out

    def split(self, size: int) -> list[Batch]:
        """Consecutive parts of ``size`` rows (the last may be shorter)."""
        return [self.index(slice(i, i + size)) for i in range(0, len(self), size)]

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        batches = [b for b in batches if len(b) or b.keys()]
        if not batches:
            return Batch()
        keys = set(batches[0].keys())
        for b in batches[1:]:
            if set(b.keys()) != keys:
                raise ValueError(
                    f"concat: batches have different columns: {sorted(keys)} vs {sorted(b.keys())}"
                )
        tensors = {}
        for k in batches[0].tensors:
            parts = [b.tensors[k] for b in batches]
            width = max(p.shape[1] for p in parts) if parts[0].dim() > 1 else None
            if width is not None and any(p.shape[1] != width for p in parts):
                raise ValueError(
                    f"concat: column {k!r} has different widths {[p.shape[1] for p in parts]}"
                )
            tensors[k] = torch.cat(parts, 0)
        meta = {k: [x for b in batches for x in b.meta[k]] for k in batches[0].meta}
        return Batch(tensors, meta)

    def repeat(self, n: int, interleave: bool = True) -> Batch:
        """Each row ``n`` times: ``aabb`` when interleaved, else ``abab``."""
        rows = (
            [i for i in range(len(self)) for _ in range(n)]
            if interleave
            else list(range(len(self))) * n
        )
        return self.index(rows)

    def to(self, device: torch.device | str) -> Batch:
        return Batch({k: t.to(device) for k, t in self.tensors.items()}, self.meta)

    def shuffle(self, generator: torch.Generator) -> Batch:
        return self.index(torch.randperm(len(self), generator=generator))


def pad_2d(
    rows: Iterable[Sequence],
    pad: float,
    dtype: torch.dtype,
    left: bool = False,
    width: int | None = None,
) -> torch.Tensor:
    """Stack ragged rows into a (B, width) tensor padded on the right (or left)."""
    rows = [list(r) for r in rows]
    width = max([len(r) for r in rows] + [0]) if width is None else width
    out = torch.full((len(rows), width), pad, dtype=dtype)
    for i, r in enumerate(rows):
        if r:
            vals = torch.tensor(r, dtype=dtype)
            if left:
                out[i, width - len(r) :] = vals
            else:
                out[i, : len(r)] = vals
    return out


def samples_to_batch(samples: Sequence[Sample], pad_id: int) -> Batch:
    """Collate samples into the training layout: ``input_ids = prompts (left-padded) ++ responses (right-padded)``."""
    prompts = pad_2d([s.prompt_ids for s in samples], pad_id, torch.long, left=True)
    prompt_mask = pad_2d([[1] * len(s.prompt_ids) for s in samples], 0, torch.long, left=True)
    width = max([len(s.response_ids) for s in samples] + [1])
    responses = pad_2d([s.response_ids for s in samples], pad_id, torch.long, width=width)
    response_mask = pad_2d([[1] * len(s.response_ids) for s in samples], 0, torch.long, width=width)
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": torch.cat([prompt_mask, response_mask], 1),
        "response_mask": response_mask,
        "rollout_log_probs": pad_2d(
            [s.log_probs for s in samples], 0.0, torch.float32, width=width
        ),
        "versions": pad_2d([s.versions for s in samples], -1, torch.long, width=width),
    }
    meta: dict[str, list] = {
        "uid": [s.uid for s in samples],
        "task_id": [s.task_id for s in samples],
        "status": [s.status for s in samples],
    }
    for key in sorted({k for s in samples for k in s.extra}):
        meta[key] = [s.extra.get(key) for s in samples]
    return Batch(tensors, meta)
