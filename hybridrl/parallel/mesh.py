"""The learner's device mesh: one object (:class:`ParallelDims`) holds the sizes of every
parallel dimension and builds every process group a model is sharded, split or pipelined over, so
the dimensions compose (data x expert x pipeline).

Dimensions, for ``world`` learner ranks, ``pp`` pipeline stages (``actor.pp_size``) and ``ep``
ranks per expert group (``moe.ep_size``):

* ``pp``: the pipeline ranks of one data-parallel replica; ``dp = world / pp`` replicas;
* ``ep``: the ranks of one replica dimension that split every MoE layer's experts
  (``Shard(0)``, ``moe/ep.py``), so ``ep`` must divide ``dp``;
* ``efsdp = dp / ep``: the ranks holding the same experts, which shard them further with FSDP2
  (``Shard(1)``);
* ``dp``: every replica, ``efsdp x ep`` flattened; FSDP2 shards the dense parameters (attention,
  norms, routers, embeddings, head) over it.

Global rank ``r`` of the pipelined layout is ``((f * ep) + e) * pp + s``: pipeline rank ``s``
(consecutive ranks form a replica, as ``parallel/pipeline.py`` numbers them), EP rank ``e``,
experts' FSDP rank ``f``. A model that is not pipelined (the reference and the critic beside a
pipelined policy, or every model when ``pp`` is 1) runs on every rank as data parallelism:
``world`` ranks, ``r = f * ep + e``.

Expert parameters are DTensors on the ``ep`` dimension and FSDP2 shards them over ``efsdp``;
FSDP2 composes the two only when both are slices of one parent mesh, which is why both come
from the one mesh built here. Each mesh is built once, on first use, with the run's collective
timeout on every group (``HYBRIDRL_PG_TIMEOUT_S``; torch's default for a new group is 30 minutes).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from functools import cached_property

import torch.distributed as dist

from hybridrl.moe.ep import check_ep_size


@dataclass(frozen=True)
class ModelMesh:
    """The groups one model is laid out over: ``dp`` (1-D) shards its dense parameters; ``ep`` and
    ``efsdp`` (1-D slices of one parent, None without expert parallelism) split and shard its
    experts; ``pp`` (1-D, None when the model is not pipelined) joins its pipeline ranks."""

    dp: object
    ep: object | None = None
    efsdp: object | None = None
    pp: object | None = None


class ParallelDims:
    """The learner's parallel dimensions and their meshes (module docstring). ``backend``: the
    group's backend ("gloo", "nccl"), or None for torch's default options."""

    def __init__(
        self, world: int, pp: int = 1, ep: int = 1, device_type: str = "cpu", backend=None
    ):
        if pp < 1 or world % pp:
            raise ValueError(
                f"actor.pp_size={pp} does not divide the actor's world size {world} "
                "(the ranks form a data-parallel x pp_size mesh)"
            )
        dp = world // pp
        check_ep_size(ep, dp, None)
        self.world, self.pp, self.ep, self.dp = world, pp, ep, dp
        self.device_type, self.backend = device_type, backend

    @classmethod
    def of(cls, env, pp: int = 1, ep: int = 1) -> ParallelDims:
        """For the ranks of ``env`` (a :class:`~hybridrl.parallel.distributed.DistEnv`)."""
        return cls(env.world_size, pp, ep, env.device.type, env.backend)

    @cached_property
    def pipelined(self) -> ModelMesh | None:
        return self._build(self.pp)

    @cached_property
    def unpipelined(self) -> ModelMesh | None:
        return self._build(1)

    def _build(self, pp: int) -> ModelMesh | None:
        if not dist.is_initialized():  # one process without a group: nothing to shard over
            return None
        data = (("efsdp", self.world // pp // self.ep), ("ep", self.ep)) if self.ep > 1 else ()
        dims = (data or (("dp", self.world // pp),)) + ((("pp", pp),) if pp > 1 else ())
        mesh = self._init(dims)
        pipe = mesh["pp"] if pp > 1 else None
        if self.ep == 1:
            return ModelMesh(mesh["dp"] if pp > 1 else mesh, pp=pipe)
        experts = mesh["efsdp", "ep"] if pp > 1 else mesh
        dp = experts._flatten("dp", backend_override=self._override())
        return ModelMesh(dp, mesh["ep"], mesh["efsdp"], pipe)

    def _override(self):
        """The run's timeout on a new group (None: torch's defaults)."""
        if self.backend is None:
            return None
        gloo = self.backend == "gloo"
        opts = dist.ProcessGroupGloo._Options() if gloo else dist.ProcessGroupNCCL.Options()
        from hybridrl.parallel import distributed

        opts._timeout = datetime.timedelta(seconds=distributed.pg_timeout_s())
        return (self.backend, opts)

    def _init(self, dims):
        from torch.distributed.device_mesh import init_device_mesh

        names, shape = zip(*dims)
        override = self._override()
        return init_device_mesh(
            self.device_type,
            shape,
            mesh_dim_names=names,
            backend_override={n: override for n in names} if override else None,
        )
