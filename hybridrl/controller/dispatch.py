"""Dispatch modes: how one driver call fans out to the ranks of a WorkerGroup
and how the per-rank results come back.

A worker method opts in with ``@register(Dispatch.X)``; the decorator only
sets an attribute, so the method stays an ordinary method (callable directly,
e.g. in a unit test). :func:`plan` turns the driver's arguments into one call
per participating rank, :func:`combine` turns the results into one value.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from enum import Enum
from typing import Any

from hybridrl.protocol import Batch

DISPATCH_ATTR = "__hybridrl_dispatch__"

# one call to one rank: (rank, positional args, keyword args)
RankCall = tuple[int, tuple, dict]


class Dispatch(str, Enum):
    ONE_TO_ALL = "one_to_all"  # same args to every rank -> list of per-rank results
    ALL_FIRST = "all_first"  # same args to every rank (a collective) -> rank 0's result
    # first arg (a Batch or list) chunked by rank -> Batch.concat / one list
    DP_COMPUTE = "dp_compute"
    RANK_ZERO = "rank_zero"  # only rank 0 runs -> its result


def register(dispatch: Dispatch | str | Callable = Dispatch.ONE_TO_ALL):
    """Mark a worker method so that a WorkerGroup exposes it as a proxy.

    Use as ``@register(Dispatch.DP_COMPUTE)``, ``@register()`` or bare
    ``@register`` (which means ONE_TO_ALL).
    """
    if callable(dispatch) and not isinstance(dispatch, (str, Dispatch)):
        return register(Dispatch.ONE_TO_ALL)(dispatch)
    mode = Dispatch(dispatch)

    def mark(fn: Callable) -> Callable:
        if not callable(fn):
            raise TypeError(f"@register expects a method, got {fn!r}")
        setattr(fn, DISPATCH_ATTR, mode)
        return fn

    return mark


def registered_methods(cls: type) -> dict[str, Dispatch]:
    """``{name: mode}`` of every method of ``cls`` (inherited ones included)
    marked with :func:`register`. An override without the decorator is not
    registered: the mark belongs to the function, not to the name."""
    out = {}
    for name, member in inspect.getmembers(cls, callable):
        mode = getattr(member, DISPATCH_ATTR, None)
        if mode is not None:
            out[name] = mode
    return out


def chunk_list(items: list, n: int) -> list[list]:
    """``n`` contiguous parts whose sizes differ by at most one (as :meth:`Batch.chunk` splits)."""
    if n < 1:
        raise ValueError(f"chunk_list: n must be >= 1, got {n}")
    size, rem = divmod(len(items), n)
    bounds = [i * size + min(i, rem) for i in range(n + 1)]
    return [items[bounds[i] : bounds[i + 1]] for i in range(n)]


def plan(mode: Dispatch, world_size: int, args: tuple, kwargs: dict) -> list[RankCall]:
    """The calls to issue, one per participating rank, in rank order."""
    if mode in (Dispatch.ONE_TO_ALL, Dispatch.ALL_FIRST):
        return [(r, args, kwargs) for r in range(world_size)]
    if mode is Dispatch.RANK_ZERO:
        return [(0, args, kwargs)]
    if mode is Dispatch.DP_COMPUTE:
        if not args or not isinstance(args[0], (Batch, list)):
            got = type(args[0]).__name__ if args else "nothing"
            raise TypeError(
                "a DP_COMPUTE method takes a Batch or a list as its first positional argument, "
                f"got {got}"
            )
        first = args[0]
        chunks = (
            first.chunk(world_size) if isinstance(first, Batch) else chunk_list(first, world_size)
        )
        return [(r, (chunks[r],) + tuple(args[1:]), kwargs) for r in range(world_size)]
    raise ValueError(f"unknown dispatch mode {mode!r}")


def combine(mode: Dispatch, results: list[Any]) -> Any:
    """Combine per-rank results (in rank order) as the mode prescribes."""
    if mode in (Dispatch.RANK_ZERO, Dispatch.ALL_FIRST):
        return results[0]
    if mode is Dispatch.DP_COMPUTE and results and all(isinstance(r, Batch) for r in results):
        return Batch.concat(results)
    if mode is Dispatch.DP_COMPUTE and results and all(isinstance(r, list) for r in results):
        return [x for r in results for x in r]
    return list(results)
