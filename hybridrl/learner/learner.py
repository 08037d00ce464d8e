"""The learner: the trained models of one training rank and the learning step.

Both drivers make one call per step, :meth:`Learner.train_step`, with the step's scored samples
(synchronous training) or with the trajectory buffer to take them from (asynchronous training; the
synchronous driver is the asynchronous one without staleness). Everything the step needs stays in
this process: the batch is built here, once, from the samples; the reference and old log-probs, the
values, the advantages and both updates run here; the driver gets metrics back, never tensors.

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
pass.
"""

from __future__ import annotations

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
from hybridrl.learner import lora as lora_lib
from hybridrl.learner import moe as moe_training
from hybridrl.learner import pipeline_policy, pipeline_update, policy_io
from hybridrl.learner.compile import maybe_compile
from hybridrl.learner.critic import Critic
from hybridrl.learner.logprob import model_device, response_log_probs, sampling_of
from hybridrl.learner.metrics import batch_metrics, mean_over_ranks, staleness_metrics
from hybridrl.learner.optim import make_adamw
from hybridrl.learner.passes import (
    dropout_in_training,
    needs_critic,
    needs_reference,
    reuses_old_log_probs,
)
from hybridrl.learner.reference import Reference
from hybridrl.learner.shaping import RewardShaper
from hybridrl.learner.state import (
    BackgroundWriter,
    check_finite,
    save_trainable,
)
from hybridrl.learner.update import (
    SkipCounter,
    first_epoch_map,
    first_epoch_minibatches,
    is_single_pass,
    run_updates,
)
from hybridrl.learner.warmup import add_warmup
from hybridrl.models.loading import load_model
from hybridrl.moe.ep import traffic_metrics as ep_traffic_metrics
from hybridrl.parallel import distributed, shm_staging, weight_sync
from hybridrl.parallel.balance import balance_for_ranks
from hybridrl.parallel.buckets import BUCKET_BYTES
from hybridrl.parallel.fsdp import fsdp_config_of, prepare_model
from hybridrl.protocol import Batch, Sample, samples_to_batch
from hybridrl.rollout.buffer import REPLACING
from hybridrl.telemetry import PhaseTimer
from hybridrl.telemetry.flops import learner_perf
from hybridrl.telemetry.timeline import SpanLog

# a batch column: each row's index, so the update's forward can note its old log-probs
ROW = "update_row"


