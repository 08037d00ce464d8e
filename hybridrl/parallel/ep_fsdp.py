"""Expert parallelism composed with FSDP2 (``moe.ep_size``, docs/moe.md): the sharding of a model
(or of a rank's pipeline stages) whose experts are split over ranks, on the groups of
``parallel/mesh.py``:

* the dense parameters (attention, norms, routers, embeddings and head) are sharded over ``dp``
  exactly as without EP (``parallel/fsdp.py``: one FSDP unit per decoder layer plus the root);
* every layer's experts are split over ``ep`` (``Shard(0)``: EP rank ``e`` holds experts
  ``e·E/ep ..``), and the ranks holding the same experts shard them further with FSDP over
  ``efsdp`` (on dim 1, so that the layout stays two plain shardings, ``(Shard(1), Shard(0))``,
  which ``full_tensor()`` and DCP read like any other).

Each experts module is its own FSDP unit over ``efsdp``; its decoder layer's unit then leaves its
parameters alone. Gradients are summed everywhere (divide factor 1): every rank's loss carries
the global normalisation, the all-to-all's backward sums the EP group's contributions to its
experts, and FSDP adds the other EP groups' (over ``efsdp``) and every rank's for the dense part,
so each gradient is the single-process one."""

from __future__ import annotations

from torch import nn

from hybridrl.config import FSDPConfig
from hybridrl.moe import ep as ep_lib
from hybridrl.parallel.fsdp import mixed_precision_policy, shard_modules
from hybridrl.parallel.mesh import ModelMesh


def shard_with_experts(
    model: nn.Module, layers: list[nn.Module], mesh: ModelMesh, cfg: FSDPConfig, device, bf16=False
) -> nn.Module:
    """Split ``model``'s experts over ``mesh.ep``, shard them over ``mesh.efsdp``, and shard the
    rest (``layers`` as units, then ``model`` as the root) over ``mesh.dp`` (the module docstring
    has the layout); every rank of the mesh must call."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    ep = mesh.ep.size()
    if cfg.strategy != "fsdp2":
        raise ValueError(f"moe.ep_size={ep} needs fsdp.strategy 'fsdp2' (got {cfg.strategy!r})")
    model.to(device)
    efsdp = mesh.efsdp.size()
    for module in ep_lib.install(model, mesh.ep, ep):
        for name in ep_lib.EXPERT_PARAMS:
            dim1 = getattr(module, name).shape[1]
            if dim1 % efsdp:
                raise ValueError(
                    f"moe.ep_size={ep}: {name} dim 1 ({dim1}) must divide by the data-parallel "
                    f"size / ep_size = {efsdp}"
                )
        fully_shard(
            module,
            mesh=mesh.efsdp,
            reshard_after_forward=cfg.sharding == "full",
            shard_placement_fn=lambda p: Shard(1),
            mp_policy=mixed_precision_policy(bf16 and device.type == "cuda"),
        )
    return shard_modules(model, layers, mesh.dp, cfg, device, bf16)
