"""Reward functions that misbehave do not stop or poison a run: non-finite scores (also those
that overflow float32) and hung calls score 0 and are counted; the metrics file survives being
deleted mid-run."""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import sys
import threading
import time

os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np
import pytest
import torch

from hybridrl.config import Config, load_config
from hybridrl.protocol import Sample
from hybridrl.rollout import scoring
from hybridrl.rollout.scoring import RewardFunctionHung, RewardTimeout, Scorer, TimedCalls
from hybridrl.tasks import Prompt, compute_reward
from hybridrl.tasks.arithmetic import ArithmeticTask
from hybridrl.tasks.base import NonFiniteReward
from hybridrl.telemetry.sinks import METRICS_FILE, MetricsLogger, read_metrics

P = Prompt(uid="p-0", text="12+345=", answer="357", task_id="arith")
RELEASE = threading.Event()  # set at the end of a test: lets its hung reward calls return


@pytest.fixture(autouse=True)
def release_hung_calls():
    RELEASE.clear()
    yield
    RELEASE.set()


# --- reward functions given by dotted path --------------------------------------------------------
def by_answer(prompt, response):
    """The score each prompt's answer names, so one call of each kind is easy to write."""
    kind = prompt.answer
    if kind == "raise":
        raise RuntimeError("reward backend unavailable")
    if kind == "hang":
        RELEASE.wait(60)
        return 1.0
    return {"inf": math.inf, "-inf": -math.inf, "nan": math.nan, "huge": 1e300}.get(kind, 1.0)


def column_lookup(prompt, response):
    """A reward that reads a key the rows lack: it fails on every sample."""
    return float(response == {}["solution"])


def trl_needs_solution(prompts, completions, solution, **kwargs):
    return [float(c == s) for c, s in zip(completions, solution)]


class SolutionTask(ArithmeticTask):
    """W1 with each prompt carrying a ``solution`` column, as a plug-in task's prompts may."""

    name = "solution_task"

    def _make(self, uid: str, a: int, b: int) -> Prompt:
        return Prompt(uid, f"{a}+{b}=", str(a + b), self.name, columns={"solution": str(a + b)})


def exits(prompt, response):
    sys.exit(0)


async def exits_async(prompt, response):
    raise SystemExit(3)


def trl_exits(prompts, completions, **kwargs):
    sys.exit()


def always_hangs(prompt, response):
    RELEASE.wait(60)
    return 1.0


CALLS = itertools.count()


def inf_or_huge_reward(prompt, response, *, finished=True):
    """inf, 1e300 or the exact-match score, by turns (every step sees all three)."""
    i = next(CALLS) % 3
    return math.inf if i == 0 else 1e300 if i == 1 else float(response == prompt.answer)


def scorer_for(fn, *overrides) -> Scorer:
    cfg = load_config(Config, None, [f"task.reward_fn={__name__}:{fn}", *overrides])
    from hybridrl.models.loading import make_task

    return Scorer(cfg, make_task(cfg).tokenizer())


def samples_with_answers(scorer: Scorer, answers: list[str]) -> list[Sample]:
    tok = scorer.tokenizer
    return [
        Sample(
            prompt_ids=tok("1+2=")["input_ids"],
            response_ids=tok("3", add_special_tokens=False)["input_ids"] + [tok.eos_token_id],
            status="finished",
            uid=f"p-{i}",
            metadata={"prompt": Prompt(f"p-{i}", "1+2=", answer, "arith")},
        )
        for i, answer in enumerate(answers)
    ]


def extras(samples, key) -> list[float]:
    return [s.reward_extras.get(key, 0.0) for s in samples]


# --- non-finite scores ----------------------------------------------------------------------------
@pytest.mark.parametrize("score", [math.inf, -math.inf, math.nan, 1e300, -1e300, 3.5e38])
def test_compute_reward_rejects_scores_that_are_not_finite_float32(score):
    with pytest.raises(NonFiniteReward) as info:
        compute_reward(lambda p, r: score, P, "")
    assert isinstance(info.value, ValueError) and "p-0" in str(info.value)
    assert info.value.score == score or math.isnan(score)
    with pytest.raises(NonFiniteReward):
        compute_reward(lambda p, r: {"score": score, "extra": 1.0}, P, "")


def test_compute_reward_keeps_the_largest_float32_scores():
    big = float(np.finfo(np.float32).max)
    assert compute_reward(lambda p, r: big, P, "")[0] == big
    assert compute_reward(lambda p, r: -3.4e38, P, "")[0] == -3.4e38
    assert compute_reward(lambda p, r: 1e-300, P, "")[0] == 1e-300


