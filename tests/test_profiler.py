"""The profiler: torch traces of ``trainer.profile_steps``, the per-step timeline of every worker's
phases (``timeline.jsonl``), and ``hybridrl profile RUN_DIR`` (summary and ``timeline.png``)."""

from __future__ import annotations

import gzip
import json
import shutil
import threading
import time

import pytest
import torch
from test_train_e2e import TINY_RUN

from hybridrl.cli import main as cli_main
from hybridrl.config import Config, load_config
from hybridrl.telemetry import PhaseTimer
from hybridrl.telemetry.profile_report import summarize
from hybridrl.telemetry.timeline import (
    SpanLog,
    idle_fractions,
    overlap_fraction,
    read_timeline,
    step_windows,
    worker_key,
)


def tiny_cfg(tmp, name: str, *extra: str) -> Config:
    return load_config(
        Config,
        None,
        [
            *TINY_RUN,
            "trainer.eval_every=0",
            "trainer.save_every=0",
            f"sft.checkpoint={tmp / 'ws'}",
            f"trainer.runs_dir={tmp / 'runs'}",
            f"trainer.name={name}",
            *extra,
        ],
    )


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    """A 2-step tiny local run whose second step is traced."""
    from hybridrl.driver.loop import train

    tmp = tmp_path_factory.mktemp("profiler")
    cfg = tiny_cfg(tmp, "local", "trainer.profile_steps=[2]")
    train(cfg)
    return tmp / "runs" / "local"


def check_timeline(rows: list[dict], steps: list[int], phases: set[str]) -> None:
    """Every step has its window and every phase; each span lies in its step's window; the spans
    of one worker process do not overlap, except scoring: the rollout's groups are scored on a
    thread of their own while the engine steps on, so a ``rollout/score`` span may overlap the
    ``rollout/generate`` spans (one per engine step)."""
    windows = step_windows(rows)
    assert sorted(windows) == steps
    for step in steps:
        mine = [r for r in rows if r["step"] == step and r["role"] != "driver"]
        assert phases <= {r["phase"] for r in mine}, (step, {r["phase"] for r in mine})
        assert {"learner", "rollout"} <= {r["role"] for r in mine}
        lo, hi = windows[step]
        for r in mine:
            assert lo <= r["t0"] <= r["t1"] <= hi, r
        for key in {worker_key(r) for r in mine}:
            own = [r for r in mine if worker_key(r) == key]
            spans = sorted((r["t0"], r["t1"]) for r in own if r["phase"] != "rollout/score")
            assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), (key, spans)


def test_local_run_traces_and_timeline(local_run):
    traces = sorted(p.name for p in (local_run / "profile").iterdir())
    # the local backend: every worker lives in the driver's process, one trace holds them all
    assert traces == ["driver-rank0-step2.json.gz"]
    trace = json.loads(gzip.decompress((local_run / "profile" / traces[0]).read_bytes()))
    names = {e.get("name") for e in trace["traceEvents"]}
    assert len(trace["traceEvents"]) > 100
    assert {"rollout/generate", "learner/update", "weight_sync/load"} <= names
    rows = read_timeline(local_run)
    phases = {
        "rollout/generate",
        "rollout/score",
        "learner/reference",
        "learner/old_log_prob",  # two mini-batches: the separate pass runs
        "learner/update",
        "weight_sync/publish",
        "weight_sync/load",
    }
    check_timeline(rows, [1, 2], phases)
    assert {r["worker"] for r in rows} == {"driver", "learner", "rollout"}


