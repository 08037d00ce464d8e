"""The ``ray`` backend: one Ray actor per rank, pinned to the rank's bundle of
the pool's placement group; and :func:`init_ray` to start or join a cluster.

The actor body is :class:`_WorkerHost`, a thin shell that builds the user's
worker inside the actor and forwards method calls to it, so worker classes
need no Ray decorator and run unchanged under the local backend. Ray must be
able to import the worker class in its worker processes: classes in an
installed package (``hybridrl.*``, or a user package) are fine; for a class in
a loose script or test module either start Ray with ``PYTHONPATH`` in
``runtime_env`` or call ``ray.cloudpickle.register_pickle_by_value(module)``.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from hybridrl.controller.dispatch import RankCall
from hybridrl.controller.resource_pool import ResourcePool
from hybridrl.controller.worker import WorkerContext, WorkerError, describe_exception, find_free_port

# seconds to wait for a group's actors to start (process spawn + imports)
START_TIMEOUT_S = 300.0
_PLAIN = (int, float, bool, str, bytes, type(None))


def init_ray(address: str | None = None, num_cpus: int | None = None, runtime_env: dict | None = None) -> None:
    """Start a local Ray cluster (``address=None``) or join ``address``.

    A local cluster runs without dashboard, with token authentication off
    (``RAY_AUTH_MODE=disabled`` unless already set) and with Ray's own
    logging at WARNING. No-op when Ray is already initialised.
    """
    import ray

    if ray.is_initialized():
        return
    opts: dict[str, Any] = dict(include_dashboard=False, logging_level=logging.WARNING, runtime_env=runtime_env)
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

    def locate(self) -> tuple[str, str, int]:
        """``(node id, node ip, a free port on that node)``."""
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), find_free_port()

    def build(self, cls: type, ctx: WorkerContext, args: tuple, kwargs: dict, env: dict[str, str]) -> None:
        os.environ.update(env)
        self.worker = cls(ctx, *args, **kwargs)

    def call(self, method: str, /, *args, **kwargs) -> Any:
        # args travel top level so that Ray resolves ObjectRefs among them
        return getattr(self.worker, method)(*args, **kwargs)


class RayBackend:
    """``pool.world_size`` actors, rank ``r`` on slot ``r`` of ``pool``.

    Each actor gets ``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` and torch threads
    = ``ctx.num_threads``, plus ``env``, before the worker is built, and
    ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE`` for
    torch.distributed. The master is rank 0's node: ``127.0.0.1`` when the
    whole group sits on one node, else rank 0's node IP.
    """

    def __init__(self, cls: type, pool: ResourcePool, contexts: list[WorkerContext], args: tuple, kwargs: dict, env: dict[str, str]):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        init_ray()
        self._ray = ray
        self.contexts = contexts
        threads = str(contexts[0].num_threads)
        actor_env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, **{k: str(v) for k, v in env.items()}}
        host = ray.remote(_WorkerHost)
        self.actors = []
        for ctx in contexts:
            pg, index = pool.placement(ctx.rank)
            self.actors.append(
                host.options(
                    **pool.actor_resources(),
                    scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index),
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
                f"actors of role {ctx.role!r} did not start within {START_TIMEOUT_S:.0f} s on pool {ctx.pool!r} "
                "(more groups on the pool than its max_colocate, or a cluster too small?)"
            ) from None
        one_node = len({node for node, _, _ in where}) == 1
        addr, port = "127.0.0.1" if one_node else where[0][1], where[0][2]
        self.contexts = [dataclasses.replace(c, master_addr=addr, master_port=port) for c in self.contexts]
        pending = []
        for actor, ctx in zip(self.actors, self.contexts):
            dist_env = {"MASTER_ADDR": addr, "MASTER_PORT": str(port), "RANK": str(ctx.rank), "WORLD_SIZE": str(ctx.world_size)}
            pending.append((ctx.rank, actor.build.remote(cls, ctx, args, kwargs, dist_env)))
        self.gather(f"{cls.__name__}.__init__", pending)

    def submit(self, method: str, calls: list[RankCall]) -> list[tuple[int, Any]]:
        """Issue all calls without waiting; an argument object passed to
        several ranks is put into the object store once."""
        calls = self._share(calls)
        return [(rank, self.actors[rank].call.remote(method, *args, **kwargs)) for rank, args, kwargs in calls]

    def gather(self, method: str, pending: list[tuple[int, Any]]) -> list[Any]:
        ray = self._ray
        try:
            return ray.get([ref for _, ref in pending])
        except ray.exceptions.RayError:
            pass
        for rank, ref in pending:  # find the first failing rank, in rank order
            try:
                ray.get(ref)
            except ray.exceptions.RayTaskError as err:
                cause = err.cause if isinstance(err.cause, BaseException) else err
                raise WorkerError(self.contexts[rank].role, rank, method, describe_exception(cause)) from err
            except ray.exceptions.RayError as err:
                raise WorkerError(self.contexts[rank].role, rank, method, describe_exception(err)) from err
        raise AssertionError("ray.get failed but no single call did")  # pragma: no cover

    def _share(self, calls: list[RankCall]) -> list[RankCall]:
        if len(calls) < 2:
            return calls
        seen: dict[int, int] = {}
        for _, args, kwargs in calls:
            for x in (*args, *kwargs.values()):
                seen[id(x)] = seen.get(id(x), 0) + 1
        refs: dict[int, Any] = {}

        def share(x):
            if seen[id(x)] < 2 or isinstance(x, _PLAIN) or isinstance(x, self._ray.ObjectRef):
                return x
            if id(x) not in refs:
                refs[id(x)] = self._ray.put(x)
            return refs[id(x)]

        return [(r, tuple(share(a) for a in args), {k: share(v) for k, v in kwargs.items()}) for r, args, kwargs in calls]

    def shutdown(self) -> None:
        for actor in self.actors:
            self._ray.kill(actor, no_restart=True)
        self.actors = []
