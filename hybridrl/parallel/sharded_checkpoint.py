"""Sharded checkpoints on disk: every rank writes its shards of the model (and optimizer) with
torch.distributed.checkpoint (DCP), loads them back at any world size (DCP reshards), and one
process can turn them into a transformers directory (:func:`export_hf`, behind ``hybridrl
export``).

Kept apart from ``parallel/fsdp.py`` (which shards the model) because the on-disk layout and its
crash safety are a concern of their own: the LoRA checkpoints (``learner/lora.py``) reuse the same
atomic directory swap without any FSDP wrapping.

Layout written by :func:`save_sharded` at ``path``::

    path/.metadata, path/__0_0.distcp ...   DCP: {"model": ..., "optim": ...}, one file per rank
    path/extra.pt                            the extra state (RNG, scheduler, step ...), rank 0

written under ``.<name>.tmp`` and renamed when every rank is done, so a crash mid-save leaves
whatever was at ``path`` before untouched and loadable.
"""

from __future__ import annotations

import os
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from hybridrl.models import save_model_dir
from hybridrl.parallel import distributed

COMPLETE_MARK = ".metadata"  # DCP writes it last (rank 0, after every rank's data)


def is_complete(path: str | Path) -> bool:
    """A finished :func:`save_sharded` checkpoint (not a temporary directory)."""
    path = Path(path)
    return (path / COMPLETE_MARK).is_file() and not path.name.endswith(".tmp")


def replace_dir(tmp: Path, path: Path) -> None:
    """``tmp`` becomes ``path``; the old ``path`` stays in place until the new one is there."""
    old = path.parent / f".{path.name}.old"
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def quiet_single_process():
    """DCP warns on every call without a process group; one process is a supported layout here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _states(model: nn.Module, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    return state


def _fresh_staging_dir(path: Path) -> Path:
    """``.<name>.tmp`` beside ``path``, emptied by rank 0 (every rank waits for it): where a save
    writes before the directory is renamed into place."""
    tmp = path.parent / f".{path.name}.tmp"
    if distributed.rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    distributed.barrier()
    return tmp


def save_sharded(
    path: str | Path, model: nn.Module, optimizer=None, extra: dict | None = None
) -> Path:
    """Every rank writes its shards of model (+ optimizer) to ``path`` (one DCP checkpoint), rank 0
    ``extra``.

    ``extra``: plain state (tensors, numbers, strings, lists, dicts): LR scheduler, RNG states, data
    position, step. Written to ``.<name>.tmp`` next to ``path`` and renamed when complete. All ranks
    must see the same filesystem at ``path``.
    """
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    tmp = _fresh_staging_dir(path)
    with quiet_single_process():
        dcp.save(_states(model, optimizer), storage_writer=dcp.FileSystemWriter(tmp))
    if distributed.rank() == 0:
        torch.save(dict(extra or {}), tmp / "extra.pt")
    distributed.barrier()
    if distributed.rank() == 0:
        replace_dir(tmp, path)
    distributed.barrier()
    return path


def stage_sharded(path: str | Path, model: nn.Module, optimizer, extra: dict, writer):
    """:func:`save_sharded` in two halves, for a background save: now (every rank, a collective)
    the shards are staged to host memory (``FileSystemWriter.stage``, what ``dcp.async_save``
    does); the returned function, run on ``writer``'s thread, writes them (synchronising on
    ``writer.group``, a gloo group of its own, never the training's), then rank 0 writes
    ``extra`` and renames the directory into place. DCP's save returns on rank 0 only once every
    rank's files are written and fsynced."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    tmp = _fresh_staging_dir(path)
    grouped = dist.is_available() and dist.is_initialized()
    if grouped and writer.group is None:
        writer.group = dist.new_group(backend="gloo")
    storage = dcp.FileSystemWriter(tmp)
    staged = storage.stage(_states(model, optimizer))
    extra = {k: v.clone() if torch.is_tensor(v) else v for k, v in extra.items()}

    def write() -> None:
        dcp.save(staged, storage_writer=storage, process_group=writer.group, no_dist=not grouped)
        if distributed.rank() == 0:
            torch.save(extra, tmp / "extra.pt")
            replace_dir(tmp, path)

    return write


