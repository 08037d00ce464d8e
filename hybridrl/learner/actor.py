"""The actor (the policy being trained) of one learner rank, in the three forms it takes, behind
one interface.

* :class:`Actor`: the model itself, in one process or sharded with FSDP2 over the learner's ranks
  (its layers compiled with ``actor.compile``);
* :class:`LoraActor` (``actor.lora_rank > 0``): PEFT LoRA adapters over a frozen base
  (``learner/lora.py``); the first weight sync after it is built or loaded also sends the base;
* :class:`PipelinedActor` (``actor.pp_size > 1``): this rank's stages of a pipeline
  (``learner/pipeline_actor.py``), its data-parallel replicas each holding a share of the rows.

Each form holds its model, its AdamW (with ``actor.lr_schedule``), the shuffle generator that draws
the update's mini-batches, the sampling filters its log-probs are taken under and its counter of
skipped steps, and answers the same calls: the share of a batch this rank computes
(:meth:`Actor.rows`), the old log-probs grouped as the next update groups them
(:meth:`Actor.old_log_probs`), the update (:meth:`Actor.update`, the one loop of
``learner/update.py`` over the form's backward passes), its weights for the rollout
(:meth:`Actor.weight_buckets`) and its checkpoint (:meth:`Actor.save`, :meth:`Actor.load`). The
learner (``learner/learner.py``) picks the form once (:func:`actor_form`) and never asks which it
has. What the actor is trained on (the objective: loss, KL, entropy) is the learner's.
"""

from __future__ import annotations

from functools import partial

import torch

from hybridrl.config import Config
from hybridrl.learner import lora as lora_lib
from hybridrl.learner import moe as moe_training
from hybridrl.learner import pipeline_actor
from hybridrl.learner.compile import maybe_compile
from hybridrl.learner.logprob import (
    model_device,
    response_log_probs,
    response_sum_pi_squared,
    sampling_of,
)
from hybridrl.learner.lr_schedule import add_lr_schedule, planned_steps
from hybridrl.learner.metrics import mean_over_ranks
from hybridrl.learner.optim import make_adamw
from hybridrl.learner.passes import needs_sum_pi_squared
from hybridrl.learner.pipeline_update import PipelineRounds, first_epoch_log_probs
from hybridrl.learner.state import load_trainable, save_trainable
from hybridrl.learner.update import MicroBatches, SkipCounter, first_epoch_map, run_updates
from hybridrl.models.loading import load_model
from hybridrl.parallel import distributed
from hybridrl.parallel.buckets import bucketed
from hybridrl.parallel.fsdp import fsdp_config_of, iter_weight_buckets, prepare_model
from hybridrl.parallel.mesh import ParallelDims
from hybridrl.protocol import Batch


def on_my_rows(fn, batch: Batch):
    """``fn`` on this rank's contiguous share of ``batch`` (as the driver's DP dispatch splits it),
    the ranks' results gathered: Batches concatenated, metric dicts averaged. One process:
    ``fn(batch)``."""
    if distributed.world_size() == 1:
        return fn(batch)
    parts = distributed.all_gather_object(
        fn(batch.chunk(distributed.world_size())[distributed.rank()])
    )
    return Batch.concat(parts) if isinstance(parts[0], Batch) else mean_over_ranks(parts)


