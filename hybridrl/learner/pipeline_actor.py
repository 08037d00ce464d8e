"""The actor as a pipeline (``actor.pp_size > 1``): building it, the replicas' rows,
weights by transformers name, checkpoints.

The actor's ``world`` ranks form a (world / pp_size) x pp_size mesh (``parallel/pipeline.py``):
each data-parallel replica (pp_size consecutive ranks) takes a contiguous chunk of the step's rows,
and every rank of a replica holds that same chunk. The reference and the critic are not pipelined:
they stay sharded with FSDP2 over all the ranks (``on_my_rows`` in ``learner/actor.py``).

Checkpoint layout of a pipelined actor at ``path``: the full model in transformers format (rank 0,
gathered from every stage by name, as for weight sync) and ``path/pipeline/stage<p>/``, one DCP
checkpoint per pipeline rank (its stages' weights and optimizer state, sharded over the replicas),
with ``path/pipeline/extra.pt`` holding the shuffle RNG.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hybridrl.learner.metrics import mean_over_ranks
from hybridrl.learner.moe import moe_forward
from hybridrl.parallel import distributed
from hybridrl.parallel.buckets import bucketed
from hybridrl.parallel.pipeline import PipeLayout, Pipeline, StageModules, check_layout
from hybridrl.protocol import Batch


def layout_of(cfg, rank: int, world: int) -> PipeLayout:
    a = cfg.actor
    return PipeLayout(a.pp_size, world // a.pp_size, rank, a.pp_schedule, a.pp_microbatches)


def check_config(cfg, world: int, n_layers: int | None = None) -> None:
    """The clear errors of a pipelined actor (world size, layers, micro-batches, LoRA); ``n_layers``
    None: the model's layers are not checked yet."""
    a = cfg.actor
    if a.pp_size <= 1:
        return
    if a.lora_rank:
        raise ValueError("actor.pp_size > 1 does not support LoRA (actor.lora_rank > 0)")
    check_layout(world, a.pp_size, a.pp_schedule, a.pp_microbatches, n_layers or 10**9)


def model_layers(cfg, path: str | None) -> int | None:
    """Decoder layers of the actor the learner will load (``path``, else ``model.path``, else the
    built-in size); None when unknown."""
    import json

    where = path or cfg.model.path
    if where is not None:
        config = Path(where).expanduser() / "config.json"
        if config.is_file():
            return json.loads(config.read_text()).get("num_hidden_layers")
        return None
    from hybridrl.models.factory import SIZES

    return SIZES.get(cfg.model.name, {}).get("num_hidden_layers")


def build(cfg, model, env, mesh) -> tuple[Pipeline, StageModules]:
    """This rank's stages of ``model`` (autocast as ``fsdp.mixed_precision`` resolves on the
    device) on ``mesh`` (the learner's pipelined ``ModelMesh``): sharded over the replicas when
    there are several, their experts split over them with ``moe.ep_size``; every micro-batch's
    forward of a stage goes through the MoE hooks of ``learner/moe.py`` (a no-op for a dense
    model)."""
    from hybridrl.parallel.fsdp import device_precision_of, fsdp_config_of
    from hybridrl.parallel.precision import set_autocast

    check_config(cfg, env.world_size, len(model.model.layers))
    layout = layout_of(cfg, env.rank, env.world_size)
    check_routers_per_rank(model, layout)
    if fsdp_config_of(cfg).activation_checkpointing:
        from hybridrl.parallel.fsdp import enable_activation_checkpointing

        enable_activation_checkpointing(model)
    prec = device_precision_of(model, fsdp_config_of(cfg), env.device)
    set_autocast(model, torch.bfloat16 if prec.bf16 else None, env.device.type)
    pl = Pipeline(model, layout, env.device, mesh, cfg.fsdp, around=moe_forward)
    return pl, pl.modules


