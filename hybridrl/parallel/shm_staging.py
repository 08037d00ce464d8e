"""The ``shm`` weight-sync transport's machinery: a shared-memory staging file, re-homing a source's
parameters into it, and the transport's two halves over it. The registered transport is
``weight_sync.ShmTransport`` (:class:`ShmStaging` on the ``WeightTransport`` interface); this module
knows nothing of the other transports and does not import ``weight_sync``.

Separate processes on one node: rank 0 copies the buckets into a shared-memory staging file
(``/dev/shm``, kept and reused across syncs so its pages are faulted in once) and the handle
(:class:`StagedWeights`) is its path and layout; each rollout process maps the file once and copies
from it into its live weights: two memcpys in all. The file is overwritten by the next publish, so
syncs must not overlap (load before publishing again).

Re-homing (``shm`` only). A single-rank source whose published weights are its parameters by name
(``weights_are_parameters``: not LoRA adapters, not a pipeline's stages), all on the CPU, and which
offers the two methods below has its parameters moved into the staging file on the first
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
import weakref
from typing import Any, NamedTuple

import torch
from torch import nn

from hybridrl.parallel.buckets import BUCKET_BYTES, nbytes_of

__all__ = [
    "ALIGN",
    "SHM_DIR",
    "Layout",
    "ShmStaging",
    "StagedWeights",
    "StagingFile",
    "rehome",
    "rehome_bytes",
    "unhome",
]

Entry = tuple[str, torch.dtype, tuple[int, ...], int, int]  # name, dtype, shape, byte offset, bytes
Layout = list[Entry]

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None
ALIGN = 64  # every tensor in a staging file starts on a cache line, whatever the dtypes around it


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


class ShmStaging:
    """The ``shm`` transport's behaviour, as a mixin for ``weight_sync.ShmTransport`` (which puts it
    on the ``WeightTransport`` interface and registers it): a shared-memory staging file written by
    trained rank 0 and mapped by each rollout process. An instance holds the writer's file (trained
    side) or the mapped file (rollout side); ``rehome=False`` turns re-homing off. ``source`` is a
    ``weight_sync.WeightSource``; see the module doc for the re-homing contract."""

    def __init__(
        self, bucket_bytes: int = BUCKET_BYTES, *, directory: str | None = None, rehome: bool = True
    ):
        super().__init__(bucket_bytes)  # WeightTransport's, next in ShmTransport's MRO
        self.directory = directory or SHM_DIR
        self.rehome = rehome
        self._writer: StagingFile | None = None
        self._remove_writer: weakref.finalize | None = None
        # the re-homed source (weakly: the source may hold this transport) and its layout
        self._rehomed: tuple[weakref.ref, Layout] | None = None
        self._reader: StagingFile | None = None

    # trained side
    def publish(self, source: Any, version: int) -> StagedWeights | None:
        if self.directory is None:
            raise RuntimeError("the shm transport needs a shared-memory directory (/dev/shm)")
        if self._can_rehome(source):
            layout = self._rehomed_layout(source)
            return StagedWeights(self._writer.path, layout)
        if self._rehomed is not None:  # no longer re-homing: the parameters leave the file first
            self._release_writer()
        buckets = source.weight_buckets(self.bucket_bytes)
        if not any(buckets):  # not rank 0
            return None
        total = sum(_aligned(nbytes_of(t)) for b in buckets for _, t in b)
        stage = self._stage(total)
        layout, offset = [], 0
        for name, t in (item for bucket in buckets for item in bucket):
            nbytes = nbytes_of(t)
            stage.tensor(t.dtype, tuple(t.shape), offset).copy_(t.detach())
            layout.append((name, t.dtype, tuple(t.shape), offset, nbytes))
            offset += _aligned(nbytes)
        return StagedWeights(stage.path, layout)

    def _can_rehome(self, source: Any) -> bool:
        return (
            self.rehome
            and source.world_size == 1
            and getattr(source, "weights_are_parameters", False)
            and callable(getattr(source, "rehome_parameters", None))
            and callable(getattr(source, "unhome_parameters", None))
            and all(p.device.type == "cpu" for p in source.model.parameters())
        )

    def _rehomed_layout(self, source: Any) -> Layout:
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
