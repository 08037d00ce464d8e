"""Checks of a dataset's columns, and :func:`check_data`: what can be checked before a run starts
without reading the whole data."""

from __future__ import annotations

from typing import Any

from hybridrl.config import Config
from hybridrl.config.schema import DataConfig
from hybridrl.data.files import DataError, first_row
from hybridrl.data.render import dig, render_prompt


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


def check_data(cfg: Config) -> None:
    """Before any work starts: the paths of ``data.train_files`` / ``data.val_files``, and the first
    row of each file (its columns, its answer, its prompt rendered with the run's tokenizer). Raises
    :class:`DataError` (one line). Reads only those rows; the rest (the length limit, later rows) is
    checked when the run reads the data. Nothing to check without ``data.train_files``."""
    if not cfg.data.train_files:
        return
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
            at = f"row 0 of {key} {str(path)!r}"
            render_prompt(row[cfg.data.prompt_key], task.tokenizer(), cfg.data, at)
            if cfg.data.answer_key is not None:
                dig(row, cfg.data.answer_key, at)
