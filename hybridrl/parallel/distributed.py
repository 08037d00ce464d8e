"""The torch.distributed group of one worker group, from its :class:`WorkerContext`.

Every rank of a trained role (actor, critic, reference) runs in its own
process (the ``ray`` backend: one actor per rank; or any launcher that sets
``RANK``/``WORLD_SIZE``) and joins one process group: gloo when the rank has
no GPU, NCCL when it has one. World size 1 needs no group: every helper here
is then a no-op, so the single-process path costs nothing.

Several roles living in the same process with the same rank layout share the
group (reference counted); :func:`teardown_distributed` calls ``barrier()``
before ``destroy_process_group()`` (without it, exit crashes
about one run in five).
"""

from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

_users = 0  # workers of this process sharing the default group

# seconds a collective (or the rendezvous) waits for a missing peer before it raises, instead of
# torch's 30 minutes; HYBRIDRL_PG_TIMEOUT_S overrides it (the ray backend forwards it to every rank)
PG_TIMEOUT_ENV = "HYBRIDRL_PG_TIMEOUT_S"
DEFAULT_PG_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class DistEnv:
    """Where this rank runs: its rank/world size, its compute device and the backend of its
    group."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    backend: str | None = None  # None: no group (world size 1)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def compute_device() -> torch.device:
    """The one rule for a worker's device, used by every role (learner, reference, critic, rollout):
    the GPU this process was given, else the CPU. Ray sets ``CUDA_VISIBLE_DEVICES`` for an actor
    that reserved GPUs (``gpus_per_worker > 0``); one that reserved none gets the CPU even on a GPU
    node (Ray leaves the variable alone then, so the process would see every GPU). A launcher sets
    ``LOCAL_RANK``; one process on a GPU machine (the local controller) takes GPU 0."""
    if not torch.cuda.is_available() or _ray_actor_without_gpu():
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def _ray_actor_without_gpu() -> bool:
    """Whether this process is a Ray actor that reserved no GPU (Ray is only asked when this process
    has imported it)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return False
    try:
        if ray.get_runtime_context().get_actor_id() is None:  # the driver, not an actor
            return False
        return not ray.get_gpu_ids()
    except Exception:  # an unexpected Ray API: keep the CUDA rule
        return False


def pg_timeout_s() -> float:
    """The process-group timeout: ``HYBRIDRL_PG_TIMEOUT_S`` if set, else DEFAULT_PG_TIMEOUT_S."""
    raw = os.environ.get(PG_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_PG_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{PG_TIMEOUT_ENV}={raw!r}: expected a number of seconds > 0")
    return value


def init_distributed(ctx, timeout_s: float | None = None) -> DistEnv:
    """Join (or create) the group of ``ctx``'s worker group; world size 1: no group. Every
    collective of the group raises after ``timeout_s`` (default :func:`pg_timeout_s`) without its
    peers, so a dead or stuck peer cannot hold a barrier for torch's default 30 minutes.

    Raises when ranks of a group of world size > 1 share one process (the ``local`` backend builds
    every rank in the driver, one after another, so the first rendezvous would wait forever).
    """
    global _users
    device = compute_device()
    if ctx.world_size <= 1:
        return DistEnv(0, 1, device, None)
    env_rank, env_world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if env_rank != str(ctx.rank) or env_world != str(ctx.world_size):
        raise RuntimeError(
            f"role {ctx.role!r}: world size {ctx.world_size} needs one process per rank (backend "
            "'ray', or a launcher "
            f"setting RANK/WORLD_SIZE); this process has RANK={env_rank} WORLD_SIZE={env_world}. "
            "Use the ray backend or one worker for this role."
        )
    backend = "nccl" if device.type == "cuda" else "gloo"
    if dist.is_initialized():
        if dist.get_rank() != ctx.rank or dist.get_world_size() != ctx.world_size:
            raise RuntimeError(
                f"role {ctx.role!r} rank {ctx.rank}/{ctx.world_size}: this process already belongs "
                "to a "
                f"group as rank {dist.get_rank()}/{dist.get_world_size()}"
            )
        _users += 1
        return DistEnv(ctx.rank, ctx.world_size, device, dist.get_backend())
    addr = ctx.master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = ctx.master_port or int(os.environ["MASTER_PORT"])
    dist.init_process_group(
        backend,
        init_method=f"tcp://{addr}:{port}",
        rank=ctx.rank,
        world_size=ctx.world_size,
        timeout=datetime.timedelta(seconds=timeout_s or pg_timeout_s()),
        device_id=device if backend == "nccl" else None,
    )
    _users += 1
    return DistEnv(ctx.rank, ctx.world_size, device, backend)


def teardown_distributed() -> None:
    """Leave the group; the last user of this process destroys it (after a barrier).

    In a process that ran FSDP2 the group's C++ object outlives this call: FSDP2's autograd hooks
    form Python/C++ reference cycles that gc cannot break, and they hold the mesh and so the group.
    Its gloo threads then run into interpreter shutdown, which aborts about one exit in seven
    ("terminate called without an active exception"). Ray workers are killed, never exited; a
    process launched per rank should leave with ``os._exit`` once its results are written (as the
    tests' rank processes do)."""
    global _users
    if not dist.is_initialized():
        return
    _users = max(_users - 1, 0)
    if _users == 0:
        dist.barrier()
        dist.destroy_process_group()


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _device_of_group() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )


def all_reduce(values: list[float] | torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Float64 all-reduce (``sum`` or ``max``) of a small vector; a plain tensor when there is no
    group."""
    t = torch.as_tensor(values, dtype=torch.float64)
    if world_size() == 1:
        return t
    t = t.to(_device_of_group())
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t.cpu()


def all_gather_ints(value: int) -> list[int]:
    """Every rank's ``value`` in rank order."""
    if world_size() == 1:
        return [int(value)]
    t = torch.tensor([int(value)], dtype=torch.int64, device=_device_of_group())
    out = [torch.zeros_like(t) for _ in range(world_size())]
    dist.all_gather(out, t)
    return [int(x.item()) for x in out]


def all_gather_object(obj) -> list:
    if world_size() == 1:
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()
