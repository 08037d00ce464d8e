"""``hybridrl profile RUN_DIR [--steps A:B]``: where a run's time went.

Prints, per phase, the total and mean seconds, the share of the steps' wall time, and MFU and
tokens/s (all from ``metrics.jsonl``: ``timing/<phase>``, ``perf/mfu_<phase>``,
``perf/tokens_per_s_<phase>``); per worker process, its busy seconds and idle fraction (time in
none of its own spans / step time, from ``timeline.jsonl``); and the fraction of the time in which
generation and training ran at once. Writes ``RUN_DIR/timeline.png``: a Gantt chart, one row per
worker process, coloured by phase, of the last three steps (or ``--steps A:B``). A run without
``timeline.jsonl`` (recorded before it existed) gets the summary from its metrics and a note.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from matplotlib.figure import Figure

from .report import _series
from .sinks import read_metrics
from .timeline import (
    WAITING,
    idle_fractions,
    overlap_fraction,
    read_timeline,
    step_windows,
    worker_key,
)

PNG = "timeline.png"
CHART_STEPS = 3  # steps drawn by default: the last ones
COLORS = {
    "rollout/generate": "tab:blue",
    "rollout/score": "tab:cyan",
    "learner/reference": "tab:purple",
    "learner/old_log_prob": "tab:pink",
    "learner/values": "tab:olive",
    "learner/advantage": "tab:gray",
    "learner/critic_update": "tab:brown",
    "learner/update": "tab:red",
    "learner/wait_batch": "#dddddd",
    "weight_sync/publish": "tab:orange",
    "weight_sync/load": "gold",
}
SPARE = ["tab:green", "darkslateblue", "teal", "salmon", "khaki", "sienna"]


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize(run_dir: str | Path, steps: tuple[int, int] | None = None) -> dict:
    """The numbers :func:`main` prints (``steps``: inclusive 1-based bounds, None: all)."""
    lo, hi = steps or (1, math.inf)
    records = [r for r in read_metrics(run_dir) if lo <= r.get("step", 0) <= hi]
    step_time = {s: v for s, v in _series(records, "timing/step").items() if s >= 1}
    total = sum(step_time.values())
    names = sorted(
        {k[7:] for r in records for k in r if k.startswith("timing/") and k != "timing/step"}
    )
    phases = {}
    for name in names:
        secs = [v for s, v in _series(records, f"timing/{name}").items() if s in step_time]
        mfu = [v for s, v in _series(records, f"perf/mfu_{name}").items() if s in step_time]
        tps = [
            v for s, v in _series(records, f"perf/tokens_per_s_{name}").items() if s in step_time
        ]
        phases[name] = {
            "total_s": sum(secs),
            "mean_s": _mean(secs),
            "share": sum(secs) / total if total else None,
            "mfu": _mean(mfu),
            "tokens_per_s": _mean(tps),
        }
    rows = [r for r in read_timeline(run_dir) if lo <= r["step"] <= hi]
    out = {
        "run_dir": str(run_dir),
        "steps": sorted(step_time),
        "step_s": total,
        "mean_step_s": total / len(step_time) if step_time else None,
        "phases": phases,
        "timeline": bool(rows),
    }
    if rows:
        out |= timeline_summary(rows)
    return out


def timeline_summary(rows: list[dict]) -> dict:
    """Per worker process its busy seconds and idle fraction, per span phase its seconds (summed
    over workers), and the overlap of generation with training, all within the steps' windows."""
    windows = step_windows(rows)
    step_s = sum(b - a for a, b in windows.values())
    idle = idle_fractions(rows)
    spans: dict[str, float] = {}
    for r in rows:
        if r.get("role") != "driver" and r["step"] in windows:
            a, b = windows[r["step"]]
            spans[r["phase"]] = spans.get(r["phase"], 0.0) + max(
                0.0, min(r["t1"], b) - max(r["t0"], a)
            )
    return {
        "timeline_step_s": step_s,
        "workers": {
            _label(key): {"idle_frac": frac, "busy_s": (1 - frac) * step_s}
            for key, frac in sorted(idle.items())
        },
        "span_s": dict(sorted(spans.items(), key=lambda kv: -kv[1])),
        "overlap_gen_train": overlap_fraction(rows),
    }


def _label(key: tuple[str, int, int]) -> str:
    worker, rank, pid = key
    return f"{worker} rank{rank} (pid {pid})"


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_summary(s: dict) -> str:
    steps = s["steps"]
    span = f"steps {steps[0]}..{steps[-1]}" if steps else "no steps"
    lines = [
        f"run {s['run_dir']}: {span} ({len(steps)} steps, {s['step_s']:.2f} s, "
        f"{_fmt(s['mean_step_s'], '.3f')} s per step)",
        "",
        f"{'phase':<16}{'total s':>10}{'mean s':>10}{'share':>8}{'MFU':>8}{'tokens/s':>12}",
    ]
    for name, p in sorted(s["phases"].items(), key=lambda kv: -kv[1]["total_s"]):
        lines.append(
            f"{name:<16}{p['total_s']:>10.3f}{_fmt(p['mean_s'], '.4f'):>10}"
            f"{_fmt(p['share'], '.1%'):>8}{_fmt(p['mfu'], '.3f'):>8}"
            f"{_fmt(p['tokens_per_s'], ',.0f'):>12}"
        )
    lines.append("")
    if not s["timeline"]:
        lines.append(
            "timeline: none (timeline.jsonl is missing: a run recorded before the timeline "
            "existed, or no step finished); per-worker idle time unknown"
        )
        return "\n".join(lines)
    lines.append(f"{'worker process':<36}{'busy s':>10}{'idle':>8}")
    for label, w in s["workers"].items():
        lines.append(f"{label:<36}{w['busy_s']:>10.3f}{w['idle_frac']:>8.1%}")
    lines += ["", f"{'span phase (all workers)':<36}{'seconds':>10}"]
    lines += [f"{name:<36}{secs:>10.3f}" for name, secs in s["span_s"].items()]
    lines.append(
        f"\ngeneration and training at once: {s['overlap_gen_train']:.1%} of the step time"
    )
    return "\n".join(lines)


