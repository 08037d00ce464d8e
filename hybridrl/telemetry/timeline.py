"""The run's timeline: which worker process ran which phase when (``<run>/timeline.jsonl``).

Worker side: a :class:`SpanLog` per worker keeps the spans of its own phases, ``(role, phase,
t0, t1)`` in wall-clock seconds (``time.time()``), in memory: ``with log.span("rollout/generate"):``
costs two clock reads and a list append, no RPC. While a torch profiler runs in the process
(``trainer.profile_steps``) each span is also a ``record_function`` range, so the phases appear by
name in the Chrome trace.

Driver side: once per step the driver takes every worker's spans (:func:`take_spans`, one
``apply_all`` per worker group) and appends one row per span to ``timeline.jsonl``::

    {"step": 3, "role": "learner", "worker": "learner+rollout", "rank": 0, "pid": 4242,
     "phase": "learner/update", "t0": 12.31, "t1": 12.74}

``worker`` names the process's group (``learner+rollout`` for a colocated one), ``role`` the part
that recorded the span; ``t0``/``t1`` are seconds since the driver's session started. One row per
step has ``role: driver, phase: step``: the step's window. Clocks: the ranks' ``time.time()`` are
compared with the driver's; on one machine they agree, across nodes they differ by the nodes' clock
offset (NTP keeps it to milliseconds, which shifts a row, not the lengths of its spans).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

FILE = "timeline.jsonl"
# phases in which a worker waits for another one: idle time, not work
WAITING = frozenset({"learner/wait_batch"})
MERGE_GAP_S = 0.002  # a span that starts this soon after the same phase's last span extends it


class SpanLog:
    """The spans of one worker's phases since the driver last took them (thread-safe: the
    asynchronous rollout records from its stream thread)."""

    def __init__(self, role: str):
        self.role = role
        self._spans: list[tuple[str, str, float, float]] = []
        self._lock = threading.Lock()

    @contextmanager
    def span(self, phase: str) -> Iterator[None]:
        """Record the enclosed code as one span of ``phase`` (also when it raises)."""
        import torch

        t0 = time.time()
        try:
            # process-wide (the asynchronous rollout records on a thread of its own)
            if getattr(torch.autograd.profiler, "_is_profiler_enabled", False):
                with torch.profiler.record_function(phase):
                    yield
            else:
                yield
        finally:
            self.add(phase, t0, time.time())

    def add(self, phase: str, t0: float, t1: float) -> None:
        """One span; it extends the last span instead when that one is of the same phase and ended
        less than ``MERGE_GAP_S`` before ``t0`` (an engine's back-to-back steps make one span)."""
        with self._lock:
            last = self._spans[-1] if self._spans else None
            if last is not None and last[1] == phase and 0 <= t0 - last[3] < MERGE_GAP_S:
                self._spans[-1] = (last[0], phase, last[2], t1)
            else:
                self._spans.append((self.role, phase, t0, t1))

    def wrap(self, phase: str, fn):
        """``fn`` with every call recorded as a span of ``phase``."""

        def spanned(*args, **kwargs):
            with self.span(phase):
                return fn(*args, **kwargs)

        return spanned

    def take(self) -> list[tuple[str, str, float, float]]:
        with self._lock:
            out, self._spans = self._spans, []
        return out


class SpannedEngine:
    """A rollout backend whose engine steps are recorded as ``rollout/generate`` spans (the
    asynchronous stream drives the backend step by step); everything else is the backend's."""

    def __init__(self, backend, spans: SpanLog):
        self._backend, self._step = backend, spans.wrap("rollout/generate", backend.step)

    def step(self, *args, **kwargs):
        return self._step(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._backend, name)


def take_spans(worker) -> dict:
    """In a worker process: the spans of every part of ``worker`` (a colocated worker holds one
    per role) since the last call, with the process id and the rank."""
    parts = getattr(worker, "parts", None) or {worker.role: worker}
    spans = []
    for part in parts.values():
        log = getattr(part, "spans", None)
        if isinstance(log, SpanLog):
            spans += log.take()
    return {"pid": os.getpid(), "rank": worker.rank, "spans": spans}


def span_rows(step: int, worker: str, taken: dict, origin: float) -> list[dict]:
    """Timeline rows of one rank's :func:`take_spans`, times relative to ``origin``."""
    return [
        {
            "step": step,
            "role": role,
            "worker": worker,
            "rank": taken["rank"],
            "pid": taken["pid"],
            "phase": phase,
            "t0": round(t0 - origin, 6),
            "t1": round(t1 - origin, 6),
        }
        for role, phase, t0, t1 in taken["spans"]
    ]


def append_rows(run_dir: str | Path, rows: Iterable[dict]) -> None:
    with open(Path(run_dir) / FILE, "a") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)


