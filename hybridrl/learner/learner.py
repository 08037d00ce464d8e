"""The learner: the trained models of one training rank and the passes a learning step runs on them.

Both drivers make one call per step, :meth:`Learner.train_step`, with the step's scored samples
(synchronous training) or with the trajectory buffer to take them from (asynchronous training; the
synchronous driver is the asynchronous one without staleness). Everything the step needs stays in
this process: the batch is built here, once, from the samples; the reference and old log-probs, the
values, the advantages and both updates run here; the driver gets metrics back, never tensors. The
order of those passes is ``learner/step.py``; this class holds the models and registers the passes
that the driver (or the step) calls by name.

The policy (its model and AdamW, optionally LoRA adapters) belongs to the learner itself; the
reference (``learner/reference.py``) exists when a KL term reads it, the critic
(``learner/critic.py``) when the advantage estimator needs values. With more than one rank the
models are sharded with FSDP2, every rank gets the whole step, and each per-row pass runs on the
rank's contiguous share of the rows (the ranks' results gathered), so the update equals the
single-process one (``learner/update.py``).

Decoupled PPO's three policies: behaviour = the rollout's log-probs (``rollout_log_probs``, possibly
stale and mixed across versions), proximal = ``old_log_probs`` (these weights before the update),
current = the policy being updated. On-policy (one epoch over one mini-batch) the update's first
forward runs the proximal weights on the same micro-batches as a separate pass would, so the learner
takes the old log-probs from it instead (π_old := sg[π_θ], ratio exactly 1) and runs no separate
pass (``learner/old_log_probs.py``).
"""

from __future__ import annotations

import torch

from hybridrl.algorithms import LOSS_AGG, POLICY_LOSSES, AggTotals, kl_penalty, masked_mean
from hybridrl.algorithms.rollout_correction import weighted_policy_loss
from hybridrl.config import Config
from hybridrl.controller import Dispatch, Worker, WorkerContext, register
from hybridrl.learner import checkpoint, offload, pipeline_policy, pipeline_update, policy_io
from hybridrl.learner import lora as lora_lib
from hybridrl.learner import moe as moe_training
from hybridrl.learner import step as learning_step
from hybridrl.learner.compile import maybe_compile
from hybridrl.learner.critic import Critic
from hybridrl.learner.logprob import (
    model_device,
    response_log_probs,
    response_sum_pi_squared,
    sampling_of,
)
from hybridrl.learner.lr_schedule import add_lr_schedule, planned_steps
from hybridrl.learner.old_log_probs import NotedOldLogProbs, check_single_pass
from hybridrl.learner.optim import make_adamw
from hybridrl.learner.passes import (
    dropout_in_training,
    needs_critic,
    needs_reference,
    needs_sum_pi_squared,
)
from hybridrl.learner.reference import Reference
from hybridrl.learner.shaping import RewardShaper
from hybridrl.learner.state import BackgroundWriter
from hybridrl.learner.update import MicroBatches, SkipCounter, first_epoch_map, run_updates
from hybridrl.models.loading import load_model
from hybridrl.parallel import distributed, shm_staging, weight_sync
from hybridrl.parallel.buckets import BUCKET_BYTES
from hybridrl.parallel.fsdp import fsdp_config_of, prepare_model
from hybridrl.parallel.mesh import ParallelDims
from hybridrl.protocol import Batch
from hybridrl.telemetry import PhaseTimer
from hybridrl.telemetry.timeline import SpanLog


