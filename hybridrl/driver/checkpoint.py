"""Trainer checkpoints: ``<run>/checkpoints/step_NNNNNN/`` with ``model/``, ``critic/``,
``trainer.json``, ``config.yaml`` and ``manifest.json``.

``model/`` is the policy in transformers format (plus ``train_state.pt``: optimizer and RNG);
``critic/`` the same for the value model when the run has one.

Written to a temporary directory: every file is fsynced, given the mode the umask gives any new file
(safetensors writes 0600) and hashed, ``manifest.json`` (each file's size and sha256) is written
last, then the directory is renamed into place and its parent fsynced, so a crash mid-save leaves
the previous checkpoint loadable; the last K are kept. A save never writes non-finite weights (the
learner refuses them); a failed save (a full disk, an unwritable or immutable directory, a symbolic
link loop) raises one line, removes its temporary directory and leaves the older checkpoints whole:
an old checkpoint is removed by one rename first, so it is either gone or untouched.

Anything under ``checkpoints/`` named ``.tmp-*`` is not a checkpoint (a save being written, a
directory being removed): the next run removes what an earlier process left.

:func:`latest_checkpoint` returns the newest checkpoint that verifies against its manifest. One
without a manifest (an older version's, or one whose manifest was lost) is checked for the damage
its files show by themselves (a truncated safetensors file, a torch archive's CRCs); since a flipped
bit in its weights cannot show, it is never loaded as it is: ``--resume`` stops, naming it, until it
is sealed (``python -m hybridrl.driver.checkpoint seal DIR`` writes its manifest) or deleted.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import zipfile
import zlib
from pathlib import Path
from typing import NoReturn

from hybridrl.config import Config, dump_yaml
from hybridrl.models import new_file_mode

log = logging.getLogger(__name__)

PREFIX = "step_"
TMP = ".tmp-"  # not a checkpoint: a save being written, a directory being removed
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
# trainer.json keys a resume reads
REQUIRED_KEYS = ("step", "prompt_cursor", "reference_path", "before")
CHUNK = 1 << 20  # bytes read at a time when hashing
# a torch write error (it carries no errno) with less than this free, or less than a checkpoint
# takes, ran out of space
FULL_BELOW = 64 << 20
# an errno that only a message carries: Python's "[Errno 28]", Rust's "(os error 28)" (safetensors)
ERRNO_IN_TEXT = re.compile(r"\[Errno (\d+)\]|\(os error (\d+)\)")
UNWRITABLE = (errno.EPERM, errno.EACCES, errno.EROFS)
MAKE_WRITABLE = "make it writable (chattr -i if it is immutable, chmod u+w, or a read-write mount)"


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or resumed from; the message is one line saying why and
    what to do."""


# --- saving -------------------------------------------------------------------------------------


def save_checkpoint(run_dir: Path, step: int, roles, trainer_state: dict, cfg: Config) -> Path:
    """Write ``step_NNNNNN/`` (through ``.tmp-step_NNNNNN/``) and drop all but the newest
    ``keep_checkpoints``. Raises :class:`CheckpointError` (nothing written, nothing rotated, the
    temporary directory removed) when the weights are not finite or a write fails."""
    tmp = staging_dir(run_dir, step)
    try:
        begin(tmp)
        # critic: when there is one
        roles.learner.save_checkpoint(str(tmp / "model"), str(tmp / "critic"))
        write_driver_files(tmp, step, trainer_state, cfg)
        write_manifest(tmp, step)
        final = publish(tmp, step)
    except BaseException as exc:  # interrupted too (a hung step stopped): no partial save stays
        fail(exc, step, tmp, run_dir)
    rotate(run_dir, step, cfg.trainer.keep_checkpoints)
    return final


def staging_dir(run_dir: Path, step: int) -> Path:
    """``.tmp-step_NNNNNN/``: where the checkpoint of ``step`` is written."""
    return run_dir / "checkpoints" / f"{TMP}{PREFIX}{step:06d}"


