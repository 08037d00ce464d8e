"""Weight sync trained side -> rollout: bucketed, versioned, never one call per tensor, through a
transport.

A transport is an object with two halves and a lifetime, one instance per process that takes part:

* ``publish(source, version)`` runs on every rank of the trained side (a collective where the
  weights are sharded) and returns a small *handle* on rank 0, None on the other ranks;
* ``load(engine, handle, version) -> int`` runs on every rollout rank with rank 0's handle and calls
  ``engine.update_weights(iterator of (name, tensor), version)``; it returns what that returns (the
  number of tensors loaded);
* ``close()`` releases what the instance holds (staging files, mappings); a closed transport may be
  used again (it allocates afresh). Instances are context managers.

The driver only passes handles, never the bytes. Transports (:data:`TRANSPORTS`,
:func:`make_transport`; :func:`choose_transport` picks one from where the roles live):

* ``fused``: the trained roles and the rollout share one process per rank and one process group.
  Rank 0's handle is its buckets; its rollout loads them as they are, and each bucket is broadcast
  as one flat byte tensor over the group (gloo / NCCL) to the other ranks' rollouts.
* ``memory``: everything in one process (``local`` backend): the handle is rank 0's buckets, the
  tensors themselves, no copy.
* ``shm``: separate processes on one node. Rank 0 copies the buckets into a shared-memory staging
  file and the handle is its path and layout; each rollout process maps the file and copies from it
  into its live weights. The file is overwritten by the next publish, so syncs must not overlap
  (load before publishing again). A single-rank CPU source can have its parameters re-homed into
  the file, so that publishing copies nothing. The staging file, re-homing (a source's
  ``rehome_parameters`` / ``unhome_parameters``, with ``shm_staging.rehome`` / ``unhome``) and the
  transport's behaviour are in ``parallel/shm_staging.py``; :class:`ShmTransport` registers it.
* ``store``: across nodes. Rank 0 puts every bucket into Ray's object store as numpy arrays and the
  handle is the list of references; each rollout process fetches the buckets one at a time (Ray
  moves them between nodes).

The source (the trained side's worker) offers ``weight_buckets(bucket_bytes)`` (rank 0 returns the
buckets of ``(name, tensor)``, the other ranks ``[]``; every rank must call it), ``model``,
``world_size`` and ``weights_are_parameters`` (whether those buckets are its model's parameters
under their own names: false for LoRA adapters). Whatever ``weight_buckets`` yields (full weights,
LoRA adapters, merged deltas) is what travels; nothing here knows about adapters.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from hybridrl.parallel.buckets import BUCKET_BYTES, nbytes_of
from hybridrl.parallel.shm_staging import SHM_DIR, ShmStaging
from hybridrl.registry import Registry

__all__ = [
    "BUCKET_BYTES",
    "SHM_DIR",
    "TRANSPORTS",
    "FusedTransport",
    "MemoryTransport",
    "ShmTransport",
    "StoreTransport",
    "WeightSource",
    "WeightTransport",
    "choose_transport",
    "make_transport",
    "pack",
    "unpack",
    "where",
]

Named = tuple[str, torch.Tensor]


class WeightSource(Protocol):
    """The trained side as a transport sees it (an actor worker); see the module doc."""

    model: nn.Module
    world_size: int
    weights_are_parameters: bool

    def weight_buckets(self, bucket_bytes: int) -> list[list[Named]]: ...


class WeightTransport:
    """Base of the transports: ``publish`` on the trained side, ``load`` on the rollout side,
    ``close``."""

    name = ""

    def __init__(self, bucket_bytes: int = BUCKET_BYTES):
        self.bucket_bytes = bucket_bytes

    def publish(self, source: WeightSource, version: int) -> Any:
        raise NotImplementedError

    def load(self, engine, handle: Any, version: int) -> int:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(bucket_bytes={self.bucket_bytes})"


TRANSPORTS: Registry[type[WeightTransport]] = Registry("weight transport")


def make_transport(name: str, bucket_bytes: int = BUCKET_BYTES, **options) -> WeightTransport:
    """A new transport instance by registered name (or dotted path ``package.module:Class``)."""
    return TRANSPORTS.get(name)(bucket_bytes=bucket_bytes, **options)


def _rank0_buckets(source: WeightSource, bucket_bytes: int) -> list[list[Named]] | None:
    buckets = source.weight_buckets(bucket_bytes)
    return buckets if any(buckets) else None


def _items(buckets: list[list[Named]]) -> Iterator[Named]:
    for bucket in buckets:
        yield from bucket


# --- memory: one process --------------------------------------------------------------------------
@TRANSPORTS.register("memory")
class MemoryTransport(WeightTransport):
    """One process: the handle is rank 0's buckets themselves, loaded without a copy."""

    name = "memory"

    def publish(self, source: WeightSource, version: int) -> list[list[Named]] | None:
        return _rank0_buckets(source, self.bucket_bytes)

    def load(self, engine, handle: list[list[Named]], version: int) -> int:
        return engine.update_weights(_items(handle), version)


