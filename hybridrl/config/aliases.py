"""The names TRL and veRL users bring, and hybridrl's key for each: one table, read by the
unknown-key error (``convert.py``) and printed in docs/configuration.md.

A name is matched against the whole dotted key a user wrote, at a dot boundary: ``adv_estimator``
matches ``algorithm.adv_estimator``, ``rollout.n`` matches ``rollout.n`` and
``actor_rollout_ref.rollout.n``. The longest matching name wins. The error refuses the key and names
ours (a value is never carried over silently: where the units differ, the note says how).
"""

from __future__ import annotations

# their name -> (whose, our key, how the two differ: "" when they mean the same)
ALIASES: dict[str, tuple[str, str, str]] = {
    # TRL (GRPOConfig and the transformers TrainingArguments it extends)
    "learning_rate": ("TRL", "actor.lr", ""),
    "num_generations": ("TRL", "trainer.samples_per_prompt", ""),
    "beta": ("TRL", "algorithm.kl_coef", "0 turns the KL term off, as TRL's default does"),
    "max_completion_length": ("TRL", "rollout.max_new_tokens", ""),
    "num_train_epochs": ("TRL", "data.epochs", ""),
    "max_steps": ("TRL", "trainer.total_steps", ""),
    "save_steps": ("TRL", "trainer.save_every", ""),
    "eval_steps": ("TRL", "trainer.eval_every", ""),
    "report_to": ("TRL", "trainer.loggers", "a string or a list: jsonl, tensorboard, wandb"),
    "epsilon": ("TRL", "algorithm.clip_ratio_low", ""),
    "epsilon_high": ("TRL", "algorithm.clip_ratio_high", ""),
    "loss_type": ("TRL", "algorithm.loss_agg", ""),
    "num_iterations": ("TRL", "actor.ppo_epochs", ""),
    "max_grad_norm": ("TRL", "actor.grad_clip", ""),
    "warmup_steps": ("TRL", "actor.lr_warmup_steps", ""),
    "per_device_train_batch_size": (
        "TRL",
        "actor.ppo_minibatch_size",
        "TRL counts completions per device; ours counts the samples of one optimizer step over "
        "all learner ranks",
    ),
    # veRL (ppo_trainer.yaml)
    "adv_estimator": ("veRL", "algorithm.advantage", ""),
    "max_response_length": ("veRL", "rollout.max_new_tokens", ""),
    "test_freq": ("veRL", "trainer.eval_every", ""),
    "save_freq": ("veRL", "trainer.save_every", ""),
    "total_training_steps": ("veRL", "trainer.total_steps", ""),
    "total_epochs": ("veRL", "data.epochs", ""),
    "train_batch_size": ("veRL", "trainer.prompts_per_step", "both count prompts"),
    "ppo_mini_batch_size": (
        "veRL",
        "actor.ppo_minibatch_size",
        "veRL counts prompts, hybridrl counts samples: multiply by trainer.samples_per_prompt",
    ),
    "rollout.n": ("veRL", "trainer.samples_per_prompt", ""),
    "kl_loss_coef": ("veRL", "algorithm.kl_coef", ""),
    "use_kl_loss": ("veRL", "algorithm.kl_coef", "0 turns the KL loss off"),
    "kl_loss_type": ("veRL", "algorithm.kl_estimator", ""),
    "entropy_coeff": ("veRL", "algorithm.entropy_coef", ""),
    "loss_agg_mode": ("veRL", "algorithm.loss_agg", ""),
    "norm_adv_by_std_in_grpo": ("veRL", "algorithm.norm_adv_by_std", ""),
    "ppo_max_token_len_per_gpu": ("veRL", "actor.micro_batch_tokens", ""),
    "tensor_model_parallel_size": ("veRL", "rollout.backend_options.tensor_parallel_size", ""),
    "optim.lr": ("veRL", "actor.lr", ""),
    "logger": ("veRL", "trainer.loggers", ""),
    "project_name": ("veRL", "trainer.wandb_project", ""),
    "experiment_name": ("veRL", "trainer.name", ""),
    "actor_rollout_ref": (
        "veRL",
        "actor",
        "veRL's actor_rollout_ref section is split here: actor.*, rollout.*, model.path",
    ),
}


