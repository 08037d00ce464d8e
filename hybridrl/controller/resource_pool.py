"""A :class:`ResourcePool` is a named set of device slots, ``nodes x
workers_per_node``. WorkerGroups are placed on pools; several groups placed on
the same pool are *colocated*: rank ``r`` of each group lands on slot ``r``.

Under the ``local`` backend a pool only supplies its world size. Under the
``ray`` backend it lazily reserves its slots as placement groups:

* one placement group per node, ``workers_per_node`` bundles of
  ``{CPU: cpus_per_worker, GPU: gpus_per_worker}`` each, strategy
  ``STRICT_PACK`` so that one node's ranks share a machine (intra-node
  collectives, one ``nodes=1`` pool never straddles machines);
* rank ``r`` -> placement group ``r // workers_per_node``, bundle
  ``r % workers_per_node``.

Distinct node groups are not forced onto distinct machines (Ray has no
"k bundles per node" strategy); on a cluster of equal machines sized to the
pool they end up on different ones. An actor asks its bundle for only
``1 / max_colocate`` of the bundle's resources, so up to ``max_colocate``
groups fit on one pool.

``resources`` adds custom Ray resources to every bundle: a pool asking for
``{"node1": 0.01}`` per worker only lands on nodes started with a ``node1``
resource (how a pool is pinned to a node or a kind of machine).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# seconds to wait for the cluster to grant a pool's placement groups
PLACEMENT_TIMEOUT_S = 120.0


@dataclass
class ResourcePool:
    name: str = "global"
    nodes: int = 1
    workers_per_node: int = 1
    cpus_per_worker: float = 1
    gpus_per_worker: float = 0
    max_colocate: int = 8  # how many WorkerGroups may share this pool (ray)
    # custom Ray resources per worker (node pinning)
    resources: dict[str, float] = field(default_factory=dict)
    _placement_groups: list[Any] = field(
        default_factory=list, init=False, repr=False, compare=False
    )

    def __post_init__(self):
        if self.nodes < 1 or self.workers_per_node < 1:
            raise ValueError(f"pool {self.name!r}: nodes and workers_per_node must be >= 1")
        if (
            self.cpus_per_worker < 0
            or self.gpus_per_worker < 0
            or self.cpus_per_worker + self.gpus_per_worker <= 0
        ):
            raise ValueError(f"pool {self.name!r}: each worker needs some CPU or GPU")
        if any(v <= 0 for v in self.resources.values()):
            raise ValueError(
                f"pool {self.name!r}: custom resources must be > 0, got {self.resources}"
            )
        if self.max_colocate < 1:
            raise ValueError(f"pool {self.name!r}: max_colocate must be >= 1")

    @property
    def world_size(self) -> int:
        return self.nodes * self.workers_per_node

    def bundle(self) -> dict[str, float]:
        """Resources reserved for one slot."""
        out = {"CPU": float(self.cpus_per_worker)}
        if self.gpus_per_worker:
            out["GPU"] = float(self.gpus_per_worker)
        out.update({k: float(v) for k, v in self.resources.items()})
        return {k: v for k, v in out.items() if v > 0}

    def actor_resources(self) -> dict[str, float]:
        """What one actor asks of its bundle: a ``1/max_colocate`` share."""
        share = {k: v / self.max_colocate for k, v in self.bundle().items()}
        out = {"num_cpus": share.pop("CPU", 0.0), "num_gpus": share.pop("GPU", 0.0)}
        return out | ({"resources": share} if share else {})

    # --- ray placement -----------------------------------------------------
    def placement(self, rank: int) -> tuple[Any, int]:
        """``(placement_group, bundle_index)`` of slot ``rank``; reserves the
        pool's placement groups on first use (needs an initialised Ray)."""
        if not 0 <= rank < self.world_size:
            raise IndexError(f"pool {self.name!r} has {self.world_size} slots, no rank {rank}")
        if not self._placement_groups:
            self._reserve()
        return self._placement_groups[rank // self.workers_per_node], rank % self.workers_per_node

    def _reserve(self) -> None:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        pgs = [
            placement_group(
                [self.bundle()] * self.workers_per_node,
                strategy="STRICT_PACK",
                name=f"{self.name}-node{n}",
            )
            for n in range(self.nodes)
        ]
        try:
            ray.get([pg.ready() for pg in pgs], timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            for pg in pgs:
                remove_placement_group(pg)
            raise RuntimeError(
                f"pool {self.name!r} could not reserve {self.nodes} node(s) x "
                f"{self.workers_per_node} x {self.bundle()} "
                f"within {PLACEMENT_TIMEOUT_S:.0f} s; cluster has {ray.available_resources()} "
                "available"
            ) from None
        self._placement_groups = pgs

    def release(self) -> None:
        """Give the pool's placement groups back to Ray (kills actors still
        placed on them). Safe to call twice, or without Ray."""
        if not self._placement_groups:
            return
        import ray
        from ray.util.placement_group import remove_placement_group

        if ray.is_initialized():
            for pg in self._placement_groups:
                remove_placement_group(pg)
        self._placement_groups = []
