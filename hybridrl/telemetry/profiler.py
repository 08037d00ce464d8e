"""The driver loop's profiling: the per-step timeline and the torch traces of chosen steps.

A driver wraps its step loop once::

    for step in profiled(session, watchdog.steps(bar)):
        ...

After each step's body the driver takes every worker's phase spans (one ``apply_all`` per worker
group, ``telemetry/timeline.py``) and appends them, with the step's own window, to
``<run>/timeline.jsonl`` (the driver's timer counts this as ``timing/profile``, logged with the next
step). During the steps listed in ``trainer.profile_steps`` (1-based, as
``metrics.jsonl`` counts) every worker process runs ``torch.profiler.profile`` (CPU activities, plus
CUDA when the process computes on a GPU; ``record_shapes`` per ``trainer.profile_record_shapes``,
no stacks) and the Chrome trace goes to ``<run>/profile/<worker>-rank<k>-step<N>.json.gz``:

* ``ray``: each rank exports its trace locally, gzips it and returns the bytes; the driver writes
  the file. The run directory need not be visible from the worker's node, so this works the same on
  a multi-node cluster (a trace is a few MB compressed).
* ``local``: every worker lives in the driver's process, which has one profiler at a time: one
  trace, ``driver-rank0-step<N>.json.gz``, holds all of them (the phases are named in it).

Perfetto (ui.perfetto.dev) and chrome://tracing open the ``.json.gz`` files as they are.
"""

from __future__ import annotations

import gzip
import logging
import os
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from hybridrl.controller.worker import WorkerDiedError
from hybridrl.telemetry import timeline
from hybridrl.telemetry.timer import PhaseTimer

log = logging.getLogger(__name__)

PROFILE_DIR = "profile"
TRACE_ATTR = "_hybridrl_trace"  # the running torch profiler of a worker process, on its worker


# --- in a worker process --------------------------------------------------------------------------
def start_trace(worker, record_shapes: bool = False) -> None:
    """Start ``torch.profiler.profile`` in this process (CUDA activities too when it computes on a
    GPU); kept on ``worker`` until :func:`stop_trace`."""
    import torch

    from hybridrl.parallel.distributed import compute_device

    if getattr(worker, TRACE_ATTR, None) is not None:
        raise RuntimeError(f"{worker!r}: a trace is already running in this process")
    activities = [torch.profiler.ProfilerActivity.CPU]
    if compute_device().type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    prof = torch.profiler.profile(
        activities=activities,
        record_shapes=record_shapes,
        with_stack=False,
        experimental_config=_all_threads(),
    )
    prof.start()
    setattr(worker, TRACE_ATTR, prof)


def _all_threads():
    """The profiler's option to record every thread's operators (the asynchronous rollout
    generates on a thread of its own), where this torch has it; None (the calling thread and the
    threads it starts) otherwise."""
    from torch._C._profiler import _ExperimentalConfig

    try:
        return _ExperimentalConfig(profile_all_threads=True)
    except TypeError:
        return None


def stop_trace(worker) -> bytes:
    """Stop the trace :func:`start_trace` began; the Chrome trace, gzipped (b"" when none ran)."""
    prof = getattr(worker, TRACE_ATTR, None)
    if prof is None:
        return b""
    setattr(worker, TRACE_ATTR, None)
    prof.stop()
    with tempfile.TemporaryDirectory(prefix="hybridrl-trace-") as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return gzip.compress(path.read_bytes(), compresslevel=6)