def test_profile_command(local_run, capsys):
    assert cli_main(["profile", str(local_run)]) == 0
    out = capsys.readouterr().out
    assert "update" in out and "idle" in out and "learner rank0" in out
    assert (local_run / "timeline.png").stat().st_size > 10_000
    metrics = [json.loads(line) for line in (local_run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in metrics if r["step"] >= 1]
    s = summarize(local_run)
    assert s["steps"] == [1, 2] and s["timeline"]
    assert s["step_s"] == pytest.approx(sum(r["timing/step"] for r in steps))
    assert s["phases"]["update"]["total_s"] == pytest.approx(sum(r["timing/update"] for r in steps))
    mfu = [r["perf/mfu_update"] for r in steps]
    assert s["phases"]["update"]["mfu"] == pytest.approx(sum(mfu) / len(mfu))
    assert all(0 <= w["idle_frac"] < 1 for w in s["workers"].values())
    assert s["overlap_gen_train"] == 0.0  # synchronous: generation and training take turns


def test_profile_without_a_timeline(local_run, tmp_path, capsys):
    old = tmp_path / "old_run"
    old.mkdir()
    shutil.copy(local_run / "metrics.jsonl", old / "metrics.jsonl")
    assert cli_main(["profile", str(old)]) == 0
    out = capsys.readouterr().out
    assert "timeline.jsonl is missing" in out and "update" in out
    assert not (old / "timeline.png").exists()


def test_profile_refuses_what_is_not_a_run(tmp_path, capsys):
    assert cli_main(["profile", str(tmp_path)]) == 2
    assert "neither metrics.jsonl nor timeline.jsonl" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text("")
    assert cli_main(["profile", str(tmp_path), "--steps", "3:1"]) == 2
    assert "--steps must be A:B" in capsys.readouterr().err


def test_summary_matches_constructed_metrics(tmp_path):
    metrics = [
        {"step": 0, "eval/accuracy": 0.5},
        {"step": 1, "timing/step": 2.0, "timing/rollout": 0.5, "timing/update": 1.0,
         "perf/mfu_update": 0.2, "perf/tokens_per_s_update": 100.0, "perf/mfu_rollout": 0.1},
        {"step": 2, "timing/step": 4.0, "timing/rollout": 1.5, "timing/update": 2.0,
         "perf/mfu_update": 0.4, "perf/tokens_per_s_update": 300.0, "perf/mfu_rollout": 0.3},
    ]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))

    def row(step, worker, phase, t0, t1):
        role = worker if worker != "x" else "learner"
        return dict(step=step, role=role, worker=worker, rank=0, pid=1, phase=phase, t0=t0, t1=t1)

    timeline = [
        row(1, "driver", "step", 0.0, 2.0),
        row(1, "rollout", "rollout/generate", 0.0, 1.0),
        row(1, "learner", "learner/update", 0.5, 1.5),  # 0.5 s at once with generation
        row(2, "driver", "step", 2.0, 4.0),
        row(2, "rollout", "rollout/generate", 2.0, 3.0),
        row(2, "learner", "learner/wait_batch", 2.0, 3.0),  # waiting: idle
        row(2, "learner", "learner/update", 3.0, 5.0),  # clipped to the step: 1 s
    ]
    (tmp_path / "timeline.jsonl").write_text("".join(json.dumps(r) + "\n" for r in timeline))
    s = summarize(tmp_path)
    assert s["steps"] == [1, 2] and s["step_s"] == 6.0 and s["mean_step_s"] == 3.0
    up, ro = s["phases"]["update"], s["phases"]["rollout"]
    assert up["total_s"] == 3.0 and up["mean_s"] == 1.5 and up["share"] == pytest.approx(0.5)
    assert up["mfu"] == pytest.approx(0.3) and up["tokens_per_s"] == pytest.approx(200.0)
    assert ro["total_s"] == 2.0 and ro["share"] == pytest.approx(1 / 3)
    assert ro["mfu"] == pytest.approx(0.2) and ro["tokens_per_s"] is None
    workers = s["workers"]
    assert workers["learner rank0 (pid 1)"]["idle_frac"] == pytest.approx(0.5)  # 2 of 4 s busy
    assert workers["rollout rank0 (pid 1)"]["idle_frac"] == pytest.approx(0.5)
    assert s["overlap_gen_train"] == pytest.approx(0.5 / 4)
    only = summarize(tmp_path, (2, 2))
    assert only["steps"] == [2] and only["phases"]["update"]["total_s"] == 2.0
    assert only["workers"]["learner rank0 (pid 1)"]["idle_frac"] == pytest.approx(0.5)
    assert idle_fractions(timeline)[("learner", 0, 1)] == pytest.approx(0.5)
    assert overlap_fraction(timeline) == pytest.approx(0.125)


def test_span_log_merges_back_to_back_spans_and_takes_across_threads():
    log = SpanLog("rollout")
    log.add("rollout/generate", 0.0, 1.0)
    log.add("rollout/generate", 1.001, 2.0)  # back to back: one span
    log.add("rollout/score", 2.0, 2.1)
    log.add("rollout/generate", 2.1005, 3.0)  # another phase in between: a new span
    assert log.take() == [
        ("rollout", "rollout/generate", 0.0, 2.0),
        ("rollout", "rollout/score", 2.0, 2.1),
        ("rollout", "rollout/generate", 2.1005, 3.0),
    ]
    assert log.take() == []
    stop, taken = threading.Event(), []

    def record():
        t = 0.0
        while not stop.is_set():
            log.add("rollout/generate", t, t + 1)
            t += 1.5
        log.add("rollout/score", t, t + 1)

    thread = threading.Thread(target=record)
    thread.start()
    for _ in range(50):
        taken += log.take()
    stop.set()
    thread.join()
    taken += log.take()
    assert taken[-1][1] == "rollout/score"
    assert all(a[3] < b[2] for a, b in zip(taken, taken[1:]))  # none lost, none twice


