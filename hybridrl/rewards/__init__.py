"""Reward functions beyond the per-sample form: the signature adapters (``signatures.py``: TRL-style
batched, veRL-style and per-sample functions, sync or async, told apart by their parameters) and
built-in rewards with optional dependencies (``mathverify.py``: ``math_verify``).

This package imports nothing at load time, so a reward module can use :func:`needs` without an
import cycle through :mod:`hybridrl.tasks`.
"""

from __future__ import annotations

from collections.abc import Callable


def needs(module: str, extra: str) -> Callable[[Callable], Callable]:
    """Mark a reward function as needing an optional package: selecting it when ``module`` is not
    importable is a config-time error telling to ``pip install 'hybridrl[<extra>]'``."""

    def deco(fn: Callable) -> Callable:
        fn.requires_module = (module, extra)  # read by signatures.load_reward_fn
        return fn

    return deco
