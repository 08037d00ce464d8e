"""Rollout collection for one synchronous step: generate and score (on the rollout ranks); with DAPO
dynamic sampling (``algorithm.filter_groups``) keep only groups whose rewards differ and sample more
prompts until the step has ``prompts_per_step`` groups or ``max_sampling_rounds`` is reached. The
prompt-stream position is explicit state, so a resumed run continues the stream exactly. The prompts
come from a :class:`~hybridrl.data.prefetch.PromptPrefetcher`, which prepares the next round's on a
background thread while this one generates (the same prompts, in the same order). A step is cut by
groups, never by rows: a multi-turn trajectory split into parts (docs/agentic.md) gives its group
more than ``samples_per_prompt`` samples.

An advantage estimator with ``needs_greedy_baseline = True`` (ReMax) also gets one greedy response
per prompt, generated and scored like the samples but never trained on: only its reward reaches the
samples, as ``reward_extras["baseline_rewards"]``. What is generated is decided by that attribute,
not by a name. Both rules are the group hooks the asynchronous stream applies too
(``rollout/group_hooks.py``).
"""

from __future__ import annotations

from dataclasses import replace

from hybridrl.algorithms.advantages import group_rows
from hybridrl.config import Config
from hybridrl.data.prefetch import PromptPrefetcher
from hybridrl.protocol import Sample
from hybridrl.rollout import SamplingParams
from hybridrl.rollout.group_hooks import differs, needs_greedy_baseline, set_baselines


def groups_of(samples: list[Sample]) -> list[list[Sample]]:
    """The samples grouped by prompt (uid), groups in order of first appearance. A group holds
    every sample of its prompt: ``samples_per_prompt`` of them, more where a multi-turn trajectory
    was split into parts."""
    return [[samples[i] for i in g] for g in group_rows([s.uid for s in samples])]


def add_greedy_baselines(
    rollout, prompts: list[Sample], samples: list[Sample], cfg: Config, params
) -> None:
    """The greedy baselines of a step's prompts, in one call (``rollout/group_hooks.py``)."""
    greedy = rollout.generate(prompts, replace(params, n=1, temperature=0.0))
    set_baselines(samples, greedy, cfg)


def collect(
    rollout, task, tokenizer, cfg: Config, params: SamplingParams, cursor: int, seed: int, timer
):
    """(scored samples, new prompt cursor, metrics); time goes to the ``rollout`` and ``baseline``
    phases. ``task``: the task, or a :class:`PromptPrefetcher` over it (kept across steps)."""
    t, alg = cfg.trainer, cfg.algorithm
    source = task if isinstance(task, PromptPrefetcher) else PromptPrefetcher(task, tokenizer, 0)
    target = t.prompts_per_step  # whole groups: a split trajectory adds samples to its group
    kept: list[list[Sample]] = []  # informative groups, then the rest as filler
    filler: list[list[Sample]] = []
    rounds = alg.max_sampling_rounds if alg.filter_groups else 1
    for rnd in range(rounds):
        prompts = source.take(cursor, t.prompts_per_step)
        cursor += t.prompts_per_step
        with timer.phase("rollout"):
            new = rollout.generate(prompts, replace(params, seed=seed * 1000 + rnd))
        if needs_greedy_baseline(cfg):
            with timer.phase("baseline"):
                add_greedy_baselines(rollout, prompts, new, cfg, params)
        for group in groups_of(new):
            (kept if differs(group) or not alg.filter_groups else filler).append(group)
        if len(kept) >= target:
            break
    # the cap was hit: fill with uninformative groups (zero advantage), so all steps have one shape
    chosen = (kept + filler)[:target]
    samples = [s for group in chosen for s in group]
    metrics = {
        "rollout/sampling_rounds": rnd + 1,
        "rollout/informative_frac": min(len(kept), target) / max(len(chosen), 1),
    }
    if needs_greedy_baseline(cfg):
        metrics["reward/greedy_baseline_mean"] = sum(
            s.reward_extras["baseline_rewards"] for s in samples
        ) / len(samples)
    return samples, cursor, metrics
