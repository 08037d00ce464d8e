"""Telemetry: per-phase wall-clock timing, metric sinks (jsonl + TensorBoard)
and a PNG run report."""

from .report import write_report
from .sinks import MetricsLogger, read_metrics
from .timer import PhaseTimer

__all__ = ["PhaseTimer", "MetricsLogger", "read_metrics", "write_report"]