def test_scorer_counts_nonfinite_scores_apart_from_errors(caplog):
    scorer = scorer_for("by_answer")
    answers = ["3", "inf", "-inf", "nan", "huge", "raise"]
    samples = samples_with_answers(scorer, answers)
    with caplog.at_level(logging.WARNING, logger=scoring.__name__):
        scorer(samples)
    assert [s.reward for s in samples] == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert extras(samples, "reward_errors") == [0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert extras(samples, "reward_nonfinite") == [0.0, 1.0, 1.0, 1.0, 1.0, 0.0]
    assert extras(samples, "reward_timeouts") == [0.0] * 6
    assert all(torch.isfinite(torch.tensor([s.reward for s in samples], dtype=torch.float32)))
    messages = [r.getMessage() for r in caplog.records]
    assert sum("reward_nonfinite" in m for m in messages) == 4
    assert any("1e+300" in m and "p-4" in m for m in messages)
    assert sum("raised" in m and "p-5" in m for m in messages) == 1
    # scored again normally: the earlier failure's count goes
    samples[1].metadata["prompt"] = Prompt("p-1", "1+2=", "3", "arith")
    scorer(samples[1:2])
    assert samples[1].reward == 1.0 and samples[1].reward_extras["reward_nonfinite"] == 0.0


def test_scorer_logs_a_bounded_number_of_failures(caplog):
    scorer = scorer_for("by_answer")
    samples = samples_with_answers(scorer, ["inf"] * 20 + ["raise"] * 20)
    with caplog.at_level(logging.WARNING, logger=scoring.__name__):
        scorer(samples)
    messages = [r.getMessage() for r in caplog.records]
    assert sum("reward_nonfinite" in m for m in messages) == scoring.LOGGED_ERRORS
    assert sum("raised" in m for m in messages) == scoring.LOGGED_ERRORS
    assert sum(extras(samples, "reward_errors")) == 40
    assert sum(extras(samples, "reward_nonfinite")) == 20


# --- timeouts -------------------------------------------------------------------------------------
def test_hung_reward_call_times_out_and_does_not_block_later_calls(caplog):
    scorer = scorer_for("by_answer", "task.reward_timeout_s=0.5")
    samples = samples_with_answers(scorer, ["3", "hang", "3", "3"])
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger=scoring.__name__):
        scorer(samples)
    assert time.monotonic() - start < 5
    assert [s.reward for s in samples] == [1.0, 0.0, 1.0, 1.0]
    assert extras(samples, "reward_timeouts") == [0.0, 1.0, 0.0, 0.0]
    assert extras(samples, "reward_errors") == [0.0, 1.0, 0.0, 0.0]
    assert extras(samples, "reward_nonfinite") == [0.0] * 4
    messages = [r.getMessage() for r in caplog.records]
    assert any("reward_timeouts" in m and "p-1" in m and "0.5 s" in m for m in messages)
    assert scorer.pools["by_answer"].hung == 1  # abandoned, still running
    # the next batch is scored normally while that call still hangs
    again = samples_with_answers(scorer, ["3", "3"])
    scorer(again)
    assert [s.reward for s in again] == [1.0, 1.0]
    RELEASE.set()  # the hung call returns: its thread exits
    deadline = time.monotonic() + 5
    while scorer.pools["by_answer"].hung and time.monotonic() < deadline:
        time.sleep(0.01)
    assert scorer.pools["by_answer"].hung == 0


def test_too_many_hung_calls_stop_the_run_naming_the_reward_function():
    scorer = scorer_for("always_hangs", "task.reward_timeout_s=0.05")
    samples = samples_with_answers(scorer, ["3"] * (scoring.MAX_HUNG_CALLS + 5))
    start = time.monotonic()
    with pytest.raises(RewardFunctionHung, match="always_hangs") as info:
        scorer(samples)
    assert time.monotonic() - start < 5
    assert f"{scoring.MAX_HUNG_CALLS} calls" in str(info.value)
    assert scorer.pools["always_hangs"].hung == scoring.MAX_HUNG_CALLS


def test_timed_calls_reuse_one_thread_and_pass_results_and_errors():
    def helpers():
        return [t for t in threading.enumerate() if t.name.startswith("reuse-test")]

    calls = TimedCalls(5.0, "reuse-test")
    assert [calls(pow, 2, i) for i in range(10)] == [2**i for i in range(10)]
    with pytest.raises(KeyError, match="missing"):
        calls({}.__getitem__, "missing")
    assert calls(lambda *, x: x + 1, x=1) == 2
    assert len(helpers()) == 1 and helpers()[0].daemon  # one helper, reused
    calls.close()
    deadline = time.monotonic() + 5
    while helpers() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not helpers()


def test_timed_calls_replace_a_timed_out_helper():
    calls = TimedCalls(0.05, "test")
    with pytest.raises(RewardTimeout):
        calls(RELEASE.wait, 60)
    assert calls(lambda: "fresh helper") == "fresh helper"
    assert calls.hung == 1
    RELEASE.set()
    deadline = time.monotonic() + 5
    while calls.hung and time.monotonic() < deadline:
        time.sleep(0.01)
    assert calls.hung == 0


def test_reward_timeout_config():
    assert Config().task.reward_timeout_s == 30.0
    with pytest.raises(Exception, match="reward_timeout_s"):
        load_config(Config, None, ["task.reward_timeout_s=0"])


