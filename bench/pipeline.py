"""Pipeline schedules: simulated bubbles against DeepSeek-V3's Table 2, and a measured run.

    python bench/pipeline.py [--pp 2,4] [--microbatches 8] [--f 1 --b 1 --w 1 --fb X --comm 0]
                             [--schedules gpipe,1f1b,...] [--png-dir docs/img] [--no-measure]

For each schedule and pipeline size, the event-driven simulator (``hybridrl/parallel/
schedule_sim.py``) gives the step time, each rank's bubble (step time minus its compute), the
idle fraction of all ranks, the peak activations (micro-batch-stages) and the parameter copies
(stages per rank); Table 2's closed form is printed next to the simulated bubble where the table
has a row, with whether the costs are the ones it assumes (then the two are equal).

Costs are for one micro-batch through a 1/pp share of the model (a stage of the one-stage-per-rank
schedules); schedules with two stages per rank run stages of half that cost, so every schedule
does the same work and 1F1B is the baseline measured in the same run. ``F&B`` defaults to
``F + B + W`` (no gain from overlapping), the honest figure for a dense model whose runtime runs
the two halves one after the other.

The measured figures come from ``bench/pipeline_run.py`` (``measure(schedule, pp,
n_microbatches)``, a real ``torch.distributed.pipelining`` run): the fraction of the step each
rank is idle, mean over ranks (``bubble_measured``), and per rank. Where that module is missing
or fails, the fields are null and ``measure_error`` says why. ``dualpipev_below_1f1b`` compares
the idle fractions of DualPipeV and 1F1B at the largest ``--pp``, simulated and measured.

With ``--png-dir``, one timeline per schedule at ``--png-pp`` ranks: ``pipeline_<schedule>.png``.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybridrl.parallel.schedule_orders import SCHEDULES, build  # noqa: E402
from hybridrl.parallel.schedule_sim import (  # noqa: E402
    Costs,
    SimResult,
    simulate,
    table2_bubble,
    table2_exact,
)

COLORS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868", "BW": "#C44E52", "FB": "#8172B3"}
LABELS = {
    "F": "F: forward",
    "B": "B: backward (inputs)",
    "W": "W: backward (weights)",
    "BW": "full backward (B+W)",
    "FB": "F&B: overlapped forward + full backward",
}


def _r(x: float) -> float:
    return round(x, 4)


def simulate_one(name: str, pp: int, m: int, costs: Costs) -> tuple[dict, SimResult]:
    plan = build(name, pp, m)
    # a stage is 1 / stages_per_chain of the model; the costs given are for 1 / pp of it
    share = plan.pp / plan.stages_per_chain
    stage_costs = costs.scaled(share)
    res = simulate(plan, stage_costs)
    formula = table2_bubble(name, plan.stages_per_chain, stage_costs)
    return {
        "n_microbatches": m,
        "stages": plan.stages_per_chain,
        "model_copies": plan.chains,
        "stage_costs": _costs_json(stage_costs),
        "makespan_sim": _r(res.makespan),
        "bubble_sim": _r(res.bubble),
        "bubble_per_rank_sim": [_r(b) for b in res.bubbles],
        "bubble_formula": None if formula is None else _r(formula),
        "formula_exact_here": table2_exact(name, stage_costs),
        "bubble_fraction_sim": _r(res.bubble_fraction),
        "peak_activations": res.peak_activation,
        "peak_activations_per_rank": res.peak_activations,
        "param_copies": plan.param_copies,
        # the same two in units of a 1/pp share of the model (what a rank's memory holds)
        "peak_activations_share_units": _r(res.peak_activation * share),
        "param_share_of_model": _r(plan.model_share_per_rank),
    }, res


def _costs_json(c: Costs) -> dict:
    return {"f": _r(c.f), "b": _r(c.b), "w": _r(c.w), "fb": _r(c.f_and_b), "comm": _r(c.comm)}


def load_measure():
    """The real run's ``measure``, or None and the reason."""
    try:
        from bench.pipeline_run import measure
    except Exception as e:  # a missing or broken module leaves the simulated figures standing
        return None, _reason(e)
    return measure, None


def _reason(e: Exception) -> str:
    """The error's type and its last line (a failed run's error carries the ranks' logs)."""
    lines = [x for x in str(e).splitlines() if x.strip()]
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"[:300]


def measured(measure, why: str | None, name: str, pp: int, m: int) -> dict:
    if measure is None:
        return {"bubble_measured": None, "stage_idle_measured": None, "measure_error": why}
    try:
        out = measure(name, pp, m)
        return {
            "bubble_measured": _r(out["bubble_measured"]),
            "stage_idle_measured": [_r(x) for x in out["stage_idle"]],
            "measure_error": None,
        }
    except Exception as e:
        return {
            "bubble_measured": None,
            "stage_idle_measured": None,
            "measure_error": _reason(e),
        }


