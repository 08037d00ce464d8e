"""Event-driven simulator of pipeline schedules, and DeepSeek-V3's closed-form bubbles to check it.

Why: a pipeline schedule trades idle time (the bubble) against activation and parameter memory,
and which one wins depends on the ratio of forward, input-backward and weight-backward costs. The
simulator answers that for any costs without GPUs, and the closed forms of DeepSeek-V3's Table 2
(arXiv 2412.19437) pin it down: at zero communication cost and the costs the formulas assume, the
simulated bubbles equal them exactly.

Model. Each rank runs its actions (``schedule_orders.Plan``) one at a time, in order. An action
starts when the rank is free and its inputs exist:

- ``F`` of micro-batch m on stage s needs ``F`` of m on stage s - 1;
- ``B`` of m on stage s needs ``B`` of m on stage s + 1 (a model's last stage: its own ``F``);
- ``W`` needs the ``B`` of the same stage and micro-batch;
- fused actions (``BW``, ``FB``) need what their parts need from outside themselves.

A dependency between two ranks costs ``comm`` more (one hop; the V's turn and a rank's own stages
are free). An order that waits on something that never runs is a deadlock and raises.

Bubble. The step time (makespan) runs from the first action's start to the last one's end. A
rank's bubble is the step time minus the time it computes. ``bubble`` is the largest over ranks;
for every schedule with the same work on each rank (all but DualPipe(V) with an overlap gain) it
is every rank's bubble, and it is the quantity of Table 2. ``bubble_fraction`` is the idle share
of all ranks' time: the mean rank bubble over the step time.

Activations are counted per rank in micro-batch-stages (one micro-batch's activations of one
stage, Table 2's unit): a forward adds one, the weight backward (``W``, or the end of ``BW`` or an
``FB``'s backward half) frees one, and the peak counts the inputs of an action while it runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from hybridrl.parallel.schedule_orders import SCHEDULES, Action, Plan, build

__all__ = [
    "SCHEDULES",
    "Costs",
    "Deadlock",
    "SimResult",
    "TABLE2",
    "TABLE2_EXACT",
    "run",
    "simulate",
    "table2_bubble",
    "table2_exact",
    "validate",
]


@dataclass(frozen=True)
class Costs:
    """Per-stage costs of one micro-batch: forward ``f``, input backward ``b``, weight backward
    ``w`` (a full backward costs ``b + w``), the overlapped forward-and-full-backward chunk ``fb``
    (default ``f + b + w``: no gain from overlapping) and one hop of communication ``comm``."""

    f: float = 1.0
    b: float = 1.0
    w: float = 1.0
    fb: float | None = None
    comm: float = 0.0

    @property
    def full_b(self) -> float:
        """Table 2's B: a full backward chunk."""
        return self.b + self.w

    @property
    def f_and_b(self) -> float:
        """Table 2's F&B."""
        return self.f + self.b + self.w if self.fb is None else self.fb

    def duration(self, action: Action) -> float:
        return {
            "F": self.f,
            "B": self.b,
            "W": self.w,
            "BW": self.full_b,
            "FB": self.f_and_b,
        }[action.kind]

    def scaled(self, factor: float) -> Costs:
        """The same costs for a stage ``factor`` times as large (communication unchanged)."""
        fb = None if self.fb is None else self.fb * factor
        return Costs(self.f * factor, self.b * factor, self.w * factor, fb, self.comm)


class Deadlock(RuntimeError):
    """A schedule whose ranks all wait on passes that can never run."""


@dataclass
class SimResult:
    plan: Plan
    costs: Costs
    timeline: list[list[tuple[Action, float, float]]]
    makespan: float
    busy: list[float]
    peak_activations: list[int]
    bubbles: list[float] = field(init=False)

    def __post_init__(self) -> None:
        self.bubbles = [self.makespan - b for b in self.busy]

    @property
    def bubble(self) -> float:
        return max(self.bubbles)

    @property
    def bubble_fraction(self) -> float:
        return sum(self.bubbles) / (len(self.bubbles) * self.makespan)

    @property
    def peak_activation(self) -> int:
        return max(self.peak_activations)


def validate(plan: Plan) -> None:
    """Every micro-batch gets F, B and W on every stage exactly once, each on the stage's rank."""
    seen: dict[tuple[str, int, int], int] = {}
    for rank, order in enumerate(plan.orders):
        for action in order:
            for part in action.parts():
                if plan.stage_rank[part[1]] != rank:
                    raise ValueError(f"{plan.name}: {action} runs on rank {rank}, not its stage's")
                seen[part] = seen.get(part, 0) + 1
    mbs = range(plan.microbatches_per_chain)
    want = {(k, s, m) for k in "FBW" for s in range(plan.num_stages) for m in mbs}
    wrong = sorted(p for p in want | set(seen) if seen.get(p, 0) != 1)
    if wrong:
        raise ValueError(f"{plan.name}: passes missing, repeated or unknown: {wrong[:8]}")


