"""The pipeline-schedule simulator: its orders are complete and runnable, its timelines honour every
dependency, and its bubbles reproduce DeepSeek-V3's Table 2 exactly where the table's costs hold."""

from __future__ import annotations

from collections import Counter

import pytest

from hybridrl.parallel.schedule_orders import SCHEDULES, Action, Plan, build
from hybridrl.parallel.schedule_sim import (
    Costs,
    Deadlock,
    run,
    simulate,
    table2_bubble,
    table2_exact,
)

# (pp ranks, micro-batches, costs) with the costs Table 2's derivations assume
TABLE2_CASES = [
    (2, 4, Costs(1, 1, 1)),
    (2, 8, Costs(2, 2, 1, fb=3)),
    (3, 6, Costs(1, 1, 0.5, fb=2)),
    (4, 8, Costs(1, 1, 1)),
    (4, 9, Costs(1, 1, 1, fb=2.5)),
    (4, 16, Costs(3, 3, 1, fb=5)),
    (6, 13, Costs(2, 2, 2, fb=4.5)),
    (8, 16, Costs(1.5, 1.5, 0.25, fb=2)),
]


@pytest.mark.parametrize("name", ["1f1b", "zb1p", "dualpipev", "dualpipe"])
@pytest.mark.parametrize(("pp", "m", "costs"), TABLE2_CASES)
def test_table2_bubbles_exact(name, pp, m, costs):
    if name == "dualpipe" and (pp % 2 or m % 2):
        pytest.skip("bidirectional DualPipe needs an even pp and micro-batch count")
    assert table2_exact(name, costs)
    result = run(name, pp, m, costs)
    # Table 2's PP: the stages one micro-batch goes through (DualPipeV: 2 per rank)
    formula = table2_bubble(name, result.plan.stages_per_chain, costs)
    assert result.bubble == pytest.approx(formula, abs=1e-9)
    if not name.startswith("dualpipe") or costs.f_and_b == costs.f + costs.full_b:
        # same work on every rank: every rank idles exactly the table's bubble
        assert result.bubbles == pytest.approx([formula] * pp, abs=1e-9)


@pytest.mark.parametrize("costs", [Costs(2, 1.5, 1), Costs(1.5, 1, 0.5, fb=2.5), Costs(1, 1, 3)])
@pytest.mark.parametrize("pp", [2, 4, 5])
def test_1f1b_bubble_exact_for_any_costs(pp, costs):
    result = run("1f1b", pp, 3 * pp, costs)
    assert result.bubble == pytest.approx((pp - 1) * (costs.f + costs.b + costs.w))


def test_formula_off_where_its_assumptions_fail():
    """A W longer than F cannot hide in ZB1P's drain; DualPipeV with F != B - W leaves more idle."""
    big_w = Costs(1, 1, 2)
    assert not table2_exact("zb1p", big_w)
    zb = run("zb1p", 4, 8, big_w)
    assert zb.bubble > table2_bubble("zb1p", 4, big_w)
    assert zb.bubble == pytest.approx(3 * big_w.b)
    slow_f = Costs(2, 1, 1)
    assert not table2_exact("dualpipev", slow_f)
    dv = run("dualpipev", 4, 8, slow_f)
    assert dv.bubble == pytest.approx(table2_bubble("dualpipev", 8, slow_f) + 3 * (2 - 1))


def _cases():
    for name in SCHEDULES:
        for pp, m in [(1, 2), (2, 4), (3, 6), (4, 8), (4, 12)]:
            if (name == "interleaved_1f1b" and m % pp) or (name == "dualpipe" and pp % 2):
                continue
            yield name, pp, m


