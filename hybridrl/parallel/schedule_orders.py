"""Per-rank action orders of the pipeline schedules, built without a process group.

A pipeline schedule is, for each rank, the order in which it runs its compute actions; the
simulator (``schedule_sim.py``) turns an order plus per-action costs into a timeline. Keeping the
orders as plain data lets tests check a schedule (every micro-batch gets its forward and both halves
of its backward on every stage exactly once, and the order can run without deadlock) and lets the
docs draw it, all without starting a process group.

Action kinds:

- ``F``: forward of one micro-batch on one stage;
- ``B``: backward for the stage's inputs only (its weight gradient is left to a later ``W``);
- ``W``: backward for the stage's weights (needs the ``B`` of the same micro-batch and stage);
- ``BW``: a full backward, ``B`` and ``W`` fused, where a schedule does not split them;
- ``FB``: DualPipe's overlapped chunk: a forward on one stage and a full backward on another,
  run together so that one's communication hides behind the other's compute.

Each schedule is a function ``(pp, n_microbatches) -> Plan`` in ``SCHEDULES``, so that callers pick
one by name without a chain of branches.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

KINDS = ("F", "B", "W", "BW", "FB")


@dataclass(frozen=True)
class Action:
    """One compute action of a rank. ``FB`` also names its backward half (``b_stage``, ``b_mb``)."""

    kind: str
    stage: int
    mb: int
    b_stage: int = -1
    b_mb: int = -1

    def parts(self) -> tuple[tuple[str, int, int], ...]:
        """The elementary passes this action performs: ``(kind, stage, mb)`` with kind F, B or W."""
        if self.kind in ("F", "B", "W"):
            return ((self.kind, self.stage, self.mb),)
        if self.kind == "BW":
            return (("B", self.stage, self.mb), ("W", self.stage, self.mb))
        if self.kind == "FB":
            return (
                ("F", self.stage, self.mb),
                ("B", self.b_stage, self.b_mb),
                ("W", self.b_stage, self.b_mb),
            )
        raise ValueError(f"unknown action kind {self.kind!r}; expected one of {KINDS}")

    def __str__(self) -> str:
        if self.kind == "FB":
            return f"F{self.stage}.{self.mb}&BW{self.b_stage}.{self.b_mb}"
        return f"{self.kind}{self.stage}.{self.mb}"


@dataclass(frozen=True)
class Plan:
    """A schedule for ``pp`` ranks: the owner rank of each stage and each rank's action order.

    ``chains`` is the number of model copies the stages form (bidirectional DualPipe: 2, one per
    direction, each with its half of the micro-batches). Stage ids run chain after chain; within a
    chain a micro-batch flows from its first stage to its last, where the loss is.

    ``param_copies`` is the parameter memory per rank in units of one stage, the unit of
    DeepSeek-V3's Table 2 ("parameter per device", compared at the same number of stages): the
    schedules with two stages per rank hold 2.
    """

    name: str
    pp: int
    n_microbatches: int
    stage_rank: tuple[int, ...]
    orders: tuple[tuple[Action, ...], ...]
    chains: int = 1

    @property
    def num_stages(self) -> int:
        return len(self.stage_rank)

    @property
    def stages_per_chain(self) -> int:
        """Table 2's PP: the stages one micro-batch goes through."""
        return self.num_stages // self.chains

    @property
    def microbatches_per_chain(self) -> int:
        return self.n_microbatches // self.chains

    @property
    def stages_per_rank(self) -> int:
        return self.num_stages // self.pp

    @property
    def param_copies(self) -> int:
        return self.stages_per_rank

    @property
    def model_share_per_rank(self) -> float:
        """The fraction of one model's parameters a rank holds (1 / pp unless copies are kept)."""
        return self.stages_per_rank / self.stages_per_chain


@dataclass
class _RankOrder:
    """Builds one rank's order: per-stage micro-batch counters and the FIFO of deferred ``W``s."""

    actions: list[Action] = field(default_factory=list)
    next_f: dict[int, int] = field(default_factory=dict)
    next_b: dict[int, int] = field(default_factory=dict)
    pending_w: deque = field(default_factory=deque)

    def _take(self, counters: dict[int, int], stage: int) -> int:
        mb = counters.get(stage, 0)
        counters[stage] = mb + 1
        return mb

    def f(self, stage: int) -> None:
        self.actions.append(Action("F", stage, self._take(self.next_f, stage)))

    def b(self, stage: int, split: bool = True) -> None:
        """Backward of the stage's next micro-batch: input-grad only (W deferred) or full."""
        mb = self._take(self.next_b, stage)
        if split:
            self.actions.append(Action("B", stage, mb))
            self.pending_w.append((stage, mb))
        else:
            self.actions.append(Action("BW", stage, mb))

    def w(self, stage: int | None = None) -> None:
        """The oldest deferred weight gradient (of ``stage`` if given), if any."""
        pick = [i for i, p in enumerate(self.pending_w) if stage is None or p[0] == stage]
        if pick:
            s, mb = self.pending_w[pick[0]]
            del self.pending_w[pick[0]]
            self.actions.append(Action("W", s, mb))

    def fb(self, f_stage: int, b_stage: int) -> None:
        f_mb = self._take(self.next_f, f_stage)
        b_mb = self._take(self.next_b, b_stage)
        self.actions.append(Action("FB", f_stage, f_mb, b_stage, b_mb))

    def flush_w(self) -> None:
        while self.pending_w:
            self.w()


