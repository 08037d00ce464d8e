"""The learner: the trained models of one training rank and the learning step that runs on them.

Both feeds of the driver loop make one call per step, :meth:`Learner.train_step`, with the step's
scored samples (synchronous training) or with the trajectory buffer to take them from (asynchronous
training). Everything the step needs stays in this process: the batch is built here, once, from
the samples; the reference and old log-probs, the values, the advantages and both updates run here,
each pass adding its columns to the batch; the driver gets metrics back, never tensors. The order
of the passes is :meth:`Learner.train_step`, which reads as docs/architecture.md draws it.

The learner holds its trained models: the actor (the policy being trained), in whichever form it
takes (plain or FSDP2, LoRA, pipelined: ``learner/actor.py``, one interface), the reference
(``learner/reference.py``) when a KL term reads it, the critic (``learner/critic.py``) when the
advantage estimator needs values. With more than one rank the models are sharded with FSDP2 over the
meshes of one :class:`~hybridrl.parallel.mesh.ParallelDims`, every rank runs the whole step, and
each per-row pass runs on the rank's contiguous share of the rows (the ranks' results gathered), so
the step equals the single-process one (``learner/update.py``).

Decoupled PPO's three policies: behaviour = the rollout's log-probs (``rollout_log_probs``, possibly
stale and mixed across versions), proximal = ``old_log_probs`` (these weights before the update),
current = the policy being updated. On-policy (one epoch over one mini-batch) the update's first
forward runs the proximal weights on the same micro-batches as a separate pass would, so the learner
takes the old log-probs from it instead (π_old := sg[π_θ], ratio exactly 1) and runs no separate
pass (``learner/old_log_probs.py``).

A run checkpoint's learner share (:meth:`Learner.save_checkpoint`): nothing at all when a weight is
NaN or inf (a checkpoint must never hold a broken state), then the policy in its form and the
critic, either written now or snapshotted now and written on a background thread
(``trainer.async_save``, ``learner/state.py``: ``BackgroundWriter``) with one save in flight at
most. A background write that fails removes what the rank wrote before it reports: on a full disk
the space is back at once, for the rank's marker, the driver's files and the run's logs.

Colocation (:meth:`Learner.sleep`, :meth:`Learner.wake`): when the learner shares its device with
the rollout, every model it holds and their optimizers' states leave the device while the rollout
generates; on a CPU rank everything already lives in host memory and nothing moves.
"""

from __future__ import annotations

import shutil
import time

import torch

