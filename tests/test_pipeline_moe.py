"""An MoE policy through the pipeline (``actor.pp_size=2``, two gloo ranks, the real Learner on
``tiny_moe``, fp32) trains like one process (the two-rank cases are in the slow set). With R3
replay of a random recorded routing (1F1B; R2 and schedules with two stages per rank), the
auxiliary loss, the z-loss and the expert bias all on, the old log-probs, the expert loads and
every ``moe/`` metric of two steps, the gradients of every parameter after them and the updated
weights (the bias included) equal the unpipelined learner's on the same batch, and the pipelined
checkpoint keeps the expert biases.

Rows of one length and a token budget of two rows per micro-batch make the pipeline's micro-batches
the single process's, so the per-micro-batch balancing losses are the same losses. The 12 rows form
two mini-batches of 6, so the old log-probs come from the forward-only pass, the bias moves between
the two optimizer steps, and each round of 4 micro-batches ends with one of filler rows, which no
load counts.

In the default set, four ranks compose expert and pipeline parallelism: two replicas of the
two-stage pipeline, each stage's experts split over the replicas (``moe.ep_size=2``), R3 and every
balancing option, against the same single process, with activation checkpointing on the four
ranks and without.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import torch

from hybridrl.config import Config, load_config
from hybridrl.protocol import Batch, Sample, samples_to_batch

WORLD = 2
ROWS, PROMPT, RESP = 12, 5, 6
TOL = 1e-5


def learner(
    replay, schedule="1f1b", pp=1, rank=0, port=None, world=1, ep=1, rows=ROWS, per_mb=2, ac=False
):
    from hybridrl.controller import WorkerContext
    from hybridrl.learner import Learner

    cfg = load_config(
        Config,
        None,
        [
            "model.name=tiny_moe",
            "rollout.backend=hf",
            f"moe.routing_replay={replay}",
            "moe.aux_loss_coef=0.01",
            "moe.z_loss_coef=0.001",
            "moe.bias_update_rate=0.01",
            f"actor.ppo_minibatch_size={rows // 2}",
            f"trainer.prompts_per_step={rows // 4}",
            "trainer.samples_per_prompt=4",
            f"actor.micro_batch_tokens={per_mb * (PROMPT + RESP)}",
            "actor.packing=false",
            "actor.compile=false",
            "fsdp.mixed_precision=fp32",
            f"actor.pp_size={pp}",
            f"actor.pp_schedule={schedule}",
            "actor.pp_microbatches=4",
            f"moe.ep_size={ep}",
            f"fsdp.activation_checkpointing={str(ac).lower()}",
        ],
    )
    ctx = WorkerContext(
        rank=rank, world_size=world, role="learner", pool="p", master_port=port, num_threads=1
    )
    return Learner(ctx, cfg, None)


def make_batch(vocab: int, rows: int = ROWS) -> Batch:
    """``rows`` rows of PROMPT + RESP tokens with a random recorded routing (the response's last
    token unrouted, as a rollout leaves it) and random advantages."""
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(rows):
        ids = torch.randint(3, vocab, (PROMPT + RESP,), generator=g).tolist()
        routing = torch.rand(PROMPT + RESP, 4, 8, generator=g).argsort(-1)[..., :2]
        routing[-1] = -1
        samples.append(
            Sample(
                prompt_ids=ids[:PROMPT],
                response_ids=ids[PROMPT:],
                log_probs=[-3.0] * RESP,
                versions=[0] * RESP,
                status="finished",
                uid=str(i // 4),
                reward=float(i % 2),
                routing=routing.to(torch.int16),
            )
        )
    batch = samples_to_batch(samples, 0)
    batch["advantages"] = torch.randn(rows, 1, generator=g) * batch["response_mask"]
    return batch


def step(lrn, batch: Batch) -> dict:
    """The learning step's policy passes (as ``Learner.train_step`` runs them, each data-parallel
    replica on its rows): replay marks, the old log-probs, R2's capture, one update (two optimizer
    steps), the step's ``moe/`` metrics."""
    from hybridrl.parallel import distributed

    moe = lrn.moe
    batch = moe.mark(batch)
    batch = batch | lrn.actor.rows(lrn.compute_log_prob, batch)
    batch = moe.after_old_pass(batch)
    metrics = lrn.actor.rows(lrn.update_actor, batch)
    loads = distributed.all_reduce(moe.counts.flatten().clone()).view(moe.counts.shape)
    metrics |= moe.step_metrics(batch)
    return {"old": batch["old_log_probs"], "metrics": metrics, "loads": loads}


def train(lrn, batch: Batch, steps: int = 2) -> list[dict]:
    """``steps`` steps on ``batch`` (the second one's routing drift compares with the first's)."""
    return [step(lrn, Batch(dict(batch.tensors))) for _ in range(steps)]