def check_routers_per_rank(model, layout: PipeLayout) -> None:
    """A mixture of experts needs a router on every pipeline rank: each rank's MoE runtime takes
    part in the step's collectives (loads, routing comparisons, the bias update)."""
    from hybridrl.moe.routing import is_moe
    from hybridrl.parallel.pipeline_stages import layer_ranges

    layers = model.model.layers
    if not is_moe(model):
        return
    ranges = layer_ranges(len(layers), layout.n_stages)
    for rank in range(layout.pp):
        held = [i for s in layout.stages_of(rank) for i in ranges[s]]
        if not any(is_moe(layers[i]) for i in held):
            raise ValueError(
                f"actor.pp_size={layout.pp}: pipeline rank {rank} would hold decoder layers "
                f"{held}, none of them a mixture-of-experts layer; every rank needs one (fewer "
                "stages, or another schedule)"
            )


def on_replica_rows(fn, batch: Batch, layout: PipeLayout):
    """``fn`` on this replica's contiguous share of ``batch`` (every rank of a replica the same
    rows), the replicas' results gathered: Batches concatenated in replica order, metric dicts
    averaged."""
    mine = batch.chunk(layout.dp)[layout.dp_rank] if layout.dp > 1 else batch
    parts = distributed.all_gather_object(fn(mine))
    if isinstance(parts[0], Batch):
        return Batch.concat(parts[:: layout.pp])
    return mean_over_ranks(parts)


def replica_total(n_rows: int, layout: PipeLayout) -> int:
    """Rows over the replicas (each replica counted once)."""
    return sum(distributed.all_gather_ints(n_rows)[:: layout.pp])


def weight_buckets(pl: Pipeline, bucket_bytes: int) -> list[list]:
    """The full model's weights by transformers name in buckets, on rank 0 (others ``[]``)."""
    weights = pl.full_weights()
    return list(bucketed(weights.items(), bucket_bytes)) if distributed.rank() == 0 else []


def _states(modules: StageModules, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    return {
        "model": get_model_state_dict(modules),
        "optim": get_optimizer_state_dict(modules, optimizer),
    }


def save(path, pl: Pipeline, modules: StageModules, optimizer, shuffle, tokenizer=None) -> None:
    """The checkpoint layout of the module docstring; every rank calls."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    weights = pl.full_weights()
    if distributed.rank() == 0:
        from transformers import AutoModelForCausalLM

        from hybridrl.moe.balance import BIAS_NAME, attach_biases

        with torch.device("meta"):
            # the stages are a causal LM's (a built-in's config names no architecture)
            model = AutoModelForCausalLM.from_config(pl.config)
        model.to_empty(device="cpu")
        if any(name.endswith(BIAS_NAME) for name in weights):  # moe.bias_update_rate: kept
            attach_biases(model)
        model.load_state_dict(weights, strict=False, assign=True)
        model.tie_weights()
        model.save_pretrained(path)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)
        (path / "pipeline").mkdir(parents=True, exist_ok=True)
        torch.save({"shuffle_rng": shuffle.get_state()}, path / "pipeline" / "extra.pt")
    distributed.barrier()
    where = path / "pipeline" / f"stage{pl.layout.pp_rank}"
    dp_group = pl.mesh.dp.get_group()
    dcp.save(
        _states(modules, optimizer),
        storage_writer=dcp.FileSystemWriter(where),
        process_group=dp_group,
    )
    distributed.barrier()


def load(path, pl: Pipeline, modules: StageModules, optimizer, shuffle) -> None:
    """From :func:`save`'s layout (weights, optimizer, RNG), or from a transformers directory
    (the weights only)."""
    path = Path(path)
    where = path / "pipeline" / f"stage{pl.layout.pp_rank}"
    if not where.is_dir():
        from transformers import AutoModelForCausalLM

        full = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        pl.load_weights(full.state_dict())
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    state = _states(modules, optimizer)
    dcp.load(
        state, storage_reader=dcp.FileSystemReader(where), process_group=pl.mesh.dp.get_group()
    )
    set_model_state_dict(modules, state["model"])
    set_optimizer_state_dict(modules, optimizer, state["optim"])
    extra = torch.load(path / "pipeline" / "extra.pt", weights_only=True)
    shuffle.set_state(extra["shuffle_rng"])
