"""The synchronous RL driver: one plain loop (docs/architecture.md §1).

Every step: the rollout generates and scores the step's samples (``driver/collect.py``), the
learner trains on them (``Learner.train_step``: reference and old log-probs, values, advantages,
updates, all in the learner's processes), the new weights go to the rollout. It is the
asynchronous driver with no staleness: generation waits for the weights it will sample with. Which
algorithm runs is decided by registries (``algorithm.advantage``, ``algorithm.policy_loss``,
``algorithm.loss_agg``), never here.
"""

from __future__ import annotations

from tqdm import tqdm

from hybridrl.config import Config
from hybridrl.data.prefetch import PromptPrefetcher
from hybridrl.driver.checkpointer import Checkpointer
from hybridrl.driver.collect import collect
from hybridrl.driver.restarts import Faults
from hybridrl.driver.session import open_session
from hybridrl.telemetry.profiler import profiled


def train(cfg: Config, resume: bool = False, faults: Faults | None = None) -> dict:
    s = open_session(cfg, resume, faults)  # faults: restart counters (driver/restarts.py)
    t, roles, timer, state, desc = cfg.trainer, s.roles, s.timer, s.state, cfg.algorithm.advantage
    last, cursor = dict(state.get("last", state["before"])), state["prompt_cursor"]
    bar = tqdm(range(state["step"], t.total_steps), initial=state["step"], total=t.total_steps,
               desc=desc, disable=not t.progress, dynamic_ncols=True)  # fmt: skip
    saver = Checkpointer(s.run_dir, roles, cfg)  # trainer.async_save: saves in the background
    prompts = PromptPrefetcher(s.task, s.tokenizer, t.prefetch_steps * t.prompts_per_step)
    with s.watchdog:  # a step past trainer.step_timeout_s: stacks dumped, StepTimeoutError
        try:
            for step in profiled(s, s.watchdog.steps(bar)):  # timeline.jsonl, traces
                saver.check()  # a background save that failed stops the run here
                samples, cursor, metrics = collect(
                    roles.rollout, prompts, s.tokenizer, cfg, s.params, cursor, t.seed + step, timer
                )
                out = roles.learner.train_step(step, samples)
                metrics |= out["metrics"]
                with timer.phase("weight_sync"):
                    roles.sync_weights(step + 1)
                metrics |= roles.rollout.stats()
                done = step + 1
                s.trace(done, out)  # trajectories.jsonl: the trained prompts' uids
                if s.due(t.eval_every, done):
                    s.watchdog.arm(step)  # the evaluation gets a timeout budget of its own
                    with timer.phase("eval"):
                        last = s.evaluate(done)
                    metrics |= last
                s.logger.log(done, metrics | timer.pop())
                s.check_rewards(done, out)  # every reward failed for too long: the run stops
                s.log_samples(done, samples)
                bar.set_postfix(
                    reward=f"{metrics['reward/mean']:.3f}", acc=f"{last['eval/accuracy']:.3f}"
                )
                stop = s.watchdog.stop_requested  # SIGTERM or SIGINT: save, then end
                if s.due(t.save_every, done) or stop:
                    s.watchdog.arm(step)  # so does the checkpoint
                    kl = roles.learner.kl_reward_coef()
                    saved = dict(step=done, last=last, prompt_cursor=cursor, kl_reward_coef=kl)
                    saver.save(done, state | saved)
                if stop:
                    break
            saver.close()  # the save in flight, if any
        finally:  # a failed step still leaves the metrics flushed and the workers stopped
            s.watchdog.disarm()  # the shutdown is not part of the step
            prompts.close()
            saver.close(abandon=True)  # after close(): nothing left
            s.logger.close()
            roles.shutdown()
    return s.close(last)
