"""The native MoE block's dispatch against a per-token reference: both ways of summing the experts'
outputs (one ``index_add_``, or slot order after undoing the sort) and top-k = 3, which the
transformers comparisons in ``test_rollout_moe.py`` (top-2 configs) do not reach."""

import pytest
import torch
import torch.nn.functional as F

from hybridrl.models.spec import MoEShape
from hybridrl.rollout.layers import hf_view
from hybridrl.rollout.moe_block import MoEBlock, combine

torch.set_num_threads(1)


def reference(block: MoEBlock, x: torch.Tensor) -> torch.Tensor:
    """Token by token, slot by slot: the experts the router chose, weighted."""
    ids, weights = block.gate(x)
    gate_up, down = hf_view(block.experts.gate_up_proj), hf_view(block.experts.down_proj)
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1], dtype=torch.float64)
        for e, w in zip(ids[t].tolist(), weights[t]):
            g, u = F.linear(x[t], gate_up[e]).chunk(2, -1)
            acc += float(w) * F.linear(F.silu(g) * u, down[e]).double()
        rows.append(acc)
    return torch.stack(rows).float()


@pytest.mark.parametrize("k", [1, 2, 3])
def test_block_output_equals_the_per_token_reference(k):
    torch.manual_seed(k)
    shape = MoEShape(6, k, 12, 0, normalise=True, cast_weights=True, sparse_layers=(True,))
    block = MoEBlock(shape, 16, device="cpu", dtype=torch.float32)
    # through the transformers-shaped views, as weight sync writes them
    experts = block.experts
    for t in (block.gate.weight, hf_view(experts.gate_up_proj), hf_view(experts.down_proj)):
        t.copy_(torch.randn(t.shape) * 0.3)
    x = torch.randn(40, 16)
    out, ids = block(x)
    assert ids.shape == (40, k)
    assert torch.allclose(out, reference(block, x), atol=1e-5)


@pytest.mark.parametrize("k", [2, 3])
def test_both_sums_agree(k):
    torch.manual_seed(0)
    T, H = 25, 8
    ids = torch.stack([torch.randperm(5)[:k] for _ in range(T)])
    order = torch.argsort(ids.flatten(), stable=True)
    ys = torch.randn(T * k, H)
    weights = torch.rand(T, k)
    slot = combine(ys, weights, order, in_slot_order=True)
    added = combine(ys, weights, order, in_slot_order=False)
    # by hand, token by token in float64: ys[p] is the output for the slot order[p] = t * k + j
    # (the p-th of the slots sorted by expert), weighted by that slot's router weight
    where = {int(flat): p for p, flat in enumerate(order)}
    expected = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            expected[t] += float(weights[t, j]) * ys[where[t * k + j]].double()
    assert torch.allclose(slot.double(), expected, atol=1e-6)
    assert torch.allclose(added.double(), expected, atol=1e-6)
