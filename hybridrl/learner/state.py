"""Save / load what a trained role needs to resume exactly.

A role checkpoint directory ``path``::

    path/config.json, model.safetensors ...   transformers format (rank 0; weights only when
                                               ``hf_weights``)
    path/tokenizer*                            the tokenizer, when the role has one
    path/dcp/                                  sharded layout: model + optimizer shards (every
                                               rank) and the extra state (shuffle RNG), see
                                               ``parallel/sharded_checkpoint.py``
    path/train_state.pt                        single-process layout: optimizer + shuffle RNG

``layout="auto"`` writes the sharded layout for an FSDP-wrapped model and the single-process one
otherwise (``"dcp"`` forces the sharded layout, which also works in one process). Every rank of the
role calls :func:`save_trainable` / :func:`load_trainable` (the sharded parts are collectives);
either layout loads. ``hybridrl.parallel.sharded_checkpoint.export_hf(path, out)`` rebuilds a
transformers directory from ``path/dcp`` alone.

Background saves (``trainer.async_save``): given a :class:`BackgroundWriter`,
:func:`save_trainable` takes a consistent snapshot now (every tensor copied to host memory, tied
weights kept tied; under FSDP the gathered full weights and the DCP shards staged as
``dcp.async_save`` stages them) and queues the writes; the writer's thread writes the same files
the synchronous save writes, and the caller goes on training meanwhile.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from hybridrl.parallel import distributed
from hybridrl.parallel.fsdp import full_state_dict, is_sharded
from hybridrl.parallel.sharded_checkpoint import (
    is_complete,
    load_sharded,
    save_sharded,
    stage_sharded,
)


def host_copy(obj, memo: dict | None = None):
    """``obj`` (nested dicts, lists and tuples of tensors and plain values) with every tensor copied
    to host memory; tensors viewing the same memory (tied weights) stay one tensor."""
    memo = {} if memo is None else memo
    if torch.is_tensor(obj):
        key = (obj.untyped_storage().data_ptr(), obj.storage_offset(), obj.shape, obj.stride())
        key += (obj.dtype,)
        if key not in memo:
            memo[key] = obj.detach().to("cpu", copy=True)
        return memo[key]
    if isinstance(obj, dict):
        return type(obj)((k, host_copy(v, memo)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(host_copy(v, memo) for v in obj)
    return obj


class BackgroundWriter:
    """One checkpoint's writes, run in order on one thread; ``wait`` returns the first failure.

    ``group``: the gloo process group the sharded writes synchronise on, so that they never share
    a collective with training (created by the first sharded background save: every rank saves at
    once)."""

    def __init__(self):
        self.jobs: list[Callable[[], None]] = []
        self.thread: threading.Thread | None = None
        self.failure: dict | None = None
        self.group = None

    def add(self, job: Callable[[], None]) -> None:
        self.jobs.append(job)

    def start(self, marker: str | None = None) -> None:
        """Run the queued jobs on a thread; then write ``marker`` (JSON: ``{"ok": true}`` or the
        failure of :func:`describe_failure`; fsynced, renamed into place) for a driver in another
        process."""
        jobs, self.jobs, self.failure = self.jobs, [], None

        def run():
            try:
                for job in jobs:
                    job()
            except BaseException as exc:  # noqa: BLE001 -- reported through wait() and the marker
                self.failure = describe_failure(exc)
            if marker is not None:
                try:  # whole or absent: written aside, then renamed
                    with open(f"{marker}.part", "w") as f:
                        f.write(json.dumps(self.failure or {"ok": True}))
                        f.flush()
                        os.fsync(f.fileno())
                    os.replace(f"{marker}.part", marker)
                except OSError as exc:
                    self.failure = self.failure or describe_failure(exc)

        self.thread = threading.Thread(target=run, name="checkpoint-writer", daemon=True)
        self.thread.start()

    def wait(self) -> dict | None:
        """Wait for the writes in flight; their failure (None: written, or nothing in flight)."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        return self.failure


