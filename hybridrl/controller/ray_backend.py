"""The ``ray`` backend: one Ray actor per rank, pinned to the rank's bundle of
the pool's placement group; and :func:`init_ray` to start or join a cluster.

The actor body is :class:`_WorkerHost`, a thin shell that builds the user's
worker inside the actor and forwards method calls to it, so worker classes
need no Ray decorator and run unchanged under the local backend. Ray must be
able to import the worker class in its worker processes: classes in an
installed package (``hybridrl.*``, or a user package) are fine; for a class in
a loose script or test module either start Ray with ``PYTHONPATH`` in
``runtime_env`` or call ``ray.cloudpickle.register_pickle_by_value(module)``.

Stack dumps (``controller/stacks.py``): every host registers :mod:`faulthandler` for ``SIGUSR1``
at startup, writing into an unlinked temporary file (nothing is left behind).
:meth:`RayBackend.dump_stacks` (the driver's watchdog, on a step past ``trainer.step_timeout_s``)
has each rank's process write its stacks and copies them into the run directory.

Deaths (``controller/ray_deaths.py``): a rank whose actor died is reported as soon as Ray knows,
as a ``WorkerDiedError`` saying where it ran, why it died and what its peers did meanwhile.

Health (``controller/health.py``): every host answers ``heartbeat()`` on a thread of its own (the
Ray concurrency group ``health``), and a call of a method bounded by
``WorkerGroup.set_call_timeout`` that runs too long kills the group's actors.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import logging
import os
import tempfile
import time
from typing import Any

from hybridrl.controller.dispatch import RankCall
from hybridrl.controller.health import HEALTH_GROUP, refusal, timed_out
from hybridrl.controller.ray_deaths import died_error
from hybridrl.controller.resource_pool import ResourcePool
from hybridrl.controller.stacks import STACKS_SIGNAL, dump_stacks
from hybridrl.controller.worker import (
    WorkerContext,
    WorkerDiedError,
    WorkerError,
    describe_exception,
    find_free_port,
)

# seconds to wait for a group's actors to start (process spawn + imports)
START_TIMEOUT_S = 300.0
# seconds to keep waiting for the other ranks once one rank raised: when a rank is killed, its
# peers' connection errors often reach the driver before Ray reports the death, and the death is
# what to report
DEATH_GRACE_S = 10.0
# driver environment variables every rank inherits (a cluster joined by address does not share the
# driver's environment): the torch.distributed timeout read by parallel/distributed.py
FORWARDED_ENV = ("HYBRIDRL_PG_TIMEOUT_S",)
_PLAIN = (int, float, bool, str, bytes, type(None))


def init_ray(
    address: str | None = None, num_cpus: int | None = None, runtime_env: dict | None = None
) -> None:
    """Start a local Ray cluster (``address=None``) or join ``address``.

    A local cluster runs without dashboard, with token authentication off
    (``RAY_AUTH_MODE=disabled`` unless already set) and with Ray's own
    logging at WARNING. No-op when Ray is already initialised.
    """
    import ray

    if ray.is_initialized():
        return
    opts: dict[str, Any] = dict(
        include_dashboard=False, logging_level=logging.WARNING, runtime_env=runtime_env
    )
    if address is None:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        opts["num_cpus"] = num_cpus
    ray.init(address=address, **opts)


class _WorkerHost:
    """Actor body holding one worker instance."""

    def __init__(self, num_threads: int):
        import torch

        torch.set_num_threads(num_threads)
        self.worker = None
        # SIGUSR1 -> every thread's Python stack appended here (read via /proc/<pid>/fd/<fd>)
        self.stacks = tempfile.TemporaryFile("w+")  # noqa: SIM115 - open for the process life
        faulthandler.register(STACKS_SIGNAL, file=self.stacks, all_threads=True)

    def locate(self) -> tuple[str, str, int, int, int]:
        """``(node id, node ip, a free port on that node, pid, stack dump fd)``."""
        import ray

        return (
            ray.get_runtime_context().get_node_id(),
            ray.util.get_node_ip_address(),
            find_free_port(),
            os.getpid(),
            self.stacks.fileno(),
        )

    def build(
        self, cls: type, ctx: WorkerContext, args: tuple, kwargs: dict, env: dict[str, str]
    ) -> None:
        os.environ.update(env)
        self.worker = cls(ctx, *args, **kwargs)

    def call(self, method: str, /, *args, **kwargs) -> Any:
        # args travel top level so that Ray resolves ObjectRefs among them
        return getattr(self.worker, method)(*args, **kwargs)

    def heartbeat(self) -> dict:
        """The worker's ``heartbeat()`` (``{}`` without one); called in the concurrency group
        ``health``, so it answers while a call runs (``controller/health.py``)."""
        beat = getattr(self.worker, "heartbeat", None)
        return beat() if callable(beat) else {}


class RayBackend:
    """``pool.world_size`` actors, rank ``r`` on slot ``r`` of ``pool``.

    Each actor gets ``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` and torch threads
    = ``ctx.num_threads``, plus ``env``, before the worker is built, and
    ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE`` for
    torch.distributed. The master is rank 0's node: ``127.0.0.1`` when the
    whole group sits on one node, else rank 0's node IP.
    """

    def __init__(
        self,
        cls: type,
        pool: ResourcePool,
        contexts: list[WorkerContext],
        args: tuple,
        kwargs: dict,
        env: dict[str, str],
    ):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        init_ray()
        self._ray = ray
        self.contexts = contexts
        self.where: list[tuple[str, str, int, int]] = []  # per rank, from locate()
        self.stack_fds: list[int] = []  # per rank: the fd its stacks are written to
        # the first rank found dead, or a call that timed out (actors killed): the group is broken
        self.dead: WorkerError | None = None
        threads = str(contexts[0].num_threads)
        forwarded = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
        actor_env = {
            "OMP_NUM_THREADS": threads,
            "MKL_NUM_THREADS": threads,
            **forwarded,
            **{k: str(v) for k, v in env.items()},
        }
        host = ray.remote(concurrency_groups={HEALTH_GROUP: 1})(_WorkerHost)
        self.actors = []
        for ctx in contexts:
            pg, index = pool.placement(ctx.rank)
            self.actors.append(
                host.options(
                    **pool.actor_resources(),
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        pg, placement_group_bundle_index=index
                    ),
                    runtime_env={"env_vars": actor_env},
                ).remote(contexts[0].num_threads)
            )
        try:
            self._start(cls, args, kwargs)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, cls: type, args: tuple, kwargs: dict) -> None:
        ray = self._ray
        try:
            where = ray.get([a.locate.remote() for a in self.actors], timeout=START_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            ctx = self.contexts[0]
            raise RuntimeError(
                f"actors of role {ctx.role!r} did not start within {START_TIMEOUT_S:.0f} s on pool "
                f"{ctx.pool!r} "
                "(more groups on the pool than its max_colocate, or a cluster too small?)"
            ) from None
        self.where = [tuple(w[:4]) for w in where]
        self.stack_fds = [w[4] for w in where]
        one_node = len({w[0] for w in where}) == 1
        addr, port = "127.0.0.1" if one_node else where[0][1], where[0][2]
        self.contexts = [
            dataclasses.replace(c, master_addr=addr, master_port=port) for c in self.contexts
        ]
        pending = []
        for actor, ctx in zip(self.actors, self.contexts):
            dist_env = {
                "MASTER_ADDR": addr,
                "MASTER_PORT": str(port),
                "RANK": str(ctx.rank),
                "WORLD_SIZE": str(ctx.world_size),
            }
            pending.append((ctx.rank, actor.build.remote(cls, ctx, args, kwargs, dist_env)))
        self.gather(f"{cls.__name__}.__init__", pending)

    def submit(self, method: str, calls: list[RankCall]) -> list[tuple[int, Any]]:
        """Issue all calls without waiting; an argument object passed to
        several ranks is put into the object store once. A group with a dead
        rank takes no more calls: its torch.distributed group is broken."""
        if self.dead is not None:
            raise refusal(self.dead, method) from self.dead
        calls = self._share(calls)
        return [
            (rank, self.actors[rank].call.remote(method, *args, **kwargs))
            for rank, args, kwargs in calls
        ]

    def gather(
        self, method: str, pending: list[tuple[int, Any]], timeout: tuple | None = None
    ) -> list[Any]:
        """The results in the order of ``pending``. A rank whose actor died is reported as soon as
        Ray knows, without awaiting the others (a survivor may sit in a collective with the dead
        peer); otherwise the first failing rank in rank order among those done within DEATH_GRACE_S
        of the first failure. ``timeout``: ``(seconds, config key, "role.method")``: a call
        running after that long kills the group and raises ``CallTimeoutError``
        (``controller/health.py``)."""
        ray = self._ray
        rank_of = {ref: rank for rank, ref in pending}
        results: dict[Any, Any] = {}
        failed: dict[int, BaseException] = {}
        waiting, deadline = [ref for _, ref in pending], None
        limit = None if timeout is None else time.monotonic() + timeout[0]
        while waiting:
            ends = [t for t in (deadline, limit) if t is not None]
            wait_s = max(min(ends) - time.monotonic(), 0.0) if ends else None
            ready, waiting = ray.wait(waiting, num_returns=1, timeout=wait_s)
            if not ready and failed:  # the grace after a failure ran out
                break
            if not ready:  # the call's timeout (ray.wait may wake a little early)
                if time.monotonic() >= limit:
                    self.dead = timed_out(self, [rank_of[r] for r in waiting], *timeout)
                    raise self.dead
                continue
            ref = ready[0]
            try:
                results[ref] = ray.get(ref)
            except ray.exceptions.RayActorError as err:
                unawaited = [rank_of[r] for r in waiting]
                self.dead = self._died(rank_of[ref], method, err, failed, unawaited)
                raise self.dead from err
            except ray.exceptions.RayError as err:
                failed[rank_of[ref]] = err
                deadline = deadline or time.monotonic() + DEATH_GRACE_S
        if not failed:
            return [results[ref] for _, ref in pending]
        rank = min(failed)
        err = failed[rank]
        cause = (
            err.cause
            if isinstance(err, ray.exceptions.RayTaskError) and isinstance(err.cause, BaseException)
            else err
        )
        raise WorkerError(
            self.contexts[rank].role, rank, method, describe_exception(cause)
        ) from err

    def _died(
        self, rank: int, method: str, err: BaseException, failed: dict, unawaited: list[int]
    ) -> WorkerDiedError:
        """The error naming dead ``rank`` (``controller/ray_deaths.py``): where it ran, why it
        died, what its peers did meanwhile (``failed``: the ranks that raised; ``unawaited``: those
        still running). Also the heartbeat watch's (``controller/health.py``)."""
        where = self.where[rank] if rank < len(self.where) else None
        role = self.contexts[rank].role
        return died_error(role, rank, method, err, where, failed, unawaited)

    def dump_stacks(self, directory) -> list[str]:
        """Every rank's Python stacks into ``<directory>/<role>-rank<r>.txt``
        (:func:`~hybridrl.controller.stacks.dump_stacks`); a rank whose stacks could not be had gets
        a file saying why. The paths."""
        return dump_stacks(self.where, self.stack_fds, self.contexts, directory)

    def _share(self, calls: list[RankCall]) -> list[RankCall]:
        if len(calls) < 2:
            return calls
        seen: dict[int, int] = {}
        for _, args, kwargs in calls:
            for x in (*args, *kwargs.values()):
                seen[id(x)] = seen.get(id(x), 0) + 1
        refs: dict[int, Any] = {}

        def share(x):
            if seen[id(x)] < 2 or isinstance(x, (*_PLAIN, self._ray.ObjectRef)):
                return x
            if id(x) not in refs:
                refs[id(x)] = self._ray.put(x)
            return refs[id(x)]

        return [
            (r, tuple(share(a) for a in args), {k: share(v) for k, v in kwargs.items()})
            for r, args, kwargs in calls
        ]

    def shutdown(self) -> None:
        """Kill every actor, dead or alive; a kill that fails does not spare the others (the first
        failure is raised once all were tried)."""
        actors, self.actors, first = self.actors, [], None
        for actor in actors:
            try:
                self._ray.kill(actor, no_restart=True)
            except Exception as exc:  # noqa: BLE001 - the remaining actors must still go
                first = first or exc
        if first is not None:
            raise first
