"""The policy update and the log-prob passes over a :class:`~hybridrl.parallel.pipeline.Pipeline`,
with the semantics of ``learner/update.py`` (same shuffle, same global mini-batches, losses
normalised by the global mini-batch totals, non-finite steps skipped on every rank alike) and of
``learner/logprob.py`` (log-probs under the rollout's sampling filters).

Data parallel over replicas: replica d holds a contiguous chunk of the step's rows (every pipeline
rank of the replica the same chunk); the permutation of the global batch is drawn as one process
draws it, and a replica trains on the rows of each mini-batch that lie in its chunk. Totals are
summed over replicas (an all-reduce over every rank, divided by pp since each replica's pp ranks
hold the same rows); FSDP2 sums the replicas' gradients.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

from hybridrl.algorithms import AggTotals, agg_totals
from hybridrl.algorithms.masking import zero_pad
from hybridrl.learner.logprob import _as_sampling, dummy_micro_batch, trim
from hybridrl.learner.moe import note_minibatch
from hybridrl.learner.update import chunk_minibatch_rows
from hybridrl.parallel import distributed
from hybridrl.parallel.pipeline import PipeLayout, Pipeline
from hybridrl.protocol import Batch

# objective(logp, entropy, mb, totals) -> (micro-batch loss, metrics): the loss on the last stage
Objective = Callable[[torch.Tensor, torch.Tensor, Batch, AggTotals], tuple[torch.Tensor, dict]]


def logits_log_probs(logits, mb: Batch, sampling, with_entropy: bool = False):
    """(log_probs, entropy or None) of ``mb``'s response tokens from the full-sequence logits,
    each (B, R), zero where ``response_mask`` is 0: the post-forward half of
    ``learner.logprob.response_log_probs`` (same sampling filters, fp32 math)."""
    from hybridrl.sampling import filtered_log_softmax

    responses, mask = mb["responses"], mb["response_mask"]
    logits = logits[:, -responses.shape[1] - 1 : -1].float()
    logp_all = filtered_log_softmax(logits, _as_sampling(sampling), responses)
    logp = zero_pad(logp_all.gather(-1, responses.unsqueeze(-1)).squeeze(-1), mask)
    if not with_entropy:
        return logp, None
    ent = -(logp_all.exp() * logp_all.masked_fill(torch.isinf(logp_all), 0.0)).sum(-1)
    return logp, zero_pad(ent, mask)


def replica_minibatch_rows(
    n_local: int, generator: torch.Generator, minibatch_size: int, layout: PipeLayout
) -> list[torch.Tensor]:
    """This replica's rows (indices into its chunk) of each global mini-batch of one epoch; draws
    from ``generator`` exactly as ``update.minibatch_rows`` does in one process."""
    sizes = distributed.all_gather_ints(n_local)[:: layout.pp]  # one rank per replica
    return chunk_minibatch_rows(sizes, layout.dp_rank, generator, minibatch_size)


def replica_totals(mini: Batch, norm_len: float, layout: PipeLayout) -> AggTotals:
    t = agg_totals(mini["response_mask"], norm_len)
    n_tokens, n_seqs = (distributed.all_reduce([t.n_tokens, t.n_seqs]) / layout.pp).tolist()
    return AggTotals(n_tokens=n_tokens, n_seqs=n_seqs, norm_len=t.norm_len)


@dataclass
class _MiniBatch:
    """One mini-batch's loss on the last stage: each micro-batch's objective with the global
    totals, its metrics summed token-weighted, whether every loss was finite."""

    objective: Objective
    sampling: object
    totals: AggTotals
    n_tokens: float
    ok: bool = True
    sums: dict = field(default_factory=lambda: defaultdict(float))

    def loss(self, rb: Batch, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        mb = rb.index(idx.cpu()).to(logits.device)
        logp, entropy = logits_log_probs(logits, mb, self.sampling, with_entropy=True)
        loss, metrics = self.objective(logp, entropy, mb, self.totals)
        self.ok = self.ok and bool(torch.isfinite(loss.detach()).all())
        share = float(mb["response_mask"].sum()) / self.n_tokens
        for k, v in metrics.items():
            self.sums[k] += v * share
        return loss


class PipelineRounds:
    """The backward passes of a pipelined policy over its replica's rows of a mini-batch, for
    ``update.run_updates``: the mini-batch in rounds of the schedule (:func:`rounds`), each
    micro-batch's ``objective`` on the last stage with the global totals, tied gradients summed;
    reports ``perf/pipeline_idle_fraction``."""

    def __init__(self, pl: Pipeline, objective: Objective, section, sampling):
        self.pl, self.objective, self.sampling = pl, objective, sampling
        self.budget = section.micro_batch_tokens

    def train(self) -> None:
        self.pl.train()

    def minibatch_rows(self, n_local: int, generator, size: int) -> list[torch.Tensor]:
        return replica_minibatch_rows(n_local, generator, size, self.pl.layout)

    def totals(self, mini: Batch, norm_len: float) -> AggTotals:
        return replica_totals(mini, norm_len, self.pl.layout)

    def backward(self, mini: Batch, totals: AggTotals, batch: Batch) -> tuple[bool, dict]:
        note_minibatch(self.pl.modules, totals)  # MoE: the balancing losses' weights, every rank
        state = _MiniBatch(self.objective, self.sampling, totals, max(totals.n_tokens, 1.0))
        for rb in rounds(self.pl, mini, self.budget, batch):
            self.pl.run_round(rb, partial(state.loss, rb))
        self.pl.sync_tied_grads()
        return state.ok, state.sums

    def clip_grad_norm(self, max_norm: float) -> float:
        return self.pl.clip_grad_norm(max_norm)

    def metrics(self, prefix: str) -> dict[str, float]:
        return {"perf/pipeline_idle_fraction": self.pl.idle_fraction()}


@torch.no_grad()
def log_probs(
    pl: Pipeline, minis: list[tuple[torch.Tensor, Batch]], batch: Batch, budget: int, sampling
) -> torch.Tensor:
    """(B, R) log-probs of ``batch``'s rows (this replica's), computed forward-only mini-batch by
    mini-batch (``minis``: (rows, mini-batch) pairs covering the batch), on every rank."""
    out = torch.zeros(tuple(batch["responses"].shape), dtype=torch.float32)
    pl.train(False)
    for rows, mini in minis:
        part = torch.zeros((len(mini), batch["responses"].shape[1]), dtype=torch.float32)
        first = 0
        for rb in rounds(pl, mini, budget, batch):
            pl.forward_round(rb, partial(_stash, part, rb, first, len(mini), sampling))
            first += len(rb)
        out[rows] = part
    pl.clock.pop()
    return pl.broadcast_from_last(out)


def _stash(part, rb, first, n_real, sampling, logits, idx) -> None:
    """A forward-only micro-batch's log-probs into ``part`` at its real rows."""
    mb = rb.index(idx.cpu()).to(logits.device)
    logp, _ = logits_log_probs(logits, mb, sampling)
    at = idx.cpu() + first
    real = at < n_real
    part[at[real], : logp.shape[1]] = logp[real.to(logp.device)].float().cpu()


