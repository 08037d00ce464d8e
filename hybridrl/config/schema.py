"""The configuration schema: one dataclass per component, nested in :class:`Config`.

Field metadata drives validation (``ge``/``gt``/``le``/``lt``/``choices``) and
the ``help`` text; ``validate()`` methods check relations between fields.
Everything is checked before any work starts (see ``config/loader.py``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

SEED_MAX = 2**63 - 1  # seeds reach torch.manual_seed and torch.Generator (64-bit)
# a step's prompts, samples and their tokens are held in host memory at once: a bound far above
# any real batch, so that a typo (prompts_per_step=100000000) fails before memory fills up
MAX_SAMPLES_PER_STEP = 2**20
# the Linear modules of the decoder layers of the built-in (Qwen2) models and of the Qwen2, Qwen3
# and Llama checkpoints the native rollout serves: the names actor.lora_target_modules may take
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_MODEL_TYPES = ("qwen2", "qwen3", "llama")


def _f(default, help: str, **checks):
    if isinstance(default, (dict, list)):
        return field(
            default_factory=lambda: type(default)(default), metadata={"help": help, **checks}
        )
    return field(default=default, metadata={"help": help, **checks})


def _check_checkpoint_dir(key: str, path: str) -> None:
    """A ValueError unless ``path`` is a directory holding a transformers ``config.json``."""
    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"{key} {path!r} does not exist or is not a directory")
    if not (p / "config.json").is_file():
        raise ValueError(f"{key} {path!r} holds no config.json (not a transformers checkpoint)")


def _check_writable_dir(key: str, path: str) -> None:
    """A ValueError unless directory ``path`` can be created (or replaced) and written: it is not
    a file, and its nearest existing ancestor is a writable directory."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{key} {path!r} is a file, not a directory")
    probe = p.parent
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if not probe.is_dir():
        raise ValueError(f"{key} {path!r} cannot be created: {str(probe)!r} is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(f"{key} {path!r} cannot be written: no write permission in {str(probe)!r}")


def _check_reward_model(key: str, path: str) -> None:
    """A ValueError unless ``path`` is a checkpoint of a one-label sequence-classification model."""
    _check_checkpoint_dir(key, path)
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{key} {path!r}: its config.json cannot be read ({e})") from None
    archs = (config.get("architectures") if isinstance(config, dict) else None) or []
    if not any(str(a).endswith("ForSequenceClassification") for a in archs):
        raise ValueError(
            f"{key} {path!r} is not a sequence-classification model (architectures: "
            f"{archs or 'none listed'}); a reward model is a *ForSequenceClassification checkpoint"
        )
    labels = len(config["id2label"]) if "id2label" in config else config.get("num_labels", 2)
    if labels != 1:
        raise ValueError(
            f"{key} {path!r} has {labels} labels; a reward model scores with one (num_labels=1)"
        )


def _absolute_file_path(plugin):
    """A plug-in named by file (``rewards.py:fn``) with the file's absolute path; anything else as
    it is."""
    if isinstance(plugin, str) and ".py:" in plugin:
        file, _, attr = plugin.rpartition(":")
        return f"{Path(file).expanduser().resolve()}:{attr}"
    return plugin


@dataclass
class ModelConfig:
    name: Literal["tiny", "small", "tiny_moe"] = _f(
        "tiny",
        "built-in size, used when path is null: tiny and small are Qwen2; tiny_moe is a "
        "Qwen3-MoE with 8 experts, top-2, as many active parameters as tiny (docs/moe.md)",
    )
    path: str | None = _f(
        None,
        "local transformers checkpoint directory (model + tokenizer) instead of a built-in size",
    )
    seed: int = _f(0, "seed of the random initialisation of a built-in model", ge=0, le=SEED_MAX)

    def validate(self) -> None:
        if self.path is not None:
            p = Path(self.path).expanduser()
            if not p.is_dir():
                raise ValueError(f"model.path {self.path!r} does not exist or is not a directory")
            if not (p / "config.json").is_file():
                raise ValueError(
                    f"model.path {self.path!r} holds no config.json (not a transformers checkpoint)"
                )


@dataclass
class TaskConfig:
    name: str = _f(
        "arith",
        "registered task name or dotted path 'pkg.module:TaskClass' (ignored when "
        "data.train_files is set: the dataset is the task)",
    )
    reward_fn: Any = _f(
        None,
        "reward function(s): a registered name, a dotted path 'pkg.module:fn', a callable (Python "
        "API), or a list of them; per-sample fn(prompt, response), TRL-style batched "
        "fn(prompts, completions, completion_ids, **columns) and veRL-style compute_score("
        "data_source, solution_str, ground_truth, extra_info) are told apart by their parameters "
        "(null: the task's default, exact_match for a dataset)",
    )
    reward_weights: list[float] | None = _f(
        None, "one weight per reward function; the reward is their weighted sum (null: all 1)"
    )
    mix: dict[str, float] | None = _f(
        None,
        "several registered tasks in one run, task name -> mixing weight (e.g. {arith: 1, "
        "reverse: 1}); each prompt drawn from one task with probability proportional to its "
        "weight; the tasks must share a tokenizer (null: the single task task.name)",
    )
    heldout_size: int = _f(1024, "prompts in the fixed held-out set", ge=1)
    eval_size: int | None = _f(None, "held-out prompts used per evaluation (null: all)", ge=1)
    reward_timeout_s: float = _f(
        30.0,
        "seconds one reward-function call may take; a call that takes longer scores its sample 0 "
        "and is counted (reward_timeouts); its thread is abandoned, and the run stops with an "
        "error once 8 abandoned calls are still running",
        gt=0,
    )
    reward_model_path: str | None = _f(
        None,
        "local transformers checkpoint of a sequence-classification reward model (num_labels 1, "
        "with its tokenizer) that scores prompt + response; its score times reward_model_weight "
        "is added to the reward, logged as reward/reward_model (null: none; placed by "
        "controller.placement.reward_model)",
    )
    reward_model_weight: float = _f(1.0, "weight of the reward model's score in the reward")
    reward_model_batch_size: int = _f(
        16, "prompt + response pairs per reward-model forward pass", ge=1
    )

    def reward_fns(self) -> list:
        """``reward_fn`` as a list (empty when null)."""
        if self.reward_fn is None:
            return []
        return (
            list(self.reward_fn) if isinstance(self.reward_fn, (list, tuple)) else [self.reward_fn]
        )

    def validate(self) -> None:
        # a plug-in's file path is made absolute: workers may run elsewhere
        fns = [_absolute_file_path(f) for f in self.reward_fns()]
        if isinstance(self.reward_fn, (list, tuple)):
            self.reward_fn = fns
        elif fns:
            self.reward_fn = fns[0]
        self.name = _absolute_file_path(self.name)
        for i, fn in enumerate(fns):
            if not (isinstance(fn, str) and fn) and not callable(fn):
                raise ValueError(
                    f"reward_fn[{i}] = {fn!r}: a reward function is a registered name, a dotted "
                    "path 'pkg.module:fn' or a callable"
                )
        if self.reward_weights is not None and len(self.reward_weights) != len(fns):
            raise ValueError(
                f"reward_weights has {len(self.reward_weights)} weight(s) for {len(fns)} reward "
                "function(s): give one weight per function"
            )
        if self.reward_model_path is not None:  # absolute: workers may run elsewhere
            self.reward_model_path = str(Path(self.reward_model_path).expanduser().resolve())
            _check_reward_model("task.reward_model_path", self.reward_model_path)


@dataclass
class DataConfig:
    """A user's dataset as the prompt source (``hybridrl/data/``); null ``train_files``: the
    built-in task."""

    train_files: str | list[str] | None = _f(
        None,
        "training data: .jsonl, .json, .parquet or .csv files, or a directory saved by "
        "datasets' save_to_disk (null: the built-in task)",
    )
    val_files: str | list[str] | None = _f(
        None,
        "held-out data in the same formats (null: task.heldout_size rows of the training data are "
        "held out, at most a tenth of it)",
    )
    prompt_key: str = _f(
        "prompt", "column holding the prompt: a string, or a list of chat messages {role, content}"
    )
    answer_key: str | None = _f(
        "answer",
        "column holding the reference answer (a dotted key reaches into a dict column, e.g. "
        "reward_model.ground_truth); null: no answer",
    )
    apply_chat_template: bool | None = _f(
        None,
        "render prompts with the tokenizer's chat template and add_generation_prompt (null: "
        "chat-message prompts are rendered, plain strings are used as they are; true: a plain "
        "string becomes one user message too)",
    )
    system_prompt: str | None = _f(
        None, "a system message put before each chat prompt that has none"
    )
    max_prompt_length: int | None = _f(
        None, "prompts longer than this many tokens are dropped and counted (null: no limit)", ge=1
    )
    drop_long_prompts: bool = _f(
        True, "false: a prompt over max_prompt_length is an error naming its row, not dropped"
    )
    shuffle: bool = _f(True, "a new seeded order (trainer.seed) of the training rows every epoch")
    epochs: int | None = _f(
        None,
        "passes over the training data; sets trainer.total_steps to cover them (null: "
        "trainer.total_steps decides)",
        ge=1,
    )
    stop: list[str] = _f(
        [], "stop strings ending a response, besides every eos id of the model's generation_config"
    )


@dataclass
class PoolConfig:
    nodes: int = _f(1, "number of nodes", ge=1)
    workers_per_node: int = _f(1, "worker processes per node", ge=1)
    cpus_per_worker: float = _f(1.0, "CPUs reserved per worker (ray backend)", gt=0)
    gpus_per_worker: float = _f(0.0, "GPUs reserved per worker (ray backend)", ge=0)
    resources: dict[str, float] = _f(
        {},
        "custom Ray resources reserved per worker, e.g. {node1: 0.01}: pins the pool to nodes "
        "offering them (ray backend)",
    )
    num_threads: int | None = _f(
        None, "torch threads of this pool's workers (null: controller.num_threads)", ge=1
    )


# the processes a run places: the trained models, the generation, the reward model
ROLES = ("learner", "rollout", "reward_model")
# roles placed only when configured (task.reward_model_path), and whose pool they take when unplaced
OPTIONAL_ROLES = {"reward_model": "rollout"}
FORMER_ROLES = {  # placement keys of earlier versions, and what replaced them
    "actor": (
        "the actor, reference and critic are parts of the learner: "
        "place them with placement.learner"
    ),
    "reference": "the reference is part of the learner: place it with placement.learner",
    "critic": "the critic is part of the learner: place it with placement.learner",
    "reward": "samples are scored on the rollout ranks that generate them: drop placement.reward",
}


@dataclass
class ControllerConfig:
    backend: Literal["local", "ray"] = _f(
        "local", "local: every worker in the driver process; ray: Ray actors"
    )
    ray_address: str | None = _f(None, "join this Ray cluster instead of starting a local one")
    num_threads: int = _f(2, "torch threads per worker process", ge=1)
    pools: dict[str, PoolConfig] = field(
        default_factory=lambda: {"global": PoolConfig()},
        metadata={"help": "resource pools by name"},
    )
    placement: dict[str, str] = _f(
        {r: "global" for r in ROLES if r not in OPTIONAL_ROLES},
        "role -> pool name: learner (policy, reference, critic and the learning step), rollout "
        "(generation and scoring), reward_model (only with task.reward_model_path; default: the "
        "rollout's pool); roles on one pool are colocated",
    )
    pg_timeout_s: float = _f(
        600.0,
        "seconds a torch.distributed collective or rendezvous waits for a missing peer before it "
        "fails (ray backend, world size > 1)",
        gt=0,
    )

    def validate(self) -> None:
        former = [r for r in self.placement if r in FORMER_ROLES]
        if former:
            raise ValueError(f"placement.{former[0]}: {FORMER_ROLES[former[0]]}")
        missing = [r for r in ROLES if r not in self.placement and r not in OPTIONAL_ROLES]
        if missing:
            raise ValueError(
                f"placement lacks role(s) {missing}; every role of "
                f"{[r for r in ROLES if r not in OPTIONAL_ROLES]} needs a pool"
            )
        for role, pool in self.placement.items():
            if role not in ROLES:
                raise ValueError(
                    f"placement names unknown role {role!r} (roles: {', '.join(ROLES)})"
                )
            if pool not in self.pools:
                raise ValueError(
                    f"placement.{role} names pool {pool!r}, which is not in pools "
                    f"({', '.join(self.pools)})"
                )

    def pool_of(self, role: str) -> str:
        """The pool of ``role``; an optional role left out takes the pool of the role it follows."""
        return self.placement.get(role) or self.placement[OPTIONAL_ROLES[role]]


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
    max_new_tokens: int = _f(16, "longest response in tokens", ge=1)
    max_batch_size: int = _f(
        512, "hf: sequences per generate call; native: most sequences decoding at once", ge=1
    )
    kv_cache_bytes: int = _f(256 << 20, "native: bytes of the paged KV-cache pool", ge=1)
    block_size: int = _f(16, "native: tokens per KV-cache block", ge=1)
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
class ActorConfig:
    lr: float = _f(1e-4, "AdamW learning rate", gt=0)
    weight_decay: float = _f(0.0, "AdamW weight decay", ge=0)
    grad_clip: float = _f(1.0, "max global grad norm (0: off)", ge=0)
    ppo_minibatch_size: int = _f(64, "samples per optimizer step", ge=1)
    ppo_epochs: int = _f(1, "passes over each step's batch", ge=1)
    micro_batch_tokens: int = _f(
        8192, "token budget of one forward/backward (gradient accumulation above it)", ge=1
    )
    reuse_old_log_probs: Literal["auto", "never"] = _f(
        "auto",
        "auto: an on-policy step (ppo_epochs 1, one mini-batch) with no "
        "reader of the old log-probs before the update (algorithm."
        "kl_reward_coef 0, rollout_is null) takes them from the update's "
        "own forward, with no separate pass; never: always the pass",
    )
    lora_rank: int = _f(0, "LoRA rank of the policy's adapters (0: train all weights)", ge=0)
    lora_alpha: float = _f(16.0, "LoRA scaling numerator (scale = alpha / rank)", gt=0)
    lora_dropout: float = _f(0.0, "dropout on the LoRA input", ge=0, lt=1)
    lora_target_modules: list[str] = _f(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "module names that get adapters",
    )
    packing: bool = _f(
        True,
        "pack whole sequences into rows (best-fit decreasing; each mini-batch's row width weighs "
        "the padding it saves against the attention a wider row costs; attention kept inside "
        "each sequence) in the learner's passes, its updates and the SFT warm start, instead of "
        "length-grouped micro-batches: the same log-probs and gradients (to float rounding) "
        "with less padding",
    )
    pp_size: int = _f(
        1,
        "pipeline stages: the actor's ranks form a (data parallel x pp_size) mesh, each rank "
        "holding its stages' decoder layers (1: no pipeline)",
        ge=1,
    )
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zbv", "dualpipev"] = _f(
        "1f1b",
        "pipeline schedule; interleaved_1f1b, zbv and dualpipev put two stages on each rank "
        "(zbv, dualpipev: V-shaped, rank 0 holds the first and the last stage)",
    )
    pp_microbatches: int = _f(
        0,
        "micro-batches per mini-batch through the pipeline (0: twice the number of stages)",
        ge=0,
    )


