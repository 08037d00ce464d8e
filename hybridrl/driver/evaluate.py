"""The held-out evaluation: the task's fixed held-out prompts, generated and scored on the rollout
ranks (before training, every ``trainer.eval_every`` steps, after, and ``hybridrl eval``).

Each evaluation draws ``eval.n`` samples per prompt with the evaluation's sampling settings
(``eval.temperature``, ``top_p``, ``max_new_tokens``; null: the rollout's) and one greedy sample,
and reports (:func:`eval_metrics`):

* ``eval/accuracy``: the mean reward of the sampled responses (mean@n; exact match: the fraction
  answered correctly), ``eval/greedy_accuracy`` the greedy one's;
* ``eval/reward_binary``: 1 where every reward was 0 or 1, when the mean is an accuracy (the
  report's titles and ``summary.json``'s ``eval_metric`` say "mean reward" otherwise);
* with such rewards and ``eval.n`` > 1, ``eval/pass@k`` for k = 1, 2, 4, ... and n: the chance that
  at least one of k samples is right, by the unbiased estimator 1 - C(n - c, k) / C(n, k) over the n
  drawn (c of them right), averaged over prompts (Chen et al. 2021); and ``eval/maj@k`` for k > 1:
  whether the most frequent final answer of k samples is right (:func:`final_answer`: the last
  ``\\boxed{}``, else the last number, else the response), averaged over the n / k disjoint runs
  of k samples a prompt has and over prompts (self-consistency, Wang et al. 2022);
* with prompts from more than one source (a dataset's ``data_source`` column, a task mix),
  ``eval/source/<name>/accuracy`` for each.

``eval.save_generations`` writes the samples to ``<run>/eval/step_<N>.jsonl``; ``hybridrl generate``
writes them for any prompts (:func:`evaluate_checkpoint`).
:func:`model_accuracy` measures the mean reward for a model in this process (the warm start's
stopping check).
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

from hybridrl.protocol import prompt_sample
from hybridrl.rollout import ROLLOUT_BACKENDS, SamplingParams
from hybridrl.tasks import Prompt

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")  # 1,234.5 -> 1234.5 (a vote's key)


def mean_reward(samples) -> float:
    return sum(s.reward for s in samples) / max(len(samples), 1)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The chance that at least one of k samples drawn from n (c of them right) is right."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def final_answer(response: str) -> str:
    """What a response answers, for a vote: the content of its last ``\\boxed{}``, else its last
    number, else the whole response stripped."""
    boxed = response.rfind("\\boxed{")
    if boxed >= 0:
        depth, start = 0, boxed + len("\\boxed{")
        for i in range(start, len(response)):
            depth += {"{": 1, "}": -1}.get(response[i], 0)
            if depth < 0:
                return response[start:i].strip()
    numbers = NUMBER.findall(response)
    return numbers[-1].replace(",", "") if numbers else response.strip()


def majority_right(rewards: list[float], answers: list[str], k: int) -> float:
    """maj@k of one prompt's samples (their rewards and final answers, in order): over its disjoint
    runs of ``k`` samples, the fraction whose most frequent final answer (ties: the one seen first)
    was scored right."""
    right, runs = 0, range(0, len(answers) - k + 1, k)
    for start in runs:
        keys = answers[start : start + k]
        top = max(keys, key=lambda a: (keys.count(a), -keys.index(a)))
        right += rewards[start + keys.index(top)] == 1
    return right / len(runs)


def eval_metrics(prompts, sampled, greedy, n: int, answers=None) -> dict[str, float]:
    """The metrics of the module docstring; ``sampled``: ``n`` scored samples per prompt in prompt
    order, ``greedy`` one; ``answers``: each sampled response's :func:`final_answer`, in the same
    order (None: no maj@k)."""
    rewards = [s.reward for s in sampled + greedy]
    binary = all(r in (0, 1) for r in rewards)
    out = {
        "eval/accuracy": mean_reward(sampled),
        "eval/greedy_accuracy": mean_reward(greedy),
        "eval/reward_binary": float(binary),
    }
    groups = [sampled[i * n : (i + 1) * n] for i in range(len(prompts))]
    if binary and n > 1:
        right = [sum(int(s.reward) for s in g) for g in groups]
        for k in sorted({*(2**j for j in range(n.bit_length()) if 2**j <= n), n}):
            out[f"eval/pass@{k}"] = sum(pass_at_k(n, c, k) for c in right) / len(right)
            if k > 1 and answers is not None:
                votes = [
                    majority_right([s.reward for s in g], answers[i * n : (i + 1) * n], k)
                    for i, g in enumerate(groups)
                ]
                out[f"eval/maj@{k}"] = sum(votes) / len(votes)
    by_source = defaultdict(list)
    for p, g in zip(prompts, groups):
        by_source[p.task_id].extend(s.reward for s in g)
    if len(by_source) > 1:
        for source, rs in sorted(by_source.items()):
            out[f"eval/source/{source}/accuracy"] = sum(rs) / len(rs)
    return out


class Evaluator:
    """``evaluate(step)``: the metrics of one evaluation; its samples written under ``save_dir``
    (None: not written)."""

    def __init__(
        self,
        rollout,
        prompts: list[Prompt],
        tokenizer,
        params: SamplingParams,
        seed: int,
        n: int = 1,
        save_dir: str | Path | None = None,
    ):
        self.rollout, self.seed, self.n, self.tokenizer = rollout, seed, n, tokenizer
        self.prompts = [prompt_sample(p, tokenizer) for p in prompts]
        self.params = replace(params, n=1)
        self.save_dir = None if save_dir is None else Path(save_dir)

    @classmethod
    def of(cls, cfg, rollout, prompts, tokenizer, save_dir=None) -> Evaluator:
        """The evaluation a config asks for (``eval`` section over the rollout's sampling)."""
        e = cfg.eval
        params = SamplingParams.of(cfg)  # data.stop too
        overrides = dict(temperature=e.temperature, top_p=e.top_p, max_new_tokens=e.max_new_tokens)
        params = replace(params, **{k: v for k, v in overrides.items() if v is not None})
        save = save_dir if e.save_generations else None
        return cls(rollout, prompts, tokenizer, params, cfg.trainer.seed + 10_000, e.n, save)

    def __call__(self, step: int | None = None) -> dict[str, float]:
        metrics, sampled, greedy = self.run()
        if self.save_dir is not None and step is not None:
            self.save_dir.mkdir(parents=True, exist_ok=True)
            self.write(self.save_dir / f"step_{step:06d}.jsonl", sampled, greedy)
        return metrics

    def run(self) -> tuple[dict[str, float], list, list]:
        """(metrics, the sampled samples, the greedy ones) of one evaluation; no prompts (no
        held-out data): null figures, nothing generated."""
        if not self.prompts:
            return dict.fromkeys(("eval/accuracy", "eval/greedy_accuracy"), math.nan), [], []
        draw = replace(self.params, n=self.n, seed=self.seed)
        sampled = self.rollout.generate(self.prompts, draw)
        greedy = self.rollout.generate(self.prompts, replace(self.params, temperature=0.0))
        prompts = [p.metadata["prompt"] for p in self.prompts]
        answers = None
        if self.tokenizer is not None:
            answers = [final_answer(self.tokenizer.decode(s.response_ids)) for s in sampled]
        return eval_metrics(prompts, sampled, greedy, self.n, answers), sampled, greedy

    def write(self, path: Path, sampled, greedy) -> None:
        """One line per prompt: uid, source, prompt, answer, the n responses with their rewards,
        the greedy response with its reward."""

        def text(s):
            return self.tokenizer.decode(s.response_ids) if self.tokenizer else s.response_ids

        with open(path, "w", encoding="utf-8") as f:
            for i, p in enumerate(self.prompts):
                prompt, group = p.metadata["prompt"], sampled[i * self.n : (i + 1) * self.n]
                row = {
                    "uid": prompt.uid,
                    "source": prompt.task_id,
                    "prompt": prompt.text,
                    "answer": prompt.answer,
                    "responses": [text(s) for s in group],
                    "rewards": [s.reward for s in group],
                    "greedy": text(greedy[i]),
                    "greedy_reward": greedy[i].reward,
                }
                f.write(json.dumps(row, ensure_ascii=False) + "\n")


def model_accuracy(
    model, tokenizer, prompts: list[Prompt], scorer, params: SamplingParams, cfg=None
) -> float:
    """Mean reward of one sample per prompt from ``model`` as it is now (warm-start accuracy check).

    Generates with the ``hf`` rollout backend, which reads the live weights (no copy, no cache kept
    between calls) and seeds each call from ``params.seed`` without touching the caller's RNG
    stream; scored by ``scorer`` (the rollout's :class:`~hybridrl.rollout.scoring.Scorer`), as the
    RL evaluation is. With ``cfg`` naming an environment (``env.name``), each sample is a whole
    episode, the model's turns and the environment's answers, as the RL rollout runs it: a task
    whose skill is to use a tool is measured using it. So does an episode of ``rollout.episode``.
    Restores train mode.
    """
    from hybridrl.rollout.episode import with_episode

    was_training = model.training
    engine = ROLLOUT_BACKENDS.get("hf")(model, tokenizer)  # puts the model in eval mode
    episodes = cfg is not None and (cfg.env.name is not None or cfg.rollout.episode is not None)
    if episodes:
        engine = with_episode(cfg, engine, tokenizer)
    try:
        samples = engine.generate(
            [prompt_sample(p, tokenizer) for p in prompts], replace(params, n=1)
        )
        return mean_reward(scorer(samples))
    finally:
        if episodes:
            engine.close()  # the environment calls' event loop
        model.train(was_training)


def evaluate_checkpoint(cfg, output: str | None = None, train: int | None = None) -> dict:
    """``hybridrl eval``: the evaluation of the checkpoint RL would start from (warm start or
    ``model.path``), the same metrics as a run's. ``hybridrl generate`` too, which writes the
    samples to ``output`` (one line per prompt) and with ``train`` takes the first that many
    training prompts instead of the held-out ones."""
    from hybridrl.driver.placement import build_roles
    from hybridrl.driver.sft import ensure_warm_start
    from hybridrl.models.loading import load_tokenizer, make_task

    path = ensure_warm_start(cfg, cfg.trainer.progress)
    task = make_task(cfg)
    prompts = (
        [task.prompt(i) for i in range(train)] if train else task.heldout()[: cfg.task.eval_size]
    )
    roles = build_roles(cfg, path, path, learner=False)
    try:
        evaluate = Evaluator.of(cfg, roles.rollout, prompts, load_tokenizer(cfg, path))
        metrics, sampled, greedy = evaluate.run()
        if output is not None:
            Path(output).parent.mkdir(parents=True, exist_ok=True)
            evaluate.write(Path(output), sampled, greedy)
        return metrics
    finally:
        roles.shutdown()