# keys a plug-in's options replaced: old key -> (new key, the plug-ins it belongs to)
MOVED: dict[str, tuple[str, str]] = {
    "algorithm.rloo_group_of_one": ("algorithm.advantage_options.group_of_one", "advantage rloo"),
    "algorithm.gdpo_reward_keys": ("algorithm.advantage_options.reward_keys", "advantage gdpo"),
    "algorithm.gdpo_reward_weights": (
        "algorithm.advantage_options.reward_weights",
        "advantage gdpo",
    ),
    "algorithm.cispo_clip_low": ("algorithm.policy_loss_options.clip_low", "policy_loss cispo"),
    "algorithm.cispo_clip_high": ("algorithm.policy_loss_options.clip_high", "policy_loss cispo"),
    "algorithm.gmpo_log_clip_low": (
        "algorithm.policy_loss_options.log_clip_low",
        "policy_loss gmpo",
    ),
    "algorithm.gmpo_log_clip_high": (
        "algorithm.policy_loss_options.log_clip_high",
        "policy_loss gmpo",
    ),
    "algorithm.clip_cov_ratio": ("algorithm.policy_loss_options.ratio", "policy_loss clip_cov"),
    "algorithm.clip_cov_lb": ("algorithm.policy_loss_options.lb", "policy_loss clip_cov"),
    "algorithm.clip_cov_ub": ("algorithm.policy_loss_options.ub", "policy_loss clip_cov"),
    "algorithm.clip_cov_seed": ("algorithm.policy_loss_options.seed", "policy_loss clip_cov"),
    "algorithm.kl_cov_ratio": ("algorithm.policy_loss_options.ratio", "policy_loss kl_cov"),
    "algorithm.kl_cov_coef": ("algorithm.policy_loss_options.coef", "policy_loss kl_cov"),
    "algorithm.sapo_tau_pos": ("algorithm.policy_loss_options.tau_pos", "policy_loss sapo"),
    "algorithm.sapo_tau_neg": ("algorithm.policy_loss_options.tau_neg", "policy_loss sapo"),
    "algorithm.dro_beta": ("algorithm.policy_loss_options.beta", "policy_loss dro"),
    "rollout.max_batch_size": ("rollout.backend_options.max_batch_size", "backend native / hf"),
    "rollout.kv_cache_bytes": ("rollout.backend_options.kv_cache_bytes", "backend native / vllm"),
    "rollout.block_size": ("rollout.backend_options.block_size", "backend native"),
    "rollout.max_num_batched_tokens": (
        "rollout.backend_options.max_num_batched_tokens",
        "backend native",
    ),
    "rollout.enable_prefix_caching": (
        "rollout.backend_options.enable_prefix_caching",
        "backend native / vllm / sglang",
    ),
    "rollout.draft_model_path": ("rollout.backend_options.draft_model_path", "backend native"),
    "rollout.num_speculative_tokens": (
        "rollout.backend_options.num_speculative_tokens",
        "backend native",
    ),
    "rollout.spec_max_batch": ("rollout.backend_options.spec_max_batch", "backend native"),
    "rollout.dtype": ("rollout.backend_options.dtype", "backend native / hf"),
    "rollout.kv_cache_memory_fraction": (
        "rollout.backend_options.kv_cache_memory_fraction",
        "backend native",
    ),
    "rollout.engine_model_path": (
        "rollout.backend_options.engine_model_path",
        "backend vllm / sglang",
    ),
    "rollout.gpu_memory_utilization": (
        "rollout.backend_options.gpu_memory_utilization",
        "backend vllm / sglang",
    ),
    "rollout.tensor_parallel_size": (
        "rollout.backend_options.tensor_parallel_size",
        "backend vllm / sglang",
    ),
    "rollout.engine_kwargs": ("rollout.backend_options.engine_kwargs", "backend vllm / sglang"),
}


def alias_hint(key: str) -> str | None:
    """What to write instead of ``key`` (a dotted key): a key that moved under a plug-in's
    options, or a TRL or veRL name."""
    if key in MOVED:
        new, owner = MOVED[key]
        return f"'{key}' moved to the {owner} options: use '{new}'"
    matches = [name for name in ALIASES if key == name or key.endswith("." + name)]
    if not matches:
        return None
    name = max(matches, key=len)
    whose, ours, note = ALIASES[name]
    return f"'{name}' is {whose}'s name: use '{ours}'" + (f" ({note})" if note else "")


def alias_table() -> str:
    """The table as Markdown (docs/configuration.md)."""
    rows = ["| their key | whose | hybridrl | note |", "|---|---|---|---|"]
    for name, (whose, ours, note) in ALIASES.items():
        rows.append(f"| `{name}` | {whose} | `{ours}` | {note} |")
    return "\n".join(rows)
