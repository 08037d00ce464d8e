"""Environments and tools for multi-turn (agentic) rollouts."""

from hybridrl.envs.base import ENVIRONMENTS, Env, StepResult

__all__ = ["ENVIRONMENTS", "Env", "StepResult"]
