"""Place the roles on their resource pools (``controller.pools`` / ``controller.placement``).

* ``local`` backend: one WorkerGroup per role, all in the driver process.
* ``ray`` backend: the roles mapped to one pool share one process per slot (a
  :class:`~hybridrl.workers.colocated.ColocatedWorker`, which makes trained roles and the rollout take
  turns on the device); a pool with a single role gets that role's own WorkerGroup. Any mix works:
  everything on one pool (colocated), rollout + reward on their own pool (disaggregated), ...

The driver sees one object per role either way (a WorkerGroup or a RoleView of the fused group) and
calls :meth:`Roles.sync_weights`, which picks the weight-sync path (``trainers/weight_sync.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridrl.algorithms import ADVANTAGES
from hybridrl.config import Config
from hybridrl.controller import ResourcePool, WorkerGroup, init_ray
from hybridrl.controller.colocated import RoleView
from hybridrl.trainers import weight_sync
from hybridrl.workers import ActorWorker, CriticWorker, ReferenceWorker, RewardWorker, RolloutWorker
from hybridrl.workers.colocated import TRAINED, ColocatedWorker
from hybridrl.workers.learner import LearnerWorker

ROLE_CLASSES = {
    "actor": ActorWorker,
    "reference": ReferenceWorker,
    "rollout": RolloutWorker,
    "reward": RewardWorker,
    "critic": CriticWorker,
}


@dataclass
class Roles:
    actor: WorkerGroup | RoleView
    reference: WorkerGroup | RoleView
    rollout: WorkerGroup | RoleView
    reward: WorkerGroup | RoleView
    critic: WorkerGroup | RoleView | None = None  # only for estimators that need values (gae)
    learner: WorkerGroup | None = (
        None  # asynchronous training: the trained roles fused (workers/learner.py)
    )
    groups: list[WorkerGroup] = field(
        default_factory=list
    )  # the processes behind the roles, each once
    pools: list[ResourcePool] = field(
        default_factory=list
    )  # their placement groups, released at shutdown
    transport: str = (
        "memory"  # weight sync: memory (one process), fused, shm (one node) or store (object store)
    )
    bucket_bytes: int = weight_sync.BUCKET_BYTES

    def __post_init__(self):
        actor, rollout = self.actor, self.rollout
        if (
            isinstance(actor, RoleView)
            and isinstance(rollout, RoleView)
            and actor.group is rollout.group
        ):
            self.transport = "fused"
        elif actor.backend_name == "ray":
            src, shm = actor.apply_all(weight_sync.where)[0]
            same = shm and all(node == src for node, _ in rollout.apply_all(weight_sync.where))
            self.transport = "shm" if same else "store"

    def sync_weights(self, version: int) -> None:
        """Actor -> rollout, bucketed and versioned (``trainers/weight_sync.py``: in memory, over the fused
        group, through a shared-memory staging file or through the object store)."""
        actor, rollout, ws = self.actor, self.rollout, weight_sync
        if self.transport == "fused":
            actor.group.apply_all(ws.sync_fused, version, self.bucket_bytes)
        elif self.transport == "memory":
            rollout.update_weights(actor.weight_buckets(self.bucket_bytes)[0], version)
        else:
            publish, load = (
                (ws.publish_shared, ws.load_shared)
                if self.transport == "shm"
                else (ws.publish, ws.load_published)
            )
            handle = actor.apply_all(publish, self.bucket_bytes)[0]
            rollout.apply_all(load, handle, version)

    def shutdown(self) -> None:
        """Close every role, stop every group and release every pool, even past failures (a dead rank,
        a close that raises); then raise the first failure, the later ones attached as notes. A group
        whose call failed gets no further close: its other roles would fail or wait the same way."""
        errors: list[Exception] = []
        failed: set[int] = set()

        def attempt(owner, fn, *args) -> None:
            if id(owner) in failed:
                return
            try:
                fn(*args)
            except Exception as exc:  # noqa: BLE001 - everything else must still be cleaned up
                errors.append(exc)
                if owner is not None:
                    failed.add(id(owner))

        if self.transport == "shm":
            attempt(None, self.actor.apply_all, weight_sync.release_stage)
        for role in (self.actor, self.reference, self.rollout, self.reward, self.critic):
            if (
                role is not None and role.world_size > 1 and "close" in role.methods
            ):  # leave torch.distributed cleanly
                attempt(_group_of(role), role.close)
        failed.clear()  # every group is killed and every pool released, whatever failed before
        for group in self.groups:
            attempt(group, group.shutdown)
        for pool in self.pools:
            attempt(pool, pool.release)
        if errors:
            for later in errors[1:]:
                errors[0].add_note(f"also failed during shutdown: {type(later).__name__}: {later}")
            raise errors[0]


def _group_of(role: WorkerGroup | RoleView) -> WorkerGroup:
    return role.group if isinstance(role, RoleView) else role


def needs_critic(cfg: Config) -> bool:
    return getattr(ADVANTAGES.get(cfg.algorithm.advantage), "needs_values", False)


def build_roles(
    cfg: Config,
    policy_path: str | None,
    reference_path: str | None,
    critic_path: str | None = None,
    learner: bool = False,
) -> Roles:
    """Worker groups for every role; roles mapped to the same pool share its devices (colocation).
    ``learner``: the trained roles (actor, reference, critic) become one LearnerWorker group on their pool
    (asynchronous training), under either backend."""
    c = cfg.controller
    if c.backend == "ray":
        init_ray(c.ray_address)
    pools = {
        name: ResourcePool(name=name, **{k: v for k, v in vars(p).items() if k != "num_threads"})
        for name, p in c.pools.items()
    }
    paths = {
        "actor": policy_path,
        "reference": reference_path,
        "rollout": policy_path,
        "reward": policy_path,
        "critic": critic_path or reference_path,
    }
    wanted = [r for r in ROLE_CLASSES if r != "critic" or needs_critic(cfg)]
    by_pool: dict[str, list[str]] = {}
    for role in wanted:
        by_pool.setdefault(c.placement[role], []).append(role)

    handles, groups = {}, []
    for pool, roles in by_pool.items():
        common = dict(
            backend=c.backend,
            num_threads=c.pools[pool].num_threads or c.num_threads,
            seed=cfg.trainer.seed,
            env={"HYBRIDRL_PG_TIMEOUT_S": str(c.pg_timeout_s)},
        )  # read by training/distributed.py on each rank
        if learner and "actor" in roles:
            trained = {r: (ROLE_CLASSES[r], (cfg, paths[r])) for r in roles if r in TRAINED}
            fused = WorkerGroup(
                LearnerWorker, pools[pool], role="learner", args=(trained, cfg), **common
            )
            groups.append(fused)
            handles |= {r: RoleView(fused, r, ROLE_CLASSES[r]) for r in trained} | {
                "learner": fused
            }
            roles = [r for r in roles if r not in TRAINED]
        if not roles:
            continue
        if c.backend == "local" or len(roles) == 1:
            for role in roles:
                handles[role] = WorkerGroup(
                    ROLE_CLASSES[role], pools[pool], role=role, args=(cfg, paths[role]), **common
                )
                groups.append(handles[role])
            continue
        parts = {role: (ROLE_CLASSES[role], (cfg, paths[role])) for role in roles}
        fused = WorkerGroup(
            ColocatedWorker, pools[pool], role="+".join(roles), args=(parts,), **common
        )
        groups.append(fused)
        handles |= {role: RoleView(fused, role, ROLE_CLASSES[role]) for role in roles}
    return Roles(**handles, groups=groups, pools=list(pools.values()))