def load_sharded(path: str | Path, model: nn.Module, optimizer=None) -> dict:
    """Load model (+ optimizer) shards from a :func:`save_sharded` checkpoint, whatever the world
    size that wrote it (DCP reshards); returns the ``extra`` state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    path = Path(path)
    if not is_complete(path):
        raise FileNotFoundError(
            f"{path} is not a complete sharded checkpoint ({COMPLETE_MARK} missing)"
        )
    state = _states(model, optimizer)
    with quiet_single_process():
        dcp.load(state, storage_reader=dcp.FileSystemReader(path))
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optim"])
    extra = path / "extra.pt"
    return torch.load(extra, weights_only=True) if extra.is_file() else {}


def export_hf(
    checkpoint: str | Path,
    out_dir: str | Path,
    *,
    config_dir: str | Path | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write a transformers-format directory (config, safetensors weights, tokenizer when found)
    from a sharded checkpoint, in one process (no group needed).

    ``checkpoint``: a :func:`save_sharded` directory or a worker checkpoint holding one under
    ``dcp/``; ``config_dir``: where ``config.json`` is (default: ``checkpoint``, then its parent).
    """
    import torch.distributed.checkpoint as dcp
    import transformers

    ckpt = Path(checkpoint)
    shards = ckpt / "dcp" if is_complete(ckpt / "dcp") else ckpt
    if not is_complete(shards):
        # single-process layout
        if any(ckpt.glob("*.safetensors")) and (ckpt / "config.json").is_file():
            return _copy_hf(ckpt, Path(out_dir), dtype)
        raise FileNotFoundError(
            f"{ckpt}: no complete sharded checkpoint (and no transformers weights)"
        )
    candidates = [Path(config_dir)] if config_dir else [ckpt, shards, ckpt.parent]
    cdir = next((c for c in candidates if (c / "config.json").is_file()), None)
    if cdir is None:
        raise FileNotFoundError(f"{ckpt}: no config.json to build the model from (pass config_dir)")
    config = transformers.AutoConfig.from_pretrained(cdir, local_files_only=True)
    cls = model_class(config)
    with torch.device("meta"):
        model = (
            cls._from_config(config) if hasattr(cls, "_from_config") else cls.from_config(config)
        )
    model.to_empty(device="cpu")
    sd = model.state_dict()
    with quiet_single_process():
        dcp.load({"model": sd}, storage_reader=dcp.FileSystemReader(shards))
    model.load_state_dict(sd, assign=True)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    if dtype is not None:
        model.to(dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = next(
        (
            transformers.AutoTokenizer.from_pretrained(src, local_files_only=True)
            for src in (ckpt, cdir)
            if (src / "tokenizer_config.json").is_file()
        ),
        None,
    )
    return save_model_dir(out, model, tokenizer)


def model_class(config):
    """The class named in ``config.architectures`` (a causal LM when it names none)."""
    import transformers

    arch = (config.architectures or ["AutoModelForCausalLM"])[0]
    return getattr(transformers, arch, None) or transformers.AutoModelForCausalLM


def _copy_hf(src: Path, out: Path, dtype: torch.dtype | None) -> Path:
    import transformers

    cls = model_class(transformers.AutoConfig.from_pretrained(src, local_files_only=True))
    model = cls.from_pretrained(src, local_files_only=True, dtype=dtype or torch.float32)
    tokenizer = (
        transformers.AutoTokenizer.from_pretrained(src, local_files_only=True)
        if (src / "tokenizer_config.json").is_file()
        else None
    )
    return save_model_dir(out, model, tokenizer)
