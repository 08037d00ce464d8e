"""W4's calculator environment, ``calc_tool`` (its task: ``hybridrl/tasks/calc.py``).

``latency_s`` per calculator call: fixed, or ``latency: lognormal`` (median ``latency_s``, shape
``sigma``; seeded from ``seed``, the prompt and the call) for a slow tool with a long tail.
"""

from __future__ import annotations

import asyncio
import math

from hybridrl.envs.base import ENVIRONMENTS, Env, StepResult
from hybridrl.tasks.arithmetic import _rng
from hybridrl.tasks.base import Prompt
from hybridrl.tasks.calc import CALL, OPS


@ENVIRONMENTS.register("calc_tool")
class CalcToolEnv(Env):
    """W4's calculator (module docstring). A turn holding ``<call>x*y</call>`` (or ``+``, ``-``) is
    answered ``<obs>value</obs>`` after the call's latency; a turn without one is the final answer,
    which ends the trajectory with reward 1 if it is exactly right."""

    def __init__(
        self, latency_s: float = 0.0, latency: str = "fixed", sigma: float = 1.0, seed: int = 0
    ):
        if latency not in ("fixed", "lognormal"):
            raise ValueError(f"latency must be fixed or lognormal, got {latency!r}")
        if latency_s < 0 or sigma < 0:
            raise ValueError(f"latency_s and sigma must be >= 0, got {latency_s}, {sigma}")
        self.latency_s, self.latency, self.sigma, self.seed = latency_s, latency, sigma, seed
        self.prompt: Prompt | None = None
        self.calls = 0

    async def reset(self, prompt: Prompt) -> None:
        self.prompt, self.calls = prompt, 0
        return None

    def delay(self, action: str) -> float:
        """This call's latency: fixed, or lognormal seeded from the seed, prompt and call."""
        if self.latency == "fixed" or self.latency_s == 0:
            return self.latency_s
        rng = _rng(
            "calc_tool", self.seed, self.prompt.uid if self.prompt else "", self.calls, action
        )
        return self.latency_s * math.exp(self.sigma * rng.gauss(0.0, 1.0))

    async def step(self, action: str) -> StepResult:
        call = CALL.search(action)
        if call is None:  # the final answer
            right = self.prompt is not None and action == self.prompt.answer
            info = {"correct": float(right), "tool_calls": float(self.calls)}
            return StepResult(reward=float(right), done=True, info=info)
        self.calls += 1
        await asyncio.sleep(self.delay(action))
        x, op, y = call.groups()
        return StepResult(observation=f"<obs>{OPS[op](int(x), int(y))}</obs>")
