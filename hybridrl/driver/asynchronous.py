"""The asynchronous RL driver (``trainer.mode: async``; AReaL / LlamaRL style).

Rollout ranks generate without pause (``rollout/stream.py``) and put scored groups into the
trajectory buffer (``rollout/buffer.py``), which admits new prompts only within the staleness
bound ``asynchronous.max_staleness``. The learner (``learner/step.py``) takes each batch from
the buffer itself (``Learner.train_step``, the same call the synchronous driver makes with the
step's samples). The driver schedules and monitors: train version v, sync the weights (the rollout
is interrupted between two engine steps and continues every sequence), log, evaluate, checkpoint.
No trajectory passes through it; it only sees metrics and the trained prompts' ids
(``trajectories.jsonl``).
"""

from __future__ import annotations

import time

from tqdm import tqdm

from hybridrl.config import Config
from hybridrl.driver.checkpointer import Checkpointer
from hybridrl.driver.replace import RolloutReplacer
from hybridrl.driver.restarts import Faults
from hybridrl.driver.session import open_session
from hybridrl.rollout.buffer import make_buffer
from hybridrl.telemetry.profiler import profiled


def train(cfg: Config, resume: bool = False, faults: Faults | None = None) -> dict:
    s = open_session(cfg, resume, faults)  # faults: restart counters (driver/restarts.py)
    t, roles, timer, state = cfg.trainer, s.roles, s.timer, s.state
    buffer = make_buffer(
        cfg.controller.backend,
        batch_groups=t.prompts_per_step,
        max_staleness=cfg.asynchronous.max_staleness,
        cursor=state["prompt_cursor"],
        pending=state.get("pending_prompts", ()),
        trained_groups=state["step"] * t.prompts_per_step,
    )
    last, desc = dict(state.get("last", state["before"])), f"{cfg.algorithm.advantage} async"
    bar = tqdm(range(state["step"], t.total_steps), initial=state["step"], total=t.total_steps,
               desc=desc, disable=not t.progress, dynamic_ncols=True)  # fmt: skip
    # a dead rollout rank pauses the buffer and is replaced while the learner goes on (replace.py)
    rep = RolloutReplacer(s, buffer, state["step"])
    saver = Checkpointer(s.run_dir, roles, cfg)  # trainer.async_save: saves in the background
    with s.watchdog:  # a step past trainer.step_timeout_s: stacks dumped, StepTimeoutError
        try:
            roles.rollout.start_stream(buffer, s.params, t.seed)
            tick = time.perf_counter()
            for step in profiled(s, s.watchdog.steps(bar)):  # timeline.jsonl, traces
                saver.check()  # a background save that failed stops the run here
                out = rep.train_step(step)
                with timer.phase("weight_sync"):
                    rep.sync(step + 1)
                done, elapsed = step + 1, time.perf_counter() - tick
                metrics = out["metrics"] | rep.stats() | buffer.stats()
                metrics["async/samples_per_s"] = len(out["staleness"]) / elapsed
                metrics["async/trainer_idle_frac"] = 1 - out["busy_s"] / elapsed
                s.trace(done, out)  # trajectories.jsonl: trained uids and staleness
                if s.due(t.eval_every, done):
                    s.watchdog.arm(step)  # the evaluation gets a timeout budget of its own
                    with timer.phase("eval"):
                        last = s.evaluate(done)
                    metrics |= last
                s.logger.log(done, metrics | timer.pop())
                s.check_rewards(done, out)  # every reward failed for too long: the run stops
                # the rollout's latest groups (of the rollout now: a dead one is replaced)
                s.log_samples(done, lambda: roles.rollout.recent_samples())
                stale = f"{metrics['async/staleness_mean']:.2f}"
                bar.set_postfix(
                    reward=f"{metrics['reward/mean']:.3f}",
                    acc=f"{last['eval/accuracy']:.3f}",
                    stale=stale,
                )
                stop = s.watchdog.stop_requested  # SIGTERM or SIGINT: save, then end
                if s.due(t.save_every, done) or stop:
                    s.watchdog.arm(step)  # so does the checkpoint
                    kl = roles.learner.kl_reward_coef()
                    extra = buffer.state() | {"step": done, "last": last, "kl_reward_coef": kl}
                    saver.save(done, state | extra)
                if stop:
                    break
                # evaluation and checkpoints do not count as the learner's idleness
                tick = time.perf_counter()
            saver.close()  # the save in flight, if any
        finally:  # stop generating first, so nothing writes into a closing buffer
            s.watchdog.disarm()  # the shutdown is not part of the step
            rep.stop()
            try:
                roles.rollout.stop_stream()
            finally:
                buffer.close()
                buffer.kill()
                saver.close(abandon=True)  # after close(): nothing left
                s.logger.close()
                roles.shutdown()
    return s.close(last)
