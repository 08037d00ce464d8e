"""actor.lr_schedule and its keys (the critic's the same): a linear warmup, then constant, linear or
cosine decay to min_lr_ratio x lr at the run's last optimizer step; a resumed optimizer continues
the schedule from its own step count; actor/lr is logged."""

import math
from types import SimpleNamespace

import pytest
import torch

from hybridrl.config import Config, load_config
from hybridrl.learner.lr_schedule import add_lr_schedule, lr_factor, optimizer_steps, planned_steps


def section(schedule="constant", warmup=0, ratio=0.0, floor=0.0):
    return SimpleNamespace(
        lr_schedule=schedule, lr_warmup_steps=warmup, lr_warmup_ratio=ratio, min_lr_ratio=floor
    )


def _opt(lr: float = 1.0) -> tuple[torch.nn.Parameter, torch.optim.Optimizer]:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(4))
    return p, torch.optim.AdamW([p], lr=lr, weight_decay=0.0)


def _step(p, opt) -> float:
    before = p.detach().clone()
    p.grad = torch.randn(4)
    opt.step()
    return float((p.detach() - before).abs().max())


def _rates(schedule, steps, **kw) -> list[float]:
    p, opt = _opt(0.1)
    add_lr_schedule(opt, section(schedule, **kw), total=steps)
    seen = []
    for _ in range(steps):
        _step(p, opt)
        seen.append(opt.param_groups[0]["lr"])
    return seen


def test_the_first_steps_are_scaled_down_then_full():
    seen = _rates("constant", 6, warmup=4)
    assert seen == pytest.approx([0.025, 0.05, 0.075, 0.1, 0.1, 0.1])


def test_linear_and_cosine_decay_after_the_warmup_to_the_floor():
    linear = _rates("linear", 12, warmup=2, floor=0.1)
    assert linear[:2] == pytest.approx([0.05, 0.1])
    # 10 decay steps from 0.1 to 0.01: step k after the warmup takes 0.1 * (1 - 0.9 * k / 10)
    assert linear[2:] == pytest.approx([0.1 * (1 - 0.9 * k / 10) for k in range(10)])
    cosine = _rates("cosine", 12, warmup=2, floor=0.1)
    expect = [0.1 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 10))) for k in range(10)]
    assert cosine[2:] == pytest.approx(expect)
    assert cosine[6] > linear[6]  # cosine stays higher in the first half
    # past the planned end (a run that took more optimizer steps): the floor, never below
    assert lr_factor(50, "cosine", 2, 12, 0.1) == pytest.approx(0.1)
    assert lr_factor(50, "linear", 2, 12, 0.0) == 0.0


def test_a_warmup_ratio_of_the_run():
    assert _rates("constant", 10, ratio=0.2)[:3] == pytest.approx([0.05, 0.1, 0.1])


def test_adam_first_step_moves_weights_by_lr_without_warmup_and_less_with_it():
    p, opt = _opt(0.1)
    assert _step(p, opt) == pytest.approx(0.1, rel=1e-3)  # sign step: why the warmup exists
    p, opt = _opt(0.1)
    add_lr_schedule(opt, section(warmup=10), total=100)
    assert _step(p, opt) == pytest.approx(0.01, rel=1e-3)


def test_a_resumed_optimizer_continues_the_schedule():
    p, opt = _opt(0.1)
    add_lr_schedule(opt, section("linear", warmup=4), total=20)
    for _ in range(6):
        _step(p, opt)
    state = opt.state_dict()
    q, fresh = _opt(0.1)
    fresh.load_state_dict(state)
    fresh.param_groups[0]["lr"] = 0.1  # a fresh run's configured rate
    add_lr_schedule(fresh, section("linear", warmup=4), total=20)
    _step(q, fresh)
    assert optimizer_steps(fresh) == 7
    assert fresh.param_groups[0]["lr"] == pytest.approx(0.1 * (1 - 2 / 16))


def test_constant_without_warmup_is_off():
    assert _rates("constant", 3) == [0.1, 0.1, 0.1]


def test_planned_steps_and_the_config_keys():
    cfg = load_config(
        Config,
        None,
        [
            "trainer.total_steps=10",
            "trainer.prompts_per_step=8",
            "trainer.samples_per_prompt=4",
            "actor.ppo_minibatch_size=16",
            "actor.ppo_epochs=2",
            "actor.lr_schedule=cosine",
            "critic.lr_schedule=linear",
        ],
    )
    assert planned_steps(cfg, cfg.actor) == 10 * 2 * 2
    assert cfg.actor.lr_schedule == "cosine" and cfg.critic.lr_schedule == "linear"
    with pytest.raises(Exception, match="did you mean 'cosine'"):
        load_config(Config, None, ["actor.lr_schedule=cosin"])
