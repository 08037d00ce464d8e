"""Checks of a dataset's columns, and :func:`check_data`: what can be checked before a run starts
without reading the whole data."""

from __future__ import annotations

from typing import Any

from hybridrl.config import Config
from hybridrl.config.schema import DataConfig
from hybridrl.data.files import DataError, first_row
from hybridrl.data.render import RowError, check_encodable, dig, encode, render_text
from hybridrl.tasks.base import Prompt


def check_columns(columns: list[str], features: Any, data: DataConfig, key: str) -> None:
    """``data.prompt_key`` is a column and ``data.answer_key`` names a column (a dotted key: a
    field of a struct column, where ``features`` says which fields it has)."""
    if data.prompt_key not in columns:
        raise DataError(
            f"{key}: no column {data.prompt_key!r} (data.prompt_key); the columns: {columns}"
        )
    answer = data.answer_key
    if answer is None:
        return
    parts = answer.split(".")
    if parts[0] not in columns:
        raise DataError(
            f"{key}: no column {parts[0]!r} for data.answer_key={answer!r}; the columns: "
            f"{columns} (data.answer_key=null: the data has no answers)"
        )
    feature = features[parts[0]] if features is not None else None
    for depth, part in enumerate(parts[1:], 1):
        if not isinstance(feature, dict):  # not a known struct: rows are checked as they are read
            break
        if part not in feature:
            raise DataError(
                f"{key}: {'.'.join(parts[:depth])!r} has no field {part!r} for "
                f"data.answer_key={answer!r}; its fields: {sorted(feature)}"
            )
        feature = feature[part]


def check_data(cfg: Config) -> list[tuple[str, Prompt]]:
    """Before any work starts: the paths of ``data.train_files`` / ``data.val_files``, and the first
    row of each file (its columns, its answer, its prompt rendered with the run's tokenizer, the
    characters the tokenizer cannot encode). Raises :class:`DataError` (one line). Reads only those
    rows; the rest (every row, ``rows.py``) is checked when the run reads the data, and a first row
    with a problem of its own (a null prompt) is dropped and counted then, as any row is. Returns
    each file's first prompt with where it is (``hybridrl/checks.py`` checks a multi-turn run's
    first turn with it). Nothing to check without ``data.train_files``."""
    first: list[tuple[str, Prompt]] = []
    if not cfg.data.train_files:
        return first
    from hybridrl.data.source import DatasetTask  # source.py uses check_columns

    task = DatasetTask(cfg)  # checks the paths
    for key, role, paths in (
        ("data.train_files", "train", task.train_paths),
        ("data.val_files", "val", task.val_paths),
    ):
        for path in paths:
            where = f"{key}: {str(path)!r}"
            columns, features, row = first_row(path, key, role)
            check_columns(columns, features, cfg.data, where)
            if row is None:  # an empty file: the whole data's emptiness is checked when read
                continue
            at = f"{key} {str(path)!r} row 0"
            raw = row[cfg.data.prompt_key]
            tokenizer = task.tokenizer()
            try:
                text, special = render_text(raw, tokenizer, cfg.data, at)
                answer = None
                if cfg.data.answer_key is not None:
                    answer = dig(row, cfg.data.answer_key, at)
            except RowError:  # the row's own problem: dropped and counted when the data is read
                continue
            check_encodable([(at, text)], tokenizer, {})
            ids = encode([text], tokenizer, special, at)[0]
            prompt = Prompt(
                uid=f"{role}-r0",
                text=text,
                answer="" if answer is None else str(answer),
                task_id=task.name,
                token_ids=tuple(ids),
                raw=raw,
                columns={k: v for k, v in row.items() if k != cfg.data.prompt_key},
            )
            first.append((at, prompt))
    return first
