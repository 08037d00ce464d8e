"""The sections of what is trained on: ``model``, ``task`` and ``data``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from hybridrl.config.sections.common import (
    SEED_MAX,
    _absolute_file_path,
    _check_reward_model,
    _f,
)

# the context length of the built-in models (hybridrl/models/factory.py builds them with it)
BUILTIN_MAX_POSITIONS = 512


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

    def max_positions(self) -> int | None:
        """The model's positions (``max_position_embeddings``): a checkpoint's config.json, or the
        built-in models'; None where unknown."""
        if self.path is None:
            return BUILTIN_MAX_POSITIONS
        try:
            config = json.loads((Path(self.path).expanduser() / "config.json").read_text())
        except (OSError, ValueError):
            return None
        positions = config.get("max_position_embeddings") if isinstance(config, dict) else None
        return positions if isinstance(positions, int) else None

    def validate(self) -> None:
        if self.path is not None:
            p = model_dir(self.path, "model.path")
            if not (p / "config.json").is_file():
                raise ValueError(
                    f"model.path {self.path!r} holds no config.json (not a transformers checkpoint)"
                )
            if (p / "dcp").is_dir() and not any(p.glob("*.safetensors")):
                raise ValueError(
                    f"model.path {self.path!r} is a sharded checkpoint: write a transformers "
                    f"directory from it with `hybridrl export {self.path} OUT_DIR` and use that"
                )
            self.path = str(p) if p != Path(self.path).expanduser() else self.path


def model_dir(path: str, key: str) -> Path:
    """The model directory ``path`` names, in any of the forms ``model.path`` and ``hybridrl
    export`` take: a transformers directory, a run checkpoint (``runs/<name>/checkpoints/step_N``,
    its ``model/``) or a run directory (``runs/<name>``, its newest checkpoint's ``model/``). A
    ValueError (one line, naming ``key``) when it is none of them."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ValueError(f"{key} {path!r} does not exist or is not a directory")
    if (p / "checkpoints").is_dir() and not (p / "config.json").is_file():  # a run directory
        steps = sorted(c for c in (p / "checkpoints").glob("step_*") if (c / "model").is_dir())
        if not steps:
            raise ValueError(f"{key} {path!r} is a run directory with no checkpoint")
        p = steps[-1]
    return p / "model" if (p / "model").is_dir() and not (p / "config.json").is_file() else p


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
    max_failed_reward_steps: int = _f(
        3,
        "the run stops, naming the reward function and its first error, once every sample's "
        "reward failed (raised, timed out, not finite) in this many steps in a row (0: never stop; "
        "failed samples score 0 and are counted in reward/errors either way)",
        ge=0,
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
        "held out, at most a tenth of it, unless holdout is false)",
    )
    holdout: bool = _f(
        True,
        "without val_files: hold out min(task.heldout_size, a tenth) of the training rows for "
        "the evaluations, never trained on (false: train on every row, no held-out evaluation)",
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
