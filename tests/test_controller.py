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
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridrl.controller import (
    Dispatch,
    ResourcePool,
    Worker,
    WorkerContext,
    WorkerError,
    WorkerGroup,
    register,
)
from hybridrl.controller.dispatch import combine, plan, registered_methods
from hybridrl.protocol import Batch

# the Ray backend: worker processes of their own (make test-distributed)
RAY = pytest.param("ray", marks=pytest.mark.distributed)


@pytest.fixture(scope="module")
def shared_pool():
    pool = ResourcePool("shared", workers_per_node=2, cpus_per_worker=1)
    yield pool
    pool.release()


@pytest.fixture(scope="module", params=["local", RAY])
def group(request, shared_pool):
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
    env = {"HYBRIDRL_TEST_ENV": "yes"} if request.param == "ray" else None
    wg = WorkerGroup(
        EchoWorker, shared_pool, role="actor", backend=request.param, kwargs={"tag": "t"}, env=env
    )
    yield wg
    wg.shutdown()


class ListWorker(Worker):
    """The list and ALL_FIRST dispatch modes through a real group (shipped to Ray by value, as
    ``controller_workers``' classes are)."""

    def __init__(self, ctx: WorkerContext):
        super().__init__(ctx)
        self.calls: list[tuple] = []

    @register(Dispatch.DP_COMPUTE)
    def tag(self, items: list, suffix: str = "") -> list:
        self.calls.append(("tag", list(items)))
        return [f"{x}{suffix}@{self.rank}" for x in items]

    @register(Dispatch.ALL_FIRST)
    def step(self, items: list) -> dict:
        self.calls.append(("step", list(items)))
        return {"rank": self.rank, "n": len(items)}

    @register(Dispatch.ONE_TO_ALL)
    def seen(self) -> list[tuple]:
        return self.calls


@pytest.fixture(scope="module", params=["local", RAY])
def list_group(request, shared_pool):
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    wg = WorkerGroup(ListWorker, shared_pool, role="lists", backend=request.param)
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


def test_plan_and_combine():
    calls = plan(Dispatch.DP_COMPUTE, 2, (make_batch(3), "extra"), {"k": 1})
    assert [(r, len(a[0]), a[1], kw) for r, a, kw in calls] == [
        (0, 2, "extra", {"k": 1}),
        (1, 1, "extra", {"k": 1}),
    ]
    assert plan(Dispatch.RANK_ZERO, 4, (1,), {}) == [(0, (1,), {})]
    assert combine(Dispatch.DP_COMPUTE, [1, 2]) == [1, 2]


@pytest.mark.parametrize("first", [(1, 2), {"a": 1}, 3, "rows", None, torch.arange(4)])
def test_dp_compute_refuses_a_first_argument_that_is_neither_a_batch_nor_a_list(first):
    with pytest.raises(TypeError, match=f"Batch or a list.*got {type(first).__name__}"):
        plan(Dispatch.DP_COMPUTE, 2, (first, [1, 2]), {})  # a list later on does not count
    with pytest.raises(TypeError, match="got nothing"):
        plan(Dispatch.DP_COMPUTE, 2, (), {"rows": [1, 2]})


def test_plan_and_combine_split_a_list_as_they_split_a_batch():
    items = [f"s{i}" for i in range(7)]
    calls = plan(Dispatch.DP_COMPUTE, 3, (items, "extra"), {"k": 1})
    assert calls == [
        (0, (["s0", "s1", "s2"], "extra"), {"k": 1}),
        (1, (["s3", "s4"], "extra"), {"k": 1}),
        (2, (["s5", "s6"], "extra"), {"k": 1}),
    ]
    assert [len(a[0]) for _, a, _ in calls] == [len(c) for c in make_batch(7).chunk(3)]
    # fewer items than ranks: the last ranks get empty lists (every rank still runs)
    assert [a[0] for _, a, _ in plan(Dispatch.DP_COMPUTE, 3, ([1],), {})] == [[1], [], []]
    assert [a[0] for _, a, _ in plan(Dispatch.DP_COMPUTE, 2, ([],), {})] == [[], []]
    # the per-rank lists come back as one list in rank order; other results as a list of them
    assert combine(Dispatch.DP_COMPUTE, [["s0", "s1"], [], ["s2"]]) == ["s0", "s1", "s2"]
    assert combine(Dispatch.DP_COMPUTE, [[1], 2]) == [[1], 2]


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 30), world=st.integers(1, 8))
def test_prop_list_chunks_concat_to_the_list(n, world):
    items = list(range(n))
    calls = plan(Dispatch.DP_COMPUTE, world, (items,), {})
    parts = [a[0] for _, a, _ in calls]
    assert [r for r, _, _ in calls] == list(range(world))
    assert [len(p) for p in parts] == [len(c) for c in make_batch(n).chunk(world)]
    assert combine(Dispatch.DP_COMPUTE, parts) == items
    assert all(p is not items for p in parts)  # each rank gets its own list


def test_plan_and_combine_all_first():
    args, kwargs = (make_batch(2), "x"), {"k": 1}
    calls = plan(Dispatch.ALL_FIRST, 3, args, kwargs)
    assert calls == [(r, args, kwargs) for r in range(3)]
    assert all(a[0] is args[0] for _, a, _ in calls)  # the whole argument, not a chunk
    assert combine(Dispatch.ALL_FIRST, [{"rank": 0}, {"rank": 1}, {"rank": 2}]) == {"rank": 0}
    assert combine(Dispatch.ALL_FIRST, [[1, 2], [3]]) == [1, 2]  # a list result is not merged


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


def test_dp_compute_splits_a_list_over_the_ranks_and_joins_the_results(list_group):
    items = [f"s{i}" for i in range(5)]
    out = list_group.tag(items, suffix="!")
    assert out == ["s0!@0", "s1!@0", "s2!@0", "s3!@1", "s4!@1"]
    assert [calls[-1] for calls in list_group.seen()] == [
        ("tag", ["s0", "s1", "s2"]),
        ("tag", ["s3", "s4"]),
    ]
    assert list_group.tag(["only"]) == ["only@0"]  # rank 1 got an empty list and returned one
    assert [calls[-1] for calls in list_group.seen()] == [("tag", ["only"]), ("tag", [])]


def test_all_first_runs_on_every_rank_and_returns_rank_zeros_result(list_group):
    items = [f"s{i}" for i in range(5)]
    assert list_group.step(items) == {"rank": 0, "n": 5}
    assert [calls[-1] for calls in list_group.seen()] == [("step", items), ("step", items)]


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


@pytest.mark.parametrize("backend", ["local", RAY])
def test_constructor_error(backend, request):
    if backend == "ray":
        request.getfixturevalue("ray_cluster")
    pool = ResourcePool("broken", workers_per_node=2, cpus_per_worker=0.5)
    try:
        with pytest.raises(
            WorkerError,
            match=(
                r"role 'bad' rank 1 failed in BrokenWorker.__init__\(\): "
                r"RuntimeError: cannot build"
            ),
        ):
            WorkerGroup(BrokenWorker, pool, role="bad", backend=backend)
    finally:
        pool.release()


# --- ray only ------------------------------------------------------------------
@pytest.mark.distributed
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