@pytest.mark.parametrize(("name", "pp", "m"), list(_cases()))
def test_orders_complete_and_dependencies_honoured(name, pp, m):
    plan = build(name, pp, m)
    passes = Counter(p for order in plan.orders for a in order for p in a.parts())
    per_chain = range(m // plan.chains)
    want = {(k, s, mb) for k in "FBW" for s in range(plan.num_stages) for mb in per_chain}
    assert set(passes) == want
    assert set(passes.values()) == {1}
    for rank, order in enumerate(plan.orders):
        assert all(plan.stage_rank[p[1]] == rank for a in order for p in a.parts())

    costs = Costs(1.0, 0.7, 0.4, fb=1.8, comm=0.3)
    result = simulate(plan, costs)
    end, start, where, owner = {}, {}, {}, {}
    for rank, timeline in enumerate(result.timeline):
        assert [a for a, _, _ in timeline] == list(plan.orders[rank])
        prev_end = 0.0
        for i, (action, s, e) in enumerate(timeline):
            assert s >= prev_end - 1e-12 and e == pytest.approx(s + costs.duration(action))
            prev_end = e
            for p in action.parts():
                start[p], end[p], where[p], owner[p] = s, e, rank, (rank, i)
    chain = plan.stages_per_chain
    for (kind, s, mb), t in start.items():
        if kind == "F":
            needs = [("F", s - 1, mb)] if s % chain else []
        elif kind == "B":
            needs = [("B", s + 1, mb)] if (s + 1) % chain else [("F", s, mb)]
        else:
            needs = [("B", s, mb)]
        for d in needs:
            if owner[d] == owner[(kind, s, mb)]:  # the parts of one fused action
                continue
            hop = costs.comm if where[d] != where[(kind, s, mb)] else 0.0
            assert t >= end[d] + hop - 1e-9, (name, (kind, s, mb), d)
    assert result.makespan == pytest.approx(max(end.values()))


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_memory_as_table2_states(pp):
    m = 3 * pp
    one = run("1f1b", pp, m, Costs())
    assert one.peak_activations == [pp - r for r in range(pp)] and one.plan.param_copies == 1
    zb = run("zb1p", pp, m, Costs())
    assert zb.peak_activations == [pp] * pp and zb.plan.param_copies == 1
    dv = run("dualpipev", pp, m, Costs())  # PP = 2 * pp stages: PP + 1 activations, 2x params
    assert dv.peak_activations == [2 * pp + 1] * pp and dv.plan.param_copies == 2
    assert dv.plan.model_share_per_rank == pytest.approx(1 / pp)
    if pp % 2 == 0:  # bidirectional: PP = pp stages per copy, and two copies of the model
        bi = run("dualpipe", pp, 2 * m, Costs())
        assert bi.peak_activations == [pp + 1] * pp and bi.plan.param_copies == 2
        assert bi.plan.model_share_per_rank == pytest.approx(2 / pp)
    assert run("gpipe", pp, m, Costs()).peak_activation == m


def test_bubble_definition_with_overlap_gain():
    """With F&B cheaper than F + B the ranks differ in work; the bubble is the largest idle."""
    result = run("dualpipev", 4, 16, Costs(1, 1, 1, fb=2.5))
    assert result.bubbles[0] < result.bubbles[-1]
    assert result.bubble == max(result.bubbles) == pytest.approx(4.5)
    assert result.bubble_fraction == pytest.approx(
        sum(result.bubbles) / (4 * result.makespan), abs=1e-12
    )
    assert all(result.makespan - b == pytest.approx(w) for b, w in zip(result.bubbles, result.busy))


def test_other_schedules_known_bubbles():
    c = Costs(1, 1, 1)
    assert run("gpipe", 4, 8, c).bubble == pytest.approx(run("1f1b", 4, 8, c).bubble)
    # interleaving two chunks per rank halves the bubble of the same model (chunks cost half)
    half = c.scaled(0.5)
    assert run("interleaved_1f1b", 4, 8, half).bubble == pytest.approx(9 / 2)
    # ZB-V at equal costs only waits for the first forward to reach each rank
    assert run("zbv", 4, 8, half).bubble == pytest.approx(3 * half.f)
    assert run("zbv", 4, 8, half).bubble_fraction < run("zb1p", 4, 8, c).bubble_fraction


def test_wrong_order_deadlocks():
    stage_rank = build("1f1b", 2, 2).stage_rank
    r0 = (Action("F", 0, 0), Action("BW", 0, 0), Action("F", 0, 1), Action("BW", 0, 1))
    r1 = (Action("F", 1, 0), Action("BW", 1, 0), Action("F", 1, 1), Action("BW", 1, 1))
    assert simulate(Plan("fine", 2, 2, stage_rank, (r0, r1)), Costs()).makespan == 12  # serial
    # rank 1 takes micro-batch 1 first; rank 0 sends it only after micro-batch 0's backward
    swapped = (r1[2], r1[3], r1[0], r1[1])
    with pytest.raises(Deadlock, match="every rank waits"):
        simulate(Plan("bad", 2, 2, stage_rank, (r0, swapped)), Costs())


def test_incomplete_order_rejected():
    good = build("zb1p", 2, 2)
    r0 = tuple(a for a in good.orders[0] if a.kind != "W")
    with pytest.raises(ValueError, match="missing"):
        simulate(Plan("no_w", 2, 2, good.stage_rank, (r0, good.orders[1])), Costs())
    with pytest.raises(ValueError, match="unknown schedule"):
        build("nope", 2, 2)
    with pytest.raises(ValueError, match="at least 4"):
        build("dualpipev", 2, 3)


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [("interleaved_1f1b", "Interleaved1F1B"), ("zbv", "ZBVZeroBubble"), ("dualpipev", "DualPipeV")],
)
def test_orders_match_torch_schedules(ours, theirs):
    """Our generators, written apart, give torch's published orders for its multi-stage schedules
    (the ones the runtime uses). Torch's own single-stage 1F1B list is not a reference: its
    published order differs from what its runtime runs."""
    visualizer = pytest.importorskip("torch.distributed.pipelining._schedule_visualizer")
    kind = {"F": "F", "B": "I", "W": "W", "BW": "B"}
    for pp, m in [(2, 4), (3, 6), (4, 8), (4, 12)]:
        torch_ops = visualizer.get_schedule_ops(theirs, pp, m, num_stages_per_rank=2)
        plan = build(ours, pp, m)
        for rank, order in enumerate(plan.orders):
            mine = [
                f"({a.stage}F{a.mb};{a.b_stage}B{a.b_mb})OVERLAP_F_B"
                if a.kind == "FB"
                else f"{a.stage}{kind[a.kind]}{a.mb}"
                for a in order
            ]
            assert [str(a) for a in torch_ops[rank] if a is not None] == mine, (pp, m, rank)
