"""The two sides of ``bench/e2e.py`` and the settings they share: hybridrl's synchronous GRPO
(:func:`run_hybridrl`) and TRL's ``GRPOTrainer`` (:func:`run_trl`), each run in a process of its own
on the step that ``bench/e2e.py`` describes, and the pure helpers that set both sides up (tested
without TRL)."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROMPTS, G, BETA, LR, CLIP, MICRO_TOKENS = 32, 8, 0.04, 1e-5, 0.2, 8192
PROMPT_LEN = 9  # longest W1 prompt: <bos> + "999+999="
# a step row's token positions per pass (bench/e2e.py: step_work)
POSITIONS, PASSES = "positions/", ("generation", "reference", "update")


def w1_prompts(count: int, seed: int = 0) -> list[tuple[str, str]]:
    """(prompt text, answer) of W1's training stream, in the order hybridrl's trainer takes them."""
    from hybridrl.tasks.arithmetic import ArithmeticTask

    task = ArithmeticTask(seed=seed)
    return [(p.text, p.answer) for p in (task.prompt(i) for i in range(count))]


def trl_micro_batch(max_new: int, budget: int = MICRO_TOKENS, batch: int = PROMPTS * G) -> int:
    """Samples per TRL forward: the largest power of two (at most ``batch``) whose padded worst case
    fits ``budget``."""
    n = 1
    while n * 2 <= batch and n * 2 * (PROMPT_LEN + max_new) <= budget:
        n *= 2
    return n


def hybridrl_overrides(
    model_dir: str, max_new: int, steps: int, threads: int, precision: str, runs_dir: str, name: str
) -> list[str]:
    """Dotted overrides on ``examples/arith_grpo.yaml`` for the benchmark's step."""
    return [
        f"model.path={model_dir}",
        "sft.enabled=false",
        f"rollout.max_new_tokens={max_new}",
        "rollout.temperature=1.0",
        "rollout.top_p=1.0",
        "rollout.top_k=0",
        f"actor.lr={LR}",
        f"actor.ppo_minibatch_size={PROMPTS * G}",
        "actor.ppo_epochs=1",
        "actor.weight_decay=0.0",
        "actor.grad_clip=1.0",
        f"actor.micro_batch_tokens={MICRO_TOKENS}",
        "algorithm.advantage=grpo",
        "algorithm.policy_loss=ppo_clip",
        f"algorithm.clip_ratio_low={CLIP}",
        f"algorithm.clip_ratio_high={CLIP}",
        f"algorithm.kl_coef={BETA}",
        "algorithm.kl_estimator=k3",
        "algorithm.loss_agg=token-mean",
        f"trainer.total_steps={steps}",
        f"trainer.prompts_per_step={PROMPTS}",
        f"trainer.samples_per_prompt={G}",
        "trainer.eval_every=0",
        f"trainer.save_every={10 * steps}",
        "trainer.loggers=[jsonl]",
        "trainer.progress=false",
        f"trainer.runs_dir={runs_dir}",
        f"trainer.name={name}",
        "task.eval_size=1",
        "controller.backend=local",
        f"controller.num_threads={threads}",
        f"fsdp.mixed_precision={precision}",
        f"rollout.backend_options.dtype={precision}",
    ]


def known_overrides(overrides: list[str]) -> tuple[list[str], list[str]]:
    """(the overrides whose key this checkout's config schema has, the others): keys added by newer
    code (``rollout.backend_options.dtype``) are dropped, not failed on, so the bench runs on older
    checkouts too."""
    from hybridrl.config import Config

    section = lambda o: getattr(Config(), o.split(".")[0], None)  # noqa: E731
    kept = [
        o
        for o in overrides
        if hasattr(section(o), "__dataclass_fields__")
        and o.split("=", 1)[0].split(".")[1] in section(o).__dataclass_fields__
    ]
    return kept, [o for o in overrides if o not in kept]


