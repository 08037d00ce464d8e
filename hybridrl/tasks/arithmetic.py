"""W1: addition of two integers, scored by exact match.

Prompt ``"a+b="`` (the model sees ``<bos>`` first), a and b uniform integers
in ``[0, max_operand]``; the answer is ``str(a + b)`` followed by ``<eos>``.
"""

from __future__ import annotations

import hashlib
import random

from transformers import PreTrainedTokenizerFast

from hybridrl.tasks.base import REWARDS, TASKS, Prompt, Task
from hybridrl.tasks.tokenizer import build_char_tokenizer


def _rng(*key: object) -> random.Random:
    """A generator seeded from ``key`` alone: stable across processes and
    Python versions (no ``hash()``, which is salted per process)."""
    digest = hashlib.sha256(repr(key).encode()).digest()
    return random.Random(int.from_bytes(digest[:16], "little"))


@TASKS.register("arith")
class ArithmeticTask(Task):
    name = "arith"
    default_reward = "exact_match"

    def __init__(
        self,
        seed: int = 0,
        max_operand: int = 999,
        heldout_size: int = 1024,
        heldout_seed: int = 2024,
    ):
        if max_operand < 0:
            raise ValueError(f"max_operand must be >= 0, got {max_operand}")
        if heldout_size < 0:
            raise ValueError(f"heldout_size must be >= 0, got {heldout_size}")
        self.seed = seed
        self.max_operand = max_operand
        self.heldout_size = heldout_size
        self.heldout_seed = heldout_seed
        self._heldout: list[Prompt] | None = None
        self._tokenizer: PreTrainedTokenizerFast | None = None

    def _operands(self, *key: object) -> tuple[int, int]:
        rng = _rng(self.name, self.max_operand, *key)
        return rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)

    def _make(self, uid: str, a: int, b: int) -> Prompt:
        return Prompt(uid=uid, text=f"{a}+{b}=", answer=str(a + b), task_id=self.name)

    def prompt(self, index: int) -> Prompt:
        if index < 0:
            raise IndexError(f"prompt index must be >= 0, got {index}")
        a, b = self._operands("train", self.seed, index)
        return self._make(f"{self.name}-{index:06d}", a, b)

    def heldout(self) -> list[Prompt]:
        """``heldout_size`` prompts from ``heldout_seed`` only (independent of
        ``seed``); they may coincide with training prompts by chance."""
        if self._heldout is None:
            self._heldout = [
                self._make(
                    f"{self.name}-heldout-{i:04d}", *self._operands("heldout", self.heldout_seed, i)
                )
                for i in range(self.heldout_size)
            ]
        return list(self._heldout)

    def sft_example(self, index: int) -> tuple[str, str]:
        if index < 0:
            raise IndexError(f"sft index must be >= 0, got {index}")
        p = self._make("", *self._operands("sft", self.seed, index))
        return p.text, p.answer

    def tokenizer(self) -> PreTrainedTokenizerFast:
        if self._tokenizer is None:
            self._tokenizer = build_char_tokenizer()
        return self._tokenizer


@REWARDS.register("exact_match")
def exact_match(prompt: Prompt, response: str, *, finished: bool = True) -> float:
    """1.0 iff the sample ended with ``<eos>`` and the text before it is
    exactly ``prompt.answer``, else 0.0.

    Strict, as W1 specifies: no whitespace stripping (``" 357"`` and
    ``"357 "`` score 0), no leading zeros (``"0357"`` scores 0), nothing after
    the number (``"357+1"`` scores 0), and the empty response scores 0.
    ``response`` is the decoded text before the first ``<eos>`` (special
    tokens skipped). ``finished=False`` means no ``<eos>`` was emitted
    (truncated or aborted): that scores 0 even if the text equals the answer,
    since the model never committed to stopping there.
    """
    return 1.0 if finished and response == prompt.answer else 0.0
