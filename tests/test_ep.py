"""Expert parallelism (``moe.ep_size``, ``hybridrl/moe/ep.py``) on gloo ranks (CPU, fp32), with the
real Learner on ``tiny_moe``: EP 2 on 2 ranks gives the single process's log-probs (the policy's
and the reference's, whose experts are split too), loss, gradients of every parameter (experts
gathered) and updated weights within 1e-5; the experts are really split (each rank holds 4 of 8 per
layer) and tokens really cross ranks; weight sync returns full expert tensors by transformers
names; an EP 2 checkpoint loads at EP 1 (2 ranks and one process) with equal weights, and its
export and transformers copy hold them too; EP 2 with a LoRA actor (adapters on attention, experts
frozen and split) equals the single-process LoRA learner and its checkpoint reloads in one process;
a critic (GAE) on the EP 2 trunk equals the single-process critic after two updates; bad
``ep_size`` values fail at config time. The slow test runs 4 ranks: EP 4, and EP 2 with FSDP over
the other dimension and activation checkpointing (the recomputed forward exchanges its tokens
again), against the same single process, EP 4 with routing replay (R3) against the single process
replaying the same routing, and loads the 2-rank EP 2 checkpoint at EP 4 and EP 2 x FSDP 2.

The ranks are subprocesses running this file (``python tests/test_ep.py rank ...``), one torch
thread each.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from batches import prompt_response_batch
from rank_processes import launch_ranks, wait_ranks

from hybridrl.config import Config, ConfigError
from hybridrl.controller import WorkerContext
from hybridrl.protocol import Batch

TOL = 1e-5
ROWS = 8


def make_cfg(
    ep_size: int = 1, checkpointing: bool = False, lora: bool = False, critic: bool = False
) -> Config:
    cfg = Config()
    if critic:  # GAE: a value model on the MoE trunk, one mini-batch of a few micro-batches
        cfg.algorithm.advantage = "gae"
        cfg.critic.ppo_minibatch_size, cfg.critic.micro_batch_tokens = ROWS, 40
    if lora:  # adapters on the attention projections; the experts (fused tensors) stay frozen
        cfg.actor.lora_rank = 4
    cfg.model.name = "tiny_moe"
    cfg.algorithm.entropy_coef = 0.01
    cfg.actor.ppo_minibatch_size = ROWS  # one mini-batch: the gradients left are the step's
    cfg.actor.micro_batch_tokens = 40  # a few micro-batches per rank
    cfg.fsdp.mixed_precision = "fp32"
    cfg.moe.ep_size = ep_size
    cfg.fsdp.activation_checkpointing = checkpointing
    return cfg


def make_batch(learner, n: int = ROWS, prompt_len: int = 5, resp_len: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    vocab = learner.model.config.vocab_size
    batch = prompt_response_batch(g, vocab, n, prompt_len, resp_len)
    rmask = batch["response_mask"]
    old = learner.compute_log_prob(batch)["old_log_probs"]
    adv = torch.randn(n, 1, generator=g).expand(n, resp_len) * rmask
    return batch | Batch(
        {
            "old_log_probs": old,
            "ref_log_probs": (old + 0.05 * torch.randn(old.shape, generator=g)) * rmask,
            "advantages": adv.contiguous(),
            "rollout_log_probs": old,
            "returns": torch.randn(old.shape, generator=g) * rmask,  # for a critic
        }
    )


def with_replay(batch: Batch, seed: int = 1) -> Batch:
    """``batch`` with recorded routing (R3) for every other token (two distinct random experts of 8
    in each of the 4 layers), the others left to the router; every row replays."""
    from hybridrl.learner.moe import REPLAY, ROUTING

    g = torch.Generator().manual_seed(seed)
    shape = (*batch["input_ids"].shape, 4)
    ids = torch.rand((*shape, 8), generator=g).argsort(-1)[..., :2]
    ids[:, ::2] = -1
    return batch | Batch({ROUTING: ids.to(torch.int16), REPLAY: torch.ones(len(batch))})


def full_weights(learner) -> dict[str, torch.Tensor]:
    return {n: t.clone() for bucket in learner.weight_buckets(1 << 20) for n, t in bucket}


def full_grads(model) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, unsharded (a collective per sharded one)."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is None:  # frozen (LoRA's base weights)
            continue
        out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:5]
    return max((a[k] - b[k]).abs().max().item() for k in a)


def step(learner, part: Batch) -> dict:
    """Log-probs, then one update; what the comparison needs."""
    from hybridrl.moe.ep import traffic_metrics

    logp = learner.compute_log_prob(part)["old_log_probs"]
    ref_logp = learner.reference.log_probs(part, learner.actor.shuffle)[
        "ref_log_probs"
    ]  # the frozen initial policy
    metrics = learner.update_actor(part)
    return {
        "logp": logp,
        "ref_logp": ref_logp,
        "metrics": metrics,
        "grads": full_grads(learner.model),
        "weights": full_weights(learner),
        "traffic": traffic_metrics(learner.model),
    }


def critic_step(learner, part: Batch) -> dict:
    """The critic's values, two updates towards the batch's returns (the value head starts at zero,
    so only the second update's gradient reaches the trunk and its experts), the values after."""
    critic = learner.critic
    before = critic.values(part)["values"]
    data = part | Batch({"values": before})
    metrics = [critic.update(data) for _ in range(2)][-1]
    weights = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in critic.model.named_parameters()
    }
    grads = full_grads(critic.model)  # before the next forward: FSDP2's root forward drops them
    return {
        "after": critic.values(part)["values"],
        "metrics": metrics,
        "grads": grads,
        "weights": weights,
        "shapes": {
            tuple(p.to_local().shape) if hasattr(p, "to_local") else tuple(p.shape)
            for n, p in critic.model.named_parameters()
            if n.endswith("experts.gate_up_proj")
        },
    }