def begin(tmp: Path) -> None:
    """A fresh, empty ``tmp`` (``checkpoints/`` made when missing). Raises
    :class:`CheckpointError` when ``checkpoints/`` is a symbolic link loop or not a directory."""
    root = tmp.parent
    if os.path.lexists(root) and (problem := _not_a_directory(root)):
        raise CheckpointError(f"{root} {problem}: remove it")
    remove_path(tmp)
    tmp.mkdir(parents=True)


def write_driver_files(tmp: Path, step: int, trainer_state: dict, cfg: Config) -> None:
    """``trainer.json`` (``{"step", **trainer_state}``) and ``config.yaml``, fsynced."""
    _write_synced(tmp / "trainer.json", json.dumps({"step": step, **trainer_state}, indent=1))
    _write_synced(tmp / "config.yaml", dump_yaml(cfg))


def publish(tmp: Path, step: int) -> Path:
    """``tmp`` (complete, with its manifest) becomes ``step_NNNNNN/``. Whatever had that name goes:
    a link or a file (a symbolic link loop too) is unlinked, never followed; a directory (a
    checkpoint of a timeline a resume left) is renamed aside first and put back when the rename of
    ``tmp`` fails."""
    root = tmp.parent
    final = root / f"{PREFIX}{step:06d}"
    aside = None
    if os.path.lexists(final):
        if final.is_symlink() or not final.is_dir():
            final.unlink()
        else:
            aside = root / f"{TMP}replaced-{final.name}"
            remove_path(aside)
            os.replace(final, aside)
    try:
        os.replace(tmp, final)
    except OSError:
        if aside is not None:
            os.replace(aside, final)
        raise
    _fsync_dir(root)
    if aside is not None:
        remove_path(aside)
    return final


def fail(exc: BaseException, step: int, tmp: Path, run_dir: Path) -> NoReturn:
    """Remove ``tmp`` and raise the one-line :class:`CheckpointError` for ``exc`` (or ``exc``
    itself when it is none of the failures handled here)."""
    error = save_error(exc, step, tmp, run_dir) if isinstance(exc, Exception) else None
    remove_path(tmp)
    if error is None:
        raise exc
    raise error from exc


def rotate(run_dir: Path, step: int, keep: int) -> None:
    """After saving ``step``: remove the checkpoints of later steps (a timeline a resume left
    behind, e.g. damaged ones it skipped: they would otherwise sort after the new saves and rotate
    the good ones out), then keep the newest ``keep`` of the rest (``step`` among them). The save
    is done: a checkpoint that cannot be removed stays whole, with a warning."""
    ckpts = list_checkpoints(run_dir)
    later = [c for c in ckpts if step_of(c) > step]
    for old in later + [c for c in ckpts if step_of(c) <= step][:-keep]:
        discard(old)


def discard(ckpt: Path) -> None:
    """Remove the checkpoint ``ckpt`` whole or not at all: a link (a loop too) or a file is
    unlinked (a link's target is left alone), a directory renamed to ``.tmp-removed-step_N`` (one
    step: it is no checkpoint from then on) and then deleted. One that cannot be renamed (an
    immutable one) stays as it was."""
    try:
        if ckpt.is_symlink() or not ckpt.is_dir():
            ckpt.unlink()
            return
        doomed = ckpt.parent / f"{TMP}removed-{ckpt.name}"
        remove_path(doomed)
        os.replace(ckpt, doomed)
    except OSError as exc:
        log.warning(
            "could not remove the old checkpoint %s (%s): it stays as it was; remove it when "
            "convenient",
            ckpt,
            exc.strerror or exc,
        )
        return
    remove_path(doomed)


def remove_partial(run_dir: Path) -> None:
    """Remove every ``.tmp-*`` under ``checkpoints/``: what an earlier process left when it was
    stopped mid-save or mid-removal (never a checkpoint: those are renamed into place whole)."""
    root = run_dir / "checkpoints"
    with contextlib.suppress(OSError):
        for p in root.iterdir():
            if p.name.startswith(TMP):
                remove_path(p)


