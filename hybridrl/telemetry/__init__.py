"""Telemetry: per-phase wall-clock timing, metric sinks (jsonl, TensorBoard, wandb), tables of
sample completions, training-health alerts and a PNG run report; the per-worker timeline of phases
(``timeline.py``), torch traces of chosen steps (``profiler.py``) and ``hybridrl profile``
(``profile_report.py``)."""

from .alerts import Alerts, read_alerts
from .report import write_report
from .sinks import MetricsLogger, read_metrics
from .timer import PhaseTimer

__all__ = ["Alerts", "PhaseTimer", "MetricsLogger", "read_alerts", "read_metrics", "write_report"]
