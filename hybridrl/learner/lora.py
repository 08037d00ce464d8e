"""LoRA on the actor (PEFT): wrapping, adapter-only weight sync, checkpoints.

``actor.lora_rank`` r > 0 wraps the policy with PEFT LoRA on ``actor.lora_target_modules`` (Linear
layers): every target W (out x in) gets A (r x in) and B (out x r, zero at start), the forward is
``W x + scale * B A dropout(x)`` with ``scale = lora_alpha / r``; only A and B are trainable and the
optimizer holds only them. The wrapping happens before ``prepare_model``, so with world size > 1
FSDP2 shards the PEFT model like any other (frozen base weights and trainable adapters in the same
per-layer unit; only the adapters get gradients, reduce-scattered).

Weight sync (``lora_weight_buckets``): the adapters only, as ``(name, tensor)`` pairs in
transformers naming of the adapted module, ``<module>.lora_A`` (r x in), ``<module>.lora_B``
(out x r) and ``<module>.lora_scaling`` (0-d float32). The rollout engine merges them into its own
copy of the base weights (``RolloutEngine.merge_adapters``): ``W = W_base + scale * B @ A``, never
accumulating. The first sync of an actor (after it is built or loaded) also sends the full *base*
weights in transformers names, which (re)sets the rollout's base copy: the rollout may have been
built from a merged checkpoint.

Checkpoint of a LoRA actor at ``path`` (every rank calls; the gathers are collectives)::

    path/config.json, model.safetensors
        the merged model (W_base + scale B A) in transformers format: eval / export
    path/tokenizer*
        the tokenizer
    path/adapter/
        the adapter in PEFT format (adapter_config.json, adapter_model.safetensors);
        adapter_config.base_model_name_or_path: where the base came from
        (null: the built-in ``model.name`` from ``model.seed``)
    path/lora_dcp/
        DCP: the adapter + the optimizer (sharded or not), extra.pt: shuffle RNG

``load_lora_state`` reloads the base weights from where they came from (the actor may have been
built from ``path``, i.e. the merged model), then the adapter, optimizer and RNG: resume is exact.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from hybridrl.config.sections.common import ALL_LINEAR
from hybridrl.parallel import distributed
from hybridrl.parallel.buckets import BUCKET_BYTES, bucketed
from hybridrl.protocol import LORA_A, LORA_B, LORA_SCALING

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
ADAPTER_DIR, STATE_DIR = "adapter", "lora_dcp"
_PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoraSettings:
    rank: int
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = DEFAULT_TARGETS

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def lora_settings(cfg) -> LoraSettings | None:
    """The actor's LoRA settings (``cfg.actor.lora_*``), or None when ``lora_rank`` is 0 or
    absent."""
    a = getattr(cfg, "actor", None)
    rank = int(getattr(a, "lora_rank", 0) or 0)
    if rank <= 0:
        return None
    return LoraSettings(
        rank=rank,
        alpha=float(getattr(a, "lora_alpha", 16.0)),
        dropout=float(getattr(a, "lora_dropout", 0.0)),
        targets=tuple(getattr(a, "lora_target_modules", None) or DEFAULT_TARGETS),
    )


def apply_lora(model: nn.Module, s: LoraSettings, seed: int = 0) -> nn.Module:
    """``model`` wrapped with fresh PEFT LoRA adapters (B = 0: the wrapped model computes what
    ``model`` did); only the adapters require grad. A's random initialisation is drawn from ``seed``
    (the same on every rank and in every process; the caller's RNG stream is left alone)."""
    import warnings

    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=s.rank,
        lora_alpha=s.alpha,
        lora_dropout=s.dropout,
        target_modules=linear_targets(model, s.targets),
        bias="none",
        task_type="CAUSAL_LM",
    )
    with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
        warnings.filterwarnings(
            "ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning
        )
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, config)
    remapped = peft_model.peft_config["default"].target_parameters
    if remapped:  # PEFT turned some MLP names into the fused experts' tensors (see linear_targets)
        mlp = sorted({t for t in s.targets if t.rsplit(".", 1)[-1] in MLP_TARGETS})
        raise ValueError(
            f"LoRA on {model.config.model_type}: PEFT maps the MLP names {mlp} onto the routed "
            f"experts' fused tensors {sorted(remapped)}, which hybridrl's LoRA does not adapt; "
            "leave them out of actor.lora_target_modules, e.g. [q_proj, k_proj, v_proj, o_proj]"
        )
    return peft_model


