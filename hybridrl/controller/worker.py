"""The worker side: :class:`WorkerContext` (who am I in my group) and
:class:`Worker`, the base class of every role (actor, reference, rollout,
reward ...). The same class runs unchanged under the ``local`` and ``ray``
backends."""

from __future__ import annotations

import socket
from dataclasses import dataclass

import torch


@dataclass
class WorkerContext:
    """Identity of one rank of a WorkerGroup, given to the worker's constructor.

    ``master_addr``/``master_port`` are the rendezvous of the group's own
    torch.distributed group (same for all its ranks; every group gets its own
    port). ``seed`` is the group's seed; derive per-rank seeds from it
    (e.g. ``seed + rank``) where ranks must differ.
    """

    rank: int
    world_size: int
    role: str
    pool: str
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    num_threads: int | None = None
    seed: int = 0


class Worker:
    """Base class of all workers.

    Subclasses::

        class MyWorker(Worker):
            def __init__(self, ctx: WorkerContext, *args, **kwargs):
                super().__init__(ctx)
                ...

            @register(Dispatch.DP_COMPUTE)
            def compute(self, batch: Batch) -> Batch: ...
    """

    def __init__(self, ctx: WorkerContext):
        if not isinstance(ctx, WorkerContext):
            raise TypeError(
                f"{type(self).__name__} expects a WorkerContext first, got {type(ctx).__name__}"
            )
        self.ctx = ctx
        if ctx.num_threads:
            torch.set_num_threads(ctx.num_threads)

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    @property
    def role(self) -> str:
        return self.ctx.role

    def apply(self, fn, /, *args, **kwargs):
        """Run ``fn(self, *args, **kwargs)`` here (driver: ``WorkerGroup.apply_all``): code that
        needs the worker's state without being one of its methods, e.g. moving weights between
        roles."""
        return fn(self, *args, **kwargs)

    def sleep(self) -> None:
        """Colocation: free device memory while another role of this process has the device."""

    def wake(self) -> None:
        """Colocation: take the device back (undo :meth:`sleep`)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(role={self.role!r}, rank={self.rank}/{self.world_size})"


class WorkerError(RuntimeError):
    """An exception raised inside a worker, re-raised in the driver.

    The message names the role, rank and method and carries the original
    ``Type: message``; the original exception is chained as ``__cause__``
    where it could be recovered.
    """

    def __init__(self, role: str, rank: int, method: str, detail: str):
        self.role, self.rank, self.method, self.detail = role, rank, method, detail
        super().__init__(f"worker role {role!r} rank {rank} failed in {method}(): {detail}")

    def __reduce__(self):
        return type(self), (self.role, self.rank, self.method, self.detail)


class WorkerDiedError(WorkerError):
    """A rank's process died (killed by a signal, out of memory, its node lost) rather than raising.

    The first line names the role, the dead rank, where it ran (``where``: pid and node) and the
    exit cause; ``detail`` (the following lines) carries what the other ranks did and Ray's own
    report. The group's torch.distributed group is broken from then on: every later call into the
    group raises this.
    """

    def __init__(
        self, role: str, rank: int, method: str, cause: str, where: str = "", detail: str = ""
    ):
        self.role, self.rank, self.method, self.detail = role, rank, method, cause
        self.where, self.report = where, detail
        head = (
            f"worker role {role!r} rank {rank} died in {method}()"
            + (f" ({where})" if where else "")
            + f": {cause}"
        )
        RuntimeError.__init__(self, head + (f"\n{detail}" if detail else ""))

    def __reduce__(self):
        return type(self), (self.role, self.rank, self.method, self.detail, self.where, self.report)


def describe_exception(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def find_free_port(host: str = "") -> int:
    """A TCP port that is free right now on this machine (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