from hybridrl.algorithms import (
    LOSS_AGG,
    POLICY_LOSSES,
    AggTotals,
    compute_advantages,
    kl_penalty,
    masked_mean,
)
from hybridrl.algorithms.rollout_correction import (
    bypass_old_log_probs,
    rollout_correction,
    weighted_policy_loss,
)
from hybridrl.config import Config
from hybridrl.controller import Dispatch, Worker, WorkerContext, register
from hybridrl.learner import moe as moe_training
from hybridrl.learner.actor import actor_form, on_my_rows
from hybridrl.learner.critic import Critic
from hybridrl.learner.metrics import batch_metrics, reward_failures, staleness_metrics
from hybridrl.learner.old_log_probs import NotedOldLogProbs, check_single_pass
from hybridrl.learner.passes import (
    dropout_in_training,
    needs_critic,
    needs_reference,
    reuses_old_log_probs,
)
from hybridrl.learner.reference import Reference
from hybridrl.learner.shaping import RewardShaper
from hybridrl.learner.state import BackgroundWriter, check_finite, save_trainable
from hybridrl.learner.update import first_epoch_minibatches
from hybridrl.models.loading import load_model
from hybridrl.moe.ep import traffic_metrics as ep_traffic_metrics
from hybridrl.parallel import distributed, shm_staging, weight_sync
from hybridrl.parallel.batch_balance import balance_for_ranks
from hybridrl.parallel.buckets import BUCKET_BYTES
from hybridrl.parallel.mesh import ParallelDims
from hybridrl.protocol import REPLACING, Batch, Sample, samples_to_batch
from hybridrl.telemetry import PhaseTimer
from hybridrl.telemetry.flops import learner_perf
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
        # plain / FSDP2, LoRA or pipelined, with its optimizer (learner/actor.py)
        self.actor = actor_form(cfg)(cfg, model, model_path, self.dist, self.dims)
        # MoE (docs/moe.md): routing replay, balancing, health; None for a dense model
        self.moe = moe_training.start(self.model, self.optimizer, cfg.moe)
        self.loss_fn = POLICY_LOSSES.get(cfg.algorithm.policy_loss)
        self.aggregate = LOSS_AGG.get(cfg.algorithm.loss_agg)
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

    @property
    def model(self):
        """The actor's model (a pipelined actor: this rank's stages)."""
        return self.actor.model

    @property
    def optimizer(self):
        return self.actor.optimizer

    @property
    def weights_are_parameters(self) -> bool:
        """Whether the published weights are the model's parameters by name (weight sync)."""
        return self.actor.weights_are_parameters

    # --- the learning step ----------------------------------------------------------------------
    @register(Dispatch.ALL_FIRST)
    def train_step(self, version: int, source) -> dict:
        """Train weights ``version`` on ``source``: the trajectory buffer (``rollout/buffer.py``)
        to take the next batch from, or scored samples in hand (a bench's, a test's). Returns
        ``metrics``, the trained prompts' ``uids``, ``reward_failures``, each sample's
        ``staleness`` (versions behind) and ``busy_s`` (time not spent waiting)."""
        t0 = time.perf_counter()
        samples = self.take_samples(source, version)
        waited = time.perf_counter() - t0
        cfg, timer, actor = self.cfg, self.timer, self.actor
        alg = cfg.algorithm
        batch = samples_to_batch(samples, self.tokenizer.pad_token_id)
        # each replica's share of each of the update's mini-batches gets an equal token count
        minis = first_epoch_minibatches(len(batch), actor.shuffle, cfg.actor.ppo_minibatch_size)
        batch, balanced = balance_for_ranks(
            batch, actor.replicas, cfg.trainer.balance_batch, minis
        )  # parallel/batch_balance.py
        reuse = reuses_old_log_probs(cfg, len(batch))
        moe = self.moe
        batch = moe.mark(batch) if moe else batch  # which rows replay their routing
        if self.reference is not None:
            with timer.phase("reference"):
                batch |= on_my_rows(
                    lambda rows: self.reference.log_probs(rows, actor.shuffle), batch
                )
        if alg.rollout_bypass:  # the rollout's log-probs are the old policy: no forward
            batch |= bypass_old_log_probs(batch)
        elif not reuse:
            with timer.phase("old_log_prob"):
                batch |= actor.rows(self.compute_log_prob, batch)
        batch = moe.after_old_pass(batch) if moe else batch  # r2: replay that pass
        correction = {}
        if not reuse:
            batch, correction = rollout_correction(batch, alg)
        if self.critic is not None:
            with timer.phase("values"):
                batch |= on_my_rows(self.critic.values, batch)
        with timer.phase("advantage"):
            batch, metrics = self.shape(batch)
            batch = compute_advantages(batch, alg)
        if self.critic is not None:
            with timer.phase("critic_update"):
                metrics |= on_my_rows(self.critic.update, batch)
        with timer.phase("update"):
            metrics |= actor.rows(self.update_actor, batch)
        if reuse:  # the update's first forward computed them: the gap metrics come now
            batch |= actor.rows(self.old_log_probs_of_last_update, batch)
            batch, correction = rollout_correction(batch, alg)
        stale, lag = staleness_metrics(batch, version, cfg.max_staleness)  # versions behind
        timing = {k: v for k, v in timer.pop().items() if k != "timing/step"}
        # MFU and tokens/s of the model phases, per rank (telemetry/flops.py)
        # the tokens one epoch of the update computed (a shared prompt once): what the FLOPs count
        fed, padding = metrics.get("perf/tokens_fed"), metrics.get("perf/padding_fraction", 0.0)
        computed = fed * (1 - padding) / cfg.actor.ppo_epochs if fed else None
        perf = learner_perf(self, timing, batch["attention_mask"], computed) | balanced
        if moe:  # moe/: loads, routing changes; with moe.ep_size > 1 the rows exchanged
            perf |= moe.step_metrics(batch) | ep_traffic_metrics(self.model)
        return {
            "metrics": metrics | correction | batch_metrics(batch) | stale | timing | perf,
            "uids": list(dict.fromkeys(s.uid for s in samples)),
            "reward_failures": reward_failures(samples),
            "staleness": lag,
            "busy_s": time.perf_counter() - t0 - waited,
        }

    def take_samples(self, source, version: int) -> list[Sample]:
        """The step's samples: the next batch rank 0 takes from the trajectory buffer ``source``
        and shares with the other ranks, or ``source`` itself when it is a list of samples. A
        rollout being replaced raises on every rank."""
        if isinstance(source, list):
            return source
        with self.timer.phase("wait_batch"):
            samples = None
            if self.rank == 0:
                try:
                    samples = source.get_batch(version, self.cfg.asynchronous.batch_timeout_s)
                except RuntimeError as exc:  # the rollout is replaced: every rank raises it
                    if REPLACING not in str(exc):
                        raise
                    samples = REPLACING
            if distributed.world_size() > 1:
                samples = distributed.all_gather_object(samples)[0]
        if isinstance(samples, str):
            raise RuntimeError(samples)
        return samples

    def policy_loss(self, mb: Batch, totals: AggTotals) -> tuple[torch.Tensor, dict[str, float]]:
        """One micro-batch's share of the mini-batch objective (:meth:`objective`) from a forward
        of the actor."""
        return self.actor.loss(self.objective, mb, totals)

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

    # --- the actor's passes (this rank's rows) -------------------------------------------------
    @register(Dispatch.DP_COMPUTE)
    def compute_log_prob(self, batch: Batch) -> Batch:
        """π_old of every row, grouped as the next update's first epoch groups them; with an
        estimator that reads it, also ``sum_pi_squared`` (``Actor.old_log_probs``)."""
        return self.actor.old_log_probs(batch)

    @register(Dispatch.DP_COMPUTE)
    def update_actor(self, batch: Batch) -> dict[str, float]:
        """Train on ``batch`` with :meth:`objective`. Without ``old_log_probs`` the old policy is
        the update's own first forward, which needs one epoch over one mini-batch (checked over
        the global batch); a model with dropout in training mode computes them with the separate
        pass instead. Either way :meth:`old_log_probs_of_last_update` returns them afterwards;
        ``actor/old_log_prob_reused`` is 1 when no separate pass ran."""
        reuse = False
        if "old_log_probs" not in batch:
            check_single_pass(self.cfg.actor, self.actor.total_rows(len(batch)))
            reuse = not dropout_in_training(self.model)
            if reuse:
                batch = self.old.expect(batch)
            else:
                batch = batch | self.compute_log_prob(batch)
                self.old.taken = batch["old_log_probs"]
        metrics = self.actor.update(batch, self.objective)
        if reuse:  # noted where the objective ran
            self.old.taken = self.actor.from_loss_ranks(self.old.taken)
        return metrics | {"actor/old_log_prob_reused": float(reuse)}

    @register(Dispatch.DP_COMPUTE)
    def old_log_probs_of_last_update(self, batch: Batch) -> Batch:
        """The old log-probs the last ``update_actor`` given a batch without them noted, for this
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
        buckets = self.actor.weight_buckets(bucket_bytes, mode)
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
        """Every rank: the actor in transformers format with its tokenizer (rank 0), and the
        sharded model + optimizer + shuffle RNG under ``path/dcp`` (LoRA: the layout of
        ``learner/lora.py``; pipelined: of ``learner/pipeline_actor.py``); the critic the same way
        under ``critic_path`` when there is one. Raises ``NonFiniteWeightsError`` before writing
        anything when a weight is NaN or inf.

        ``marker`` (``trainer.async_save``): snapshot the state now and write it on a background
        thread (LoRA and pipelined: the actor is written now, the critic in the background), then
        write ``<marker>-rank<r>``; returns that path."""
        critic = self.critic.model if self.critic is not None else None
        check_finite({"actor": self.model, "critic": critic})
        writer = None
        if marker is not None:
            self.wait_checkpoint()  # one save in flight at most
            writer = self.writer
        self.actor.save(path, self.tokenizer, writer)
        if self.critic is not None and critic_path is not None:
            c = self.critic
            save_trainable(critic_path, c.model, c.optimizer, c.shuffle, background=writer)
        if writer is None:
            return None
        removing_on_failure(writer, [path, critic_path])
        writer.start(f"{marker}-rank{self.rank}")
        return f"{marker}-rank{self.rank}"

    @register(Dispatch.ONE_TO_ALL)
    def wait_checkpoint(self) -> dict | None:
        """Wait for this rank's background save; its failure (``learner/state.py``:
        ``describe_failure``) or None."""
        return self.writer.wait()

    @register(Dispatch.ONE_TO_ALL)
    def load_state(self, path: str, critic_path: str | None = None) -> None:
        """The actor from ``path``, the critic from ``critic_path``."""
        self.actor.load(path)
        if self.critic is not None and critic_path is not None:
            self.critic.load(critic_path)

    @register(Dispatch.RANK_ZERO)
    def kl_reward_coef(self) -> float:
        return self.shape.kl.value

    @register(Dispatch.ONE_TO_ALL)
    def set_kl_reward_coef(self, value: float | None) -> None:
        if value is not None:  # a resumed run continues the adaptive coefficient
            self.shape = RewardShaper(self.cfg.algorithm, self.cfg.rollout.max_new_tokens, value)

    def held_models(self) -> list[tuple]:
        """Every (model, optimizer or None) the learner holds."""
        held = [(self.model, self.optimizer)]
        held += [(self.reference.model, None)] if self.reference is not None else []
        held += [(self.critic.model, self.critic.optimizer)] if self.critic is not None else []
        return held

    def sleep(self) -> None:
        """Colocation: the training state to host memory while the rollout has the device, the
        device's cache emptied (a CPU rank: nothing)."""
        if self.dist.device.type != "cpu":
            for model, optimizer in self.held_models():
                move_training_state(model, optimizer, torch.device("cpu"))
            torch.cuda.empty_cache()

    def wake(self) -> None:
        """The training state back to the learner's device (a CPU rank: nothing)."""
        if self.dist.device.type != "cpu":
            for model, optimizer in self.held_models():
                move_training_state(model, optimizer, self.dist.device)

    @register(Dispatch.ONE_TO_ALL)
    def close(self) -> None:
        """Release the weight-sync transports (staging files) and leave the process group (barrier
        first); the learner is unusable afterwards."""
        for transport in self.transports.values():
            transport.close()
        distributed.teardown_distributed()


def removing_on_failure(writer, paths: list[str | None]) -> None:
    """The writes queued on ``writer``, as one write that removes ``paths`` (this save's output
    directories) when any of them fails, then fails the same way."""
    jobs, writer.jobs = writer.jobs, []

    def run() -> None:
        try:
            for job in jobs:
                job()
        except BaseException:
            for path in paths:
                if path is not None:
                    shutil.rmtree(path, ignore_errors=True)
            raise

    writer.add(run)


@torch.no_grad()
def move_training_state(model, optimizer, device: torch.device) -> None:
    """A model's parameters and its optimizer's states (exp_avg, exp_avg_sq ...) to ``device``."""
    # FSDP2 keeps the sharded parameters' identity: the optimizer still refers to them
    model.to(device)
    for state in optimizer.state.values() if optimizer is not None else ():
        for key, value in state.items():
            if torch.is_tensor(value) and key != "step":  # Adam's step counter stays on the CPU
                state[key] = value.to(device, non_blocking=True)
