"""W4: ``a*b+c`` with a calculator the model calls (docs/workloads.md, docs/agentic.md).

Prompt ``"a*b+c="`` (the model sees ``<bos>`` first), a and b uniform in ``[2, max_factor]``, c
uniform in ``[0, max_addend]``. A tiny model cannot multiply two-digit numbers, so the skill is to
ask: the model writes ``<call>a*b</call>`` (``env.turn_stop: ["</call>"]`` ends its turn there),
the ``calc_tool`` environment (``hybridrl/envs/calc_tool.py``) answers ``<obs>P</obs>``, and the
model writes ``P + c`` and ``<eos>``. The environment's reward is 1 for the right final answer,
else 0. The tokenizer is W1's with ``*<>/`` and the letters of the tags added (W1's ids unchanged).

The environment's calls can be slowed down (``latency_s``, fixed or lognormal) to stand in
for a slow tool. The warm start trains on tool-using traces: :meth:`CalcTask.sft_segments` marks the
observation as not trained on (``driver/sft.py`` masks it out of the loss).
"""

from __future__ import annotations

import re

from transformers import PreTrainedTokenizerFast

from hybridrl.tasks.arithmetic import _rng
from hybridrl.tasks.base import REWARDS, TASKS, Prompt, Task
from hybridrl.tasks.tokenizer import build_char_tokenizer

CALC_CHARS = "*</>abclos"  # after W1's characters: '*', the tags' brackets, slash and letters
CALL = re.compile(r"<call>(\d{1,6})([*+-])(\d{1,6})</call>")
OPS = {"*": lambda x, y: x * y, "+": lambda x, y: x + y, "-": lambda x, y: x - y}


def trace(a: int, b: int, c: int) -> list[tuple[str, bool]]:
    """A correct tool-using completion as (text, trained on) segments: the call, the
    observation (not trained on: the tool wrote it), the answer."""
    return [(f"<call>{a}*{b}</call>", True), (f"<obs>{a * b}</obs>", False), (str(a * b + c), True)]


@TASKS.register("calc")
class CalcTask(Task):
    name = "calc"
    default_reward = "calc_answer"  # used only when the run has no environment

    def __init__(
        self,
        seed: int = 0,
        heldout_size: int = 1024,
        heldout_seed: int = 2024,
        max_factor: int = 99,
        max_addend: int = 9,
    ):
        if max_factor < 2 or max_addend < 0:
            raise ValueError(
                f"need max_factor >= 2 and max_addend >= 0, got {max_factor}, {max_addend}"
            )
        self.seed, self.heldout_size, self.heldout_seed = seed, heldout_size, heldout_seed
        self.max_factor, self.max_addend = max_factor, max_addend
        self._heldout: list[Prompt] | None = None
        self._tokenizer: PreTrainedTokenizerFast | None = None

    def _operands(self, *key: object) -> tuple[int, int, int]:
        rng = _rng(self.name, self.max_factor, self.max_addend, *key)
        a, b = rng.randint(2, self.max_factor), rng.randint(2, self.max_factor)
        return a, b, rng.randint(0, self.max_addend)

    def _make(self, uid: str, a: int, b: int, c: int) -> Prompt:
        return Prompt(uid=uid, text=f"{a}*{b}+{c}=", answer=str(a * b + c), task_id=self.name)

    def prompt(self, index: int) -> Prompt:
        if index < 0:
            raise IndexError(f"prompt index must be >= 0, got {index}")
        return self._make(f"{self.name}-{index:06d}", *self._operands("train", self.seed, index))

    def heldout(self) -> list[Prompt]:
        if self._heldout is None:
            self._heldout = [
                self._make(
                    f"{self.name}-heldout-{i:04d}", *self._operands("heldout", self.heldout_seed, i)
                )
                for i in range(self.heldout_size)
            ]
        return list(self._heldout)

    def sft_segments(self, index: int) -> tuple[str, list[tuple[str, bool]]]:
        """(prompt text, completion segments (text, trained on)): the observation is not."""
        if index < 0:
            raise IndexError(f"sft index must be >= 0, got {index}")
        a, b, c = self._operands("sft", self.seed, index)
        return self._make("", a, b, c).text, trace(a, b, c)

    def sft_example(self, index: int) -> tuple[str, str]:
        prompt, segments = self.sft_segments(index)
        return prompt, "".join(text for text, _ in segments)

    def tokenizer(self) -> PreTrainedTokenizerFast:
        if self._tokenizer is None:
            self._tokenizer = build_char_tokenizer(CALC_CHARS)
        return self._tokenizer


@REWARDS.register("calc_answer")
def calc_answer(prompt: Prompt, response: str, *, finished: bool = True) -> float:
    """1.0 iff the sample ended with ``<eos>`` and the text after its last observation is exactly
    the answer (the whole trajectory's text, as reward functions see it in a multi-turn run)."""
    return 1.0 if finished and response.rpartition("</obs>")[2] == prompt.answer else 0.0
