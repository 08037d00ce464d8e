"""Reading a user's data files into one HF ``datasets.Dataset``.

``data.train_files`` / ``data.val_files`` name a path or a list of paths: ``.jsonl``, ``.json``,
``.parquet`` or ``.csv`` files, or directories written by ``Dataset.save_to_disk``. The files of a
list are read in order and concatenated (they must share their columns). Everything is read into
memory: ``datasets`` builds its Arrow files in a temporary directory that is removed afterwards, so
nothing accumulates under ``~/.cache``, and its progress bars are off while reading.

Every problem is a :class:`DataError`: one line naming the config key, the path and what is allowed.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hybridrl.config import ConfigError

# file suffix -> the datasets builder that reads it
FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
ALLOWED = ".jsonl, .json, .parquet, .csv, or a directory written by datasets' save_to_disk"
# the split taken from a saved DatasetDict with several splits, by role
SPLITS = {"train": ("train",), "val": ("validation", "val", "test")}


class DataError(ConfigError):
    """A problem with a user's data (files, columns, prompts); the message is one line."""


def as_paths(files: str | list[str] | None, key: str) -> list[Path]:
    """``files`` as a list of existing paths of an allowed kind (checked without reading them)."""
    names = [files] if isinstance(files, str) else list(files or [])
    if not names:
        raise DataError(f"{key} is empty: give a path or a list of paths ({ALLOWED})")
    paths = []
    for name in names:
        path = Path(name).expanduser()
        if not path.exists():
            raise DataError(f"{key}: {name!r} does not exist")
        if path.is_dir():
            if (
                not (path / "dataset_info.json").is_file()
                and not (path / "dataset_dict.json").is_file()
            ):
                raise DataError(
                    f"{key}: directory {name!r} was not written by datasets' save_to_disk (no "
                    f"dataset_info.json or dataset_dict.json); name its files instead ({ALLOWED})"
                )
        elif path.suffix.lower() not in FORMATS:
            raise DataError(
                f"{key}: {name!r} has an unknown extension {path.suffix or '(none)'!r}; "
                f"allowed: {ALLOWED}"
            )
        paths.append(path)
    return paths


def read_files(
    paths: list[Path],
    key: str,
    role: str = "train",
    check: Callable[[Any, str], None] | None = None,
):
    """One in-memory ``datasets.Dataset`` of all ``paths`` (from :func:`as_paths`), in order.
    ``role`` ("train" or "val") picks the split of a saved DatasetDict that has several. ``check``
    (table, "<key>: '<path>'") runs on each file's table before they are concatenated: a column
    one file lacks would otherwise be filled with nulls."""
    import datasets

    parts = []
    with _quiet():
        for path in paths:
            try:
                parts.append(_read_one(path, key, role))
            except DataError:
                raise
            except Exception as e:  # a malformed file: datasets' own message, on one line
                raise DataError(f"{key}: cannot read {str(path)!r}: {_one_line(e)}") from e
            if check is not None:
                check(parts[-1], f"{key}: {str(path)!r}" if len(paths) > 1 else key)
        if len(parts) == 1:
            return parts[0]
        try:
            return datasets.concatenate_datasets(parts)
        except ValueError as e:
            columns = "; ".join(f"{p}: {sorted(d.column_names)}" for p, d in zip(paths, parts))
            raise DataError(
                f"{key}: the files do not share their columns ({columns}): {_one_line(e)}"
            ) from e


def first_row(path: Path, key: str, role: str) -> tuple[list[str], Any, dict | None]:
    """(columns, features or None, the first row or None when empty) of one path, reading as
    little as the format allows (a file is streamed, a saved directory memory-mapped)."""
    import datasets

    try:
        with _quiet():
            if path.is_dir():
                data = datasets.load_from_disk(str(path))
                if isinstance(data, datasets.DatasetDict):
                    data = _pick_split(data, path, key, role)
                return data.column_names, data.features, data[0] if len(data) else None
            with tempfile.TemporaryDirectory(prefix="hybridrl-data-") as cache:
                data = datasets.load_dataset(
                    FORMATS[path.suffix.lower()],
                    data_files=[str(path)],
                    split="train",
                    cache_dir=cache,
                    streaming=True,
                )
                row = next(iter(data), None)
                columns = data.column_names or (list(row) if row else [])
                return columns, data.features, row
    except DataError:
        raise
    except Exception as e:  # a malformed file: datasets' own message, on one line
        raise DataError(f"{key}: cannot read {str(path)!r}: {_one_line(e)}") from e


def _read_one(path: Path, key: str, role: str):
    import datasets

    if path.is_dir():
        data = datasets.load_from_disk(str(path), keep_in_memory=True)
        if isinstance(data, datasets.DatasetDict):
            return _pick_split(data, path, key, role)
        return data
    with tempfile.TemporaryDirectory(prefix="hybridrl-data-") as cache:
        return datasets.load_dataset(
            FORMATS[path.suffix.lower()],
            data_files=[str(path)],
            split="train",
            cache_dir=cache,
            keep_in_memory=True,
        )


def _pick_split(data, path: Path, key: str, role: str):
    if len(data) == 1:
        return next(iter(data.values()))
    for name in SPLITS[role]:
        if name in data:
            return data[name]
    raise DataError(
        f"{key}: {str(path)!r} holds the splits {sorted(data)} and none of {list(SPLITS[role])}; "
        "save the one split to use (ds['<split>'].save_to_disk(...))"
    )


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """No datasets progress bars or info logging while reading (restored afterwards)."""
    from datasets.utils import logging as ds_logging

    bars = ds_logging.is_progress_bar_enabled()
    level = ds_logging.get_verbosity()
    ds_logging.disable_progress_bar()
    ds_logging.set_verbosity(logging.ERROR)
    try:
        yield
    finally:
        ds_logging.set_verbosity(level)
        if bars:
            ds_logging.enable_progress_bar()


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__
