"""Placement: the learner and the rollout colocated in one process taking turns (ColocatedWorker), a
two-simulated-node Ray cluster placing the rollout pool on the second node with the weight sync
going through the object store, and the one-node shared-memory sync between the real workers."""

import os
import sys

import pytest
import ray
import torch

from hybridrl.config import Config, load_config
from hybridrl.controller import ResourcePool, WorkerContext, WorkerGroup
from hybridrl.controller.colocated import ColocatedWorker, RoleView
from hybridrl.driver.placement import WORKER_CLASSES, Roles, build_roles
from hybridrl.learner.learner import Learner
from hybridrl.models.loading import load_tokenizer, make_task
from hybridrl.parallel import weight_sync
from hybridrl.parallel.distributed import pg_timeout_s
from hybridrl.protocol import prompt_sample
from hybridrl.rollout import SamplingParams
from hybridrl.rollout.worker import RolloutWorker

IDS = torch.tensor([[1, 4, 5, 13, 6, 15, 7, 8]])


def small_cfg(*extra) -> Config:
    return load_config(
        Config, None, ["controller.num_threads=1", "rollout.max_new_tokens=4", *extra]
    )


def perturb(worker, scale: float) -> None:
    """Make the learner's weights differ from the rollout's (every rank: in-place on its shards)."""
    with torch.no_grad():
        for p in worker.model.parameters():
            p.mul_(scale)


def rollout_state(worker) -> tuple[dict, torch.Tensor | None]:
    """The rollout's live weights (and, for the hf backend, its logits on IDS)."""
    model = getattr(worker.backend, "model", None)
    if model is None:  # native: the engine's weights by transformers name
        return {n: t.clone() for n, t in worker.backend.engine.named_weights().items()}, None
    with torch.no_grad():
        return {n: p.detach().clone() for n, p in model.named_parameters()}, model(IDS).logits


def node_of(worker) -> str:
    return ray.get_runtime_context().get_node_id()


def group_timeout(worker) -> float:
    return pg_timeout_s()


def prompts_of(cfg: Config, n: int) -> list:
    tok = load_tokenizer(cfg, None)
    return [prompt_sample(make_task(cfg).prompt(i), tok) for i in range(n)]


def all_weights(buckets: list[list]) -> dict[str, torch.Tensor]:
    return dict(item for bucket in buckets for item in bucket)


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def check_synced(
    full: dict, rollout_weights: dict, rollout_logits: torch.Tensor, cfg: Config
) -> None:
    from hybridrl.models.loading import load_model

    assert set(rollout_weights) <= set(full) | {"lm_head.weight"}
    for name, w in rollout_weights.items():
        assert torch.equal(w, full.get(name, full.get("model.embed_tokens.weight"))), name
    if rollout_logits is None:
        return
    model, _ = load_model(cfg, None)
    model.load_state_dict(full, strict=False)
    with torch.no_grad():
        torch.testing.assert_close(rollout_logits, model(IDS).logits, rtol=0, atol=1e-5)


def count_calls(part, counts: dict, role: str) -> None:
    """Wrap ``part``'s ``sleep`` and ``wake`` so that
    ``counts[(role, name)]`` counts their calls."""
    for name in ("sleep", "wake"):
        inner = getattr(part, name)

        def counted(inner=inner, key=(role, name)):
            counts[key] = counts.get(key, 0) + 1
            return inner()

        setattr(part, name, counted)