def truncate_after(run_dir: str | Path, step: int) -> None:
    """Drop the rows of steps after ``step`` (a resumed run computes them again)."""
    path = Path(run_dir) / FILE
    if path.is_file():
        kept = [r for r in read_timeline(run_dir) if r["step"] <= step]
        path.write_text("".join(json.dumps(r) + "\n" for r in kept))


def read_timeline(run_dir: str | Path) -> list[dict]:
    """The rows of ``timeline.jsonl`` ([] when there is none); a torn last line is skipped."""
    path = Path(run_dir) / FILE
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and {"step", "phase", "t0", "t1"} <= row.keys():
            rows.append(row)
    return rows


# --- analysis ---------------------------------------------------------------------------------
def union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted disjoint intervals covering the same time."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        elif b > a:
            out.append([a, b])
    return [(a, b) for a, b in out]


def length(intervals: Iterable[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def intersect(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    """Seconds covered by both disjoint sorted interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, b - a)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def step_windows(rows: list[dict]) -> dict[int, tuple[float, float]]:
    """step -> (t0, t1) of the driver's step rows."""
    return {r["step"]: (r["t0"], r["t1"]) for r in rows if r.get("role") == "driver"}


def worker_key(row: dict) -> tuple[str, int, int]:
    return (
        row.get("worker", row.get("role", "?")),
        int(row.get("rank", 0)),
        int(row.get("pid", 0)),
    )


def idle_fractions(rows: list[dict]) -> dict[tuple[str, int, int], float]:
    """Per worker process: the fraction of the steps' time in no span of its own (waiting phases
    count as idle), spans clipped to their step's window."""
    windows = step_windows(rows)
    total = sum(b - a for a, b in windows.values())
    busy: dict[tuple[str, int, int], list[tuple[float, float]]] = {}
    for r in rows:
        if r.get("role") == "driver":
            continue
        mine = busy.setdefault(worker_key(r), [])
        if r["phase"] not in WAITING and r["step"] in windows:
            lo, hi = windows[r["step"]]
            mine.append((max(r["t0"], lo), min(r["t1"], hi)))
    return {k: 1 - length(union(v)) / total if total else 0.0 for k, v in busy.items()}


def overlap_fraction(rows: list[dict], first: str = "rollout/generate", second="learner/") -> float:
    """The fraction of the steps' time in which a ``first`` span (a phase name) and a span whose
    phase starts with ``second`` run at once, anywhere (waiting phases excluded)."""
    windows = step_windows(rows)
    total = sum(b - a for a, b in windows.values())
    spans: dict[str, list[tuple[float, float]]] = {"a": [], "b": []}
    for r in rows:
        if r.get("role") == "driver" or r["phase"] in WAITING or r["step"] not in windows:
            continue
        lo, hi = windows[r["step"]]
        side = "a" if r["phase"] == first else "b" if r["phase"].startswith(second) else None
        if side:
            spans[side].append((max(r["t0"], lo), min(r["t1"], hi)))
    return intersect(union(spans["a"]), union(spans["b"])) / total if total else 0.0