LOSS_AGG_MODES = [
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
]


@dataclass
class AlgorithmConfig:
    advantage: str = _f(
        "grpo",
        "advantage estimator: grpo, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline, gae, "
        "remax, grpo_passk, opo (registry name or dotted path)",
    )
    policy_loss: str = _f(
        "auto",
        "policy loss: ppo_clip, gspo, gspo_token, decoupled_ppo, cispo, gmpo, clip_cov, kl_cov, "
        "sapo (registry name or dotted path); "
        "auto: decoupled_ppo when trainer.mode is async, else ppo_clip",
    )
    norm_adv_by_std: bool = _f(True, "grpo, grpo_passk: divide by the group's std (false: Dr.GRPO)")
    task_norm: bool = _f(
        False,
        "task-level normalisation (AgentRL): after the estimator, whiten the advantages within "
        "each task's samples, (A - mean_task) / std_task over that task's tokens",
    )
    whiten_shift_mean: bool = _f(
        True,
        "reinforce_pp, reinforce_pp_baseline, gae: whitened advantages have mean 0 "
        "(false: the batch mean is added back after scaling, as veRL's shift_mean=False)",
    )
    gamma: float = _f(1.0, "discount (gae, reinforce_pp)", ge=0, le=1)
    lam: float = _f(1.0, "GAE lambda", ge=0, le=1)
    clip_ratio_low: float = _f(0.2, "clip: ratio >= 1 - clip_ratio_low", ge=0, lt=1)
    clip_ratio_high: float = _f(
        0.2, "clip: ratio <= 1 + clip_ratio_high (DAPO clip-higher: larger than low)", ge=0
    )
    clip_ratio_c: float | None = _f(
        3.0, "dual clip bound for negative advantages (null: off)", gt=1
    )
    behav_imp_weight_cap: float | None = _f(
        None, "decoupled_ppo: cap of the behaviour importance weight (null: none)", gt=0
    )
    cispo_clip_low: float | None = _f(
        None,
        "cispo: the detached IS weight is >= 1 - cispo_clip_low (null: no lower bound, "
        "as the CISPO paper)",
        ge=0,
        le=1,
    )
    cispo_clip_high: float = _f(
        0.28, "cispo: the detached IS weight is <= 1 + cispo_clip_high", ge=0
    )
    gmpo_log_clip_low: float = _f(
        0.4,
        "gmpo: token log-ratios are clipped at -gmpo_log_clip_low (log space; the paper's 0.4)",
        gt=0,
    )
    gmpo_log_clip_high: float = _f(
        0.4, "gmpo: token log-ratios are clipped at +gmpo_log_clip_high (log space)", gt=0
    )
    clip_cov_ratio: float = _f(
        2e-4,
        "clip_cov: share of a micro-batch's valid tokens whose gradient is cut (at least one)",
        gt=0,
        le=1,
    )
    clip_cov_lb: float = _f(1.0, "clip_cov: only tokens with covariance above this are candidates")
    clip_cov_ub: float = _f(
        5.0,
        "clip_cov: only tokens with covariance below this are candidates (must be > clip_cov_lb)",
    )
    clip_cov_seed: int = _f(
        0,
        "clip_cov: seed of the random choice among candidates "
        "(mixed with a hash of the micro-batch)",
        ge=0,
        le=SEED_MAX,
    )
    kl_cov_ratio: float = _f(
        2e-3,
        "kl_cov: share of a micro-batch's valid tokens, those of highest covariance, that get "
        "the KL penalty (at least one)",
        gt=0,
        le=1,
    )
    kl_cov_coef: float = _f(
        1.0, "kl_cov: weight of |log pi - log pi_old| on the selected tokens", ge=0
    )
    sapo_tau_pos: float = _f(
        1.0, "sapo: temperature of the soft gate for positive advantages", gt=0
    )
    sapo_tau_neg: float = _f(
        1.05, "sapo: temperature of the soft gate for negative and zero advantages", gt=0
    )
    loss_agg: str = _f("token-mean", "loss aggregation", choices=LOSS_AGG_MODES)
    loss_agg_norm_len: int | None = _f(
        None, "seq-mean-token-sum-norm: the fixed length (null: rollout.max_new_tokens)", ge=1
    )
    kl_coef: float = _f(
        0.001, "weight of the KL-to-reference loss term (the KL is always measured)", ge=0
    )
    kl_estimator: str = _f(
        "k3",
        "KL estimator of the loss term and the reward penalty: k1, k2, k3, abs; k1+, k2+, k3+ "
        "(the value of k1/k2/k3 with the gradient of k2)",
    )
    kl_reward_coef: float = _f(
        0.0, "initial weight of the per-token KL penalty in the reward (0: off)", ge=0
    )
    kl_ctrl: Literal["fixed", "adaptive"] = _f(
        "fixed", "reward KL controller (adaptive: Ziegler et al. 2019)"
    )
    kl_target: float = _f(0.01, "adaptive KL controller: target KL per sequence", gt=0)
    kl_horizon: int = _f(10000, "adaptive KL controller: horizon in samples", ge=1)
    entropy_coef: float = _f(0.0, "entropy bonus weight", ge=0)
    filter_groups: bool = _f(
        False, "DAPO dynamic sampling: drop groups whose rewards are all equal, sample more prompts"
    )
    max_sampling_rounds: int = _f(4, "dynamic sampling: generate rounds per step at most", ge=1)
    overlong_buffer: int = _f(
        0,
        "DAPO soft overlong punishment: length of the buffer before max_new_tokens (0: off)",
        ge=0,
    )
    overlong_penalty: float = _f(1.0, "soft overlong punishment at max_new_tokens", ge=0)
    rollout_is: Literal["token", "sequence"] | None = _f(
        None,
        "rollout correction: importance weight pi_old/pi_rollout per "
        "token or per sequence (null: off; see algorithms.md)",
    )
    rollout_is_mode: Literal["truncate", "mask"] = _f(
        "truncate",
        "rollout correction: truncate (TIS: min(w, threshold)) or "
        "mask (MIS: drop tokens/sequences with w outside [lower, threshold])",
    )
    rollout_is_threshold: float = _f(
        2.0, "rollout correction: upper bound of the importance weight", gt=0
    )
    rollout_is_threshold_lower: float | None = _f(
        None, "rollout correction, mask mode: lower bound (null: 1/rollout_is_threshold)", ge=0
    )
    rollout_bypass: bool = _f(
        False, "use the rollout's log-probs as the old policy: no old-log-prob forward"
    )

    def validate(self) -> None:
        if self.clip_cov_lb >= self.clip_cov_ub:
            raise ValueError(
                f"clip_cov_lb ({self.clip_cov_lb}) must be below clip_cov_ub ({self.clip_cov_ub}): "
                "the candidates of clip_cov have a covariance between the two"
            )


