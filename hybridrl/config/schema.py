"""The configuration schema: one dataclass per component, nested in :class:`Config`.

Field metadata drives validation (``ge``/``gt``/``le``/``lt``/``choices``) and
the ``help`` text; ``validate()`` methods check relations between fields.
Everything is checked before any work starts (see ``config/loader.py``).

The sections live in ``config/sections/``, grouped by concern:

- ``common.py``: the shared bounds and names (``SEED_MAX``, ``MAX_SAMPLES_PER_STEP``,
  ``LORA_TARGETS``, ``LORA_MODEL_TYPES``), ``_f`` and the path checks;
- ``model.py``: ``model``, ``task``, ``data``;
- ``controller.py``: ``controller``, its pools and the roles it places;
- ``rollout.py``: ``rollout``, ``env``;
- ``learner.py``: ``actor``, ``algorithm``, ``critic``, ``fsdp``, ``moe``;
- ``trainer.py``: ``trainer``, ``sft``, ``asynchronous``, ``alerts``, ``eval``.

This module holds :class:`Config` (the checks across sections) and re-exports every name of the
sections, so ``hybridrl.config.schema.X`` imports them all.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from hybridrl.config.sections.common import (
    ALL_LINEAR,
    LORA_MODEL_TYPES,
    LORA_TARGETS,
    MAX_SAMPLES_PER_STEP,
    SEED_MAX,
    _absolute_file_path,
    _check_checkpoint_dir,
    _check_reward_model,
    _check_writable_dir,
    _f,
)
from hybridrl.config.sections.controller import (
    FORMER_ROLES,
    OPTIONAL_ROLES,
    ROLES,
    ControllerConfig,
    PoolConfig,
)
from hybridrl.config.sections.learner import (
    LOSS_AGG_MODES,
    ActorConfig,
    AlgorithmConfig,
    CriticConfig,
    FSDPConfig,
    MoEConfig,
)
from hybridrl.config.sections.model import (
    DataConfig,
    ModelConfig,
    TaskConfig,
)
from hybridrl.config.sections.rollout import (
    EnvConfig,
    RolloutConfig,
)
from hybridrl.config.sections.trainer import (
    AlertsConfig,
    AsyncConfig,
    EvalConfig,
    SFTConfig,
    TrainerConfig,
)

# defaults that depend on the model: (a model.path checkpoint, a built-in toy model). A real LLM
# gets TRL's and veRL's values; the built-in 1M-parameter models learn their tasks with these
MODEL_DEFAULTS = {
    ("actor", "lr"): (1e-6, 1e-4),
    ("rollout", "max_new_tokens"): (256, 16),
    ("algorithm", "kl_coef"): (0.0, 0.001),
    ("sft", "lr"): (2e-5, 3e-3),
}


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
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self):
        """Resolve the defaults that depend on other sections (so the saved config.yaml says what
        ran)."""
        real = self.model.path is not None  # a checkpoint; the built-in models are toys
        for (section, key), (checkpoint, builtin) in MODEL_DEFAULTS.items():
            if getattr(getattr(self, section), key) is None:
                setattr(getattr(self, section), key, checkpoint if real else builtin)
        if self.sft.enabled is None:  # the arithmetic warm start suits only the built-in setup
            self.sft.enabled = self.sft.train_files is not None or (
                self.model.path is None and self.data.train_files is None
            )
        if self.trainer.name is None:  # one path component: a plug-in's path gives its last part
            advantage = self.algorithm.advantage.rsplit(":", 1)[-1].rsplit(".", 1)[-1]
            self.trainer.name = f"{self.source_name}_{advantage}"
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
    def max_staleness(self) -> int:
        """The staleness bound the run trains under: ``asynchronous.max_staleness``, 0 in
        synchronous training."""
        return self.asynchronous.max_staleness if self.trainer.mode == "async" else 0

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
        self.algorithm.check_plugins()  # after policy_loss "auto" is resolved
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
        targets = self.actor.lora_target_modules
        if ALL_LINEAR in targets:
            if len(targets) > 1:
                raise ValueError(
                    f"actor.lora_target_modules: {ALL_LINEAR!r} (every Linear module but the "
                    f"head) stands alone, got {targets}"
                )
            return
        for i, name in enumerate(targets):
            if name.rsplit(".", 1)[-1] not in LORA_TARGETS:
                raise ValueError(
                    f"actor.lora_target_modules[{i}] = {name!r} names no Linear module of the "
                    f"model; the modules: {', '.join(LORA_TARGETS)}, or {ALL_LINEAR!r} alone"
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
        if getattr(est, "needs_sum_pi_squared", False):
            # the plain policy's old-log-prob pass adds sum_pi_squared; bypass skips that pass
            # and a pipelined policy's pass returns log-probs only
            skipped = "algorithm.rollout_bypass" if self.algorithm.rollout_bypass else None
            skipped = skipped or ("actor.pp_size > 1" if self.actor.pp_size > 1 else None)
            if skipped:
                raise ValueError(
                    f"algorithm.advantage={name} reads sum_pi_squared from the policy's "
                    f"old-log-prob pass, which {skipped} does not provide; use another estimator "
                    "or turn it off"
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


__all__ = [
    "ActorConfig",
    "AlertsConfig",
    "EvalConfig",
    "AlgorithmConfig",
    "AsyncConfig",
    "Config",
    "ControllerConfig",
    "CriticConfig",
    "DataConfig",
    "EnvConfig",
    "FORMER_ROLES",
    "FSDPConfig",
    "LORA_MODEL_TYPES",
    "ALL_LINEAR",
    "LORA_TARGETS",
    "LOSS_AGG_MODES",
    "MAX_SAMPLES_PER_STEP",
    "MoEConfig",
    "ModelConfig",
    "OPTIONAL_ROLES",
    "PoolConfig",
    "ROLES",
    "RolloutConfig",
    "SEED_MAX",
    "SFTConfig",
    "TaskConfig",
    "TrainerConfig",
    "_absolute_file_path",
    "_check_checkpoint_dir",
    "_check_reward_model",
    "_check_writable_dir",
    "_f",
]
