"""Building a rollout backend for a worker, and what a backend needs installed.

A backend class may declare:

* ``takes_device = True``: its constructor accepts ``device=``, the worker's compute device
  (:func:`hybridrl.parallel.distributed.compute_device`: the GPU Ray or a launcher gave this
  process, else the CPU); the engine's weights, KV cache and sampling then live there. ``native``
  and ``hf`` do; the ``vllm`` / ``sglang`` adapters place themselves (their engines take the GPUs
  they are given) and keep the in-memory model on the CPU as a host mirror.
* ``records_routing = True``: for a mixture-of-experts model, every sample carries the experts its
  tokens were routed to (``Sample.routing``), which ``moe.routing_replay=r3`` replays in training;
  a config asking for r3 with a backend that records none is refused before any worker starts.
* ``package`` / ``extra``: the third-party package it drives and the hybridrl extra that installs
  it; :func:`missing_requirement` turns a missing one into a one-line config error before any
  worker starts (``hybridrl.checks.check_plugins``).

Only hybridrl code is imported here (the registry's classes are looked up when asked for).
"""

from __future__ import annotations

import importlib.util
import sys


def package_available(package: str) -> bool:
    """Whether ``package`` can be imported here, without importing it."""
    if package in sys.modules:
        return sys.modules[package] is not None
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def usable_backends() -> list[str]:
    """Registered backends whose third-party package (if any) is importable here."""
    from hybridrl.rollout.base import ROLLOUT_BACKENDS

    out = []
    for name in ROLLOUT_BACKENDS.names():
        package = getattr(ROLLOUT_BACKENDS.get(name), "package", "")
        if not package or package_available(package):
            out.append(name)
    return out


def missing_requirement(backend: str) -> str | None:
    """Why ``rollout.backend=backend`` cannot run here, in one line (its declared package is not
    installed), or None."""
    from hybridrl.rollout.base import ROLLOUT_BACKENDS

    cls = ROLLOUT_BACKENDS.get(backend)
    package = getattr(cls, "package", "")
    if not package or package_available(package):
        return None
    extra = getattr(cls, "extra", "") or package
    return (
        f"rollout.backend={backend!r} needs the {package!r} package, which is not installed; "
        f"install it with `pip install 'hybridrl[{extra}]'` after torch (docs/gpu.md), or choose a "
        f"backend usable here: {', '.join(usable_backends())}"
    )


def make_backend(cfg, model, tokenizer, device=None):
    """The ``cfg.backend`` rollout backend (``cfg``: a RolloutConfig) for ``model``; a backend that
    ``takes_device`` runs on ``device`` (None: where the model is)."""
    from hybridrl.rollout.base import ROLLOUT_BACKENDS

    cls = ROLLOUT_BACKENDS.get(cfg.backend)
    if device is not None and getattr(cls, "takes_device", False):
        return cls(model, tokenizer, cfg, device=device)
    return cls(model, tokenizer, cfg)
