"""The two roles of a run, each a :class:`~hybridrl.controller.Worker` whose ``@register``-ed methods the
driver calls: the learner (trained models and the learning step) and the rollout (generation and scoring)."""

from hybridrl.workers.learner import Learner
from hybridrl.workers.rollout import RolloutWorker

__all__ = ["Learner", "RolloutWorker"]
