"""A user's dataset as the prompt source: :class:`DatasetTask`.

The training stream walks the training rows epoch after epoch: prompt ``index`` is position
``index % n`` of epoch ``index // n`` (``n`` training rows). With ``data.shuffle`` every epoch has
its own order, a permutation seeded from ``(trainer.seed, epoch)`` with a stable hash; otherwise the
file order. A prompt is thus a pure function of (seed, index), and a resumed run continues the
stream exactly, across epoch boundaries too.

The held-out set is ``data.val_files``, or, when there are none, ``min(task.heldout_size, n // 10)``
training rows chosen once with a fixed seed (the same on every run, any ``trainer.seed``) and never
trained on. Every row is checked when the data is read (``rows.py``): a row no step could use (not
a prompt, no tokens, too long, ...) is dropped and counted (:attr:`DatasetTask.dropped`), and a
problem of the whole data refuses it in one line naming the file and the row.

Constructing a task checks the paths only; the files are read on first use, once per task
object (``make_task`` runs in the driver, the rollout workers and evaluation, and many of those
callers want the tokenizer alone).
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerFast

from hybridrl.config import Config
from hybridrl.data.check import check_columns
from hybridrl.data.files import DataError, as_paths, read_files
from hybridrl.data.render import dig, render_prompt
from hybridrl.data.rows import REASONS, RowCheck, Sources
from hybridrl.tasks.base import Prompt, Task

log = logging.getLogger(__name__)

_PERMUTATIONS_KEPT = 2  # epochs whose order is cached (the current one and the one before)


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
    sources: dict[str, Sources]  # by config key: the files a table's rows come from
    dropped: Counter  # rows dropped when read (training and validation), by reason


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
        uid = f"{self.name}-e{epoch}-r{row}"
        return self._make(rows.train_table, row, uid, "data.train_files", rows.sources)

    def heldout(self) -> list[Prompt]:
        if self._heldout is None:
            rows = self.rows()
            key = "data.val_files" if rows.heldout_tag == "val" else "data.train_files"
            self._heldout = [
                self._make(
                    rows.heldout_table, r, f"{self.name}-{rows.heldout_tag}-r{r}", key, rows.sources
                )
                for r in rows.heldout
            ]
        return list(self._heldout)

    def sft_example(self, index: int) -> tuple[str, str]:
        raise DataError(
            "a dataset (data.train_files) gives prompts, not supervised examples: fine-tune on "
            "your own examples with sft.train_files, or set sft.enabled=false and start from "
            "model.path"
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
        """Training rows (one epoch's prompts): after dropping rows and holding out."""
        return len(self.rows().train)

    @property
    def dropped(self) -> Counter:
        """Rows (training and validation) dropped when the data was read, by reason
        (``rows.REASONS``)."""
        return self.rows().dropped

    @property
    def dropped_long(self) -> int:
        """Rows (training and validation) dropped as longer than the prompt limit."""
        return self.dropped["long"]

    def data_metrics(self) -> dict[str, int]:
        """The data's counts for the run's metrics: training and held-out rows, and the rows
        dropped by reason (``data/dropped_<reason>``, 0 where none)."""
        rows = self.rows()
        counts = {"data/train_rows": len(rows.train), "data/heldout_rows": len(rows.heldout)}
        return counts | {f"data/dropped_{r}": rows.dropped[r] for r in REASONS}

    def rows(self) -> _Rows:
        """The data, read and checked on first use."""
        if self._rows is None:
            self._rows = self._read()
        return self._rows

    def _read(self) -> _Rows:
        check = RowCheck(self.cfg, self.tokenizer())
        train_table, sizes = read_files(self.train_paths, "data.train_files", "train", self._check)
        sources = {"data.train_files": Sources("data.train_files", self.train_paths, sizes)}
        checked = check(train_table, sources["data.train_files"])
        train, dropped, first = checked.kept, Counter(checked.dropped), checked.first
        if self.val_paths:
            val_table, sizes = read_files(self.val_paths, "data.val_files", "val", self._check)
            sources["data.val_files"] = Sources("data.val_files", self.val_paths, sizes)
            checked = check(val_table, sources["data.val_files"])
            rows = _Rows(
                train_table,
                train,
                val_table,
                checked.kept,
                "val",
                sources,
                dropped + checked.dropped,
            )
        else:
            size = min(self.heldout_size, len(train) // 10) if self.data.holdout else 0
            chosen = set(seeded_rng("data-heldout", len(train)).sample(range(len(train)), size))
            heldout = [r for i, r in enumerate(train) if i in chosen]
            train = [r for i, r in enumerate(train) if i not in chosen]
            # a warning, so the Python API shows it without any logging set up: these rows are
            # not trained on
            if self.data.holdout:
                log.warning(
                    "data: %d of the %d training rows held out for evaluation, not trained on (no "
                    "data.val_files; at most task.heldout_size=%d, a tenth of the data; give "
                    "data.val_files, or data.holdout=false, to keep every row for training)",
                    len(heldout),
                    len(heldout) + len(train),
                    self.heldout_size,
                )
            else:
                log.warning(
                    "data: every training row is trained on and none evaluated on (data.holdout="
                    "false, no data.val_files): the run's evaluations are skipped"
                )
            rows = _Rows(train_table, train, train_table, heldout, "heldout", sources, dropped)
        if not rows.train:
            counts = ", ".join(f"{n} {REASONS[r]}" for r, n in dropped.items()) or "none dropped"
            held = len(rows.heldout) if rows.heldout_tag == "heldout" else 0
            raise DataError(
                f"data.train_files: no training rows left ({len(train_table)} read; dropped: "
                f"{counts}; {held} held out)" + (f"; the first dropped: {first}" if first else "")
            )
        return rows

    def _check(self, table, key: str) -> None:
        check_columns(table.column_names, table.features, self.data, key)

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

    def _make(self, table, row: int, uid: str, key: str, sources: dict[str, Sources]) -> Prompt:
        record = table[row]
        where = sources[key].where(row)
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
