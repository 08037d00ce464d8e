"""The native engine's KV pool capacity: how many blocks the pool gets, and whether a request can
ever run in it.

Both answers come from the same numbers (blocks of the native engine's ``block_size`` option tokens,
the bytes one block costs in the model and its draft) and both are settled before any step runs: the
pool's size once when the engine is built, a request's fit when it arrives. A request that could
never be scheduled then fails at once, naming the settings that would make it fit, instead of
waiting in the queue forever. The step loop itself (``rollout/engine.py``) only asks the block
manager.
"""

from __future__ import annotations

import logging

import torch

from hybridrl.rollout.block_manager import BlockManager
from hybridrl.sampling import SamplingParams

log = logging.getLogger(__name__)


def bytes_per_block(spec, block_size: int, dtype: torch.dtype, routing_bytes: int = 0) -> int:
    """What one block of ``block_size`` token slots costs in the pool of a model of ``spec`` (a
    :class:`~hybridrl.models.spec.ModelSpec`): its keys and values in every layer, in
    ``dtype``, and ``routing_bytes`` per slot of recorded expert ids (MoE models)."""
    kv = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * torch.finfo(dtype).bits // 8
    return block_size * (kv + routing_bytes)


def pool_blocks(options, device: torch.device, bytes_per_block: int, num_blocks: int | None) -> int:
    """The pool's block count: ``num_blocks`` when given, else the KV budget over
    ``bytes_per_block`` (at least 2). The budget is the ``kv_cache_bytes`` option, or on CUDA
    ``kv_cache_memory_fraction`` of the device memory free now, when that is set (``options``:
    the native engine's, ``rollout/engine.py``)."""
    budget = options.kv_cache_bytes
    fraction = options.kv_cache_memory_fraction  # GPU: a share of the free device memory
    if fraction and device.type == "cuda":
        budget = int(fraction * torch.cuda.mem_get_info(device)[0])
    elif fraction:
        log.warning(
            "rollout.backend_options.kv_cache_memory_fraction applies on CUDA only; on %s the KV "
            "pool takes rollout.backend_options.kv_cache_bytes = %d",
            device.type,
            budget,
        )
    return num_blocks or max(2, budget // bytes_per_block)


def check_fits(
    request_id: str,
    prompt_ids: list[int],
    params: SamplingParams,
    *,
    bm: BlockManager,
    max_positions: int,
    max_seqs: int,
    lookahead: int,
) -> int:
    """Raise ``ValueError`` if the request can never run: its prompt leaves no room below the
    model's ``max_positions``, or the pool cannot hold one of its sequences grown to the token limit
    (nor the prompt with one block per sample it forks at once, which admission reserves; at most
    ``max_seqs`` samples enter together). ``lookahead``: the KV slots a speculative step reserves
    per decoding sequence (0 without a draft). Returns the token limit (``max_new_tokens``, capped
    by the positions left)."""
    limit = max_positions
    max_tokens = min(params.max_new_tokens, limit - len(prompt_ids))
    if max_tokens <= 0:
        raise ValueError(
            f"request {request_id!r}: prompt of {len(prompt_ids)} tokens leaves no room "
            f"below {limit} positions"
        )
    bs, total = bm.block_size, bm.num_blocks
    # the last token is sampled, never written to the KV
    need = bm.blocks_for(len(prompt_ids) + max_tokens - 1 + lookahead)
    forks = min(max_seqs, max(1, params.n)) - 1
    need_forks = bm.blocks_for(len(prompt_ids)) + forks
    if need <= total and need_forks <= total:
        return max_tokens
    capped = (
        f" (capped at {max_tokens} by the model's {limit} positions)"
        if max_tokens < params.max_new_tokens
        else ""
    )
    spec = f" plus {lookahead} speculative tokens" if lookahead else ""
    group = forks > 0 and need_forks > total  # only a group has forks to reserve for
    fixes = [
        "a larger rollout.backend_options.kv_cache_bytes (or "
        "rollout.backend_options.kv_cache_memory_fraction on CUDA)"
    ]
    if need > total:
        fixes.append("a shorter rollout.max_new_tokens")
    fixes.append("shorter prompts")
    if group:
        fixes.append(
            "a smaller rollout.backend_options.max_batch_size or trainer.samples_per_prompt"
        )
    raise ValueError(
        f"request {request_id!r} cannot fit the KV pool: one sequence of its "
        f"{len(prompt_ids)}-token prompt and max_new_tokens {params.max_new_tokens}{capped}"
        f"{spec} needs {need} blocks"
        + (
            f", and admitting its group of {forks + 1} samples reserves {need_forks} (the "
            "prompt's blocks plus one per forked sample)"
            if group
            else ""
        )
        + f", but the pool has {total} blocks of {bs} tokens; use "
        + ", ".join(fixes[:-1])
        + f" or {fixes[-1]}"
    )
