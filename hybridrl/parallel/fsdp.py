"""The FSDP2 training engine: sharding a transformers model with ``fully_shard``, its compute
precision, gradient clipping over the shards, and gathering its full weights in bounded buckets.

Sharding (``FSDPConfig.sharding``), in ZeRO's terms
(Rajbhandari et al. 1910.02054; Ψ parameters, N ranks):

* ``full``: ZeRO-3-like. Parameters, gradients and optimizer states sharded; each decoder layer's
  parameters are all-gathered for its forward, freed after it (``reshard_after_forward=True``) and
  gathered again for its backward.
* ``grad_op``: ZeRO-2-like. Gradients and optimizer states sharded; the unsharded parameters stay
  from forward to backward (``reshard_after_forward=False``): one all-gather less per layer,
  more memory between forward and backward.

Every decoder layer is one FSDP unit (its own all-gather / reduce-scatter), the root holds the
rest (embeddings, final norm, a tied or untied LM head). Gradients are *summed* over ranks (the
divide factor is 1): each rank's loss is already normalised by the global mini-batch totals
(see ``learner/update.py``), so the sum over ranks is the single-process gradient.

World size 1 never wraps: the model stays an ordinary module (``strategy: none`` semantics), so
the single-process path is unchanged. Sharded checkpoints of a wrapped model (DCP save / load,
``export_hf``) are in ``parallel/sharded_checkpoint.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from hybridrl.config import FSDPConfig
from hybridrl.parallel import distributed
from hybridrl.parallel.buckets import BUCKET_BYTES, bucketed
from hybridrl.parallel.distributed import DistEnv
from hybridrl.parallel.mesh import ModelMesh, ParallelDims

log = logging.getLogger(__name__)


def fsdp_config_of(cfg) -> FSDPConfig:
    """The run's sharding settings (``cfg.fsdp``), or the defaults for objects without them."""
    return getattr(cfg, "fsdp", None) or FSDPConfig()


# --- wrapping -------------------------------------------------------------------------------------
def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks (``model.model.layers`` for Qwen2/Llama-style transformers
    models)."""
    base = getattr(model, getattr(model, "base_model_prefix", ""), None) or model
    layers = getattr(base, "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers):
        return list(layers)
    # any other architecture: the longest ModuleList of identical blocks
    for module in model.modules():
        if (
            isinstance(module, nn.ModuleList)
            and len(module) > 1
            and len({type(m) for m in module}) == 1
        ):
            return list(module)
    raise ValueError(f"{type(model).__name__}: found no list of decoder layers to shard")


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Recompute every decoder layer in backward (only the layer inputs are kept: O(L)
    activations). A mixture-of-experts layer is recomputed with its forward's routing
    (``moe/routing.py``: :func:`~hybridrl.moe.routing.checkpoint_context`)."""
    from hybridrl.moe.routing import checkpoint_context, moe_gates

    kwargs = {"use_reentrant": False}
    if moe_gates(model):
        kwargs["context_fn"] = checkpoint_context(model)
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.20
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        raise TypeError(
            f"{type(model).__name__} is not a transformers model: "
            "no per-layer activation checkpointing"
        )
    if getattr(model, "config", None) is not None:
        model.config.use_cache = False


