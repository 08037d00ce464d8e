"""The RL driver: one plain loop for synchronous and asynchronous training (architecture.md §1).

Every step the learner trains one version on a batch (``Learner.train_step``: reference and old
log-probs, values, advantages, updates, all in the learner's processes), the new weights go to the
rollout, and the driver logs, evaluates and checkpoints. The batch comes from the :class:`Feed`,
the same in both modes (AReaL / LlamaRL style): the rollout ranks generate (``rollout/stream.py``)
into the trajectory buffer (``rollout/buffer.py``), which admits new prompts only within the
staleness bound, and the learner takes each batch from the buffer itself, so no trajectory passes
through the driver. ``trainer.mode`` says only when the rollout generates:

* ``sync``: in turn with the learner. The bound is 0, and before each learner step the driver has
  the rollout fill the buffer with the step's batch, sampled with the weights just synced; the
  rollout and the learner may then share a device, each taking it in turn;
* ``async``: without pause, on a thread of each rollout rank, within
  ``asynchronous.max_staleness``.

In both, a dead rollout rank on a pool of its own is replaced while the learner goes on
(``driver/replace.py``).

Which algorithm runs is decided by registries (``algorithm.advantage``, ``algorithm.policy_loss``,
``algorithm.loss_agg``), never here.
"""

from __future__ import annotations

import time

from tqdm import tqdm

from hybridrl.config import Config
from hybridrl.driver.checkpointer import Checkpointer
from hybridrl.driver.replace import RolloutReplacer
from hybridrl.driver.restarts import Faults
from hybridrl.driver.session import Session, open_session
from hybridrl.rollout.buffer import make_buffer
from hybridrl.rollout.group_hooks import DynamicSampling
from hybridrl.telemetry.profiler import profiled


def train(cfg: Config, resume: bool = False, faults: Faults | None = None) -> dict:
    s = open_session(cfg, resume, faults)  # faults: restart counters (driver/restarts.py)
    t, roles, timer, state = cfg.trainer, s.roles, s.timer, s.state
    feed = Feed(s)
    last = dict(state.get("last", state["before"]))
    bar = tqdm(range(state["step"], t.total_steps), initial=state["step"], total=t.total_steps,
               desc=cfg.algorithm.advantage + feed.label, disable=not t.progress,
               dynamic_ncols=True)  # fmt: skip
    saver = Checkpointer(s.run_dir, roles, cfg)  # trainer.async_save: saves in the background
    with s.watchdog:  # a step past trainer.step_timeout_s: stacks dumped, StepTimeoutError
        try:
            feed.start()
            tick = time.perf_counter()
            for step in profiled(s, s.watchdog.steps(bar)):  # timeline.jsonl, traces
                saver.check()  # a background save that failed stops the run here
                out = feed.train_step(step)
                with timer.phase("weight_sync"):
                    feed.sync_weights(step + 1)
                done, elapsed = step + 1, time.perf_counter() - tick
                metrics = out["metrics"] | feed.stats(out, elapsed)
                s.trace(done, out)  # trajectories.jsonl: the trained prompts' uids
                if s.due(t.eval_every, done):
                    s.watchdog.arm(step)  # the evaluation gets a timeout budget of its own
                    with timer.phase("eval"):
                        last = s.evaluate(done)
                    metrics |= last
                s.logger.log(done, metrics | timer.pop())
                s.check_rewards(done, out)  # every reward failed for too long: the run stops
                s.log_samples(done, feed.recent_samples)
                postfix = dict(
                    reward=f"{metrics['reward/mean']:.3f}", acc=f"{last['eval/accuracy']:.3f}"
                )
                if "async/staleness_mean" in metrics:
                    postfix["stale"] = f"{metrics['async/staleness_mean']:.2f}"
                bar.set_postfix(postfix)
                stop = s.watchdog.stop_requested  # SIGTERM or SIGINT: save, then end
                if s.due(t.save_every, done) or stop:
                    s.watchdog.arm(step)  # so does the checkpoint
                    kl = roles.learner.kl_reward_coef()
                    saved = feed.state() | {"step": done, "last": last, "kl_reward_coef": kl}
                    saver.save(done, state | saved)
                if stop:
                    break
                # evaluation and checkpoints do not count as the learner's idleness
                tick = time.perf_counter()
            saver.close()  # the save in flight, if any
        finally:  # a failed step still leaves the metrics flushed and the workers stopped
            s.watchdog.disarm()  # the shutdown is not part of the step
            try:
                feed.close()
            finally:
                saver.close(abandon=True)  # after close(): nothing left
                s.logger.close()
                roles.shutdown()
    return s.close(last)


class Feed:
    """Each step's batch, through the trajectory buffer (module doc): the rollout generates into it
    on a thread of its own (``async``), or when the step asks (``sync``)."""

    def __init__(self, s: Session):
        t, state = s.cfg.trainer, s.state
        self.s, self.threaded = s, t.mode == "async"
        self.label = " async" if self.threaded else ""
        self.buffer = make_buffer(
            s.cfg.controller.backend,
            batch_groups=t.prompts_per_step,
            max_staleness=s.cfg.max_staleness,
            cursor=state["prompt_cursor"],
            pending=state.get("pending_prompts", ()),
            trained_groups=state["step"] * t.prompts_per_step,
            sampling=DynamicSampling.of(s.cfg, state.get("sampling_credit")),  # DAPO
        )
        # a dead rollout rank pauses the buffer and is replaced while the learner goes on
        self.rep = RolloutReplacer(s, self.buffer, state["step"])

    def start(self) -> None:
        self.s.roles.rollout.start_stream(
            self.buffer, self.s.params, self.s.cfg.trainer.seed, self.threaded
        )

    def train_step(self, step: int) -> dict:
        if not self.threaded:
            with self.s.timer.phase("rollout"):
                self.rep.fill()
        return self.rep.train_step(step)

    def sync_weights(self, version: int) -> None:
        self.rep.sync(version)

    def stats(self, out: dict, elapsed: float) -> dict:
        """The rollout's and the buffer's figures; asynchronous, the step's throughput and idleness
        too (``elapsed``: seconds since the step began, evaluation and checkpoints left out)."""
        metrics = self.rep.stats() | self.buffer.stats()
        if self.threaded:
            metrics["async/samples_per_s"] = len(out["staleness"]) / elapsed
            metrics["async/trainer_idle_frac"] = 1 - out["busy_s"] / elapsed
        return metrics

    def recent_samples(self) -> list:
        """The rollout's latest groups (of the rollout now: a dead one is replaced)."""
        return self.s.roles.rollout.recent_samples()

    def state(self) -> dict:
        return self.buffer.state()

    def close(self) -> None:
        """Stop generating first, so nothing writes into a closing buffer."""
        self.rep.stop()
        try:
            self.s.roles.rollout.stop_stream()
        finally:
            self.buffer.close()
            self.buffer.kill()
