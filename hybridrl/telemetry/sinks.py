"""Metric sinks (``trainer.loggers``): one JSON line per ``log`` call in ``run_dir/metrics.jsonl``
(always), TensorBoard scalars in ``run_dir/tb`` and a wandb run in ``run_dir/wandb``
(``telemetry/tracking.py``), each optional. Tables of sample completions (``log_samples``,
``telemetry/samples.py``) go to ``run_dir/samples.jsonl`` and the same optional sinks.

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
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import samples as tables
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


def _truncate_after(path: Path, resume_step: int) -> None:
    """Drop the lines of ``path`` with ``step > resume_step``."""
    kept = [
        r
        for r in _parse_lines(path)
        if not (isinstance(r.get("step"), int) and r["step"] > resume_step)
    ]
    tmp = path.with_suffix(".jsonl.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for rec in kept:
            f.write(json.dumps(rec, allow_nan=False) + "\n")
    os.replace(tmp, path)


# the metrics of a console line, in order, with their short names
CONSOLE_KEYS = {
    "reward/mean": "reward",
    "eval/accuracy": "eval_acc",
    "actor/pg_loss": "pg_loss",
    "actor/kl_ref": "kl",
    "actor/entropy": "entropy",
    "actor/lr": "lr",
    "response/length_mean": "resp_len",
    "async/staleness_mean": "stale",
    "timing/step": "step_s",
}


def console_line(step: int, total: int | None, scalars: Mapping[str, float]) -> str:
    """``step 20/200 reward=0.531 eval_acc=0.612 ... step_s=0.48``: the headline metrics a step
    has."""
    parts = [f"step {step}" + (f"/{total}" if total else "")]
    parts += [
        f"{short}={scalars[k]:.4g}"
        for k, short in CONSOLE_KEYS.items()
        if k in scalars and math.isfinite(scalars[k])
    ]
    return " ".join(parts)


class MetricsLogger:
    """Writes metrics to ``run_dir/metrics.jsonl``; if ``tensorboard``, to a ``SummaryWriter``
    in ``run_dir/tb``; given ``wandb`` (``project``, ``name`` and ``config`` of
    :class:`~hybridrl.telemetry.tracking.WandbSink`), to a wandb run.

    ``resume_step``: when resuming from a checkpoint taken at that step, lines
    with ``step > resume_step`` (written after the checkpoint, and about to be
    recomputed) are dropped from ``metrics.jsonl`` and ``samples.jsonl``; everything else is
    kept. TensorBoard events after the checkpoint are purged via ``purge_step``; the wandb run is
    continued (same id). Without ``resume_step`` existing files are appended to.

    The jsonl is opened for each line, so a ``metrics.jsonl`` deleted (or
    moved away) during a run is recreated by the next ``log`` and holds the
    later steps; TensorBoard is not affected.

    ``console_every`` > 0: every that many steps, one line of the headline metrics
    (:data:`CONSOLE_KEYS` that the step has) goes to ``console`` (standard error, where the logs and
    the progress bar go; standard output keeps the run's summary), for a run whose output is a log
    file, not a terminal with a progress bar (``trainer.log_every``).

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
        wandb: Mapping[str, Any] | None = None,
        console_every: int = 0,
        total_steps: int | None = None,
        console=None,
    ):
        self.run_dir = Path(run_dir)
        self.console_every, self.total_steps = console_every, total_steps
        self.console = console or sys.stderr
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self.samples_path = self.run_dir / tables.SAMPLES_FILE
        if resume_step is not None:
            for path in (self.path, self.samples_path):
                if path.exists():
                    _truncate_after(path, resume_step)
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
        self._wandb = None
        if wandb is not None:
            from .tracking import WandbSink  # lazy: optional dependency

            self._wandb = WandbSink(self.run_dir, **wandb)

    def _append(self, text: str) -> None:
        """Append ``text`` to the jsonl (opened per write: every line is on disk once logged)."""
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(text)

    def _ends_with_newline(self) -> bool:
        with open(self.path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) == b"\n"

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
        scalars = {}
        for key, raw in metrics.items():
            value = record[str(key)]
            if value is None and raw is not None:  # non-finite: keep it visible in TB and wandb
                value = float(raw.item() if hasattr(raw, "item") else raw)
            if isinstance(value, (int, float)):  # bool is an int too
                scalars[str(key)] = float(value)
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, global_step=step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(step, scalars)
        if self.console_every and step % self.console_every == 0:
            print(console_line(step, self.total_steps, scalars), file=self.console, flush=True)

    def log_samples(self, step: int, rows: list[dict]) -> None:
        """A table of sample completions (:func:`~hybridrl.telemetry.samples.sample_rows`): one
        line per row in ``samples.jsonl``, a markdown table in TensorBoard's text tab, a
        ``wandb.Table``."""
        if not self._open:
            raise RuntimeError("MetricsLogger is closed")
        if not rows:
            return
        with open(self.samples_path, "a", encoding="utf-8") as f:
            f.writelines(json.dumps(r, allow_nan=False, ensure_ascii=False) + "\n" for r in rows)
        if self._tb is not None:
            self._tb.add_text(tables.TABLE_KEY, tables.markdown(rows), global_step=step)
            self._tb.flush()
        if self._wandb is not None:
            cols = tables.columns(rows)
            data = [[r.get(c) for c in cols] for r in rows]
            self._wandb.table(step, tables.TABLE_KEY, cols, data)

    def close(self) -> None:
        """Flush and close the sinks (idempotent)."""
        self._open = False
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            wandb, self._wandb = self._wandb, None
            wandb.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
