"""Place the roles of a run on their resource pools (``controller.pools`` /
``controller.placement``): the learner (``learner/learner.py``: policy, reference, critic and the
learning step), the rollout (``rollout/worker.py``: generation and scoring) and, with
``task.reward_model_path``, the reward model (``rollout/reward_model.py``; by default on the
rollout's pool), which every rollout rank's Scorer calls (:func:`connect_reward_model`).

* ``local`` backend: one WorkerGroup per role, all in the driver process.
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
from hybridrl.rollout.reward_model import (
    RewardModelClient,
    RewardModelWorker,
    attach_colocated,
    attach_reward_model,
)
from hybridrl.rollout.worker import RolloutWorker

# the worker class of each role named in the config's ROLES (controller.placement)
WORKER_CLASSES = {"learner": Learner, "rollout": RolloutWorker, "reward_model": RewardModelWorker}


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
    # a WorkerGroup or RoleView of RewardModelWorker (None: no task.reward_model_path)
    reward_model: RewardModelWorker | None = None

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

        # staging files released, torch.distributed left (the reward model holds neither: its
        # group's shutdown below is all it needs)
        for role in (self.learner, self.rollout):
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


def connect_reward_model(rollout, reward_model, weight: float) -> None:
    """Give every rollout rank's Scorer a reward-model rank to call (rank ``i % n``): the worker
    object beside it in one process (the ``local`` backend, or one colocated group holding both),
    else the rank's Ray actor (a colocated one reached through ``call_role``)."""
    if isinstance(reward_model, RoleView) and _group_of(rollout) is reward_model.group:
        reward_model.group.apply_all(attach_colocated, weight)
        return
    group = _group_of(reward_model)
    if group.backend_name == "local":
        clients = [RewardModelClient(worker) for worker in group.workers]
    else:
        route = ("call_role", "reward_model", "score") if group is not reward_model else ("score",)
        clients = [RewardModelClient(actor, route) for actor in group.workers]
    rollout.apply_all(attach_reward_model, clients, weight)


def build_roles(
    cfg: Config,
    policy_path: str | None,
    reference_path: str | None,
    critic_path: str | None = None,
    learner: bool = True,
) -> Roles:
    """Worker groups for the learner (unless ``learner`` is False: a run that only generates, e.g.
    ``hybridrl eval``), the rollout and the reward model (with ``task.reward_model_path``); roles
    mapped to the same pool share its processes (colocation) under the ``ray`` backend."""
    c = cfg.controller
    if learner and cfg.actor.pp_size > 1:  # the actor's ranks are a dp x pp mesh: refuse early
        from hybridrl.learner.pipeline_actor import check_config, model_layers

        p = c.pools[c.pool_of("learner")]
        check_config(cfg, p.nodes * p.workers_per_node, model_layers(cfg, policy_path))
    if c.backend == "ray":
        init_ray(c.ray_address)
    pools = {
        name: ResourcePool(name=name, **{k: v for k, v in vars(p).items() if k != "num_threads"})
        for name, p in c.pools.items()
    }
    args = {
        "learner": (cfg, policy_path, reference_path, critic_path),
        "rollout": (cfg, policy_path),
        "reward_model": (cfg,),
    }
    placed = ["learner", "rollout"] if learner else ["rollout"]
    placed += ["reward_model"] if cfg.task.reward_model_path else []
    by_pool: dict[str, list[str]] = {}
    for role in placed:
        by_pool.setdefault(c.pool_of(role), []).append(role)

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
    roles = Roles(
        learner=handles.get("learner"),
        rollout=handles["rollout"],
        reward_model=handles.get("reward_model"),
        groups=groups,
        pools=list(pools.values()),
    )
    if roles.reward_model is not None:
        try:
            connect_reward_model(roles.rollout, roles.reward_model, cfg.task.reward_model_weight)
        except BaseException:
            roles.shutdown()
            raise
    return roles