def trl_config_kwargs(
    max_new: int, steps: int, precision: str, out_dir: str, micro: int | None = None
) -> dict:
    """Keyword arguments of TRL's ``GRPOConfig`` for the benchmark's step."""
    micro = micro or trl_micro_batch(max_new)
    return dict(
        output_dir=out_dir,
        max_steps=steps,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=PROMPTS * G // micro,
        num_generations=G,
        max_completion_length=max_new,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=BETA,
        epsilon=CLIP,
        loss_type="dapo",
        scale_rewards="group",
        num_iterations=1,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        bf16=precision == "bf16",
        fp16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        shuffle_dataset=False,
        report_to="none",
        save_strategy="no",
        logging_steps=10**6,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
        remove_unused_columns=False,
    )


def trl_positions(rows: int, prompt_width: int, longest: int) -> dict[str, float]:
    """What TRL feeds the model in one step: ``rows`` sequences of the batch's longest prompt
    (left-padded) and longest completion (right-padded), in generation (a finished row keeps
    decoding padding until the last one ends), the reference forward and the update."""
    n = float(rows * (prompt_width + longest))
    return {POSITIONS + p: n for p in PASSES}


# --- the two sides (each in its own process) -----------------------------------------------------
def save_model(size: str, seed: int, path: Path) -> None:
    from transformers.utils import logging as hf_logging

    from hybridrl.models.factory import build_model
    from hybridrl.tasks.tokenizer import build_char_tokenizer

    hf_logging.disable_progress_bar()
    tok = build_char_tokenizer()
    build_model(size, tok, seed).save_pretrained(path)
    tok.save_pretrained(path)


def run_hybridrl(spec: dict) -> dict:
    import torch

    import hybridrl.data.prefetch as prefetch_mod  # where the training prompts are made
    import hybridrl.driver.session as session_mod
    from hybridrl.config import Config, load_config
    from hybridrl.driver import loop

    seen: list[list[int]] = []
    original = prefetch_mod.prompt_sample

    def recording(prompt, tokenizer):  # the ids the rollout is given, step by step
        sample = original(prompt, tokenizer)
        seen.append(list(sample.prompt_ids))
        return sample

    prefetch_mod.prompt_sample = recording

    class CpuTimer(session_mod.PhaseTimer):  # also this process's CPU seconds per step
        def pop(self):
            now, start = time.process_time(), getattr(self, "cpu0", None)
            self.cpu0 = now
            return super().pop() | ({} if start is None else {"timing/cpu": now - start})

    session_mod.PhaseTimer = CpuTimer
    runs = str(
        Path(spec["out"]).parent / "hybridrl_runs"
    )  # inside the parent's temporary directory
    overrides, dropped = known_overrides(
        hybridrl_overrides(
            spec["model_dir"],
            spec["max_new"],
            spec["steps"],
            spec["threads"],
            spec["precision"],
            runs,
            "e2e",
        )
    )
    cfg = load_config(Config, str(ROOT / "examples" / "arith_grpo.yaml"), overrides)
    notes: list[str] = []
    compile_notes: list[str] = []

    class Notes(logging.Handler):  # the roles' one-line precision and compile reports
        def emit(self, record):
            if "precision" in record.getMessage():
                notes.append(record.getMessage())
            elif "decoder layers:" in record.getMessage():  # actor.compile (learner/compile.py)
                compile_notes.append(record.getMessage())

    logging.getLogger("hybridrl").addHandler(Notes(logging.INFO))
    logging.getLogger("hybridrl").setLevel(logging.INFO)
    torch.set_num_threads(spec["threads"])
    summary = loop.train(cfg)
    rows = [
        json.loads(line)
        for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    ]
    steps = []
    for r in (r for r in rows if r["step"] > 0):
        row = {
            k[7:]: v
            for k, v in r.items()
            if k.startswith("timing/") and k not in ("timing/eval", "timing/step")
        }
        row["step"] = r["timing/step"] - r.get("timing/eval", 0.0)
        row["response_length"] = r["response/length_mean"]
        if "perf/tokens_fed" in r:  # what the step fed the model (older checkouts: not logged)
            fed = r["perf/tokens_fed"]  # the reference pass packs the same micro-batches
            gen = r["engine/generated_tokens"] + r["engine/prompt_tokens_computed"]
            row |= dict(zip((POSITIONS + p for p in PASSES), (gen, fed, fed)))
        steps.append(row)
    if spec["precision"] == "bf16" and not any("bf16" in n for n in notes):
        notes.append(
            "fsdp.mixed_precision=bf16 was passed but no role reported bf16: this checkout has no "
            "CPU bf16 for a "
            "single-process actor, so hybridrl trained in fp32"
        )
    return {
        "steps": steps,
        "prompt_ids": seen[: spec["steps"] * PROMPTS],
        "precision_notes": sorted(set(notes)),
        "compile_notes": sorted(set(compile_notes)),
        "dropped_overrides": dropped,
    }