def _deps(part: tuple[str, int, int], chain: int) -> list[tuple[str, int, int]]:
    """The passes ``part`` needs; ``chain`` stages make one model (a chain's first stage reads the
    data, its last one computes the loss)."""
    kind, s, m = part
    if kind == "F":
        return [("F", s - 1, m)] if s % chain else []
    if kind == "B":
        return [("B", s + 1, m)] if (s + 1) % chain else [("F", s, m)]
    return [("B", s, m)]


def simulate(plan: Plan, costs: Costs) -> SimResult:
    """Each action's start and end: as early as its rank and its inputs allow."""
    validate(plan)
    ends: dict[tuple[str, int, int], float] = {}
    pos = [0] * plan.pp
    free = [0.0] * plan.pp
    timeline: list[list[tuple[Action, float, float]]] = [[] for _ in range(plan.pp)]
    remaining = sum(len(o) for o in plan.orders)
    while remaining:
        progressed = False
        for rank, order in enumerate(plan.orders):
            while pos[rank] < len(order):
                action = order[pos[rank]]
                own = set(action.parts())
                deps = {d for p in own for d in _deps(p, plan.stages_per_chain)} - own
                if any(d not in ends for d in deps):
                    break
                ready = [
                    ends[d] + (costs.comm if plan.stage_rank[d[1]] != rank else 0.0) for d in deps
                ]
                start = max([free[rank], *ready])
                end = start + costs.duration(action)
                for p in own:
                    ends[p] = end
                timeline[rank].append((action, start, end))
                free[rank] = end
                pos[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: str(o[pos[r]]) for r, o in enumerate(plan.orders) if pos[r] < len(o)}
            raise Deadlock(f"{plan.name}: every rank waits; next actions {stuck}")
    busy = [sum(e - s for _, s, e in t) for t in timeline]
    return SimResult(plan, costs, timeline, max(free), busy, _peaks(plan))


def _peaks(plan: Plan) -> list[int]:
    peaks = []
    for order in plan.orders:
        live = peak = 0
        for action in order:
            parts = action.parts()
            live += sum(p[0] == "F" for p in parts)
            peak = max(peak, live)
            live -= sum(p[0] == "W" for p in parts)
        peaks.append(peak)
    return peaks


def run(name: str, pp: int, n_microbatches: int, costs: Costs) -> SimResult:
    return simulate(build(name, pp, n_microbatches), costs)


# --- DeepSeek-V3 Table 2 --------------------------------------------------------------------------
# PP is the number of stages; F a forward chunk, B a full backward chunk, W a weight backward, F&B
# an overlapped forward and backward chunk.
TABLE2: dict[str, Callable[[int, Costs], float]] = {
    "1f1b": lambda pp, c: (pp - 1) * (c.f + c.full_b),
    "zb1p": lambda pp, c: (pp - 1) * (c.f + c.full_b - 2 * c.w),
    "dualpipe": lambda pp, c: (pp / 2 - 1) * (c.f_and_b + c.full_b - 3 * c.w),
    "dualpipev": lambda pp, c: (pp / 2 - 1) * (c.f_and_b + c.full_b - 3 * c.w),
}


# Where each row is exact for these orders (zero communication): the costs the derivations assume.
# 1F1B: any costs. ZB1P: W <= F (a larger W cannot hide in the drain; the bubble is then
# (PP - 1)(B - W)). DualPipeV: F equals the input backward (B - W), as the paper's figure draws
# it, W <= F, and F&B >= B (an overlapped chunk is not shorter than its own backward).
TABLE2_EXACT: dict[str, Callable[[Costs], bool]] = {
    "1f1b": lambda c: True,
    "zb1p": lambda c: c.w <= c.f,
    "dualpipev": lambda c: c.f == c.b and c.w <= c.f and c.f_and_b >= c.full_b,
}
TABLE2_EXACT["dualpipe"] = TABLE2_EXACT["dualpipev"]


def table2_bubble(name: str, stages: int, costs: Costs) -> float | None:
    """Table 2's bubble for ``stages`` pipeline stages, or None where the table has no row."""
    formula = TABLE2.get(name)
    return None if formula is None else formula(stages, costs)


def table2_exact(name: str, costs: Costs) -> bool | None:
    """Whether the simulated bubble equals Table 2's at these costs (None: no row)."""
    check = TABLE2_EXACT.get(name)
    return None if check is None else check(costs) and costs.comm == 0
