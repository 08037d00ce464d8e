"""A user's dataset as the prompt source: :class:`DatasetTask`.

The training stream walks the training rows epoch after epoch: prompt ``index`` is position
``index % n`` of epoch ``index // n`` (``n`` training rows). With ``data.shuffle`` every epoch has
its own order, a permutation seeded from ``(trainer.seed, epoch)`` with a stable hash; otherwise the
file order. A prompt is thus a pure function of (seed, index), and a resumed run continues the
stream exactly, across epoch boundaries too.

The held-out set is ``data.val_files``, or, when there are none, ``min(task.heldout_size, n // 10)``
training rows chosen once with a fixed seed (the same on every run, any ``trainer.seed``) and never
trained on. With ``data.max_prompt_length``, longer prompts are dropped when the data is read (and
counted: :attr:`DatasetTask.dropped_long`), or are an error with ``data.drop_long_prompts=false``.

Constructing a task checks the paths only; the files are read on first use, once per task
object (``make_task`` runs in the driver, the rollout workers and evaluation, and many of those
callers want the tokenizer alone).
"""

from __future__ import annotations

import hashlib
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerFast

from hybridrl.config import Config
from hybridrl.data.check import check_columns
from hybridrl.data.files import DataError, as_paths, read_files
from hybridrl.data.render import dig, encode, render_prompt, render_text
from hybridrl.tasks.base import Prompt, Task

log = logging.getLogger(__name__)

_PERMUTATIONS_KEPT = 2  # epochs whose order is cached (the current one and the one before)
_BATCH = 1024  # prompts encoded per tokenizer call when their lengths are measured


def seeded_rng(*key: object) -> random.Random:
    """A generator seeded from ``key`` alone: stable across processes and Python versions (no
    ``hash()``, which is salted per process)."""
    digest = hashlib.sha256(repr(key).encode()).digest()
    return random.Random(int.from_bytes(digest[:16], "little"))


@dataclass
class _Rows:
    """What reading the data gives: the tables and which of their rows serve which purpose."""

    train_table: Any  # datasets.Dataset
    train: list[int]  # rows of train_table trained on, in file order
    heldout_table: Any
    heldout: list[int]  # rows of heldout_table evaluated on
    heldout_tag: str  # "val" (data.val_files) or "heldout" (split from the training data)
    dropped_long: int = 0


