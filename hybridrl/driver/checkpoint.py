"""Trainer checkpoints: ``<run>/checkpoints/step_NNNNNN/`` with ``model/``, ``critic/``,
``trainer.json``, ``config.yaml`` and ``manifest.json``.

``model/`` is the policy in transformers format (plus ``train_state.pt``: optimizer and RNG);
``critic/`` the same for the value model when the run has one.

Written to a temporary directory: every file is fsynced and hashed, ``manifest.json`` (each
file's size and sha256) is written last, then the directory is renamed into place and its parent
fsynced, so a crash mid-save leaves the previous checkpoint loadable; the last K are kept. A save
never writes non-finite weights (the learner refuses them) and a failed save removes its temporary
directory.
:func:`latest_checkpoint` returns the newest checkpoint that verifies against its manifest.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import NoReturn

from hybridrl.config import Config, dump_yaml

log = logging.getLogger(__name__)

PREFIX = "step_"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
# trainer.json keys a resume reads
REQUIRED_KEYS = ("step", "prompt_cursor", "reference_path", "before")
CHUNK = 1 << 20  # bytes read at a time when hashing
# a write that failed with less than this free on the checkpoint's filesystem ran out of space
FULL_BELOW = 64 << 20


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved; the message is one line saying why and what was kept."""


# --- saving -------------------------------------------------------------------------------------


def save_checkpoint(run_dir: Path, step: int, roles, trainer_state: dict, cfg: Config) -> Path:
    """Write ``step_NNNNNN/`` (through ``.tmp-step_NNNNNN/``) and drop all but the newest
    ``keep_checkpoints``. Raises :class:`CheckpointError` (nothing written, nothing rotated, the
    temporary directory removed) when the weights are not finite or a write fails."""
    tmp = begin(run_dir, step)
    try:
        # critic: when there is one
        roles.learner.save_checkpoint(str(tmp / "model"), str(tmp / "critic"))
        write_driver_files(tmp, step, trainer_state, cfg)
        write_manifest(tmp, step)
    except BaseException as exc:  # interrupted too (a hung step stopped): no partial save stays
        fail(exc, step, tmp, run_dir)
    return publish(run_dir, step, tmp, cfg.trainer.keep_checkpoints)


def begin(run_dir: Path, step: int) -> Path:
    """A fresh, empty ``.tmp-step_NNNNNN/`` to write the checkpoint of ``step`` into."""
    tmp = run_dir / "checkpoints" / f".tmp-{PREFIX}{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def write_driver_files(tmp: Path, step: int, trainer_state: dict, cfg: Config) -> None:
    """``trainer.json`` (``{"step", **trainer_state}``) and ``config.yaml``, fsynced."""
    _write_synced(tmp / "trainer.json", json.dumps({"step": step, **trainer_state}, indent=1))
    _write_synced(tmp / "config.yaml", dump_yaml(cfg))


def publish(run_dir: Path, step: int, tmp: Path, keep: int) -> Path:
    """``tmp`` (complete, with its manifest) becomes ``step_NNNNNN/``; then the old ones rotate."""
    root = run_dir / "checkpoints"
    final = root / f"{PREFIX}{step:06d}"
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _fsync_dir(root)
    rotate(run_dir, step, keep)
    return final


def fail(exc: BaseException, step: int, tmp: Path, run_dir: Path) -> NoReturn:
    """Remove ``tmp`` and raise the one-line :class:`CheckpointError` for ``exc`` (or ``exc``
    itself when it is none of the failures handled here)."""
    error = save_error(exc, step, tmp, run_dir) if isinstance(exc, Exception) else None
    shutil.rmtree(tmp, ignore_errors=True)
    if error is None:
        raise exc
    raise error from exc


