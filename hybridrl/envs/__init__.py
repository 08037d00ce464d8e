"""Environments and tools for multi-turn (agentic) rollouts."""

from hybridrl.envs import calc_tool  # noqa: F401  (registers calc_tool)
from hybridrl.envs.base import ENVIRONMENTS, Env, StepResult
from hybridrl.envs.tool_env import ToolEnv
from hybridrl.envs.tools import TOOLS, Tool, ToolBox, parse_tool_calls, tool

__all__ = [
    "ENVIRONMENTS",
    "TOOLS",
    "Env",
    "StepResult",
    "Tool",
    "ToolBox",
    "ToolEnv",
    "parse_tool_calls",
    "tool",
]
