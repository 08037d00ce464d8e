"""Weight sync actor -> rollout: bucketed (``actor.weight_buckets(bucket_bytes)``), versioned, never one
call per tensor. Three paths, chosen by where the roles live (:meth:`Roles.sync_weights`):

* same process (``local`` backend): rank 0's buckets are handed to the rollout as they are (the tensors
  themselves, no copy);
* fused (ray, actor and rollout colocated in one process per slot): every rank gathers, rank 0 hands its
  buckets to its own rollout in memory and broadcasts each bucket as one flat byte tensor over the
  group the ranks already share (gloo / NCCL) to the other ranks' rollouts;
* across processes on one node (ray, rollout on its own pool, every rollout worker on actor rank 0's
  node): actor rank 0 copies the buckets into a shared-memory staging file (``/dev/shm``, kept and
  reused across syncs, so its pages are faulted in once) and returns a small descriptor; each rollout
  worker maps the file once and copies from it into its live weights: two memcpys in all. A
  single-rank actor training all its weights goes further: on the first sync its parameters are
  re-homed into the staging file (each one a view of it), so the optimizer updates them in place there
  and later syncs publish without copying: one memcpy in all, on the rollout side;
* across nodes: actor rank 0 puts every bucket into Ray's object store as numpy arrays and returns
  only the references; each rollout worker fetches the buckets itself (Ray moves them between nodes)
  and loads them one at a time.

The driver only passes descriptors or references, never the bytes. The staging file is overwritten by
the next sync, so syncs must not overlap (``Roles.sync_weights`` waits for the rollout to load).

LoRA: whatever the actor's ``weight_buckets`` yields (the adapter tensors, merged deltas or full weights)
is what travels; nothing here knows about adapters.
"""

from __future__ import annotations

import atexit
import mmap
import os
import uuid
import warnings
from collections.abc import Iterable, Iterator

import numpy as np
import torch

BUCKET_BYTES = 64 << 20

Named = tuple[str, torch.Tensor]


# --- packing: a bucket as numpy arrays (what Ray's object store serialises without copying) -------------
def pack(bucket: list[Named]) -> tuple[list[tuple[str, str, tuple]], list[np.ndarray]]:
    """``(meta, arrays)``: one uint8 array per tensor (a view of the tensor, any dtype incl. bf16)."""
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
    with (
        warnings.catch_warnings()
    ):  # object-store arrays are read-only; the engine only copies from them
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for (name, dtype, shape), arr in zip(meta, arrays):
            yield name, torch.from_numpy(arr).view(getattr(torch, dtype)).view(shape)


# --- across processes: the object store ----------------------------------------------------------------
def publish(actor, bucket_bytes: int = BUCKET_BYTES) -> list:
    """On every actor rank (the gather is a collective): rank 0 returns one ObjectRef per bucket, others []."""
    import ray

    return [ray.put(pack(b)) for b in actor.weight_buckets(bucket_bytes)]


def load_published(rollout, refs: list, version: int) -> int:
    """On every rollout rank: fetch the buckets one at a time and load them; the number of tensors loaded."""
    import ray

    def items() -> Iterator[Named]:
        for ref in refs:
            yield from unpack(ray.get(ref))

    return rollout.update_weights([items()], version)


# --- across processes on one node: a reused shared-memory staging file --------------------------------------
SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None


class _Stage:
    """A file in shared memory mapped into this process; grown (re-created) when a sync needs more room."""

    def __init__(self, path: str, nbytes: int, create: bool):
        self.path, self.nbytes = path, nbytes
        with open(path, "w+b" if create else "r+b") as f:
            if create:
                f.truncate(nbytes)
            self.map = mmap.mmap(f.fileno(), nbytes)
        self.buf = torch.frombuffer(self.map, dtype=torch.uint8)

    def close(self) -> None:
        del self.buf
        try:
            self.map.close()
        except BufferError:  # a view is still alive somewhere: the mapping goes with it
            pass


_writer: _Stage | None = None  # actor rank 0's staging file
_readers: dict[str, _Stage] = {}  # rollout side: mapped staging files by path


_ALIGN = 64  # every tensor starts on a cache line, whatever the dtypes around it
_rehomed: list | None = (
    None  # the descriptor of a re-homed actor (its weights live in the staging file)
)


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _rehome(actor) -> list:
    """Move a single-rank actor's parameters into the staging file, once; their layout as a descriptor."""
    global _writer
    named = list(dict(actor.model.named_parameters()).items())  # tied weights once
    total = sum(_aligned(p.numel() * p.element_size()) for _, p in named)
    release_stage(actor)
    _writer = _Stage(
        os.path.join(SHM_DIR, f"hybridrl-weights-{os.getpid()}-{uuid.uuid4().hex[:8]}"),
        total,
        create=True,
    )
    atexit.register(release_stage)
    meta, offset = [], 0
    with torch.no_grad():
        for name, p in named:
            nbytes = p.numel() * p.element_size()
            # its own storage object over the shared pages (checkpoints must not see one storage shared by all)
            home = torch.frombuffer(
                _writer.map, dtype=p.dtype, count=p.numel(), offset=offset
            ).view(p.shape)
            home.copy_(p.data)
            p.data = home
            meta.append((name, p.dtype, tuple(p.shape), offset, nbytes))
            offset += _aligned(nbytes)
    return meta


