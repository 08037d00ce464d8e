"""Place the roles on their resource pools (``controller.pools`` / ``controller.placement``)."""
from __future__ import annotations

from dataclasses import dataclass

from hybridrl.algorithms import ADVANTAGES
from hybridrl.config import Config
from hybridrl.controller import ResourcePool, WorkerGroup, init_ray
from hybridrl.workers import ActorWorker, CriticWorker, ReferenceWorker, RewardWorker, RolloutWorker


@dataclass
class Roles:
    actor: WorkerGroup
    reference: WorkerGroup
    rollout: WorkerGroup
    reward: WorkerGroup
    critic: WorkerGroup | None = None  # only for estimators that need values (gae)

    def shutdown(self) -> None:
        for wg in (self.actor, self.reference, self.rollout, self.reward, self.critic):
            if wg is None:
                continue
            if wg.world_size > 1 and "close" in wg.methods:  # leave the torch.distributed group cleanly
                wg.close()
            wg.shutdown()


def needs_critic(cfg: Config) -> bool:
    return getattr(ADVANTAGES.get(cfg.algorithm.advantage), "needs_values", False)


def build_roles(cfg: Config, policy_path: str | None, reference_path: str | None, critic_path: str | None = None) -> Roles:
    """Worker groups for every role; roles mapped to the same pool share its devices (colocation)."""
    c = cfg.controller
    if c.backend == "ray":
        init_ray(c.ray_address)
    pools = {name: ResourcePool(name=name, **vars(p)) for name, p in c.pools.items()}

    def group(cls, role: str, path: str | None) -> WorkerGroup:
        return WorkerGroup(cls, pools[c.placement[role]], role=role, backend=c.backend, args=(cfg, path),
                           num_threads=c.num_threads, seed=cfg.trainer.seed)

    return Roles(
        actor=group(ActorWorker, "actor", policy_path),
        reference=group(ReferenceWorker, "reference", reference_path),
        rollout=group(RolloutWorker, "rollout", policy_path),
        reward=group(RewardWorker, "reward", policy_path),
        critic=group(CriticWorker, "critic", critic_path or reference_path) if needs_critic(cfg) else None,
    )
