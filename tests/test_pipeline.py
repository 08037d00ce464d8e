"""Pipeline parallelism is exact: every schedule gives the single process's loss, gradients,
log-probs and (after two clipped SGD steps over two mini-batches) weights, within 1e-5, for the
RL loss under every loss aggregation mode; at pp = 2, at pp = 4 with two stages per rank, and with
FSDP2 over two data-parallel replicas of a pipeline of two ranks (a 2-D mesh; the zero-bubble
schedules refuse data parallelism).

The ranks are processes running ``tests/pipeline_ranks.py`` (gloo, one thread each); one launch per
world size checks all of its cases in one process group. The default run keeps pp = 2 with 1F1B
(every mode) and DualPipeV (two modes; its tie is on one rank, 1F1B's across two); the rest is
marked slow.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pipeline_ranks import single_process
from rank_processes import launch_ranks, wait_ranks

from hybridrl.config.schema import LOSS_AGG_MODES
from hybridrl.parallel.pipeline import PipeLayout, check_layout
from hybridrl.parallel.pipeline_stages import layer_ranges

SCRIPT = str(Path(__file__).with_name("pipeline_ranks.py"))
TOL = 1e-5
DUALPIPEV_DEFAULT = ["token-mean", "seq-mean-token-mean"]


def run_cases(tmp_path, cases: list[tuple], world: int) -> tuple[dict, dict]:
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    wait_ranks(launch_ranks(SCRIPT, world, tmp_path), timeout=900)
    outs = [torch.load(tmp_path / f"out-{r}.pt", weights_only=False) for r in range(world)]
    return outs, {agg: single_process(agg) for agg in {c[3] for c in cases}}


def merged(outs: list[dict], case: tuple, key: str) -> dict:
    """A per-name result over the ranks (each name from the rank that holds it)."""
    out = {}
    for o in outs:
        out |= o["results"][case][key]
    return out


def check_case(outs: list[dict], ref: dict, case: tuple) -> None:
    agg = case[3]
    grads = merged(outs, case, "grads")
    tied = grads.pop("lm_head.weight")
    want = ref[agg]["grads"]
    assert grads.keys() == want.keys(), case
    for name, g in grads.items():
        assert (g - want[name]).abs().max().item() <= TOL, (case, name)
    # the head copy's gradient is the tied weight's whole gradient
    assert (tied - want["model.embed_tokens.weight"]).abs().max().item() <= TOL, case
    losses = [o["results"][case]["loss"] for o in outs]
    # the last stages' micro-batch losses add up to the mini-batch loss (summed over replicas)
    assert abs(sum(losses) - ref[agg]["loss"]) <= TOL, (case, losses, ref[agg]["loss"])
    for o in outs:
        assert (o["results"][case]["logp"] - ref[agg]["logp"]).abs().max().item() <= TOL, case
    weights = merged(outs, case, "weights")
    tied_w = weights.pop("lm_head.weight")
    for name, w in ref[agg]["weights"].items():
        assert (weights[name] - w).abs().max().item() <= TOL, (case, name)
    assert torch.equal(tied_w, weights["model.embed_tokens.weight"]), case
    idle = outs[0]["results"][case]["idle"]["perf/pipeline_idle_fraction"]
    assert 0.0 <= idle < 1.0


@pytest.mark.distributed
def test_pp2_default(tmp_path):
    """pp = 2: 1F1B (tie across two ranks) under every loss aggregation mode, DualPipeV (V-shaped,
    tie on rank 0, split backward) under two; the other modes are in the slow set."""
    cases = [("1f1b", 2, 1, agg) for agg in LOSS_AGG_MODES]
    cases += [("dualpipev", 2, 1, agg) for agg in DUALPIPEV_DEFAULT]
    outs, ref = run_cases(tmp_path, cases, 2)
    for case in cases:
        check_case(outs, ref, tuple(case))


@pytest.mark.slow
def test_pp2_other_schedules(tmp_path):
    cases = [(s, 2, 1, agg) for s in ("gpipe", "interleaved_1f1b", "zbv") for agg in LOSS_AGG_MODES]
    cases += [("dualpipev", 2, 1, a) for a in LOSS_AGG_MODES if a not in DUALPIPEV_DEFAULT]
    outs, ref = run_cases(tmp_path, cases, 2)
    for case in cases:
        check_case(outs, ref, tuple(case))


@pytest.mark.slow
def test_world4_pp4_and_fsdp(tmp_path):
    """pp = 4 with two stages per rank (8 stages of one layer each), and FSDP2 x pipeline: two
    data-parallel replicas of a pipeline of two ranks on a 2-D mesh (1F1B, interleaved 1F1B with
    two stages per rank, GPipe)."""
    cases = [(s, 4, 1, agg) for s in ("interleaved_1f1b", "zbv", "dualpipev") for agg in
             LOSS_AGG_MODES]  # fmt: skip
    cases += [(s, 2, 2, agg) for s in ("1f1b", "interleaved_1f1b") for agg in LOSS_AGG_MODES]
    cases += [("gpipe", 2, 2, "token-mean")]
    outs, ref = run_cases(tmp_path, cases, 4)
    for case in cases:
        check_case(outs, ref, tuple(case))


def test_layout_and_errors():
    assert [list(r) for r in layer_ranges(5, 2)] == [[0, 1, 2], [3, 4]]
    v = PipeLayout(pp=2, dp=1, rank=0, schedule="dualpipev")
    assert v.stages_of(0) == [0, 3] and v.stages_of(1) == [1, 2] and v.n_microbatches == 8
    loop = PipeLayout(pp=2, dp=2, rank=3, schedule="interleaved_1f1b")
    assert (loop.dp_rank, loop.pp_rank, loop.stages_of(1)) == (1, 1, [1, 3])
    with pytest.raises(ValueError, match="does not divide"):
        check_layout(3, 2, "1f1b", 0, 8)
    with pytest.raises(ValueError, match="fewer than the 8 pipeline stages"):
        check_layout(4, 4, "zbv", 0, 4)
    with pytest.raises(ValueError, match="does not compose with FSDP2"):
        check_layout(4, 2, "zbv", 0, 8)
    with pytest.raises(ValueError, match="at least as many micro-batches"):
        check_layout(2, 2, "dualpipev", 3, 8)


def test_build_roles_refuses_a_pipeline_that_cannot_run():
    """Before any worker starts: the learner pool's world size must be a multiple of pp_size, and
    the built-in tiny model (4 layers) cannot fill 8 stages."""
    from hybridrl.config import Config, load_config
    from hybridrl.driver.placement import build_roles

    base = ["controller.backend=ray", "controller.placement={learner: train, rollout: gen}"]
    for extra, match in (
        (["controller.pools={train: {workers_per_node: 3}, gen: {}}"], "does not divide"),
        (
            ["controller.pools={train: {workers_per_node: 4}, gen: {}}", "actor.pp_size=4",
             "actor.pp_schedule=zbv"],
            "fewer than the 8 pipeline stages",
        ),
    ):  # fmt: skip
        cfg = load_config(Config, None, [*base, "actor.pp_size=2", *extra])
        with pytest.raises(ValueError, match=match):
            build_roles(cfg, None, None)
