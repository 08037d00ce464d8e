"""Training-health alerts: rules over each logged step's metrics.

:class:`Alerts` is fed every step's metrics dict (by ``MetricsLogger.log``, so both drivers get
it). The rules and their thresholds (the ``alerts`` config section; a threshold of 0 turns its
rule off):

- ``entropy_collapse``: ``actor/entropy`` below ``entropy_floor``;
- ``reward_std_zero``: ``reward/std`` == 0 for ``reward_std_zero_steps`` steps in a row;
- ``reward_drop``: ``reward/mean`` more than ``reward_drop`` below its best so far;
- ``kl_ref_blowup``: ``actor/kl_ref`` above ``kl_ref_max``;
- ``approx_kl_old_blowup``: ``actor/approx_kl_old`` above ``approx_kl_old_max``;
- ``grad_norm_spike``: ``actor/grad_norm`` above ``grad_norm_spike`` x the median of its last 50
  positive values (once 5 are known);
- ``staleness_at_bound``: ``async/staleness_max`` at ``asynchronous.max_staleness`` (> 0) for
  ``staleness_bound_steps`` steps in a row;
- ``nonfinite_updates``: any ``<role>/skipped_updates`` > 0 (optimizer steps skipped for a
  non-finite loss or gradient norm, ``learner/update.py``); always on.

A rule fires on each step its condition holds: the step's metrics get ``alert/<name>`` = 1.
The first step of a streak (the rule did not fire on the step before) also logs one warning line
and appends ``{"step", "alert", "value", "threshold", "message"}`` to ``<run>/alerts.jsonl``; a
streak that goes on is not logged again. A step that lacks a rule's metric (or has it NaN) leaves
that rule's state as it was. On resume, :meth:`Alerts.replay` rebuilds the state (best reward,
grad-norm history, counts, streaks) from the kept metrics lines, silently.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridrl.config.schema import AlertsConfig

log = logging.getLogger(__name__)

ALERTS_FILE = "alerts.jsonl"
GRAD_NORM_WINDOW = 50  # the grad-norm spike rule's median is over this many recent values
GRAD_NORM_MIN_HISTORY = 5  # ... and needs this many before it can fire

# a firing: (value, threshold, message)
Firing = tuple[float, float, str]


def _num(metrics: Mapping[str, Any], key: str) -> float | None:
    """``metrics[key]`` as a float; None when absent, not a number, or NaN (inf is kept)."""
    v = metrics.get(key)
    if hasattr(v, "item") and callable(v.item):
        v = v.item()
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return None if math.isnan(v) else v


class Rule:
    """One alert rule. ``update(metrics)``: None when the step says nothing about it (its metric is
    missing), False when quiet, else a :data:`Firing`."""

    name = ""

    def update(self, metrics: Mapping[str, Any]) -> Firing | bool | None:
        raise NotImplementedError


class Below(Rule):
    def __init__(self, name: str, key: str, floor: float, knob: str, what: str):
        self.name, self.key, self.floor, self.knob, self.what = name, key, floor, knob, what

    def update(self, metrics):
        v = _num(metrics, self.key)
        if v is None:
            return None
        if v >= self.floor:
            return False
        msg = f"{self.key} = {v:.4g} below alerts.{self.knob} = {self.floor:g} ({self.what})"
        return v, self.floor, msg


class Above(Rule):
    def __init__(self, name: str, key: str, ceiling: float, knob: str, what: str):
        self.name, self.key, self.ceiling, self.knob, self.what = name, key, ceiling, knob, what

    def update(self, metrics):
        v = _num(metrics, self.key)
        if v is None:
            return None
        if not v > self.ceiling:
            return False
        msg = f"{self.key} = {v:.4g} above alerts.{self.knob} = {self.ceiling:g} ({self.what})"
        return v, self.ceiling, msg


class InARow(Rule):
    """``key`` satisfies ``hit(value)`` on ``steps`` logged steps in a row."""

    def __init__(self, name: str, key: str, steps: int, hit, what: str):
        self.name, self.key, self.steps, self.hit, self.what = name, key, steps, hit, what
        self.count = 0

    def update(self, metrics):
        v = _num(metrics, self.key)
        if v is None:
            return None
        self.count = self.count + 1 if self.hit(v) else 0
        if self.count < self.steps:
            return False
        return float(self.count), float(self.steps), f"{self.what} for {self.count} steps in a row"


class RewardDrop(Rule):
    name = "reward_drop"

    def __init__(self, drop: float):
        self.drop, self.best = drop, -math.inf

    def update(self, metrics):
        v = _num(metrics, "reward/mean")
        if v is None or math.isinf(v):
            return None
        self.best = max(self.best, v)
        fall = self.best - v
        if not fall > self.drop:
            return False
        msg = (
            f"reward/mean = {v:.4g} is {fall:.4g} below its best {self.best:.4g} "
            f"(alerts.reward_drop = {self.drop:g})"
        )
        return fall, self.drop, msg


class GradNormSpike(Rule):
    name = "grad_norm_spike"

    def __init__(self, factor: float):
        self.factor = factor
        self.history: deque[float] = deque(maxlen=GRAD_NORM_WINDOW)

    def update(self, metrics):
        v = _num(metrics, "actor/grad_norm")
        if v is None:
            return None
        fired: Firing | bool = False
        if len(self.history) >= GRAD_NORM_MIN_HISTORY:
            median = statistics.median(self.history)
            if v > self.factor * median:
                msg = (
                    f"actor/grad_norm = {v:.4g} is {v / median:.3g}x the median {median:.4g} of "
                    f"the last {len(self.history)} (alerts.grad_norm_spike = {self.factor:g})"
                )
                fired = (v, self.factor * median, msg)
        if 0 < v < math.inf:  # steps without a gradient (grad norm 0) say nothing about the scale
            self.history.append(v)
        return fired


class NonFiniteUpdates(Rule):
    name = "nonfinite_updates"

    def update(self, metrics):
        counts = {
            k: v
            for k in metrics
            if k.endswith("/skipped_updates") and (v := _num(metrics, k)) is not None
        }
        if not counts:
            return None
        if not any(v > 0 for v in counts.values()):
            return False
        which = ", ".join(f"{k} = {v:g}" for k, v in counts.items() if v > 0)
        msg = f"optimizer steps skipped for a non-finite loss or gradient norm: {which}"
        return sum(counts.values()), 0.0, msg


def build_rules(config: AlertsConfig, max_staleness: int = 0) -> list[Rule]:
    """The rules ``config`` turns on (``max_staleness``: ``asynchronous.max_staleness``)."""
    c, rules = config, []
    if c.entropy_floor > 0:
        what = "entropy collapse: the policy is close to deterministic"
        rules.append(
            Below("entropy_collapse", "actor/entropy", c.entropy_floor, "entropy_floor", what)
        )
    if c.reward_std_zero_steps > 0:
        what = "reward/std == 0: every sample of the step got the same reward, no learning signal"
        rules.append(
            InARow("reward_std_zero", "reward/std", c.reward_std_zero_steps, lambda v: v == 0, what)
        )
    if c.reward_drop > 0:
        rules.append(RewardDrop(c.reward_drop))
    if c.kl_ref_max > 0:
        what = "KL blow-up: the policy runs away from the reference"
        rules.append(Above("kl_ref_blowup", "actor/kl_ref", c.kl_ref_max, "kl_ref_max", what))
    if c.approx_kl_old_max > 0:
        what = "KL blow-up: the update moves far from the policy that generated"
        rules.append(
            Above(
                "approx_kl_old_blowup",
                "actor/approx_kl_old",
                c.approx_kl_old_max,
                "approx_kl_old_max",
                what,
            )
        )
    if c.grad_norm_spike > 0:
        rules.append(GradNormSpike(c.grad_norm_spike))
    if c.staleness_bound_steps > 0 and max_staleness > 0:
        what = (
            f"async/staleness_max at asynchronous.max_staleness = {max_staleness}: the rollout "
            "runs ahead of the learner"
        )
        rules.append(
            InARow(
                "staleness_at_bound",
                "async/staleness_max",
                c.staleness_bound_steps,
                lambda v: v >= max_staleness,
                what,
            )
        )
    rules.append(NonFiniteUpdates())
    return rules


def _json_number(v: float) -> float | None:
    return v if math.isfinite(v) else None


def read_alerts(run_dir: str | os.PathLike) -> list[dict]:
    """The rows of ``run_dir/alerts.jsonl`` in file order ([] if absent; malformed lines
    skipped)."""
    path = Path(run_dir) / ALERTS_FILE
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


class Alerts:
    """The alert rules of one run, writing to ``run_dir/alerts.jsonl``.

    ``resume_step``: rows of ``alerts.jsonl`` after that step are dropped (as in
    ``metrics.jsonl``); feed the kept metrics lines to :meth:`replay`."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        config: AlertsConfig,
        max_staleness: int = 0,
        resume_step: int | None = None,
    ):
        self.path = Path(run_dir) / ALERTS_FILE
        self.rules = build_rules(config, max_staleness)
        self.firing: set[str] = set()  # rules that fired on the last step that said something
        if resume_step is not None and self.path.exists():
            kept = [
                r
                for r in read_alerts(self.path.parent)
                if not (isinstance(r.get("step"), int) and r["step"] > resume_step)
            ]
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
            os.replace(tmp, self.path)

    def _evaluate(self, metrics: Mapping[str, Any]) -> dict[str, Firing]:
        """Update every rule with one step; the rules that fire. A rule that is quiet leaves
        ``self.firing`` (its streak ends); the caller adds the ones that fire."""
        fired: dict[str, Firing] = {}
        for rule in self.rules:
            out = rule.update(metrics)
            if out is None:
                continue
            if out is False:
                self.firing.discard(rule.name)
            else:
                fired[rule.name] = out
        return fired

    def check(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float]:
        """Run the rules on one step's metrics; ``{"alert/<name>": 1.0}`` for each rule that fires.
        A firing that starts a streak logs a warning and appends a row to ``alerts.jsonl``."""
        fired = self._evaluate(metrics)
        rows = []
        for name, (value, threshold, message) in fired.items():
            if name in self.firing:
                continue
            self.firing.add(name)
            log.warning("alert %s at step %d: %s", name, step, message)
            row = {
                "step": int(step),
                "alert": name,
                "value": _json_number(float(value)),
                "threshold": _json_number(float(threshold)),
                "message": message,
            }
            rows.append(json.dumps(row, allow_nan=False) + "\n")
        if rows:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write("".join(rows))
        return {f"alert/{name}": 1.0 for name in fired}

    def replay(self, records: Iterable[Mapping[str, Any]]) -> None:
        """Feed earlier steps' metrics (e.g. the kept lines of ``metrics.jsonl`` on resume) through
        the rules without logging: their running state and streaks continue from there."""
        for rec in records:
            fired = set(self._evaluate(rec))
            # what the step logged as firing counts too (an infinite value was written as null)
            logged = {k.removeprefix("alert/") for k, v in rec.items() if k.startswith("alert/")}
            fired |= {name for name in logged if rec[f"alert/{name}"]}
            self.firing |= fired
