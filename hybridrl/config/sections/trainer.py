"""The run around the steps: ``trainer``, ``sft``, ``asynchronous`` and ``alerts``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from hybridrl.config.sections.common import (
    SEED_MAX,
    _check_writable_dir,
    _f,
)

# a run name is one directory name (at most 255 bytes on common filesystems), with room for the
# ".<timestamp>" an earlier run is moved aside to
RUN_NAME_MAX = 200


@dataclass
class SFTConfig:
    """The supervised warm start (``hybridrl sft``, and before RL when enabled): on the built-in
    task's correct examples, or on the user's own data (``train_files``)."""

    train_files: str | list[str] | None = _f(
        None,
        "the user's SFT data (.jsonl, .json, .parquet, .csv or a save_to_disk directory): a "
        "'messages' column (chat, loss on the assistant turns) or 'prompt' and 'completion' "
        "columns (loss on the completion) (null: the built-in task's examples)",
    )
    val_files: str | list[str] | None = _f(
        None,
        "held-out SFT data in the same format; its loss is measured every eval_every steps and "
        "at the end (with train_files; null: none)",
    )
    epochs: float = _f(
        1.0, "passes over train_files when steps is null (the last step may be partial)", gt=0
    )
    max_length: int | None = _f(
        None,
        "rows of train_files longer than this many tokens are dropped and counted (null: the "
        "model's context)",
        ge=1,
    )
    lora_rank: int = _f(
        0,
        "train LoRA adapters of this rank on every linear layer (PEFT's all-linear) instead of "
        "the whole model; the checkpoint is the merged model, the adapter beside it in adapter/ "
        "(0: full fine-tuning)",
        ge=0,
    )
    lora_alpha: float = _f(32.0, "LoRA scale numerator (scale = lora_alpha / lora_rank)", gt=0)
    steps: int | None = _f(
        None,
        "fixed number of warm-start optimizer steps, no accuracy check (null: with train_files, "
        "epochs passes over it; else train until target_accuracy is reached, at most max_steps)",
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
    eval_every: int = _f(
        10,
        "accuracy check every N warm-start steps (when steps is null); with train_files, the "
        "val_files loss every N steps",
        ge=1,
    )
    eval_size: int = _f(
        256, "held-out prompts per accuracy check (those that no SFT batch so far contained)", ge=1
    )
    batch_size: int = _f(256, "examples per SFT step", ge=1)
    lr: float | None = _f(
        None,
        "SFT AdamW learning rate (null: 2e-5 for a model.path checkpoint, TRL's SFT rate; 3e-3 "
        "for the built-in toy models)",
        gt=0,
    )
    grad_clip: float = _f(
        0.0,
        "clip each SFT step's global gradient norm to this (0: off); a spike in the loss at a "
        "high learning rate then moves the weights by a bounded step",
        ge=0,
    )
    checkpoint: str | None = _f(
        None,
        "warm-start checkpoint directory "
        "(null: a cache path derived from the model/task/sft config)",
    )
    enabled: bool | None = _f(
        None,
        "run (or reuse) the warm start before RL (null: on with train_files, or for a built-in "
        "model and task; off with model.path or data.train_files)",
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
    """Fully asynchronous training (``trainer.mode: async``, the stream feed of driver/loop.py)."""

    max_staleness: int = _f(
        1, "a trained sample is at most this many weight versions old (0: on-policy)", ge=0
    )
    max_concurrent_prompts: int = _f(64, "prompt groups generating at once on a rollout rank", ge=1)
    batch_timeout_s: float = _f(
        600.0, "the learner fails when no batch is ready for this long (a dead rollout)", gt=0
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
    log_every: int = _f(
        10,
        "when standard error is not a terminal (a batch job's log) or progress is off: one line "
        "of headline metrics (reward, eval accuracy, losses, lr, step time) every N steps (0: "
        "never)",
        ge=0,
    )
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
        if self.name is not None and (
            self.name in (".", "..")
            or any(c in self.name for c in "/\\\0")
            or len(self.name.encode()) > RUN_NAME_MAX
        ):
            # the run directory is <runs_dir>/<name>, and a fresh run moves an earlier one aside:
            # a name that is a path could move or write any directory
            raise ValueError(
                f"name {self.name!r} is not a run name: one path component (no '/', '\\' or NUL, "
                f"not '.' or '..', at most {RUN_NAME_MAX} bytes); the runs go under runs_dir"
            )
        bad = [s for s in self.profile_steps if s < 1]
        if bad:
            raise ValueError(f"profile_steps holds {bad[0]}: steps count from 1")


@dataclass
class EvalConfig:
    """The held-out evaluation (``driver/evaluate.py``): before training, every
    ``trainer.eval_every`` steps, after training, and ``hybridrl eval``. Each one generates
    ``eval.n`` samples per held-out prompt with its own sampling settings and a greedy one."""

    n: int = _f(
        1,
        "samples per held-out prompt: eval/accuracy is their mean reward (mean@n); with rewards "
        "of 0 and 1 and n > 1, eval/pass@k for k = 1, 2, 4, ... and n (the unbiased estimator) "
        "and eval/maj@k for k > 1 (majority vote on the final answer)",
        ge=1,
        le=1024,
    )
    temperature: float | None = _f(
        None, "sampling temperature of the evaluation (null: rollout.temperature)", ge=0
    )
    top_p: float | None = _f(None, "top-p of the evaluation (null: rollout.top_p)", gt=0, le=1)
    max_new_tokens: int | None = _f(
        None, "new tokens per held-out response (null: rollout.max_new_tokens)", ge=1
    )
    before: bool = _f(True, "evaluate before training (its figures are null when off)")
    save_generations: bool = _f(
        True,
        "write each evaluation's samples to <run>/eval/step_<N>.jsonl: prompt, response, reward, "
        "per line",
    )
