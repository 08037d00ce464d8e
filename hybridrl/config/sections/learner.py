"""The learning step: ``actor``, ``algorithm``, ``critic``, ``fsdp`` and ``moe``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from hybridrl.config.sections.common import (
    _f,
)


@dataclass
class ActorConfig:
    lr: float | None = _f(
        None,
        "AdamW learning rate (null: 1e-6 for a model.path checkpoint, TRL's and veRL's rate; 1e-4 "
        "for the built-in toy models)",
        gt=0,
    )
    lr_schedule: Literal["constant", "linear", "cosine"] = _f(
        "constant",
        "after the warmup: constant, or linear or cosine decay to lr x min_lr_ratio at the run's "
        "last optimizer step (logged as actor/lr)",
    )
    lr_warmup_steps: int = _f(
        0,
        "optimizer steps over which the learning rate rises linearly to lr (0: lr_warmup_ratio): "
        "a fresh AdamW's first steps move every weight by about lr, noise included",
        ge=0,
    )
    lr_warmup_ratio: float = _f(
        0.0,
        "the warmup as a share of the run's optimizer steps, when lr_warmup_steps is 0",
        ge=0,
        le=1,
    )
    min_lr_ratio: float = _f(0.0, "where linear or cosine decay ends, as a share of lr", ge=0, le=1)
    weight_decay: float = _f(0.0, "AdamW weight decay", ge=0)
    grad_clip: float = _f(1.0, "max global grad norm (0: off)", ge=0)
    ppo_minibatch_size: int = _f(
        64,
        "samples (not prompts: a prompt's samples_per_prompt samples count each) per optimizer "
        "step; veRL's ppo_mini_batch_size counts prompts",
        ge=1,
    )
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
        "module names that get adapters (a name or its dotted suffix), or all-linear alone: every "
        "Linear module but the output head, as PEFT means it",
    )
    packing: bool = _f(
        True,
        "pack whole sequences into rows (best-fit decreasing; each mini-batch's row width weighs "
        "the padding it saves against the attention a wider row costs; attention kept inside "
        "each sequence) in the learner's passes, its updates and the SFT warm start, instead of "
        "length-grouped micro-batches: the same log-probs and gradients (to float rounding) "
        "with less padding",
    )
    compile: bool | Literal["auto"] = _f(
        "auto",
        "torch.compile each decoder layer of the policy and the reference (inductor, dynamic "
        "shapes; same results to fp32 rounding; learner/compile.py): true, false, or auto = on "
        "where it measured faster (a CPU in fp32, hidden size >= 512, a tested family, not "
        "sharded, no LoRA); the first step pays the compile",
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
        "remax, grpo_passk, opo, gdpo, gpg, optimal_token_baseline, tir_optimal_token_baseline "
        "(registry name or dotted path)",
    )
    policy_loss: str = _f(
        "auto",
        "policy loss: ppo_clip, gspo, gspo_token, decoupled_ppo, cispo, gmpo, clip_cov, kl_cov, "
        "sapo, reinforce, dro, dppo_tv, dppo_kl (registry name or dotted path); "
        "auto: decoupled_ppo when trainer.mode is async, else ppo_clip",
    )
    norm_adv_by_std: bool = _f(
        True, "grpo, grpo_passk, gdpo: divide by the group's std (false: Dr.GRPO)"
    )
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
    advantage_options: dict[str, Any] = _f(
        {},
        "the advantage estimator's own options, as the estimator declares them (listed per "
        "estimator under 'Plug-in options' in docs/configuration.md); e.g. "
        "algorithm.advantage_options.group_of_one=zero with rloo",
        options_of="advantage",
    )
    policy_loss_options: dict[str, Any] = _f(
        {},
        "the policy loss's own options, as the loss declares them (listed per loss under "
        "'Plug-in options' in docs/configuration.md); e.g. "
        "algorithm.policy_loss_options.clip_high=0.3 with cispo",
        options_of="policy_loss",
    )
    loss_agg: str = _f("token-mean", "loss aggregation", choices=LOSS_AGG_MODES)
    loss_agg_norm_len: int | None = _f(
        None, "seq-mean-token-sum-norm: the fixed length (null: rollout.max_new_tokens)", ge=1
    )
    kl_coef: float | None = _f(
        None,
        "weight of the KL-to-reference loss term; 0: no term and no reference model unless "
        "kl_reward_coef needs one (null: 0 for a model.path checkpoint, as TRL's beta and veRL's "
        "use_kl_loss default; 0.001 for the built-in toy models)",
        ge=0,
    )
    kl_estimator: str = _f(
        "k3",
        "KL estimator of the loss term and the reward penalty: k1, k2, k3, abs; k1+, k2+, k3+, "
        "abs+ (the value of k1/k2/k3/abs with the gradient of k2)",
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
    max_sampling_rounds: int = _f(
        4,
        "dynamic sampling: DAPO's generate rounds per step at most: up to max_sampling_rounds - 1 "
        "uniform groups are dropped per group kept",
        ge=1,
    )
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
    rollout_is_batch_normalize: bool = _f(
        False,
        "rollout correction: divide the weights by their mean (over valid tokens at token level, "
        "over non-empty sequences at sequence level) so that they average 1",
    )
    rollout_bypass: bool = _f(
        False,
        "use the rollout's log-probs as the old policy: no old-log-prob forward; with rollout_is "
        "(policy_loss reinforce) the weight is pi/pi_rollout of the current policy",
    )

    def check_plugins(self) -> None:
        """The chosen estimator's and loss's options, read into the dataclass each declares (its
        ``options`` attribute, whose ``__post_init__`` holds any rule between them); never by
        name here. The whole config's ``validate`` calls it, once ``policy_loss: auto`` is
        resolved."""
        # lazy: the algorithms import the config
        from hybridrl.algorithms import ADVANTAGES, POLICY_LOSSES
        from hybridrl.config.convert import ConfigError

        for registry, role in ((ADVANTAGES, "advantage"), (POLICY_LOSSES, "policy_loss")):
            name = getattr(self, role)
            try:
                plugin = registry.get(name)
            except KeyError:  # unknown, or "auto": reported or resolved elsewhere
                continue
            declared, given = getattr(plugin, "options", None), getattr(self, f"{role}_options")
            if declared is None and given:
                raise ConfigError(
                    f"config key 'algorithm.{role}_options': {role} {name!r} declares no "
                    f"options, got {', '.join(map(str, given))}"
                )
            if declared is not None:
                self.options(declared, role)

    def options(self, declared: type, role: str):
        """``<role>_options`` (role: "advantage" or "policy_loss") read into the plug-in's
        options dataclass ``declared``: every key checked, the others at their defaults
        (ConfigError naming the key). Read once per value."""
        from hybridrl.config.convert import from_dict

        given = getattr(self, f"{role}_options")
        cache = self.__dict__.setdefault("_read_options", {})
        key = (declared, role, repr(given))
        if key not in cache:
            cache[key] = from_dict(declared, given, f"algorithm.{role}_options")
        return cache[key]


@dataclass
class CriticConfig:
    lr: float = _f(1e-3, "critic AdamW learning rate (gae only)", gt=0)
    lr_schedule: Literal["constant", "linear", "cosine"] = _f(
        "constant", "as actor.lr_schedule, for the critic (logged as critic/lr)"
    )
    lr_warmup_steps: int = _f(0, "as actor.lr_warmup_steps, for the critic", ge=0)
    lr_warmup_ratio: float = _f(0.0, "as actor.lr_warmup_ratio, for the critic", ge=0, le=1)
    min_lr_ratio: float = _f(0.0, "as actor.min_lr_ratio, for the critic", ge=0, le=1)
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
    ep_size: int = _f(
        1,
        "expert parallelism: the learner's ranks split each MoE layer's experts (policy and "
        "reference) in groups of this many ranks, each holding experts / ep_size of them; tokens "
        "travel to their experts by all-to-all. Must divide the learner's world size and the "
        "number of experts (1: off)",
        ge=1,
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
