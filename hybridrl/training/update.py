"""The mini-batch / micro-batch loop shared by every trained role (actor, critic).

One optimizer step per mini-batch of ``minibatch_size`` samples; each
mini-batch is cut into micro-batches under a token budget and the gradients
accumulate. ``loss_fn(mb, totals)`` returns the micro-batch's *contribution*
to the mini-batch loss (normalised by the mini-batch totals), so the sum over
micro-batches is exactly the mini-batch loss whatever the budget.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable

import torch

from hybridrl.algorithms import AggTotals, agg_totals
from hybridrl.protocol import Batch
from hybridrl.training.logprob import micro_batches

LossFn = Callable[[Batch, AggTotals], tuple[torch.Tensor, dict[str, float]]]


def run_updates(model, optimizer, batch: Batch, loss_fn: LossFn, *, minibatch_size: int, epochs: int,
                micro_batch_tokens: int, grad_clip: float, generator: torch.Generator, norm_len: float,
                prefix: str) -> dict[str, float]:
    """Train ``epochs`` passes over ``batch`` (shuffled by ``generator``); metrics averaged over optimizer steps."""
    model.train()
    sums: dict[str, float] = defaultdict(float)
    steps = 0
    for _ in range(epochs):
        for mini in batch.shuffle(generator).split(minibatch_size):
            optimizer.zero_grad(set_to_none=True)
            totals = agg_totals(mini["response_mask"], norm_len)
            n_tokens = max(float(mini["response_mask"].sum()), 1.0)
            for mb in micro_batches(mini, micro_batch_tokens):
                loss, metrics = loss_fn(mb, totals)
                loss.backward()
                share = float(mb["response_mask"].sum()) / n_tokens  # metrics: token-weighted mean over the mini-batch
                for k, v in metrics.items():
                    sums[k] += v * share
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip or float("inf"))
            sums[f"{prefix}/grad_norm"] += norm.item()
            optimizer.step()
            steps += 1
    return {k: v / max(steps, 1) for k, v in sums.items()} | {f"{prefix}/updates": steps}
