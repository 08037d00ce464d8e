"""``ToolEnv``: the model calls tools until it answers.

Each model turn is parsed for ``<tool_call>`` blocks (see :mod:`hybridrl.envs.tools`). A turn
with calls runs them concurrently and shows their results as the observation, each wrapped in
``response_template``; a turn without calls is the final answer: the episode ends and
``reward_fn`` scores it: a registered reward function or a dotted path, in any of the forms
``task.reward_fn`` takes (per-sample, TRL-style, veRL-style; ``tasks/reward_signatures.py``). An
episode also ends after ``max_turns`` turns, with reward 0. Every turn reports ``tool_calls`` and
``tool_errors`` in its info.

Configured from ``env.kwargs``, e.g.::

    env:
      name: tools
      kwargs:
        tools: [calculator, python]
        max_turns: 4
        reward_fn: exact_match
        tool_config: {python: {limits: {cpu_s: 2, memory_mb: 512}}}
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import hybridrl.envs.builtin_tools  # noqa: F401 (registers calculator and python)
from hybridrl.envs.base import ENVIRONMENTS, Env, StepResult
from hybridrl.envs.tools import ToolBox, parse_tool_calls

# What ``describe_tools`` shows before the first turn (for models without a chat template that
# renders ``tools=``): the schemas and the call format.
TOOLS_PREAMBLE = (
    "You may call tools. The tools, as JSON schemas:\n<tools>\n{schemas}\n</tools>\n"
    'To call one, write <tool_call>{{"name": <tool name>, "arguments": <arguments object>}}'
    "</tool_call>. Answer without a tool call when you are done.\n"
)


@ENVIRONMENTS.register("tools")
class ToolEnv(Env):
    """Multi-turn tool use (see the module docstring for the episode's rules).

    ``response_template`` formats each result (``{name}``, ``{content}``); the observation is
    ``observation_prefix`` + the results joined by newlines + ``observation_suffix``. An
    observation is text: chat markers in it are never control tokens (a prompt rendered through
    a chat template gets its observations as tool messages of the conversation instead).
    At most ``max_calls_per_turn`` calls of a turn run; the others are answered with an error.
    """

    def __init__(
        self,
        tools: Sequence[str] = ("calculator", "python"),
        max_turns: int = 4,
        reward_fn: str | None = None,
        tool_config: Mapping[str, Mapping[str, Any]] | None = None,
        tool_timeout_s: float | None = None,
        max_calls_per_turn: int = 8,
        response_template: str = "<tool_response>\n{content}\n</tool_response>",
        observation_prefix: str = "",
        observation_suffix: str = "",
        describe_tools: bool = False,
    ):
        for key, value in (("max_turns", max_turns), ("max_calls_per_turn", max_calls_per_turn)):
            if value < 1:
                raise ValueError(f"{key} must be at least 1, got {value}")
        self.toolbox = ToolBox(tools, tool_config, tool_timeout_s)
        self.reward_fn = _reward_function(reward_fn) if reward_fn else None
        self.max_turns, self.max_calls = max_turns, max_calls_per_turn
        self.template, self.prefix, self.suffix = (
            response_template,
            observation_prefix,
            observation_suffix,
        )
        self.describe_tools = describe_tools
        self.prompt, self.turn = None, 0

    def reset(self, prompt) -> str | None:
        self.prompt, self.turn = prompt, 0
        if not self.describe_tools:
            return None
        schemas = "\n".join(json.dumps(s) for s in self.toolbox.schemas())
        return TOOLS_PREAMBLE.format(schemas=schemas)

    async def step(self, action: str) -> StepResult:
        self.turn += 1
        calls = parse_tool_calls(action)
        if not calls:  # the final answer
            reward, extras = await self._score(action)
            info = {"tool_calls": 0, "tool_errors": 0, "answered": 1, **_numbers(extras)}
            return StepResult(None, reward, True, info)
        results = await self.toolbox.call_all(calls[: self.max_calls])
        contents = [(r.name, r.content) for r in results]
        contents += [
            (c.name, f"Error: at most {self.max_calls} tool calls per turn; this one did not run")
            for c in calls[self.max_calls :]
        ]
        errors = sum(r.error for r in results) + max(0, len(calls) - self.max_calls)
        body = "\n".join(self.template.format(name=n, content=c) for n, c in contents)
        done = self.turn >= self.max_turns
        info = {"tool_calls": len(calls), "tool_errors": errors, "answered": 0}
        return StepResult(self.prefix + body + self.suffix, 0.0, done, info)

    async def _score(self, answer: str) -> tuple[float, dict]:
        if self.reward_fn is None:
            return 0.0, {}
        from hybridrl.tasks.reward_signatures import score_alone

        return await score_alone(self.reward_fn, self.prompt, answer)


def _reward_function(spec: str):
    # imported here: the tasks package imports the environments (a task may define one)
    from hybridrl.tasks.reward_signatures import reward_function

    return reward_function(spec, "env.kwargs.reward_fn")


def _numbers(extras: Mapping[str, Any]) -> dict[str, float]:
    """The reward function's numeric extras (info numbers are logged)."""
    return {k: float(v) for k, v in extras.items() if isinstance(v, (int, float))}
