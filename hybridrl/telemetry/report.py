"""One-page PNG summary of a run, drawn from ``run_dir/metrics.jsonl``.

Three panels: training reward per step (with a moving average), held-out
accuracy (sampled vs greedy), and wall time per phase per step. A panel whose
metrics are missing says "no data" instead of failing.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from matplotlib.figure import Figure  # no pyplot: no global figure state, no display needed
from matplotlib.ticker import MaxNLocator

from .sinks import read_metrics

REWARD_KEY = "reward/mean"
EVAL_KEYS = {"eval/accuracy": "sampled", "eval/greedy_accuracy": "greedy"}
TIMING_PREFIX = "timing/"
STEP_TIME_KEY = "timing/step"
MAX_PHASES = 8  # more phases than this are folded into "other"


def _series(records: list[dict], key: str) -> dict[int, float]:
    """step -> value for every record holding a finite number under ``key``
    (a later record for the same step wins)."""
    out: dict[int, float] = {}
    for rec in records:
        value, step = rec.get(key), rec.get("step")
        if (
            isinstance(step, int)
            and isinstance(value, (int, float))
            and not isinstance(value, bool)
            and math.isfinite(value)
        ):
            out[step] = float(value)
    return dict(sorted(out.items()))


def _moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` points."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _no_data(ax, what: str) -> None:
    ax.text(
        0.5,
        0.5,
        f"no data\n({what})",
        ha="center",
        va="center",
        transform=ax.transAxes,
        color="gray",
    )
    ax.set_xticks([])
    ax.set_yticks([])


def _plot_reward(ax, records: list[dict]) -> None:
    ax.set_title("Training reward")
    series = _series(records, REWARD_KEY)
    if not series:
        return _no_data(ax, REWARD_KEY)
    steps, values = list(series), list(series.values())
    window = max(1, min(50, len(values) // 10))
    ax.plot(
        steps,
        values,
        color="tab:blue",
        alpha=0.35 if window > 1 else 1.0,
        lw=1,
        marker="." if len(steps) < 50 else None,
        label=REWARD_KEY,
    )
    if window > 1:
        ax.plot(
            steps,
            _moving_average(values, window),
            color="tab:blue",
            lw=2,
            label=f"moving avg ({window})",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)


def _plot_eval(ax, records: list[dict]) -> None:
    binary = _series(records, "eval/reward_binary")
    what = "accuracy" if not binary or list(binary.values())[-1] else "mean reward"
    ax.set_title(f"Held-out {what}")
    all_values = []
    for key, label in EVAL_KEYS.items():
        series = _series(records, key)
        if series:
            ax.plot(list(series), list(series.values()), marker="o", ms=4, label=f"{label} ({key})")
            all_values += series.values()
    if not all_values:
        return _no_data(ax, " / ".join(EVAL_KEYS))
    if min(all_values) >= 0.0 and max(all_values) <= 1.0:
        ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("step")
    ax.set_ylabel(what)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)


def _plot_timing(ax, records: list[dict]) -> None:
    ax.set_title("Wall time per phase")
    keys = sorted(
        {k for r in records for k in r if k.startswith(TIMING_PREFIX) and k != STEP_TIME_KEY}
    )
    per_key = {k: _series(records, k) for k in keys}
    per_key = {k: s for k, s in per_key.items() if s}
    if not per_key:
        return _no_data(ax, TIMING_PREFIX + "*")
    steps = sorted({s for series in per_key.values() for s in series})
    # largest phases first; fold the tail into "other"
    ordered = sorted(per_key, key=lambda k: -sum(per_key[k].values()))
    layers = [
        (k[len(TIMING_PREFIX) :], [per_key[k].get(s, 0.0) for s in steps])
        for k in ordered[:MAX_PHASES]
    ]
    if len(ordered) > MAX_PHASES:
        rest = ordered[MAX_PHASES:]
        layers.append(("other", [sum(per_key[k].get(s, 0.0) for k in rest) for s in steps]))
    if len(steps) <= 60:
        bottom = [0.0] * len(steps)
        for name, vals in layers:
            ax.bar(steps, vals, bottom=bottom, label=name, width=0.8)
            bottom = [b + v for b, v in zip(bottom, vals)]
    else:
        ax.stackplot(
            steps, *[vals for _, vals in layers], labels=[name for name, _ in layers], alpha=0.85
        )
    top = max(sum(vals[i] for _, vals in layers) for i in range(len(steps)))
    step_time = _series(records, STEP_TIME_KEY)
    if step_time:
        ax.plot(
            list(step_time),
            list(step_time.values()),
            color="black",
            lw=1,
            ls="--",
            label="step (total)",
        )
        top = max(top, max(step_time.values()))
    ax.set_ylim(0, top * 1.3 or 1.0)  # headroom for the legend
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(loc="upper center", fontsize=8, ncol=min(len(layers) + 1, 5))


def write_report(run_dir: str | os.PathLike, title: str = "") -> Path:
    """Draw ``run_dir/report.png`` from ``run_dir/metrics.jsonl``; return its path."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    fig = Figure(figsize=(9, 11), dpi=100, layout="constrained")
    ax_reward, ax_eval, ax_time = fig.subplots(3, 1)
    _plot_reward(ax_reward, records)
    _plot_eval(ax_eval, records)
    _plot_timing(ax_time, records)
    for ax in (ax_reward, ax_eval, ax_time):
        if ax.has_data():  # "no data" panels keep their blank axes
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(title or run_dir.name, fontsize=13)
    path = run_dir / "report.png"
    fig.savefig(path)
    return path
