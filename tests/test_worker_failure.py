"""A rank that dies, a close that fails, a peer that never joins: real Ray actors in real
2-rank gloo groups. The driver must name the rank that died (not the peer that lost its
connection), must not wait on survivors, and must tear every group down whatever failed. One
Ray cluster for the module."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

os.environ["HF_HUB_OFFLINE"] = "1"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytest
import ray
from controller_workers import (  # noqa: F401 (fixture)
    CloseCountWorker,
    CloseFailsWorker,
    GlooWorker,
    ray_cluster,
)
from ray.util import placement_group_table

from hybridrl.controller import ResourcePool, WorkerDiedError, WorkerError, WorkerGroup
from hybridrl.controller.ray_deaths import exit_cause
from hybridrl.driver.placement import Roles


def actor_dead(actor) -> bool:
    """Ray answers a call into the actor with an actor error (killed, or its process gone)."""
    try:
        ray.get(actor.locate.remote(), timeout=60)
    except ray.exceptions.RayActorError:
        return True
    return False


def process_gone(pid: int, timeout_s: float = 20.0) -> bool:
    """The OS process has exited (or is a zombie awaiting its parent)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/status") as f:
                if any(line.startswith("State:") and "Z" in line.split()[1] for line in f):
                    return True
        except (FileNotFoundError, ProcessLookupError):  # gone before the open, or mid-read
            return True
        time.sleep(0.1)
    return False


def kill_later(pid: int, after_s: float) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(after_s), os.kill(pid, signal.SIGKILL)))
    thread.start()
    return thread


def make_roles(
    train: ResourcePool,
    gen: ResourcePool,
    learner_cls=GlooWorker,
    rollout_cls=GlooWorker,
    backend: str = "ray",
) -> Roles:
    """The learner: a group on ``train``; the rollout: a group on ``gen`` (each its own gloo group
    for GlooWorker, as many ranks as its pool has slots)."""
    groups = []
    try:
        for cls, pool, role in ((learner_cls, train, "learner"), (rollout_cls, gen, "rollout")):
            groups.append(WorkerGroup(cls, pool, role=role, backend=backend))
    except BaseException:
        for group in groups:
            group.shutdown()
        raise
    learner, rollout = groups
    return Roles(learner=learner, rollout=rollout, groups=groups, pools=[train, gen])


@pytest.mark.distributed
@pytest.mark.usefixtures("ray_cluster")
def test_dead_rank_is_named_and_every_group_is_shut_down():
    """SIGKILL rank 1 of the learner group while rank 0 waits for it in an all-reduce: rank 0 fails
    with gloo's "Connection closed by peer", but the error names rank 1 and its death. Then
    shutdown: the learner's close fails (rank 1 is dead), the rollout group still closes, every
    actor and placement group goes, and only then does the close's error come out."""
    train = ResourcePool("train", workers_per_node=2, cpus_per_worker=0.5)
    gen = ResourcePool("gen", workers_per_node=2, cpus_per_worker=0.5)
    roles = make_roles(train, gen)
    try:
        assert roles.learner.total(1.0) == [2.0, 2.0]
        assert roles.rollout.total(1.0) == [2.0, 2.0]  # a gloo group of its own
        pids = roles.learner.pid()
        others = [a for g in roles.groups[1:] for a in g.workers]
        other_pids = roles.rollout.pid()
        pgs = list(train._placement_groups) + list(gen._placement_groups)
        killer = kill_later(pids[1], after_s=2.0)
        with pytest.raises(WorkerDiedError) as info:
            roles.learner.total(1.0, late_rank=1, delay_s=60.0)
        killer.join()
    except BaseException:
        roles.shutdown()
        raise
    err = info.value
    head, detail = str(err).split("\n", 1)
    assert (err.role, err.rank, err.method) == ("learner", 1, "total")
    assert head.startswith(f"worker role 'learner' rank 1 died in total() (pid {pids[1]} on node ")
    assert "node id " in head and "killed by a signal" in head and "Connection closed" not in head
    # rank 0's own failure, if it reached the driver first, is told as a consequence of the death
    assert (
        "rank 0 failed too, most likely because its peer died" in detail
        or "rank 0: not awaited" in detail
    )
    with pytest.raises(
        WorkerDiedError, match=r"rank 1 died in total\(\)[^\n]*\n.*this one: pid\(\)"
    ):
        roles.learner.pid()  # the broken group takes no more calls
    with pytest.raises(WorkerDiedError, match="rank 1 died") as shut:
        roles.shutdown()
    # the rollout's close (a barrier) went through
    assert "rollout" not in " ".join(getattr(shut.value, "__notes__", []))
    assert all(actor_dead(a) for a in others)
    assert all(process_gone(pid) for pid in other_pids + [pids[0]])
    assert {placement_group_table(pg)["state"] for pg in pgs} == {"REMOVED"}