def check_writable(run_dir: Path) -> None:
    """Raise :class:`CheckpointError` unless checkpoints can be saved under ``run_dir``:
    ``checkpoints/`` is a directory (made when missing; not a symbolic link loop) in which a
    directory can be made. Checked by making one: what the permissions say is not the whole story
    (an immutable directory, a read-only mount, root on a network filesystem)."""
    root = run_dir / "checkpoints"
    if os.path.lexists(root) and (problem := _not_a_directory(root)):
        raise CheckpointError(f"checkpoints cannot be saved: {root} {problem}: remove it")
    problem = writable_problem(root, create=True)
    if problem:
        raise CheckpointError(f"checkpoints cannot be saved: {problem}")


def writable_problem(path: Path, create: bool = False) -> str | None:
    """Why directory ``path`` cannot be written (``"<path> cannot be written (<why>): make it
    writable (...)"``), or None. ``create``: make ``path`` first when it is missing."""
    try:
        if create:
            path.mkdir(parents=True, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(prefix=f"{TMP}probe-", dir=path))
    except OSError as exc:
        todo = (
            MAKE_WRITABLE
            if exc.errno in UNWRITABLE
            else "free space on it"
            if exc.errno in (errno.ENOSPC, errno.EDQUOT)
            else "check it"
        )
        return f"{path} cannot be written ({exc.strerror}): {todo}"
    return None


def write_manifest(ckpt: Path, step: int) -> dict:
    """fsync every file under ``ckpt`` (each given the mode the umask gives a new file) and each
    directory, then write ``manifest.json`` (``{"format", "step", "files": {relative path:
    {"size", "sha256"}}}``), fsynced."""
    files, mode = {}, new_file_mode()
    for path in sorted(p for p in ckpt.rglob("*") if p.is_file() and p.name != MANIFEST):
        if path.stat().st_mode & 0o777 != mode:
            path.chmod(mode)
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


def remove_path(path: Path) -> None:
    """Remove ``path`` whatever it is (a link is unlinked, never followed), as far as it can be
    removed: what stays is a ``.tmp-*`` the next run removes."""
    with contextlib.suppress(OSError):
        if path.is_symlink() or (os.path.lexists(path) and not path.is_dir()):
            path.unlink()
        elif path.is_dir():
            shutil.rmtree(path, ignore_errors=True)


def _not_a_directory(path: Path) -> str | None:
    """What ``path`` (an existing name) is when it is no directory: ``"is a symbolic link loop"``,
    a link to nothing, a file; None for a directory (or a link to one)."""
    try:
        os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "is a symbolic link loop"
        if exc.errno == errno.ENOENT:
            return f"is a symbolic link to {os.readlink(path)}, which does not exist"
        return f"cannot be read ({exc.strerror})"
    return None if path.is_dir() else "is not a directory"


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


def _tree_bytes(path: Path) -> int:
    with contextlib.suppress(OSError):
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return 0


def _last_line(text: str) -> str:
    """The last non-empty line of ``text`` (a DCP error holds a whole traceback; its last line is
    the failure)."""
    return next((x.strip() for x in reversed(text.splitlines()) if x.strip()), text.strip())


def _kept(run_dir: Path, tmp: Path) -> list[Path]:
    return [p for p in list_checkpoints(run_dir) if p != tmp and p.is_dir()]


def kept_text(run_dir: Path, tmp: Path) -> str:
    good = _kept(run_dir, tmp)
    return (
        f"the last good checkpoint {good[-1]} is kept" if good else "no earlier checkpoint exists"
    )