def _orders(ranks: list[_RankOrder]) -> tuple[tuple[Action, ...], ...]:
    return tuple(tuple(r.actions) for r in ranks)


def _plan(name: str, pp: int, m: int, stage_rank: list[int], ranks: list[_RankOrder]) -> Plan:
    return Plan(name, pp, m, tuple(stage_rank), _orders(ranks))


def _check(pp: int, m: int, min_m: int = 1) -> None:
    if pp < 1 or m < min_m:
        raise ValueError(f"need pp >= 1 and at least {min_m} micro-batches, got pp={pp}, m={m}")


def v_stage_rank(pp: int) -> list[int]:
    """V placement of ``2 * pp`` stages: down the ranks and back up (rank 0: first and last)."""
    return [*range(pp), *reversed(range(pp))]


# --- one stage per rank ---------------------------------------------------------------------------
def gpipe(pp: int, m: int) -> Plan:
    """All forwards, then all full backwards: simple, but every micro-batch's activations live."""
    _check(pp, m)
    ranks = [_RankOrder() for _ in range(pp)]
    for r, o in enumerate(ranks):
        for _ in range(m):
            o.f(r)
        for _ in range(m):
            o.b(r, split=False)
    return _plan("gpipe", pp, m, list(range(pp)), ranks)


def _one_f_one_b(name: str, pp: int, m: int, split: bool) -> Plan:
    """1F1B: rank r runs ``pp - 1 - r`` warm-up forwards, then alternates one forward and one
    backward, then drains. With ``split`` (ZB-H1) each backward is B only and rank r defers the
    ``W`` of its first r backwards to the end, where they fill the tail that 1F1B leaves idle; the
    number of micro-batches alive per rank stays at most ``pp`` as in 1F1B."""
    _check(pp, m)
    ranks = [_RankOrder() for _ in range(pp)]
    for r, o in enumerate(ranks):
        warmup = min(pp - 1 - r, m)
        for _ in range(warmup):
            o.f(r)
        for k in range(m):
            if k < m - warmup:
                o.f(r)
            o.b(r, split=split)
            if split and k >= r:  # the first r backwards leave their W for the drain
                o.w()
        o.flush_w()
    return _plan(name, pp, m, list(range(pp)), ranks)


def one_f_one_b(pp: int, m: int) -> Plan:
    return _one_f_one_b("1f1b", pp, m, split=False)


def zb1p(pp: int, m: int) -> Plan:
    return _one_f_one_b("zb1p", pp, m, split=True)


