"""The synchronous RL driver: one plain loop over the roles (GUIDE.md §1).

Every step: generate -> score -> reference log-probs -> old log-probs ->
advantages -> policy update -> weight sync. Which algorithm runs is decided
by registries (``algorithm.advantage``, ``algorithm.policy_loss``), never by
branches here.
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace

from tqdm import tqdm

from hybridrl.algorithms import compute_advantages
from hybridrl.config import Config
from hybridrl.rollout import SamplingParams
from hybridrl.telemetry import MetricsLogger, PhaseTimer, write_report
from hybridrl.trainers.checkpoint import latest_checkpoint, save_checkpoint
from hybridrl.trainers.evaluate import Evaluator, collate, prompt_batch
from hybridrl.trainers.metrics import batch_metrics, mean_over_ranks
from hybridrl.trainers.roles import build_roles
from hybridrl.trainers.run_dir import open_run_dir, run_path, write_summary
from hybridrl.trainers.sft import ensure_warm_start
from hybridrl.workers.common import load_tokenizer, make_task

log = logging.getLogger(__name__)


def train(cfg: Config, resume: bool = False) -> dict:
    t_start, t = time.perf_counter(), cfg.trainer
    warm = ensure_warm_start(cfg, t.progress)
    found = latest_checkpoint(run_path(cfg)) if resume else None
    if resume and not found:
        log.warning("--resume: no complete checkpoint under %s, starting a fresh run", run_path(cfg))
    run_dir = open_run_dir(cfg, resume=found is not None)
    state = found[1] if found else {"step": 0, "reference_path": warm}
    policy_path = str(found[0] / "model") if found else warm
    task, tokenizer = make_task(cfg), load_tokenizer(cfg, warm)
    roles = build_roles(cfg, policy_path, state["reference_path"])
    if found:
        roles.actor.load_state(str(found[0]))
        roles.rollout.update_weights(roles.actor.weight_buckets(), state["step"])
    params = SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                            max_new_tokens=cfg.rollout.max_new_tokens, n=t.samples_per_prompt)
    evaluate = Evaluator(roles, task.heldout()[: cfg.task.eval_size], tokenizer, params, seed=t.seed + 10_000)
    logger = MetricsLogger(run_dir, t.tensorboard, resume_step=state["step"] if found else None)
    timer = PhaseTimer()
    if "before" not in state:
        with timer.phase("eval"):
            state["before"] = evaluate()
        logger.log(0, state["before"])
    last = dict(state.get("last", state["before"]))
    bar = tqdm(range(state["step"], t.total_steps), initial=state["step"], total=t.total_steps, desc="GRPO", disable=not t.progress, dynamic_ncols=True)
    timer.pop()
    for step in bar:
        prompts = prompt_batch([task.prompt(step * t.prompts_per_step + i) for i in range(t.prompts_per_step)], tokenizer)
        with timer.phase("rollout"):
            batch = collate(roles.rollout.generate(prompts, replace(params, seed=t.seed + step)), tokenizer.pad_token_id)
        with timer.phase("reward"):
            batch |= roles.reward.score(batch)
        with timer.phase("reference"):
            batch |= roles.reference.compute_ref_log_prob(batch)
        with timer.phase("old_log_prob"):
            batch |= roles.actor.compute_log_prob(batch)
        with timer.phase("advantage"):
            batch = compute_advantages(batch, cfg.algorithm)
        with timer.phase("update"):
            metrics = mean_over_ranks(roles.actor.update_policy(batch))
        with timer.phase("weight_sync"):
            roles.rollout.update_weights(roles.actor.weight_buckets(), step + 1)
        metrics |= batch_metrics(batch) | roles.rollout.stats()
        done = step + 1
        if (t.eval_every and done % t.eval_every == 0) or done == t.total_steps:
            with timer.phase("eval"):
                last = evaluate()
            metrics |= last
        logger.log(done, metrics | timer.pop())
        bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", acc=f"{last['eval/accuracy']:.3f}")
        if (t.save_every and done % t.save_every == 0) or done == t.total_steps:
            save_checkpoint(run_dir, done, roles.actor, state | {"step": done, "last": last}, cfg)
    logger.close()
    roles.shutdown()
    summary = {
        "accuracy_before": state["before"]["eval/accuracy"], "accuracy_after": last["eval/accuracy"],
        "greedy_accuracy_before": state["before"]["eval/greedy_accuracy"], "greedy_accuracy_after": last["eval/greedy_accuracy"],
        "steps": t.total_steps, "wall_seconds": time.perf_counter() - t_start, "run_dir": str(run_dir),
        "warm_start": warm, "resumed_from_step": found[1]["step"] if found else None,
    }
    write_summary(run_dir, summary)
    write_report(run_dir, title=f"{t.name}: {cfg.algorithm.advantage} on {cfg.task.name}")
    return summary