def mixed_precision_policy(bf16: bool):
    """FSDP2's parameter / reduction dtypes: bf16 parameters with fp32 reduction when ``bf16`` (a
    CUDA rank whose ``fsdp.mixed_precision`` resolves to bf16), else fp32. On a CPU always fp32:
    bf16 there is autocast over fp32 parameters (:func:`prepare_model`), so gathers, gradients and
    optimizer state stay fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if not bf16:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def device_precision_of(model: nn.Module, cfg: FSDPConfig, device: torch.device):
    """The compute precision ``fsdp.mixed_precision`` resolves to on ``device``: on CUDA bf16 where
    the GPU has it natively (``auto``); on the CPU :func:`cpu_precision_of`; elsewhere fp32."""
    from hybridrl.parallel import precision

    if device.type == "cuda":
        return precision.cuda_precision(
            cfg.mixed_precision, key="fsdp.mixed_precision", device=device
        )
    if device.type == "cpu":
        return cpu_precision_of(model, cfg)
    return precision.Precision(torch.float32, f"fsdp.mixed_precision on {device.type}")


def cpu_precision_of(model: nn.Module, cfg: FSDPConfig):
    """The CPU compute precision ``fsdp.mixed_precision`` resolves to for ``model`` (still
    unsharded: ``auto`` measures forward + backward of a copy of one of its layers,
    ``parallel/precision.py``). With a process group, ``auto`` gives bf16 only if every rank
    measured it so, so that the ranks of a role compute alike. Every rank must call."""
    from hybridrl.parallel import precision

    prec = precision.cpu_precision(
        cfg.mixed_precision, model, train=True, key="fsdp.mixed_precision"
    )
    if (
        cfg.mixed_precision == "auto"
        and distributed.world_size() > 1
        and int(distributed.all_reduce([0.0 if prec.bf16 else 1.0], op="max")[0].item())
        and prec.bf16
    ):
        prec = precision.Precision(
            torch.float32, prec.reason + "; another rank measured less, so fp32 on every rank"
        )
    return prec


def prepare_model(
    model: nn.Module,
    cfg: FSDPConfig,
    env: DistEnv,
    *,
    trainable: bool = True,
    mesh: ModelMesh | None = None,
) -> nn.Module:
    """Activation checkpointing (when trained and asked for), then ``fully_shard`` per decoder
    layer + root when the rank has a process group (world size > 1, or a launcher-made group of one:
    e.g. one GPU with CPU offload); no group: the module moved to ``env.device``, unwrapped.
    ``fsdp.mixed_precision`` resolves per device (:func:`device_precision_of`); at bf16 a sharded
    model on CUDA gets FSDP2's bf16 parameters with fp32 reduction (:func:`mixed_precision_policy`),
    and an unsharded one (one GPU, or any CPU rank) is marked for bf16 autocast over its fp32
    parameters (fp32 master weights, gradients and optimizer state). One log line says which
    precision runs and why. ``mesh``: the groups to shard over (the learner's
    ``ParallelDims``, ``parallel/mesh.py``; with an ``ep`` dimension, expert parallelism:
    ``parallel/ep_fsdp.py``); None: data parallelism over ``env``'s ranks."""
    from hybridrl.parallel.precision import set_autocast

    what = "training" if trainable else "reference / log-prob"
    # the reference follows the actor's verdict (the same rule, or on a CPU the same forward +
    # backward measurement, cached): at equal weights its log-probs equal the actor's, so the KL
    # term starts at exactly 0
    prec = device_precision_of(model, cfg, env.device)
    model = _prepare(model, cfg, env, trainable, prec.bf16, mesh)
    if is_sharded(model) and env.device.type == "cuda":
        params = "bf16 params + fp32 reduce" if prec.bf16 else "fp32"
        log.info("%s precision: %s (FSDP2; %s)", what, params, prec.reason)
        return set_autocast(model, None)
    log.info(prec.describe(what))
    return set_autocast(model, torch.bfloat16 if prec.bf16 else None, env.device.type)


def _prepare(
    model: nn.Module, cfg: FSDPConfig, env: DistEnv, trainable: bool, bf16: bool, mesh
) -> nn.Module:
    if trainable and cfg.activation_checkpointing:
        enable_activation_checkpointing(model)
    if mesh is not None and mesh.ep is not None:  # moe.ep_size: experts split over ranks
        from hybridrl.parallel.ep_fsdp import shard_with_experts

        return shard_with_experts(model, decoder_layers(model), mesh, cfg, env.device, bf16)
    if env.backend is None or (cfg.strategy == "none" and not env.distributed):
        return model.to(env.device)
    if cfg.strategy != "fsdp2":
        raise ValueError(
            f"world size {env.world_size} needs fsdp.strategy 'fsdp2' (got {cfg.strategy!r})"
        )
    mesh = mesh or ParallelDims.of(env).unpipelined
    shard_modules(model, decoder_layers(model), mesh.dp, cfg, env.device, bf16)
    return model


