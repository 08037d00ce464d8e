"""The generation: ``rollout`` and the multi-turn environment (``env``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hybridrl.config.sections.common import (
    _absolute_file_path,
    _check_checkpoint_dir,
    _f,
)


@dataclass
class RolloutConfig:
    backend: str = _f(
        "native",
        "rollout backend: native (paged-KV engine), hf (transformers generate) or a "
        "registered/dotted one",
    )
    temperature: float = _f(1.0, "sampling temperature (0: greedy)", ge=0)
    top_p: float = _f(1.0, "nucleus sampling mass", gt=0, le=1)
    top_k: int = _f(0, "top-k sampling (0: off)", ge=0)
    max_new_tokens: int | None = _f(
        None,
        "longest response in tokens (null: 256 for a model.path checkpoint, as TRL's default; 16 "
        "for the built-in toy models)",
        ge=1,
    )
    max_batch_size: int = _f(
        512, "hf: sequences per generate call; native: most sequences decoding at once", ge=1
    )
    kv_cache_bytes: int = _f(
        256 << 20,
        "native, and vllm on a CPU: bytes of the paged KV-cache pool (vllm: unless "
        "VLLM_CPU_KVCACHE_SPACE is set)",
        ge=1,
    )
    block_size: int = _f(
        16,
        "native: tokens per KV-cache block (at most 1024: a block is the unit of sharing and of "
        "allocation, and the pool holds at least two)",
        ge=1,
        le=1024,
    )
    max_num_batched_tokens: int = _f(
        4096, "native: token budget of one engine step (prefill + decode)", ge=1
    )
    enable_prefix_caching: bool = _f(
        True, "native, vllm, sglang: share KV blocks of identical prompt prefixes"
    )
    draft_model_path: str | None = _f(
        None, "native: draft model checkpoint for speculative decoding (null: off)"
    )
    num_speculative_tokens: int = _f(4, "native: tokens the draft proposes per step", ge=1)
    spec_max_batch: int = _f(
        32, "native: speculate only while at most this many sequences decode", ge=1
    )
    dtype: Literal["auto", "fp32", "bf16"] = _f(
        "auto",
        "native (and hf on CUDA): dtype of the engine's weights and KV cache (log-probs stay "
        "fp32); auto: on CUDA bf16 where the GPU has native bf16 (compute capability >= 8.0), "
        "else fp32; on a CPU bf16 when it has native bf16 matmuls and a measurement on the "
        "model says they pay, else fp32",
    )
    kv_cache_memory_fraction: float | None = _f(
        None,
        "native, CUDA: KV pool = this share of free device memory (overrides kv_cache_bytes)",
        gt=0,
        le=1,
    )
    engine_model_path: str | None = _f(
        None,
        "vllm, sglang: checkpoint directory the engine loads (null: the in-memory model and "
        "tokenizer are saved to a temporary directory)",
    )
    gpu_memory_utilization: float = _f(
        0.5,
        "vllm, sglang: share of GPU memory the engine takes for weights and KV cache "
        "(sglang: mem_fraction_static)",
        gt=0,
        le=1,
    )
    tensor_parallel_size: int = _f(1, "vllm, sglang: GPUs the engine shards the model over", ge=1)
    engine_kwargs: dict = _f(
        {},
        "vllm, sglang: extra keyword arguments passed as they are to vllm.LLM / sglang.Engine "
        "(e.g. {dtype: bfloat16})",
    )
    timeout_s: float | None = _f(
        1200.0,
        "ray backend: a generate call of the rollout still running after this many seconds has "
        "its workers killed, and the run restarts from its last checkpoint (trainer.max_restarts); "
        "keep it below trainer.step_timeout_s, whose watchdog otherwise stops the run first; "
        "null: no limit. Not applied under the local backend (a thread cannot be stopped)",
        gt=0,
    )

    def validate(self) -> None:
        if self.draft_model_path:
            _check_checkpoint_dir("rollout.draft_model_path", self.draft_model_path)


@dataclass
class EnvConfig:
    """Multi-turn (agentic) rollouts with an environment (``hybridrl/envs/``, docs/agentic.md);
    null ``name``: single-turn generation."""

    name: str | None = _f(
        None,
        "environment: a registered name (e.g. calc_tool), a dotted path 'pkg.module:Env' or "
        "'envs.py:Env'; each trajectory gets its own instance, cls(**kwargs) (null: single-turn)",
    )
    kwargs: dict = _f({}, "keyword arguments of the environment's constructor")
    max_turns: int = _f(
        4, "model turns per trajectory; one that is not done by then is truncated", ge=1
    )
    max_total_tokens: int = _f(
        1024,
        "response tokens per trajectory, the model's turns and the observations together; a "
        "trajectory that reaches it is truncated (status truncated); rollout.max_new_tokens "
        "bounds each turn",
        ge=1,
    )
    step_timeout_s: float = _f(
        30.0,
        "seconds one reset or step of the environment may take; past it the trajectory ends with "
        "reward 0, counted in env/timeouts (an exception: env/errors); the run goes on",
        gt=0,
    )
    turn_stop: list[str] = _f(
        [],
        "strings that end a model turn (e.g. '</call>'), kept in the response; eos and "
        "rollout.max_new_tokens end a turn too",
    )
    max_concurrent_steps: int = _f(
        256, "environment calls (reset/step) running at once on a rollout rank", ge=1
    )
    observation_role: str = _f(
        "tool",
        "with a chat template and chat prompts: the message role an observation is rendered as",
    )
    cross_policy_frac: float = _f(
        0.0,
        "cross-policy sampling (AgentRL): this fraction of model turns (drawn per trajectory and "
        "turn, seeded) is generated by a frozen copy of the starting policy (the warm-started "
        "model, which is also the reference) instead of the current one, to widen exploration",
        ge=0,
        le=1,
    )
    cross_policy_tokens: Literal["masked", "weighted"] = _f(
        "masked",
        "how the other policy's tokens enter the loss: masked (loss mask 0: context only) or "
        "weighted (trained on, with that policy's log-probs as behaviour log-probs, so that the "
        "importance weight pi_old/mu of decoupled_ppo or algorithm.rollout_is corrects them)",
    )

    def validate(self) -> None:
        if self.name is not None:
            if not isinstance(self.name, str) or not self.name.strip():
                raise ValueError("name must be a non-empty string (null: single-turn)")
            self.name = _absolute_file_path(self.name)  # workers may run elsewhere
        if not isinstance(self.kwargs, dict) or not all(isinstance(k, str) for k in self.kwargs):
            raise ValueError(f"kwargs must be a mapping of argument names, got {self.kwargs!r}")
        bad = [s for s in self.turn_stop if not isinstance(s, str) or not s]
        if bad:
            raise ValueError(f"turn_stop holds {bad[0]!r}: each entry is a non-empty string")
        if self.name is None and (self.kwargs or self.turn_stop):
            raise ValueError("kwargs / turn_stop are set but env.name is null: name an environment")
        if self.name is not None:
            from hybridrl.envs.base import check_environment  # lazy: the schema stays import-light

            check_environment(self.name, self.kwargs)
