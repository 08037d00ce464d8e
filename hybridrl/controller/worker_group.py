"""WorkerGroup: ``world_size`` ranks of one worker class, one role, placed on
a ResourcePool, driven from the single controller as if it were one object.

Every method of the worker class marked with ``@register`` becomes a method
of the group of the same name that dispatches per its mode::

    pool = ResourcePool("actor", workers_per_node=2)
    actor = WorkerGroup(ActorWorker, pool, role="actor", backend="ray", args=(cfg,))
    batch = batch | actor.compute_log_prob(batch)   # DP_COMPUTE: split, run, concat
"""

from __future__ import annotations

import itertools
import time
from typing import Any

from hybridrl.controller.dispatch import Dispatch, combine, plan, registered_methods
from hybridrl.controller.local_backend import LocalBackend
from hybridrl.controller.resource_pool import ResourcePool
from hybridrl.controller.worker import Worker, WorkerContext, WorkerError

BACKENDS = ("local", "ray")


class WorkerGroup:
    """The ranks of one role.

    Args:
        cls: a :class:`Worker` subclass, built as ``cls(ctx, *args, **kwargs)``
            on every rank.
        pool: where the ranks go; ``pool.world_size`` ranks.
        role: name of the role (``actor``, ``ref``, ``rollout`` ...), used in
            contexts and error messages.
        backend: ``local`` (all ranks in this process, run one after another)
            or ``ray`` (one actor per rank, ranks run in parallel; starts a
            local Ray cluster with :func:`init_ray` if none is running).
        num_threads: torch/OpenMP threads per rank. ``local``: left as is when
            None. ``ray``: 1 when None.
        seed: the group's seed, in every rank's context.
        env: extra environment variables for each rank (``ray`` only; the
            local backend shares the driver's environment).
    """

    def __init__(
        self,
        cls: type,
        pool: ResourcePool,
        *,
        role: str,
        backend: str = "local",
        args: tuple = (),
        kwargs: dict | None = None,
        num_threads: int | None = None,
        seed: int = 0,
        env: dict | None = None,
    ):
        if not (isinstance(cls, type) and issubclass(cls, Worker)):
            raise TypeError(f"WorkerGroup needs a Worker subclass, got {cls!r}")
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
        self.cls, self.pool, self.role, self.backend_name = cls, pool, role, backend
        self._methods = registered_methods(cls)
        # calls now waited for: key -> (method, calls, monotonic start); one dict update per call,
        # read by the driver's watchdog (telemetry/watchdog.py)
        self._in_flight: dict[int, tuple[str, list, float]] = {}
        self._keys = itertools.count()
        self._abandoned: str | None = None
        # "role.method" -> (seconds, config key): calls bounded in time (ray only, health.py)
        self._timeouts: dict[str, tuple[float, str]] = {}
        clash = sorted(n for n in self._methods if hasattr(WorkerGroup, n))
        if clash:
            raise ValueError(
                f"{cls.__name__}: registered method(s) {clash} clash with WorkerGroup attributes"
            )
        if backend == "ray" and num_threads is None:
            num_threads = 1
        contexts = [
            WorkerContext(
                rank=r,
                world_size=pool.world_size,
                role=role,
                pool=pool.name,
                num_threads=num_threads,
                seed=seed,
            )
            for r in range(pool.world_size)
        ]
        if backend == "local":
            self._backend = LocalBackend(cls, contexts, tuple(args), dict(kwargs or {}))
        else:
            from hybridrl.controller.ray_backend import RayBackend

            self._backend = RayBackend(
                cls, pool, contexts, tuple(args), dict(kwargs or {}), dict(env or {})
            )
        for name, mode in self._methods.items():
            setattr(self, name, self._proxy(name, mode))

    # --- introspection -----------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.pool.world_size

    @property
    def contexts(self) -> list[WorkerContext]:
        """Every rank's context (with the group's master address and port)."""
        return list(self._backend.contexts)

    @property
    def workers(self) -> list[Any]:
        """Per rank: the worker object (local) or the Ray actor handle (ray)."""
        return list(self._backend.workers if self.backend_name == "local" else self._backend.actors)

    @property
    def methods(self) -> dict[str, Dispatch]:
        """The proxied methods and their dispatch modes."""
        return dict(self._methods)

    def __repr__(self) -> str:
        return (
            f"WorkerGroup({self.cls.__name__}, role={self.role!r}, pool={self.pool.name!r}, "
            f"world_size={self.world_size}, backend={self.backend_name!r})"
        )

    # --- calls ---------------------------------------------------------------
    def _proxy(self, name: str, mode: Dispatch):
        def proxy(*args, **kwargs):
            return combine(mode, self.run(name, plan(mode, self.world_size, args, kwargs)))

        proxy.__name__ = proxy.__qualname__ = name
        proxy.__doc__ = f"[{mode.value} over {self.world_size} ranks] " + (
            getattr(self.cls, name).__doc__ or ""
        )
        return proxy

    def run(self, name: str, calls: list) -> list:
        """Issue ``calls`` (``(rank, args, kwargs)`` each, as :func:`plan` makes them) of method
        ``name`` and wait for them; the results in call order (the proxies and views use this).
        While it waits, the call is listed by :meth:`in_flight`."""
        if self._abandoned is not None:
            raise WorkerError(self.role, calls[0][0] if calls else 0, name, self._abandoned)
        key = next(self._keys)
        self._in_flight[key] = (name, calls, time.monotonic())
        try:
            pending = self._backend.submit(name, calls)
            what = self._describe(name, calls) if self._timeouts else None
            if what not in self._timeouts:
                return self._backend.gather(name, pending)
            return self._backend.gather(name, pending, timeout=(*self._timeouts[what], what))
        finally:
            del self._in_flight[key]

    def set_call_timeout(self, what: str, seconds: float | None, setting: str) -> None:
        """Bound every call of ``what`` (``role.method`` as :meth:`in_flight` names it, e.g.
        ``rollout.generate``) to ``seconds`` (None: no bound): past it the group's actors are killed
        and the call raises :class:`~hybridrl.controller.health.CallTimeoutError` naming
        ``setting``. ``ray`` only: a ``local`` call runs in the driver's thread and cannot be
        stopped, so there it is not bounded."""
        if self.backend_name != "ray":
            return
        if seconds is None:
            self._timeouts.pop(what, None)
        else:
            self._timeouts[what] = (float(seconds), setting)

    # --- hang detection ------------------------------------------------------
    def in_flight(self) -> list[tuple[str, float]]:
        """``(role.method, seconds running)`` of every call of this group the driver waits for now,
        oldest first (any thread may ask). A colocated role's call reads ``learner.train_step``,
        ``apply_all`` reads ``role.apply(fn)``."""
        now = time.monotonic()
        for _ in range(3):  # another thread may add or end a call while we copy
            try:
                calls = list(self._in_flight.values())
                break
            except RuntimeError:
                continue
        else:
            return []
        calls.sort(key=lambda c: c[2])
        return [(self._describe(name, c), now - since) for name, c, since in calls]

    def _describe(self, name: str, calls: list) -> str:
        args = calls[0][1] if calls else ()
        if name == "call_role" and len(args) >= 2:  # ColocatedWorker (RoleView): role, method
            return f"{args[0]}.{args[1]}"
        if name == "apply_role" and len(args) >= 2:
            return f"{args[0]}.apply({_fn_name(args[1])})"
        if name == "apply" and args:
            return f"{self.role}.apply({_fn_name(args[0])})"
        return f"{self.role}.{name}"

    def processes(self) -> list[dict]:
        """Per rank of a ``ray`` group: ``rank``, ``pid``, ``node_ip``, ``node_id``. Empty for a
        ``local`` group: its ranks live in the driver's own process."""
        if self.backend_name == "local":
            return []
        return [
            {"rank": r, "pid": pid, "node_ip": ip, "node_id": node}
            for r, (node, ip, _, pid) in enumerate(self._backend.where)
        ]

    def dump_stacks(self, directory) -> list[str]:
        """Have every rank's process write its Python stacks (all threads) to
        ``<directory>/<role>-rank<r>.txt``, even while the rank is stuck in a call; the paths
        written. ``local``: nothing (the ranks are the driver's process: dump that one)."""
        if self.backend_name == "local":
            return []
        return self._backend.dump_stacks(directory)

    def abandon(self, reason: str) -> None:
        """Refuse every later call at once with ``reason`` (a ``WorkerError``): a rank still busy in
        a hung call would queue it forever. :meth:`shutdown` still kills the ranks."""
        self._abandoned = reason

    def execute_all(self, name: str, *args, **kwargs) -> list:
        """Call any method (registered or not) on every rank with the same
        arguments; per-rank results in rank order."""
        self._check_method(name)
        return self.run(name, plan(Dispatch.ONE_TO_ALL, self.world_size, args, kwargs))

    def execute_rank(self, rank: int, name: str, *args, **kwargs) -> Any:
        """Call any method on one rank; its result."""
        self._check_method(name)
        if not 0 <= rank < self.world_size:
            raise IndexError(f"group {self.role!r} has {self.world_size} ranks, no rank {rank}")
        return self.run(name, [(rank, args, kwargs)])[0]

    def apply_all(self, fn, *args, **kwargs) -> list:
        """``fn(worker, *args, **kwargs)`` on every rank (in the rank's process); per-rank results
        in rank order. Under ray ``fn`` must be importable (or pickled by value) in the worker
        processes."""
        return self.run("apply", plan(Dispatch.ONE_TO_ALL, self.world_size, (fn, *args), kwargs))

    def _check_method(self, name: str) -> None:
        if not callable(getattr(self.cls, name, None)):
            raise AttributeError(f"{self.cls.__name__} has no method {name!r}")

    def __getattr__(self, name: str):
        # only reached when normal lookup fails: explain unregistered methods
        if not name.startswith("_") and callable(getattr(self.__dict__.get("cls"), name, None)):
            raise AttributeError(
                f"{self.cls.__name__}.{name} is not marked with @register, so the group has no "
                f"proxy for it; mark it or use execute_all({name!r}, ...)"
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # --- lifetime ------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the group's workers (the pool stays reserved for others). Under ray every rank's
        actor is killed, busy or dead; a kill that fails is raised only after the others were
        tried."""
        self._backend.shutdown()

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _fn_name(fn) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
