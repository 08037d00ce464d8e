"""The placement of the processes: ``controller`` and its resource pools (``PoolConfig``), and
the roles a run places."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from hybridrl.config.sections.common import (
    MAX_THREADS,
    _f,
)


@dataclass
class PoolConfig:
    nodes: int = _f(1, "number of nodes", ge=1)
    workers_per_node: int = _f(1, "worker processes per node", ge=1)
    cpus_per_worker: float = _f(1.0, "CPUs reserved per worker (ray backend)", gt=0)
    gpus_per_worker: float = _f(0.0, "GPUs reserved per worker (ray backend)", ge=0)
    resources: dict[str, float] = _f(
        {},
        "custom Ray resources reserved per worker, e.g. {node1: 0.01}: pins the pool to nodes "
        "offering them (ray backend)",
    )
    num_threads: int | None = _f(
        None,
        "torch threads of this pool's workers (null: controller.num_threads)",
        ge=1,
        le=MAX_THREADS,
    )


# the processes a run places: the trained models, the generation, the reward model
ROLES = ("learner", "rollout", "reward_model")
# roles placed only when configured (task.reward_model_path), and whose pool they take when unplaced
OPTIONAL_ROLES = {"reward_model": "rollout"}
FORMER_ROLES = {  # placement keys of earlier versions, and what replaced them
    "actor": (
        "the actor, reference and critic are parts of the learner: "
        "place them with placement.learner"
    ),
    "reference": "the reference is part of the learner: place it with placement.learner",
    "critic": "the critic is part of the learner: place it with placement.learner",
    "reward": "samples are scored on the rollout ranks that generate them: drop placement.reward",
}


@dataclass
class ControllerConfig:
    backend: Literal["local", "ray"] = _f(
        "local", "local: every worker in the driver process; ray: Ray actors"
    )
    ray_address: str | None = _f(None, "join this Ray cluster instead of starting a local one")
    num_threads: int = _f(2, "torch threads per worker process", ge=1, le=MAX_THREADS)
    pools: dict[str, PoolConfig] = field(
        default_factory=lambda: {"global": PoolConfig()},
        metadata={"help": "resource pools by name"},
    )
    placement: dict[str, str] = _f(
        {r: "global" for r in ROLES if r not in OPTIONAL_ROLES},
        "role -> pool name: learner (policy, reference, critic and the learning step), rollout "
        "(generation and scoring), reward_model (only with task.reward_model_path; default: the "
        "rollout's pool); roles on one pool are colocated",
    )
    pg_timeout_s: float = _f(
        600.0,
        "seconds a torch.distributed collective or rendezvous waits for a missing peer before it "
        "fails (ray backend, world size > 1)",
        gt=0,
    )

    def validate(self) -> None:
        former = [r for r in self.placement if r in FORMER_ROLES]
        if former:
            raise ValueError(f"placement.{former[0]}: {FORMER_ROLES[former[0]]}")
        missing = [r for r in ROLES if r not in self.placement and r not in OPTIONAL_ROLES]
        if missing:
            raise ValueError(
                f"placement lacks role(s) {missing}; every role of "
                f"{[r for r in ROLES if r not in OPTIONAL_ROLES]} needs a pool"
            )
        for role, pool in self.placement.items():
            if role not in ROLES:
                raise ValueError(
                    f"placement names unknown role {role!r} (roles: {', '.join(ROLES)})"
                )
            if pool not in self.pools:
                raise ValueError(
                    f"placement.{role} names pool {pool!r}, which is not in pools "
                    f"({', '.join(self.pools)})"
                )

    def pool_of(self, role: str) -> str:
        """The pool of ``role``; an optional role left out takes the pool of the role it follows."""
        return self.placement.get(role) or self.placement[OPTIONAL_ROLES[role]]
