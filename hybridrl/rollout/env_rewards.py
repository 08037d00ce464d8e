"""The rewards of multi-turn rollouts (``env.name`` set; docs/agentic.md).

A multi-turn trajectory comes back from ``rollout/multiturn.py`` with its environment's outcome in
its metadata (the sum of the per-turn rewards, whether the environment failed). Turning that into
the sample's reward is scoring, not generation, so it lives apart from the rollout that drives the
environments: with ``task.reward_fn`` null the reward is the environment's sum; with reward
functions given, they score the decoded response (observations included) as in single-turn
training, and the environment's sum is logged as ``reward/env``. A trajectory whose environment
failed scores 0 either way.
"""

from __future__ import annotations

from hybridrl.protocol import Sample
from hybridrl.rollout.scoring import FAILURE_COUNTS


class EnvRewards:
    """The scorer of a multi-turn rollout (module docstring): the environment's reward, or the
    configured reward functions when ``task.reward_fn`` names any."""

    def __init__(self, cfg, scorer):
        self.scorer, self.use_functions = scorer, bool(cfg.task.reward_fns())

    def __call__(self, samples: list[Sample]) -> list[Sample]:
        if self.use_functions:
            self.scorer(samples)
        for s in samples:
            env_reward = float(s.metadata.get("env_reward", 0.0))
            if self.use_functions:
                s.reward_extras["reward/env"] = env_reward
            else:
                s.reward_extras.update(FAILURE_COUNTS)
                s.reward = env_reward
            if s.metadata.get("env_error") or s.status == "aborted" and not s.response_ids:
                s.reward = 0.0
        return samples

    def __getattr__(self, name: str):
        if name == "scorer":
            raise AttributeError(name)
        return getattr(self.scorer, name)


def env_rewards(cfg, scorer):
    """``scorer`` as it is (``env.name`` null), or :class:`EnvRewards` around it."""
    return scorer if cfg.env.name is None else EnvRewards(cfg, scorer)