def named_grads(stages) -> dict[str, torch.Tensor]:
    """This rank's stage parameters' gradients by transformers name, unsharded (a collective over
    the replicas' ranks when they are sharded)."""
    out = {}
    for stage in stages:
        names = stage.hf_names()
        for name, p in stage.named_parameters():
            t = p.grad
            if t is not None and names[name] is not None:
                t = t.full_tensor() if hasattr(t, "full_tensor") else t
                out[names[name]] = t.detach().clone()
    return out


def rank_main(rank: int, port: int, workdir: str) -> None:
    from hybridrl.parallel import distributed

    torch.set_num_threads(1)
    work = Path(workdir)
    saved = torch.load(work / "batch.pt", weights_only=True)
    world, ep, rows, per_mb = saved["world"], saved["ep"], saved["rows"], saved["per_mb"]
    ac = saved["ac"]
    results = {}
    for replay, schedule in saved["modes"]:
        lrn = learner(replay, schedule, 2, rank, port, world, ep, rows, per_mb, ac)
        if ep > 1:  # each rank holds half of every layer's experts
            experts = lrn.actor.pipeline.stages[0].layers["0" if rank % 2 == 0 else "2"].mlp.experts
            assert experts.gate_up_proj.to_local().shape[0] == 4
        out = {"steps": train(lrn, Batch(saved["tensors"]), saved["steps"])}
        lrn.actor.pipeline.reshard()  # the stages keep their gathered roots
        out["grads"] = named_grads(lrn.actor.pipeline.stages)
        out["weights"] = lrn.actor.pipeline.full_weights()  # rank 0: the whole model
        path = str(work / f"checkpoint-{replay}-{schedule}")
        lrn.save_checkpoint(path)
        if ep > 1:  # the sharded checkpoint (split experts and all) loads back on this layout
            fresh = learner(replay, schedule, 2, rank, port, world, ep, rows, per_mb, ac)
            fresh.load_state(path)
            out["reloaded"] = fresh.actor.pipeline.full_weights()
        results[replay, schedule] = out
    torch.save(results, work / f"out-{rank}.pt")
    distributed.barrier()
    sys.stdout.flush()
    os._exit(0)  # see parallel/distributed.py: teardown after FSDP2 may abort at exit


def run(tmp_path, modes, world=WORLD, ep=1, rows=ROWS, per_mb=2, steps=2, ac=False) -> None:
    """Each (replay, schedule) of ``modes`` on ``world`` ranks (two pipeline stages, ``ep`` ranks
    per expert group; ``ac``: with activation checkpointing) against one process without it, for
    ``steps`` steps; ``per_mb`` rows per micro-batch."""
    from rank_processes import launch_ranks, wait_ranks

    replays = {replay for replay, _ in modes}
    single = {replay: learner(replay, rows=rows, per_mb=per_mb) for replay in replays}
    batch = make_batch(next(iter(single.values())).model.config.vocab_size, rows)
    shape = {"world": world, "ep": ep, "rows": rows, "per_mb": per_mb, "modes": modes}
    shape |= {"steps": steps, "ac": ac}
    torch.save(shape | {"tensors": dict(batch.tensors)}, tmp_path / "batch.pt")
    procs = launch_ranks(__file__, world, tmp_path)
    want = {}
    for replay, lrn in single.items():
        want[replay] = {"steps": train(lrn, batch, steps)}
        params = dict(lrn.model.named_parameters())
        want[replay]["grads"] = {n: p.grad.clone() for n, p in params.items() if p.grad is not None}
        want[replay]["weights"] = {n: p.detach().clone() for n, p in params.items()}
    wait_ranks(procs, timeout=600)
    outs = [torch.load(tmp_path / f"out-{r}.pt", weights_only=False) for r in range(world)]
    for replay, schedule in modes:
        got = [out[replay, schedule] for out in outs]
        for i, (mine, theirs) in enumerate(zip(want[replay]["steps"], got[0]["steps"])):
            check_step(mine, theirs, replay, i, rows)
        check_weights(want[replay], got, replay)
        check_checkpoint(want[replay]["weights"], tmp_path / f"checkpoint-{replay}-{schedule}")
        if ep > 1:
            reloaded = got[0]["reloaded"]
            assert all(torch.equal(reloaded[k], w) for k, w in got[0]["weights"].items())


