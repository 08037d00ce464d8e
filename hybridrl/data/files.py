"""Reading a user's data files into one HF ``datasets.Dataset``.

``data.train_files`` / ``data.val_files`` name a path or a list of paths: ``.jsonl``, ``.json``,
``.parquet`` or ``.csv`` files, or directories written by ``Dataset.save_to_disk``. The files of a
list are read in order and concatenated (they must share their columns). Everything is read into
memory: ``datasets`` builds its Arrow files in a temporary directory that is removed afterwards, so
nothing accumulates under ``~/.cache``, and its progress bars are off while reading.

Text must be UTF-8. ``datasets``' readers check it unevenly: the JSON reader keeps a line's bytes
unchecked, so a Latin-1 file reads and its row fails only when a step draws it. A text file is
therefore decoded line by line before it is read, and a table's strings are validated after it is
read; either refuses the file naming the line (text) or the row and column (a table).

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
TEXT_FORMATS = (".jsonl", ".json", ".csv")  # decoded as UTF-8 before datasets reads them
_ROWS_SCANNED = 1024  # rows converted per try when a table's text is not UTF-8


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
) -> tuple[Any, list[int]]:
    """One in-memory ``datasets.Dataset`` of all ``paths`` (from :func:`as_paths`), in order, and
    each path's number of rows. ``role`` ("train" or "val") picks the split of a saved DatasetDict
    that has several. ``check`` (table, "<key>: '<path>'") runs on each file's table before they
    are concatenated: a column one file lacks would otherwise be filled with nulls."""
    import datasets

    parts = []
    with _quiet():
        for path in paths:
            if path.suffix.lower() in TEXT_FORMATS and path.is_file():
                check_utf8_text(path, key)
            try:
                parts.append(_read_one(path, key, role))
            except DataError:
                raise
            except Exception as e:  # a malformed file: datasets' own message, on one line
                raise DataError(f"{key}: cannot read {str(path)!r}: {_one_line(e)}") from e
            check_utf8_table(parts[-1], path, key)
            if check is not None:
                check(parts[-1], f"{key}: {str(path)!r}" if len(paths) > 1 else key)
        sizes = [len(part) for part in parts]
        if len(parts) == 1:
            return parts[0], sizes
        try:
            return datasets.concatenate_datasets(parts), sizes
        except ValueError as e:
            columns = "; ".join(f"{p}: {sorted(d.column_names)}" for p, d in zip(paths, parts))
            raise DataError(
                f"{key}: the files do not share their columns ({columns}): {_one_line(e)}"
            ) from e


def check_utf8_text(path: Path, key: str) -> None:
    """Raise :class:`DataError` naming the first line of the text file ``path`` that is not valid
    UTF-8 (the file is read line by line, in binary)."""
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{key}: {str(path)!r} line {number} is not valid UTF-8 (byte "
                    f"0x{line[e.start]:02x} at column {e.start + 1}); data files are UTF-8: "
                    "convert it (e.g. iconv -f latin1 -t utf-8)"
                ) from None


def check_utf8_table(data, path: Path, key: str) -> None:
    """Raise :class:`DataError` naming the first row and column of ``data`` (a
    ``datasets.Dataset`` read from ``path``) whose text is not valid UTF-8. Arrow validates the
    whole table at once; the row is looked for only when that fails."""
    import pyarrow as pa

    table = data.data.table
    try:
        table.validate(full=True)
        return
    except pa.ArrowInvalid as e:
        if "utf8" not in str(e).lower():
            raise DataError(f"{key}: cannot read {str(path)!r}: {_one_line(e)}") from e
    for start in range(0, table.num_rows, _ROWS_SCANNED):
        if _decodes(table.slice(start, _ROWS_SCANNED)):
            continue
        for row in range(start, min(start + _ROWS_SCANNED, table.num_rows)):
            for name in table.column_names:
                if not _decodes(table.slice(row, 1).select([name])):
                    raise DataError(
                        f"{key}: {str(path)!r} row {row} holds text that is not valid UTF-8 "
                        f"(column {name!r}); write the file's strings as UTF-8"
                    )
    raise DataError(f"{key}: {str(path)!r} holds text that is not valid UTF-8")


def _decodes(table) -> bool:
    try:
        table.to_pylist()
    except UnicodeDecodeError:
        return False
    return True


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
        if path.suffix.lower() in TEXT_FORMATS and path.is_file():
            check_utf8_text(path, key)  # names the line where that is the cause
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