class Actor:
    """The actor as one model: in one process, or sharded with FSDP2 over every learner rank
    (its experts split with ``moe.ep_size``)."""

    # the weights it publishes are its model's parameters under their own names (a weight-sync
    # transport may then move the parameters themselves into shared memory)
    weights_are_parameters = True

    def __init__(self, cfg: Config, model, source: str | None, dist, dims: ParallelDims):
        """``model``: the actor as loaded from ``source`` (a transformers directory, None: the
        built-in model), on no device yet."""
        self.cfg = cfg
        model = moe_training.prepare(self.adapt(model), cfg.moe)  # MoE: biases, before sharding
        self.model = self.place(model, dist, dims)
        # fused where it applies (learner/optim.py: one pass per parameter, same AdamW math)
        a = cfg.actor
        self.optimizer = make_adamw(self.trainable(), a.lr, a.weight_decay, "actor")
        add_lr_schedule(self.optimizer, a, planned_steps(cfg, a))  # warmup, then decay
        self.shuffle = torch.Generator().manual_seed(cfg.trainer.seed + 1)
        self.sampling = sampling_of(cfg.rollout)  # log-probs under the rollout's filters
        self.skips = SkipCounter(cfg.alerts.max_nonfinite_in_a_row, "actor")

    # --- how the form is built ------------------------------------------------------------------
    def adapt(self, model):
        """The model before MoE preparation and sharding (LoRA wraps it here)."""
        return model

    def place(self, model, dist, dims: ParallelDims):
        """The model on its devices: sharded over every rank, then compiled (``actor.compile``)."""
        model = prepare_model(model, fsdp_config_of(self.cfg), dist, mesh=dims.unpipelined)
        return maybe_compile(self.cfg.actor.compile, model, model_device(model), "actor")

    def trainable(self):
        """The parameters the optimizer steps."""
        return self.model.parameters()

    # --- the passes -----------------------------------------------------------------------------
    @property
    def replicas(self) -> int:
        """How many shares a step's rows are split into (data-parallel balancing evens them)."""
        return distributed.world_size()

    def rows(self, fn, batch: Batch):
        """``fn`` on this rank's share of ``batch``, the shares' results gathered."""
        return on_my_rows(fn, batch)

    def total_rows(self, rows: int) -> int:
        """The rows of a batch whose share here is ``rows``, over every share (a collective)."""
        return sum(distributed.all_gather_ints(rows))

    def old_log_probs(self, batch: Batch) -> Batch:
        """π_old of every row, grouped as the next update's first epoch groups them; with an
        estimator that reads it, also ``sum_pi_squared`` (a second forward of the same
        micro-batches)."""

        def log_probs(model, mb):
            return response_log_probs(model, mb, self.sampling)[0]

        def sum_pi_squared(model, mb):
            return response_sum_pi_squared(model, mb, self.sampling)

        a = self.cfg.actor
        cols = {"old_log_probs": first_epoch_map(self.model, batch, self.shuffle, a, log_probs)}
        if needs_sum_pi_squared(self.cfg):
            cols["sum_pi_squared"] = first_epoch_map(
                self.model, batch, self.shuffle, a, sum_pi_squared
            )
        return Batch(cols)

    def loss(self, objective, mb: Batch, totals) -> tuple[torch.Tensor, dict[str, float]]:
        """``objective`` of one micro-batch, from a forward of the actor."""
        logp, entropy = response_log_probs(self.model, mb, self.sampling, with_entropy=True)
        return objective(logp, entropy, mb, totals)

    def backward_passes(self, objective):
        """How a mini-batch's backward passes run (``update.run_updates``)."""
        return MicroBatches(self.model, partial(self.loss, objective), self.cfg.actor)

    def update(self, batch: Batch, objective) -> dict[str, float]:
        """Train on ``batch`` (this rank's rows); ``objective(logp, entropy, mb, totals)``: each
        micro-batch's share of the mini-batch loss."""
        return run_updates(
            self.backward_passes(objective),
            self.optimizer,
            batch,
            self.cfg.actor,
            generator=self.shuffle,
            norm_len=self.cfg.loss_norm_len,
            prefix="actor",
            skips=self.skips,
        )

    def from_loss_ranks(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor the objective computed, on every rank (it ran on every rank)."""
        return t

    # --- weights and checkpoints ----------------------------------------------------------------
    def weight_buckets(self, bucket_bytes: int, mode: str) -> list[list]:
        """The weights as buckets of (name, tensor), by transformers name; every rank takes part in
        gathering (``mode``: see ``Learner.weight_buckets``)."""
        return list(iter_weight_buckets(self.model, bucket_bytes))

    def save(self, path: str, tokenizer, writer) -> None:
        """Model, optimizer and shuffle RNG under ``path`` (``writer``: a background writer, or
        None to write now)."""
        save_trainable(path, self.model, self.optimizer, self.shuffle, tokenizer, background=writer)

    def load(self, path: str) -> None:
        load_trainable(path, self.model, self.optimizer, self.shuffle)


class LoraActor(Actor):
    """LoRA adapters over a frozen base (``learner/lora.py``); the optimizer holds the adapters
    only. Its checkpoint is written at once, whatever the writer."""

    weights_are_parameters = False  # PEFT names; the base once, then the adapters

    def __init__(self, cfg: Config, model, source: str | None, dist, dims: ParallelDims):
        self.settings = lora_lib.lora_settings(cfg)
        self.base_source = source  # where the base weights came from; None: built-in
        self.base_synced = False  # whether the rollout has our base weights (sent on first sync)
        super().__init__(cfg, model, source, dist, dims)

    def adapt(self, model):
        return lora_lib.apply_lora(model, self.settings, seed=self.cfg.model.seed)

    def trainable(self):
        return lora_lib.trainable_parameters(self.model)

    def weight_buckets(self, bucket_bytes: int, mode: str) -> list[list]:
        if mode == "merged":
            return list(bucketed(lora_lib.merged_weights(self.model).items(), bucket_bytes))
        if mode not in ("auto", "adapter", "base"):
            raise ValueError(
                f"weight_buckets: mode must be auto, adapter, base or merged, got {mode!r}"
            )
        with_base = mode == "base" or (mode == "auto" and not self.base_synced)
        buckets = list(lora_lib.lora_weight_buckets(self.model, bucket_bytes, with_base=with_base))
        self.base_synced |= with_base  # once they are gathered
        return buckets

    def save(self, path: str, tokenizer, writer) -> None:
        lora_lib.save_lora_checkpoint(
            path, self.model, self.optimizer, self.shuffle, tokenizer, base_source=self.base_source
        )

    def load(self, path: str) -> None:
        """A LoRA checkpoint (its base reloaded from where it came from), or full weights."""
        if not lora_lib.is_lora_checkpoint(path):
            super().load(path)
            return
        self.base_source = lora_lib.base_source_of(path)
        base, _ = load_model(self.cfg, self.base_source)
        lora_lib.load_lora_state(path, self.model, self.optimizer, self.shuffle, base)
        self.base_synced = False


class PipelinedActor(Actor):
    """This rank's stages of the pipelined actor (``learner/pipeline_actor.py``); ``model`` is
    the stages' modules. A replica's pipeline ranks hold the same rows; the objective runs on the
    last stage."""

    weights_are_parameters = False  # gathered from every stage by transformers name

    def place(self, model, dist, dims: ParallelDims):
        self.pipeline, modules = pipeline_actor.build(self.cfg, model, dist, dims.pipelined)
        return modules

    @property
    def replicas(self) -> int:
        return self.pipeline.layout.dp

    def rows(self, fn, batch: Batch):
        return pipeline_actor.on_replica_rows(fn, batch, self.pipeline.layout)

    def total_rows(self, rows: int) -> int:
        return pipeline_actor.replica_total(rows, self.pipeline.layout)

    def old_log_probs(self, batch: Batch) -> Batch:
        old = first_epoch_log_probs(
            self.pipeline, batch, self.shuffle, self.cfg.actor, self.sampling
        )
        return Batch({"old_log_probs": old})

    def backward_passes(self, objective):
        return PipelineRounds(self.pipeline, objective, self.cfg.actor, self.sampling)

    def from_loss_ranks(self, t: torch.Tensor) -> torch.Tensor:
        return self.pipeline.broadcast_from_last(t)

    def weight_buckets(self, bucket_bytes: int, mode: str) -> list[list]:
        return pipeline_actor.weight_buckets(self.pipeline, bucket_bytes)

    def save(self, path: str, tokenizer, writer) -> None:
        """Written at once on every rank, whatever the writer."""
        pipeline_actor.save(
            path, self.pipeline, self.model, self.optimizer, self.shuffle, tokenizer
        )

    def load(self, path: str) -> None:
        pipeline_actor.load(path, self.pipeline, self.model, self.optimizer, self.shuffle)


def actor_form(cfg: Config) -> type[Actor]:
    """The form the config asks for (LoRA and a pipeline do not combine: the config refuses it)."""
    if cfg.actor.pp_size > 1:
        return PipelinedActor
    return LoraActor if cfg.actor.lora_rank > 0 else Actor