def shard_modules(
    model: nn.Module,
    layers: list[nn.Module],
    mesh,
    cfg: FSDPConfig | None,
    device: torch.device,
    bf16: bool = False,
) -> nn.Module:
    """``fully_shard`` each of ``layers``, then ``model`` as the root, over ``mesh`` (1-D: the whole
    group, or the data-parallel dimension of a pipeline's mesh), with gradients summed over it."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard

    cfg = cfg or FSDPConfig()
    # on a CPU-only rank everything is in CPU memory anyway
    offload = cfg.cpu_offload and device.type == "cuda"
    common = dict(
        mesh=mesh,
        mp_policy=mixed_precision_policy(bf16 and device.type == "cuda"),
        offload_policy=CPUOffloadPolicy(pin_memory=True) if offload else OffloadPolicy(),
    )
    reshard = cfg.sharding == "full"
    for layer in layers:
        fully_shard(layer, reshard_after_forward=reshard, **common)
    # the root's parameters (embeddings, final norm, head) are used last in forward and first in
    # backward: keeping them gathered in between saves one all-gather (it costs the unsharded root
    # until backward)
    fully_shard(model, reshard_after_forward=False, **common)
    # every unit: sum over ranks (losses carry the global normalisation)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
    return model


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def clip_grad_norm(model: nn.Module, max_norm: float) -> float:
    """Clip the global gradient norm (over all ranks' shards) to ``max_norm`` (0: measure only); the
    norm before."""
    params = [p for p in model.parameters() if p.grad is not None]
    groups = _by_mesh(params)
    if len(groups) <= 1:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm or float("inf"))
        return float((norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item())
    total = grad_norm([p.grad for p in params])
    if max_norm:
        for group in groups.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return float(total.item())


def grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of ``grads`` over every rank's shards, a plain tensor (a collective when they
    are DTensors). Expert parallelism leaves the experts' gradients on another mesh than the
    dense ones, and DTensor ops do not mix meshes: each mesh's norm is taken on its own, then
    combined."""
    norms = []
    for group in _by_mesh(grads).values():
        n = torch.nn.utils.get_total_norm(group, 2.0)
        norms.append(n.full_tensor() if hasattr(n, "full_tensor") else n)
    if len(norms) <= 1:
        return norms[0] if norms else torch.zeros(())
    return torch.linalg.vector_norm(torch.stack(norms))


def _by_mesh(tensors: list[torch.Tensor]) -> dict[int, list[torch.Tensor]]:
    """``tensors`` (or parameters, by their gradient's) grouped by the DeviceMesh they live on."""
    out: dict[int, list[torch.Tensor]] = {}
    for t in tensors:
        g = t.grad if isinstance(t, nn.Parameter) else t
        out.setdefault(id(getattr(g, "device_mesh", None)), []).append(t)
    return out


# --- full weights ---------------------------------------------------------------------------------
def _full(p: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The unsharded value of a parameter (a collective when it is a DTensor: every rank must
    call)."""
    from torch.distributed.tensor import DTensor

    p = p.detach()
    if not isinstance(p, DTensor):
        return p
    local = p.to_local()
    if local.device != device:  # CPU-offloaded shard: gather on the compute device
        p = DTensor.from_local(
            local.to(device), p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
        )
    return p.full_tensor()


def iter_weight_buckets(
    model: nn.Module,
    bucket_bytes: int = BUCKET_BYTES,
    *,
    device: torch.device | None = None,
    dst: int = 0,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The full parameters as buckets of ``(name, tensor)`` of at most ``bucket_bytes`` (or one
    tensor), cut by :func:`hybridrl.parallel.buckets.bucketed`.

    Every rank must iterate to the end (each sharded parameter is one all-gather); rank ``dst`` gets
    the tensors (on the CPU when sharded), every other rank gets empty buckets in the same rhythm.
    Only one bucket is held at a time. Names are the model's own (``named_parameters``; a tied head
    appears once). An unsharded model yields its parameters themselves (detached, no copy).
    """
    sharded = is_sharded(model)
    device = device or next(model.parameters()).device
    if (
        sharded
        and device.type == "cpu"
        and torch.cuda.is_available()
        and dist.get_backend() == "nccl"
    ):
        device = torch.device("cuda", torch.cuda.current_device())

    def full_values() -> Iterator[tuple[str, torch.Tensor]]:
        for name, p in model.named_parameters():
            full = _full(p, device)
            yield name, (full.cpu() if sharded else full)

    yield from bucketed(full_values(), bucket_bytes, keep=distributed.rank() == dst)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict on the CPU of rank 0 (other ranks: ``{}``); every rank must call."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if not is_sharded(model):
        return {k: v.detach() for k, v in model.state_dict().items()}
    sd = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    return sd if distributed.rank() == 0 else {}
