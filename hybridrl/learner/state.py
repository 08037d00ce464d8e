"""Save / load what a trained role needs to resume exactly.

A role checkpoint directory ``path``::

    path/config.json, model.safetensors ...   transformers format (rank 0; weights only when
    ``hf_weights``) path/tokenizer*                            the tokenizer, when the role has one
    path/dcp/                                  sharded layout: model + optimizer shards (every rank)
    and the
                                               extra state (shuffle RNG) -- see ``parallel/fsdp.py``
    path/train_state.pt                        single-process layout: optimizer + shuffle RNG

``layout="auto"`` writes the sharded layout for an FSDP-wrapped model and the single-process one
otherwise (``"dcp"`` forces the sharded layout, which also works in one process). Every rank of the
role calls :func:`save_trainable` / :func:`load_trainable` (the sharded parts are collectives);
either layout loads. ``hybridrl.parallel.fsdp.export_hf(path, out)`` rebuilds a transformers
directory from ``path/dcp`` alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hybridrl.parallel import distributed
from hybridrl.parallel.fsdp import (
    full_state_dict,
    is_complete,
    is_sharded,
    load_sharded,
    save_sharded,
)


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
) -> None:
    path = Path(path)
    if layout not in ("auto", "dcp", "single"):
        raise ValueError(f"layout must be auto, dcp or single, got {layout!r}")
    if layout == "single" or (layout == "auto" and not is_sharded(model)):
        if is_sharded(model):
            raise ValueError("a sharded model needs the dcp layout")
        model.save_pretrained(path)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)
        torch.save(
            {"optimizer": optimizer.state_dict(), "shuffle_rng": generator.get_state()},
            path / "train_state.pt",
        )
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
