"""The roles: each a :class:`~hybridrl.controller.Worker` whose ``@register``-ed methods the driver calls."""

from hybridrl.workers.actor import ActorWorker
from hybridrl.workers.critic import CriticWorker
from hybridrl.workers.reference import ReferenceWorker
from hybridrl.workers.reward import RewardWorker
from hybridrl.workers.rollout import RolloutWorker

__all__ = ["ActorWorker", "CriticWorker", "ReferenceWorker", "RewardWorker", "RolloutWorker"]