def describe_failure(exc: BaseException) -> dict:
    """A failed write as plain data (it crosses processes): the exception's type and message and,
    for an ``OSError`` in it or its causes, the errno, strerror and file name."""
    os_err, e = None, exc
    while e is not None and os_err is None:
        os_err = e if isinstance(e, OSError) else None
        e = e.__cause__ or e.__context__
    out = {"type": type(exc).__name__, "message": " ".join(str(exc).split())}
    if os_err is not None:
        out |= {"errno": os_err.errno, "strerror": os_err.strerror, "filename": os_err.filename}
    return out


def _plain_class_name(model) -> str:
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule)).__name__


def save_trainable(
    path: str | Path,
    model,
    optimizer,
    generator: torch.Generator,
    tokenizer=None,
    *,
    hf_weights: bool = True,
    layout: str = "auto",
    background: BackgroundWriter | None = None,
) -> None:
    """Write the role to ``path`` (the layouts of the module doc); with ``background``, snapshot
    now and queue the writes on it (:class:`BackgroundWriter`)."""
    path = Path(path)
    if layout not in ("auto", "dcp", "single"):
        raise ValueError(f"layout must be auto, dcp or single, got {layout!r}")
    if layout == "single" or (layout == "auto" and not is_sharded(model)):
        if is_sharded(model):
            raise ValueError("a sharded model needs the dcp layout")
        if background is None:
            _write_single(
                path, model, None, optimizer.state_dict(), generator.get_state(), tokenizer
            )
            return
        weights = host_copy(model.state_dict())
        train_state = host_copy(optimizer.state_dict())
        rng = generator.get_state()
        background.add(lambda: _write_single(path, model, weights, train_state, rng, tokenizer))
        return
    if background is not None:
        _queue_sharded(path, model, optimizer, generator, tokenizer, hf_weights, background)
        return
    if not is_sharded(model):
        if hf_weights:
            model.save_pretrained(path)
        else:
            path.mkdir(parents=True, exist_ok=True)
            model.config.save_pretrained(path)
    else:
        sd = full_state_dict(model) if hf_weights else {}  # collective
        if distributed.rank() == 0:
            path.mkdir(parents=True, exist_ok=True)
            if hf_weights:
                model.save_pretrained(path, state_dict=sd)
            else:
                model.config.save_pretrained(path)
            # the class name, not FSDP's subclass
            config = json.loads((path / "config.json").read_text())
            config["architectures"] = [_plain_class_name(model)]
            (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        del sd
    if tokenizer is not None and distributed.rank() == 0:
        tokenizer.save_pretrained(path)
    save_sharded(path / "dcp", model, optimizer, extra={"shuffle_rng": generator.get_state()})


def _write_single(path: Path, model, weights, optimizer_state, rng, tokenizer) -> None:
    """The single-process layout: ``weights`` (None: the model's own) in transformers format,
    the tokenizer, and ``train_state.pt``."""
    model.save_pretrained(path, **({} if weights is None else {"state_dict": weights}))
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    torch.save({"optimizer": optimizer_state, "shuffle_rng": rng}, path / "train_state.pt")


def _queue_sharded(path: Path, model, optimizer, generator, tokenizer, hf_weights, writer) -> None:
    """The sharded layout in the background: the full weights gathered now (a collective, rank 0
    keeps a host copy), the shards staged now; the files written by ``writer``'s thread."""
    if not is_sharded(model):
        sd = host_copy(model.state_dict()) if hf_weights else None
    else:
        sd = host_copy(full_state_dict(model)) if hf_weights else None  # collective
    rank0 = distributed.rank() == 0
    write_shards = stage_sharded(
        path / "dcp", model, optimizer, {"shuffle_rng": generator.get_state()}, writer
    )

    def write() -> None:
        if rank0:
            path.mkdir(parents=True, exist_ok=True)
            if sd is not None:
                model.save_pretrained(path, state_dict=sd)
            else:
                model.config.save_pretrained(path)
            if is_sharded(model):  # the class name, not FSDP's subclass
                config = json.loads((path / "config.json").read_text())
                config["architectures"] = [_plain_class_name(model)]
                text = json.dumps(config, indent=2, sort_keys=True) + "\n"
                (path / "config.json").write_text(text)
            if tokenizer is not None:
                tokenizer.save_pretrained(path)
        write_shards()

    writer.add(write)


def _load_hf_weights(path: Path, model) -> None:
    """Copy the transformers-format weights at ``path`` into ``model``, every parameter and
    persistent buffer (a tied copy, which the format stores once, excepted); raises when the names
    do not match."""
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.is_file()
        else ["model.safetensors"]
    )
    saved = {}
    for name in files:
        saved |= load_file(path / name)
    own = model.state_dict()
    stored = {own[k].data_ptr() for k in saved if k in own}
    unexpected = sorted(set(saved) - set(own))
    missing = sorted(k for k in set(own) - set(saved) if own[k].data_ptr() not in stored)
    if unexpected or missing:
        raise ValueError(
            f"{path}: weights do not match the model (missing {missing[:5]}, unexpected "
            f"{unexpected[:5]})"
        )
    with torch.no_grad():
        for k, t in saved.items():
            own[k].copy_(t)