def check_step(want: dict, got: dict, replay: str, i: int, rows: int) -> None:
    assert (got["old"] - want["old"]).abs().max().item() <= TOL, (replay, i)
    # every real token of the two mini-batches, once per layer and slot
    assert want["loads"].sum(-1).tolist() == [2.0 * rows * (PROMPT + RESP)] * 4
    assert torch.equal(got["loads"], want["loads"]), (replay, i)
    metrics, theirs = want["metrics"], got["metrics"]
    against = "old_pass" if replay == "r2" else "rollout"
    assert f"moe/routing_changed_vs_{against}" in metrics
    if replay == "r3":  # the random routing is not the router's choice: replay ran in both
        assert metrics["moe/routing_changed_vs_rollout"] > 0.5
    assert metrics["moe/aux_loss"] > 0 and metrics["moe/z_loss"] > 0
    drift = metrics["moe/routing_changed_vs_previous_version"]
    assert math.isnan(drift) if i == 0 else 0 <= drift <= 1, (replay, i, drift)
    keys = [k for k in metrics if k.startswith("moe/") or k.startswith("actor/")]
    assert "moe/layer3/load/7" in keys and "moe/bias_abs_max" in keys
    bad = []
    for key in keys:
        a, b = metrics[key], theirs[key]
        same = (math.isnan(a) and math.isnan(b)) or abs(a - b) <= TOL
        if not same:
            bad.append((key, a, b))
    assert not bad, (replay, i, bad)


def check_weights(want: dict, got: list[dict], replay: str) -> None:
    """The last mini-batch's gradients (from the ranks holding them) and the weights after it."""
    grads = {}
    for rank in got:
        grads |= rank["grads"]
    got = got[0]
    assert grads.keys() == want["grads"].keys(), replay
    for name, g in grads.items():
        assert (g - want["grads"][name]).abs().max().item() <= TOL, (replay, name)
    assert all(k in got["weights"] for k in want["weights"]), replay
    bias = [k for k in want["weights"] if k.endswith("expert_bias")]
    assert len(bias) == 4 and all(want["weights"][k].abs().max() > 0 for k in bias)
    for name, w in want["weights"].items():
        assert (got["weights"][name] - w).abs().max().item() <= TOL, (replay, name)


def check_checkpoint(weights: dict, path: Path) -> None:
    """The pipelined checkpoint's transformers directory keeps the expert biases."""
    from safetensors import safe_open

    saved = {}
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            names = [k for k in f.keys() if k.endswith("expert_bias")]  # noqa: SIM118
            saved |= {k: f.get_tensor(k) for k in names}
    bias = {k: w for k, w in weights.items() if k.endswith("expert_bias")}
    assert saved.keys() == bias.keys()
    assert all((saved[k] - w).abs().max() <= TOL for k, w in bias.items())


def test_every_pipeline_rank_needs_a_router():
    """Each rank's MoE runtime takes part in the step's collectives: a cut that leaves a rank only
    dense layers is refused when the pipeline is built."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from hybridrl.learner.pipeline_actor import check_routers_per_rank
    from hybridrl.models.factory import MOE_SIZES
    from hybridrl.parallel.pipeline import PipeLayout

    def model(dense: list[int]):
        config = Qwen3MoeConfig(
            vocab_size=32, **(MOE_SIZES["tiny_moe"] | {"mlp_only_layers": dense})
        )
        return Qwen3MoeForCausalLM(config)

    layout = PipeLayout(pp=2, dp=1, rank=0, schedule="1f1b")
    check_routers_per_rank(model([0]), layout)
    with pytest.raises(ValueError, match="pipeline rank 0 would hold decoder layers"):
        check_routers_per_rank(model([0, 1]), layout)


@pytest.mark.slow  # the four-rank test below runs R3 through the pipeline in the default set
def test_pipelined_moe_update_equals_one_process_r3(tmp_path):
    run(tmp_path, [("r3", "1f1b")])


@pytest.mark.distributed
@pytest.mark.parametrize("checkpointing", [False, True], ids=["", "activation_checkpointing"])
def test_expert_and_pipeline_parallelism_compose(tmp_path, checkpointing):
    """Four ranks: two replicas of two pipeline stages, each stage's experts split over the two
    replicas' ranks that hold it (``moe.ep_size=2``, FSDP2 over the replicas for the rest), R3,
    against one process over one step (two optimizer steps; the two-rank tests check the second
    step's routing drift). Micro-batches of one row make the replicas' micro-batches the single
    process's, so even the per-micro-batch auxiliary loss is the same loss; 16 rows in
    mini-batches of 8 give each replica rounds of four rows (as many rounds as the busier
    replica). The sharded checkpoint loads back on the same layout with equal weights. With
    activation checkpointing on the four ranks, each layer the backward recomputes routes as its
    forward did, exchanging its tokens with the other replica again, and counts nothing twice."""
    run(tmp_path, [("r3", "1f1b")], world=4, ep=2, rows=16, per_mb=1, steps=1, ac=checkpointing)


@pytest.mark.slow
def test_pipelined_moe_update_equals_one_process_r2_and_two_stages_per_rank(tmp_path):
    """R2 with 1F1B and with DualPipeV (rank 0 holds the first and the last stage, split
    backward), R3 with interleaved 1F1B (each rank two stages of one layer)."""
    run(tmp_path, [("r2", "1f1b"), ("r2", "dualpipev"), ("r3", "interleaved_1f1b")])


if __name__ == "__main__" and sys.argv[1] == "rank":
    rank_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