@pytest.mark.distributed
@pytest.mark.usefixtures("ray_cluster")
def test_busy_survivor_is_not_awaited(monkeypatch):
    """Rank 1 dies in the all-reduce while rank 0 is busy for a minute: the driver reports the death
    at once instead of awaiting rank 0, and shutdown kills the busy survivor. The group's timeout
    set in the driver (HYBRIDRL_PG_TIMEOUT_S) reaches its ranks."""
    monkeypatch.setenv("HYBRIDRL_PG_TIMEOUT_S", "45")
    pool = ResourcePool("busy", workers_per_node=2, cpus_per_worker=0.5)
    try:
        group = WorkerGroup(GlooWorker, pool, role="learner", backend="ray")
        try:
            assert group.timeout_s() == [45.0, 45.0]
            pids = group.pid()
            killer = kill_later(pids[1], after_s=2.0)
            start = time.monotonic()
            with pytest.raises(
                WorkerDiedError, match=r"^worker role 'learner' rank 1 died in total\(\)"
            ) as info:
                group.total(1.0, late_rank=0, delay_s=60.0)
            assert time.monotonic() - start < 30.0
            assert "rank 0: not awaited" in str(info.value)
            killer.join()
        finally:
            group.shutdown()
        assert process_gone(pids[0])
    finally:
        pool.release()


@pytest.mark.distributed
@pytest.mark.usefixtures("ray_cluster")
def test_a_call_past_its_timeout_kills_the_group():
    """``set_call_timeout``: rank 1 sleeps past the bound while rank 0 waits for it in the
    all-reduce; the call fails after the bound (not after the sleep) naming the lowest waiting rank,
    the config key and what the heartbeats said, every actor of the group is killed, and the group
    refuses later calls with the same error. Other methods are not bounded."""
    from hybridrl.controller.health import CallTimeoutError, heartbeats

    pool = ResourcePool("slow", workers_per_node=2, cpus_per_worker=0.5)
    try:
        group = WorkerGroup(GlooWorker, pool, role="learner", backend="ray")
        try:
            # the heartbeat answers from its own thread, even while the rank is busy
            pending = group._backend.submit("total", [(r, (1.0, 1, 3.0), {}) for r in (0, 1)])
            assert heartbeats(ray, dict(enumerate(group.workers)), wait_s=2.0) == {0: {}, 1: {}}
            assert group._backend.gather("total", pending) == [2.0, 2.0]
            group.set_call_timeout("learner.total", 2.0, "test.timeout_s")
            assert group.pid() == group.pid()  # unbounded method
            start = time.monotonic()
            with pytest.raises(CallTimeoutError) as info:
                group.total(1.0, late_rank=1, delay_s=60.0)
            assert time.monotonic() - start < 20.0
            assert str(info.value) == (
                "worker role 'learner' rank 0 failed in total(): exceeded test.timeout_s=2 s "
                "(it reports no progress; rank 1: it reports no progress); its workers were killed"
            )
            assert all(actor_dead(a) for a in group.workers)
            with pytest.raises(CallTimeoutError, match=r"(?s)exceeded.*this one: pid\(\)"):
                group.pid()
        finally:
            group.shutdown()
    finally:
        pool.release()


def test_shutdown_closes_every_role_past_a_failing_close_local():
    """Local backend: the roles after the failing one are still closed and their groups stopped."""
    roles = make_roles(
        ResourcePool("t", workers_per_node=2),
        ResourcePool("g", workers_per_node=2),
        CloseFailsWorker,
        CloseCountWorker,
        "local",
    )
    rollout = roles.rollout.workers
    with pytest.raises(WorkerError, match="close failed on purpose"):
        roles.shutdown()
    assert [w.closed for w in rollout] == [1, 1]
    assert all(group.workers == [] for group in roles.groups)


@pytest.mark.distributed
def test_process_group_timeout_bounds_a_missing_peer(monkeypatch):
    """Rank 0 of a 2-rank group whose rank 1 never comes: HYBRIDRL_PG_TIMEOUT_S bounds the wait (the
    same timeout bounds every collective of the group), not torch's default 30 minutes."""
    import torch.distributed as dist

    from hybridrl.controller import WorkerContext
    from hybridrl.controller.worker import find_free_port
    from hybridrl.parallel.distributed import init_distributed

    monkeypatch.setenv("HYBRIDRL_PG_TIMEOUT_S", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    ctx = WorkerContext(
        rank=0, world_size=2, role="learner", pool="p", master_port=find_free_port("127.0.0.1")
    )
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="[Tt]imed out"):
        init_distributed(ctx)
    assert time.monotonic() - start < 20.0 and not dist.is_initialized()
    monkeypatch.setenv("HYBRIDRL_PG_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="HYBRIDRL_PG_TIMEOUT_S='soon'"):
        init_distributed(ctx)


def test_exit_cause_in_plain_words():
    sigkill = (
        "The actor died unexpectedly before finishing this task.\n"
        "\tclass_name: _WorkerHost\n\tpid: 7\n"
        "The actor is dead because its worker process has died. "
        "Worker exit type: SYSTEM_ERROR Worker exit detail: "
        "Worker unexpectedly exits with a connection error code 2. End of file. "
        "Some common causes include: ..."
    )
    assert exit_cause(sigkill) == (
        "its process vanished (killed by a signal such as SIGKILL or the OOM killer, or crashed) "
        "[Ray: SYSTEM_ERROR: Worker unexpectedly exits with a connection error code 2. "
        "End of file.]"
    )
    assert exit_cause("The actor is dead because its node has died. Node Id: ab").startswith(
        "its node was lost"
    )
    assert exit_cause("Task was killed due to the node running low on memory.").startswith(
        "out of memory"
    )
