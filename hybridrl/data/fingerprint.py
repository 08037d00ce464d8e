"""The data files' fingerprint: the sha256 of each file's bytes, recorded in a run's trainer state
(so in every checkpoint) and compared when the run is resumed.

A resumed run continues the prompt stream by index (``source.py``), which is the same stream only on
the same rows: a file edited, reordered or replaced between the checkpoint and ``--resume`` would
train on other prompts with nothing said. Sizes and modification times cannot tell (a copy keeps the
size, a touch changes the time), so the bytes are hashed, streaming; a directory written by
``save_to_disk`` hashes its files' relative names and bytes in name order. Only the bytes count: the
same files moved elsewhere are the same data.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from hybridrl.config import Config
from hybridrl.data.files import DataError, as_paths

log = logging.getLogger(__name__)

STATE_KEY = "data_sha256"  # in the trainer state: {config key: [one hex digest per file]}
_KEYS = ("data.train_files", "data.val_files")


def data_fingerprint(cfg: Config) -> dict[str, list[str]] | None:
    """``{"data.train_files": [sha256, ...], "data.val_files": [...]}`` of the config's data
    files (a key without files is left out); None when the run reads no data files."""
    if not cfg.data.train_files:
        return None
    found = {}
    for key, files in zip(_KEYS, (cfg.data.train_files, cfg.data.val_files)):
        if files:
            found[key] = [path_sha256(path) for path in as_paths(files, key)]
    return found


def path_sha256(path: Path) -> str:
    """The hex sha256 of a file's bytes, or of a directory's files (relative names and bytes)."""
    digest = hashlib.sha256()
    if path.is_dir():
        for file in sorted(p for p in path.rglob("*") if p.is_file()):
            name = file.relative_to(path).as_posix().encode()
            digest.update(len(name).to_bytes(8, "little") + name)
            digest.update(bytes.fromhex(_file_sha256(file)))
    else:
        return _file_sha256(path)
    return digest.hexdigest()


def check_unchanged(
    saved: dict[str, list[str]] | None,
    current: dict[str, list[str]] | None,
    cfg: Config,
    checkpoint: Path,
    force: bool,
) -> None:
    """Raise :class:`DataError` (one line) when the data files differ from those the checkpoint's
    run read (``saved``: its trainer state's fingerprint); with ``force``, log it and go on. Nothing
    to compare when the checkpoint records none (a run that read no data files)."""
    if saved is None or current is None or saved == current:
        return
    what = ""
    for key, files in zip(_KEYS, (cfg.data.train_files, cfg.data.val_files)):
        old, new = saved.get(key, []), current.get(key, [])
        if len(old) != len(new):
            what = f"{key} names {len(new)} file(s) where the run read {len(old)}"
            break
        changed = [i for i, (a, b) in enumerate(zip(old, new)) if a != b]
        if changed:
            path = as_paths(files, key)[changed[0]]
            what = f"{key} {str(path)!r} changed"
            break
    message = (
        f"{what} since the checkpoint {str(checkpoint)!r} was saved (the sha256 of its bytes "
        "differs): resuming would train on other prompts than the run would have"
    )
    if force:
        log.warning(
            "--resume-changed-data: %s; the run goes on with the data as it is now", message
        )
        return
    raise DataError(
        f"{message}; restore the data, start a new run (another trainer.name), or resume on the "
        "changed data with --resume-changed-data (Python: resume=Resume(changed_data=True))"
    )


def _file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