# --- a real run -----------------------------------------------------------------------------------
def test_run_with_inf_and_overflowing_rewards_keeps_finite_weights(tmp_path, caplog):
    from test_train_e2e import make_cfg
    from transformers import AutoModelForCausalLM

    from hybridrl.driver.loop import train

    with caplog.at_level(logging.WARNING, logger=scoring.__name__):
        summary = train(
            make_cfg(
                tmp_path,
                f"task.reward_fn={__name__}:inf_or_huge_reward",
                "trainer.name=nonfinite",
            )
        )
    run_dir = tmp_path / "runs" / "nonfinite"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 2 and [r["step"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:
        assert row["reward/errors"] > 0 and row["reward/nonfinite"] == row["reward/errors"]
        for key in ("reward/mean", "actor/grad_norm", "actor/kl_ref", "advantage/abs_mean"):
            assert row[key] is not None and math.isfinite(row[key]), (key, row)
    messages = [r.getMessage() for r in caplog.records]
    assert any(
        "inf_or_huge_reward" in m and "reward_nonfinite" in m and "1e+300" in m for m in messages
    )
    assert any("reward_nonfinite" in m and "inf" in m and "1e+300" not in m for m in messages)
    model = AutoModelForCausalLM.from_pretrained(run_dir / "checkpoints" / "step_000002" / "model")
    assert all(torch.isfinite(p).all() for p in model.parameters())
    # summary.json: the run's totals of failed reward calls
    for key in ("reward_errors", "reward_nonfinite", "reward_timeouts"):
        assert summary[key] == sum(r[key.replace("_", "/", 1)] for r in rows[1:]), key
    assert summary["reward_nonfinite"] > 0 and summary["reward_timeouts"] == 0


def test_run_whose_every_reward_fails_stops_naming_the_function(tmp_path):
    """Every reward errors: the run stops after task.max_failed_reward_steps steps in a row with one
    line naming the function and its first error; the steps done so far stay logged."""
    from test_train_e2e import make_cfg

    from hybridrl.driver.loop import train
    from hybridrl.rollout.scoring import RewardsFailedError

    cfg = make_cfg(
        tmp_path,
        f"task.reward_fn={__name__}:column_lookup",
        "trainer.name=failing",
        "trainer.total_steps=5",
        "trainer.eval_every=0",
        "trainer.save_every=0",
        "task.max_failed_reward_steps=2",
    )
    with pytest.raises(RewardsFailedError) as err:
        train(cfg)
    message = str(err.value)
    assert "\n" not in message
    assert (
        "steps 1-2" in message and "column_lookup" in message and "KeyError('solution')" in message
    )
    rows = read_metrics(tmp_path / "runs" / "failing")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["reward/errors"] == 8 for r in rows[1:])  # 4 prompts x 2 samples, all failed


@pytest.mark.parametrize("fn", ["exits", "exits_async", "trl_exits"])
def test_reward_function_calling_sys_exit_fails_its_samples_not_the_run(fn, caplog):
    """sys.exit() inside a reward function (per-sample, async or batched) is an error of its call:
    the samples score 0 and are counted, the process goes on."""
    scorer = scorer_for(fn)
    with caplog.at_level(logging.WARNING, logger=scoring.__name__):
        samples = scorer(samples_with_answers(scorer, ["3", "3"]))
    assert [s.reward for s in samples] == [0.0, 0.0]
    assert extras(samples, "reward_errors") == [1.0, 1.0]
    assert "SystemExit" in samples[0].metadata["reward_error"]
    assert any(
        fn in r.getMessage() and "cannot end the run" in r.getMessage() for r in caplog.records
    )


def test_trl_style_function_naming_a_missing_column_is_refused_at_start(tmp_path):
    from hybridrl.checks import check_config
    from hybridrl.config import ConfigError

    fn = f"task.reward_fn={__name__}:trl_needs_solution"
    with pytest.raises(ConfigError) as err:  # a built-in task's prompts carry no columns
        check_config(load_config(Config, None, [fn]))
    assert str(err.value).startswith("config key 'task.reward_fn[0]': TRL-style reward function")
    assert "['solution']" in str(err.value)
    # a plug-in task's prompts carry the column: accepted
    check_config(load_config(Config, None, [fn, f"task.name={__name__}:SolutionTask"]))
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n"
                            for i in range(4)))  # fmt: skip
    with pytest.raises(ConfigError, match=r"columns: \['answer'\]"):
        check_config(load_config(Config, None, [fn, f"data.train_files={data}"]))
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "solution": str(i + 1)}) + "\n"
                            for i in range(4)))  # fmt: skip
    check_config(
        load_config(Config, None, [fn, f"data.train_files={data}", "data.answer_key=null"])
    )


# --- the metrics file -----------------------------------------------------------------------------
def test_metrics_file_deleted_mid_run_gets_the_later_steps(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path) as logger:
        logger.log(0, {"reward/mean": 0.0})
        (tmp_path / METRICS_FILE).unlink()
        logger.log(1, {"reward/mean": 0.5})
        logger.log(2, {"reward/mean": 1.0})
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    assert read_metrics(tmp_path)[1] == {"step": 2, "reward/mean": 1.0}
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("reward/mean")] == [0, 1, 2]