def linear_targets(model: nn.Module, targets: Iterable[str]) -> list[str]:
    """The names of ``model``'s Linear modules that ``targets`` name (a name or its dotted suffix,
    as PEFT matches), spelled out. Given the short names, PEFT would also put 3-D adapters on a
    mixture-of-experts model's fused expert tensors (``mlp.experts.gate_up_proj`` / ``down_proj``),
    which neither the merged weights, the weight sync nor the native engine's merge handle: on an
    MoE model LoRA adapts attention (and any dense or shared-expert MLP) and the routed experts stay
    frozen (docs/moe.md). For some MoE families (Qwen3-MoE, Mixtral) PEFT maps any target named
    like an MLP projection onto the experts, even a dense layer's: :func:`apply_lora` then
    refuses, naming the names to leave out."""
    targets = tuple(targets)
    linear = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    if targets == (ALL_LINEAR,):  # PEFT's meaning: every Linear module but the output head
        head = model.get_output_embeddings()
        return [n for n in linear if model.get_submodule(n) is not head]
    names = [n for n in linear if any(n == t or n.endswith("." + t) for t in targets)]
    if not names:
        known = sorted({name.rsplit(".", 1)[-1] for name in linear})
        raise ValueError(
            f"actor.lora_target_modules {list(targets)} names no Linear module of the model; "
            f"its Linear modules end in: {', '.join(known)}"
        )
    return names


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def hf_name(peft_name: str) -> str:
    """A PEFT parameter name in the base model's own (transformers) naming."""
    name = peft_name[len(_PEFT_PREFIX) :] if peft_name.startswith(_PEFT_PREFIX) else peft_name
    return name.replace(".base_layer.", ".")


def _adapter_parts(peft_name: str) -> tuple[str, str] | None:
    """``(module, 'A'|'B')`` for a LoRA parameter name (``...q_proj.lora_A.default.weight``), else
    None."""
    for tag in ("A", "B"):
        key = f".lora_{tag}."
        if key in peft_name:
            return hf_name(peft_name.split(key)[0]), tag
    return None


def _lora_modules(model: nn.Module) -> dict[str, nn.Module]:
    """transformers module name -> PEFT LoRA layer (the ones with adapters)."""
    from peft.tuners.lora import LoraLayer

    return {hf_name(n): m for n, m in model.named_modules() if isinstance(m, LoraLayer)}


def _scaling(module: nn.Module) -> float:
    name = module.active_adapters[0] if hasattr(module, "active_adapters") else "default"
    return float(module.scaling[name])


# --- full values (collectives when sharded) ----------------------------------------------------
def _gather_device(model: nn.Module) -> torch.device:
    from hybridrl.parallel.fsdp import is_sharded

    device = next(model.parameters()).device
    if (
        is_sharded(model)
        and torch.cuda.is_available()
        and torch.distributed.get_backend() == "nccl"
    ):
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def iter_full(model: nn.Module, which: str = "all") -> Iterator[tuple[str, torch.Tensor]]:
    """``(peft_name, full value)`` of the parameters (``which``: all, adapter or base); every rank
    must iterate to the end (one all-gather per sharded parameter). Sharded values come back on the
    CPU."""
    from hybridrl.parallel.fsdp import _full, is_sharded

    sharded, device = is_sharded(model), _gather_device(model)
    for name, p in model.named_parameters():
        adapter = _adapter_parts(name) is not None
        if (which == "adapter" and not adapter) or (which == "base" and adapter):
            continue
        full = _full(p, device)
        yield name, (full.cpu() if sharded else full)