@dataclass
class CriticConfig:
    lr: float = _f(1e-3, "critic AdamW learning rate (gae only)", gt=0)
    value_clip: float = _f(0.5, "value-loss clip range around the old values", gt=0)
    grad_clip: float = _f(1.0, "max global grad norm (0: off)", ge=0)
    ppo_minibatch_size: int = _f(64, "samples per critic optimizer step", ge=1)
    ppo_epochs: int = _f(1, "passes over each step's batch", ge=1)
    micro_batch_tokens: int = _f(8192, "token budget of one forward/backward", ge=1)


@dataclass
class FSDPConfig:
    """How trained roles (actor, critic) and the reference are sharded at world size > 1."""

    strategy: Literal["fsdp2", "none"] = _f(
        "fsdp2",
        "fsdp2: fully_shard per decoder layer + root; none: plain module (world size 1 only)",
    )
    sharding: Literal["full", "grad_op"] = _f(
        "full", "full: ZeRO-3-like (params resharded after forward); grad_op: ZeRO-2-like"
    )
    mixed_precision: Literal["auto", "fp32", "bf16"] = _f(
        "auto",
        "training and reference precision. GPU: bf16 = bf16 params + fp32 reduce "
        "(FSDP2, world size > 1), or bf16 autocast with fp32 master weights and optimizer state "
        "(one GPU); auto = bf16 where the GPU has native bf16 (compute capability >= 8.0), else "
        "fp32. CPU: bf16 = autocast with fp32 "
        "master weights and optimizer state; auto = bf16 when the CPU has "
        "native bf16 matmuls (amx_bf16, avx512_bf16) and a measurement on the "
        "model says they pay (>= 1.3x), else fp32",
    )
    cpu_offload: bool = _f(
        False, "keep sharded params, grads and optimizer states in CPU memory (GPU only)"
    )
    activation_checkpointing: bool = _f(
        False, "recompute each decoder layer's activations in backward"
    )