class Learner(Worker):
    def __init__(
        self,
        ctx: WorkerContext,
        cfg: Config,
        model_path: str | None,
        reference_path: str | None = None,
        critic_path: str | None = None,
    ):
        super().__init__(ctx)
        self.cfg = cfg
        self.dist = distributed.init_distributed(ctx)
        # every group the models are sharded, split or pipelined over (parallel/mesh.py)
        self.dims = ParallelDims.of(self.dist, cfg.actor.pp_size, cfg.moe.ep_size)
        model, self.tokenizer = load_model(cfg, model_path)
        self.lora = lora_lib.lora_settings(cfg)
        self.base_source = model_path  # where the (LoRA base) weights came from; None: built-in
        # LoRA: the rollout has our base weights (the first sync sends them)
        self._base_synced = False
        if self.lora is not None:
            model = lora_lib.apply_lora(model, self.lora, seed=cfg.model.seed)
        model = moe_training.prepare(model, cfg.moe)  # MoE: expert biases, before sharding
        # actor.pp_size > 1: this rank's pipeline stages (learner/pipeline_policy.py)
        self.pipeline = None
        if cfg.actor.pp_size > 1:
            mesh = self.dims.pipelined
            self.pipeline, self.model = pipeline_policy.build(cfg, model, self.dist, mesh)
        else:
            mesh = self.dims.unpipelined
            self.model = prepare_model(model, fsdp_config_of(cfg), self.dist, mesh=mesh)
            # actor.compile: the decoder layers compiled in place (learner/compile.py)
            self.model = maybe_compile(
                cfg.actor.compile, self.model, model_device(self.model), "policy"
            )
        params = self.model.parameters()
        if self.lora is not None:
            params = lora_lib.trainable_parameters(self.model)
        # fused where it applies (learner/optim.py: one pass per parameter, same AdamW math)
        self.optimizer = make_adamw(params, cfg.actor.lr, cfg.actor.weight_decay, "policy")
        # actor.lr_schedule: warmup, then constant / linear / cosine decay
        add_lr_schedule(self.optimizer, cfg.actor, planned_steps(cfg, cfg.actor))
        # MoE (docs/moe.md): routing replay, balancing, health; None for a dense model
        self.moe = moe_training.start(self.model, self.optimizer, cfg.moe)
        self.loss_fn = POLICY_LOSSES.get(cfg.algorithm.policy_loss)
        self.aggregate = LOSS_AGG.get(cfg.algorithm.loss_agg)
        self.shuffle = torch.Generator().manual_seed(cfg.trainer.seed + 1)
        # log-probs under the rollout's filtered distribution
        self.sampling = sampling_of(cfg.rollout)
        self.skips = SkipCounter(cfg.alerts.max_nonfinite_in_a_row, "actor")
        self.old = NotedOldLogProbs()  # old log-probs noted by the running / last update
        ref_path = reference_path or model_path
        self.reference = (
            Reference(cfg, ref_path, self.dist, self.dims) if needs_reference(cfg) else None
        )
        if self.reference is not None:  # MoE r3: the reference replays the rollout's routing too
            moe_training.replays_routing(self.reference.model)
        critic_from = critic_path or ref_path
        self.critic = Critic(cfg, critic_from, self.dist, self.dims) if needs_critic(cfg) else None
        self.shape = RewardShaper(cfg.algorithm, cfg.rollout.max_new_tokens)
        # each phase is also a span of the run's timeline (telemetry/timeline.py)
        self.spans = SpanLog(ctx.role)
        self.timer = PhaseTimer(spans=self.spans, prefix="learner/")
        # weight sync, by name, built on first use
        self.transports: dict[str, weight_sync.WeightTransport] = {}
        self.writer = BackgroundWriter()  # background checkpoint saves (trainer.async_save)

    # --- the learning step ----------------------------------------------------------------------
    @register(Dispatch.ALL_FIRST)
    def train_step(self, version: int, source) -> dict:
        """Train weights ``version`` on ``source``: the step's scored samples, or a trajectory
        buffer (``rollout/buffer.py``) to take the next batch from. Returns ``metrics``, the trained
        prompts' ``uids``, each sample's ``staleness`` (versions behind) and ``busy_s`` (time not
        spent waiting). The passes and their order: ``learner/step.py``."""
        return learning_step.train_step(self, version, source)

    def policy_loss(self, mb: Batch, totals: AggTotals) -> tuple[torch.Tensor, dict[str, float]]:
        """One micro-batch's share of the mini-batch objective (:meth:`objective`) from a forward
        of the policy."""
        logp, entropy = response_log_probs(self.model, mb, self.sampling, with_entropy=True)
        return self.objective(logp, entropy, mb, totals)

    def objective(
        self, logp: torch.Tensor, entropy: torch.Tensor, mb: Batch, totals: AggTotals
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The policy-gradient loss (``algorithm.policy_loss``, reweighted by the rollout
        correction when on) of the response log-probs ``logp``, plus ``kl_coef`` times the KL to the
        reference, minus ``entropy_coef`` times the entropy, each aggregated by
        ``algorithm.loss_agg`` with the mini-batch's ``totals``. A pipeline's last stage calls it
        with the log-probs of its logits."""
        alg, mask = self.cfg.algorithm, mb["response_mask"]
        mb = self.old.keep(mb, logp)  # an update that notes the old log-probs: these are they
        pg, metrics = self.loss_fn(logp, mb, alg)
        # rollout correction (algorithm.rollout_is), when on and the loss does not apply it itself
        pg = weighted_policy_loss(pg, mb, self.loss_fn)
        loss = self.aggregate(pg, mask, totals)
        metrics |= {
            "actor/pg_loss": masked_mean(pg, mask).item(),
            "actor/entropy": masked_mean(entropy, mask).item(),
        }
        if "ref_log_probs" in mb:
            kl = kl_penalty(alg.kl_estimator, logp, mb["ref_log_probs"]) * mask
            loss = loss + alg.kl_coef * self.aggregate(kl, mask, totals)
            metrics["actor/kl_ref"] = masked_mean(kl, mask).item()
        if alg.entropy_coef:
            loss = loss - alg.entropy_coef * self.aggregate(entropy, mask, totals)
        if self.moe:  # the weights of this forward's balancing losses, in its backward
            moe_training.note_minibatch(self.model, totals)
        return loss, metrics

    # --- the policy's passes (this rank's rows) -------------------------------------------------
    @register(Dispatch.DP_COMPUTE)
    def compute_log_prob(self, batch: Batch) -> Batch:
        """π_old of every row, grouped as the next update's first epoch groups them
        (``first_epoch_map``); with an estimator that reads it, also ``sum_pi_squared`` (a second
        forward of the same micro-batches)."""

        def fn(model, mb):
            return response_log_probs(model, mb, self.sampling)[0]

        if self.pipeline is not None:
            old = pipeline_update.first_epoch_log_probs(
                self.pipeline, batch, self.shuffle, self.cfg.actor, self.sampling
            )
            return Batch({"old_log_probs": old})
        cols = {
            "old_log_probs": first_epoch_map(self.model, batch, self.shuffle, self.cfg.actor, fn)
        }
        if needs_sum_pi_squared(self.cfg):
            cols["sum_pi_squared"] = first_epoch_map(
                self.model,
                batch,
                self.shuffle,
                self.cfg.actor,
                lambda model, mb: response_sum_pi_squared(model, mb, self.sampling),
            )
        return Batch(cols)

    @register(Dispatch.DP_COMPUTE)
    def update_policy(self, batch: Batch, loss_fn=None) -> dict[str, float]:
        """Train on ``batch`` with ``loss_fn`` (each micro-batch's objective; default
        :meth:`policy_loss`). Without ``old_log_probs`` the old policy is the update's own first
        forward, which needs one epoch over one mini-batch (checked over the global batch); a model
        with dropout in training mode computes them with the separate pass instead. Either way
        :meth:`old_log_probs_of_last_update` returns them afterwards; ``actor/old_log_prob_reused``
        is 1 when no separate pass ran."""
        reuse = False
        if "old_log_probs" not in batch:
            check_single_pass(self.cfg.actor, self.pipeline, len(batch))
            reuse = not dropout_in_training(self.model)
            if reuse:
                batch = self.old.expect(batch)
            else:
                batch = batch | self.compute_log_prob(batch)
                self.old.taken = batch["old_log_probs"]
        if self.pipeline is not None:
            if loss_fn is not None:
                raise ValueError("update_policy: a pipelined policy trains on objective() only")
            passes = pipeline_update.PipelineRounds(
                self.pipeline, self.objective, self.cfg.actor, self.sampling
            )
            metrics = run_updates(
                passes,
                self.optimizer,
                batch,
                self.cfg.actor,
                generator=self.shuffle,
                norm_len=self.cfg.loss_norm_len,
                prefix="actor",
                skips=self.skips,
            )
            if reuse:  # the last stage noted them
                self.old.taken = self.pipeline.broadcast_from_last(self.old.taken)
            return metrics | {"actor/old_log_prob_reused": float(reuse)}
        metrics = run_updates(
            MicroBatches(self.model, loss_fn or self.policy_loss, self.cfg.actor),
            self.optimizer,
            batch,
            self.cfg.actor,
            generator=self.shuffle,
            norm_len=self.cfg.loss_norm_len,
            prefix="actor",
            skips=self.skips,
        )
        return metrics | {"actor/old_log_prob_reused": float(reuse)}

    @register(Dispatch.DP_COMPUTE)
    def old_log_probs_of_last_update(self, batch: Batch) -> Batch:
        """The old log-probs the last ``update_policy`` given a batch without them noted, for this
        rank's rows of ``batch`` (the batch it trained on)."""
        return self.old.take(batch)

    # --- weights, checkpoints, colocation -------------------------------------------------------
    @register(Dispatch.ONE_TO_ALL)
    def weight_buckets(self, bucket_bytes: int = BUCKET_BYTES, mode: str = "auto") -> list[list]:
        """The weights as buckets of (name, tensor) of at most ``bucket_bytes`` (or one tensor).
        Every rank takes part in gathering the shards; rank 0 returns the buckets, the others
        ``[]``.

        Without LoRA: the full weights. With LoRA, ``mode``: ``adapter`` the adapters only; ``base``
        the base weights, then the adapters; ``auto``: ``base`` on the first call after the learner
        was built or loaded, ``adapter`` afterwards; ``merged`` the full merged weights (plain
        names)."""
        buckets = policy_io.weight_buckets(self, bucket_bytes, mode)
        return buckets if self.rank == 0 else []

    @register(Dispatch.ALL_FIRST)
    def publish_weights(self, transport: str, version: int):
        """Every rank: hand the weights to this learner's ``transport``
        (``parallel/weight_sync.py``); the handle the rollout loads from (rank 0)."""
        if transport not in self.transports:
            self.transports[transport] = weight_sync.make_transport(transport)
        with self.spans.span("weight_sync/publish"):
            return self.transports[transport].publish(self, version)

    def rehome_parameters(self, stage):
        """Move the parameters into a shared-memory staging file (the ``shm`` transport's zero-copy
        sync)."""
        return shm_staging.rehome(self.model, stage)

    def unhome_parameters(self, stage) -> None:
        shm_staging.unhome(self.model, stage)

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(
        self, path: str, critic_path: str | None = None, marker: str | None = None
    ) -> str | None:
        """Every rank: the policy in transformers format with its tokenizer (rank 0), and the
        sharded model + optimizer + shuffle RNG under ``path/dcp`` (LoRA: the layout of
        ``learner/lora.py``); the critic the same way under ``critic_path`` when there is one.
        Raises ``NonFiniteWeightsError`` before writing anything when a weight is NaN or inf.

        ``marker`` (``trainer.async_save``): snapshot the state now and write it on a background
        thread (LoRA: the policy is written now, the critic in the background), then write
        ``<marker>-rank<r>`` (``learner/state.py``: ``BackgroundWriter``); returns that path. The
        choices: ``learner/checkpoint.py``."""
        return checkpoint.save(self, path, critic_path, marker)

    @register(Dispatch.ONE_TO_ALL)
    def wait_checkpoint(self) -> dict | None:
        """Wait for this rank's background save; its failure (``learner/state.py``:
        ``describe_failure``) or None."""
        return self.writer.wait()

    @register(Dispatch.ONE_TO_ALL)
    def load_state(self, path: str, critic_path: str | None = None) -> None:
        checkpoint.load(self, path, critic_path)

    @register(Dispatch.RANK_ZERO)
    def kl_reward_coef(self) -> float:
        return self.shape.kl.value

    @register(Dispatch.ONE_TO_ALL)
    def set_kl_reward_coef(self, value: float | None) -> None:
        if value is not None:  # a resumed run continues the adaptive coefficient
            self.shape = RewardShaper(self.cfg.algorithm, self.cfg.rollout.max_new_tokens, value)

    def sleep(self) -> None:
        """Colocation: the training state leaves the device while the rollout has it (on a CPU rank
        everything already lives in host memory; ``learner/offload.py``)."""
        offload.sleep(self)

    def wake(self) -> None:
        offload.wake(self)

    @register(Dispatch.ONE_TO_ALL)
    def close(self) -> None:
        """Release the weight-sync transports (staging files) and leave the process group (barrier
        first); the learner is unusable afterwards."""
        for transport in self.transports.values():
            transport.close()
        distributed.teardown_distributed()