# --- in the driver ----------------------------------------------------------------------------
class StepProfiler:
    """Timeline rows after every step, traces around the steps in ``profile_steps``.

    Args:
        groups: the run's worker groups (``Roles.groups``).
        run_dir: where ``timeline.jsonl`` and ``profile/`` go.
        origin: the wall-clock time the timeline's ``t0``/``t1`` count from.
        first_step: the 0-based step the loop starts at (rows of later steps from an interrupted
            run are dropped: they are computed again).
        timer: the driver's :class:`PhaseTimer`: taking the spans and writing the traces after a
            step is its phase ``profile`` (in the next step's ``timing/profile``).
    """

    def __init__(
        self,
        groups: list,
        run_dir: str | Path,
        origin: float,
        first_step: int = 0,
        profile_steps: Iterable[int] = (),
        record_shapes: bool = False,
        timer=None,
    ):
        # a list is kept as is: a group replaced in it (driver/replace.py) is the one asked
        self.groups = groups if isinstance(groups, list) else list(groups)
        self.run_dir, self.origin = Path(run_dir), origin
        self.timer = timer if timer is not None else PhaseTimer()
        self.profile_steps, self.record_shapes = set(profile_steps), record_shapes
        self.local = any(g.backend_name == "local" for g in self.groups)
        self.driver = _DriverProcess()  # holds the driver's own trace (local backend)
        timeline.truncate_after(self.run_dir, first_step)

    def steps(self, steps: Iterable[int]) -> Iterator[int]:
        """``steps`` (0-based), each followed by its timeline rows; traced when listed."""
        self._take()  # spans from before the loop (the evaluation before training) are not rows
        for step in steps:
            done = step + 1
            traced = done in self.profile_steps
            if traced:
                self._start()
            t0 = time.time()
            try:
                yield step
            except GeneratorExit:  # the loop failed: no more calls into the workers
                if traced and self.local:
                    stop_trace(self.driver)
                raise
            t1 = time.time()
            with self.timer.phase("profile"):  # in the next step's metrics: timing/profile
                if traced:
                    self._stop(done)
                self._record(done, t0, t1)

    def _take(self) -> list[tuple[str, dict]]:
        out = []
        for g in list(self.groups):
            try:
                out += [(g.role, taken) for taken in g.apply_all(timeline.take_spans)]
            except WorkerDiedError as exc:  # its next call raises it again: the driver's to handle
                log.warning("no timeline spans of a dead worker: %s", str(exc).splitlines()[0])
        return out

    def _record(self, done: int, t0: float, t1: float) -> None:
        rows = [
            row
            for worker, taken in self._take()
            for row in timeline.span_rows(done, worker, taken, self.origin)
        ]
        mine = {"pid": os.getpid(), "rank": 0, "spans": [("driver", "step", t0, t1)]}
        timeline.append_rows(
            self.run_dir, timeline.span_rows(done, "driver", mine, self.origin) + rows
        )

    def _start(self) -> None:
        if self.local:
            start_trace(self.driver, self.record_shapes)
        for g in self.groups:
            if g.backend_name != "local":
                g.apply_all(start_trace, self.record_shapes)

    def _stop(self, done: int) -> None:
        out = self.run_dir / PROFILE_DIR
        out.mkdir(parents=True, exist_ok=True)
        if self.local:
            (out / f"driver-rank0-step{done}.json.gz").write_bytes(stop_trace(self.driver))
        for g in self.groups:
            if g.backend_name == "local":
                continue
            for rank, data in enumerate(g.apply_all(stop_trace)):
                if data:
                    (out / f"{g.role}-rank{rank}-step{done}.json.gz").write_bytes(data)


class _DriverProcess:
    """Where the driver's own trace is kept (:func:`start_trace` keeps it on an object)."""

    def __repr__(self) -> str:
        return "driver"


def profiled(session, steps: Iterable[int]) -> Iterator[int]:
    """``steps`` of a driver loop, with the timeline and the traces of ``trainer.profile_steps``
    (:class:`StepProfiler`) of a :class:`~hybridrl.driver.session.Session`."""
    t = session.cfg.trainer
    origin = time.time() - (time.perf_counter() - session.t_start)
    return StepProfiler(
        session.roles.groups,
        session.run_dir,
        origin,
        session.state["step"],
        t.profile_steps,
        t.profile_record_shapes,
        session.timer,
    ).steps(steps)
