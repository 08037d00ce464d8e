"""One sequence being generated: its tokens, its KV blocks and its per-token outputs.

A request asking for ``n`` samples enters the engine as one sequence; when its
prompt has been prefilled the engine samples ``n`` first tokens from the same
logits and forks ``n - 1`` children that share the prompt's KV blocks
(:meth:`BlockManager.fork`). Every sequence has its own seed, so its random
stream does not depend on which other sequences share a step.
"""

from __future__ import annotations

import hashlib
from enum import Enum
from itertools import count
from typing import Any

_MASK63 = (1 << 63) - 1


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"  # stop token / stop string
    TRUNCATED = "truncated"  # max tokens
    ABORTED = "aborted"


def derive_seed(seed: int, index: int) -> int:
    """A well-mixed 63-bit seed for sample ``index`` of a request seeded with ``seed``."""
    x = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & (
        (1 << 64) - 1
    )
    x ^= x >> 31
    x = (x * 0xD6E8FEB86659FD93) & ((1 << 64) - 1)
    x ^= x >> 32
    return x & _MASK63


def request_seed(seed: int, request_id: str) -> int:
    """The seed of request ``request_id`` in a call seeded with ``seed``; its sample ``i`` uses
    ``derive_seed(request_seed(...), i)``. It depends on the request's identity, not on its position
    in the call, so a prompt draws the same numbers however the prompts are split among
    data-parallel ranks."""
    # stable across processes, unlike hash()
    digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
    return derive_seed(seed, int.from_bytes(digest, "little"))


class Sequence:
    _ids = count()

    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: Any,
        seed: int,
        *,
        sample_index: int = 0,
        num_forks: int = 0,
        max_tokens: int | None = None,
        tag: Any = None,
        base_seed: int | None = None,
        stop_ids: frozenset[int] = frozenset(),
    ):
        if not prompt_ids:
            raise ValueError(f"request {request_id!r} has an empty prompt")
        self.seq_id = next(Sequence._ids)
        self.request_id = request_id
        self.sample_index = sample_index
        self.params = params
        self.seed = seed  # this sample's seed
        # the request's: children derive theirs from it
        self.base_seed = seed if base_seed is None else base_seed
        self.stop_ids = stop_ids
        self.tag = tag  # the caller's object for the request (the prompt Sample)
        self.token_ids: list[int] = list(prompt_ids)
        self.num_prompt_tokens = len(prompt_ids)
        self.max_tokens = params.max_new_tokens if max_tokens is None else max_tokens
        self.num_forks = num_forks  # children to create when the first token is sampled
        self.status = Status.WAITING
        # KV state
        self.block_table: list[int] = []
        self.num_computed = 0  # tokens whose KV is in the cache
        self.num_hashed_blocks = 0  # leading full blocks registered in the prefix cache
        self.last_hash = b""  # digest of block num_hashed_blocks - 1 (b"": none)
        # block-manager epoch its KV was computed in (stale after a weight change)
        self.hash_epoch = -1
        # tokens whose KV is in the draft model's cache (speculative decoding)
        self.num_draft_computed = 0
        self.num_draft_blocks = 0  # leading registered blocks marked as holding the draft's KV too
        # outputs
        self.log_probs: list[float] = []
        self.raw_log_probs: list[float] = []
        self.versions: list[int] = []
        self.num_cached_prompt_tokens = 0  # prompt tokens served from the prefix cache or a fork
        # mixture-of-experts models: (tokens, MoE layers, k) expert ids, set when it finishes
        self.routing = None

    # --- sizes ----------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def completion_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def num_blocks(self, block_size: int) -> int:
        return (len(self.token_ids) + block_size - 1) // block_size

    # --- outputs --------------------------------------------------------------
    def append(
        self, token: int, log_prob: float, version: int, raw_log_prob: float | None = None
    ) -> None:
        self.token_ids.append(token)
        self.log_probs.append(log_prob)
        self.versions.append(version)
        if raw_log_prob is not None:
            self.raw_log_probs.append(raw_log_prob)

    def fork(self, sample_index: int, seed: int) -> Sequence:
        """A child with the same prompt (and KV state); its outputs are filled by the caller."""
        child = Sequence(
            self.request_id,
            self.prompt_ids,
            self.params,
            seed,
            sample_index=sample_index,
            max_tokens=self.max_tokens,
            tag=self.tag,
            base_seed=self.base_seed,
            stop_ids=self.stop_ids,
        )
        child.num_computed = self.num_computed
        child.num_draft_computed = self.num_draft_computed
        child.num_cached_prompt_tokens = self.num_prompt_tokens
        child.hash_epoch = self.hash_epoch
        child.num_hashed_blocks = self.num_hashed_blocks
        child.num_draft_blocks = self.num_draft_blocks
        child.last_hash = self.last_hash
        return child

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, req={self.request_id!r}#{self.sample_index}, "
            f"{self.status.value}, tokens={len(self)}, computed={self.num_computed}, "
            f"blocks={self.block_table})"
        )
