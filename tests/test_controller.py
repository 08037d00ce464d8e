"""The single-controller layer under both backends: dispatch modes, placement,
colocation, errors. One Ray cluster for the whole module."""

from __future__ import annotations

import os
import sys
import time

os.environ["HF_HUB_OFFLINE"] = "1"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytest
import ray
import torch
from controller_workers import BrokenWorker, EchoWorker, ScoreWorker, ray_cluster  # noqa: F401 (fixture)

from hybridrl.controller import (
    Dispatch,
    ResourcePool,
    WorkerContext,
    WorkerError,
    WorkerGroup,
    register,
)
from hybridrl.controller.dispatch import collect, plan, registered_methods
from hybridrl.protocol import Batch


@pytest.fixture(scope="module")
def shared_pool():
    pool = ResourcePool("shared", workers_per_node=2, cpus_per_worker=1)
    yield pool
    pool.release()


@pytest.fixture(scope="module", params=["local", "ray"])
def group(request, shared_pool):
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
    env = {"HYBRIDRL_TEST_ENV": "yes"} if request.param == "ray" else None
    wg = WorkerGroup(
        EchoWorker, shared_pool, role="actor", backend=request.param, kwargs={"tag": "t"}, env=env
    )
    yield wg
    wg.shutdown()


def make_batch(n: int) -> Batch:
    return Batch(
        {"idx": torch.arange(n), "x": torch.arange(n) * 10}, {"name": [f"s{i}" for i in range(n)]}
    )


# --- pure parts ------------------------------------------------------------
def test_pool_world_size_and_validation():
    assert ResourcePool().world_size == 1
    assert ResourcePool("p", nodes=2, workers_per_node=4).world_size == 8
    assert ResourcePool(gpus_per_worker=1, max_colocate=4).actor_resources() == {
        "num_cpus": 0.25,
        "num_gpus": 0.25,
    }
    with pytest.raises(ValueError):
        ResourcePool(nodes=0)
    with pytest.raises(ValueError):
        ResourcePool(cpus_per_worker=0)


def test_register_marks_and_keeps_method_callable():
    methods = registered_methods(EchoWorker)
    assert methods["scale"] is Dispatch.DP_COMPUTE and methods["lead"] is Dispatch.RANK_ZERO
    assert (
        methods["history"] is Dispatch.ONE_TO_ALL and methods["reset"] is Dispatch.ONE_TO_ALL
    )  # register() / bare
    assert "plain" not in methods and "__init__" not in methods
    w = EchoWorker(WorkerContext(rank=0, world_size=1, role="r", pool="p"))
    assert w.scale(make_batch(3))["y"].tolist() == [0, 20, 40]
    with pytest.raises(ValueError):
        register("no_such_mode")


def test_plan_and_collect():
    calls = plan(Dispatch.DP_COMPUTE, 2, (make_batch(3), "extra"), {"k": 1})
    assert [(r, len(a[0]), a[1], kw) for r, a, kw in calls] == [
        (0, 2, "extra", {"k": 1}),
        (1, 1, "extra", {"k": 1}),
    ]
    assert plan(Dispatch.RANK_ZERO, 4, (1,), {}) == [(0, (1,), {})]
    with pytest.raises(TypeError, match="Batch"):
        plan(Dispatch.DP_COMPUTE, 2, ([1, 2],), {})
    assert collect(Dispatch.DP_COMPUTE, [1, 2]) == [1, 2]


# --- both backends ----------------------------------------------------------
def test_one_to_all(group):
    infos = group.info(x={"a": [1, 2]})  # under ray: put once, passed to both ranks by reference
    assert [i["rank"] for i in infos] == [0, 1]
    assert all(
        i["world_size"] == 2
        and i["role"] == "actor"
        and i["tag"] == "t"
        and i["x"] == {"a": [1, 2]}
        for i in infos
    )
    masters = {i["master"] for i in infos}
    assert (
        len(masters) == 1 and next(iter(masters))[0] == "127.0.0.1" and next(iter(masters))[1] > 0
    )
    if group.backend_name == "ray":
        assert len({i["pid"] for i in infos}) == 2 and os.getpid() not in {i["pid"] for i in infos}
        assert all(i["threads"] == 1 and i["test_env"] == "yes" for i in infos)
        port = str(infos[0]["master"][1])
        assert [i["env_master"] for i in infos] == [
            ("127.0.0.1", port, "0"),
            ("127.0.0.1", port, "1"),
        ]
    assert group.execute_all("plain") == ["plain 0", "plain 1"]
    assert group.execute_rank(1, "plain") == "plain 1"


def test_dp_compute_splits_and_concats(group):
    group.reset()
    batch = make_batch(5)
    out = group.scale(batch, factor=3)
    assert isinstance(out, Batch) and len(out) == 5
    assert out["y"].tolist() == [0, 30, 60, 90, 120]
    assert out["rank"] == [0, 0, 0, 1, 1]
    chunks = batch.chunk(2)
    seen = [h["seen_rows"] for h in group.history()]
    assert seen == [[chunks[0]["idx"].tolist()], [chunks[1]["idx"].tolist()]]
    assert group.count(batch) == [3, 2]  # non-Batch results come back as a list


def test_rank_zero(group):
    group.reset()
    assert group.lead() == 0
    assert [h["lead_calls"] for h in group.history()] == [1, 0]


def test_unregistered_method_is_not_proxied(group):
    assert "plain" not in group.methods and not hasattr(group, "plain")
    with pytest.raises(AttributeError, match="not marked with @register"):
        group.plain()


def test_worker_error_names_role_rank_method(group):
    with pytest.raises(
        WorkerError, match=r"role 'actor' rank 1 failed in boom\(\): ValueError: kaboom from rank 1"
    ) as info:
        group.boom(1)
    assert (info.value.role, info.value.rank, info.value.method) == ("actor", 1, "boom")
    assert group.boom(-1) == [0, 1]  # the group survives a failed call


@pytest.mark.parametrize("backend", ["local", "ray"])
def test_constructor_error(backend, request):
    if backend == "ray":
        request.getfixturevalue("ray_cluster")
    pool = ResourcePool("broken", workers_per_node=2, cpus_per_worker=0.5)
    try:
        with pytest.raises(
            WorkerError,
            match=r"role 'bad' rank 1 failed in BrokenWorker.__init__\(\): RuntimeError: cannot build",
        ):
            WorkerGroup(BrokenWorker, pool, role="bad", backend=backend)
    finally:
        pool.release()


# --- ray only ------------------------------------------------------------------
@pytest.mark.parametrize("group", ["ray"], indirect=True)
def test_colocated_roles_share_bundles(shared_pool, group):
    with WorkerGroup(ScoreWorker, shared_pool, role="reward", backend="ray") as reward:
        assert reward.contexts[0].master_port != group.contexts[0].master_port  # one port per group
        out = reward.score(make_batch(4))
        assert out["score"].tolist() == [0.5, 10.5, 20.5, 30.5]
        placements = group.placement() + reward.placement()
        assert len({pg for pg, _ in placements}) == 1  # one placement group ...
        pg = placements[0][0]
        # ... and rank r of both groups sits in bundle r: each bundle lost two 1/8 CPU shares
        expect = {f"CPU_group_{b}_{pg}": 0.75 for b in range(2)}
        for _ in range(200):  # Ray reports freed shares a little late on a loaded machine
            free = {k: v for k, v in ray.available_resources().items() if k in expect}
            if free == expect:
                break
            time.sleep(0.1)
        assert free == expect
