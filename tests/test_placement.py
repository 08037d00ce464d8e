"""Placement: colocated roles taking turns (fused worker), and a two-simulated-node Ray cluster placing the
rollout pool on the second node with the weight sync going through the object store."""

import sys

import pytest
import ray
import torch

from hybridrl.config import Config, load_config
from hybridrl.controller import ResourcePool, WorkerGroup
from hybridrl.controller.colocated import RoleView
from hybridrl.rollout import SamplingParams
from hybridrl.trainers import weight_sync
from hybridrl.trainers.evaluate import prompt_batch
from hybridrl.trainers.roles import ROLE_CLASSES, build_roles
from hybridrl.training.distributed import pg_timeout_s
from hybridrl.workers.colocated import ColocatedWorker
from hybridrl.workers.common import load_tokenizer, make_task

IDS = torch.tensor([[1, 4, 5, 13, 6, 15, 7, 8]])


def small_cfg(*extra) -> Config:
    return load_config(
        Config, None, ["controller.num_threads=1", "rollout.max_new_tokens=4", *extra]
    )


def perturb(worker, scale: float) -> None:
    """Make the actor's weights differ from the rollout's (every rank: in-place on its shards)."""
    with torch.no_grad():
        for p in worker.model.parameters():
            p.mul_(scale)


def rollout_state(worker) -> tuple[dict, torch.Tensor | None]:
    """The rollout's live weights (and, for the hf backend, its logits on IDS)."""
    model = getattr(worker.engine, "model", None)
    if model is None:  # native: the runner's weights by transformers name
        return {n: t.clone() for n, t in worker.engine.engine.runner._targets.items()}, None
    with torch.no_grad():
        return {n: p.detach().clone() for n, p in model.named_parameters()}, model(IDS).logits


def node_of(worker) -> str:
    return ray.get_runtime_context().get_node_id()


def group_timeout(worker) -> float:
    return pg_timeout_s()


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def check_synced(
    full: dict, rollout_weights: dict, rollout_logits: torch.Tensor, cfg: Config
) -> None:
    from hybridrl.workers.common import load_model

    assert set(rollout_weights) <= set(full) | {"lm_head.weight"}
    for name, w in rollout_weights.items():
        assert torch.equal(w, full.get(name, full.get("model.embed_tokens.weight"))), name
    if rollout_logits is None:
        return
    model, _ = load_model(cfg, None)
    model.load_state_dict(full, strict=False)
    with torch.no_grad():
        torch.testing.assert_close(rollout_logits, model(IDS).logits, rtol=0, atol=1e-5)


def test_colocated_roles_take_turns_and_sync_in_memory():
    cfg = small_cfg("rollout.backend=native", "rollout.kv_cache_bytes=1048576")
    parts = {r: (ROLE_CLASSES[r], (cfg, None)) for r in ("actor", "rollout")}
    group = WorkerGroup(ColocatedWorker, ResourcePool(), role="actor+rollout", args=(parts,))
    actor, rollout = (
        RoleView(group, "actor", ROLE_CLASSES["actor"]),
        RoleView(group, "rollout", ROLE_CLASSES["rollout"]),
    )
    fused = group.workers[0]
    engine = fused.parts["rollout"].engine.engine
    assert fused.phase == "train"
    tok = load_tokenizer(cfg, None)
    prompts = prompt_batch([make_task(cfg).prompt(i) for i in range(2)], tok)
    samples = rollout.generate(prompts, SamplingParams(max_new_tokens=4, seed=0))
    assert fused.phase == "rollout" and not engine.released and len(samples[0]) == 2
    actor.apply_all(perturb, 1.01)  # a call into the actor: the KV pool is released while it trains
    assert fused.phase == "train" and engine.released and fused.moves == 2
    group.apply_all(weight_sync.sync_fused, 7)
    full = dict(actor.weight_buckets()[0][0])
    weights, logits = rollout.apply_all(rollout_state)[0]
    assert fused.parts["rollout"].engine.version == 7 and engine.released is False
    check_synced(full, weights, logits, cfg)


@pytest.fixture()
def two_node_cluster():
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"node0": 1}}
    )
    second = cluster.add_node(num_cpus=2, resources={"node1": 1})
    cluster.wait_for_nodes()
    yield cluster, second
    ray.shutdown()
    cluster.shutdown()


