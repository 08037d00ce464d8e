"""Expert parallelism composed with FSDP2 (``moe.ep_size``, docs/moe.md): the learner's mesh and
the sharding of a model whose experts are split over ranks.

Two meshes over the same ranks:

* the **dense** mesh, 1-D over all N ranks: attention, norms, routers, embeddings and head are
  sharded over it exactly as without EP (``parallel/fsdp.py``: one FSDP unit per decoder layer plus
  the root);
* the **experts'** mesh, 2-D ``(N / ep, ep)`` named :data:`EP_DIMS`: ranks ``r`` with the same
  ``r // ep`` form an EP group and split every layer's experts (``Shard(0)`` over ``ep``, rank
  ``r % ep`` holding experts ``(r % ep)·E/ep ..``); ranks with the same ``r % ep`` hold the same
  experts and shard them further with FSDP over ``efsdp`` (on dim 1, so that the layout stays two
  plain shardings, ``(Shard(1), Shard(0))``, which ``full_tensor()`` and DCP read like any other).

Each experts module is its own FSDP unit over ``efsdp``; its decoder layer's unit then leaves its
parameters alone. Gradients are summed everywhere (divide factor 1): every rank's loss carries
the global normalisation, the all-to-all's backward sums the EP group's contributions to its
experts, and FSDP adds the other EP groups' (over ``efsdp``) and every rank's for the dense part,
so each gradient is the single-process one.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist
from torch import nn

from hybridrl.config import FSDPConfig
from hybridrl.moe import ep as ep_lib
from hybridrl.parallel import distributed
from hybridrl.parallel.distributed import DistEnv
from hybridrl.parallel.fsdp import decoder_layers, mixed_precision_policy, shard_modules

# the experts' mesh: FSDP over the first dimension, experts split over the second
EP_DIMS = ("efsdp", "ep")


def expert_mesh(env: DistEnv, ep_size: int):
    """The 2-D ``(world / ep_size, ep_size)`` mesh named :data:`EP_DIMS`. Its groups get the run's
    collective timeout (``HYBRIDRL_PG_TIMEOUT_S``), like the default group (torch's default for a
    new group is 30 minutes)."""
    from torch.distributed.device_mesh import init_device_mesh

    ep_lib.check_ep_size(ep_size, env.world_size, None)
    gloo = env.backend == "gloo"
    opts = dist.ProcessGroupGloo._Options() if gloo else dist.ProcessGroupNCCL.Options()
    opts._timeout = datetime.timedelta(seconds=distributed.pg_timeout_s())
    override = {name: (env.backend, opts) for name in EP_DIMS}
    shape = (env.world_size // ep_size, ep_size)
    return init_device_mesh(
        env.device.type, shape, mesh_dim_names=EP_DIMS, backend_override=override
    )


def shard_with_experts(
    model: nn.Module, cfg: FSDPConfig, env: DistEnv, ep_size: int, bf16: bool = False
) -> nn.Module:
    """Split ``model``'s experts over EP groups of ``ep_size`` ranks and shard the rest with FSDP2
    (the module docstring has the layout); every rank must call."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    if env.backend is None or cfg.strategy != "fsdp2":
        raise ValueError(
            f"moe.ep_size={ep_size} needs a process group of several ranks and fsdp.strategy "
            f"'fsdp2' (world size {env.world_size}, strategy {cfg.strategy!r})"
        )
    model.to(env.device)
    mesh = expert_mesh(env, ep_size)
    efsdp = mesh["efsdp"].size()
    for module in ep_lib.install(model, mesh["ep"], ep_size):
        for name in ep_lib.EXPERT_PARAMS:
            dim1 = getattr(module, name).shape[1]
            if dim1 % efsdp:
                raise ValueError(
                    f"moe.ep_size={ep_size}: {name} dim 1 ({dim1}) must divide by world size / "
                    f"ep_size = {efsdp}"
                )
        fully_shard(
            module,
            mesh=mesh["efsdp"],
            reshard_after_forward=cfg.sharding == "full",
            shard_placement_fn=lambda p: Shard(1),
            mp_policy=mixed_precision_policy(bf16 and env.device.type == "cuda"),
        )
    dense = init_device_mesh(env.device.type, (env.world_size,))
    return shard_modules(model, decoder_layers(model), dense, cfg, env.device, bf16)