def test_phase_timer_records_spans():
    log = SpanLog("learner")
    timer = PhaseTimer(spans=log, prefix="learner/")
    with timer.phase("update"):
        pass
    with pytest.raises(ValueError), timer.phase("reference"):
        raise ValueError("a phase that fails is still a span")
    assert [(role, phase) for role, phase, *_ in log.take()] == [
        ("learner", "learner/update"),
        ("learner", "learner/reference"),
    ]
    assert set(timer.pop()) == {"timing/update", "timing/reference", "timing/step"}


def test_profile_steps_are_checked():
    with pytest.raises(Exception, match="profile_steps holds 0: steps count from 1"):
        load_config(Config, None, ["trainer.profile_steps=[0]"])


@pytest.mark.slow  # a Ray run (~15-30 s); the local run covers the traces and the timeline
def test_ray_colocated_run_writes_a_trace_per_worker_process(tmp_path, local_run):
    """Ray, learner and rollout colocated in one process: the process's trace, written by the
    driver from the bytes the worker returned, and its spans of both roles in one row."""
    import ray

    from hybridrl.driver.loop import train

    shutil.copytree(local_run.parent.parent / "ws", tmp_path / "ws")  # the same warm start
    cfg = tiny_cfg(tmp_path, "ray", "controller.backend=ray", "trainer.profile_steps=[1]")
    try:
        train(cfg)
    finally:
        ray.shutdown()
    run = tmp_path / "runs" / "ray"
    traces = sorted(p.name for p in (run / "profile").iterdir())
    assert traces == ["learner+rollout-rank0-step1.json.gz"]
    trace = json.loads(gzip.decompress((run / "profile" / traces[0]).read_bytes()))
    assert {"rollout/generate", "learner/update"} <= {e.get("name") for e in trace["traceEvents"]}
    rows = read_timeline(run)
    phases = {"rollout/generate", "learner/update", "weight_sync/publish", "weight_sync/load"}
    check_timeline(rows, [1, 2], phases)
    workers = {(r["worker"], r["pid"]) for r in rows if r["role"] != "driver"}
    assert len(workers) == 1 and next(iter(workers))[0] == "learner+rollout"


def test_resume_drops_the_rows_it_computes_again(tmp_path):
    from hybridrl.telemetry.timeline import append_rows, truncate_after

    rows = [dict(step=s, role="driver", phase="step", t0=s, t1=s + 1.0) for s in (1, 2, 3)]
    append_rows(tmp_path, rows)
    with open(tmp_path / "timeline.jsonl", "a") as f:
        f.write('{"step": 4, "ro')  # a line torn by a crash
    assert [r["step"] for r in read_timeline(tmp_path)] == [1, 2, 3]
    truncate_after(tmp_path, 2)
    assert read_timeline(tmp_path) == rows[:2]


def test_a_trace_holds_the_spans_of_every_thread():
    """The asynchronous rollout generates on a thread of its own, started before the trace."""
    from hybridrl.telemetry.profiler import start_trace, stop_trace

    class Process:
        pass

    log, stop, process = SpanLog("rollout"), threading.Event(), Process()

    def generate():
        while not stop.is_set():
            with log.span("rollout/generate"):
                torch.mm(torch.ones(32, 32), torch.ones(32, 32))
            time.sleep(0.001)

    thread = threading.Thread(target=generate)
    thread.start()
    try:
        time.sleep(0.02)
        start_trace(process)
        with pytest.raises(RuntimeError, match="already running"):
            start_trace(process)
        with log.span("learner/update"):
            torch.mm(torch.ones(8, 8), torch.ones(8, 8))
        time.sleep(0.05)
        data = stop_trace(process)
    finally:
        stop.set()
        thread.join()
    names = [e.get("name") for e in json.loads(gzip.decompress(data))["traceEvents"]]
    assert "learner/update" in names and "rollout/generate" in names
    assert stop_trace(process) == b""  # none running
