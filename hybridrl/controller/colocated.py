"""Several roles in one process per device slot (colocation).

Under the ``ray`` backend, roles placed on the same pool could each get their own actor on every
slot (one process per role per device). A :class:`ColocatedWorker` instead holds one worker of every
such role in a single process, so the roles hand tensors to each other in memory (weight sync
without Ray), share the process's torch.distributed group, and take turns on the device: before a
call into a role, every other role sleeps (``Worker.sleep``: the learner moves its training state
to host memory, the rollout frees its KV cache; a no-op for roles that hold no device memory) and
the called role wakes (``wake``), each only when the turn changes.

The driver still sees one object per role: :class:`RoleView` exposes the ``@register``-ed methods of
a role's class, with their dispatch modes, on top of the colocated group, so
``roles.learner.train_step(...)`` reads the same whether the learner shares its processes or not.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hybridrl.controller.dispatch import Dispatch, combine, plan, registered_methods
from hybridrl.controller.worker import Worker, WorkerContext


class ColocatedWorker(Worker):
    """``parts``: ``{role: (cls, args)}``, built in this order as ``cls(ctx with role, *args)``."""

    def __init__(self, ctx: WorkerContext, parts: dict[str, tuple[type, tuple]]):
        super().__init__(ctx)
        self.parts: dict[str, Any] = {}
        for role, (cls, args) in parts.items():
            self.parts[role] = cls(dataclasses.replace(ctx, role=role), *args)
        self.turn: str | None = None  # the role that has the device

    def take_turn(self, role: str) -> None:
        """Give the device to ``role``: the others sleep first (memory freed), then it wakes."""
        if role == self.turn:
            return
        for other, part in self.parts.items():
            if other != role:
                part.sleep()
        self.parts[role].wake()
        self.turn = role

    def call_role(self, role: str, method: str, /, *args, **kwargs) -> Any:
        self.take_turn(role)
        return getattr(self.parts[role], method)(*args, **kwargs)

    def apply_role(self, role: str, fn, /, *args, **kwargs) -> Any:
        self.take_turn(role)
        return fn(self.parts[role], *args, **kwargs)

    def heartbeat(self) -> dict:
        """The heartbeat of the first part that reports one (the rollout's); read from another
        thread while a call runs (``controller/health.py``)."""
        for part in self.parts.values():
            beat = getattr(part, "heartbeat", None)
            if callable(beat):
                return beat()
        return {}


class RoleView:
    """One role of a WorkerGroup of :class:`ColocatedWorker`: the role class's registered methods as
    proxies, plus ``apply_all``, ``world_size``, ``methods`` -- what the driver uses of a
    WorkerGroup."""

    def __init__(self, group, role: str, cls: type):
        self.group, self.role, self.cls = group, role, cls
        self._methods = registered_methods(cls)
        for name, mode in self._methods.items():
            setattr(self, name, self._proxy(name, mode))

    @property
    def world_size(self) -> int:
        return self.group.world_size

    @property
    def methods(self) -> dict[str, Dispatch]:
        return dict(self._methods)

    @property
    def backend_name(self) -> str:
        return self.group.backend_name

    def _proxy(self, name: str, mode: Dispatch):
        def proxy(*args, **kwargs):
            calls = [
                (r, (self.role, name, *a), kw)
                for r, a, kw in plan(mode, self.world_size, args, kwargs)
            ]
            return combine(mode, self.group.run("call_role", calls))

        proxy.__name__ = proxy.__qualname__ = name
        proxy.__doc__ = f"[{mode.value} over {self.world_size} ranks, colocated] " + (
            getattr(self.cls, name).__doc__ or ""
        )
        return proxy

    def apply_all(self, fn, *args, **kwargs) -> list:
        """``fn(role worker, *args, **kwargs)`` on every rank."""
        return self.group.run(
            "apply_role", plan(Dispatch.ONE_TO_ALL, self.world_size, (self.role, fn, *args), kwargs)
        )

    def shutdown(self) -> None:  # the colocated group is shut down once, by its owner
        pass

    def __repr__(self) -> str:
        return f"RoleView({self.cls.__name__}, role={self.role!r}, in {self.group!r})"