# --- the Gantt chart ------------------------------------------------------------------------
def chart_steps(rows: list[dict], steps: tuple[int, int] | None = None) -> list[int]:
    have = sorted(step_windows(rows))
    if steps is not None:
        return [s for s in have if steps[0] <= s <= steps[1]]
    return have[-CHART_STEPS:]


def draw_timeline(ax, rows: list[dict], steps: list[int], title: str = "") -> None:
    """One bar row per worker process, spans coloured by phase, the steps' boundaries dashed; x
    in seconds from the first step's start."""
    windows = {s: w for s, w in step_windows(rows).items() if s in steps}
    ax.set_title(title or "timeline", fontsize=10)
    if not windows:
        ax.text(0.5, 0.5, "no timeline", ha="center", va="center", transform=ax.transAxes)
        return
    origin = min(a for a, _ in windows.values())
    end = max(b for _, b in windows.values())
    shown = [r for r in rows if r["step"] in windows and r.get("role") != "driver"]
    keys = sorted({worker_key(r) for r in shown})
    colors = dict(COLORS)
    for r in shown:
        colors.setdefault(r["phase"], SPARE[len(colors) % len(SPARE)])
    for y, key in enumerate(keys):
        by_phase: dict[str, list[tuple[float, float]]] = {}
        for r in shown:
            if worker_key(r) == key:
                by_phase.setdefault(r["phase"], []).append((r["t0"] - origin, r["t1"] - r["t0"]))
        for phase, bars in by_phase.items():
            ax.broken_barh(
                bars,
                (y - 0.38, 0.76),
                facecolors=colors[phase],
                hatch="//" if phase in WAITING else None,
                edgecolor="none",
            )
    for step, (a, _) in sorted(windows.items()):
        ax.axvline(a - origin, color="black", ls="--", lw=0.7)
        ax.text(a - origin, len(keys) - 0.45, f" step {step}", fontsize=7, va="bottom")
    ax.axvline(end - origin, color="black", ls="--", lw=0.7)
    ax.set_yticks(range(len(keys)), [f"{w} r{rank}\npid {pid}" for w, rank, pid in keys])
    ax.set_ylim(-0.6, len(keys) + 0.1)
    ax.set_xlim(min(0.0, min((r["t0"] - origin for r in shown), default=0.0)), end - origin)
    ax.set_xlabel("seconds")
    ax.tick_params(axis="y", labelsize=8)
    used = [p for p in colors if any(r["phase"] == p for r in shown)]
    handles = [
        ax.bar(0, 0, color=colors[p], hatch="//" if p in WAITING else None, label=p) for p in used
    ]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def write_timeline(path: str | Path, panels: list[tuple[str, list[dict], list[int]]]) -> Path:
    """A PNG of one Gantt panel per ``(title, rows, steps)``."""
    fig = Figure(figsize=(11, 1.2 + 2.1 * len(panels)), dpi=90, layout="constrained")
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    for ax, (title, rows, steps) in zip(axes, panels):
        draw_timeline(ax, rows, steps, title)
    fig.savefig(path)
    return Path(path)


# --- the command ----------------------------------------------------------------------------
def parse_steps(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        a = b = 0
    if not 1 <= a <= b:
        raise ValueError(f"--steps must be A:B with 1 <= A <= B, got {text!r}")
    return a, b


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="hybridrl profile", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", help="a run directory (runs/<name>)")
    p.add_argument(
        "--steps", help="A:B, the steps summarised and drawn (default: all; drawn: the last 3)"
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = p.parse_args(argv)
    run_dir = Path(args.run_dir)
    try:
        steps = parse_steps(args.steps)
    except ValueError as e:
        print(f"hybridrl: error: {e}", file=sys.stderr)
        return 2
    if not (run_dir / "metrics.jsonl").is_file() and not (run_dir / "timeline.jsonl").is_file():
        print(
            f"hybridrl: error: {str(run_dir)!r} holds neither metrics.jsonl nor timeline.jsonl "
            "(not a run directory)",
            file=sys.stderr,
        )
        return 2
    summary = summarize(run_dir, steps)
    if summary["timeline"]:
        rows = read_timeline(run_dir)
        shown = chart_steps(rows, steps)
        title = f"{run_dir.name}: steps {shown[0]}..{shown[-1]}" if shown else run_dir.name
        summary["png"] = str(write_timeline(run_dir / PNG, [(title, rows, shown)]))
    print(json.dumps(summary, indent=1) if args.json else format_summary(summary))
    if "png" in summary and not args.json:
        print(f"timeline: {summary['png']}")
    return 0