def save_error(exc: Exception, step: int, tmp: Path, run_dir: Path) -> CheckpointError | None:
    """The one-line error for a failed save, or None when ``exc`` is none of the failures
    handled here (it is re-raised as it is). Called before ``tmp`` is removed."""
    chain = _chain(exc)
    text = " ".join(str(e) for e in chain)
    good = _kept(run_dir, tmp)
    kept = kept_text(run_dir, tmp)
    partial = f"the partial {tmp.name} was removed, " if os.path.lexists(tmp) else ""
    refused = next((e for e in chain if isinstance(e, CheckpointError)), None)
    if refused is not None:
        return CheckpointError(f"step {step}: checkpoint not saved, {refused}; {partial}{kept}")
    nonfinite = next((e for e in chain if type(e).__name__ == "NonFiniteWeightsError"), None)
    if nonfinite is not None or "NonFiniteWeightsError" in text:
        what = str(nonfinite) if nonfinite is not None else text
        return CheckpointError(f"step {step}: checkpoint not saved, {what}; {kept}")
    os_err = next((e for e in chain if isinstance(e, OSError)), None)
    code = os_err.errno if os_err is not None else None
    if code is None and (found := ERRNO_IN_TEXT.search(text)):
        code = int(found.group(1) or found.group(2))
    torch_write = any(s in text for s in ("inline_container", "unexpected pos", "StreamWriter"))
    if os_err is None and code is None and not torch_write:
        return None
    where = Path((os_err.filename if os_err is not None else None) or tmp)
    free = _free_bytes(tmp)
    takes = _tree_bytes(good[-1]) if good else 0
    guessed_full = free is not None and free < max(FULL_BELOW, takes)
    if code in (errno.ENOSPC, errno.EDQUOT) or (code is None and guessed_full):
        left = f"{free / 2**20:.1f} MiB free" if free is not None else "free space unknown"
        if takes:
            left += f", a checkpoint takes {takes / 2**20:.1f} MiB"
        what = f"no space left on device while writing {where} ({left})"
    elif code in UNWRITABLE:
        what = f"{where.parent} cannot be written ({os.strerror(code)}): {MAKE_WRITABLE}"
    elif code == errno.ELOOP:
        what = f"{where} passes through a symbolic link loop: remove the link"
    elif code is not None:
        what = f"{os.strerror(code)} while writing {where}"
    else:
        what = f"write failed while writing {where}: {_last_line(str(chain[-1]))}"
    return CheckpointError(f"step {step}: checkpoint not saved, {what}; {partial}{kept}")


# --- finding and verifying ----------------------------------------------------------------------


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Every ``step_NNNNNN`` entry, oldest first (complete or not, a directory or not: see
    :func:`verify_checkpoint`)."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    done = [
        p for p in root.iterdir() if p.name.startswith(PREFIX) and p.name[len(PREFIX) :].isdigit()
    ]
    return sorted(done, key=step_of)


def step_of(ckpt: Path) -> int:
    return int(ckpt.name[len(PREFIX) :])


def verify_checkpoint(ckpt: Path) -> tuple[str | None, dict | None, bool]:
    """``(problem, trainer_state, has_manifest)``: ``problem`` is None when every file the manifest
    lists has its size and sha256 and ``trainer.json`` is readable with the keys a resume needs; a
    checkpoint without a manifest gets the checks its files allow by themselves
    (:func:`_check_files`) and the ``trainer.json`` check."""
    problem = _not_a_directory(ckpt)
    if problem:
        return f"it {problem}", None, False
    has_manifest = (ckpt / MANIFEST).exists()
    if has_manifest:
        problem = _check_manifest(ckpt)
    elif not (ckpt / "model").is_dir():
        problem = "model/ is missing"
    else:
        problem = _check_files(ckpt)
    if problem:
        return problem, None, has_manifest
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
    if state["step"] != step_of(ckpt):
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


def _check_files(ckpt: Path) -> str | None:
    """Without a manifest: the damage files show by themselves. A safetensors file's length must be
    the one its header gives; a torch file (a zip archive) must be whole with every member's CRC
    right. A flipped bit in a safetensors file's tensors shows nowhere."""
    for path in sorted(p for p in ckpt.rglob("*") if p.is_file()):
        rel = path.relative_to(ckpt).as_posix()
        try:
            if path.suffix == ".safetensors":
                problem = _safetensors_problem(path)
            elif path.suffix == ".pt":
                problem = _zip_problem(path)
            else:
                continue
        except OSError as exc:
            problem = f"is unreadable ({exc.strerror or exc})"
        if problem:
            return f"{rel} {problem}"
    return None