def rotate(run_dir: Path, step: int, keep: int) -> None:
    """After saving ``step``: remove the checkpoints of later steps (a timeline a resume left
    behind, e.g. damaged ones it skipped: they would otherwise sort after the new saves and rotate
    the good ones out), then keep the newest ``keep`` of the rest (``step`` among them)."""
    ckpts = list_checkpoints(run_dir)
    for stale in [c for c in ckpts if step_of(c) > step]:
        shutil.rmtree(stale, ignore_errors=True)
    for old in [c for c in ckpts if step_of(c) <= step][:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def write_manifest(ckpt: Path, step: int) -> dict:
    """fsync every file under ``ckpt`` and each directory, then write ``manifest.json``
    (``{"format", "step", "files": {relative path: {"size", "sha256"}}}``), fsynced."""
    files = {}
    for path in sorted(p for p in ckpt.rglob("*") if p.is_file() and p.name != MANIFEST):
        size, digest = _hash_file(path, sync=True)
        files[path.relative_to(ckpt).as_posix()] = {"size": size, "sha256": digest}
    for d in sorted((p for p in ckpt.rglob("*") if p.is_dir()), reverse=True):
        _fsync_dir(d)
    manifest = {"format": MANIFEST_FORMAT, "step": step, "files": files}
    _write_synced(ckpt / MANIFEST, json.dumps(manifest, indent=1))
    _fsync_dir(ckpt)
    return manifest


def _hash_file(path: Path, sync: bool = False) -> tuple[int, str]:
    """Size and sha256 of ``path``, read in chunks (never the whole file at once)."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
        if sync:
            os.fsync(f.fileno())
    return size, h.hexdigest()


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        # some filesystems cannot fsync a directory: nothing more to do there
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and what caused it: ``__cause__``/``__context__``, and a Ray task error's
    ``cause``."""
    seen, todo = [], [exc]
    while todo:
        e = todo.pop(0)
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        todo += [e.__cause__, e.__context__, getattr(e, "cause", None)]
    return [e for e in seen if isinstance(e, BaseException)]


def _free_bytes(path: Path) -> int | None:
    for p in (path, *path.parents):
        if p.exists():
            try:
                return shutil.disk_usage(p).free
            except OSError:
                return None
    return None


def kept_text(run_dir: Path, tmp: Path) -> str:
    good = [p for p in list_checkpoints(run_dir) if p != tmp]
    return (
        f"the last good checkpoint {good[-1]} is kept" if good else "no earlier checkpoint exists"
    )


def save_error(exc: Exception, step: int, tmp: Path, run_dir: Path) -> CheckpointError | None:
    """The one-line error for a failed save, or None when ``exc`` is none of the failures
    handled here (it is re-raised as it is). Called before ``tmp`` is removed."""
    chain = _chain(exc)
    text = " ".join(str(e) for e in chain)
    kept = kept_text(run_dir, tmp)
    nonfinite = next((e for e in chain if type(e).__name__ == "NonFiniteWeightsError"), None)
    if nonfinite is not None or "NonFiniteWeightsError" in text:
        what = str(nonfinite) if nonfinite is not None else text
        return CheckpointError(f"step {step}: checkpoint not saved, {what}; {kept}")
    os_err = next((e for e in chain if isinstance(e, OSError)), None)
    torch_write = any(s in text for s in ("inline_container", "unexpected pos", "StreamWriter"))
    if os_err is None and not torch_write:
        return None
    where = (os_err.filename if os_err is not None else None) or tmp
    free = _free_bytes(tmp)
    code = os_err.errno if os_err is not None else None
    no_space = code in (errno.ENOSPC, errno.EDQUOT) or (
        code is None and free is not None and free < FULL_BELOW
    )
    if no_space:
        left = f" ({free / 2**20:.1f} MiB free)" if free is not None else ""
        what = f"no space left on device while writing {where}{left}"
    elif os_err is not None:
        what = f"{os_err.strerror or os_err} while writing {where}"
    else:
        what = f"write failed while writing {where}: {chain[-1]}"
    return CheckpointError(
        f"step {step}: checkpoint not saved, {what}; the partial {tmp.name} was removed, {kept}"
    )


# --- finding and verifying ----------------------------------------------------------------------


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Every ``step_NNNNNN`` directory, oldest first (complete or not: see
    :func:`verify_checkpoint`)."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    done = [
        p
        for p in root.iterdir()
        if p.name.startswith(PREFIX) and p.name[len(PREFIX) :].isdigit() and p.is_dir()
    ]
    return sorted(done, key=step_of)


def step_of(ckpt: Path) -> int:
    return int(ckpt.name[len(PREFIX) :])


def verify_checkpoint(ckpt: Path) -> tuple[str | None, dict | None, bool]:
    """``(problem, trainer_state, has_manifest)``: ``problem`` is None when every file the manifest
    lists has its size and sha256 and ``trainer.json`` is readable with the keys a resume needs; a
    checkpoint without a manifest (an older version's) gets only the ``trainer.json`` check."""
    has_manifest = (ckpt / MANIFEST).exists()
    if has_manifest:
        problem = _check_manifest(ckpt)
        if problem:
            return problem, None, True
    elif not (ckpt / "model").is_dir():
        return "model/ is missing", None, False
    try:
        state = json.loads((ckpt / "trainer.json").read_text())
    except FileNotFoundError:
        return "trainer.json is missing", None, has_manifest
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return f"trainer.json is unreadable ({exc})", None, has_manifest
    if not isinstance(state, dict):
        return "trainer.json does not hold an object", None, has_manifest
    missing = [k for k in REQUIRED_KEYS if k not in state]
    if missing:
        return f"trainer.json lacks {', '.join(missing)}", None, has_manifest
    if state["step"] != int(ckpt.name[len(PREFIX) :]):
        return f"trainer.json says step {state['step']}", None, has_manifest
    return None, state, has_manifest


def _check_manifest(ckpt: Path) -> str | None:
    try:
        manifest = json.loads((ckpt / MANIFEST).read_text())
        files = manifest["files"]
        entries = [(rel, int(e["size"]), str(e["sha256"])) for rel, e in files.items()]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"{MANIFEST} is unreadable ({type(exc).__name__}: {exc})"
    for rel, size, sha in entries:
        path = ckpt / rel
        if not path.is_file():
            return f"{rel} is missing"
        actual = path.stat().st_size
        if actual != size:
            kind = "empty" if actual == 0 else "truncated" if actual < size else "too long"
            return f"{rel} is {kind} ({actual} bytes, the manifest says {size})"
        try:
            if _hash_file(path)[1] != sha:
                return f"{rel} does not match its sha256 in the manifest"
        except OSError as exc:
            return f"{rel} is unreadable ({exc})"
    return None


def latest_checkpoint(run_dir: Path) -> tuple[Path, dict] | None:
    """The newest checkpoint that verifies, with its ``trainer.json``. Each newer one that does not
    is reported in one warning (which checkpoint, what is wrong) and skipped; one without a
    manifest is accepted with a warning."""
    for ckpt in reversed(list_checkpoints(run_dir)):
        problem, state, has_manifest = verify_checkpoint(ckpt)
        if problem:
            log.warning("checkpoint %s is damaged: %s; trying an older one", ckpt, problem)
            continue
        if not has_manifest:
            log.warning(
                "checkpoint %s has no %s (an older version wrote it): resuming from it with its "
                "files unverified",
                ckpt,
                MANIFEST,
            )
        return ckpt, state
    return None
