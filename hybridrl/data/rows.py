"""Every row of a user's data checked when it is read, so that no training step meets a row it
cannot use (a bad row would otherwise stop the run at the step that draws it, and again on every
resume).

A row whose problem is its own is dropped and counted, under a reason:

* ``not_a_prompt``: the prompt is neither a string nor a list of chat messages (null, a number, a
  dict, a list of strings);
* ``template_failed``: the chat template raised on its messages;
* ``no_answer``: ``data.answer_key`` does not reach into it (e.g. its dict column is null);
* ``empty``: the prompt has no tokens (an empty string, with a tokenizer that adds no ``<bos>``);
* ``long``: more tokens than the limit, which is ``data.max_prompt_length`` and the model's
  positions less ``rollout.max_new_tokens`` (a longer prompt leaves no room for a whole response),
  the smaller of the two. With ``data.drop_long_prompts=false`` such a row refuses the data instead.

The log names the first :data:`NAMED_ROWS` dropped rows of each config key (file and row in that
file, and why), then gives one count per key; the counts go to the run's metrics
(:meth:`DatasetTask.data_metrics`). The level is a warning, or info where only prompts over the
user's own ``data.max_prompt_length`` were dropped (what the setting asks for).

A problem of the data as a whole refuses it in one line naming the file and the row: characters the
tokenizer cannot encode (:func:`~hybridrl.data.render.check_encodable`). A tokenizer that drops a
character trains on another prompt than the one written (``'sum 12+34='`` as ``'12+34='``), and one
that raises on it would stop the run; either way the fix is the tokenizer or the data, not a row
count, and the same tokenizer gives the same answer whether it raises or drops. Text that is not
UTF-8 is refused when the files are read (``files.py``).
"""

from __future__ import annotations

import bisect
import itertools
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridrl.config import Config
from hybridrl.data.files import DataError
from hybridrl.data.render import RowError, check_encodable, dig, encode, render_text

log = logging.getLogger(__name__)

# reason -> how the count reads ("3 not a prompt")
REASONS = {
    "not_a_prompt": "not a prompt",
    "template_failed": "failed in the chat template",
    "no_answer": "without an answer",
    "empty": "with no tokens",
    "long": "too long",
}
NAMED_ROWS = 5  # dropped rows named in the log per config key; the others are only counted
_BATCH = 1024  # rows rendered and encoded together


@dataclass
class Sources:
    """The files a table was read from (``key``: the config key naming them), to name a row of the
    concatenated table by its file and its row in that file."""

    key: str
    paths: list[Path]
    sizes: list[int]

    def __post_init__(self):
        self._starts = [0, *itertools.accumulate(self.sizes)][:-1]

    def where(self, row: int) -> str:
        i = bisect.bisect_right(self._starts, row) - 1
        return f"{self.key} {str(self.paths[i])!r} row {row - self._starts[i]}"


@dataclass
class Limit:
    """The most tokens a prompt may have (None: no limit), and how to say where it comes from."""

    tokens: int | None
    text: str = ""  # "data.max_prompt_length=64", or the model's positions less max_new_tokens
    fix: str = ""
    asked: bool = False  # the user's data.max_prompt_length is what binds


@dataclass
class Checked:
    """The rows of one table kept (in file order), the dropped ones counted by reason, and the
    first dropped row's message."""

    kept: list[int]
    dropped: Counter = field(default_factory=Counter)
    first: str | None = None


def prompt_limit(cfg: Config, tokenizer) -> Limit:
    """The smaller of ``data.max_prompt_length`` and the model's positions less
    ``rollout.max_new_tokens`` (where the positions are known)."""
    asked, new = cfg.data.max_prompt_length, cfg.rollout.max_new_tokens
    positions = cfg.model.max_positions()
    room = None if positions is None else positions - new
    if room is not None and room < 1:
        raise DataError(
            f"rollout.max_new_tokens={new} leaves no room for a prompt in the model's "
            f"{positions} positions; lower it"
        )
    if asked is not None and (room is None or asked <= room):
        return Limit(
            asked,
            f"data.max_prompt_length={asked}",
            "raise the limit or set data.drop_long_prompts=true to drop such rows",
            asked=True,
        )
    if room is None:
        return Limit(None)
    return Limit(
        room,
        f"{room} (the model's {positions} positions less rollout.max_new_tokens={new})",
        "shorten it, lower rollout.max_new_tokens, or set data.drop_long_prompts=true to drop "
        "such rows",
    )