@dataclass
class SFTConfig:
    steps: int | None = _f(
        None,
        "fixed number of warm-start optimizer steps, no accuracy check (null: train until "
        "target_accuracy is reached, at most max_steps)",
        ge=0,
    )
    target_accuracy: float = _f(
        0.4,
        "stop the warm start at the first check whose sampled (T = 1) accuracy on held-out "
        "prompts reaches this; below 1 so that RL has room to gain",
        gt=0,
        le=1,
    )
    max_steps: int = _f(
        2000,
        "cap on warm-start steps when steps is null (a warning says the target was not reached)",
        ge=1,
    )
    eval_every: int = _f(10, "accuracy check every N warm-start steps (when steps is null)", ge=1)
    eval_size: int = _f(
        256, "held-out prompts per accuracy check (those that no SFT batch so far contained)", ge=1
    )
    batch_size: int = _f(256, "examples per SFT step", ge=1)
    lr: float = _f(3e-3, "SFT AdamW learning rate", gt=0)
    checkpoint: str | None = _f(
        None,
        "warm-start checkpoint directory "
        "(null: a cache path derived from the model/task/sft config)",
    )
    enabled: bool | None = _f(
        None,
        "run (or reuse) the warm start before RL (null: on for a built-in model and task, off "
        "with model.path or data.train_files)",
    )

    def validate(self) -> None:
        if self.enabled is not False:
            self.check_checkpoint_writable()

    def check_checkpoint_writable(self, reuse: bool = True) -> None:
        """A ValueError when the warm start would be trained but ``checkpoint`` cannot be written
        (checked before the training, not after it). With ``reuse`` a cached one (it holds a
        config.json) is only read, so it need not be writable."""
        if not self.checkpoint:
            return
        if not (reuse and (Path(self.checkpoint) / "config.json").is_file()):
            _check_writable_dir("sft.checkpoint", self.checkpoint)


