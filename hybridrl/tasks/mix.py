"""Several registered tasks in one run (``task.mix``: task name -> mixing weight).

Prompt ``index`` comes from the task drawn for it, with probabilities proportional to the weights,
by a generator seeded from ``(seed, index)`` alone: the stream is a pure function of the index, so a
resumed run continues it exactly. The drawn task's own prompt ``index`` is used (each task's stream
is a pure function of its index too); uids stay unique because every task names its prompts with
its own prefix. The held-out set is every task's held-out set (``heldout_size`` split over the
tasks by weight, at least one each), so ``eval/accuracy`` is their prompt-weighted mean; the
samples keep their ``task_id``, which the metrics (``reward/task/<id>``) and the task-level
advantage normalisation (``algorithm.task_norm``) group by.

The tasks must share one tokenizer, or all use the built-in character tokenizer (then the mix uses
one with the union of their characters). The default
reward is ``task_default``: each prompt scored by its own task's default reward.
"""

from __future__ import annotations

import bisect
import itertools

from transformers import PreTrainedTokenizerFast

from hybridrl.tasks.arithmetic import _rng
from hybridrl.tasks.base import REWARDS, TASKS, Prompt, Task, compute_reward
from hybridrl.tasks.tokenizer import SPECIAL_TOKENS, W1_CHARS, build_char_tokenizer


class MixedTask(Task):
    name = "mix"
    default_reward = "task_default"

    def __init__(self, mix: dict[str, float], seed: int = 0, heldout_size: int = 1024):
        if len(mix) < 2:
            raise ValueError(f"task.mix needs at least two tasks, got {sorted(mix)}")
        bad = {k: w for k, w in mix.items() if not w > 0}
        if bad:
            raise ValueError(f"task.mix weights must be > 0, got {bad}")
        total = sum(mix.values())
        self.names = list(mix)
        self.cumulative = list(itertools.accumulate(w / total for w in mix.values()))
        self.tasks = {
            name: TASKS.get(name)(seed=seed, heldout_size=max(1, round(heldout_size * w / total)))
            for name, w in mix.items()
        }
        self.seed = seed
        self._tokenizer = _shared_tokenizer({n: t.tokenizer() for n, t in self.tasks.items()})

    def _draw(self, kind: str, index: int) -> Task:
        u = _rng("mix", kind, self.seed, index).random()
        i = min(bisect.bisect_right(self.cumulative, u), len(self.names) - 1)
        return self.tasks[self.names[i]]

    def prompt(self, index: int) -> Prompt:
        return self._draw("train", index).prompt(index)

    def heldout(self) -> list[Prompt]:
        return [p for t in self.tasks.values() for p in t.heldout()]

    def sft_example(self, index: int) -> tuple[str, str]:
        return self._draw("sft", index).sft_example(index)

    def tokenizer(self) -> PreTrainedTokenizerFast:
        return self._tokenizer


def _shared_tokenizer(tokenizers: dict[str, PreTrainedTokenizerFast]) -> PreTrainedTokenizerFast:
    """One tokenizer for every task of the mix: theirs when all are the same; when all are the
    built-in character tokenizer with different extra characters (reverse adds ``r:``), one with
    the union of their characters (prompts are text, encoded with the mix's tokenizer). Anything
    else is an error."""
    vocabs = {n: tok.get_vocab() for n, tok in tokenizers.items()}
    first = next(iter(vocabs))
    if all(v == vocabs[first] for v in vocabs.values()):
        return tokenizers[first]
    base = set(SPECIAL_TOKENS) | set(W1_CHARS)
    extras = [sorted(set(v) - base, key=v.get) for v in vocabs.values()]
    if all(base <= set(v) for v in vocabs.values()) and all(len(c) == 1 for e in extras for c in e):
        return build_char_tokenizer("".join(dict.fromkeys(c for e in extras for c in e)))
    raise ValueError(
        f"task.mix: the tasks {sorted(vocabs)} use different tokenizers; the tasks of a mix must "
        "share one (or all use the built-in character tokenizer)"
    )


@REWARDS.register("task_default")
def task_default(prompt: Prompt, response: str, *, finished: bool = True):
    """The default reward of the task that made ``prompt`` (its ``task_id``), e.g. exact match for
    arith and reverse."""
    fn = REWARDS.get(TASKS.get(prompt.task_id).default_reward)
    score, extras = compute_reward(fn, prompt, response, finished=finished)
    return {"score": score, **extras}