def run_trl(spec: dict) -> dict:
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback

    torch.set_num_threads(spec["threads"])
    tok = AutoTokenizer.from_pretrained(spec["model_dir"], local_files_only=True)
    eos = tok.eos_token_id
    pairs = w1_prompts(spec["steps"] * PROMPTS)
    data = Dataset.from_dict({"prompt": [p for p, _ in pairs], "answer": [a for _, a in pairs]})

    def exact_match(prompts, completions, completion_ids, answer, **_):
        return [
            1.0 if ids and ids[-1] == eos and text == ans else 0.0
            for text, ids, ans in zip(completions, completion_ids, answer)
        ]

    kwargs = trl_config_kwargs(
        spec["max_new"],
        spec["steps"],
        spec["precision"],
        str(Path(spec["out"]).parent / "trl_out"),
        spec.get("trl_micro_batch"),
    )
    args = trl.GRPOConfig(**kwargs, model_init_kwargs={"dtype": "float32"})
    trainer = trl.GRPOTrainer(
        model=spec["model_dir"],
        reward_funcs=exact_match,
        args=args,
        train_dataset=data,
        processing_class=tok,
    )
    phases: dict[str, float] = {}
    seen: list[list[int]] = []
    width = [0]  # the step's padded prompt width

    def timed(name, fn, pick=None):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            key = pick(*a, **kw) if pick else name
            if key:
                phases[key] = phases.get(key, 0.0) + time.perf_counter() - t0
            if name == "tokenize":
                seen.extend(out[0][::G])  # each prompt arrives G times in a row
                width[0] = max(len(ids) for ids in out[0])  # left-padded to the longest
            return out

        return wrapper

    ref = trainer.ref_model
    trainer._tokenize_prompts = timed("tokenize", trainer._tokenize_prompts, lambda *a, **k: None)
    trainer._generate_single_turn = timed("rollout", trainer._generate_single_turn)
    trainer._calculate_rewards = timed("reward", trainer._calculate_rewards)
    trainer._get_per_token_logps_and_entropies = timed(
        "logps",
        trainer._get_per_token_logps_and_entropies,
        lambda model, *a, **k: (
            "reference" if model is ref else (None if torch.is_grad_enabled() else "old_log_prob")
        ),
    )
    trainer._generate_and_score_completions = timed(
        "generate_and_score", trainer._generate_and_score_completions
    )
    steps: list[dict] = []
    lengths = trainer._metrics["train"]["completions/mean_length"]
    longest = trainer._metrics["train"]["completions/max_length"]

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_, **__):
            phases.clear()
            self.t0, self.c0 = time.perf_counter(), time.process_time()

        def on_step_end(self, *_, **__):
            row = {
                "step": time.perf_counter() - self.t0,
                "cpu": time.process_time() - self.c0,
                **phases,
            }
            row["update"] = row["step"] - row.get("generate_and_score", 0.0)
            if lengths:
                row["response_length"] = lengths[-1]
                row |= trl_positions(PROMPTS * G, width[0], int(longest[-1]))
            steps.append(row)

    trainer.add_callback(StepTimer())
    trainer.train()
    autocast = hasattr(
        trainer.model, "_original_forward"
    )  # accelerate wraps forward in bf16 autocast (generate too)
    note = (
        "bf16=True: autocast over fp32 weights "
        f"({'generation included' if autocast else 'forward not wrapped'})"
        if spec["precision"] == "bf16"
        else "fp32"
    )
    return {
        "steps": steps,
        "prompt_ids": seen[: spec["steps"] * PROMPTS],
        "version": trl.__version__,
        "micro_batch": kwargs["per_device_train_batch_size"],
        "precision_note": note,
    }


# side name -> what its process runs
SIDES = {"hybridrl": run_hybridrl, "trl": run_trl}