@dataclass
class AsyncConfig:
    """Fully asynchronous training (``trainer.mode: async``, ``driver/asynchronous.py``)."""

    max_staleness: int = _f(
        1, "a trained sample is at most this many weight versions old (0: on-policy)", ge=0
    )
    max_concurrent_prompts: int = _f(64, "prompt groups generating at once on a rollout rank", ge=1)
    batch_timeout_s: float = _f(
        600.0, "the learner fails when no batch is ready for this long (a dead rollout)", gt=0
    )


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


@dataclass
class MoEConfig:
    """Mixture-of-experts training (``hybridrl/moe/``, docs/moe.md): routing replay, load
    balancing and routing health. Replay and balancing need an MoE model."""

    routing_replay: Literal["none", "r2", "r3"] = _f(
        "none",
        "which expert choices the training forwards use: none (the trainer routes afresh), r2 "
        "(the update replays the routing of the trainer's old-policy pass), r3 (every training "
        "forward replays the routing the rollout recorded)",
    )
    aux_loss_coef: float = _f(
        0.0,
        "Switch-style load-balancing loss added to the actor's loss: coef x experts x sum of "
        "(token fraction x mean router probability) per expert, averaged over layers (0: off)",
        ge=0,
    )
    z_loss_coef: float = _f(
        0.0, "router z-loss: coef x mean over tokens of logsumexp(router logits)^2 (0: off)", ge=0
    )
    bias_update_rate: float = _f(
        0.0,
        "auxiliary-loss-free balancing: a per-expert bias added to the router scores for "
        "selection only, moved by this rate x sign(mean load - load) after every optimizer step "
        "(0: off)",
        ge=0,
    )
    health_max_mean_threshold: float = _f(
        3.0,
        "warn (and set moe/alert_imbalance) when a layer's busiest expert gets more than this "
        "many times the mean load",
        gt=1,
    )
    health_empty_steps: int = _f(
        20,
        "warn (and set moe/alert_dead_expert) when an expert of a layer receives no token for "
        "this many steps in a row",
        ge=1,
    )

    @property
    def active(self) -> bool:
        """Whether any setting needs a mixture-of-experts model."""
        return (
            self.routing_replay != "none"
            or self.aux_loss_coef > 0
            or self.z_loss_coef > 0
            or self.bias_update_rate > 0
        )


