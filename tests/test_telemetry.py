"""Tests for hybridrl.telemetry: PhaseTimer, MetricsLogger, read_metrics, write_report."""

from __future__ import annotations

import json
import math

import pytest

from hybridrl.telemetry import MetricsLogger, PhaseTimer, read_metrics, write_report


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


# --- PhaseTimer ---------------------------------------------------------------
def test_timer_sums_repeated_phases_and_step_time():
    clock = FakeClock()
    timer = PhaseTimer(clock=clock)
    for _ in range(3):
        with timer.phase("rollout"):
            clock.advance(1.5)
        clock.advance(0.5)  # untimed
    out = timer.pop()
    assert out["timing/rollout"] == pytest.approx(4.5)
    assert out["timing/step"] == pytest.approx(6.0)
    assert set(out) == {"timing/rollout", "timing/step"}


def test_timer_nested_phases():
    clock = FakeClock()
    timer = PhaseTimer(clock=clock)
    with timer.phase("update"):
        clock.advance(1.0)
        with timer.phase("forward"):
            clock.advance(2.0)
        clock.advance(1.0)
    out = timer.pop()
    assert out["timing/update"] == pytest.approx(4.0)
    assert out["timing/forward"] == pytest.approx(2.0)
    assert out["timing/step"] == pytest.approx(4.0)


def test_timer_pop_resets_and_measures_since_previous_pop():
    clock = FakeClock()
    timer = PhaseTimer(clock=clock)
    with timer.phase("a"):
        clock.advance(1.0)
    timer.pop()
    clock.advance(3.0)
    out = timer.pop()
    assert out == {"timing/step": pytest.approx(3.0)}


def test_timer_splits_open_phase_and_rejects_reentry():
    clock = FakeClock()
    timer = PhaseTimer(clock=clock)
    with timer.phase("a"):
        clock.advance(1.0)
        assert timer.pop()["timing/a"] == pytest.approx(1.0)
        clock.advance(2.0)
        with pytest.raises(RuntimeError), timer.phase("a"):
            pass
    assert timer.pop()["timing/a"] == pytest.approx(2.0)


def test_timer_real_clock():
    import time

    timer = PhaseTimer()
    with timer.phase("sleep"):
        time.sleep(0.02)
    out = timer.pop()
    assert 0.015 < out["timing/sleep"] <= out["timing/step"]


# --- MetricsLogger --------------------------------------------------------------
def test_logger_writes_jsonl(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(0, {"reward/mean": 0.25, "n": 3})
        logger.log(1, {"reward/mean": 0.5})
        # flushed on every call: readable while the logger is open
        assert len(read_metrics(tmp_path)) == 2
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"step": 0, "reward/mean": 0.25, "n": 3},
        {"step": 1, "reward/mean": 0.5},
    ]
    assert not (tmp_path / "tb").exists()


def test_logger_nonfinite_written_as_null(tmp_path):
    import numpy as np
    import torch

    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(
            0, {"a": float("nan"), "b": float("inf"), "c": np.float32(1.5), "d": torch.tensor(2)}
        )
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text) == {"step": 0, "a": None, "b": None, "c": 1.5, "d": 2}


def test_logger_tensorboard_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path) as logger:
        for step in range(3):
            logger.log(step, {"reward/mean": step / 2, "timing/step": 1.0})
    event_files = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert event_files
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert "reward/mean" in acc.Tags()["scalars"]
    events = acc.Scalars("reward/mean")
    assert [e.step for e in events] == [0, 1, 2]
    assert [e.value for e in events] == pytest.approx([0.0, 0.5, 1.0])


def test_logger_resume_truncates_later_steps(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        for step in range(6):
            logger.log(step, {"x": step})
    with MetricsLogger(tmp_path, tensorboard=False, resume_step=3) as logger:
        logger.log(4, {"x": 40})
    assert [(r["step"], r["x"]) for r in read_metrics(tmp_path)] == [
        (0, 0),
        (1, 1),
        (2, 2),
        (3, 3),
        (4, 40),
    ]


def test_logger_resume_tensorboard_purges(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path) as logger:
        for step in range(6):
            logger.log(step, {"x": step})
    with MetricsLogger(tmp_path, resume_step=3) as logger:
        logger.log(4, {"x": 40})
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("x")] == [
        (0, 0),
        (1, 1),
        (2, 2),
        (3, 3),
        (4, 40),
    ]


