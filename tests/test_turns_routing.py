"""A multi-turn trajectory's recorded MoE routing (``rollout/turns.py``: ``Trajectory.add_routing``
and ``part``): each token keeps its first recorded routing, a token first seen unrouted takes the
next turn's, tokens never fed stay -1 in the sample."""

import torch

from hybridrl.moe.routing import NOT_ROUTED, ROUTING_DTYPE
from hybridrl.protocol import Sample
from hybridrl.rollout.turns import Group, Trajectory
from hybridrl.sampling import SamplingParams


def rows(values: list[int]) -> torch.Tensor:
    """One (token, 1 layer, k = 2) routing row per value: (v, v), or -1 for NOT_ROUTED."""
    return torch.tensor([[[v, v]] for v in values], dtype=ROUTING_DTYPE)


def test_each_token_keeps_its_first_routing_and_unfed_tokens_stay_unrouted():
    t = Trajectory(Group(Sample(prompt_ids=[1, 2], uid="p"), SamplingParams()), 0, [1, 2])
    t.extend([3, 4], [0.0, 0.0], [0, 0], [1, 1])  # turn 1: its last token was never fed
    t.add_routing(rows([10, 11, 12, NOT_ROUTED]))
    t.extend([5], [0.0], [0], [0])  # an observation
    t.extend([6], [0.0], [0], [1])  # turn 2, prefilled the turn-1 tail and the observation anew
    t.add_routing(rows([20, 21, 22, 23, 24, NOT_ROUTED]))
    assert t.routing[:, 0, 0].tolist() == [10, 11, 12, 23, 24, NOT_ROUTED]
    t.add_routing(rows([30, 31]))  # a shorter record keeps the rest as it was
    assert t.routing[:, 0, 0].tolist() == [10, 11, 12, 23, 24, NOT_ROUTED]
    t.extend([7], [0.0], [0], [0])  # an observation after the last turn: never fed
    s = t.part("finished")
    assert s.routing.dtype == ROUTING_DTYPE
    assert s.routing[:, 0, 0].tolist() == [10, 11, 12, 23, 24, NOT_ROUTED, NOT_ROUTED]
