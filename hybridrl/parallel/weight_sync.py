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
  file (``/dev/shm``, kept and reused across syncs so its pages are faulted in once) and the handle
  is its path and layout; each rollout process maps the file once and copies from it into its live
  weights: two memcpys in all. The file is overwritten by the next publish, so syncs must not
  overlap (load before publishing again).
* ``store``: across nodes. Rank 0 puts every bucket into Ray's object store as numpy arrays and the
  handle is the list of references; each rollout process fetches the buckets one at a time (Ray
  moves them between nodes).

The source (the trained side's worker) offers ``weight_buckets(bucket_bytes)`` (rank 0 returns the
buckets of ``(name, tensor)``, the other ranks ``[]``; every rank must call it), ``model``,
``world_size`` and ``lora`` (None without LoRA). Whatever ``weight_buckets`` yields (full weights,
LoRA adapters, merged deltas) is what travels; nothing here knows about adapters.

Re-homing (``shm`` only). A single-rank source without LoRA whose parameters are all on the CPU and
which offers the two methods below has its parameters moved into the staging file on the first
publish (each one a view of the file): the optimizer then updates them in place there and later
publishes copy nothing, leaving one memcpy in all, on the rollout side. The transport never touches
the parameters itself; the source moves its own, with the helpers of this module:

* ``source.rehome_parameters(stage: StagingFile) -> Layout``: move the parameters into ``stage`` and
  return their layout; implemented as ``return rehome(self.model, stage)``. Called by ``publish``
  once, and again if a parameter was replaced since (a checkpoint load that assigns new tensors, for
  example).
* ``source.unhome_parameters(stage: StagingFile) -> None``: give every parameter that lives in
  ``stage`` its own memory again; implemented as ``unhome(self.model, stage)``. Called by
  ``close()`` (and before a re-homing into a new file) while the source is still alive, so the file
  can be unmapped and removed.

At shutdown the source's process calls ``close()`` on its transport: the parameters leave the
staging file (through ``unhome_parameters``), then the file is unmapped and removed. A transport
that is garbage collected or still open at interpreter exit removes its file (its own
``weakref.finalize``); parameters still inside it keep the mapping, and so their values, until they
are freed.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import uuid
import warnings
import weakref
from collections.abc import Iterator
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch
from torch import nn

from hybridrl.parallel.buckets import BUCKET_BYTES, nbytes_of
from hybridrl.registry import Registry

__all__ = [
    "BUCKET_BYTES",
    "SHM_DIR",
    "TRANSPORTS",
    "FusedTransport",
    "MemoryTransport",
    "ShmTransport",
    "StagedWeights",
    "StagingFile",
    "StoreTransport",
    "WeightSource",
    "WeightTransport",
    "choose_transport",
    "make_transport",
    "pack",
    "rehome",
    "unhome",
    "unpack",
    "where",
]

Named = tuple[str, torch.Tensor]
Entry = tuple[str, torch.dtype, tuple[int, ...], int, int]  # name, dtype, shape, byte offset, bytes
Layout = list[Entry]

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None
ALIGN = 64  # every tensor in a staging file starts on a cache line, whatever the dtypes around it


class WeightSource(Protocol):
    """The trained side as a transport sees it (an actor worker); see the module doc."""

    model: nn.Module
    world_size: int
    lora: Any

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