def test_logger_appends_without_resume_and_survives_partial_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 0, "x": 1}\n{"step": 1, "x"'
    )  # crashed mid-write
    with pytest.warns(UserWarning):
        with MetricsLogger(tmp_path, tensorboard=False) as logger:
            logger.log(1, {"x": 2})
        records = read_metrics(tmp_path)
    assert records == [{"step": 0, "x": 1}, {"step": 1, "x": 2}]


def test_logger_rejects_step_key_and_closed_use(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=False)
    with pytest.raises(ValueError):
        logger.log(0, {"step": 1})
    logger.close()
    logger.close()  # idempotent
    with pytest.raises(RuntimeError):
        logger.log(0, {"x": 1})


def test_read_metrics_missing_file(tmp_path):
    assert read_metrics(tmp_path) == []


# --- report ---------------------------------------------------------------------
def _fake_run(tmp_path, steps=40, with_eval=True, with_timing=True):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        for step in range(steps):
            m = {"reward/mean": 0.2 + 0.6 * step / steps + 0.05 * math.sin(step)}
            if with_timing:
                m |= {
                    "timing/rollout": 2.0 + 0.1 * (step % 3),
                    "timing/update": 1.0,
                    "timing/ref": 0.3,
                    "timing/step": 3.6,
                }
            if with_eval and step % 10 == 0:
                m |= {"eval/accuracy": 0.3 + step / 100, "eval/greedy_accuracy": 0.35 + step / 100}
            logger.log(step, m)


def _assert_png(path):
    assert path.exists() and path.stat().st_size > 1000
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_full_metrics(tmp_path):
    _fake_run(tmp_path)
    path = write_report(tmp_path, title="toy run")
    assert path == tmp_path / "report.png"
    _assert_png(path)


def test_report_long_run_uses_area_chart(tmp_path):
    _fake_run(tmp_path, steps=200)
    _assert_png(write_report(tmp_path))


@pytest.mark.parametrize("with_eval,with_timing", [(False, True), (True, False), (False, False)])
def test_report_partial_metrics(tmp_path, with_eval, with_timing):
    _fake_run(tmp_path, steps=5, with_eval=with_eval, with_timing=with_timing)
    _assert_png(write_report(tmp_path))


def test_report_empty_run(tmp_path):
    _assert_png(write_report(tmp_path))


def test_a_console_line_every_log_every_steps(tmp_path):
    """trainer.log_every: a run whose output is a log file gets one line of headline metrics every
    N steps (the progress bar is for terminals)."""
    import io

    out = io.StringIO()
    with MetricsLogger(
        tmp_path, tensorboard=False, console_every=2, total_steps=4, console=out
    ) as logger:
        for step in range(1, 5):
            logger.log(step, {"reward/mean": step / 10, "timing/step": 0.5, "other/x": 1.0})
    assert out.getvalue().splitlines() == [
        "step 2/4 reward=0.2 step_s=0.5",
        "step 4/4 reward=0.4 step_s=0.5",
    ]
    quiet = io.StringIO()
    with MetricsLogger(tmp_path / "q", tensorboard=False, console=quiet) as logger:
        logger.log(10, {"reward/mean": 1.0})
    assert quiet.getvalue() == ""  # console_every 0: never


@pytest.mark.parametrize("rewards, metric", [([1.0, 0.0], 1.0), ([0.5, 1.0], 0.0)])
def test_the_evaluation_says_whether_its_mean_reward_is_an_accuracy(rewards, metric):
    """eval/reward_binary: 1 where every held-out reward is 0 or 1 (the mean is an accuracy), else 0
    (report.png then titles the panel "mean reward" and summary.json's eval_metric says so)."""
    from types import SimpleNamespace

    from hybridrl.driver.evaluate import Evaluator
    from hybridrl.rollout import SamplingParams
    from hybridrl.tasks import Prompt

    class Scored:  # the rollout group's generate: scored samples
        def generate(self, prompts, params):
            return [SimpleNamespace(reward=r, response_ids=[3]) for r in rewards]

    class Tok:
        def __call__(self, text):
            return {"input_ids": [1, 2]}

        def decode(self, ids):
            return "2"

    tok = Tok()

    prompts = [Prompt(text="1+1=", answer="2", uid=f"p{i}", task_id="t") for i in range(2)]
    ev = Evaluator(Scored(), prompts, tok, SamplingParams(), 0)
    out = ev()
    assert out["eval/reward_binary"] == metric
    assert out["eval/accuracy"] == pytest.approx(sum(rewards) / 2)
