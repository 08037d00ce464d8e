"""Metric sinks: one JSON line per ``log`` call in ``run_dir/metrics.jsonl``
and (optionally) TensorBoard scalars in ``run_dir/tb``.

``metrics.jsonl`` is the source of truth (the report is drawn from it). Each
line is ``{"step": <int>, "<name>": <number or null>, ...}``; non-finite
numbers are written as ``null`` so that every line is strict JSON.

Given an ``alerts`` config, every logged step also goes through the alert rules
(``telemetry/alerts.py``): ``alert/<name>`` = 1 joins the line of a step where a rule
fires, and ``run_dir/alerts.jsonl`` gets a row per streak.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .alerts import Alerts

if TYPE_CHECKING:
    from hybridrl.config.schema import AlertsConfig

METRICS_FILE = "metrics.jsonl"
TB_DIR = "tb"


def _to_python(value: Any) -> Any:
    """Turn numpy / torch scalars into plain Python; non-finite floats -> None."""
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalar
        try:
            value = value.item()
        except (ValueError, RuntimeError):  # not a single element
            raise TypeError(f"metric value must be a scalar, got {type(value).__name__}") from None
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        value = float(value)
        return value if math.isfinite(value) else None
    raise TypeError(f"unsupported metric value type {type(value).__name__}")


def _parse_lines(path: Path) -> list[dict]:
    """Parse a jsonl file, skipping blank and malformed (e.g. half-written) lines."""
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                warnings.warn(f"{path}:{lineno}: skipping malformed metrics line", stacklevel=2)
                continue
            if isinstance(rec, dict):
                records.append(rec)
    return records


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """All records of ``run_dir/metrics.jsonl`` in file order ([] if absent)."""
    path = Path(run_dir) / METRICS_FILE
    return _parse_lines(path) if path.exists() else []


class MetricsLogger:
    """Writes metrics to ``run_dir/metrics.jsonl`` and, if ``tensorboard``,
    to a ``SummaryWriter`` in ``run_dir/tb``.

    ``resume_step``: when resuming from a checkpoint taken at that step, lines
    with ``step > resume_step`` (written after the checkpoint, and about to be
    recomputed) are dropped from ``metrics.jsonl``; everything else is kept.
    TensorBoard events after the checkpoint are purged via ``purge_step``.
    Without ``resume_step`` an existing file is appended to.

    The jsonl is opened for each line, so a ``metrics.jsonl`` deleted (or
    moved away) during a run is recreated by the next ``log`` and holds the
    later steps; TensorBoard is not affected.

    ``alerts`` (the ``alerts`` config section; None or ``enabled: false``: none): check the alert
    rules on every logged step (``max_staleness``: ``asynchronous.max_staleness``, for the
    staleness rule). On resume the rules' state is rebuilt from the kept lines.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        tensorboard: bool = True,
        resume_step: int | None = None,
        alerts: AlertsConfig | None = None,
        max_staleness: int = 0,
    ):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        if resume_step is not None and self.path.exists():
            self._truncate_after(resume_step)
        self.alerts = None
        if alerts is not None and alerts.enabled:
            self.alerts = Alerts(self.run_dir, alerts, max_staleness, resume_step)
            if resume_step is not None and self.path.exists():
                self.alerts.replay(_parse_lines(self.path))
        with open(self.path, "a", encoding="utf-8") as f:  # created here, appended to per line
            if f.tell() > 0 and not self._ends_with_newline():
                f.write("\n")  # previous run died mid-line
        self._open = True
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # lazy: optional dependency

            purge = None if resume_step is None else resume_step + 1
            self._tb = SummaryWriter(log_dir=str(self.run_dir / TB_DIR), purge_step=purge)

    def _append(self, text: str) -> None:
        """Append ``text`` to the jsonl (opened per write: every line is on disk once logged)."""
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(text)

    def _ends_with_newline(self) -> bool:
        with open(self.path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) == b"\n"

    def _truncate_after(self, resume_step: int) -> None:
        kept = [
            r
            for r in _parse_lines(self.path)
            if not (isinstance(r.get("step"), int) and r["step"] > resume_step)
        ]
        tmp = self.path.with_suffix(".jsonl.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for rec in kept:
                f.write(json.dumps(rec, allow_nan=False) + "\n")
        os.replace(tmp, self.path)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Append ``{"step": step, **metrics}`` as one line (with ``alert/<name>`` = 1 for each
        alert firing) and write the numeric values as TensorBoard scalars (strings only go to the
        jsonl)."""
        if not self._open:
            raise RuntimeError("MetricsLogger is closed")
        if "step" in metrics:
            raise ValueError("'step' is reserved; pass it as the step argument")
        step = int(step)
        record: dict[str, Any] = {"step": step}
        for key, value in metrics.items():
            record[str(key)] = _to_python(value)
        if self.alerts is not None:
            # the raw values (an infinite KL is a blow-up; the line says null)
            fired = self.alerts.check(step, metrics)  # alert/<name>: 1 for each rule firing
            record |= fired
            metrics = {**metrics, **fired}
        self._append(json.dumps(record, allow_nan=False) + "\n")
        if self._tb is not None:
            for key, raw in metrics.items():
                value = record[str(key)]
                if value is None and raw is not None:  # non-finite: keep it visible in TB
                    value = float(raw.item() if hasattr(raw, "item") else raw)
                if isinstance(value, (int, float)):  # bool is an int too
                    self._tb.add_scalar(str(key), float(value), global_step=step)
            self._tb.flush()

    def close(self) -> None:
        """Flush and close both sinks (idempotent)."""
        self._open = False
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
