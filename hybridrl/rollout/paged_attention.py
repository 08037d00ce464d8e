"""Attention over the paged KV pool, for one decoder layer (``layers.Attention``).

The pool (the runner, ``model_runner.py``) holds one K and one V tensor of shape (layers, kv_heads,
slots, head_dim), slot = block * block_size + offset. Attention writes the step's new K/V at the
tokens' slots, gathers each sequence's context through its block table into a reused buffer (or,
for a decode step over the batch kept from the previous step, only appends the new token to the
kept buffer), then computes grouped-query attention without repeating K/V: the query heads of one KV
head are stacked so that one matmul serves them all. Decode steps (one query per sequence) run one
fused SDPA kernel with each row's mask; prefill pads queries to the step's longest and masks the
future with the step's additive bias.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F


class KVPool(Protocol):
    """What attention needs of the runner's KV pool."""

    k_cache: torch.Tensor  # (layers, kv_heads, slots, head_dim)
    v_cache: torch.Tensor
    block_size: int
    keep_gathered: bool

    def gather_targets(
        self, layer: int, numel: int, persistent: bool
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


def paged_attention(
    pool: KVPool, li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, x
) -> torch.Tensor:
    """(T, heads * D) attention output of layer ``li`` for q (T, heads, D) and the new k, v
    (T, kv_heads, D) of the step inputs ``x`` (``step_inputs.StepInputs``)."""
    KV, D = k.shape[1], k.shape[2]
    G = q.shape[1] // KV
    kc, vc = pool.k_cache[li], pool.v_cache[li]  # (KV, slots, D)
    kc.index_copy_(1, x.slots, k.transpose(0, 1))
    vc.index_copy_(1, x.slots, v.transpose(0, 1))
    B, qmax, kmax, bs = x.batch, x.qmax, x.kmax, pool.block_size
    R = x.num_rows if x.pos is not None else B
    n, nb, bsd = KV * R * kmax * D, B * kmax // bs, bs * D
    kbuf, vbuf = pool.gather_targets(li, n, x.pos is not None and pool.keep_gathered)
    if x.reuse:  # decode over the kept batch: its gathered context only lacks the new token
        rows = (torch.arange(B, device=k.device) if x.rows is None else x.rows) * kmax + x.pos
        K = kbuf.view(KV, R * kmax, D).index_copy_(1, rows, k.transpose(0, 1)).view(KV, R, kmax, D)
        V = vbuf.view(KV, R * kmax, D).index_copy_(1, rows, v.transpose(0, 1)).view(KV, R, kmax, D)
    else:
        kb, vb = kc.view(KV, -1, bsd), vc.view(KV, -1, bsd)  # (KV, blocks, block_size * D)
        K = torch.index_select(kb, 1, x.kv_blocks, out=kbuf.view(KV, nb, bsd))
        V = torch.index_select(vb, 1, x.kv_blocks, out=vbuf.view(KV, nb, bsd))
        K, V = K.view(KV, B, kmax, D), V.view(KV, B, kmax, D)
    if x.q_pad_index is None:  # decode: one query per sequence, one fused kernel
        Q = q.reshape(B, KV, G, D).transpose(0, 1)
        if x.rows is not None:  # scatter into the kept rows
            Q = torch.zeros(KV, R, G, D, device=q.device, dtype=q.dtype).index_copy_(1, x.rows, Q)
        # the row's mask serves all its heads
        out = F.scaled_dot_product_attention(Q, K, V, attn_mask=x.bias.view(1, -1, 1, kmax))
        if x.rows is not None:
            out = out.index_select(1, x.rows)
        return out.transpose(0, 1).reshape(B, KV * G * D)
    Q = q[x.q_pad_index].view(B, qmax, KV, G, D).permute(2, 0, 3, 1, 4).reshape(KV, B, G * qmax, D)
    scores = torch.matmul(Q, K.transpose(-1, -2)).mul_(1.0 / math.sqrt(D))
    scores.view(KV, B, G, qmax, kmax).add_(x.bias.view(1, B, 1, qmax, kmax))
    probs = torch.softmax(scores, -1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, V)  # (KV, B, G*qmax, D)
    out = out.view(KV, B, G, qmax, D).permute(1, 3, 0, 2, 4).reshape(B * qmax, KV * G * D)
    return out[x.out_index]
