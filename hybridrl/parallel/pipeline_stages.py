"""Cutting a decoder-only causal LM into pipeline stages, and where each stage lives.

A transformers Qwen2/Qwen3/Llama-style model (``model.model.embed_tokens``, ``.layers``, ``.norm``,
``.rotary_emb``, ``lm_head``) becomes ``n_stages`` :class:`DecoderStage` modules: contiguous runs of
decoder layers, as even as possible (the earlier stages take the extra layers), the first stage also
holding the embeddings, the last the final norm and the head. Every stage holds the (parameter-free)
rotary embedding and rebuilds the causal mask and the rotary angles from the attention mask and the
position ids, which every stage receives as keyword arguments of the schedule's step (each rank of a
pipeline holds the whole micro-batch's inputs anyway); only the hidden states travel between ranks.

Tied embeddings: the first stage keeps ``embed_tokens``, the last stage gets its own copy of the
weight as its head. The two copies start equal, and after every backward
:meth:`StagedModel.sync_tied_grads` gives each the sum of both gradients (on one rank a local sum,
else an all-reduce over the two ranks), so that the optimizer, deterministic and fed the same
gradient and state, keeps them equal: the same update as one tied weight. The gradient norm counts
the weight once (the head copy is left out).

Placement (:data:`PLACEMENTS`): ``loop`` puts stage s on pipeline rank ``s % pp`` (one stage per
rank, or interleaved 1F1B's looped stages), ``v`` puts stages r and ``2 pp - 1 - r`` on rank r
(ZBV, DualPipeV: rank 0 holds the first and the last stage).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Placement:
    """How many stages a pipeline rank holds and in which shape (``loop`` or ``v``)."""

    stages_per_rank: int
    shape: str

    def stages_of(self, pp_rank: int, pp: int) -> list[int]:
        if self.shape == "v":
            return [pp_rank, 2 * pp - 1 - pp_rank]
        return [pp_rank + k * pp for k in range(self.stages_per_rank)]


# schedule name -> placement of its stages (the schedule classes are in pipeline.py)
PLACEMENTS = {
    "gpipe": Placement(1, "loop"),
    "1f1b": Placement(1, "loop"),
    "interleaved_1f1b": Placement(2, "loop"),
    "zbv": Placement(2, "v"),
    "dualpipev": Placement(2, "v"),
}


def layer_ranges(n_layers: int, n_stages: int) -> list[range]:
    """Contiguous layer index ranges of each stage; the first ``n_layers % n_stages`` stages take
    one layer more. Raises when a stage would have no layer."""
    if n_layers < n_stages:
        raise ValueError(
            f"the model has {n_layers} decoder layers, fewer than the pipeline's {n_stages} stages "
            "(every stage needs a layer): lower actor.pp_size or pick a one-stage-per-rank "
            "schedule"
        )
    base, extra = divmod(n_layers, n_stages)
    out, start = [], 0
    for s in range(n_stages):
        size = base + (1 if s < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def causal_lm_parts(model: nn.Module):
    """(decoder, head) of a transformers causal LM: ``model.model`` (embed_tokens, layers, norm,
    rotary_emb) and ``model.lm_head``."""
    decoder = getattr(model, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if decoder is None or not all(hasattr(decoder, k) for k in needed):
        raise TypeError(
            f"{type(model).__name__}: pipeline stages need a decoder-only causal LM with "
            "model.embed_tokens, model.layers, model.norm, model.rotary_emb and lm_head"
        )
    return decoder, model.lm_head


def is_tied(model: nn.Module) -> bool:
    decoder, head = causal_lm_parts(model)
    return head.weight is decoder.embed_tokens.weight


class DecoderStage(nn.Module):
    """One stage: ``x`` is the token ids (first stage) or the hidden states; the output is the
    hidden states, or the logits (last stage). ``attention_mask`` (B, T) and ``position_ids``
    (B, T) come with every micro-batch: the causal mask and the rotary angles are rebuilt here.

    Layers are kept under their global index (``layers.<i>``), so a parameter's transformers name is
    ``model.<name>`` (``lm_head.<name>`` for the head): :meth:`hf_names`."""

    def __init__(self, config, index: int, n_stages: int, layers: dict[int, nn.Module], parts):
        super().__init__()
        decoder, head, tied = parts
        self.config, self.index = config, index
        self.is_first, self.is_last = index == 0, index == n_stages - 1
        self.embed_tokens = decoder.embed_tokens if self.is_first else None
        self.layers = nn.ModuleDict({str(i): layer for i, layer in layers.items()})
        self.rotary_emb = decoder.rotary_emb
        self.norm = decoder.norm if self.is_last else None
        self.head = None
        self.head_is_copy = False
        if self.is_last:
            if tied:  # a copy of its own; StagedModel.sync_tied_grads keeps the two equal
                self.head = nn.Linear(head.in_features, head.out_features, bias=False)
                self.head.weight = nn.Parameter(head.weight.detach().clone())
                self.head_is_copy = True
            else:
                self.head = head

    def forward(self, x, attention_mask, position_ids):
        from hybridrl.parallel.precision import autocast

        with autocast(self):  # bf16 matmuls when the model was marked for them
            return self._forward(x, attention_mask, position_ids)

    def _forward(self, x, attention_mask, position_ids):
        from transformers.masking_utils import create_causal_mask

        h = self.embed_tokens(x) if self.is_first else x
        masks = {
            # the cache (None) by position: transformers 5.19 names it past_key_values, later
            # releases cache
            "full_attention": create_causal_mask(
                self.config, h, attention_mask, None, position_ids=position_ids
            )
        }
        if getattr(self.config, "sliding_window", None) and any(
            t == "sliding_attention" for t in getattr(self.config, "layer_types", []) or []
        ):
            from transformers.masking_utils import create_sliding_window_causal_mask

            masks["sliding_attention"] = create_sliding_window_causal_mask(
                self.config, h, attention_mask, None, position_ids=position_ids
            )
        rotary = self.rotary_emb(h, position_ids)
        types = getattr(self.config, "layer_types", None)
        for name, layer in self.layers.items():
            kind = types[int(name)] if types else "full_attention"
            h = layer(
                h,
                attention_mask=masks[kind],
                position_embeddings=rotary,
                position_ids=position_ids,
                use_cache=False,
            )
        if self.is_last:
            return self.head(self.norm(h))
        return h

    def hf_names(self) -> dict[str, str | None]:
        """Stage parameter name -> the full model's transformers name (None: a tied head copy,
        which the full model lists once, as the embeddings)."""
        out = {}
        for name, _ in self.named_parameters():
            if name.startswith("head."):
                out[name] = None if self.head_is_copy else "lm_head." + name[len("head.") :]
            else:
                out[name] = "model." + name
        return out

    def decoder_layers(self) -> list[nn.Module]:
        return list(self.layers.values())


def build_stages(model: nn.Module, indices: list[int], n_stages: int) -> list[DecoderStage]:
    """This rank's stages (``indices``) of ``model`` cut into ``n_stages``; they share the model's
    modules (no copy, except a tied head's own weight) and its autocast mark, and a mixture of
    experts' routers keep their layer numbers in the whole model (``moe/routing.py``)."""
    from hybridrl.moe.routing import number_gates
    from hybridrl.parallel.precision import autocast_device, autocast_dtype, set_autocast

    number_gates(model)
    decoder, head = causal_lm_parts(model)
    ranges = layer_ranges(len(decoder.layers), n_stages)
    parts = (decoder, head, is_tied(model))
    stages = [
        DecoderStage(model.config, s, n_stages, {i: decoder.layers[i] for i in ranges[s]}, parts)
        for s in indices
    ]
    for stage in stages:
        set_autocast(stage, autocast_dtype(model), autocast_device(model))
    return stages


def split_whole(model: nn.Module, n_stages: int) -> list[DecoderStage]:
    """Every stage of ``model`` in one process (tests, and the reference for a stage's output)."""
    return build_stages(model, list(range(n_stages)), n_stages)


def stage_weights(stages: list[DecoderStage]) -> dict[str, torch.Tensor]:
    """This rank's stage parameters as full CPU tensors by transformers name (a tied head copy left
    out); under FSDP2 each is all-gathered over the data-parallel dimension (every rank calls)."""
    out = {}
    with torch.no_grad():
        for stage in stages:
            names = stage.hf_names()
            for name, p in stage.named_parameters():
                full = p.full_tensor() if hasattr(p, "full_tensor") else p
                if names[name] is not None:
                    out[names[name]] = full.detach().cpu().clone()
    return out


def gather_full_weights(stages: list[DecoderStage], replica_ranks: list[int]) -> dict:
    """The full model's weights by transformers name on global rank 0 (``{}`` elsewhere), from
    the ranks of replica 0 (``replica_ranks``); every rank calls."""
    import torch.distributed as dist

    mine = stage_weights(stages)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    rank = dist.get_rank()
    parts = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(mine if rank in replica_ranks else None, parts, dst=0)
    if rank != 0:
        return {}
    out = {}
    for part in parts:
        out |= part or {}
    return out


@torch.no_grad()
def load_full_weights(stages: list[DecoderStage], weights: dict[str, torch.Tensor]) -> None:
    """Each stage parameter takes the value of its transformers name in ``weights`` (a full state
    dict; a tied head copy takes the embeddings); sharded parameters take their shard."""
    for stage in stages:
        names = stage.hf_names()
        for name, p in stage.named_parameters():
            value = weights[names[name] or "model.embed_tokens.weight"]
            if hasattr(p, "to_local"):
                from torch.distributed.tensor import distribute_tensor

                value = distribute_tensor(value.to(p.dtype), p.device_mesh, p.placements)
                p.to_local().copy_(value.to_local())
            else:
                p.copy_(value)
