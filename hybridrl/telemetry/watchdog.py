"""Hang detection for the driver loop: a step past ``trainer.step_timeout_s`` stops the run.

A :class:`Watchdog` thread in the driver is armed at the start of each step and disarmed at its end
(``for step in watchdog.steps(...)``, inside ``with watchdog:``). When a step runs past the timeout
it

1. dumps every process's Python stacks into ``<run>/hang/``: the driver's own (all threads, hence
   every ``local`` rank too, which live in the driver) into ``driver.txt``, and each ``ray`` rank's
   into ``<role>-rank<r>.txt`` (:meth:`WorkerGroup.dump_stacks`: the rank's process was registered
   with :mod:`faulthandler` for ``SIGUSR1`` at startup; ``py-spy`` dumps are added when it is on
   the PATH);
2. marks every ``ray`` group with a call still in flight as abandoned (later calls fail at once
   instead of queueing behind the hung one, so the shutdown that follows does not wait on it; the
   shutdown kills those processes);
3. interrupts the driver's main thread (``SIGINT`` to it, which also wakes a blocking system call;
   a process that inherited SIGINT ignored, as one started in the background by a script does,
   gets a handler for it while ``with watchdog:`` runs, which raises only for a timed-out step).
   Leaving ``with watchdog:`` turns the ``KeyboardInterrupt``, or whatever the shutdown after it
   raised, into one :class:`StepTimeoutError`, e.g. ``step 12 exceeded
   trainer.step_timeout_s=30 s: still waiting for learner.train_step (running 31 s); stacks in
   runs/x/hang/``.

What can be interrupted: the driver waiting on Ray workers (they are then killed), and, under the
``local`` backend, Python code running in the driver's thread (a ``time.sleep`` included). A hang
inside one C call in the driver's thread (a kernel, a collective without timeout) cannot be
interrupted in-process: it is only reported (the stacks are dumped, the error is logged), and the
process must be killed from outside. Collectives between a group's ranks are bounded separately:
every torch.distributed process group is created with ``controller.pg_timeout_s`` (forwarded to
the ranks as ``HYBRIDRL_PG_TIMEOUT_S``, ``parallel/distributed.py``), so a rank whose peer vanished
fails after that long rather than hanging.

A step that ends while the dumps are being written is let through with a warning (the dumps stay).
"""

from __future__ import annotations

import _thread
import faulthandler
import logging
import signal
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

log = logging.getLogger(__name__)


class StepTimeoutError(RuntimeError):
    """A driver step ran past ``trainer.step_timeout_s``; the message says which calls were still
    waited for and where the stacks are."""


