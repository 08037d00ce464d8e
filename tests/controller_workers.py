"""Worker classes for tests/test_controller.py and tests/test_worker_failure.py (a module of
their own so Ray can ship them to its worker processes by value), and the Ray cluster fixture
those two and tests/test_weight_transport.py use."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from hybridrl.controller import Dispatch, Worker, WorkerContext, register
from hybridrl.protocol import Batch


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster for one test module; this module's classes are shipped by value (they
    live outside any installed package)."""
    import ray

    from hybridrl.controller import init_ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    init_ray(num_cpus=4)
    yield
    ray.shutdown()


def placement() -> tuple:
    """(placement group id, assigned resources) of the calling Ray actor."""
    import ray

    rt = ray.get_runtime_context()
    return rt.get_placement_group_id(), rt.get_assigned_resources()


class EchoWorker(Worker):
    def __init__(self, ctx: WorkerContext, tag: str = "echo"):
        super().__init__(ctx)
        self.tag = tag
        self.seen_rows: list[list[int]] = []
        self.lead_calls = 0

    @register(Dispatch.ONE_TO_ALL)
    def info(self, x=None) -> dict:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "role": self.role,
            "tag": self.tag,
            "x": x,
            "pid": os.getpid(),
            "threads": torch.get_num_threads(),
            "master": (self.ctx.master_addr, self.ctx.master_port),
            "env_master": (
                os.environ.get("MASTER_ADDR"),
                os.environ.get("MASTER_PORT"),
                os.environ.get("RANK"),
            ),
            "test_env": os.environ.get("HYBRIDRL_TEST_ENV"),
        }

    @register(Dispatch.DP_COMPUTE)
    def scale(self, batch: Batch, factor: int = 2) -> Batch:
        self.seen_rows.append(batch["idx"].tolist())
        return Batch({"y": batch["x"] * factor}, {"rank": [self.rank] * len(batch)})

    @register(Dispatch.DP_COMPUTE)
    def count(self, batch: Batch) -> int:
        return len(batch)

    @register(Dispatch.RANK_ZERO)
    def lead(self) -> int:
        self.lead_calls += 1
        return self.rank

    @register()
    def history(self) -> dict:
        return {"seen_rows": self.seen_rows, "lead_calls": self.lead_calls}

    @register
    def reset(self) -> None:
        self.seen_rows, self.lead_calls = [], 0

    @register(Dispatch.ONE_TO_ALL)
    def boom(self, fail_rank: int) -> int:
        if self.rank == fail_rank:
            raise ValueError(f"kaboom from rank {self.rank}")
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def placement(self) -> tuple:
        return placement()

    def plain(self) -> str:
        return f"plain {self.rank}"


class ScoreWorker(Worker):
    """A second role, for colocation."""

    @register(Dispatch.DP_COMPUTE)
    def score(self, batch: Batch) -> Batch:
        return Batch({"score": batch["x"].float() + 0.5})

    @register(Dispatch.ONE_TO_ALL)
    def placement(self) -> tuple:
        return placement()


class BrokenWorker(Worker):
    def __init__(self, ctx: WorkerContext):
        super().__init__(ctx)
        if ctx.rank == 1:
            raise RuntimeError("cannot build rank 1")


class GlooWorker(Worker):
    """A rank of a real torch.distributed (gloo) group, for the worker-failure tests."""

    def __init__(self, ctx: WorkerContext):
        super().__init__(ctx)
        from hybridrl.parallel.distributed import init_distributed

        self.dist = init_distributed(ctx)

    @register(Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()

    @register(Dispatch.ONE_TO_ALL)
    def timeout_s(self) -> float:
        """The process-group timeout this rank's group was built with."""
        from hybridrl.parallel.distributed import pg_timeout_s

        return pg_timeout_s()

    @register(Dispatch.ONE_TO_ALL)
    def total(
        self, value: float, late_rank: int = -1, delay_s: float = 0.0, skip_rank: int = -1
    ) -> float:
        """All-reduce ``value`` over the group; ``late_rank`` sleeps ``delay_s`` first,
        ``skip_rank`` never joins."""
        import time

        from hybridrl.parallel.distributed import all_reduce

        if self.rank == late_rank:
            time.sleep(delay_s)
        if self.rank == skip_rank:
            return value
        return float(all_reduce([value])[0])

    @register(Dispatch.ONE_TO_ALL)
    def close(self) -> None:
        from hybridrl.parallel.distributed import teardown_distributed

        teardown_distributed()


class CloseFailsWorker(Worker):
    """A role whose ``close`` raises on rank 0 (the shutdown test)."""

    @register(Dispatch.ONE_TO_ALL)
    def close(self) -> None:
        if self.rank == 0:
            raise RuntimeError("close failed on purpose")


class CloseCountWorker(Worker):
    """A role that counts its ``close`` calls (local backend: the test reads the worker objects)."""

    def __init__(self, ctx: WorkerContext):
        super().__init__(ctx)
        self.closed = 0

    @register(Dispatch.ONE_TO_ALL)
    def close(self) -> None:
        self.closed += 1
