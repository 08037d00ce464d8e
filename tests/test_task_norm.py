"""Task-level advantage normalisation (AgentRL): each task whitened over its own valid tokens."""

from __future__ import annotations

import math

import pytest
import torch

from hybridrl.algorithms.advantages import compute_advantages, task_normalized
from hybridrl.config import AlgorithmConfig
from hybridrl.protocol import Batch


def test_task_normalized_by_hand():
    # task a: advantages 1, 3 (one valid token each): mean 2, unbiased var 2
    # task b: 10, 10, 40 over rows of two valid tokens (the pad holds junk): mean 20, var 300
    adv = torch.tensor([[1.0, 0.0], [10.0, 10.0], [3.0, 7.0], [40.0, 40.0], [10.0, 10.0]])
    mask = torch.tensor([[1, 0], [1, 1], [1, 0], [1, 1], [1, 1]])
    out = task_normalized(adv, mask, ["a", "b", "a", "b", "b"])
    sa = 1 / math.sqrt(2 + 1e-8)
    # b's six tokens: 10 x4, 40 x2 -> mean 20, unbiased var (4 * 100 + 2 * 400) / 5 = 240
    sb = 1 / math.sqrt(240 + 1e-8)
    expected = torch.tensor(
        [[-sa, 0.0], [-10 * sb] * 2, [sa, 0.0], [20 * sb] * 2, [-10 * sb] * 2],
        dtype=torch.float32,
    )
    assert torch.allclose(out, expected, atol=1e-6)


def test_one_task_is_whitening_the_batch_and_tasks_do_not_mix():
    g = torch.Generator().manual_seed(0)
    adv = torch.randn(6, 4, generator=g) * 5 + 3
    mask = torch.ones(6, 4, dtype=torch.long)
    one = task_normalized(adv, mask, ["t"] * 6)
    assert one[mask.bool()].mean().abs() < 1e-6
    assert one[mask.bool()].std().item() == pytest.approx(1.0, abs=1e-5)
    # a second task's values never change the first task's output
    two = task_normalized(
        torch.cat([adv, adv * 100]), torch.cat([mask, mask]), ["t"] * 6 + ["u"] * 6
    )
    assert torch.allclose(two[:6], one)


def test_compute_advantages_applies_it_when_asked():
    mask = torch.ones(4, 2, dtype=torch.long)
    rewards = torch.zeros(4, 2)
    rewards[:, -1] = torch.tensor([1.0, 0.0, 5.0, 1.0])
    batch = Batch(
        {"token_level_rewards": rewards, "response_mask": mask},
        {"uid": ["p", "p", "q", "q"], "task_id": ["x", "x", "y", "y"]},
    )
    plain = compute_advantages(batch, AlgorithmConfig(advantage="reinforce_pp"))
    normed = compute_advantages(batch, AlgorithmConfig(advantage="reinforce_pp", task_norm=True))
    expected = task_normalized(plain["advantages"], mask, ["x", "x", "y", "y"])
    assert torch.allclose(normed["advantages"], expected)
    assert not torch.allclose(normed["advantages"], plain["advantages"])
