"""The learning step behind ``Learner.train_step``: in what order a step's passes run, on which
rows, and what goes back to the driver.

The :class:`~hybridrl.learner.learner.Learner` holds the models and registers their passes
(reference log-probs, old log-probs, values, both updates); this module is the sequence over them,
kept in one place so that it reads as docs/architecture.md draws it. The batch is built here, once,
from the step's samples; every pass adds its columns to it; the driver gets metrics back, never
tensors. With more than one rank every rank runs the whole step, and each per-row pass runs on the
rank's contiguous share of the rows (:func:`on_my_rows`), so the step equals the single-process one.
"""

from __future__ import annotations

import time

from hybridrl.algorithms import compute_advantages
from hybridrl.algorithms.rollout_correction import bypass_old_log_probs, rollout_correction
from hybridrl.learner import pipeline_policy
from hybridrl.learner.metrics import batch_metrics, mean_over_ranks, staleness_metrics
from hybridrl.learner.passes import reuses_old_log_probs
from hybridrl.learner.update import first_epoch_minibatches
from hybridrl.moe.ep import traffic_metrics as ep_traffic_metrics
from hybridrl.parallel import distributed
from hybridrl.parallel.balance import balance_for_ranks
from hybridrl.protocol import REPLACING, Batch, Sample, samples_to_batch
from hybridrl.telemetry.flops import learner_perf


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


def policy_rows(learner, fn, batch: Batch):
    """``on_my_rows`` for the policy's passes: with a pipeline, each data-parallel replica's share
    (learner/pipeline_policy.py)."""
    if learner.pipeline is None:
        return on_my_rows(fn, batch)
    return pipeline_policy.on_replica_rows(fn, batch, learner.pipeline.layout)


def reward_failures(samples: list[Sample]) -> tuple[int, int, str | None]:
    """``(failed, scored, first error)``: how many of the step's samples had a reward that failed
    (``rollout/scoring.py``) or an environment that failed (multi-turn: its reward is then 0),
    out of how many, and the first failure's message."""
    failed = [
        s for s in samples if s.reward_extras.get("reward_errors") or s.metadata.get("env_error")
    ]
    first = next(
        (s.metadata.get("reward_error") or s.metadata.get("env_error_message") for s in failed),
        None,
    )
    return len(failed), len(samples), first


def take_samples(learner, source, version: int) -> list[Sample]:
    """The step's samples: ``source`` itself (synchronous), or the next batch rank 0 takes from the
    trajectory buffer ``source`` and shares with the other ranks (asynchronous). A rollout being
    replaced raises on every rank."""
    if isinstance(source, list):
        return source
    with learner.timer.phase("wait_batch"):
        samples = None
        if learner.rank == 0:
            try:
                samples = source.get_batch(version, learner.cfg.asynchronous.batch_timeout_s)
            except RuntimeError as exc:  # the rollout is replaced: every rank raises it
                if REPLACING not in str(exc):
                    raise
                samples = REPLACING
        if distributed.world_size() > 1:
            samples = distributed.all_gather_object(samples)[0]
    if isinstance(samples, str):
        raise RuntimeError(samples)
    return samples


def train_step(learner, version: int, source) -> dict:
    """``Learner.train_step``: train weights ``version`` on ``source`` (the step's scored samples,
    or a trajectory buffer to take the next batch from)."""
    t0 = time.perf_counter()
    samples = take_samples(learner, source, version)
    waited = time.perf_counter() - t0
    cfg, timer = learner.cfg, learner.timer
    alg = cfg.algorithm
    batch = samples_to_batch(samples, learner.tokenizer.pad_token_id)
    # each rank's share of each of the update's mini-batches gets an equal token count
    minis = first_epoch_minibatches(len(batch), learner.shuffle, cfg.actor.ppo_minibatch_size)
    world, balance = distributed.world_size(), cfg.trainer.balance_batch
    if learner.pipeline is not None:  # the policy's rows go to the data-parallel replicas
        world = learner.pipeline.layout.dp
    batch, balanced = balance_for_ranks(batch, world, balance, minis)  # parallel/balance.py
    reuse = reuses_old_log_probs(cfg, len(batch))
    moe = learner.moe
    batch = moe.mark(batch) if moe else batch  # which rows replay their routing
    if learner.reference is not None:
        with timer.phase("reference"):
            batch |= on_my_rows(
                lambda rows: learner.reference.log_probs(rows, learner.shuffle), batch
            )
    if alg.rollout_bypass:  # the rollout's log-probs are the old policy: no forward
        batch |= bypass_old_log_probs(batch)
    elif not reuse:
        with timer.phase("old_log_prob"):
            batch |= policy_rows(learner, learner.compute_log_prob, batch)
    batch = moe.after_old_pass(batch) if moe else batch  # r2: replay that pass
    correction = {}
    if not reuse:
        batch, correction = rollout_correction(batch, alg)
    if learner.critic is not None:
        with timer.phase("values"):
            batch |= on_my_rows(learner.critic.values, batch)
    with timer.phase("advantage"):
        batch, metrics = learner.shape(batch)
        batch = compute_advantages(batch, alg)
    if learner.critic is not None:
        with timer.phase("critic_update"):
            metrics |= on_my_rows(learner.critic.update, batch)
    with timer.phase("update"):
        metrics |= policy_rows(learner, learner.update_policy, batch)
    if reuse:  # the update's first forward computed them: the gap metrics come now
        batch |= policy_rows(learner, learner.old_log_probs_of_last_update, batch)
        batch, correction = rollout_correction(batch, alg)
    stale, lag = {}, []
    if not isinstance(source, list):  # asynchronous: how many versions behind each sample is
        stale, lag = staleness_metrics(batch, version, cfg.asynchronous.max_staleness)
    timing = {k: v for k, v in timer.pop().items() if k != "timing/step"}
    # MFU and tokens/s of the model phases, per rank (telemetry/flops.py)
    # the tokens one epoch of the update computed (a shared prompt once): what the FLOPs count
    fed, padding = metrics.get("perf/tokens_fed"), metrics.get("perf/padding_fraction", 0.0)
    computed = fed * (1 - padding) / cfg.actor.ppo_epochs if fed else None
    perf = learner_perf(learner, timing, batch["attention_mask"], computed) | balanced
    if moe:  # moe/: loads, routing changes; with moe.ep_size > 1 the rows exchanged
        perf |= moe.step_metrics(batch) | ep_traffic_metrics(learner.model)
    return {
        "metrics": metrics | correction | batch_metrics(batch) | stale | timing | perf,
        "uids": list(dict.fromkeys(s.uid for s in samples)),
        "reward_failures": reward_failures(samples),
        "staleness": lag,
        "busy_s": time.perf_counter() - t0 - waited,
    }