@torch.no_grad()
def move_training_state(model, optimizer, device: torch.device) -> None:
    """A model's parameters and its optimizer's states (exp_avg, exp_avg_sq ...) to ``device``."""
    # FSDP2 keeps the sharded parameters' identity: the optimizer still refers to them
    model.to(device)
    for state in optimizer.state.values() if optimizer is not None else ():
        for key, value in state.items():
            if torch.is_tensor(value) and key != "step":  # Adam's step counter stays on the CPU
                state[key] = value.to(device, non_blocking=True)


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
            self.pipeline, self.model = pipeline_policy.build(cfg, model, self.dist)
        else:
            self.model = prepare_model(
                model, fsdp_config_of(cfg), self.dist, ep_size=cfg.moe.ep_size
            )
            # actor.compile: the decoder layers compiled in place (learner/compile.py)
            self.model = maybe_compile(
                cfg.actor.compile, self.model, model_device(self.model), "policy"
            )
        params = self.model.parameters()
        if self.lora is not None:
            params = lora_lib.trainable_parameters(self.model)
        # fused where it applies (learner/optim.py: one pass per parameter, same AdamW math)
        self.optimizer = make_adamw(params, cfg.actor.lr, cfg.actor.weight_decay, "policy")
        add_warmup(self.optimizer, cfg.actor.lr_warmup_steps)  # actor.lr_warmup_steps
        # MoE (docs/moe.md): routing replay, balancing, health; None for a dense model
        self.moe = moe_training.start(self.model, self.optimizer, cfg.moe)
        self.loss_fn = POLICY_LOSSES.get(cfg.algorithm.policy_loss)
        self.aggregate = LOSS_AGG.get(cfg.algorithm.loss_agg)
        self.shuffle = torch.Generator().manual_seed(cfg.trainer.seed + 1)
        # log-probs under the rollout's filtered distribution
        self.sampling = sampling_of(cfg.rollout)
        self.skips = SkipCounter(cfg.alerts.max_nonfinite_in_a_row, "actor")
        self._taken: torch.Tensor | None = None  # old log-probs noted by the running / last update
        ref_path = reference_path or model_path
        self.reference = Reference(cfg, ref_path, self.dist) if needs_reference(cfg) else None
        if self.reference is not None:  # MoE r3: the reference replays the rollout's routing too
            moe_training.replays_routing(self.reference.model)
        critic_from = critic_path or ref_path
        self.critic = Critic(cfg, critic_from, self.dist) if needs_critic(cfg) else None
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
        spent waiting)."""
        t0 = time.perf_counter()
        samples = self._samples(source, version)
        waited = time.perf_counter() - t0
        alg, timer = self.cfg.algorithm, self.timer
        batch = samples_to_batch(samples, self.tokenizer.pad_token_id)
        # each rank's share of each of the update's mini-batches gets an equal token count
        minis = first_epoch_minibatches(len(batch), self.shuffle, self.cfg.actor.ppo_minibatch_size)
        world, balance = distributed.world_size(), self.cfg.trainer.balance_batch
        if self.pipeline is not None:  # the policy's rows go to the data-parallel replicas
            world = self.pipeline.layout.dp
        batch, balanced = balance_for_ranks(batch, world, balance, minis)  # parallel/balance.py
        reuse = reuses_old_log_probs(self.cfg, len(batch))
        batch = self.moe.mark(batch) if self.moe else batch  # which rows replay their routing
        if self.reference is not None:
            with timer.phase("reference"):
                batch |= on_my_rows(self.reference.log_probs, batch)
        if alg.rollout_bypass:  # the rollout's log-probs are the old policy: no forward
            batch |= bypass_old_log_probs(batch)
        elif not reuse:
            with timer.phase("old_log_prob"):
                batch |= self._policy_rows(self.compute_log_prob, batch)
        batch = self.moe.after_old_pass(batch) if self.moe else batch  # r2: replay that pass
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
            metrics |= self._policy_rows(self.update_policy, batch)
        if reuse:  # the update's first forward computed them: the gap metrics come now
            batch |= self._policy_rows(self.old_log_probs_of_last_update, batch)
            batch, correction = rollout_correction(batch, alg)
        stale, lag = {}, []
        if not isinstance(source, list):  # asynchronous: how many versions behind each sample is
            stale, lag = staleness_metrics(batch, version, self.cfg.asynchronous.max_staleness)
        timing = {k: v for k, v in timer.pop().items() if k != "timing/step"}
        # MFU and tokens/s of the model phases, per rank (telemetry/flops.py)
        perf = learner_perf(self, timing, batch["attention_mask"]) | balanced
        if self.moe:  # moe/: loads, routing changes; with moe.ep_size > 1 the rows exchanged
            perf |= self.moe.step_metrics(batch) | ep_traffic_metrics(self.model)
        return {
            "metrics": metrics | correction | batch_metrics(batch) | stale | timing | perf,
            "uids": list(dict.fromkeys(s.uid for s in samples)),
            "staleness": lag,
            "busy_s": time.perf_counter() - t0 - waited,
        }

    def _samples(self, source, version: int) -> list[Sample]:
        if isinstance(source, list):
            return source
        with self.timer.phase("wait_batch"):  # rank 0 takes the batch and shares it with the others
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

    def _policy_rows(self, fn, batch: Batch):
        """``on_my_rows`` for the policy's passes: with a pipeline, each data-parallel replica's
        share (learner/pipeline_policy.py)."""
        if self.pipeline is None:
            return on_my_rows(fn, batch)
        return pipeline_policy.on_replica_rows(fn, batch, self.pipeline.layout)

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
        if ROW in mb:
            mb = mb | Batch({"old_log_probs": self._keep_old(mb, logp)})
        pg, metrics = self.loss_fn(logp, mb, alg)
        pg = weighted_policy_loss(pg, mb)  # rollout correction (algorithm.rollout_is), when on
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
        if self.moe:  # MoE balancing losses of this forward (moe.aux_loss_coef, moe.z_loss_coef)
            loss, metrics = self.moe.add_losses(loss, metrics, mb, totals)
        return loss, metrics

    # --- the policy's passes (this rank's rows) -------------------------------------------------
    @register(Dispatch.DP_COMPUTE)
    def compute_log_prob(self, batch: Batch) -> Batch:
        """π_old of every row, grouped as the next update's first epoch groups them
        (``first_epoch_map``)."""

        def fn(model, mb):
            return response_log_probs(model, mb, self.sampling)[0]

        if self.pipeline is not None:
            old = pipeline_update.first_epoch_log_probs(
                self.pipeline, batch, self.shuffle, self.cfg.actor, self.sampling
            )
            return Batch({"old_log_probs": old})
        return Batch(
            {"old_log_probs": first_epoch_map(self.model, batch, self.shuffle, self.cfg.actor, fn)}
        )

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
            self._check_single_pass(batch)
            reuse = not dropout_in_training(self.model)
            if reuse:
                self._taken = torch.zeros(tuple(batch["responses"].shape), dtype=torch.float32)
                batch = batch | Batch({ROW: torch.arange(len(batch))})
            else:
                batch = batch | self.compute_log_prob(batch)
                self._taken = batch["old_log_probs"]
        if self.pipeline is not None:
            if loss_fn is not None:
                raise ValueError("update_policy: a pipelined policy trains on objective() only")
            metrics = pipeline_update.run_updates(
                self.pipeline,
                self.optimizer,
                batch,
                self.objective,
                self.cfg.actor,
                generator=self.shuffle,
                norm_len=self.cfg.loss_norm_len,
                sampling=self.sampling,
                prefix="actor",
                skips=self.skips,
            )
            if reuse:  # the last stage noted them
                self._taken = self.pipeline.broadcast_from_last(self._taken)
            return metrics | {"actor/old_log_prob_reused": float(reuse)}
        metrics = run_updates(
            self.model,
            self.optimizer,
            batch,
            loss_fn or self.policy_loss,
            self.cfg.actor,
            generator=self.shuffle,
            norm_len=self.cfg.loss_norm_len,
            prefix="actor",
            skips=self.skips,
        )
        return metrics | {"actor/old_log_prob_reused": float(reuse)}

    def _keep_old(self, mb: Batch, logp: torch.Tensor) -> torch.Tensor:
        """On-policy: this forward's log-probs are the old policy's; note them at the micro-batch's
        rows (valid tokens only: a dummy micro-batch repeats a row with an empty mask), return them
        detached."""
        old = logp.detach().float()
        rows, width, mask = mb[ROW], old.shape[1], mb["response_mask"].bool()
        kept = self._taken[rows.cpu(), :width]
        self._taken[rows.cpu(), :width] = torch.where(mask.cpu(), old.cpu(), kept)
        return old

    def _check_single_pass(self, batch: Batch) -> None:
        if self.pipeline is not None:
            total = pipeline_policy.replica_total(len(batch), self.pipeline.layout)
        else:
            total = sum(distributed.all_gather_ints(len(batch)))
        if not is_single_pass(self.cfg.actor, total):
            a = self.cfg.actor
            raise ValueError(
                "update_policy: a batch without old_log_probs needs one epoch over one "
                f"mini-batch, got ppo_epochs={a.ppo_epochs}, "
                f"ppo_minibatch_size={a.ppo_minibatch_size} for {total} rows; "
                "run compute_log_prob first"
            )

    @register(Dispatch.DP_COMPUTE)
    def old_log_probs_of_last_update(self, batch: Batch) -> Batch:
        """The old log-probs the last ``update_policy`` given a batch without them noted, for this
        rank's rows of ``batch`` (the batch it trained on)."""
        old, self._taken = self._taken, None
        if old is None or len(old) != len(batch):
            raise RuntimeError(
                "old_log_probs_of_last_update: the last update_policy was not given a batch "
                "without old_log_probs"
            )
        return Batch({"old_log_probs": old})

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
        ``<marker>-rank<r>`` (``learner/state.py``: ``BackgroundWriter``); returns that path."""
        critic = self.critic.model if self.critic is not None else None
        check_finite({"policy": self.model, "critic": critic})
        writer = None
        if marker is not None:
            self.wait_checkpoint()  # one save in flight at most
            writer = self.writer
        policy_io.save(self, path, writer)
        if self.critic is not None and critic_path is not None:
            c = self.critic
            save_trainable(critic_path, c.model, c.optimizer, c.shuffle, background=writer)
        if writer is None:
            return None
        writer.start(f"{marker}-rank{self.rank}")
        return f"{marker}-rank{self.rank}"

    @register(Dispatch.ONE_TO_ALL)
    def wait_checkpoint(self) -> dict | None:
        """Wait for this rank's background save; its failure (``learner/state.py``:
        ``describe_failure``) or None."""
        return self.writer.wait()

    @register(Dispatch.ONE_TO_ALL)
    def load_state(self, path: str, critic_path: str | None = None) -> None:
        policy_io.load(self, path)
        if self.critic is not None and critic_path is not None:
            self.critic.load(critic_path)

    @register(Dispatch.RANK_ZERO)
    def kl_reward_coef(self) -> float:
        return self.shape.kl.value

    @register(Dispatch.ONE_TO_ALL)
    def set_kl_reward_coef(self, value: float | None) -> None:
        if value is not None:  # a resumed run continues the adaptive coefficient
            self.shape = RewardShaper(self.cfg.algorithm, self.cfg.rollout.max_new_tokens, value)

    def _move_training_state(self, device: torch.device) -> None:
        """Every model this learner holds, with its optimizer's states, to ``device``."""
        held = [(self.model, self.optimizer)]
        held += [(self.reference.model, None)] if self.reference is not None else []
        held += [(self.critic.model, self.critic.optimizer)] if self.critic is not None else []
        for model, optimizer in held:
            move_training_state(model, optimizer, device)

    def sleep(self) -> None:
        """Colocation: the training state leaves the device while the rollout has it (on a CPU rank
        everything already lives in host memory)."""
        if self.dist.device.type != "cpu":
            self._move_training_state(torch.device("cpu"))
            torch.cuda.empty_cache()

    def wake(self) -> None:
        if self.dist.device.type != "cpu":
            self._move_training_state(self.dist.device)

    @register(Dispatch.ONE_TO_ALL)
    def close(self) -> None:
        """Release the weight-sync transports (staging files) and leave the process group (barrier
        first); the learner is unusable afterwards."""
        for transport in self.transports.values():
            transport.close()
        distributed.teardown_distributed()
