"""The ``local`` backend: every rank is an ordinary object in the driver
process, and ranks run one after another. Nothing is pickled, so a
breakpoint inside a worker method just works, and tests need no cluster.

A backend (local or ray) offers the same three operations to WorkerGroup:
``submit(method, calls) -> pending``, ``gather(method, pending) -> results``
(in the order of ``calls``) and ``shutdown()``. Here ``submit`` already runs
the calls; under Ray it only issues them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hybridrl.controller.dispatch import RankCall
from hybridrl.controller.worker import (
    WorkerContext,
    WorkerError,
    describe_exception,
    find_free_port,
)


class LocalBackend:
    """``world_size`` instances of ``cls`` living in this process.

    ``env`` is not applied: all local ranks of all groups share the driver's
    environment, so a per-group environment cannot exist here.
    """

    def __init__(self, cls: type, contexts: list[WorkerContext], args: tuple, kwargs: dict):
        port = find_free_port("127.0.0.1")
        self.contexts = [
            dataclasses.replace(c, master_addr="127.0.0.1", master_port=port) for c in contexts
        ]
        self.workers = []
        for ctx in self.contexts:
            try:
                self.workers.append(cls(ctx, *args, **kwargs))
            except Exception as exc:
                raise WorkerError(
                    ctx.role, ctx.rank, f"{cls.__name__}.__init__", describe_exception(exc)
                ) from exc

    def submit(self, method: str, calls: list[RankCall]) -> list[Any]:
        results = []
        for rank, args, kwargs in calls:
            fn = getattr(self.workers[rank], method)
            try:
                results.append(fn(*args, **kwargs))
            except Exception as exc:
                raise WorkerError(
                    self.contexts[rank].role, rank, method, describe_exception(exc)
                ) from exc
        return results

    def gather(self, method: str, pending: list[Any]) -> list[Any]:
        return pending

    def shutdown(self) -> None:
        self.workers = []
