"""The synchronous RL driver: one plain loop over the roles (GUIDE.md §1).

Every step: generate and score -> reference log-probs -> old log-probs ->
(values) -> token-level rewards -> advantages -> (critic update) -> policy
update -> weight sync. Which algorithm runs is decided by registries
(``algorithm.advantage``, ``algorithm.policy_loss``, ``algorithm.loss_agg``),
never by branches here; the critic exists only when the estimator needs values.
"""
from __future__ import annotations

import logging
import time

from tqdm import tqdm

from hybridrl.algorithms import compute_advantages
from hybridrl.config import Config
from hybridrl.rollout import SamplingParams
from hybridrl.telemetry import MetricsLogger, PhaseTimer, write_report
from hybridrl.trainers.checkpoint import latest_checkpoint, save_checkpoint
from hybridrl.trainers.collect import collect
from hybridrl.trainers.evaluate import Evaluator
from hybridrl.trainers.metrics import batch_metrics, mean_over_ranks
from hybridrl.trainers.roles import build_roles
from hybridrl.trainers.run_dir import open_run_dir, run_path, write_summary
from hybridrl.trainers.sft import ensure_warm_start
from hybridrl.trainers.shaping import RewardShaper
from hybridrl.workers.common import load_tokenizer, make_task

log = logging.getLogger(__name__)


def train(cfg: Config, resume: bool = False) -> dict:
    t_start, t = time.perf_counter(), cfg.trainer
    warm = ensure_warm_start(cfg, t.progress)
    found = latest_checkpoint(run_path(cfg)) if resume else None
    if resume and not found:
        log.warning("--resume: no complete checkpoint under %s, starting a fresh run", run_path(cfg))
    run_dir = open_run_dir(cfg, resume=found is not None)
    state = found[1] if found else {"step": 0, "prompt_cursor": 0, "reference_path": warm}
    ckpt = found[0] if found else None
    roles = build_roles(cfg, str(ckpt / "model") if ckpt else warm, state["reference_path"],
                        str(ckpt / "critic") if ckpt and (ckpt / "critic").is_dir() else None)
    if ckpt:
        roles.actor.load_state(str(ckpt / "model"))
        if roles.critic is not None:
            roles.critic.load_state(str(ckpt / "critic"))
        roles.sync_weights(state["step"])
    task, tokenizer = make_task(cfg), load_tokenizer(cfg, warm)
    params = SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                            max_new_tokens=cfg.rollout.max_new_tokens, n=t.samples_per_prompt)
    evaluate = Evaluator(roles, task.heldout()[: cfg.task.eval_size], tokenizer, params, seed=t.seed + 10_000)
    shape = RewardShaper(cfg.algorithm, cfg.rollout.max_new_tokens, state.get("kl_reward_coef"))
    logger, timer = MetricsLogger(run_dir, t.tensorboard, resume_step=state["step"] if found else None), PhaseTimer()
    if "before" not in state:
        with timer.phase("eval"):
            state["before"] = evaluate()
        logger.log(0, state["before"])
    last, cursor = dict(state.get("last", state["before"])), state["prompt_cursor"]
    timer.pop()
    bar = tqdm(range(state["step"], t.total_steps), initial=state["step"], total=t.total_steps, desc=cfg.algorithm.advantage,
               disable=not t.progress, dynamic_ncols=True)
    try:
        for step in bar:
            batch, cursor, metrics = collect(roles, task, tokenizer, cfg, params, cursor, seed=t.seed + step, timer=timer)
            with timer.phase("reference"):
                batch |= roles.reference.compute_ref_log_prob(batch)
            with timer.phase("old_log_prob"):
                batch |= roles.actor.compute_log_prob(batch)
            if roles.critic is not None:
                with timer.phase("values"):
                    batch |= roles.critic.compute_values(batch)
            with timer.phase("advantage"):
                batch, shaping_metrics = shape(batch)
                batch = compute_advantages(batch, cfg.algorithm)
            if roles.critic is not None:
                with timer.phase("critic_update"):
                    metrics |= mean_over_ranks(roles.critic.update_critic(batch))
            with timer.phase("update"):
                metrics |= mean_over_ranks(roles.actor.update_policy(batch))
            with timer.phase("weight_sync"):
                roles.sync_weights(step + 1)
            metrics |= shaping_metrics | batch_metrics(batch) | roles.rollout.stats()
            done = step + 1
            if (t.eval_every and done % t.eval_every == 0) or done == t.total_steps:
                with timer.phase("eval"):
                    last = evaluate()
                metrics |= last
            logger.log(done, metrics | timer.pop())
            bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", acc=f"{last['eval/accuracy']:.3f}")
            if (t.save_every and done % t.save_every == 0) or done == t.total_steps:
                save_checkpoint(run_dir, done, roles, state | {"step": done, "last": last, "prompt_cursor": cursor,
                                                               "kl_reward_coef": shape.kl.value}, cfg)
    finally:  # a failed step still leaves the metrics flushed and the workers stopped
        logger.close()
        roles.shutdown()
    summary = {
        "accuracy_before": state["before"]["eval/accuracy"], "accuracy_after": last["eval/accuracy"],
        "greedy_accuracy_before": state["before"]["eval/greedy_accuracy"], "greedy_accuracy_after": last["eval/greedy_accuracy"],
        "steps": t.total_steps, "wall_seconds": time.perf_counter() - t_start, "run_dir": str(run_dir),
        "warm_start": warm, "resumed_from_step": found[1]["step"] if found else None,
    }
    write_summary(run_dir, summary)
    write_report(run_dir, title=f"{t.name}: {cfg.algorithm.advantage} / {cfg.algorithm.policy_loss} on {cfg.task.name}")
    return summary
