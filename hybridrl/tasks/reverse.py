"""W3: reverse a string of digits, a long-tailed workload (docs/workloads.md).

Prompt ``"r:" + digits + "="`` (the model sees ``<bos>`` first); the answer is the digits reversed,
then ``<eos>``; reward 1 for an exact match (W1's ``exact_match``). Lengths are long-tailed: with
probability ``1 - long_frac`` uniform in ``short`` (1..16 digits), else uniform in ``long``
(48..96 digits), so one in ten groups takes several times longer to generate than the rest: the
stragglers that stall a synchronous trainer. The tokenizer is W1's with ``r`` and ``:`` added.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

from hybridrl.tasks.arithmetic import _rng
from hybridrl.tasks.base import TASKS, Prompt, Task
from hybridrl.tasks.tokenizer import build_char_tokenizer


@TASKS.register("reverse")
class ReverseTask(Task):
    name = "reverse"
    default_reward = "exact_match"

    def __init__(
        self,
        seed: int = 0,
        heldout_size: int = 1024,
        heldout_seed: int = 2024,
        long_frac: float = 0.1,
        short: tuple[int, int] = (1, 16),
        long: tuple[int, int] = (48, 96),
    ):
        if not 0 <= long_frac <= 1:
            raise ValueError(f"long_frac must be in [0, 1], got {long_frac}")
        for label, (lo, hi) in (("short", short), ("long", long)):
            if not 1 <= lo <= hi:
                raise ValueError(
                    f"{label} length range must satisfy 1 <= low <= high, got ({lo}, {hi})"
                )
        self.seed, self.heldout_size, self.heldout_seed = seed, heldout_size, heldout_seed
        self.long_frac, self.short, self.long = long_frac, tuple(short), tuple(long)
        self._heldout: list[Prompt] | None = None
        self._tokenizer: PreTrainedTokenizerFast | None = None

    def _digits(self, *key: object) -> str:
        rng = _rng(self.name, *key)
        lo, hi = self.long if rng.random() < self.long_frac else self.short
        return "".join(rng.choice("0123456789") for _ in range(rng.randint(lo, hi)))

    def _make(self, uid: str, digits: str) -> Prompt:
        return Prompt(uid=uid, text=f"r:{digits}=", answer=digits[::-1], task_id=self.name)

    def prompt(self, index: int) -> Prompt:
        if index < 0:
            raise IndexError(f"prompt index must be >= 0, got {index}")
        return self._make(f"{self.name}-{index:06d}", self._digits("train", self.seed, index))

    def heldout(self) -> list[Prompt]:
        """``heldout_size`` prompts from ``heldout_seed`` only, with the training length
        distribution."""
        if self._heldout is None:
            self._heldout = [
                self._make(
                    f"{self.name}-heldout-{i:04d}", self._digits("heldout", self.heldout_seed, i)
                )
                for i in range(self.heldout_size)
            ]
        return list(self._heldout)

    def sft_example(self, index: int) -> tuple[str, str]:
        if index < 0:
            raise IndexError(f"sft index must be >= 0, got {index}")
        p = self._make("", self._digits("sft", self.seed, index))
        return p.text, p.answer

    def tokenizer(self) -> PreTrainedTokenizerFast:
        if self._tokenizer is None:
            self._tokenizer = build_char_tokenizer("r:")
        return self._tokenizer