# --- shm: a shared-memory staging file, one node --------------------------------------------------
def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class StagingFile:
    """A file (in shared memory) mapped into this process. ``create`` makes a new one of ``nbytes``;
    ``open`` maps an existing one. ``close`` unmaps it (the file stays; the writer removes it)."""

    def __init__(self, path: str, nbytes: int, create: bool):
        self.path, self.nbytes = path, nbytes
        with open(path, "w+b" if create else "r+b") as f:
            if create:
                f.truncate(nbytes)
            self.map = mmap.mmap(f.fileno(), nbytes)
        self.buf = torch.frombuffer(self.map, dtype=torch.uint8) if nbytes else torch.empty(0)

    @classmethod
    def create(cls, nbytes: int, directory: str) -> StagingFile:
        name = f"hybridrl-weights-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        return cls(os.path.join(directory, name), nbytes, create=True)

    @classmethod
    def open(cls, path: str) -> StagingFile:
        return cls(path, os.path.getsize(path), create=False)

    @property
    def base(self) -> int:
        """The address of the file's first byte in this process."""
        return self.buf.data_ptr()

    def tensor(self, dtype: torch.dtype, shape: tuple[int, ...], offset: int) -> torch.Tensor:
        """A tensor over the file's bytes at ``offset``, with a storage object of its own (a
        checkpoint must not see every parameter in one shared storage)."""
        count = 1
        for d in shape:
            count *= d
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(self.map, dtype=dtype, count=count, offset=offset).view(shape)

    def contains(self, t: torch.Tensor) -> bool:
        return self.nbytes > 0 and self.base <= t.data_ptr() < self.base + self.nbytes

    def __enter__(self) -> StagingFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.buf = torch.empty(0)
        # a view still alive somewhere keeps the mapping: it goes with the last one
        with contextlib.suppress(BufferError):
            self.map.close()


class StagedWeights(NamedTuple):
    """The ``shm`` handle: the staging file and where each tensor lies in it."""

    path: str
    layout: Layout


def _rehome_layout(model: nn.Module) -> tuple[Layout, int]:
    layout, offset = [], 0
    for name, p in model.named_parameters():  # a tied weight once
        nbytes = nbytes_of(p)
        layout.append((name, p.dtype, tuple(p.shape), offset, nbytes))
        offset += _aligned(nbytes)
    return layout, offset


def rehome(model: nn.Module, stage: StagingFile) -> Layout:
    """Move ``model``'s parameters into ``stage`` (each one a view of the file, values unchanged,
    the ``Parameter`` objects the same, so an optimizer keeps working on them); their layout. For
    the source's own ``rehome_parameters``; ``stage`` must hold :func:`rehome_bytes` of
    ``model``."""
    layout, total = _rehome_layout(model)
    if total > stage.nbytes:
        raise ValueError(
            f"rehome: the model needs {total} bytes, the staging file has {stage.nbytes}"
        )
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, dtype, shape, offset, _ in layout:
            p = params[name]
            home = stage.tensor(dtype, shape, offset)
            home.copy_(p.data)
            p.data = home
    return layout


def rehome_bytes(model: nn.Module) -> int:
    """The size of a staging file that holds ``model``'s parameters re-homed."""
    return _rehome_layout(model)[1]


def unhome(model: nn.Module, stage: StagingFile) -> None:
    """Give every parameter of ``model`` that lives in ``stage`` its own memory again (values
    unchanged). For the source's own ``unhome_parameters``."""
    with torch.no_grad():
        for p in model.parameters():
            if stage.contains(p.data):
                p.data = p.data.clone()


