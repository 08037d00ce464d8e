"""Place the two roles of a run on their resource pools (``controller.pools`` /
``controller.placement``): the learner (``learner/learner.py``: policy, reference, critic and the
learning step) and the rollout (``rollout/worker.py``: generation and scoring).

* ``local`` backend: one WorkerGroup per role, both in the driver process.
* ``ray`` backend: roles on different pools get their own WorkerGroups (disaggregated); roles on one
  pool share one process per slot, a :class:`~hybridrl.controller.colocated.ColocatedWorker`, in
  which they take turns on the device (colocated).

The driver sees one object per role either way (a WorkerGroup or a RoleView of the colocated group)
and calls :meth:`Roles.sync_weights`, which picks the weight-sync path
(``parallel/weight_sync.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridrl.config import Config
from hybridrl.controller import ResourcePool, WorkerGroup, init_ray
from hybridrl.controller.colocated import ColocatedWorker, RoleView
from hybridrl.learner.learner import Learner
from hybridrl.parallel import weight_sync
from hybridrl.rollout.worker import RolloutWorker

# the worker class of each role named in the config's ROLES (controller.placement)
WORKER_CLASSES = {"learner": Learner, "rollout": RolloutWorker}


@dataclass
class Roles:
    # a WorkerGroup or RoleView of Learner (None: a run that only generates)
    learner: Learner | None
    rollout: RolloutWorker  # a WorkerGroup or RoleView of RolloutWorker
    # the processes behind the roles, each once
    groups: list[WorkerGroup] = field(default_factory=list)
    # their placement groups, released at shutdown
    pools: list[ResourcePool] = field(default_factory=list)
    transport: str = "memory"  # weight sync: memory (one process), fused, shm (one node) or store

    def __post_init__(self):
        if self.learner is not None:
            self.transport = weight_sync.choose_transport(self.learner, self.rollout)

    def sync_weights(self, version: int) -> None:
        """Learner -> rollout, bucketed and versioned, through the transport each side holds
        (``parallel/weight_sync.py``); the driver passes only the handle (in one colocated group,
        not even that)."""
        if self.transport == "fused":
            self.learner.group.apply_all(sync_colocated, version)
            return
        handle = self.learner.publish_weights(self.transport, version)
        self.rollout.load_weights(self.transport, handle, version)

    def shutdown(self) -> None:
        """Close every role, stop every group and release every pool, even past failures (a dead
        rank, a close that raises); then raise the first failure, the later ones attached as notes.
        A group whose call failed gets no further close: its other roles would fail or wait the same
        way."""
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

        for role in (self.learner, self.rollout):  # staging files released, torch.distributed left
            if role is not None:
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


def sync_colocated(worker: ColocatedWorker, version: int) -> int:
    """On every rank of a colocated group: the learner publishes, the rollout beside it loads (rank
    0's buckets in memory, broadcast over the process group to the other ranks)."""
    learner, rollout = worker.parts["learner"], worker.parts["rollout"]
    handle = learner.publish_weights("fused", version)
    return rollout.load_weights("fused", handle, version)


def _group_of(role: WorkerGroup | RoleView) -> WorkerGroup:
    return role.group if isinstance(role, RoleView) else role


def build_roles(
    cfg: Config,
    policy_path: str | None,
    reference_path: str | None,
    critic_path: str | None = None,
    learner: bool = True,
) -> Roles:
    """Worker groups for the learner (unless ``learner`` is False: a run that only generates, e.g.
    ``hybridrl eval``) and the rollout; roles mapped to the same pool share its processes
    (colocation) under the ``ray`` backend."""
    c = cfg.controller
    if c.backend == "ray":
        init_ray(c.ray_address)
    pools = {
        name: ResourcePool(name=name, **{k: v for k, v in vars(p).items() if k != "num_threads"})
        for name, p in c.pools.items()
    }
    args = {
        "learner": (cfg, policy_path, reference_path, critic_path),
        "rollout": (cfg, policy_path),
    }
    by_pool: dict[str, list[str]] = {}
    for role in WORKER_CLASSES if learner else ("rollout",):
        by_pool.setdefault(c.placement[role], []).append(role)

    handles, groups = {}, []
    for pool, roles in by_pool.items():
        common = dict(
            backend=c.backend,
            num_threads=c.pools[pool].num_threads or c.num_threads,
            seed=cfg.trainer.seed,
            env={
                "HYBRIDRL_PG_TIMEOUT_S": str(c.pg_timeout_s)
            },  # read by parallel/distributed.py on each rank
        )
        if c.backend == "local" or len(roles) == 1:
            for role in roles:
                handles[role] = WorkerGroup(
                    WORKER_CLASSES[role], pools[pool], role=role, args=args[role], **common
                )
                groups.append(handles[role])
            continue
        parts = {role: (WORKER_CLASSES[role], args[role]) for role in roles}
        fused = WorkerGroup(
            ColocatedWorker, pools[pool], role="+".join(roles), args=(parts,), **common
        )
        groups.append(fused)
        handles |= {role: RoleView(fused, role, WORKER_CLASSES[role]) for role in roles}
    return Roles(
        learner=handles.get("learner"),
        rollout=handles["rollout"],
        groups=groups,
        pools=list(pools.values()),
    )