class Watchdog:
    """Stops a step that runs past ``timeout_s`` (see the module docstring).

    Args:
        timeout_s: seconds one step may take.
        hang_dir: where the stacks go (created only when a step times out).
        groups: the WorkerGroups whose calls are watched and whose processes are dumped.
        setting: the config key named in the error.
    """

    def __init__(
        self,
        timeout_s: float,
        hang_dir: str | Path,
        groups: Iterable = (),
        setting: str = "trainer.step_timeout_s",
    ):
        self.timeout_s, self.hang_dir, self.setting = float(timeout_s), Path(hang_dir), setting
        self.groups = list(groups)
        self.error: StepTimeoutError | None = None
        self._cond = threading.Condition()
        self._armed: tuple[int, float, int] | None = None  # (step, deadline, arm count)
        self._arms = 0
        self._stop = False
        self._thread: threading.Thread | None = None
        self._target: int | None = None  # the thread to interrupt (its ident)
        self._previous: dict = {}  # SIGINT's and SIGTERM's handlers before __enter__ (see there)
        self.stop_requested: str | None = None  # the signal that asked for a graceful stop

    # --- the driver's side ------------------------------------------------------
    def steps(self, steps: Iterable[int]) -> Iterator[int]:
        """``steps``, each yielded with the watchdog armed until the loop asks for the next."""
        for step in steps:
            self.arm(step)
            try:
                yield step
            finally:
                self.disarm()

    def arm(self, step: int) -> None:
        """Start timing ``step`` (0-based; the error names it 1-based, as metrics.jsonl does)."""
        with self._cond:
            self._arms += 1
            self._armed = (step, time.monotonic() + self.timeout_s, self._arms)
            self._target = threading.get_ident()
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._watch, name="hybridrl-step-watchdog", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()

    def disarm(self) -> None:
        with self._cond:
            self._armed = None
            self._cond.notify_all()

    def close(self) -> None:
        """Stop the thread (idempotent)."""
        with self._cond:
            self._armed, self._stop = None, True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def __enter__(self) -> Watchdog:
        # While the watchdog runs (in the main thread), SIGINT and SIGTERM ask for a graceful
        # stop: the first sets stop_requested (the driver finishes the step, saves and ends), a
        # second one stops at once (KeyboardInterrupt). A process started in the background by a
        # script (nohup, `&`) inherits SIGINT ignored: it stays ignored, but the watchdog's own
        # SIGINT still interrupts a timed-out step.
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.getsignal(signum)
                signal.signal(signum, self._on_signal)
        return self

    def _on_signal(self, signum, frame) -> None:
        if self.error is not None:  # the interrupt of a timed-out step
            raise KeyboardInterrupt
        if self._previous.get(signum) == signal.SIG_IGN:
            return  # not ours, and it was ignored before
        if self.stop_requested is None:
            self.stop_requested = signal.Signals(signum).name
            log.warning(
                "%s: the run stops after this step, saves a checkpoint and closes its trackers "
                "(send it again to stop at once, without saving)",
                self.stop_requested,
            )
            return
        raise KeyboardInterrupt

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}
        if self.error is None:
            return
        error = self.error
        if exc is not None and not isinstance(exc, KeyboardInterrupt):
            error.add_note(f"then, while stopping: {type(exc).__name__}: {_first_line(exc)}")
        raise error from None

    # --- the watchdog thread ------------------------------------------------------
    def _watch(self) -> None:
        while True:
            with self._cond:
                while not self._stop and (self._armed is None or time.monotonic() < self._armed[1]):
                    wait = None if self._armed is None else self._armed[1] - time.monotonic()
                    self._cond.wait(timeout=wait)
                if self._stop:
                    return
                step, _, arms = self._armed
            try:
                self._fire(step, arms)
            except Exception:  # noqa: BLE001 - the watchdog must not die silently
                log.exception("step watchdog: reporting the hang of step %d failed", step + 1)
            with self._cond:  # one report per step
                while not self._stop and self._armed is not None and self._armed[2] == arms:
                    self._cond.wait()

    def _fire(self, step: int, arms: int) -> None:
        waiting = []  # (group, description, seconds)
        for group in self.groups:
            waiting += [(group, what, s) for what, s in group.in_flight()]
        waiting.sort(key=lambda w: -w[2])
        self.hang_dir.mkdir(parents=True, exist_ok=True)
        with open(self.hang_dir / "driver.txt", "w") as f:
            f.write(f"# driver, step {step + 1}, all threads\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        for group in self.groups:
            try:
                group.dump_stacks(self.hang_dir)
            except Exception as exc:  # noqa: BLE001 - the other groups and the stop still matter
                log.warning("stack dump of %r failed: %s", group, exc)
        if waiting:
            what = ", ".join(f"{w} (running {s:.0f} s)" for _, w, s in waiting)
            what = f"still waiting for {what}"
        else:
            what = "no worker call in flight (the driver itself is busy: see driver.txt)"
        message = (
            f"step {step + 1} exceeded {self.setting}={self.timeout_s:g} s: {what}; "
            f"stacks in {self.hang_dir}/"
        )
        with self._cond:
            if self._armed is None or self._armed[2] != arms:  # the step ended meanwhile
                log.warning("%s (the step then ended; the run goes on)", message)
                return
            self.error = StepTimeoutError(message)
            for group, _, _ in waiting:
                if group.backend_name == "ray":
                    group.abandon(f"abandoned: {message}")
            log.error("%s", message)
            self._interrupt()

    def _interrupt(self) -> None:
        target = self._target
        if target != threading.main_thread().ident:
            log.error("the driver loop runs outside the main thread: it cannot be interrupted")
            return
        if callable(signal.getsignal(signal.SIGINT)):
            signal.pthread_kill(target, signal.SIGINT)  # also ends a blocking sleep or wait
        else:  # SIGINT ignored or default (would kill the process): set the flag only
            _thread.interrupt_main()


def _first_line(exc: BaseException, limit: int = 300) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."
