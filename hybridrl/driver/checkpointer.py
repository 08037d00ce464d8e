"""The drivers' checkpoint saves: in the step (:func:`~hybridrl.driver.checkpoint.save_checkpoint`),
or in the background with ``trainer.async_save``.

A background save of step N: the step makes ``.tmp-step_N/``, every learner rank snapshots its
trained state to host memory (weights, optimizer, RNG; refusing non-finite weights at once) and
starts a thread writing it there (``Learner.save_checkpoint(..., marker=)``); then the step
returns and training goes on. A driver thread writes ``trainer.json`` (the state given to the
step) and ``config.yaml``, waits for every rank's marker (``.written-rank<r>``, written by the
rank's thread after its files are fsynced, holding its failure if any), removes the markers,
hashes every file into ``manifest.json``, renames the directory into place and rotates the old
checkpoints: the synchronous path's steps, in the same order, so a crash at any point leaves the
previous checkpoint the newest complete one.

At most one save is in flight: the next save and the end of the run wait for it (a resume starts
after the end of the run it resumes). A failed background save (a full disk, a write error) removes
its temporary directory and is raised at the next step (:meth:`Checkpointer.check`) or at the end,
with the synchronous path's one-line message; a rank whose write fails removes its partial files
at once (``Learner.save_checkpoint``), so a full disk is usable again for its marker and the run's
logs.
A run that fails while a save is in flight gives the ranks a few seconds to end their writes, then
completes the save or removes it; one still being written after that is left as ``.tmp-step_N/``,
which the next run removes before its first step, as it removes any an earlier process left.

Before the first step (:meth:`Checkpointer.check`) the checkpoints directory is checked: a symbolic
link loop, an immutable or read-only directory stop the run then, in one line, not after the first
``save_every`` steps.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
import time
from pathlib import Path

from hybridrl.config import Config
from hybridrl.driver.checkpoint import (
    CheckpointError,
    begin,
    check_writable,
    fail,
    kept_text,
    publish,
    remove_partial,
    remove_path,
    rotate,
    save_checkpoint,
    save_error,
    staging_dir,
    write_driver_files,
    write_manifest,
)

log = logging.getLogger(__name__)

MARKER = ".written"  # a learner rank's background writes are done: .written-rank<r>
POLL_S = 0.02  # how often the driver thread looks for the ranks' markers
# a failing run waits this long for the ranks' writes in flight, so that their save is completed or
# removed rather than left half written
ABANDON_WAIT_S = 10.0


class BackgroundWriteError(RuntimeError):
    """A learner rank's background write failed with something other than an ``OSError``; the
    message is that exception's ``Type: message``."""


def rebuilt(failure: dict) -> Exception:
    """The exception a learner rank's thread reported (``learner/state.py``:
    ``describe_failure``), rebuilt in this process: an ``OSError`` when it was one."""
    if failure.get("errno") is not None or failure.get("filename"):
        strerror = failure.get("strerror") or failure["message"]
        return OSError(failure.get("errno"), strerror, failure.get("filename"))
    return BackgroundWriteError(f"{failure['type']}: {failure['message']}")