def test_two_node_cluster_puts_rollout_on_second_node(two_node_cluster):
    cluster, second = two_node_cluster
    cfg = small_cfg(
        "controller.backend=ray",
        f"controller.ray_address={cluster.address}",
        "controller.pools={train: {workers_per_node: 2, cpus_per_worker: 0.5}, gen: {workers_per_node: 1}}",
        "controller.placement={actor: train, reference: train, critic: train, rollout: gen, reward: gen}",
        "controller.pg_timeout_s=321",
    )
    # pin each pool to a node by a custom resource (PoolConfig.resources; ResourcePool reads it)
    cfg.controller.pools["train"].resources = {"node0": 0.01}
    cfg.controller.pools["gen"].resources = {"node1": 0.01}
    roles = build_roles(cfg, None, None)
    try:
        assert (
            isinstance(roles.rollout, RoleView) and roles.rollout.group is roles.reward.group
        )  # fused on "gen"
        assert roles.rollout.apply_all(node_of) == [second.node_id]
        assert set(roles.actor.apply_all(node_of)) == {cluster.head_node.node_id}
        assert roles.actor.apply_all(group_timeout) == [
            321.0,
            321.0,
        ]  # controller.pg_timeout_s reached both ranks
        roles.actor.apply_all(perturb, 1.01)
        roles.sync_weights(
            3
        )  # rank 0 -> object store on node 0 -> fetched by the rollout on node 1
        full = dict(b for bucket in roles.actor.weight_buckets()[0] for b in bucket)
        weights, logits = roles.rollout.apply_all(rollout_state)[0]
        check_synced(full, weights, logits, cfg)
        tok = load_tokenizer(cfg, None)
        prompts = prompt_batch([make_task(cfg).prompt(i) for i in range(2)], tok)
        samples = [
            s
            for part in roles.rollout.generate(prompts, SamplingParams(max_new_tokens=4, seed=0))
            for s in part
        ]
        assert len(samples) == 2 and all(set(s.versions) == {3} for s in samples)
    finally:
        roles.shutdown()


def test_pool_custom_resources_pin_bundles():
    pool = ResourcePool(resources={"node1": 0.01}, max_colocate=2)
    assert pool.bundle() == {"CPU": 1.0, "node1": 0.01}
    assert pool.actor_resources() == {
        "num_cpus": 0.5,
        "num_gpus": 0.0,
        "resources": {"node1": 0.005},
    }
    with pytest.raises(ValueError):
        ResourcePool(resources={"node1": 0})


def test_pack_roundtrip_any_dtype_and_shape():
    bucket = [
        ("a", torch.randn(3, 5)),
        ("b", torch.randn(7).to(torch.bfloat16)),
        ("s", torch.tensor(0.5)),
    ]
    out = list(weight_sync.unpack(weight_sync.pack(bucket)))
    assert [n for n, _ in out] == ["a", "b", "s"]
    assert all(
        t.dtype == u.dtype and t.shape == u.shape and torch.equal(t, u)
        for (_, t), (_, u) in zip(bucket, out)
    )


def test_shared_memory_staging_roundtrip():
    """The same-node path without Ray: actor rank 0 stages the buckets in /dev/shm, the rollout maps and loads."""
    import os

    cfg = small_cfg()
    ctx = dict(rank=0, world_size=1, pool="p")
    from hybridrl.controller import WorkerContext

    actor = ROLE_CLASSES["actor"](WorkerContext(role="actor", **ctx), cfg, None)
    rollout = ROLE_CLASSES["rollout"](WorkerContext(role="rollout", **ctx), cfg, None)
    perturb(actor, 1.01)
    path, meta = weight_sync.publish_shared(
        actor, bucket_bytes=1 << 16
    )  # many small buckets, one staging file
    assert os.path.exists(path) and weight_sync.load_shared(rollout, (path, meta), 5) > 0
    weights, logits = rollout_state(rollout)
    check_synced(dict(actor.model.named_parameters()), weights, logits, cfg)
    assert weight_sync.publish_shared(actor)[0] == path  # reused, not re-created
    weight_sync.release_stage()
    assert not os.path.exists(path)


def test_shared_memory_sync_rehomes_a_single_rank_actor(tmp_path):
    """One-node, separate-process path without Ray: the actor's weights move into the staging file once,
    later syncs copy nothing on the actor side, training and checkpoints keep working."""
    import torch

    from hybridrl.config import Config
    from hybridrl.controller import ResourcePool, WorkerGroup
    from hybridrl.trainers import weight_sync as ws
    from hybridrl.workers import ActorWorker, RolloutWorker

    if ws.SHM_DIR is None:
        pytest.skip("no /dev/shm")
    cfg = Config()
    actor = WorkerGroup(
        ActorWorker, ResourcePool(), role="actor", args=(cfg, None), num_threads=1
    ).workers[0]
    rollout = WorkerGroup(
        RolloutWorker, ResourcePool(), role="rollout", args=(cfg, None), num_threads=1
    ).workers[0]
    try:
        path, meta = ws.publish_shared(actor)
        first_ptr = next(actor.model.parameters()).data_ptr()
        with torch.no_grad():  # an in-place update, as the optimizer does
            for p in actor.model.parameters():
                p.add_(0.01)
        assert (
            ws.publish_shared(actor)[0] == path
            and next(actor.model.parameters()).data_ptr() == first_ptr
        )
        assert ws.load_shared(rollout, (path, meta), 3) > 0
        live = rollout.engine._weight_tensors()
        for name, p in actor.model.named_parameters():
            if name in live:
                assert torch.equal(live[name].reshape(p.shape), p), name
        actor.model.save_pretrained(
            tmp_path / "ckpt"
        )  # safetensors must not see one shared storage
        assert (tmp_path / "ckpt" / "model.safetensors").is_file()
    finally:
        ws.release_stage(actor)
    assert not any(
        p.data_ptr() == first_ptr for p in actor.model.parameters()
    )  # moved back out of the file
