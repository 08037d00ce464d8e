"""Checks of a dataset's columns, and :func:`check_data`: what can be checked before a run starts
without reading the whole data."""

from __future__ import annotations

import json
from pathlib import Path
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


def check_data(cfg: Config) -> None:
    """Before any work starts: the paths of ``data.train_files`` / ``data.val_files``, and the first
    row of each file (its columns, its answer, its prompt rendered with the run's tokenizer, the
    characters the tokenizer cannot encode and, with an environment, the first turn's context:
    :func:`check_first_turn`). Raises :class:`DataError` (one line). Reads only those rows; the
    rest (every row, ``rows.py``) is checked when the run reads the data, and a first row with a
    problem of its own (a null prompt) is dropped and counted then, as any row is. Nothing to check
    without ``data.train_files``."""
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
            if cfg.env.name is not None:
                prompt = Prompt(
                    uid=f"{role}-r0",
                    text=text,
                    answer="" if answer is None else str(answer),
                    task_id=task.name,
                    token_ids=tuple(ids),
                    raw=raw,
                    columns={k: v for k, v in row.items() if k != cfg.data.prompt_key},
                )
                check_first_turn(cfg, tokenizer, prompt, ids, at)


def check_first_turn(cfg: Config, tokenizer, prompt: Prompt, ids: list[int], where: str) -> None:
    """A multi-turn prompt (``env.name`` set) whose first turn cannot fit the model's positions:
    the prompt, the environment's reset observation (e.g. the tool schemas of ``describe_tools``)
    and ``rollout.max_new_tokens`` for the model's first turn. Such a run would end every
    trajectory at once, empty and truncated."""
    positions = model_positions(cfg, tokenizer)
    if positions is None:
        return
    from hybridrl.rollout.multiturn import first_turn_context  # it imports this package

    try:
        context = first_turn_context(cfg, tokenizer, prompt, ids)
    except Exception as e:
        message = " ".join(str(e).split()) or type(e).__name__
        raise DataError(f"{where}: the environment's reset failed on this prompt: {message}") from e
    need = len(context) + cfg.rollout.max_new_tokens
    if need > positions:
        raise DataError(
            f"{where}: the first turn needs {need} positions, above the model's {positions}: "
            f"the prompt ({len(ids)} tokens), the environment's reset observation "
            f"({len(context) - len(ids)} tokens) and rollout.max_new_tokens="
            f"{cfg.rollout.max_new_tokens}; shorten the prompts or the observation (env.kwargs, "
            "e.g. describe_tools), or lower rollout.max_new_tokens"
        )


def model_positions(cfg: Config, tokenizer) -> int | None:
    """The model's positions (``max_position_embeddings``): a checkpoint's config.json, or the
    built-in model's; None where unknown."""
    if cfg.model.path is None:
        from hybridrl.models.factory import model_size_config

        try:
            return model_size_config(cfg.model.name, tokenizer).max_position_embeddings
        except ValueError:  # an unknown model name is reported where the model is built
            return None
    try:
        config = json.loads((Path(cfg.model.path).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    positions = config.get("max_position_embeddings") if isinstance(config, dict) else None
    return positions if isinstance(positions, int) else None
