"""The rollout interface every backend implements (GUIDE.md §1).

``generate(requests, params) -> list[Sample]`` returns ``params.n`` samples
per request, each with the behaviour log-prob of every token and the weight
version that produced it. ``update_weights`` takes an iterator of
``(name, tensor)`` pairs (streamed in buckets by the caller) and a version;
``pause``/``resume``/``abort`` and ``release_memory``/``wake_up`` serve
asynchronous training and colocation.

LoRA: ``update_weights`` recognises adapter entries, ``<module>.lora_A`` (r x in),
``<module>.lora_B`` (out x r) and ``<module>.lora_scaling`` (0-d), and merges
them into the live weight ``<module>.weight`` as ``W_base + scale * B @ A``
(:meth:`RolloutEngine.merge_adapters`). The engine keeps its own copy of the
base weight of every adapted module, so repeated syncs never accumulate; a
full weight for such a module received in a sync becomes its new base (the
actor's first sync sends the base weights, then adapters only). Backends that
override ``update_weights`` pass their stream through ``merge_adapters`` and,
when they have no ``self.model``, implement ``_weight_tensors``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch

from hybridrl.protocol import Sample
from hybridrl.registry import Registry

ROLLOUT_BACKENDS = Registry("rollout backend")  # name -> cls(model, tokenizer, cfg: RolloutConfig)

LORA_A, LORA_B, LORA_SCALING = ".lora_A", ".lora_B", ".lora_scaling"  # adapter entries of a weight sync
_LORA_SUFFIXES = (LORA_A, LORA_B, LORA_SCALING)


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 16
    n: int = 1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    min_p: float = 0.0
    stop: tuple[str, ...] = ()  # stop strings (native backend)
    ignore_eos: bool = False
    return_raw_log_probs: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    uid: str = ""
    task_id: str = ""
    extra: dict = field(default_factory=dict)


class RolloutEngine(ABC):
    """Base of all rollout backends; holds the weight version and pause/abort state."""

    def __init__(self) -> None:
        self.version = 0
        self.paused = False
        self._aborted: set[str] = set()
        self._lora_base: dict[str, torch.Tensor] = {}  # "<module>.weight" -> its base value (adapted modules)

    @abstractmethod
    def generate(self, requests: list[GenerationRequest], params: SamplingParams) -> list[Sample]: ...

    @abstractmethod
    def _load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy tensors into the live weights in place; return the number of tensors loaded."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> int:
        count = self._load_weights(self.merge_adapters(named_tensors))
        self.version = version
        return count

    # --- LoRA -------------------------------------------------------------------------------------------
    def _weight_tensors(self) -> dict[str, torch.Tensor]:
        """The live weights by transformers name (read to take the base copies of adapted modules)."""
        model = getattr(self, "model", None)
        if model is None:
            raise NotImplementedError(f"{type(self).__name__}: LoRA sync needs _weight_tensors() (live weights by name)")
        return dict(model.named_parameters())

    @torch.no_grad()
    def merge_adapters(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The sync stream with adapter entries replaced by merged weights: full weights pass through as they
        come (the consumer loads each before asking for the next); the adapters are gathered and, once the
        stream is exhausted, every adapted module yields ``W = W_base + scale * B @ A`` (float32 math, cast to
        the live dtype). A module's base copy is taken from the live weight the first time it is adapted, and
        again whenever the same sync also carried its full weight."""
        adapters: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
        full: set[str] = set()
        for name, tensor in named_tensors:
            suffix = next((s for s in _LORA_SUFFIXES if name.endswith(s)), None)
            if suffix is None:
                full.add(name)
                yield name, tensor
            else:
                adapters[name[: -len(suffix)]][suffix] = tensor
        stale = full & self._lora_base.keys()
        if not adapters and not stale:
            return
        live = self._weight_tensors()
        for wname in stale:  # a new base (adapters for it, if any, are merged below)
            self._lora_base[wname] = live[wname].detach().clone()
        for module, parts in adapters.items():
            missing = [s for s in _LORA_SUFFIXES if s not in parts]
            if missing:
                raise ValueError(f"LoRA sync: {module!r} lacks {missing}")
            wname = module + ".weight"
            if wname not in live:
                raise KeyError(f"LoRA sync: the rollout model has no weight {wname!r}")
            w = live[wname]
            if wname not in self._lora_base:
                self._lora_base[wname] = w.detach().clone()
            base = self._lora_base[wname]
            a, b = parts[LORA_A].to(w.device, torch.float32), parts[LORA_B].to(w.device, torch.float32)
            if (b.shape[0], a.shape[1]) != tuple(w.shape) or b.shape[1] != a.shape[0]:
                raise ValueError(f"LoRA sync: {module}: B {tuple(b.shape)} @ A {tuple(a.shape)} does not fit {tuple(w.shape)}")
            yield wname, (base.float() + float(parts[LORA_SCALING]) * (b @ a)).to(w.dtype)

    def lora_base_bytes(self) -> int:
        """Memory held by the base copies of the adapted modules."""
        return sum(t.numel() * t.element_size() for t in self._lora_base.values())

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def abort(self, request_ids: Iterable[str]) -> None:
        self._aborted.update(request_ids)

    def release_memory(self) -> None:  # nothing to free for backends without a KV pool
        pass

    def wake_up(self) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return {}