class RowCheck:
    """The check of a task's tables (training and held-out) with its tokenizer; each distinct
    character's verdict is kept from one table to the next."""

    def __init__(self, cfg: Config, tokenizer):
        self.data, self.tokenizer = cfg.data, tokenizer
        self.limit = prompt_limit(cfg, tokenizer)
        self._known: dict[str, bool] = {}

    def __call__(self, table: Any, sources: Sources) -> Checked:
        """Check every row of ``table`` (a ``datasets.Dataset`` read from ``sources``): drop and
        count, log, or raise :class:`DataError` (see the module docstring)."""
        data, checked = self.data, Checked([])
        named = 0

        def drop(reason: str, message: str) -> None:
            nonlocal named
            checked.dropped[reason] += 1
            checked.first = checked.first or message
            if named < NAMED_ROWS:
                named += 1
                log.log(self._level(reason), "%s; the row is dropped", message)

        answer = None if data.answer_key is None else data.answer_key.split(".")[0]
        view = table.select_columns(
            list(dict.fromkeys([data.prompt_key, answer or data.prompt_key]))
        )
        for start in range(0, len(table), _BATCH):
            batch = view[start : start + _BATCH]
            by_kind: dict[bool, list[tuple[int, str]]] = {True: [], False: []}
            for i, value in enumerate(batch[data.prompt_key]):
                where = sources.where(start + i)
                try:
                    if answer is not None:
                        dig({answer: batch[answer][i]}, data.answer_key, where)
                    text, special = render_text(value, self.tokenizer, data, where)
                except RowError as e:
                    drop(e.reason, str(e))
                    continue
                by_kind[special].append((start + i, text))
            self._refuse_lost(by_kind, sources)
            for special, items in by_kind.items():
                if not items:
                    continue
                span = f"{sources.key} rows {items[0][0]}..{items[-1][0]}"
                ids = encode([t for _, t in items], self.tokenizer, special, span)
                for (row, _), row_ids in zip(items, ids):
                    self._measure(row, len(row_ids), sources, checked, drop)
        checked.kept.sort()
        if checked.dropped:
            total = sum(checked.dropped.values())
            counts = ", ".join(f"{n} {REASONS[r]}" for r, n in checked.dropped.items())
            more = f"; the first {NAMED_ROWS} are named above" if total > NAMED_ROWS else ""
            level = max(self._level(r) for r in checked.dropped)
            log.log(
                level, "%s: %d of %d rows dropped (%s)%s", sources.key, total, len(table), counts,
                more,
            )  # fmt: skip
        return checked

    def _measure(self, row: int, tokens: int, sources: Sources, checked: Checked, drop) -> None:
        limit = self.limit
        if tokens == 0:
            drop(
                "empty",
                f"{sources.where(row)}: the prompt has no tokens (an empty prompt, and the "
                "tokenizer adds no <bos>)",
            )
        elif limit.tokens is not None and tokens > limit.tokens:
            message = f"{sources.where(row)}: the prompt is {tokens} tokens, above {limit.text}"
            if not self.data.drop_long_prompts:
                raise DataError(f"{message}; {limit.fix}")
            drop("long", message)
        else:
            checked.kept.append(row)

    def _refuse_lost(self, by_kind: dict[bool, list[tuple[int, str]]], sources: Sources) -> None:
        items = sorted(itertools.chain(*by_kind.values()))
        check_encodable([(sources.where(r), t) for r, t in items], self.tokenizer, self._known)

    def _level(self, reason: str) -> int:
        return logging.INFO if reason == "long" and self.limit.asked else logging.WARNING