class Checkpointer:
    """Saves for a driver loop over ``roles``: :meth:`save` each due step, :meth:`check` at each
    step's start, :meth:`close` after the last step (``abandon=True`` on the way out of a failed
    run: never raises, never waits for a worker)."""

    def __init__(self, run_dir: Path, roles, cfg: Config):
        self.run_dir, self.roles, self.cfg = run_dir, roles, cfg
        self.background = cfg.trainer.async_save
        self.thread: threading.Thread | None = None
        self.error: CheckpointError | None = None
        self.stop = threading.Event()  # stop waiting for markers: the ranks' threads are done
        self.abandon = False  # a failed run: leave the temporary directory as it is
        self.failures: list[dict] = []  # the ranks' failures, as their wait_checkpoint said
        remove_partial(run_dir)  # what a process stopped mid-save left
        try:  # raised by the first check(): inside the driver's loop, which shuts the workers down
            check_writable(run_dir)
        except CheckpointError as exc:
            self.error = exc

    def save(self, step: int, trainer_state: dict) -> None:
        """Save ``step``; in the background with ``trainer.async_save`` (after waiting for the
        save in flight)."""
        if not self.background:
            save_checkpoint(self.run_dir, step, self.roles, trainer_state, self.cfg)
            return
        self.wait()
        tmp = staging_dir(self.run_dir, step)
        try:
            begin(tmp)
            markers = self.roles.learner.save_checkpoint(
                str(tmp / "model"), str(tmp / "critic"), str(tmp / MARKER)
            )
        except BaseException as exc:
            # a rank that did start writing into tmp (another one failed) finishes first
            self._wait_learner(quiet=True)
            fail(exc, step, tmp, self.run_dir)
        self.stop.clear()
        self.abandon, self.failures = False, []
        self.thread = threading.Thread(
            target=self._finish,
            args=(step, tmp, markers, copy.deepcopy(trainer_state)),
            name="checkpoint-finish",
            daemon=True,
        )
        self.thread.start()

    def check(self) -> None:
        """Raise the failure of a background save that has ended, or of the check of the
        checkpoints directory, once."""
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def wait(self) -> None:
        """Wait for the save in flight (every rank's writes, then the manifest and the rename);
        raise its failure."""
        if self.thread is not None:
            try:
                self._wait_learner()
            finally:
                self.stop.set()
                self.thread.join()
                self.thread = None
        self.check()

    def close(self, abandon: bool = False) -> None:
        """The end of the run: :meth:`wait`. ``abandon``: the run failed; a save whose ranks end
        their writes within ``ABANDON_WAIT_S`` is completed (or removed when a write failed), one
        still being written is left (never published: the next run removes it), and a failure is
        logged, not raised."""
        if not abandon:
            self.wait()
            return
        if self.thread is not None:
            self.abandon = True
            self.stop.set()
            self.thread.join()
            self.thread = None
        if self.error is not None:
            log.error("%s", self.error)
            self.error = None

    def _wait_learner(self, quiet: bool = False) -> None:
        try:
            self.failures = [f for f in self.roles.learner.wait_checkpoint() if f]
        except BaseException:
            self.abandon = True  # a rank is gone: its thread may still write
            if not quiet:
                raise

    def _finish(self, step: int, tmp: Path, markers: list[str], trainer_state: dict) -> None:
        written: Exception | None = None
        try:  # while the ranks write
            write_driver_files(tmp, step, trainer_state, self.cfg)
        except Exception as exc:  # noqa: BLE001 -- raised below, once the ranks are done
            written = exc
        try:
            failures = self._await(markers)
            if failures is None:  # abandoned while the ranks were still writing
                log.warning(
                    "step %d: the run stopped while its checkpoint was still being written: %s is "
                    "left, and removed when the run next starts",
                    step,
                    tmp,
                )
                return
            if written is not None:
                raise written
            if failures:
                raise rebuilt(failures[0])
            for marker in markers:
                Path(marker).unlink()
            write_manifest(tmp, step)
            publish(tmp, step)
        except BaseException as exc:  # noqa: BLE001 -- raised in the driver by check()/wait()
            error = save_error(exc, step, tmp, self.run_dir) if isinstance(exc, Exception) else None
            if error is None:
                what = " ".join(str(exc).split())
                if not isinstance(exc, BackgroundWriteError):
                    what = f"{type(exc).__name__}: {what}"
                error = CheckpointError(
                    f"step {step}: checkpoint not saved, the background write failed ({what}); "
                    f"the partial {tmp.name} was removed, {kept_text(self.run_dir, tmp)}"
                )
            remove_path(tmp)
            self.error = error
            return
        rotate(self.run_dir, step, self.cfg.trainer.keep_checkpoints)

    def _await(self, markers: list[str]) -> list[dict] | None:
        """Every rank's failure (empty: all written), once each rank has written its marker or
        :meth:`wait` said their threads are done; None when abandoned and the markers are still
        missing ``ABANDON_WAIT_S`` later."""
        deadline = None
        while not all(Path(m).exists() for m in markers):
            if not self.stop.wait(POLL_S):
                continue
            if self.abandon:
                deadline = deadline or time.monotonic() + ABANDON_WAIT_S
                if time.monotonic() >= deadline:
                    return None
                time.sleep(POLL_S)
            elif not all(Path(m).exists() for m in markers):
                # the threads are done, yet a marker is missing: writing it failed
                return self.failures or [
                    {"type": "RuntimeError", "message": "a learner rank wrote no marker"}
                ]
        found = [json.loads(Path(m).read_text() or "{}") for m in markers]
        return [f for f in found if not f.get("ok")]