def expert_shapes(learner) -> set:
    """This rank's shapes of the policy's and the reference's ``gate_up_proj``."""
    return {
        tuple(p.to_local().shape) if hasattr(p, "to_local") else tuple(p.shape)
        for model in (learner.model, learner.reference.model)
        for n, p in model.named_parameters()
        if n.endswith("experts.gate_up_proj")
    }


# --- the ranks ------------------------------------------------------------------------------------
def rank_main(rank: int, port: int, workdir: str) -> None:
    from hybridrl.learner import Learner
    from hybridrl.parallel.distributed import teardown_distributed

    torch.set_num_threads(1)
    work = Path(workdir)
    world = int(__import__("os").environ["WORLD_SIZE"])
    batch = Batch(torch.load(work / "batch.pt", weights_only=True))
    part = batch.chunk(world)[rank]
    ctx = WorkerContext(
        rank=rank, world_size=world, role="learner", pool="p", master_port=port, num_threads=1
    )
    out: dict = {}
    workers = []
    sizes = (2,) if world == 2 else (4, 2)
    for ep in sizes:  # 4 ranks: EP 2 x FSDP 2 recomputes its layers in backward
        learner = Learner(ctx, make_cfg(ep, checkpointing=world == 4 and ep == 2), None)
        workers.append(learner)
        out[ep] = step(learner, part) | {"shapes": expert_shapes(learner)}
    if world == 4:  # routing replay (R3) in front of the exchange
        replayed = Learner(ctx, make_cfg(4), None)
        workers.append(replayed)
        out["r3"] = step(replayed, with_replay(batch).chunk(world)[rank])
    if world == 2:  # an EP 2 checkpoint, loaded at EP 1 on the same ranks
        trained = workers[0]
        trained.save_checkpoint(str(work / "ckpt"))
        plain = Learner(ctx, make_cfg(1), None)
        plain.load_state(str(work / "ckpt"))
        workers.append(plain)
        out["loaded_ep1"] = full_weights(plain)
        lora = Learner(ctx, make_cfg(2, lora=True), None)  # LoRA on the EP 2 model
        workers.append(lora)
        out["lora"] = step(lora, part) | {"shapes": expert_shapes(lora)}
        lora.save_checkpoint(str(work / "lora_ckpt"))
        critic = Learner(ctx, make_cfg(2, critic=True), None)  # a critic on the EP 2 trunk
        workers.append(critic)
        out["critic"] = critic_step(critic, part)
        critic.save_checkpoint(str(work / "critic_policy"), str(work / "critic_ckpt"))
    else:  # the 2-rank EP 2 checkpoint at EP 4 and at EP 2 x FSDP 2
        for ep in sizes:
            fresh = Learner(ctx, make_cfg(ep), None)
            fresh.load_state(str(work / "ckpt"))
            workers.append(fresh)
            out[f"loaded_ep{ep}"] = full_weights(fresh)
    for w in workers:
        w.close()
    teardown_distributed()
    if rank == 0:
        torch.save(out, work / f"ranks{world}.pt")


