"""Rollout collection for one step: generate and score; with DAPO dynamic sampling
(``algorithm.filter_groups``) keep only groups whose rewards differ and sample more prompts until
the step has ``prompts_per_step`` groups or ``max_sampling_rounds`` is reached. The prompt-stream
position is explicit state, so a resumed run continues the stream exactly.

An advantage estimator with ``needs_greedy_baseline = True`` (ReMax) also gets one greedy response per
prompt, generated and scored like the samples but never trained on: only its reward reaches the batch, as
the per-row ``baseline_rewards`` column. What is generated is decided by that attribute, not by a name.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import torch

from hybridrl.algorithms import ADVANTAGES
from hybridrl.config import Config
from hybridrl.protocol import Batch, samples_to_batch
from hybridrl.rollout import SamplingParams
from hybridrl.trainers.evaluate import prompt_batch
from hybridrl.trainers.shaping import overlong_penalty


def informative_rows(uids: list, rewards) -> list[int]:
    """Rows of the groups whose rewards are not all equal (equal rewards give zero group advantage)."""
    rows: dict = defaultdict(list)
    for i, uid in enumerate(uids):
        rows[uid].append(i)
    return [
        i
        for idx in rows.values()
        if len(idx) > 1 and len(set(rewards[idx].tolist())) > 1
        for i in idx
    ]


def needs_greedy_baseline(cfg: Config) -> bool:
    return getattr(ADVANTAGES.get(cfg.algorithm.advantage), "needs_greedy_baseline", False)


def greedy_baselines(roles, prompts: Batch, tokenizer, cfg: Config, params: SamplingParams) -> dict:
    """uid -> reward of one greedy (temperature 0) response to that prompt.

    The reward is the one the samples get before the KL penalty: the reward role's score plus the soft
    overlong penalty, so that r_i - baseline compares like with like.
    """
    greedy = replace(params, n=1, temperature=0.0)
    samples = [s for part in roles.rollout.generate(prompts, greedy) for s in part]
    batch = samples_to_batch(samples, tokenizer.pad_token_id)
    alg = cfg.algorithm
    penalty = overlong_penalty(
        batch["response_mask"].sum(-1),
        cfg.rollout.max_new_tokens,
        alg.overlong_buffer,
        alg.overlong_penalty,
    )
    rewards = roles.reward.score(batch)["rewards"].float() + penalty
    return dict(zip([s.uid for s in samples], rewards.tolist()))


def collect(
    roles, task, tokenizer, cfg: Config, params: SamplingParams, cursor: int, seed: int, timer
) -> tuple[Batch, int, dict]:
    """(scored batch, new prompt cursor, metrics); time goes to the ``rollout`` and ``reward`` phases of ``timer``."""
    t, alg = cfg.trainer, cfg.algorithm
    target = t.prompts_per_step * t.samples_per_prompt
    kept: list = []  # (sample, one-row scored batch) of informative groups, then the rest as filler
    filler: list = []
    rounds = alg.max_sampling_rounds if alg.filter_groups else 1
    baseline = needs_greedy_baseline(cfg)
    for rnd in range(rounds):
        prompts = prompt_batch(
            [task.prompt(cursor + i) for i in range(t.prompts_per_step)], tokenizer
        )
        cursor += t.prompts_per_step
        with timer.phase("rollout"):
            new = [
                s
                for part in roles.rollout.generate(prompts, replace(params, seed=seed * 1000 + rnd))
                for s in part
            ]
        with timer.phase("reward"):
            scored = roles.reward.score(samples_to_batch(new, tokenizer.pad_token_id))
        if baseline:
            with timer.phase("baseline"):
                by_uid = greedy_baselines(roles, prompts, tokenizer, cfg, params)
            scored = scored | Batch(
                {"baseline_rewards": torch.tensor([by_uid[s.uid] for s in new])}
            )
        rows = (
            informative_rows([s.uid for s in new], scored["rewards"])
            if alg.filter_groups
            else list(range(len(new)))
        )
        other = sorted(set(range(len(new))) - set(rows))
        kept += [(new[i], scored.index([i])) for i in rows]
        filler += [(new[i], scored.index([i])) for i in other]
        if len(kept) >= target:
            break
    informative = min(len(kept), target)
    # the cap was hit: fill with uninformative groups (zero advantage) so every step has the same shape
    chosen = (kept + filler)[:target]
    batch = samples_to_batch([s for s, _ in chosen], tokenizer.pad_token_id) | Batch.concat(
        [b for _, b in chosen]
    )
    metrics = {
        "rollout/sampling_rounds": rnd + 1,
        "rollout/informative_frac": informative / max(len(batch), 1),
    }
    if baseline:
        metrics["reward/greedy_baseline_mean"] = batch["baseline_rewards"].mean().item()
    return batch, cursor, metrics