@dataclass
class AlertsConfig:
    """Training-health alerts on each logged step's metrics (``telemetry/alerts.py``): a warning,
    a row in ``<run>/alerts.jsonl`` and the metric ``alert/<name>`` = 1; a rule that keeps firing
    is logged once per streak. A threshold of 0 turns its rule off."""

    enabled: bool = _f(True, "check the alert rules on every logged step")
    max_nonfinite_in_a_row: int = _f(
        3,
        "the run stops after this many consecutive optimizer steps of one role skipped for a "
        "non-finite loss or gradient norm (0: never stops; skips are still counted and alerted)",
        ge=0,
    )
    entropy_floor: float = _f(0.01, "entropy_collapse: actor/entropy below this", ge=0)
    reward_std_zero_steps: int = _f(
        5, "reward_std_zero: reward/std == 0 (no learning signal) this many steps in a row", ge=0
    )
    reward_drop: float = _f(
        0.5, "reward_drop: reward/mean more than this below its best so far", ge=0
    )
    kl_ref_max: float = _f(1.0, "kl_ref_blowup: actor/kl_ref above this", ge=0)
    approx_kl_old_max: float = _f(0.5, "approx_kl_old_blowup: actor/approx_kl_old above this", ge=0)
    grad_norm_spike: float = _f(
        10.0,
        "grad_norm_spike: actor/grad_norm above this many times the median of its last 50 "
        "(positive) values, once 5 are known",
        ge=0,
    )
    staleness_bound_steps: int = _f(
        5,
        "staleness_at_bound: async/staleness_max == asynchronous.max_staleness (> 0) this many "
        "steps in a row",
        ge=0,
    )


