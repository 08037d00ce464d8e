"""The supervised warm start stops on a held-out accuracy target (sft.target_accuracy), at the
cap sft.max_steps with a warning, or after a fixed sft.steps; sft.json records which; the
cache key covers it."""

import json
import logging

import pytest

from hybridrl.config import Config, load_config
from hybridrl.driver.sft import (
    HeldoutCheck,
    _train_step,
    ensure_warm_start,
    lr_factor,
    run_sft,
    sft_batch,
    warm_start_path,
)
from hybridrl.envs.base import Env, StepResult
from hybridrl.models.loading import load_model, make_task
from hybridrl.tasks import TASKS, Prompt
from hybridrl.tasks.arithmetic import ArithmeticTask


@TASKS.register("test_sft_seven")
class SevenTask(ArithmeticTask):
    """W1's prompts with the answer always "7": the tiny model learns it in a few dozen steps."""

    name = "test_sft_seven"

    def _make(self, uid: str, a: int, b: int) -> Prompt:
        return Prompt(uid=uid, text=f"{a}+{b}=", answer="7", task_id=self.name)


def cfg_for(tmp_path, *overrides: str) -> Config:
    return load_config(
        Config,
        None,
        [
            "sft.batch_size=16",
            "sft.lr=3e-3",
            "sft.eval_size=32",
            "task.heldout_size=64",
            "controller.num_threads=1",
            f"sft.checkpoint={tmp_path / 'ws'}",
            *overrides,
        ],
    )


def test_stops_at_the_target(tmp_path):
    cfg = cfg_for(
        tmp_path,
        "task.name=test_sft_seven",
        "sft.target_accuracy=0.5",
        "sft.max_steps=200",
        "sft.eval_every=5",
    )
    rec = json.loads((run_sft(cfg, tmp_path / "ws", progress=False) / "sft.json").read_text())
    assert rec["target_met"] is True and rec["accuracy"] >= 0.5, rec
    assert rec["steps"] < 200 and rec["steps"] % 5 == 0, (
        rec
    )  # stopped at the first check that reached it
    # at least one check fell short first, so "stopped at the first check that
    # reached it" is tested, not vacuous
    assert len(rec["checks"]) >= 2 and rec["checks"][-1]["step"] == rec["steps"], rec
    assert all(c["accuracy"] < 0.5 for c in rec["checks"][:-1]), rec
    assert rec["check_prompts"] == 32 and rec["max_steps"] == 200 and rec["target_accuracy"] == 0.5


def test_cap_stops_with_a_warning(tmp_path, caplog):
    cfg = cfg_for(tmp_path, "sft.target_accuracy=1.0", "sft.max_steps=6", "sft.eval_every=4")
    with caplog.at_level(logging.WARNING, logger="hybridrl.driver.sft"):
        path = ensure_warm_start(cfg, progress=False)
    rec = json.loads((tmp_path / "ws" / "sft.json").read_text())
    assert path == str(tmp_path / "ws")
    assert rec["steps"] == 6 and rec["target_met"] is False, rec
    assert [c["step"] for c in rec["checks"]] == [4, 6], (
        rec
    )  # every eval_every steps, and at the cap
    assert "reached the cap sft.max_steps=6 before sft.target_accuracy=1" in caplog.text
    assert "Raise sft.max_steps" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hybridrl.driver.sft"):
        ensure_warm_start(
            cfg, progress=False
        )  # cached: not retrained, but the miss is reported again
    assert "reached the cap" in caplog.text


def test_fixed_steps_skip_the_check(tmp_path):
    cfg = cfg_for(tmp_path, "sft.steps=3")
    rec = json.loads((run_sft(cfg, tmp_path / "ws", progress=False) / "sft.json").read_text())
    assert rec["steps"] == 3 and "target_met" not in rec and "checks" not in rec, rec


def test_check_is_held_out_and_deterministic(tmp_path):
    cfg = cfg_for(tmp_path, "task.name=test_sft_seven", "sft.eval_size=8", "task.heldout_size=12")
    task = make_task(cfg)
    model, tok = load_model(cfg, None)
    check = HeldoutCheck(cfg, task, tok)
    held = task.heldout()
    check.trained_on([held[0].text, held[3].text, "not-held-out"])  # as if an SFT batch held these
    assert check.seen == {held[0].text, held[3].text}
    assert check(model)[1] == 8  # the first 8 of the 10 not seen
    model.train()
    first = check(model)
    assert model.training  # the check restores train mode
    assert check(model) == first  # same seed, same weights: same accuracy
    check.trained_on([p.text for p in held])
    with pytest.raises(RuntimeError, match="held-out prompts appeared in an SFT batch"):
        check(model)


@pytest.mark.parametrize("clip", [0.0, 1e-3])
def test_grad_clip_bounds_the_step(tmp_path, clip):
    """With sft.grad_clip the update moves the weights by at most lr x clip (plain SGD, lr 1)."""
    import torch

    cfg = cfg_for(tmp_path)
    model, tok = load_model(cfg, None)
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0)
    ids, attn, labels, _ = sft_batch(make_task(cfg), tok, 0, 8)
    _train_step(model, opt, sched, ids, attn, labels, 4096, False, clip)
    moved = (torch.cat([p.detach().flatten() for p in model.parameters()]) - before).norm()
    assert moved <= clip * 1.001 if clip else moved > 1e-2, moved.item()


class EpisodeRan(Env):
    """Reward 1 once a model turn reaches the environment, whatever it says: the check scores an
    episode with it only when it runs the episode."""

    def step(self, action: str) -> StepResult:
        return StepResult(reward=1.0, done=True)


def test_check_runs_episodes_with_the_environment(tmp_path):
    """With env.name the check's samples are episodes, scored as the RL rollout scores them (the
    environment's reward); a single-turn check would score this untrained model's answers 0."""
    cfg = cfg_for(
        tmp_path, "task.name=test_sft_seven", "sft.eval_size=8", f"env.name={__name__}:EpisodeRan"
    )
    model, tok = load_model(cfg, None)
    assert HeldoutCheck(cfg, make_task(cfg), tok)(model) == (1.0, 8)
    single = cfg_for(tmp_path, "task.name=test_sft_seven", "sft.eval_size=8")
    assert HeldoutCheck(single, make_task(single), tok)(model)[0] == 0.0


def test_cache_key_covers_the_stop_rule(tmp_path):
    base = load_config(Config, None, [])
    paths = {
        str(warm_start_path(load_config(Config, None, o)))
        for o in (
            [],
            ["sft.target_accuracy=0.5"],
            ["sft.max_steps=999"],
            ["sft.eval_every=7"],
            ["sft.eval_size=64"],
            ["trainer.seed=1"],
            ["rollout.max_new_tokens=20"],
            ["sft.steps=300"],
        )
    }
    assert len(paths) == 8 and str(warm_start_path(base)) in paths
    fixed = [
        load_config(Config, None, ["sft.steps=300", o])
        for o in ("rollout.max_new_tokens=20", "rollout.max_new_tokens=16")
    ]
    assert warm_start_path(fixed[0]) == warm_start_path(
        fixed[1]
    )  # no check: the rollout settings do not matter


def test_lr_schedule_is_constant_until_the_cap_decays():
    assert lr_factor(0, 2000) == pytest.approx(1 / 20)
    assert (
        lr_factor(19, 2000) == 1.0 and lr_factor(1599, 2000) == 1.0
    )  # a stop on the target lands here
    assert lr_factor(1999, 2000) == pytest.approx(0.1, abs=0.01)
