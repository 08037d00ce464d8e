"""The learner of asynchronous training: the trained roles (actor, reference, critic) fused in one
process per slot, taking each training batch straight from the trajectory buffer.

The driver only says "train version v" (:meth:`LearnerWorker.train_step`); the learner fetches the
batch from the buffer itself (rollout -> buffer -> learner, never through the driver), runs the same
step as the synchronous trainer (``trainers/learn.py``), and returns metrics and the trained prompts'
ids. Decoupled PPO's three policies are then: behaviour = the engine's log-probs (``rollout_log_probs``,
possibly stale and mixed across versions), proximal = this step's recomputed ``old_log_probs`` (weights
``v`` before the update; on-policy, one epoch over one mini-batch, the update's own first forward, which
runs those weights: ``trainers/learn.py``), current = the policy being updated.
"""

from __future__ import annotations

import time

import torch

from hybridrl.controller import Dispatch, register
from hybridrl.controller.colocated import FusedWorker
from hybridrl.controller.dispatch import collect, plan, registered_methods
from hybridrl.protocol import Batch, samples_to_batch
from hybridrl.telemetry import PhaseTimer
from hybridrl.trainers.learn import learn
from hybridrl.trainers.metrics import batch_metrics
from hybridrl.trainers.shaping import RewardShaper
from hybridrl.training import distributed as D


def staleness_metrics(
    batch: Batch, version: int, max_staleness: int
) -> tuple[dict[str, float], list[int]]:
    """Per sample: staleness = ``version`` - the oldest version among its tokens; a histogram over
    0..max_staleness (``async/staleness_<k>``: fraction of samples), mean / max, and the fraction of
    partial samples (interrupted by a weight update: tokens of more than one version)."""
    stamps, mask = batch["versions"], batch["response_mask"].bool()
    big = torch.iinfo(stamps.dtype).max
    oldest = torch.where(mask, stamps, big).min(-1).values
    oldest = torch.where(oldest == big, version, oldest)  # empty responses count as fresh
    newest = torch.where(mask, stamps, -1).max(-1).values
    lag = (version - oldest).tolist()
    n = max(len(lag), 1)
    out = {
        f"async/staleness_{k}": sum(x == k for x in lag) / n
        for k in range(max(max_staleness, max(lag, default=0)) + 1)
    }
    out |= {
        "async/staleness_mean": sum(lag) / n,
        "async/staleness_max": float(max(lag, default=0)),
        "async/partial_frac": ((newest > oldest) & mask.any(-1)).float().mean().item(),
    }
    return out, lag


class RankView:
    """A role worker as every learner rank calls it in-process: a DP_COMPUTE method runs on this rank's
    chunk of the batch and the ranks' results are gathered, as the driver's dispatch does across ranks."""

    def __init__(self, worker):
        self.worker, self.modes = worker, registered_methods(type(worker))

    def __getattr__(self, name: str):
        fn = getattr(self.worker, name)
        if self.modes.get(name) is not Dispatch.DP_COMPUTE or D.world_size() == 1:
            return fn

        def call(batch, *args, **kwargs):
            ((_, mine, kw),) = [
                c
                for c in plan(Dispatch.DP_COMPUTE, D.world_size(), (batch, *args), kwargs)
                if c[0] == D.rank()
            ]
            return collect(Dispatch.DP_COMPUTE, D.all_gather_object(fn(*mine, **kw)))

        return call


class LearnerWorker(FusedWorker):
    def __init__(self, ctx, parts, cfg):
        super().__init__(ctx, parts)
        self.cfg = cfg
        self.actor, self.reference, self.critic = (
            RankView(self.parts[r]) if r in self.parts else None
            for r in ("actor", "reference", "critic")
        )
        self.shape = RewardShaper(cfg.algorithm, cfg.rollout.max_new_tokens)
        self.timer = PhaseTimer()
        self.pad_id = self.parts["actor"].tokenizer.pad_token_id

    @register(Dispatch.ONE_TO_ALL)
    def train_step(self, buffer, version: int) -> dict:
        """Train weights ``version`` on the next batch of ``buffer`` (fetched by rank 0, shared with the other
        ranks); returns ``metrics``, the trained prompts' ``uids``, each sample's ``staleness``, and ``busy_s``
        (time not spent waiting), the same on every rank."""
        t0 = time.perf_counter()
        with self.timer.phase("wait_batch"):
            groups = (
                buffer.get_batch(version, self.cfg.asynchronous.batch_timeout_s)
                if self.rank == 0
                else None
            )
            groups = D.all_gather_object(groups)[0] if D.world_size() > 1 else groups
        waited = time.perf_counter() - t0
        samples = [s for g in groups for s in g.samples]
        batch = samples_to_batch(samples, self.pad_id) | Batch(
            {
                "rewards": torch.tensor([r for g in groups for r in g.rewards]),
                "reward_errors": torch.tensor([e for g in groups for e in g.errors]),
            }
        )
        batch, metrics = learn(
            self.actor, self.reference, self.critic, batch, self.shape, self.cfg, self.timer
        )
        stale, lag = staleness_metrics(batch, version, self.cfg.asynchronous.max_staleness)
        timing = {k: v for k, v in self.timer.pop().items() if k != "timing/step"}
        return {
            "metrics": metrics | batch_metrics(batch) | stale | timing,
            "uids": [g.samples[0].uid for g in groups],
            "staleness": lag,
            "busy_s": time.perf_counter() - t0 - waited,
        }

    @register(Dispatch.RANK_ZERO)
    def kl_reward_coef(self) -> float:
        return self.shape.kl.value

    @register(Dispatch.ONE_TO_ALL)
    def set_kl_reward_coef(self, value: float | None) -> None:
        if value is not None:
            self.shape = RewardShaper(self.cfg.algorithm, self.cfg.rollout.max_new_tokens, value)