def _adapter_items(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    modules = _lora_modules(model)
    done = set()
    for name, full in iter_full(model, "adapter"):
        module, tag = _adapter_parts(name)
        yield module + (LORA_A if tag == "A" else LORA_B), full.detach()
        if module not in done:
            done.add(module)
            yield (
                module + LORA_SCALING,
                torch.tensor(_scaling(modules[module]), dtype=torch.float32),
            )


def lora_weight_buckets(
    model: nn.Module, bucket_bytes: int = BUCKET_BYTES, *, with_base: bool = False, dst: int = 0
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The adapters as buckets of at most ``bucket_bytes`` (see the module doc for the names);
    ``with_base``: the full base weights (transformers names) first. Every rank iterates; rank
    ``dst`` gets the tensors."""
    keep = distributed.rank() == dst

    def items():
        if with_base:
            for name, full in iter_full(model, "base"):
                yield hf_name(name), full.detach()
        yield from _adapter_items(model)

    yield from bucketed(items(), bucket_bytes, keep=keep)


def sync_bytes(buckets: Iterable[Iterable[tuple[str, torch.Tensor]]]) -> int:
    """Bytes of the tensors of one weight sync (a list of buckets of ``(name, tensor)``)."""
    return sum(t.numel() * t.element_size() for bucket in buckets for _, t in bucket)


def merged_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The merged model's parameters (transformers names, ``W_base + scale * B @ A`` for adapted
    modules), computed in float32 and cast to the base dtype; every rank must call, rank 0 gets them
    (others ``{}``)."""
    modules = {m: _scaling(layer) for m, layer in _lora_modules(model).items()}
    base, ab = {}, {}
    for name, full in iter_full(model):
        parts = _adapter_parts(name)
        if parts is None:
            base[hf_name(name)] = full.detach()
        else:
            ab[parts] = full.detach()
    if distributed.rank() != 0:
        return {}
    out = dict(base)
    for module, scale in modules.items():
        w = base[module + ".weight"]
        delta = ab[(module, "B")].float() @ ab[(module, "A")].float()
        out[module + ".weight"] = (w.float() + scale * delta).to(w.dtype)
    return out


# --- checkpoints ------------------------------------------------------------------------------
def _plain_model(model: nn.Module) -> nn.Module:
    """The transformers model inside the PEFT wrapper."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def save_lora_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer,
    generator: torch.Generator,
    tokenizer=None,
    *,
    base_source: str | None = None,
) -> None:
    """The layout of the module doc; every rank calls. ``base_source``: where the base weights came
    from (a transformers directory, or None for the built-in model from ``model.name`` /
    ``model.seed``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    from hybridrl.parallel.sharded_checkpoint import quiet_single_process, replace_dir

    path = Path(path)
    merged = merged_weights(model)  # collective
    adapter = dict(iter_full(model, "adapter"))  # collective
    if distributed.rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
        plain = _plain_model(model)
        plain.save_pretrained(path, state_dict=merged)
        config = json.loads((path / "config.json").read_text())
        config["architectures"] = [
            next(c for c in type(plain).__mro__ if "FSDP" not in c.__name__).__name__
        ]
        (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if tokenizer is not None:
            tokenizer.save_pretrained(path)
        peft_config = model.peft_config["default"]
        peft_config.base_model_name_or_path = base_source
        model.save_pretrained(path / ADAPTER_DIR, state_dict=adapter)
    del merged, adapter
    tmp = path / f".{STATE_DIR}.tmp"
    if distributed.rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    distributed.barrier()
    state = {
        "adapter": get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=True)),
        "optim": get_optimizer_state_dict(model, optimizer),
    }
    with quiet_single_process():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp))
    if distributed.rank() == 0:
        torch.save({"shuffle_rng": generator.get_state()}, tmp / "extra.pt")
    distributed.barrier()
    if distributed.rank() == 0:
        replace_dir(tmp, path / STATE_DIR)
    distributed.barrier()


def is_lora_checkpoint(path: str | Path) -> bool:
    return (Path(path) / STATE_DIR / ".metadata").is_file()


def base_source_of(path: str | Path) -> str | None:
    """Where a LoRA checkpoint's base weights came from (its adapter_config.json)."""
    cfg = json.loads((Path(path) / ADAPTER_DIR / "adapter_config.json").read_text())
    return cfg.get("base_model_name_or_path") or None


def load_lora_state(
    path: str | Path, model: nn.Module, optimizer, generator: torch.Generator, base_model: nn.Module
) -> None:
    """Base weights from ``base_model`` (a plain transformers model: the checkpoint's base, see
    :func:`base_source_of`), then the adapter, optimizer and RNG of a :func:`save_lora_checkpoint`
    directory; every rank calls."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from hybridrl.parallel.sharded_checkpoint import quiet_single_process

    path = Path(path)
    if not is_lora_checkpoint(path):
        raise FileNotFoundError(
            f"{path} is not a complete LoRA checkpoint ({STATE_DIR}/.metadata missing)"
        )
    base_sd = dict(base_model.named_parameters())
    full = {}
    for name, _ in model.named_parameters():
        if _adapter_parts(name) is None:
            full[name] = base_sd[hf_name(name)].detach()
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, strict=False))
    state = {
        "adapter": get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=True)),
        "optim": get_optimizer_state_dict(model, optimizer),
    }
    with quiet_single_process():
        dcp.load(state, storage_reader=dcp.FileSystemReader(path / STATE_DIR))
    set_model_state_dict(model, state["adapter"], options=StateDictOptions(strict=False))
    set_optimizer_state_dict(model, optimizer, state["optim"])
    extra = torch.load(path / STATE_DIR / "extra.pt", weights_only=True)
    generator.set_state(extra["shuffle_rng"])