@TRANSPORTS.register("shm")
class ShmTransport(WeightTransport):
    """One node: a shared-memory staging file written by trained rank 0 and mapped by each rollout
    process. An instance holds the writer's file (trained side) or the mapped file (rollout side);
    ``rehome=False`` turns re-homing off. See the module doc for the re-homing contract."""

    name = "shm"

    def __init__(
        self, bucket_bytes: int = BUCKET_BYTES, *, directory: str | None = None, rehome: bool = True
    ):
        super().__init__(bucket_bytes)
        self.directory = directory or SHM_DIR
        self.rehome = rehome
        self._writer: StagingFile | None = None
        self._remove_writer: weakref.finalize | None = None
        # the re-homed source (weakly: the source may hold this transport) and its layout
        self._rehomed: tuple[weakref.ref, Layout] | None = None
        self._reader: StagingFile | None = None

    # trained side
    def publish(self, source: WeightSource, version: int) -> StagedWeights | None:
        if self.directory is None:
            raise RuntimeError("the shm transport needs a shared-memory directory (/dev/shm)")
        if self._can_rehome(source):
            layout = self._rehomed_layout(source)
            return StagedWeights(self._writer.path, layout)
        if self._rehomed is not None:  # no longer re-homing: the parameters leave the file first
            self._release_writer()
        buckets = _rank0_buckets(source, self.bucket_bytes)
        if buckets is None:
            return None
        total = sum(_aligned(nbytes_of(t)) for b in buckets for _, t in b)
        stage = self._stage(total)
        layout, offset = [], 0
        for name, t in _items(buckets):
            nbytes = nbytes_of(t)
            stage.tensor(t.dtype, tuple(t.shape), offset).copy_(t.detach())
            layout.append((name, t.dtype, tuple(t.shape), offset, nbytes))
            offset += _aligned(nbytes)
        return StagedWeights(stage.path, layout)

    def _can_rehome(self, source: WeightSource) -> bool:
        return (
            self.rehome
            and source.world_size == 1
            and getattr(source, "lora", None) is None
            and callable(getattr(source, "rehome_parameters", None))
            and callable(getattr(source, "unhome_parameters", None))
            and all(p.device.type == "cpu" for p in source.model.parameters())
        )

    def _rehomed_layout(self, source: WeightSource) -> Layout:
        if self._rehomed is not None:
            ref, layout = self._rehomed
            if ref() is source and self._still_home(source.model, layout):
                return layout
            self._release_writer()  # the parameters were replaced: they leave the old file first
        stage = self._stage(rehome_bytes(source.model))
        layout = source.rehome_parameters(stage)
        if not self._still_home(source.model, layout):
            raise RuntimeError("rehome_parameters left parameters outside the staging file")
        self._rehomed = (weakref.ref(source), layout)
        return layout

    def _still_home(self, model: nn.Module, layout: Layout) -> bool:
        params = dict(model.named_parameters())
        base = self._writer.base if self._writer is not None else -1
        return len(params) == len(layout) and all(
            name in params
            and params[name].dtype == dtype
            and tuple(params[name].shape) == shape
            and (nbytes == 0 or params[name].data_ptr() == base + offset)
            for name, dtype, shape, offset, nbytes in layout
        )

    def _stage(self, nbytes: int) -> StagingFile:
        """The writer's staging file, re-created when it is smaller than ``nbytes``."""
        if self._writer is None or self._writer.nbytes < nbytes:
            self._release_writer()
            self._writer = StagingFile.create(max(nbytes, ALIGN), self.directory)
            self._remove_writer = weakref.finalize(self, _unlink, self._writer.path)
        return self._writer

    def _release_writer(self) -> None:
        if self._rehomed is not None:
            source = self._rehomed[0]()
            self._rehomed = None
            if source is not None and self._writer is not None:
                source.unhome_parameters(self._writer)
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._remove_writer is not None:
            self._remove_writer()  # removes the file, once
            self._remove_writer = None

    # rollout side
    def load(self, engine, handle: StagedWeights, version: int) -> int:
        path, layout = handle
        if self._reader is None or self._reader.path != path:
            self._close_reader()
            self._reader = StagingFile.open(path)
        stage = self._reader
        items = ((n, stage.tensor(dtype, shape, o)) for n, dtype, shape, o, _ in layout)
        return engine.update_weights(items, version)

    def _close_reader(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    @property
    def rehomed(self) -> bool:
        """Whether a source's parameters live in this transport's staging file (trained side)."""
        return self._rehomed is not None and self._rehomed[0]() is not None

    @property
    def path(self) -> str | None:
        """The writer's staging file (trained side), if any."""
        return self._writer.path if self._writer is not None else None

    def close(self) -> None:
        self._release_writer()
        self._close_reader()


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