# --- fused: one process group, rank 0's buckets broadcast -----------------------------------------
@TRANSPORTS.register("fused")
class FusedTransport(WeightTransport):
    """Trained side and rollout in the same processes and process group: ``publish`` and ``load``
    run in the same process on every rank; rank 0's rollout loads its buckets in memory, the other
    ranks' rollouts receive them by broadcast (one per bucket, into a reused buffer). Every rank
    must call both."""

    name = "fused"

    def publish(self, source: WeightSource, version: int) -> list[list[Named]] | None:
        return _rank0_buckets(source, self.bucket_bytes)

    def load(self, engine, handle: list[list[Named]] | None, version: int) -> int:
        from hybridrl.parallel import distributed

        if distributed.world_size() == 1:
            return engine.update_weights(_items(handle or []), version)
        return engine.update_weights(_broadcast_buckets(handle or []), version)


def _broadcast_buckets(buckets: list[list[Named]]) -> Iterator[Named]:
    """Rank 0's buckets on every rank of the default group: rank 0 yields its own tensors; the
    others receive each bucket as one flat tensor and yield views of it."""
    import torch.distributed as dist

    from hybridrl.parallel import distributed

    rank = distributed.rank()
    box = [[[(n, t.dtype, tuple(t.shape), nbytes_of(t)) for n, t in b] for b in buckets]]
    dist.broadcast_object_list(box, src=0)
    meta = box[0]
    buf = torch.empty(
        max((sum(m[3] for m in b) for b in meta), default=0),
        dtype=torch.uint8,
        device=distributed._device_of_group(),
    )
    for i, bucket_meta in enumerate(meta):
        flat = buf[: sum(m[3] for m in bucket_meta)]
        if rank == 0:
            offset = 0
            for _, t in buckets[i]:
                nbytes = nbytes_of(t)
                flat[offset : offset + nbytes].copy_(t.detach().reshape(-1).view(torch.uint8))
                offset += nbytes
        dist.broadcast(flat, src=0)
        if rank == 0:
            yield from buckets[i]
            continue
        offset = 0
        for name, dtype, shape, nbytes in bucket_meta:
            yield name, flat[offset : offset + nbytes].view(dtype).view(shape)
            offset += nbytes


# --- store: Ray's object store, across nodes ------------------------------------------------------
def pack(bucket: list[Named]) -> tuple[list[tuple[str, str, tuple]], list[np.ndarray]]:
    """``(meta, arrays)``: one uint8 array per tensor (any dtype, bf16 included), what Ray's object
    store serialises without copying."""
    meta, arrays = [], []
    for name, t in bucket:
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        meta.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape)))
        arrays.append(t.contiguous().reshape(-1).view(torch.uint8).numpy())
    return meta, arrays


def unpack(packed) -> Iterator[Named]:
    meta, arrays = packed
    # object-store arrays are read-only; the engine only copies from them
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for (name, dtype, shape), arr in zip(meta, arrays, strict=True):
            yield name, torch.from_numpy(arr).view(getattr(torch, dtype)).view(shape)


@TRANSPORTS.register("store")
class StoreTransport(WeightTransport):
    """Across nodes: the handle is one object-store reference per bucket; each rollout process
    fetches the buckets one at a time. The references are released when the handle is dropped."""

    name = "store"

    def publish(self, source: WeightSource, version: int) -> list | None:
        import ray

        buckets = _rank0_buckets(source, self.bucket_bytes)
        return None if buckets is None else [ray.put(pack(b)) for b in buckets]

    def load(self, engine, handle: list, version: int) -> int:
        import ray

        def items() -> Iterator[Named]:
            for ref in handle:
                yield from unpack(ray.get(ref))

        return engine.update_weights(items(), version)


# --- shm: a shared-memory staging file, one node (parallel/shm_staging.py) -----------------------
@TRANSPORTS.register("shm")
class ShmTransport(ShmStaging, WeightTransport):
    """One node: a shared-memory staging file written by trained rank 0 and mapped by each rollout
    process (``rehome=False`` turns re-homing off). The behaviour is :class:`ShmStaging`'s
    (``parallel/shm_staging.py``, with the re-homing contract)."""

    name = "shm"


# --- choosing a transport -------------------------------------------------------------------------
def where(worker=None) -> tuple[str, bool]:
    """(Ray node id of this process, whether it has a shared-memory directory); for
    ``apply_all``."""
    import ray

    return ray.get_runtime_context().get_node_id(), SHM_DIR is not None


def choose_transport(trained, rollout) -> str:
    """The transport from the trained side ``trained`` (its role handle: a WorkerGroup or RoleView)
    to ``rollout``: ``fused`` when both are roles of one colocated group (one process group); else
    ``memory`` under the local backend; under ray ``shm`` when every rollout rank is on trained
    rank 0's node and that node has a shared-memory directory, else ``store``. Under ray this asks
    every rank of both roles where it runs (:func:`where`)."""
    from hybridrl.controller.colocated import RoleView

    if (
        isinstance(trained, RoleView)
        and isinstance(rollout, RoleView)
        and trained.group is rollout.group
    ):
        return "fused"
    if trained.backend_name != "ray":
        return "memory"
    node, shm = trained.apply_all(where)[0]
    same = shm and all(n == node for n, _ in rollout.apply_all(where))
    return "shm" if same else "store"