@dataclass
class TrainerConfig:
    name: str | None = _f(
        None,
        "run name: outputs go to <runs_dir>/<name> (null: <task or dataset>_<advantage>, e.g. "
        "arith_grpo)",
    )
    mode: Literal["sync", "async"] = _f(
        "sync", "sync: generate then train, in turn; async: at once (see asynchronous.*)"
    )
    runs_dir: str = _f("runs", "parent directory of run outputs")
    total_steps: int = _f(200, "RL steps", ge=0)
    prompts_per_step: int = _f(32, "prompts per RL step", ge=1)
    samples_per_prompt: int = _f(8, "G: samples per prompt", ge=1)
    balance_batch: bool = _f(
        True,
        "reorder each step's samples so that every data-parallel rank of a trained role gets "
        "an equal token count (Karmarkar-Karp over sequence lengths)",
    )
    eval_every: int = _f(10, "held-out evaluation every N steps (0: only before and after)", ge=0)
    save_every: int = _f(20, "checkpoint every N steps (0: only at the end)", ge=0)
    keep_checkpoints: int = _f(2, "checkpoints kept on disk", ge=1)
    max_restarts: int = _f(
        3,
        "times a run (one invocation; --resume may restart as often again) restarts by itself "
        "from its last checkpoint after a worker died or a rollout call timed out "
        "(rollout.timeout_s, asynchronous.batch_timeout_s); at most save_every steps are computed "
        "again each time (0: stop with the error)",
        ge=0,
    )
    async_save: bool = _f(
        False,
        "write checkpoints in the background: the saving step only snapshots the trained state to "
        "host memory (one more copy of weights and optimizer) and training goes on; at most one "
        "save in flight, the next save and the end of the run wait for it (docs/operations.md)",
    )
    prefetch_steps: int = _f(
        1,
        "steps of prompts prepared ahead on a background thread (task.prompt: reading, chat "
        "template, tokenizing) while the current step runs (the rollout stream's admissions in "
        "an asynchronous run); the same prompts in the same order (0: off)",
        ge=0,
        le=2,
    )
    seed: int = _f(0, "seed of the prompt stream, sampling and shuffling", ge=0, le=SEED_MAX)
    loggers: list[str] = _f(
        ["jsonl", "tensorboard"],
        "where metrics go: jsonl (metrics.jsonl, always written: reports and resume read it), "
        "tensorboard, wandb (offline unless WANDB_API_KEY is set; pip install hybridrl[wandb])",
        choices=("jsonl", "tensorboard", "wandb"),
    )
    wandb_project: str = _f("hybridrl", "wandb project name")
    log_samples_every: int = _f(
        10,
        "every N steps a table of sample completions (prompt, completion, reward and its extras) "
        "goes to samples.jsonl, TensorBoard text and wandb (0: never)",
        ge=0,
    )
    log_samples: int = _f(4, "completions in each sample table", ge=1)
    progress: bool = _f(True, "show a progress bar")
    step_timeout_s: float = _f(
        1800.0,
        "seconds one step of the driver loop may take (generation, the learning step and the "
        "weight sync, plus the evaluation or checkpoint when due): past it every worker's Python "
        "stacks go to <run>/hang/ and the run stops with an error naming the calls still waited "
        "for",
        gt=0,
    )
    profile_steps: list[int] = _f(
        [],
        "steps (1-based, as in metrics.jsonl) during which every worker process runs the torch "
        "profiler; Chrome traces go to <run>/profile/<worker>-rank<k>-step<N>.json.gz (open in "
        "Perfetto); a step beyond the run is never reached. Every step's phase spans go to "
        "<run>/timeline.jsonl regardless",
    )
    profile_record_shapes: bool = _f(
        False, "profiled steps: record operator input shapes (larger traces)"
    )

    def validate(self) -> None:
        if self.name == "":
            raise ValueError("name must not be empty (null: derived from the task)")
        bad = [s for s in self.profile_steps if s < 1]
        if bad:
            raise ValueError(f"profile_steps holds {bad[0]}: steps count from 1")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    data: DataConfig = field(default_factory=DataConfig)
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    asynchronous: AsyncConfig = field(default_factory=AsyncConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    alerts: AlertsConfig = field(default_factory=AlertsConfig)

    def __post_init__(self):
        """Resolve the defaults that depend on other sections (so the saved config.yaml says what
        ran)."""
        if self.sft.enabled is None:  # the arithmetic warm start suits only the built-in setup
            self.sft.enabled = self.model.path is None and self.data.train_files is None
        if self.trainer.name is None:
            self.trainer.name = f"{self.source_name}_{self.algorithm.advantage}"
        if self.algorithm.policy_loss == "auto":
            self.algorithm.policy_loss = (
                "decoupled_ppo" if self.trainer.mode == "async" else "ppo_clip"
            )

    @property
    def source_name(self) -> str:
        """The prompt source in a word: the first training file's stem, or the task's name."""
        files = self.data.train_files
        if files:
            first = Path(files if isinstance(files, str) else files[0])
            return (first.name if first.is_dir() else first.stem).split(".")[0] or "data"
        return self.task.name.rsplit(":", 1)[-1].rsplit(".", 1)[-1].lower()

    @property
    def loss_norm_len(self) -> int:
        """The fixed length of ``seq-mean-token-sum-norm`` (default: the longest response)."""
        return self.algorithm.loss_agg_norm_len or self.rollout.max_new_tokens

    def validate(self) -> None:
        if self.controller.backend == "local":
            pool = self.controller.pools[self.controller.placement["learner"]]
            if pool.nodes * pool.workers_per_node > 1:
                raise ValueError(
                    f"the learner pool has {pool.nodes * pool.workers_per_node} workers: "
                    "more than one learner rank needs one process per rank, "
                    "i.e. controller.backend=ray"
                )
        if self.trainer.mode == "async":
            self._validate_async()
        if "reward_model" in self.controller.placement and self.task.reward_model_path is None:
            raise ValueError(
                "controller.placement.reward_model is set but task.reward_model_path is null: "
                "give the reward model's checkpoint or drop placement.reward_model"
            )
        self._validate_estimator()
        if (
            self.env.cross_policy_frac > 0
            and self.env.cross_policy_tokens == "weighted"
            and self.algorithm.policy_loss != "decoupled_ppo"
            and self.algorithm.rollout_is is None
        ):
            raise ValueError(
                "env.cross_policy_tokens=weighted trains on another policy's tokens: it needs an "
                "importance weight against their behaviour log-probs, algorithm.policy_loss="
                "decoupled_ppo or algorithm.rollout_is=token (or use cross_policy_tokens=masked)"
            )
        if self.env.cross_policy_frac > 0 and self.env.name is None:
            raise ValueError("env.cross_policy_frac applies to multi-turn rollouts: set env.name")
        from hybridrl.algorithms import rollout_correction  # lazy: schema stays import-light

        rollout_correction.validate(self)
        self._validate_lora()
        samples = self.trainer.prompts_per_step * self.trainer.samples_per_prompt
        if samples > MAX_SAMPLES_PER_STEP:
            raise ValueError(
                f"trainer.prompts_per_step * trainer.samples_per_prompt = {samples} samples per "
                f"step, above {MAX_SAMPLES_PER_STEP}: a step holds all its samples in memory at "
                "once; lower trainer.prompts_per_step (`hybridrl memory` estimates the training "
                "memory of a model and layout)"
            )
        if samples % self.actor.ppo_minibatch_size:
            raise ValueError(
                f"trainer.prompts_per_step * trainer.samples_per_prompt = {samples} must be a "
                f"multiple of actor.ppo_minibatch_size = {self.actor.ppo_minibatch_size}"
            )

    def _validate_lora(self) -> None:
        """``actor.lora_target_modules`` against the decoder's Linear module names, when LoRA is on
        and the model is one whose names are known (built-in, or a Qwen2/Qwen3/Llama checkpoint).
        A name may carry its parent (``self_attn.q_proj``), as PEFT matches name suffixes."""
        if self.actor.lora_rank <= 0:
            return
        if self.model.path is not None:
            config = Path(self.model.path).expanduser() / "config.json"
            try:
                model_type = json.loads(config.read_text()).get("model_type")
            except (OSError, ValueError, AttributeError):
                return  # an unreadable config.json is reported when the model loads
            if model_type not in LORA_MODEL_TYPES:
                return
        for i, name in enumerate(self.actor.lora_target_modules):
            if name.rsplit(".", 1)[-1] not in LORA_TARGETS:
                hint = (
                    " (PEFT's 'all-linear' is not supported here: list the modules)"
                    if name == "all-linear"
                    else ""
                )
                raise ValueError(
                    f"actor.lora_target_modules[{i}] = {name!r} names no Linear module of the "
                    f"model{hint}; the modules: {', '.join(LORA_TARGETS)}"
                )

    def _validate_estimator(self) -> None:
        """What the advantage estimator declares it needs (attributes, not names) against the rest
        of the config."""
        from hybridrl.algorithms.advantages import (
            ADVANTAGES,  # lazy: only the estimator's attributes are read
        )

        try:
            est = ADVANTAGES.get(self.algorithm.advantage)
        except KeyError:
            return  # an unknown name is reported by the plug-in check, with the registered names
        name = self.algorithm.advantage
        if self.trainer.mode == "async" and getattr(est, "needs_greedy_baseline", False):
            raise ValueError(
                f"algorithm.advantage={name} needs a greedy baseline response per prompt, which "
                "trainer.mode=async does not generate; use trainer.mode=sync"
            )
        least = getattr(est, "min_group_size", 1)
        if self.trainer.samples_per_prompt < least:
            raise ValueError(
                f"algorithm.advantage={name} needs trainer.samples_per_prompt >= {least}, "
                f"got {self.trainer.samples_per_prompt}"
            )

    def _validate_async(self) -> None:
        place = self.controller.placement
        if self.controller.backend == "ray" and place["rollout"] == place["learner"]:
            raise ValueError(
                "trainer.mode=async with controller.backend=ray: the rollout needs its own pool "
                "(rollout and training run at the same time); "
                "map placement.rollout to a pool other than the learner's"
            )
        rm = self.controller.pool_of("reward_model")
        ray = self.controller.backend == "ray"
        if ray and self.task.reward_model_path and rm == place["learner"] != place["rollout"]:
            raise ValueError(
                "trainer.mode=async: placement.reward_model shares the learner's pool, whose "
                "process is busy training while the rollout scores; map it to the rollout's pool "
                "or a pool of its own"
            )
