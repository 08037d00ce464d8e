"""The rollout interface every backend implements (GUIDE.md §1).

``generate(requests, params) -> list[Sample]`` returns ``params.n`` samples
per request, each with the behaviour log-prob of every token and the weight
version that produced it. ``update_weights`` takes an iterator of
``(name, tensor)`` pairs (streamed in buckets by the caller) and a version;
``pause``/``resume``/``abort`` and ``release_memory``/``wake_up`` serve
asynchronous training and colocation.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Iterable

import torch

from hybridrl.protocol import Sample
from hybridrl.registry import Registry

ROLLOUT_BACKENDS = Registry("rollout backend")  # name -> cls(model, tokenizer, cfg: RolloutConfig)


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 16
    n: int = 1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

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

    @abstractmethod
    def generate(self, requests: list[GenerationRequest], params: SamplingParams) -> list[Sample]: ...

    @abstractmethod
    def _load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy tensors into the live weights in place; return the number of tensors loaded."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> int:
        count = self._load_weights(named_tensors)
        self.version = version
        return count

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
