"""Held-out accuracy: the task's fixed held-out prompts, scored by the reward role.

``sampled`` draws at the rollout temperature (the distribution RL trains);
``greedy`` takes the argmax. Accuracy is the mean reward (exact match: the
fraction answered correctly). :func:`model_accuracy` measures the same for a model in this process
(the warm start's stopping check).
"""

from __future__ import annotations

from dataclasses import replace

from hybridrl.protocol import Batch, samples_to_batch
from hybridrl.rollout import SamplingParams
from hybridrl.tasks import Prompt


def prompt_batch(prompts: list[Prompt], tokenizer) -> Batch:
    """Meta ``prompt`` and ``prompt_ids`` (the tokenizer adds ``<bos>`` where it has one)."""
    return Batch(
        meta={"prompt": prompts, "prompt_ids": [tokenizer(p.text)["input_ids"] for p in prompts]}
    )


def collate(parts: list, pad_id: int) -> Batch:
    """Samples from every rollout rank into one training batch."""
    return samples_to_batch([s for part in parts for s in part], pad_id)


class Evaluator:
    def __init__(self, roles, prompts: list[Prompt], tokenizer, params: SamplingParams, seed: int):
        self.roles, self.tokenizer, self.seed = roles, tokenizer, seed
        self.batch = prompt_batch(prompts, tokenizer)
        self.params = replace(params, n=1)

    def accuracy(self, greedy: bool) -> float:
        params = (
            replace(self.params, temperature=0.0)
            if greedy
            else replace(self.params, seed=self.seed)
        )
        batch = collate(
            self.roles.rollout.generate(self.batch, params), self.tokenizer.pad_token_id
        )
        return self.roles.reward.score(batch)["rewards"].mean().item()

    def __call__(self) -> dict[str, float]:
        return {
            "eval/accuracy": self.accuracy(greedy=False),
            "eval/greedy_accuracy": self.accuracy(greedy=True),
        }


def model_accuracy(
    model, tokenizer, prompts: list[Prompt], scorer, params: SamplingParams
) -> float:
    """Mean reward of one sample per prompt from ``model`` as it is now (the warm start's accuracy check).

    Generates with the ``hf`` rollout backend, which reads the live weights (no copy, no cache kept between
    calls) and seeds each call from ``params.seed`` without touching the caller's RNG stream; scored by the
    reward role's :class:`~hybridrl.workers.reward.Scorer`, as the RL evaluation is. Restores train mode.
    """
    from hybridrl.rollout import ROLLOUT_BACKENDS, GenerationRequest

    was_training = model.training
    try:
        engine = ROLLOUT_BACKENDS.get("hf")(model, tokenizer)  # puts the model in eval mode
        batch = prompt_batch(prompts, tokenizer)
        requests = [
            GenerationRequest(
                request_id=p.uid, prompt_ids=ids, uid=p.uid, task_id=p.task_id, extra={"prompt": p}
            )
            for p, ids in zip(batch["prompt"], batch["prompt_ids"])
        ]
        samples = engine.generate(requests, replace(params, n=1))
        return scorer(collate([samples], tokenizer.pad_token_id))["rewards"].mean().item()
    finally:
        model.train(was_training)


def evaluate_checkpoint(cfg) -> dict[str, float]:
    """``hybridrl eval``: accuracy of the checkpoint RL would start from (warm start or ``model.path``)."""
    from hybridrl.trainers.roles import build_roles
    from hybridrl.trainers.sft import ensure_warm_start
    from hybridrl.workers.common import load_tokenizer, make_task

    path = ensure_warm_start(cfg, cfg.trainer.progress)
    roles = build_roles(cfg, path, path)
    try:
        params = SamplingParams(
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            top_k=cfg.rollout.top_k,
            max_new_tokens=cfg.rollout.max_new_tokens,
        )
        prompts = make_task(cfg).heldout()[: cfg.task.eval_size]
        return Evaluator(
            roles, prompts, load_tokenizer(cfg, path), params, seed=cfg.trainer.seed + 10_000
        )()
    finally:
        roles.shutdown()