# --- the tests ------------------------------------------------------------------------------------
def single_process(batch: Batch | None = None, lora: bool = False, critic: bool = False):
    from hybridrl.learner import Learner

    ctx = WorkerContext(rank=0, world_size=1, role="learner", pool="p", num_threads=1)
    learner = Learner(ctx, make_cfg(lora=lora, critic=critic), None)
    return learner, (make_batch(learner) if batch is None else batch)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The 2 ranks (EP 2, then a checkpoint loaded at EP 1); the single process meanwhile."""
    work = tmp_path_factory.mktemp("ep")
    learner, batch = single_process()
    torch.save(batch.tensors, work / "batch.pt")
    procs = launch_ranks(__file__, 2, work)
    ref = step(learner, batch) | {"batch": batch}
    lora, _ = single_process(batch, lora=True)
    ref_lora = step(lora, batch) | {"batch": batch}
    ref_critic = critic_step(single_process(batch, critic=True)[0], batch)
    wait_ranks(procs, timeout=300)
    ranks = torch.load(work / "ranks2.pt", weights_only=False)
    return {
        "work": work,
        "ref": ref,
        "ref_lora": ref_lora,
        "ref_critic": ref_critic,
        "ranks": ranks,
    }


def check_equal(ref: dict, got: dict, world: int) -> None:
    n0 = len(ref["batch"].chunk(world)[0])  # rank 0's rows
    assert (got["logp"] - ref["logp"][:n0]).abs().max().item() <= TOL
    assert (got["ref_logp"] - ref["ref_logp"][:n0]).abs().max().item() <= TOL
    for k in ("actor/pg_loss", "actor/kl_ref", "actor/entropy", "actor/grad_norm"):
        assert got["metrics"][k] == pytest.approx(ref["metrics"][k], rel=1e-5, abs=1e-6), k
    assert max_diff(ref["grads"], got["grads"]) <= TOL
    # Adam's first step is about lr x sign(grad): the weights moved by about 1e-4 everywhere
    assert max_diff(ref["weights"], got["weights"]) <= TOL


@pytest.mark.distributed
def test_ep2_equals_single_process(runs):
    ref, got = runs["ref"], runs["ranks"][2]
    assert got["shapes"] == {(4, 512, 128)}  # 4 of the 8 experts per rank
    check_equal(ref, got, 2)
    # the experts' gradients are not trivially zero, and the step moved the weights
    experts = [k for k in ref["grads"] if "experts" in k]
    assert experts and min(ref["grads"][k].abs().max().item() for k in experts) > 1e-4
    traffic = got["traffic"]  # the step's exchanges, as the learner logs them
    assert traffic["perf/ep_rows_sent"] > 0 and traffic["perf/ep_rows_received"] > 0
    assert traffic["perf/ep_received_imbalance"] >= 0
    assert ref["traffic"] == {}  # no EP: no metrics, no collective


@pytest.mark.distributed
def test_weight_sync_sends_full_experts_by_transformers_name(runs):
    from hybridrl.models.factory import build_model
    from hybridrl.tasks import TASKS

    got = runs["ranks"][2]["weights"]
    plain = build_model("tiny_moe", TASKS.get("arith")(seed=0).tokenizer(), 0)
    names = {n: tuple(p.shape) for n, p in plain.named_parameters()}
    assert {n: tuple(t.shape) for n, t in got.items()} == names
    assert got["model.layers.0.mlp.experts.down_proj"].shape == (8, 128, 256)


@pytest.mark.distributed
def test_ep2_checkpoint_loads_at_ep1(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    from hybridrl.parallel.sharded_checkpoint import export_hf

    trained = runs["ranks"][2]["weights"]
    assert max_diff(trained, runs["ranks"]["loaded_ep1"]) == 0.0
    learner, _ = single_process(runs["ref"]["batch"])  # one process, no group
    learner.load_state(str(runs["work"] / "ckpt"))
    assert max_diff(trained, full_weights(learner)) == 0.0
    # the export reads the sharded checkpoint into a plain transformers model
    out = export_hf(runs["work"] / "ckpt", tmp_path / "hf")
    exported = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert max_diff(trained, dict(exported.named_parameters())) == 0.0
    # so does the transformers copy the checkpoint keeps next to its shards (for the rollout)
    kept = AutoModelForCausalLM.from_pretrained(runs["work"] / "ckpt", local_files_only=True)
    assert max_diff(trained, dict(kept.named_parameters())) == 0.0


@pytest.mark.distributed
def test_ep2_with_lora_equals_single_process_and_reloads_at_ep1(runs):
    ref, got = runs["ref_lora"], runs["ranks"]["lora"]
    assert got["shapes"] == {(4, 512, 128)}  # the frozen experts are split as without LoRA
    check_equal(ref, got, 2)
    # only the adapters learn (attention's; the experts stay frozen); B starts at zero, so at the
    # first step only the B matrices have a gradient, and each of them has one
    assert ref["grads"] and all("lora_" in k and "experts" not in k for k in ref["grads"])
    assert min(g.abs().max().item() for k, g in ref["grads"].items() if "lora_B" in k) > 0.0
    # the first weight sync sends the base too: the experts whole, gathered from the EP shards
    assert got["weights"]["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 512, 128)
    assert set(got["grads"]) == set(ref["grads"])
    # the LoRA checkpoint written at EP 2 reloads in one process: the same adapters and base
    learner, _ = single_process(runs["ref"]["batch"], lora=True)
    learner.load_state(str(runs["work"] / "lora_ckpt"))
    assert max_diff(got["weights"], full_weights(learner)) == 0.0


@pytest.mark.distributed
def test_critic_on_an_ep2_trunk_equals_single_process(runs):
    ref, got = runs["ref_critic"], runs["ranks"]["critic"]
    assert got["shapes"] == {(4, 512, 128)}  # the value model's experts are split too
    n0 = len(runs["ref"]["batch"].chunk(2)[0])
    assert (got["after"] - ref["after"][:n0]).abs().max().item() <= TOL
    assert ref["after"].abs().max().item() > 1e-3  # the updates moved the values
    for k in ("critic/vf_loss", "critic/grad_norm"):
        assert got["metrics"][k] == pytest.approx(ref["metrics"][k], rel=1e-5, abs=1e-6), k
    experts = [k for k in ref["grads"] if "experts" in k]
    assert experts and min(ref["grads"][k].abs().max().item() for k in experts) > 0.0
    assert max_diff(ref["grads"], got["grads"]) <= TOL
    assert max_diff(ref["weights"], got["weights"]) <= TOL
    # the critic saved at EP 2 reloads in one process with the same weights
    learner, _ = single_process(runs["ref"]["batch"], critic=True)
    learner.load_state(str(runs["work"] / "critic_policy"), str(runs["work"] / "critic_ckpt"))
    loaded = {n: p.detach() for n, p in learner.critic.model.named_parameters()}
    assert max_diff(got["weights"], loaded) == 0.0


@pytest.mark.slow
def test_four_ranks_ep4_and_ep2_with_fsdp(runs):
    work = runs["work"]
    procs = launch_ranks(__file__, 4, work)
    learner, _ = single_process(runs["ref"]["batch"])
    replayed = with_replay(runs["ref"]["batch"])
    ref_r3 = step(learner, replayed) | {"batch": replayed}
    wait_ranks(procs, timeout=600)
    got = torch.load(work / "ranks4.pt", weights_only=False)
    check_equal(ref_r3, got["r3"], 4)
    assert max_diff(ref_r3["weights"], runs["ref"]["weights"]) > 10 * TOL  # replay changed it
    assert got[4]["shapes"] == {(2, 512, 128)}
    assert got[2]["shapes"] == {(4, 256, 128)}  # 4 experts per EP rank, halved again by FSDP
    for ep in (4, 2):
        check_equal(runs["ref"], got[ep], 4)
    trained = runs["ranks"][2]["weights"]
    for ep in (4, 2):
        assert max_diff(trained, got[f"loaded_ep{ep}"]) == 0.0


def test_bad_ep_size_fails_at_config_time():
    """``moe.ep_size`` must divide the learner's data-parallel size (world size / actor.pp_size)
    and the experts per layer; expert and pipeline parallelism compose when it does."""
    from hybridrl.checks import check_moe
    from hybridrl.moe.ep import check_ep_size

    with pytest.raises(
        ValueError, match=r"ep_size=3 must divide the learner's data-parallel size 4"
    ):
        check_ep_size(3, 4, 8)
    with pytest.raises(ValueError, match=r"number of experts per layer 6 \(allowed .*: 1, 2\)"):
        check_ep_size(4, 4, 6)
    check_ep_size(2, 4, 8)
    cfg = make_cfg(2)  # the default learner pool has one worker
    with pytest.raises(ConfigError, match=r"moe.ep_size=2 must divide the learner's data-paral"):
        check_moe(cfg)
    cfg.controller.pools[cfg.controller.placement["learner"]].workers_per_node = 2
    check_moe(cfg)  # 2 learner ranks, 8 experts: fine
    cfg.actor.pp_size = 2  # one replica of two stages: nothing to split the experts over
    with pytest.raises(ConfigError, match=r"data-parallel size 1 \(world size / actor.pp_size"):
        check_moe(cfg)
    cfg.controller.pools[cfg.controller.placement["learner"]].workers_per_node = 4
    check_moe(cfg)  # two replicas of two stages, each stage's experts split over the replicas
    dense = make_cfg(1)
    dense.model.name = "tiny"
    dense.moe.ep_size = 2
    with pytest.raises(ConfigError, match="mixture-of-experts"):
        check_moe(dense)


if __name__ == "__main__" and sys.argv[1] == "rank":
    import os

    try:
        rank_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)  # FSDP2's reference cycles keep gloo threads alive (parallel/distributed.py)