def first_epoch_log_probs(
    pl: Pipeline, batch: Batch, generator: torch.Generator, section, sampling
) -> torch.Tensor:
    """Log-probs over the mini-batches and rounds the next update (:class:`PipelineRounds`) with
    ``generator``
    cuts in its first epoch (the generator only peeked at), so that they equal that update's first
    forward."""
    peek = torch.Generator()
    peek.set_state(generator.get_state())
    minis = [
        (rows, batch.index(rows))
        for rows in replica_minibatch_rows(len(batch), peek, section.ppo_minibatch_size, pl.layout)
    ]
    return log_probs(pl, minis, batch, section.micro_batch_tokens, sampling)


def rounds(pl, mini: Batch, token_budget: int, pad_from: Batch) -> list[Batch]:
    """``mini`` (this replica's rows of pipeline ``pl``) as round batches: trimmed, empty rows
    added so that each round holds ``n_microbatches`` equal micro-batches under ``token_budget``
    (at least one row each); replicas get as many rounds as the busiest (a collective)."""
    n = pl.layout.n_microbatches
    source = trim(mini) if len(mini) else trim(dummy_micro_batch(pad_from))
    width = source["input_ids"].shape[1]
    per_mb = max(1, token_budget // width)
    count = max(1, math.ceil(len(mini) / (per_mb * n)))
    count = int(distributed.all_reduce([count], op="max")[0].item())
    rows = max(1, math.ceil(len(mini) / (count * n)))
    out = []
    for r in range(count):
        # a replica with fewer rows than the busiest may have none left for its last rounds
        real = torch.arange(min(r * rows * n, len(mini)), min((r + 1) * rows * n, len(mini)))
        pad = rows * n - len(real)
        idx = torch.cat([real, torch.zeros(pad, dtype=torch.long)])
        rb = source.index(idx)
        if pad:  # the added rows contribute nothing
            keep = (torch.arange(len(idx)) < len(real)).unsqueeze(1)
            rm = rb["response_mask"]
            rm = torch.where(keep, rm, torch.zeros_like(rm))
            rb = Batch(dict(rb.tensors) | {"response_mask": rm}, rb.meta)
        out.append(rb)
    return out