# --- two stages per rank --------------------------------------------------------------------------
def interleaved_1f1b(pp: int, m: int, chunks: int = 2) -> Plan:
    """Megatron's interleaved 1F1B: stage s on rank ``s % pp``; forwards go round the ranks in
    groups of ``pp`` micro-batches per chunk, so each bubble is a chunk's cost instead of a whole
    rank's share. Needs ``m`` a multiple of ``pp`` (the grouping)."""
    _check(pp, m)
    if m % pp:
        raise ValueError(f"interleaved_1f1b needs n_microbatches divisible by pp, got {m}, {pp}")
    stages = chunks * pp
    ranks = [_RankOrder() for _ in range(pp)]
    for r, o in enumerate(ranks):
        fwd = [c * pp + r for _ in range(m // pp) for c in range(chunks) for _ in range(pp)]
        bwd = [
            c * pp + r for _ in range(m // pp) for c in reversed(range(chunks)) for _ in range(pp)
        ]
        warmup = min((chunks - 1) * pp + 2 * (pp - 1 - r), len(fwd))
        for s in fwd[:warmup]:
            o.f(s)
        for i, s in enumerate(fwd[warmup:]):
            o.f(s)
            o.b(bwd[i], split=False)
        for s in bwd[len(fwd) - warmup :]:
            o.b(s, split=False)
    return _plan("interleaved_1f1b", pp, m, [s % pp for s in range(stages)], ranks)


def zbv(pp: int, m: int) -> Plan:
    """Zero-bubble V (ZB-V): two stages per rank in a V, backward split into B and W. Warm-up
    forwards fill the V, then each rank alternates F, B, W on its two stages; W passes of the last
    backwards are deferred to fill the drain. Needs at least ``2 * pp`` micro-batches."""
    _check(pp, m, 2 * pp)
    ranks = [_RankOrder() for _ in range(pp)]
    for r, o in enumerate(ranks):
        s0, s1 = r, 2 * pp - 1 - r
        for _ in range(2 * (pp - r) - 1):
            o.f(s0)
        for _ in range(r):
            o.f(s1)
            o.f(s0)
        for _ in range(pp - r):
            o.f(s1)
            o.b(s1)
            o.w()
        while o.next_f.get(s0, 0) < m or o.next_f.get(s1, 0) < m:
            if o.next_f.get(s0, 0) < m:
                o.f(s0)
            o.b(s0)
            o.w()
            o.f(s1)
            o.b(s1)
            o.w()
        for _ in range(r):
            o.b(s0)
            o.b(s1)
        for _ in range(pp - r):
            o.b(s0)
            o.w(s0)
        for s in (s1, s0):
            while any(p[0] == s for p in o.pending_w):
                o.w(s)
    return _plan("zbv", pp, m, v_stage_rank(pp), ranks)


def _dualpipe_rank(o: _RankOrder, s0: int, s1: int, half: int, h: int, n: int) -> None:
    """One rank of DualPipe's phases. ``s0`` is the stage its first forwards go to, ``s1`` the
    other; ``half`` ranks form one direction's half-pipeline, this rank is ``h`` hops from its end
    (``h == half - 1``: at the turn) and each direction carries ``n`` micro-batches."""
    turn = h == half - 1
    for _ in range(2 * (half - h - 1)):
        o.f(s0)
    for _ in range(h + 1):
        o.f(s0)
        o.f(s1)
    for _ in range(half - h - 1):
        o.b(s1)
        o.w()
        o.f(s1)
    for i in range(n - 2 * half + h + 1):
        if i == 0 and turn:
            o.f(s0)  # the turn: nothing to overlap with yet
            o.b(s1, split=False)
        else:
            o.fb(s0, s1)
        o.fb(s1, s0)
    for _ in range(half - h - 1):
        o.b(s1, split=False)
        o.fb(s1, s0)
    split = False
    for i in range(h + 1):
        # the second half of the drain's backwards defer their W to fill the tail
        split = split or (i == (h + 1) // 2 and h % 2 == 1)
        o.b(s1, split=split)
        split = split or (i == (h + 1) // 2 and h % 2 == 0)
        o.b(s0, split=split)
    for _ in range(half - h - 1):
        o.w()
        o.b(s0)
    o.flush_w()


def dualpipev(pp: int, m: int) -> Plan:
    """DualPipeV (DeepSeek's cut-in-half DualPipe): two stages per rank in a V. After the warm-up
    forwards, the steady state pairs each forward of one stage with a full backward of the other
    in one overlapped ``FB`` chunk; B/W splitting is used only where it fills a gap (right after the
    warm-up and in the drain). Needs at least ``2 * pp`` micro-batches."""
    _check(pp, m, 2 * pp)
    ranks = [_RankOrder() for _ in range(pp)]
    for r, o in enumerate(ranks):
        _dualpipe_rank(o, r, 2 * pp - 1 - r, pp, r, m)
    return _plan("dualpipev", pp, m, v_stage_rank(pp), ranks)


def dualpipe(pp: int, m: int) -> Plan:
    """Bidirectional DualPipe: two model copies, one fed from rank 0 down, one from the last rank
    up, each with half the micro-batches. Rank r holds stage r of the first and stage
    ``pp - 1 - r`` of the second (global id ``2 pp - 1 - r``); ranks r and ``pp - 1 - r`` run
    mirrored DualPipeV phases. Needs an even pp and an even ``m >= 2 * pp``."""
    _check(pp, m, 2 * pp)
    if pp % 2 or m % 2:
        raise ValueError(f"dualpipe needs an even pp and micro-batch count, got {pp}, {m}")
    ranks = [_RankOrder() for _ in range(pp)]
    for r, o in enumerate(ranks):
        down, up = r, 2 * pp - 1 - r
        s0, s1 = (down, up) if r < pp // 2 else (up, down)
        _dualpipe_rank(o, s0, s1, pp // 2, min(r, pp - 1 - r), m // 2)
    return Plan("dualpipe", pp, m, tuple(v_stage_rank(pp)), _orders(ranks), chains=2)


SCHEDULES: dict[str, Callable[[int, int], Plan]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": interleaved_1f1b,
    "zb1p": zb1p,
    "zbv": zbv,
    "dualpipev": dualpipev,
    "dualpipe": dualpipe,
}


def build(name: str, pp: int, n_microbatches: int) -> Plan:
    """The plan of a schedule by name (``SCHEDULES``)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose from {', '.join(SCHEDULES)}")
    return SCHEDULES[name](pp, n_microbatches)
