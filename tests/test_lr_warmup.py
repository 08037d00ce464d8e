"""actor.lr_warmup_steps: the actor's learning rate ramps up over the first optimizer steps, and a
resumed optimizer continues the ramp from its own step count."""

import pytest
import torch

from hybridrl.learner.warmup import add_warmup, optimizer_steps


def _opt(lr: float = 1.0) -> tuple[torch.nn.Parameter, torch.optim.Optimizer]:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(4))
    return p, torch.optim.AdamW([p], lr=lr, weight_decay=0.0)


def _step(p, opt) -> float:
    before = p.detach().clone()
    p.grad = torch.randn(4)
    opt.step()
    return float((p.detach() - before).abs().max())


def test_the_first_steps_are_scaled_down_then_full():
    p, opt = _opt(0.1)
    add_warmup(opt, 4)
    seen = []
    for _ in range(6):
        _step(p, opt)
        seen.append(opt.param_groups[0]["lr"])
    assert seen == pytest.approx([0.025, 0.05, 0.075, 0.1, 0.1, 0.1])
    assert optimizer_steps(opt) == 6


def test_adam_first_step_moves_weights_by_lr_without_warmup_and_less_with_it():
    p, opt = _opt(0.1)
    assert _step(p, opt) == pytest.approx(0.1, rel=1e-3)  # sign step: why the warmup exists
    p, opt = _opt(0.1)
    add_warmup(opt, 10)
    assert _step(p, opt) == pytest.approx(0.01, rel=1e-3)


def test_a_resumed_optimizer_continues_the_ramp():
    p, opt = _opt(0.1)
    add_warmup(opt, 4)
    for _ in range(2):
        _step(p, opt)
    state = opt.state_dict()
    q, fresh = _opt(0.1)
    fresh.load_state_dict(state)
    fresh.param_groups[0]["lr"] = 0.1  # a fresh run's configured rate
    add_warmup(fresh, 4)
    _step(q, fresh)
    assert fresh.param_groups[0]["lr"] == pytest.approx(0.075)


def test_zero_means_off():
    p, opt = _opt(0.1)
    add_warmup(opt, 0)
    _step(p, opt)
    assert opt.param_groups[0]["lr"] == 0.1