def load_trainable(path: str | Path, model, optimizer, generator: torch.Generator) -> None:
    """Weights, optimizer and RNG state, from either layout: the role equals the one that saved,
    however its model was built (e.g. a critic's head initialised for a fresh run)."""
    path = Path(path)
    if is_complete(path / "dcp"):
        extra = load_sharded(path / "dcp", model, optimizer)
        generator.set_state(extra["shuffle_rng"])
        return
    if is_sharded(model):
        raise ValueError(
            f"{path} holds the single-process layout; a sharded model loads only {path / 'dcp'}"
        )
    state = torch.load(path / "train_state.pt", weights_only=True)
    _load_hf_weights(path, model)
    optimizer.load_state_dict(state["optimizer"])
    generator.set_state(state["shuffle_rng"])


class NonFiniteWeightsError(ValueError):
    """A role's parameters hold NaN or inf: such weights are never written to a checkpoint."""


def nonfinite_parameters(model) -> list[str]:
    """Names of ``model``'s parameters (this rank's shards under FSDP) holding a NaN or inf: one
    ``isfinite().all()`` reduction per tensor, and one device-to-host copy per device."""
    flags: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            t = p.to_local() if hasattr(p, "to_local") else p  # a DTensor: this rank's shard
            if t.numel():
                flags.setdefault(t.device, []).append((name, torch.isfinite(t).all()))
    bad = []
    for items in flags.values():
        finite = torch.stack([f for _, f in items]).cpu().tolist()
        bad += [name for (name, _), ok in zip(items, finite) if not ok]
    return bad


def check_finite(models: dict) -> None:
    """Raise :class:`NonFiniteWeightsError` when a parameter of any of ``models`` (``{role:
    model}``; None skipped) is not finite on any rank. A collective when the role is sharded: every
    rank checks its shards and the ranks agree through one small all-reduce."""
    models = {role: m for role, m in models.items() if m is not None}
    bad = {role: nonfinite_parameters(m) for role, m in models.items()}
    counts = distributed.all_reduce([float(len(b)) for b in bad.values()]).tolist()
    if not any(counts):
        return
    parts = []
    for (role, names), n in zip(bad.items(), counts):
        if n:
            example = f", e.g. {names[0]!r}" if names else ""
            parts.append(f"{role}: {int(n)} parameter tensor(s) with NaN/inf{example}")
    raise NonFiniteWeightsError("non-finite weights (" + "; ".join(parts) + ")")