def _can_rehome(actor) -> bool:
    return (
        actor.world_size == 1
        and getattr(actor, "lora", None) is None
        and SHM_DIR is not None
        and all(p.device.type == "cpu" for p in actor.model.parameters())
    )


def publish_shared(actor, bucket_bytes: int = BUCKET_BYTES):
    """On every actor rank: rank 0 copies the buckets into its staging file (or, re-homed, copies nothing)
    and returns ``(path, [(name, dtype, shape, offset, nbytes)])``; other ranks None."""
    global _writer, _rehomed
    if _can_rehome(actor):
        if _rehomed is None or _writer is None:
            _rehomed = _rehome(actor)
        return _writer.path, _rehomed
    meta, offset = [], 0
    buckets = actor.weight_buckets(bucket_bytes)
    if not buckets:
        return None
    total = sum(t.numel() * t.element_size() for b in buckets for _, t in b)
    if _writer is None or _writer.nbytes < total:
        release_stage(actor)
        _writer = _Stage(
            os.path.join(SHM_DIR, f"hybridrl-weights-{os.getpid()}-{uuid.uuid4().hex[:8]}"),
            total,
            create=True,
        )
        atexit.register(release_stage)
    for bucket in buckets:
        for name, t in bucket:
            nbytes = t.numel() * t.element_size()
            _writer.buf[offset : offset + nbytes].copy_(t.detach().reshape(-1).view(torch.uint8))
            meta.append((name, t.dtype, tuple(t.shape), offset, nbytes))
            offset += nbytes
    return _writer.path, meta


def load_shared(rollout, desc, version: int) -> int:
    """On every rollout rank (same node as actor rank 0): map the staging file (once) and load from it."""
    path, meta = desc
    stage = _readers.get(path)
    if stage is None:
        for old in _readers.values():
            old.close()
        _readers.clear()
        stage = _readers[path] = _Stage(path, os.path.getsize(path), create=False)
    items = ((n, stage.buf[o : o + b].view(dtype).view(shape)) for n, dtype, shape, o, b in meta)
    return rollout.update_weights([items], version)


def where(worker) -> tuple[str, bool]:
    """(Ray node id of this process, whether it has a shared-memory directory)."""
    import ray

    return ray.get_runtime_context().get_node_id(), SHM_DIR is not None


def release_stage(actor=None) -> None:
    """Remove actor rank 0's staging file (at shutdown; a new sync creates another)."""
    global _writer, _rehomed
    if _rehomed is not None and actor is not None:  # the parameters leave the file before it goes
        with torch.no_grad():
            for p in actor.model.parameters():
                p.data = p.data.clone()
    _rehomed = None
    if _writer is not None:
        _writer.close()
        try:
            os.unlink(_writer.path)
        except FileNotFoundError:
            pass
        _writer = None


# --- fused: in memory on rank 0, a broadcast to the other ranks -------------------------------------------
def _broadcast_buckets(buckets: list[list[Named]]) -> Iterator[Named]:
    """Rank 0's buckets on every rank of the default group: rank 0 yields its own tensors; the others
    receive each bucket as one flat tensor (one broadcast per bucket, into a reused buffer) and yield views."""
    import torch.distributed as dist

    from hybridrl.training import distributed as D

    device = D._device_of_group()
    meta = [
        [(n, t.dtype, tuple(t.shape), t.numel() * t.element_size()) for n, t in b] for b in buckets
    ]
    box = [meta]
    dist.broadcast_object_list(box, src=0)
    meta = box[0]
    buf = torch.empty(
        max((sum(m[3] for m in b) for b in meta), default=0), dtype=torch.uint8, device=device
    )
    for i, bucket_meta in enumerate(meta):
        size = sum(m[3] for m in bucket_meta)
        flat = buf[:size]
        if D.rank() == 0:
            offset = 0
            for _, t in buckets[i]:
                nbytes = t.numel() * t.element_size()
                flat[offset : offset + nbytes].copy_(t.detach().reshape(-1).view(torch.uint8))
                offset += nbytes
        dist.broadcast(flat, src=0)
        if D.rank() == 0:
            yield from buckets[i]
            continue
        offset = 0
        for name, dtype, shape, nbytes in bucket_meta:
            yield name, flat[offset : offset + nbytes].view(dtype).view(shape)
            offset += nbytes


def sync_fused(worker, version: int, bucket_bytes: int = BUCKET_BYTES) -> int:
    """On every rank of a fused group holding ``actor`` and ``rollout``."""
    from hybridrl.training import distributed as D

    actor, rollout = worker.parts["actor"], worker.parts["rollout"]
    buckets = actor.weight_buckets(bucket_bytes)
    if D.world_size() == 1:
        return rollout.update_weights(buckets, version)
    return rollout.update_weights([_broadcast_buckets(buckets)], version)


def bucket_bytes_of(items: Iterable[Named]) -> int:
    return sum(t.numel() * t.element_size() for _, t in items)
