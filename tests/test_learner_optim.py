"""The learner's AdamW (learner/optim.py): fused on a CPU, the same steps as PyTorch's loop."""

import copy

import torch
from torch import nn

from hybridrl.learner.optim import fused_blocker, make_adamw


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 4))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=g)
        opt.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        opt.step()


def test_cpu_parameters_get_the_fused_kernel():
    model = _model()
    assert fused_blocker(list(model.parameters())) is None
    opt = make_adamw(model.parameters(), 1e-3, 0.01, "test")
    assert opt.defaults["fused"] is True


def test_fused_steps_match_the_loop_to_rounding():
    fused_model, loop_model = _model(), _model()
    fused = make_adamw(fused_model.parameters(), 1e-2, 0.01, "test")
    loop = torch.optim.AdamW(loop_model.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    start = copy.deepcopy(loop_model.state_dict())
    _train(fused_model, fused, 5)
    _train(loop_model, loop, 5)
    for (name, a), b in zip(fused_model.state_dict().items(), loop_model.state_dict().values()):
        assert not torch.equal(b, start[name])  # the steps moved the weights
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # the state dicts are interchangeable: the loop's state loads into a fused optimizer
    fused.load_state_dict(loop.state_dict())
    assert set(fused.state_dict()["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}


def test_non_float_parameters_fall_back_to_the_loop():
    assert fused_blocker([]) == "no parameters"
    assert "dtype" in fused_blocker([torch.zeros(2, dtype=torch.int64)])