def test_colocated_roles_take_turns_and_sync_in_memory():
    cfg = small_cfg("rollout.backend=native", "rollout.backend_options.kv_cache_bytes=1048576")
    parts = {r: (WORKER_CLASSES[r], (cfg, None)) for r in ("learner", "rollout")}
    group = WorkerGroup(ColocatedWorker, ResourcePool(), role="learner+rollout", args=(parts,))
    learner, rollout = (
        RoleView(group, "learner", WORKER_CLASSES["learner"]),
        RoleView(group, "rollout", WORKER_CLASSES["rollout"]),
    )
    fused = group.workers[0]
    counts: dict = {}
    for role, part in fused.parts.items():
        count_calls(part, counts, role)
    engine = fused.parts["rollout"].backend.engine
    assert fused.turn is None and not engine.released
    samples = rollout.generate(prompts_of(cfg, 2), SamplingParams(max_new_tokens=4, seed=0))
    assert fused.turn == "rollout" and not engine.released
    assert len(samples) == 2 and all(s.reward is not None for s in samples)  # scored where made
    assert counts == {("learner", "sleep"): 1, ("rollout", "wake"): 1}
    # a call into the learner: the KV pool is released while it trains
    learner.apply_all(perturb, 1.01)
    assert fused.turn == "learner" and engine.released
    learner.weight_buckets()  # the learner has the device already: nobody sleeps or wakes
    assert counts == {
        ("learner", "sleep"): 1,
        ("learner", "wake"): 1,
        ("rollout", "sleep"): 1,
        ("rollout", "wake"): 1,
    }
    roles = Roles(learner=learner, rollout=rollout, groups=[group])
    assert roles.transport == "fused"  # one process: the weights are handed over in memory
    roles.sync_weights(7)
    full = all_weights(learner.weight_buckets()[0])
    weights, logits = rollout.apply_all(rollout_state)[0]
    assert fused.parts["rollout"].backend.version == 7
    check_synced(full, weights, logits, cfg)
    again = rollout.generate(prompts_of(cfg, 2), SamplingParams(max_new_tokens=4, seed=0))
    assert fused.turn == "rollout" and not engine.released  # woken for its turn
    assert all(set(s.versions) == {7} for s in again)
    assert counts[("rollout", "wake")] == 2 and counts[("learner", "sleep")] == 2


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


@pytest.mark.slow  # starts a two-node Ray cluster (~20 s)
def test_two_node_cluster_puts_rollout_on_second_node(two_node_cluster):
    cluster, second = two_node_cluster
    cfg = small_cfg(
        "controller.backend=ray",
        f"controller.ray_address={cluster.address}",
        "controller.pools={train: {workers_per_node: 2, cpus_per_worker: 0.5}, "
        "gen: {workers_per_node: 1}}",
        "controller.placement={learner: train, rollout: gen}",
        "controller.pg_timeout_s=321",
    )
    # pin each pool to a node by a custom resource (PoolConfig.resources; ResourcePool reads it)
    cfg.controller.pools["train"].resources = {"node0": 0.01}
    cfg.controller.pools["gen"].resources = {"node1": 0.01}
    roles = build_roles(cfg, None, None)
    try:
        # one role per pool: each has a WorkerGroup of its own (nothing to colocate)
        assert [g.role for g in roles.groups] == ["learner", "rollout"]
        assert roles.learner is roles.groups[0] and roles.rollout is roles.groups[1]
        assert roles.rollout.apply_all(node_of) == [second.node_id]
        assert set(roles.learner.apply_all(node_of)) == {cluster.head_node.node_id}
        # controller.pg_timeout_s reached both ranks
        assert roles.learner.apply_all(group_timeout) == [321.0, 321.0]
        assert roles.transport == "store"  # the rollout is on another node than learner rank 0
        roles.learner.apply_all(perturb, 1.01)
        # rank 0 -> object store on node 0 -> fetched by the rollout on node 1
        roles.sync_weights(3)
        full = all_weights(roles.learner.weight_buckets()[0])
        weights, logits = roles.rollout.apply_all(rollout_state)[0]
        check_synced(full, weights, logits, cfg)
        samples = roles.rollout.generate(
            prompts_of(cfg, 2), SamplingParams(max_new_tokens=4, seed=0)
        )
        assert len(samples) == 2 and all(set(s.versions) == {3} for s in samples)
        assert all(s.reward is not None for s in samples)  # scored on the second node
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


def local_workers(cfg: Config) -> tuple[Learner, RolloutWorker]:
    """A learner and a rollout worker of world size 1, built as the local backend builds them."""
    learner = WorkerGroup(
        Learner, ResourcePool(), role="learner", args=(cfg, None), num_threads=1
    ).workers[0]
    rollout = WorkerGroup(
        RolloutWorker, ResourcePool(), role="rollout", args=(cfg, None), num_threads=1
    ).workers[0]
    return learner, rollout


@pytest.mark.skipif(weight_sync.SHM_DIR is None, reason="no /dev/shm")
def test_shared_memory_staging_roundtrip():
    """The same-node path without Ray: learner rank 0 stages the buckets in /dev/shm, the rollout
    maps the file and loads; a later publish reuses the file, close removes it."""
    cfg = small_cfg()
    ctx = dict(rank=0, world_size=1, pool="p")
    learner = Learner(WorkerContext(role="learner", **ctx), cfg, None)
    rollout = RolloutWorker(WorkerContext(role="rollout", **ctx), cfg, None)
    perturb(learner, 1.01)
    # many small buckets, one staging file; the copying path (no re-homing)
    writer = weight_sync.ShmTransport(bucket_bytes=1 << 16, rehome=False)
    reader = weight_sync.ShmTransport()
    handle = writer.publish(learner, 5)
    assert os.path.exists(handle.path) and reader.load(rollout.backend, handle, 5) > 0
    assert rollout.backend.version == 5
    weights, logits = rollout_state(rollout)
    check_synced(dict(learner.model.named_parameters()), weights, logits, cfg)
    assert writer.publish(learner, 6).path == handle.path  # reused, not re-created
    reader.close()
    writer.close()
    assert not os.path.exists(handle.path)