class DatasetTask(Task):
    """Prompts from ``cfg.data``'s files (see the module docstring); ``name`` is
    ``cfg.source_name``."""

    default_reward = "exact_match"

    def __init__(self, cfg: Config):
        self.cfg, self.data = cfg, cfg.data
        self.name = cfg.source_name
        self.seed = cfg.trainer.seed
        self.heldout_size = cfg.task.heldout_size
        self.train_paths = as_paths(self.data.train_files, "data.train_files")
        self.val_paths = (
            as_paths(self.data.val_files, "data.val_files") if self.data.val_files else []
        )
        self._tokenizer: PreTrainedTokenizerFast | None = None
        self._rows: _Rows | None = None
        self._heldout: list[Prompt] | None = None
        self._orders: dict[int, list[int]] = {}  # epoch -> its permutation of the training rows

    # --- the Task interface -------------------------------------------------------------------
    def prompt(self, index: int) -> Prompt:
        if index < 0:
            raise IndexError(f"prompt index must be >= 0, got {index}")
        rows = self.rows()
        epoch, position = divmod(index, len(rows.train))
        row = rows.train[self._order(epoch)[position]]
        return self._make(rows.train_table, row, f"{self.name}-e{epoch}-r{row}", "data.train_files")

    def heldout(self) -> list[Prompt]:
        if self._heldout is None:
            rows = self.rows()
            key = "data.val_files" if rows.heldout_tag == "val" else "data.train_files"
            self._heldout = [
                self._make(rows.heldout_table, r, f"{self.name}-{rows.heldout_tag}-r{r}", key)
                for r in rows.heldout
            ]
        return list(self._heldout)

    def sft_example(self, index: int) -> tuple[str, str]:
        raise DataError(
            "a dataset (data.train_files) gives prompts, not supervised examples: there is no "
            "warm start on it; set sft.enabled=false and start from model.path"
        )

    def tokenizer(self) -> PreTrainedTokenizerFast:
        """The tokenizer of ``model.path``; with no model.path, the built-in model's (that of
        ``task.name``)."""
        if self._tokenizer is None:
            if self.cfg.model.path:
                from transformers import AutoTokenizer

                path = str(Path(self.cfg.model.path).expanduser())
                self._tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
            else:
                from hybridrl.tasks import TASKS

                builtin = TASKS.get(self.cfg.task.name)(seed=self.seed)
                self._tokenizer = builtin.tokenizer()
        return self._tokenizer

    # --- the data -----------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        """Training rows (one epoch's prompts): after dropping long prompts and holding out."""
        return len(self.rows().train)

    @property
    def dropped_long(self) -> int:
        """Rows (training and validation) dropped as longer than ``data.max_prompt_length``."""
        return self.rows().dropped_long

    def rows(self) -> _Rows:
        """The data, read on first use."""
        if self._rows is None:
            self._rows = self._read()
        return self._rows

    def _read(self) -> _Rows:
        data = self.data
        train_table = read_files(self.train_paths, "data.train_files", "train", self._check)
        train, dropped = self._within_length(train_table, "data.train_files")
        if self.val_paths:
            val_table = read_files(self.val_paths, "data.val_files", "val", self._check)
            heldout, dropped_val = self._within_length(val_table, "data.val_files")
            rows = _Rows(train_table, train, val_table, heldout, "val", dropped + dropped_val)
        else:
            size = min(self.heldout_size, len(train) // 10)
            chosen = set(seeded_rng("data-heldout", len(train)).sample(range(len(train)), size))
            heldout = [r for i, r in enumerate(train) if i in chosen]
            train = [r for i, r in enumerate(train) if i not in chosen]
            log.info(
                "data: %d of the %d training rows held out for evaluation (no data.val_files; "
                "at most task.heldout_size=%d, a tenth of the data)",
                len(heldout),
                len(heldout) + len(train),
                self.heldout_size,
            )
            rows = _Rows(train_table, train, train_table, heldout, "heldout", dropped)
        if rows.dropped_long:
            log.info(
                "data: %d prompt(s) longer than data.max_prompt_length=%d tokens dropped",
                rows.dropped_long,
                data.max_prompt_length,
            )
        if not rows.train:
            raise DataError(
                f"data.train_files: no training rows left ({len(train_table)} read, "
                f"{dropped} dropped as longer than data.max_prompt_length={data.max_prompt_length},"
                f" {len(rows.heldout) if rows.heldout_tag == 'heldout' else 0} held out)"
            )
        # a first render finds a missing chat template or a prompt of the wrong kind before the run
        self._make(train_table, rows.train[0], "check", "data.train_files")
        return rows

    def _check(self, table, key: str) -> None:
        check_columns(table.column_names, table.features, self.data, key)

    def _within_length(self, table, key: str) -> tuple[list[int], int]:
        """(the rows within ``data.max_prompt_length``, how many were dropped); the prompts are
        rendered one by one and encoded in batches."""
        limit = self.data.max_prompt_length
        if limit is None:
            return list(range(len(table))), 0
        tokenizer, values = self.tokenizer(), table[self.data.prompt_key]
        kept = []
        for start in range(0, len(values), _BATCH):
            by_kind: dict[bool, list[tuple[int, str]]] = {True: [], False: []}
            for row in range(start, min(start + _BATCH, len(values))):
                where = f"row {row} of {key}"
                text, special = render_text(values[row], tokenizer, self.data, where)
                by_kind[special].append((row, text))
            for special, items in by_kind.items():
                if not items:
                    continue
                where = f"rows {items[0][0]}..{items[-1][0]} of {key}"
                ids = encode([t for _, t in items], tokenizer, special, where)
                for (row, _), row_ids in zip(items, ids):
                    if len(row_ids) <= limit:
                        kept.append(row)
                    elif not self.data.drop_long_prompts:
                        raise DataError(
                            f"{key}: row {row}'s prompt is {len(row_ids)} tokens, above "
                            f"data.max_prompt_length={limit}; raise the limit or set "
                            "data.drop_long_prompts=true to drop such rows"
                        )
        return sorted(kept), len(table) - len(kept)

    def _order(self, epoch: int) -> list[int]:
        """Epoch ``epoch``'s order of the training positions."""
        order = self._orders.get(epoch)
        if order is None:
            order = list(range(len(self.rows().train)))
            if self.data.shuffle:
                seeded_rng("data-shuffle", self.seed, epoch).shuffle(order)
            while len(self._orders) >= _PERMUTATIONS_KEPT:
                self._orders.pop(next(iter(self._orders)))
            self._orders[epoch] = order
        return order

    def _make(self, table, row: int, uid: str, key: str) -> Prompt:
        record = table[row]
        where = f"row {row} of {key}"
        raw = record[self.data.prompt_key]
        text, ids = render_prompt(raw, self.tokenizer(), self.data, where)
        answer = "" if self.data.answer_key is None else dig(record, self.data.answer_key, where)
        source = record.get("data_source")
        return Prompt(
            uid=uid,
            text=text,
            answer="" if answer is None else str(answer),
            task_id=source if isinstance(source, str) and source else self.name,
            token_ids=tuple(ids),
            raw=raw,
            columns={k: v for k, v in record.items() if k != self.data.prompt_key},
        )
