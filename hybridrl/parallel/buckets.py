"""Bucketing a stream of named tensors for weight sync: the one place that decides bucket
boundaries.

A bucket holds consecutive ``(name, tensor)`` pairs of at most ``bucket_bytes`` in all; a tensor
larger than that is a bucket of its own. Every producer of weight buckets (the FSDP gather, the LoRA
adapters, the rollout adapters that hand weights to an external engine) cuts its stream here, so a
bucket size means the same thing everywhere.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from torch import Tensor

BUCKET_BYTES = 64 << 20  # the default bucket size of a weight sync


def nbytes_of(t: Tensor) -> int:
    return t.numel() * t.element_size()


def bucketed(
    named: Iterable[tuple[str, Tensor]], bucket_bytes: int = BUCKET_BYTES, *, keep: bool = True
) -> Iterator[list[tuple[str, Tensor]]]:
    """Consecutive buckets of ``named``, each of at most ``bucket_bytes`` (or one larger tensor);
    only one bucket is held at a time and the stream is read once, lazily.

    ``keep=False``: the stream is still consumed and cut at the same boundaries, but every bucket
    comes out empty. Ranks that take part in a collective gather without receiving its result use it
    to yield in the same rhythm as the rank that keeps the tensors.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: list[tuple[str, Tensor]] = []
    size = count = 0  # bytes and tensors in the current bucket (counted even when not kept)
    for name, t in named:
        nbytes = nbytes_of(t)
        if count and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size, count = [], 0, 0
        size += nbytes
        count += 1
        if keep:
            bucket.append((name, t))
    if count:
        yield bucket
