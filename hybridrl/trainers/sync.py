"""The synchronous RL driver: one plain loop over the roles (docs/architecture.md §1).

Every step: generate and score -> reference log-probs -> old log-probs ->
(values) -> token-level rewards -> advantages -> (critic update) -> policy
update -> weight sync (``trainers/learn.py`` holds the middle part, shared with
the asynchronous learner). Which algorithm runs is decided by registries
(``algorithm.advantage``, ``algorithm.policy_loss``, ``algorithm.loss_agg``),
never by branches here; the critic exists only when the estimator needs values.
"""

from __future__ import annotations

from tqdm import tqdm

from hybridrl.config import Config
from hybridrl.trainers.checkpoint import save_checkpoint
from hybridrl.trainers.collect import collect
from hybridrl.trainers.learn import learn
from hybridrl.trainers.metrics import batch_metrics
from hybridrl.trainers.session import open_session
from hybridrl.trainers.shaping import RewardShaper


def train(cfg: Config, resume: bool = False) -> dict:
    s = open_session(cfg, resume)
    t, roles, timer, state = cfg.trainer, s.roles, s.timer, s.state
    shape = RewardShaper(cfg.algorithm, cfg.rollout.max_new_tokens, state.get("kl_reward_coef"))
    last, cursor = dict(state.get("last", state["before"])), state["prompt_cursor"]
    bar = tqdm(
        range(state["step"], t.total_steps),
        initial=state["step"],
        total=t.total_steps,
        desc=cfg.algorithm.advantage,
        disable=not t.progress,
        dynamic_ncols=True,
    )
    try:
        for step in bar:
            batch, cursor, metrics = collect(
                roles, s.task, s.tokenizer, cfg, s.params, cursor, seed=t.seed + step, timer=timer
            )
            batch, learned = learn(
                roles.actor, roles.reference, roles.critic, batch, shape, cfg, timer
            )
            with timer.phase("weight_sync"):
                roles.sync_weights(step + 1)
            metrics |= learned | batch_metrics(batch) | roles.rollout.stats()
            done = step + 1
            if s.due(t.eval_every, done):
                with timer.phase("eval"):
                    last = s.evaluate()
                metrics |= last
            s.logger.log(done, metrics | timer.pop())
            bar.set_postfix(
                reward=f"{metrics['reward/mean']:.3f}", acc=f"{last['eval/accuracy']:.3f}"
            )
            if s.due(t.save_every, done):
                save_checkpoint(
                    s.run_dir,
                    done,
                    roles,
                    state
                    | {
                        "step": done,
                        "last": last,
                        "prompt_cursor": cursor,
                        "kl_reward_coef": shape.kl.value,
                    },
                    cfg,
                )
    finally:  # a failed step still leaves the metrics flushed and the workers stopped
        s.logger.close()
        roles.shutdown()
    return s.close(last)
