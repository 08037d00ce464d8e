"""Tables of sample completions (``trainer.log_samples_every``, ``trainer.log_samples``).

A table has one row per chosen sample: the step, the prompt's uid, the prompt text, the completion
(decoded, special tokens skipped), the reward, every reward extra (``reward/<name>`` from the
reward function, ``reward_errors`` ...), the status and the number of model turns. The rows are
chosen deterministically: the first sample of each group in batch order, then the second of each,
and so on, so that a table covers as many prompts as it has rows. They go to ``<run>/samples.jsonl``
(one JSON line per row), TensorBoard (a markdown table, text tab) and wandb (a ``wandb.Table``):
see :meth:`~hybridrl.telemetry.sinks.MetricsLogger.log_samples`.

In asynchronous training no sample reaches the driver: each rollout rank keeps its most recent
scored groups in a :class:`RecentSamples` and the driver asks for them when a table is due.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

SAMPLES_FILE = "samples.jsonl"
TABLE_KEY = "samples"  # the TensorBoard text tag and the wandb key
COLUMNS = ("step", "uid", "prompt", "completion", "reward", "status", "turns")
MAX_CELL_CHARS = 2000  # a markdown cell longer than this is cut (the jsonl keeps every character)


def pick(samples: Sequence, n: int) -> list:
    """``n`` samples spread over the groups (``uid``): the first of each group in order, then the
    second of each, and so on."""
    groups: dict[str, list] = {}
    for s in samples:
        groups.setdefault(s.uid, []).append(s)
    longest = max((len(g) for g in groups.values()), default=0)
    ordered = [g[i] for i in range(longest) for g in groups.values() if i < len(g)]
    return ordered[:n]


def _number(value: Any) -> float | None:
    value = None if value is None else float(value)
    return value if value is None or math.isfinite(value) else None


def sample_rows(samples: Sequence, tokenizer, step: int, n: int) -> list[dict]:
    """The table rows of ``n`` of ``samples`` (:func:`pick`) at ``step``."""
    rows = []
    for s in pick(samples, n):
        prompt = s.metadata.get("prompt")
        text = getattr(prompt, "text", None)
        if text is None:  # a prompt given only as token ids
            text = tokenizer.decode(s.prompt_ids, skip_special_tokens=True)
        row = {
            "step": int(step),
            "uid": s.uid,
            "prompt": text,
            "completion": tokenizer.decode(s.response_ids, skip_special_tokens=True),
            "reward": _number(s.reward),
            "status": s.status,
            "turns": 1,  # one model turn per sample
        }
        for key in sorted(s.reward_extras):
            row.setdefault(key, _number(s.reward_extras[key]))
        rows.append(row)
    return rows


def columns(rows: Iterable[dict]) -> list[str]:
    """The fixed columns, then every other key of ``rows`` (the reward extras) in sorted order."""
    extra = sorted({k for r in rows for k in r} - set(COLUMNS))
    return [*COLUMNS, *extra]


def _cell(value: Any) -> str:
    text = "" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)
    if len(text) > MAX_CELL_CHARS:
        text = text[:MAX_CELL_CHARS] + " …"
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\r", "").replace("\n", "<br>")


def markdown(rows: Sequence[dict]) -> str:
    """``rows`` as a markdown table (TensorBoard's text tab renders it)."""
    cols = columns(rows)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_cell(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


class RecentSamples:
    """The latest ``groups`` scored groups of a rollout rank (thread-safe: the stream thread keeps,
    the worker's caller takes)."""

    def __init__(self, groups: int):
        self._groups: deque[list] = deque(maxlen=groups)
        self._lock = threading.Lock()

    def keep(self, samples: list) -> list:
        """Remember the group ``samples``; returns it (to wrap a scorer)."""
        with self._lock:
            self._groups.append(samples)
        return samples

    def take(self) -> list:
        """The samples of the groups remembered since the last call, oldest group first (a run
        resumed from a checkpoint shows the tables of the run that never stopped)."""
        with self._lock:
            out = [s for g in self._groups for s in g]
            self._groups.clear()
            return out