def draw(res: SimResult, path: Path) -> Path:
    """One schedule's timeline: ranks as rows, each action a bar coloured by kind, idle grey."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    plan = res.plan
    fig, ax = plt.subplots(figsize=(11, 0.55 * plan.pp + 1.3))
    kinds = set()
    for rank, timeline in enumerate(res.timeline):
        y = plan.pp - 1 - rank
        ax.barh(y, res.makespan, left=0, height=0.8, color="#E5E5E5")
        for action, start, end in timeline:
            kinds.add(action.kind)
            second = plan.stages_per_rank > 1 and action.stage >= plan.pp
            ax.barh(
                y,
                end - start,
                left=start,
                height=0.8,
                color=COLORS[action.kind],
                alpha=0.6 if second else 1.0,
                edgecolor="white",
                linewidth=0.5,
            )
            ax.text((start + end) / 2, y, str(action.mb), ha="center", va="center", fontsize=6)
    ax.set_yticks(range(plan.pp), [f"rank {plan.pp - 1 - y}" for y in range(plan.pp)])
    ax.set_xlim(0, res.makespan)
    paler = {1: "", 2: "; paler: the rank's later stage"}.get(plan.stages_per_rank, "")
    if plan.chains > 1:
        paler = "; paler: the second model copy (fed from the last rank)"
    ax.set_xlabel("time (cost units)" + paler)
    handles = [Patch(color=COLORS[k], label=LABELS[k]) for k in COLORS if k in kinds]
    handles.append(Patch(color="#E5E5E5", label="idle"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=3, fontsize=8)
    ax.set_title(
        f"{plan.name}: pp={plan.pp}, {plan.n_microbatches} micro-batches, "
        f"bubble {res.bubble_fraction:.1%} of rank time (simulated)"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", default="2,4", help="pipeline sizes (ranks)")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--schedules", default=",".join(SCHEDULES))
    p.add_argument("--f", type=float, default=1.0, help="forward of a 1/pp share")
    p.add_argument("--b", type=float, default=1.0, help="backward for inputs of a 1/pp share")
    p.add_argument("--w", type=float, default=1.0, help="backward for weights of a 1/pp share")
    p.add_argument("--fb", type=float, default=None, help="F&B of a 1/pp share (F+B+W)")
    p.add_argument("--comm", type=float, default=0.0, help="one hop between ranks")
    p.add_argument("--png-dir", type=Path, default=None)
    p.add_argument("--png-pp", type=int, default=4)
    p.add_argument("--no-measure", action="store_true", help="simulate only")
    args = p.parse_args(argv)
    names = args.schedules.split(",")
    for name in names:
        if name not in SCHEDULES:
            p.error(f"--schedules: unknown {name!r}; choose from {', '.join(SCHEDULES)}")
    pps = [int(x) for x in args.pp.split(",")]
    m = args.microbatches
    costs = Costs(args.f, args.b, args.w, args.fb, args.comm)
    measure, why = (None, "--no-measure") if args.no_measure else load_measure()

    out: dict = {
        "costs": {
            "unit": "one micro-batch through a 1/pp share of the model",
            **_costs_json(costs),
        },
        "bubble": "per rank: step time minus the rank's compute; bubble_sim: the largest rank's",
        "bubble_fraction": "idle share of all ranks' time (mean rank bubble / step time)",
        "schedules": {},
    }
    for name in names:
        entry = out["schedules"].setdefault(name, {})
        for pp in pps:
            key = f"pp{pp}"
            try:
                entry[key], res = simulate_one(name, pp, m, costs)
            except ValueError as e:
                entry[key] = {"error": str(e)}
                continue
            entry[key] |= measured(measure, why, name, pp, m)
            if args.png_dir is not None and pp == args.png_pp:
                entry[key]["png"] = str(draw(res, args.png_dir / f"pipeline_{name}.png"))
    top = f"pp{max(pps)}"
    dv = out["schedules"].get("dualpipev", {}).get(top, {})
    base = out["schedules"].get("1f1b", {}).get(top, {})
    if "bubble_fraction_sim" in dv and "bubble_fraction_sim" in base:
        both = dv.get("bubble_measured") is not None and base.get("bubble_measured") is not None
        out["dualpipev_below_1f1b"] = {
            "pp": max(pps),
            "n_microbatches": m,
            "simulated": dv["bubble_fraction_sim"] < base["bubble_fraction_sim"],
            "measured": dv["bubble_measured"] < base["bubble_measured"] if both else None,
        }
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