@pytest.mark.skipif(weight_sync.SHM_DIR is None, reason="no /dev/shm")
def test_shared_memory_sync_rehomes_a_single_rank_actor(tmp_path):
    """One-node, separate-process path without Ray, through the workers' own transports
    (``publish_weights`` / ``load_weights``, as Roles.sync_weights calls them): the learner's
    weights move into the staging file once, later syncs copy nothing on the learner side,
    training and checkpoints keep working, and closing the learner moves them back out and
    removes the file."""
    learner, rollout = local_workers(Config())
    closed = False
    try:
        handle = learner.publish_weights("shm", 1)
        first_ptr = next(learner.model.parameters()).data_ptr()
        assert learner.transports["shm"].rehomed  # the parameters live in the file now
        with torch.no_grad():  # an in-place update, as the optimizer does
            for p in learner.model.parameters():
                p.add_(0.01)
        again = learner.publish_weights("shm", 3)
        assert (
            again.path == handle.path and next(learner.model.parameters()).data_ptr() == first_ptr
        )
        assert rollout.load_weights("shm", again, 3) > 0 and rollout.backend.version == 3
        live = rollout.backend._weight_tensors()
        for name, p in learner.model.named_parameters():
            if name in live:
                assert torch.equal(live[name].reshape(p.shape), p), name
        # safetensors must not see one shared storage
        learner.model.save_pretrained(tmp_path / "ckpt")
        assert (tmp_path / "ckpt" / "model.safetensors").is_file()
        rollout.close()
        learner.close()
        closed = True
        assert not os.path.exists(handle.path)
    finally:
        if not closed:
            for transport in [*learner.transports.values(), *rollout.transports.values()]:
                transport.close()
    # moved back out of the file
    assert not any(p.data_ptr() == first_ptr for p in learner.model.parameters())


def staging_path(worker) -> str | None:
    return worker.transports["shm"].path


@pytest.mark.slow  # ~20 s of Ray; the shm transport itself is tested in test_weight_transport.py
@pytest.mark.skipif(weight_sync.SHM_DIR is None, reason="no /dev/shm")
def test_one_node_ray_sync_goes_through_shared_memory_and_shutdown_removes_the_file():
    """Learner and rollout in their own Ray processes on one node: the sync goes through a staging
    file in /dev/shm, and shutting the roles down removes it (a file left there would hold the
    weights' bytes of every run until the machine restarts)."""
    cfg = small_cfg(
        "controller.backend=ray",
        "controller.pools={train: {cpus_per_worker: 0.5}, gen: {cpus_per_worker: 0.5}}",
        "controller.placement={learner: train, rollout: gen}",
    )
    roles = build_roles(cfg, None, None)
    path = None
    try:
        assert roles.transport == "shm"
        roles.learner.apply_all(perturb, 1.01)
        roles.sync_weights(2)
        path = roles.learner.apply_all(staging_path)[0]
        assert path is not None and os.path.exists(path)
        full = all_weights(roles.learner.weight_buckets()[0])
        weights, logits = roles.rollout.apply_all(rollout_state)[0]
        check_synced(full, weights, logits, cfg)
    finally:
        try:
            roles.shutdown()
        finally:
            ray.shutdown()
    assert not os.path.exists(path)


def test_former_placement_keys_are_refused_with_their_replacement():
    """actor, reference and critic are parts of the learner now, and the reward role is gone: a
    placement naming them fails at load time and says what to write instead."""
    for role, hint in (
        ("actor", "placement.learner"),
        ("reference", "placement.learner"),
        ("critic", "placement.learner"),
        ("reward", "drop placement.reward"),
    ):
        with pytest.raises(ValueError, match=hint):
            small_cfg(f"controller.placement={{learner: global, rollout: global, {role}: global}}")


def test_every_placed_role_has_a_worker_class():
    """The config's role names (controller.placement's keys) and the workers building them agree."""
    from hybridrl.config.schema import ROLES

    assert set(WORKER_CLASSES) == set(ROLES) and len(ROLES) == len(set(ROLES))
