"""Loading the native model's weights by their transformers names.

The model's parameter names are the transformers names with the packed modules in place of the
ones they pack (``decoder.py``): :data:`PACKED_MODULES` maps ``q_proj``, ``k_proj`` and ``v_proj``
to ``qkv_proj``, ``gate_proj`` and ``up_proj`` to ``gate_up_proj``. A transformers name resolves
to a parameter by replacing its packed module and, for those, to the shard named after the module
it replaced; the parameter then copies the tensor into that shard (``layers.load_into``). The
reverse walk, over the model's parameters and their shards, lists every transformers name the model
holds: that is :meth:`WeightMap.named_weights`, views that alias the parameters.

Buffers with a ``weight_loader`` (the routers' ``expert_bias``) are optional weights: accepted when
sent, never required. The rotary ``inv_freq`` of a transformers state dict is skipped (the runner
builds its own tables).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from hybridrl.rollout.layers import hf_view, load_into

# transformers module -> the packed module that holds it (its shard in that module)
PACKED_MODULES: dict[str, str] = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}
SKIPPED = ("rotary_emb.inv_freq",)  # in a transformers state dict, not weights


def packed_name(name: str) -> tuple[str, str | None]:
    """The model's parameter name for a transformers weight name and the shard it fills (None: the
    whole parameter). Components are matched whole: ``experts.gate_up_proj`` stays as it is."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in PACKED_MODULES:
            parts[i] = PACKED_MODULES[part]
            return ".".join(parts), part
    return name, None


def transformers_name(param_name: str, shard: str | None) -> str:
    """The inverse of :func:`packed_name`."""
    if shard is None:
        return param_name
    parts = param_name.split(".")
    i = max(j for j, part in enumerate(parts) if part == PACKED_MODULES[shard])
    return ".".join(parts[:i] + [shard] + parts[i + 1 :])


class WeightMap:
    """The weights of ``model`` by transformers name, and their loader."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.optional = {
            n: b for n, b in model.named_buffers() if getattr(b, "weight_loader", None) is not None
        }

    def entries(self) -> Iterable[tuple[str, torch.Tensor, str | None]]:
        """(transformers name, parameter, shard) of every weight the model holds."""
        for pname, p in self.params.items():
            for shard in getattr(p, "shards", None) or (None,):
                yield transformers_name(pname, shard), p, shard

    def named_weights(self) -> dict[str, torch.Tensor]:
        """The live weights by transformers name: views of the parameters (a tied head is the
        embedding)."""
        return {name: hf_view(p, shard) for name, p, shard in self.entries()}

    def optional_names(self) -> set[str]:
        return set(self.optional)

    def resolve(self, name: str) -> tuple[torch.Tensor, str | None]:
        """The parameter (or optional buffer) and shard that the transformers weight ``name``
        fills; a KeyError naming it when the model has no such weight."""
        pname, shard = packed_name(name)
        p = self.params.get(pname)
        shards = getattr(p, "shards", None)
        if p is not None and (shard in shards if shards is not None else shard is None):
            return p, shard
        if name in self.optional:
            return self.optional[name], None
        raise KeyError(f"native rollout: no weight named {name!r}")

    @torch.no_grad()
    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]], strict: bool = False) -> int:
        """Copy tensors (transformers names) into the parameters in place, cast to their dtype;
        the number loaded. ``strict``: every weight the model holds must have come (a tied head
        comes with the embedding), else a KeyError naming the missing ones."""
        count, loaded = 0, set()
        for name, tensor in named_tensors:
            if name.endswith(SKIPPED):
                continue
            target, shard = self.resolve(name)
            load_into(target, tensor, shard, name)
            loaded.add((id(target), shard))
            count += 1
        if strict:
            self.check_complete(loaded)
        return count

    def check_complete(self, loaded: set[tuple[int, str | None]]) -> None:
        """Raise a KeyError naming the weights that ``loaded`` ((id(parameter), shard) pairs)
        lacks."""
        missing = [name for name, p, shard in self.entries() if (id(p), shard) not in loaded]
        if missing:
            raise KeyError(f"native rollout: {len(missing)} weight(s) not loaded: {missing[:8]}")
