"""Rank processes of tests/test_pipeline.py: the pipelined update and log-prob pass against the
single-process ones on the same tiny 8-layer Qwen2 (tied embeddings), for several schedules and
loss aggregation modes in one process group.

``python tests/pipeline_ranks.py rank <r> <port> <workdir>``; the case list is ``cases.json`` in
the work directory: ``[[schedule, pp, dp, loss_agg], ...]`` (pp * dp is the world size). Each rank
writes ``out-<r>.pt``: per case the loss sum, every gradient by transformers name, the weights
after two clipped SGD steps and the log-probs, from the ranks that hold them (SGD, not AdamW: Adam's
normalisation blows the float rounding of near-zero gradients up to its step size). The
single-process values
(:func:`single_process`) are computed by the test's own process, which has no process group.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from batches import prompt_response_batch
from transformers import Qwen2Config, Qwen2ForCausalLM

from hybridrl.algorithms import LOSS_AGG, POLICY_LOSSES, kl_penalty
from hybridrl.config import AlgorithmConfig
from hybridrl.learner.logprob import response_log_probs
from hybridrl.learner.update import MicroBatches, run_updates
from hybridrl.protocol import Batch
from hybridrl.sampling import SamplingParams

SAMPLING = SamplingParams(temperature=0.7)
ROWS, PROMPT, RESP, VOCAB = 12, 5, 6, 64


def tiny_model(seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=64,
        rope_theta=1e4,
    )
    return Qwen2ForCausalLM(cfg).float()


def make_batch(seed: int = 0) -> Batch:
    """Left-padded prompts ++ right-padded responses of ragged lengths, with the columns the loss
    reads."""
    g = torch.Generator().manual_seed(seed)
    batch = prompt_response_batch(g, VOCAB, ROWS, PROMPT, RESP)
    rmask = batch["response_mask"]
    noise = torch.randn(ROWS, RESP, generator=g)
    return batch | Batch(
        {
            "old_log_probs": (-4.0 + 0.3 * noise) * rmask,
            "ref_log_probs": (-4.2 + 0.3 * noise.flip(0)) * rmask,
            "advantages": (torch.randn(ROWS, 1, generator=g) * rmask).contiguous(),
        }
    )


def objective_for(loss_agg: str):
    """The learner's micro-batch objective (policy loss + KL to the reference - entropy bonus),
    aggregated by ``loss_agg``; returns (fn(logp, entropy, mb, totals), losses it records)."""
    alg = AlgorithmConfig(
        loss_agg=loss_agg, kl_coef=0.05, entropy_coef=0.01, policy_loss="ppo_clip"
    )
    policy, agg, losses = POLICY_LOSSES.get(alg.policy_loss), LOSS_AGG.get(loss_agg), []

    def objective(logp, entropy, mb, totals):
        mask = mb["response_mask"]
        pg, metrics = policy(logp, mb, alg)
        loss = agg(pg, mask, totals)
        kl = kl_penalty(alg.kl_estimator, logp, mb["ref_log_probs"]) * mask
        loss = (
            loss
            + alg.kl_coef * agg(kl, mask, totals)
            - alg.entropy_coef * agg(entropy, mask, totals)
        )
        losses.append(float(loss.detach()))
        return loss, metrics

    return objective, losses


def section(minibatch: int, grad_clip: float, budget: int = 40):
    return SimpleNamespace(
        ppo_minibatch_size=minibatch, ppo_epochs=1, micro_batch_tokens=budget, grad_clip=grad_clip
    )


def hf_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def single_process(loss_agg: str) -> dict:
    """Loss and gradients of one mini-batch (no clip, lr 0), log-probs, weights after two
    clipped SGD steps: the numbers every pipelined case must match."""
    batch, out = make_batch(), {}
    model = tiny_model()
    objective, losses = objective_for(loss_agg)

    def loss_fn(mb, totals):
        logp, ent = response_log_probs(model, mb, SAMPLING, with_entropy=True)
        return objective(logp, ent, mb, totals)

    sgd = torch.optim.SGD(model.parameters(), lr=0.0)
    g = torch.Generator().manual_seed(1)
    sec = section(ROWS, 0.0)
    run_updates(MicroBatches(model, loss_fn, sec), sgd, batch, sec, generator=g, norm_len=RESP,
                prefix="actor")  # fmt: skip
    out["loss"], out["grads"] = sum(losses), hf_grads(model)
    with torch.no_grad():
        out["logp"] = response_log_probs(model, batch, SAMPLING)[0]
    model = tiny_model()
    adam = torch.optim.SGD(model.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(2)
    sec = section(ROWS // 2, 0.5)
    run_updates(MicroBatches(model, loss_fn, sec), adam, batch, sec, generator=g, norm_len=RESP,
                prefix="actor")  # fmt: skip
    out["weights"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def pipelined(schedule: str, pp: int, dp: int, loss_agg: str, rank: int) -> dict:
    from hybridrl.learner.pipeline_update import PipelineRounds, first_epoch_log_probs
    from hybridrl.parallel.pipeline import PipeLayout, Pipeline

    layout = PipeLayout(pp=pp, dp=dp, rank=rank, schedule=schedule)
    batch = make_batch()
    part = batch.chunk(dp)[layout.dp_rank]
    out = {}
    pl = Pipeline(tiny_model(), layout)
    objective, losses = objective_for(loss_agg)
    sgd = torch.optim.SGD(pl.parameters(), lr=0.0)
    g = torch.Generator().manual_seed(1)
    kw = dict(norm_len=RESP, prefix="actor")
    sec = section(ROWS, 0.0)
    metrics = run_updates(PipelineRounds(pl, objective, sec, SAMPLING), sgd, part, sec,
                          generator=g, **kw)  # fmt: skip
    out["loss"], out["grads"], out["idle"] = sum(losses), stage_values(pl, "grad"), metrics
    g = torch.Generator().manual_seed(1)
    logp = first_epoch_log_probs(pl, part, g, section(ROWS, 0.0), SAMPLING)
    out["logp"] = distributed_cat(logp, layout)
    pl = Pipeline(tiny_model(), layout)
    adam = torch.optim.SGD(pl.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(2)
    sec = section(ROWS // 2, 0.5)
    run_updates(PipelineRounds(pl, objective, sec, SAMPLING), adam, part, sec, generator=g, **kw)
    out["weights"] = stage_values(pl, "data")
    return out


def stage_values(pl, attr: str) -> dict[str, torch.Tensor]:
    """This rank's stage parameters' ``attr`` (grad or data) by transformers name, full tensors
    (a collective under FSDP2); a tied head copy under ``lm_head.weight``."""
    out = {}
    for stage in pl.stages:
        names = stage.hf_names()
        for name, p in stage.named_parameters():
            t = getattr(p, attr)
            if t is None:
                continue
            t = t.full_tensor() if hasattr(t, "full_tensor") else t
            out[names[name] or "lm_head.weight"] = t.detach().clone()
    return out


def distributed_cat(logp: torch.Tensor, layout) -> torch.Tensor:
    """The replicas' log-probs in row order (every rank)."""
    from hybridrl.parallel import distributed

    parts = distributed.all_gather_object(logp)
    return torch.cat(parts[:: layout.pp])


def rank_main(rank: int, port: int, workdir: str) -> None:
    import faulthandler

    from hybridrl.controller import WorkerContext
    from hybridrl.parallel import distributed

    faulthandler.dump_traceback_later(float(os.environ.get("PIPELINE_TEST_DUMP_S", 600)), exit=True)
    torch.set_num_threads(1)
    work = Path(workdir)
    cases = json.loads((work / "cases.json").read_text())
    world = int(os.environ["WORLD_SIZE"])
    ctx = WorkerContext(rank=rank, world_size=world, role="learner", pool="p", master_port=port)
    distributed.init_distributed(ctx)
    results = {}
    for schedule, pp, dp, loss_agg in cases:
        results[(schedule, pp, dp, loss_agg)] = pipelined(schedule, pp, dp, loss_agg, rank)
    torch.save({"results": results}, work / f"out-{rank}.pt")
    distributed.barrier()
    sys.stdout.flush()
    os._exit(0)  # see parallel/distributed.py: teardown after FSDP2 may abort at exit


if __name__ == "__main__" and sys.argv[1] == "rank":
    rank_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
