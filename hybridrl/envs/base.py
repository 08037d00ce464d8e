"""The environment interface of multi-turn (agentic) rollouts, and the environment registry.

One environment instance serves one trajectory. The rollout calls ``reset(prompt)`` once, before
the model's first turn; its observation (or None) is appended to the prompt. Then, after each model
turn, ``step(action)`` with the turn's decoded text returns a :class:`StepResult`: the observation
to append (its tokens join the trajectory with loss mask 0: the model reads them but is never
trained to produce them), the reward of this turn, and whether the trajectory is over.
A trajectory also ends at the rollout's turn and token limits.

An environment may define ``reset`` and ``step`` as ``async def``: the rollout awaits them, so a
trajectory waiting on a slow tool never blocks the engine or the other trajectories. Plain
functions run on a thread pool for the same reason.

Environments are registered in :data:`ENVIRONMENTS` (or given by dotted path,
``my_pkg.envs:SearchEnv`` or ``envs.py:SearchEnv``) and built as ``cls(**env.kwargs)`` once per
trajectory, so building one is cheap: when the config loads, one is built and closed
(:func:`check_environment`), and arguments it refuses fail the config there, in one line, instead
of ending every trajectory. An exception or a timeout in ``reset`` or ``step`` ends the trajectory
with reward 0 and is counted; it never stops the run.
"""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass, field
from typing import Any

from hybridrl.registry import Registry


@dataclass
class StepResult:
    observation: str | None = None  # text appended after the model's turn (None: nothing)
    reward: float = 0.0  # this turn's reward (summed over the trajectory's turns)
    done: bool = False  # the trajectory ends after this turn
    info: dict[str, Any] = field(default_factory=dict)  # numbers here are logged as env/<key>


class Env:
    """Base class of environments (subclassing it is optional: any object with ``reset`` and
    ``step``, sync or async, will do)."""

    def reset(self, prompt) -> str | None:
        """The observation shown before the first model turn (default: none). ``prompt`` is the
        task's :class:`~hybridrl.tasks.base.Prompt` (its ``text``, ``answer``, ...)."""
        return None

    def step(self, action: str) -> StepResult:
        raise NotImplementedError

    def close(self) -> None:  # noqa: B027 (optional: most environments hold nothing)
        """Called once when the trajectory ends (also after an error)."""


ENVIRONMENTS: Registry[type] = Registry("environment")


def check_environment(name: str, kwargs: dict[str, Any]) -> None:
    """Raise ``ValueError`` (one line: what is wrong, what is allowed) when environment ``name``
    cannot be built from ``kwargs``: an unknown name, an argument its constructor does not take,
    or a value it refuses (one is built and closed to find out)."""
    import hybridrl.envs  # noqa: F401  (registers the built-in environments)

    try:
        cls = ENVIRONMENTS.get(name)
    except KeyError as e:
        raise ValueError(f"name: {e.args[0]}") from None
    try:
        params = list(inspect.signature(cls).parameters.values())
    except (TypeError, ValueError):  # no signature to read: building it tells
        params = []
    by_name = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    if params and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        allowed = [p.name for p in params if p.kind in by_name]
        unknown = sorted(set(kwargs) - set(allowed))
        if unknown:
            raise ValueError(
                f"kwargs: environment {name!r} takes no argument {', '.join(unknown)}; its "
                f"arguments: {', '.join(allowed) or 'none'}"
            )
    try:
        env = cls(**kwargs)
        closed = env.close() if hasattr(env, "close") else None
        if inspect.isawaitable(closed):
            asyncio.run(closed)
    except Exception as e:
        message = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        raise ValueError(
            f"kwargs: environment {name!r} refuses {kwargs}: {' '.join(str(message).split())}"
        ) from None
