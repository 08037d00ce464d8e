"""The policy's weights in and out, for each form it takes: plain (one process or FSDP2-sharded),
LoRA adapters over a frozen base (``learner/lora.py``) and pipelined stages
(``learner/pipeline_policy.py``). The :class:`~hybridrl.learner.learner.Learner` methods that sync
weights and write or read checkpoints call these, so the choice between the three forms lives in
one place.
"""

from __future__ import annotations

from hybridrl.learner import lora as lora_lib
from hybridrl.learner import pipeline_policy
from hybridrl.learner.state import load_trainable, save_trainable
from hybridrl.models.loading import load_model
from hybridrl.parallel.buckets import bucketed
from hybridrl.parallel.fsdp import iter_weight_buckets


def weight_buckets(learner, bucket_bytes: int, mode: str) -> list[list]:
    """The policy's weights as buckets of (name, tensor), by transformers name (every rank takes
    part in gathering; ``mode`` as in ``Learner.weight_buckets``)."""
    if learner.pipeline is not None:  # every stage's weights, by transformers name
        buckets = pipeline_policy.weight_buckets(learner.pipeline, bucket_bytes)
    elif learner.lora is None:
        buckets = list(iter_weight_buckets(learner.model, bucket_bytes))
    elif mode == "merged":
        merged = lora_lib.merged_weights(learner.model)
        buckets = list(bucketed(merged.items(), bucket_bytes))
    else:
        if mode not in ("auto", "adapter", "base"):
            raise ValueError(
                f"weight_buckets: mode must be auto, adapter, base or merged, got {mode!r}"
            )
        with_base = mode == "base" or (mode == "auto" and not learner._base_synced)
        buckets = list(
            lora_lib.lora_weight_buckets(learner.model, bucket_bytes, with_base=with_base)
        )
        learner._base_synced |= with_base
    return buckets


def save(learner, path: str, writer) -> None:
    """The policy under ``path`` (``writer``: a background writer, or None to write now; a pipelined
    policy is always written now)."""
    model, opt, rng, tok = learner.model, learner.optimizer, learner.shuffle, learner.tokenizer
    if learner.pipeline is not None:
        pipeline_policy.save(path, learner.pipeline, model, opt, rng, tok)
    elif learner.lora is not None:
        lora_lib.save_lora_checkpoint(path, model, opt, rng, tok, base_source=learner.base_source)
    else:
        save_trainable(path, model, opt, rng, tok, background=writer)


def load(learner, path: str) -> None:
    """The policy (weights, optimizer, shuffle RNG) from the checkpoint at ``path``."""
    model, opt, rng = learner.model, learner.optimizer, learner.shuffle
    if learner.pipeline is not None:
        pipeline_policy.load(path, learner.pipeline, model, opt, rng)
    elif learner.lora is not None and lora_lib.is_lora_checkpoint(path):
        learner.base_source = lora_lib.base_source_of(path)
        base, _ = load_model(learner.cfg, learner.base_source)
        lora_lib.load_lora_state(path, model, opt, rng, base)
        learner._base_synced = False
    else:
        load_trainable(path, model, opt, rng)