def _safetensors_problem(path: Path) -> str | None:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else None
        if n is None or n > size - 8:
            return f"is truncated ({size} bytes, shorter than its header)"
        try:
            header = json.loads(f.read(n))
            ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            return "has an unreadable header"
    expected = 8 + n + max(ends, default=0)
    if size != expected:
        kind = "truncated" if size < expected else "too long"
        return f"is {kind} ({size} bytes, its header says {expected})"
    return None


def _zip_problem(path: Path) -> str | None:
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, EOFError, ValueError, zlib.error):
        return "is not a whole zip archive (truncated or overwritten)"
    return f"fails its CRC check (member {bad})" if bad else None


def unverifiable_text(ckpt: Path) -> str:
    return (
        f"checkpoint {ckpt} has no {MANIFEST}, so its files cannot be verified (a flipped bit in "
        f"its weights would load silently); if you trust it, seal it with `python -m "
        f"hybridrl.driver.checkpoint seal {ckpt}` (writes its manifest), else delete it to resume "
        "from the one before"
    )


def latest_checkpoint(run_dir: Path) -> tuple[Path, dict] | None:
    """The newest checkpoint that verifies, with its ``trainer.json``. Each newer one that does not
    is reported in one warning (which checkpoint, what is wrong) and skipped. Raises
    :class:`CheckpointError` when the newest one that shows no damage has no manifest: loading it
    could load a flipped bit, and resuming from an older one would delete it at the next save."""
    root = run_dir / "checkpoints"
    if os.path.lexists(root) and (problem := _not_a_directory(root)):
        log.warning("%s %s: no checkpoint can be read from it", root, problem)
        return None
    for ckpt in reversed(list_checkpoints(run_dir)):
        problem, state, has_manifest = verify_checkpoint(ckpt)
        if problem:
            log.warning("checkpoint %s is damaged: %s; trying an older one", ckpt, problem)
            continue
        if not has_manifest:
            raise CheckpointError(unverifiable_text(ckpt))
        return ckpt, state
    return None


def seal_checkpoint(ckpt: Path) -> bool:
    """Write the manifest of a checkpoint that has none, once the checks its files allow by
    themselves pass; False when it has one already and verifies against it. Raises
    :class:`CheckpointError` naming what is wrong."""
    problem, _, has_manifest = verify_checkpoint(ckpt)
    if problem:
        what = f"it does not match its {MANIFEST}" if has_manifest else "it is damaged"
        raise CheckpointError(f"{ckpt} is not sealed: {what} ({problem}); delete it")
    if has_manifest:
        return False
    write_manifest(ckpt, step_of(ckpt))
    return True


def main(argv: list[str] | None = None) -> int:
    """``python -m hybridrl.driver.checkpoint seal DIR...``: :func:`seal_checkpoint` each."""
    p = argparse.ArgumentParser(
        prog="python -m hybridrl.driver.checkpoint",
        description="Write the manifest of a checkpoint that has none (an older version's, or one "
        "whose manifest was lost), so that --resume takes it: only for a checkpoint you trust, "
        "since a flipped bit in its weights cannot be found.",
    )
    p.add_argument("command", choices=["seal"])
    p.add_argument("checkpoints", nargs="+", type=Path, help="step_NNNNNN directories")
    args = p.parse_args(argv)
    for ckpt in args.checkpoints:
        try:
            sealed = seal_checkpoint(ckpt)
        except CheckpointError as e:
            print(f"hybridrl: error: {e}", file=sys.stderr)
            return 1
        print(f"{'sealed' if sealed else 'already sealed'} {ckpt}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
