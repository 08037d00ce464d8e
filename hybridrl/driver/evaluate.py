"""Held-out accuracy: the task's fixed held-out prompts, generated and scored on the rollout ranks.

``sampled`` draws at the rollout temperature (the distribution RL trains); ``greedy`` takes the
argmax. Accuracy is the mean reward (exact match: the fraction answered correctly); where a reward
takes values other than 0 and 1 it is a mean reward, and ``eval/reward_binary`` (1 or 0) says which,
for the report's titles and ``summary.json``'s ``eval_metric``.
:func:`model_accuracy` measures the same for a model in this process (the warm start's stopping
check).
"""

from __future__ import annotations

from dataclasses import replace

from hybridrl.protocol import prompt_sample
from hybridrl.rollout import ROLLOUT_BACKENDS, SamplingParams
from hybridrl.tasks import Prompt


def mean_reward(samples) -> float:
    return sum(s.reward for s in samples) / max(len(samples), 1)


class Evaluator:
    def __init__(
        self, rollout, prompts: list[Prompt], tokenizer, params: SamplingParams, seed: int
    ):
        self.rollout, self.seed = rollout, seed
        self.prompts = [prompt_sample(p, tokenizer) for p in prompts]
        self.params = replace(params, n=1)

    def scored(self, greedy: bool) -> list:
        params = (
            replace(self.params, temperature=0.0)
            if greedy
            else replace(self.params, seed=self.seed)
        )
        return self.rollout.generate(self.prompts, params)

    def __call__(self) -> dict[str, float]:
        sampled, greedy = self.scored(greedy=False), self.scored(greedy=True)
        binary = all(s.reward in (0, 1) for s in sampled + greedy)
        return {
            "eval/accuracy": mean_reward(sampled),
            "eval/greedy_accuracy": mean_reward(greedy),
            "eval/reward_binary": float(binary),
        }


def model_accuracy(
    model, tokenizer, prompts: list[Prompt], scorer, params: SamplingParams, cfg=None
) -> float:
    """Mean reward of one sample per prompt from ``model`` as it is now (warm-start accuracy check).

    Generates with the ``hf`` rollout backend, which reads the live weights (no copy, no cache kept
    between calls) and seeds each call from ``params.seed`` without touching the caller's RNG
    stream; scored by ``scorer`` (the rollout's :class:`~hybridrl.rollout.scoring.Scorer`), as the
    RL evaluation is. With ``cfg`` naming an environment (``env.name``), each sample is a whole
    episode, the model's turns and the environment's answers, as the RL rollout runs it: a task
    whose skill is to use a tool is measured using it. Restores train mode.
    """
    from hybridrl.rollout.multiturn import with_environment

    was_training = model.training
    engine = ROLLOUT_BACKENDS.get("hf")(model, tokenizer)  # puts the model in eval mode
    episodes = cfg is not None and cfg.env.name is not None
    if episodes:
        engine = with_environment(cfg, engine, tokenizer)
    try:
        samples = engine.generate(
            [prompt_sample(p, tokenizer) for p in prompts], replace(params, n=1)
        )
        return mean_reward(scorer(samples))
    finally:
        if episodes:
            engine.close()  # the environment calls' event loop
        model.train(was_training)


def evaluate_checkpoint(cfg) -> dict[str, float]:
    """``hybridrl eval``: accuracy of the checkpoint RL would start from (warm start or
    ``model.path``)."""
    from hybridrl.driver.placement import build_roles
    from hybridrl.driver.sft import ensure_warm_start
    from hybridrl.models.loading import load_tokenizer, make_task

    path = ensure_warm_start(cfg, cfg.trainer.progress)
    roles = build_roles(cfg, path, path, learner=False)
    try:
        params = SamplingParams.of(cfg)  # data.stop too
        prompts = make_task(cfg).heldout()[: cfg.task.eval_size]
        return Evaluator(
            roles.rollout,
            prompts,
            load_tokenizer(cfg, path),
            params,
            seed=cfg.trainer.seed + 10_000,
        )()
    finally:
        roles.shutdown()
