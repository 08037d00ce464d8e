"""End to end: hybridrl's synchronous GRPO against TRL's ``GRPOTrainer`` on the same work, in one
run.

    python bench/e2e.py [--quick] [--workloads w1_tiny,...] [--steps N] [--warmup N] [--threads N]
                        [--precision fp32|bf16] [--out FILE]

Prints one JSON object (``w1_tiny.speedup_vs_trl`` is ``out["w1_tiny"]["speedup_vs_trl"]``, TRL
s/step over hybridrl s/step) and a short table. Workloads (docs/workloads.md): ``w1_tiny`` /
``w1_small`` (W1, at most 16 new tokens) and ``w1_long_tiny`` / ``w1_long_small`` (W1-long, at most
128), each from a *random-init* built-in model (no warm start). ``--quick`` runs the two tiny ones
with few steps (about 5 minutes).

What both sides get:

- the same weights: the built-in Qwen2 of that size from ``model.seed`` 0, saved once with W1's
  character tokenizer to a temporary directory that both load (policy and reference);
- the same prompts: W1's prompt stream (``ArithmeticTask(seed=0).prompt(i)``), step k takes prompts
  32k..32k+31 on both sides (TRL: a ``datasets.Dataset`` with a "prompt" column,
  ``shuffle_dataset=False``). Both tokenizers add ``<bos>``; each side records the prompt ids it fed
  the model and the JSON says whether they are identical;
- the same step: 32 prompts x 8 samples, temperature 1.0, top-p 1.0, top-k off, eos honoured, at
  most 16 / 128 new tokens; GRPO advantages (group mean and std); clip 0.2; KL to the reference, k3
  estimator, coefficient 0.04 in the loss; loss averaged over every response token of the 256
  samples (hybridrl ``token-mean``, TRL ``loss_type="dapo"``); one AdamW step per RL step
  (``torch.optim.AdamW``, lr 1e-5, no weight decay, constant rate, no warm-up, grad-norm clip 1.0);
  reward: exact match of the sum followed by ``<eos>``;
- the same threads: each side runs in its own fresh process with
  ``torch.set_num_threads(--threads)`` (default 2), one after the other, the side that goes first
  alternating per workload;
- no evaluation, checkpoint, logging or progress bar inside the timed steps.

Differences that remain (each framework's own way of doing the same step):

- generation: hybridrl's native engine (paged KV cache, continuous batching, prefix cache shared by
  a group's 8 samples) against TRL's transformers ``generate`` on one padded batch of 256 (TRL's
  default without vLLM);
- old log-probs: with one optimizer step per batch TRL skips the old-policy forward (the ratio is 1
  by construction); hybridrl skips it too where the checkout has ``actor.reuse_old_log_probs``
  (``auto``), and otherwise runs it (then ``old_log_prob`` appears in ``hybridrl.phases``);
- micro-batches: hybridrl packs samples into rows within ``actor.micro_batch_tokens`` (8192), a
  group's samples sharing one copy of their prompt (``learner/prefix_share.py``); TRL
  takes ``--trl-micro-batch`` samples per forward (default: the largest power of two whose padded
  worst case, (prompt + max new tokens) x batch, fits the same 8192 tokens: 256 at 16 tokens, 32 at
  128), with gradient accumulation up to 256;
- sampled tokens differ (each side's own random streams), so response lengths, and with them the
  work, vary from step to step; ``response_length`` records each side's mean;
- hybridrl's PPO loss has a dual clip (3.0) that never binds on-policy; TRL has none;
- compiled layers: hybridrl's ``actor.compile=auto`` compiles the decoder layers of the policy and
  the reference where that measured faster (``small`` in fp32: ``learner/compile.py``), during the
  warm-up step (``--warmup``), whose time ``step_times`` shows; ``hybridrl.compile_notes`` records
  the choice. TRL runs eager (its ``torch_compile`` is off by default); its warm-up step is excluded
  the same way;
- bf16 (``--precision bf16``): TRL ``bf16=True``, bf16 autocast over fp32 weights for every forward,
  generation included; hybridrl ``fsdp.mixed_precision=bf16`` (on a CPU: bf16 autocast over fp32
  weights for the actor and the reference) and ``rollout.dtype=bf16`` (the engine's weights and KV
  cache in bf16). The JSON records each side's precision as reported (``hybridrl.precision_notes``,
  ``trl.precision_note``).

s/step: the median over the timed steps (warm-up steps excluded) of each step's wall time:
hybridrl's ``timing/step`` from ``metrics.jsonl``; TRL's between ``on_step_begin`` and
``on_step_end`` of a ``TrainerCallback``. ``cpu_s_per_step`` / ``speedup_vs_trl_cpu_time``: the same
with the process's CPU seconds, steadier than wall time on a shared machine when each side has one
thread. ``speedup_vs_trl_per_token``: the ratio of seconds per generated token (s/step over the
mean response length), since each side samples its own tokens and one may answer longer.
``work_ratio``: TRL's work per step over hybridrl's (medians), where a step's work is the token
positions it pushed through the model in forward-pass equivalents (:func:`work`: generation and
the reference once, the update three times; TRL's from its padded widths, hybridrl's from the
engine's token counts and the update's ``perf/tokens_fed``). Both sides run the same model, so at
equal speed per position the speed-up would equal the work ratio; ``speedup_per_work`` (speed-up
over work ratio) says how much faster hybridrl runs each position. Phases:
hybridrl's ``timing/*``; TRL's generation, reward and reference forward are timed by
wrapping the trainer's own methods, ``update`` is the rest of the step.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORKLOADS = {
    "w1_tiny": ("tiny", 16),
    "w1_small": ("small", 16),
    "w1_long_tiny": ("tiny", 128),
    "w1_long_small": ("small", 128),
}
QUICK = ("w1_tiny", "w1_long_tiny")
PROMPTS, G, BETA, LR, CLIP, MICRO_TOKENS = 32, 8, 0.04, 1e-5, 0.2, 8192
PROMPT_LEN = 8  # longest W1 prompt: <bos> + "999+999="
POSITIONS, PASSES = "positions/", ("generation", "reference", "update")  # a step's rows: work


# --- pure helpers (tested without TRL) ------------------------------------------------------------
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
        f"rollout.dtype={precision}",
    ]


def known_overrides(overrides: list[str]) -> tuple[list[str], list[str]]:
    """(the overrides whose key this checkout's config schema has, the others): keys added by newer
    code (``rollout.dtype``) are dropped, not failed on, so the bench runs on older checkouts
    too."""
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


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarise(steps: list[dict], warmup: int) -> dict:
    """s/step (median of the timed steps) and each phase's median, from per-step rows {"step": s,
    phase: s, ...}."""
    timed = steps[warmup:]
    keys = {k for r in timed for k in r} - {"step", "cpu", "response_length"}
    phases = sorted(k for k in keys if not k.startswith(POSITIONS))
    counted = [r for r in timed if all(POSITIONS + p in r for p in PASSES)]
    return {
        "s_per_step": median([r["step"] for r in timed]),
        "step_times": [r["step"] for r in steps],
        "cpu_s_per_step": median([r["cpu"] for r in timed if "cpu" in r]),
        "phases": {k: median([r.get(k, 0.0) for r in timed]) for k in phases},
        "response_length": median([r["response_length"] for r in timed if "response_length" in r]),
        "positions": {p: median([r[POSITIONS + p] for r in counted]) for p in PASSES},
        "work": median([work(r) for r in counted]),
        "timed_steps": len(timed),
    }


def work(row: dict) -> float:
    """The token positions one step pushed through the model, in forward-pass equivalents: each
    generated or prefilled position and each reference position once, each position of the update
    three times (its forward and backward). The two sides run the same model, so this is their
    matmul work up to a common factor (attention, a few percent at W1's lengths, left out)."""
    p = {k: row[POSITIONS + k] for k in PASSES}
    return p["generation"] + p["reference"] + 3 * p["update"]


def trl_positions(rows: int, prompt_width: int, longest: int) -> dict[str, float]:
    """What TRL feeds the model in one step: ``rows`` sequences of the batch's longest prompt
    (left-padded) and longest completion (right-padded), in generation (a finished row keeps
    decoding padding until the last one ends), the reference forward and the update."""
    n = float(rows * (prompt_width + longest))
    return {POSITIONS + p: n for p in PASSES}


def machine() -> dict:
    flags, model = "", platform.processor()
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in text.splitlines():
            key, _, val = line.partition(":")
            model = val.strip() if key.strip() == "Model name" else model
            flags = val if key.strip() == "Flags" else flags
    except (OSError, subprocess.SubprocessError):
        pass
    return {"cpu": model, "cores": os.cpu_count(), "amx": "amx_bf16" in flags.split()}


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10
    ).stdout


def commit() -> tuple[str, list[str]]:
    """(HEAD, with "+dirty" when the code measured differs from it; the uncommitted paths under
    hybridrl/ and bench/)."""
    git = _git
    try:
        dirty = [
            line[3:]
            for line in git("status", "--porcelain", "--", "hybridrl", "bench/e2e.py").splitlines()
        ]
        return git("rev-parse", "--short", "HEAD").strip() + ("+dirty" if dirty else ""), dirty
    except (OSError, subprocess.SubprocessError):
        return "unknown", []


# --- the two sides (each in its own process) ------------------------------------------------------
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
    from hybridrl.driver import sync

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
    summary = sync.train(cfg)
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


def child(side: str, spec_path: str) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    spec = json.loads(Path(spec_path).read_text())
    res = {"hybridrl": run_hybridrl, "trl": run_trl}[side](spec)
    Path(spec["out"]).write_text(json.dumps(res))


def run_side(side: str, spec: dict, work: Path) -> dict:
    spec = dict(spec, out=str(work / f"{side}.json"))
    (work / f"{side}_spec.json").write_text(json.dumps(spec))
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]), TOKENIZERS_PARALLELISM="false")
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, __file__, "--child", side, str(work / f"{side}_spec.json")],
        check=True,
        env=env,
        stdout=sys.stderr,
    )  # the JSON on stdout is the parent's alone
    res = json.loads(Path(spec["out"]).read_text())
    res["process_seconds"] = time.perf_counter() - t0
    return res


def workload(name: str, index: int, args, work: Path) -> dict:
    size, max_new = WORKLOADS[name]
    model_dir = work / name / "model"
    save_model(size, 0, model_dir)
    steps = args.warmup + (
        args.steps or (args.long_small_steps if name == "w1_long_small" else 3 if args.quick else 5)
    )
    spec = dict(
        model_dir=str(model_dir),
        max_new=max_new,
        steps=steps,
        threads=args.threads,
        precision=args.precision,
        trl_micro_batch=args.trl_micro_batch,
    )
    order = ["hybridrl", "trl"] if index % 2 == 0 else ["trl", "hybridrl"]
    raw = {side: run_side(side, spec, work / name) for side in order}
    h, t = (
        summarise(raw["hybridrl"]["steps"], args.warmup),
        summarise(raw["trl"]["steps"], args.warmup),
    )
    same = (
        raw["hybridrl"]["prompt_ids"] == raw["trl"]["prompt_ids"]
        and len(raw["trl"]["prompt_ids"]) == steps * PROMPTS
    )
    h |= {
        k: raw["hybridrl"].get(k)
        for k in ("precision_notes", "compile_notes", "dropped_overrides", "process_seconds")
    }
    t |= {k: raw["trl"][k] for k in ("micro_batch", "precision_note", "process_seconds")}
    return {
        "model": size,
        "max_new_tokens": max_new,
        "speedup_vs_trl": t["s_per_step"] / h["s_per_step"],
        "speedup_vs_trl_cpu_time": t["cpu_s_per_step"] / h["cpu_s_per_step"],
        # each side samples its own tokens: the ratio of seconds per generated token (median
        # s/step over median mean response length) corrects for one side's longer responses
        "speedup_vs_trl_per_token": (t["s_per_step"] / t["response_length"])
        / (h["s_per_step"] / h["response_length"]),
        # how much less TRL's step would take if each side's work ran at the same rate, and how
        # much faster than TRL's hybridrl runs the same work (speed-up over work ratio)
        "work_ratio": t["work"] / h["work"],
        "speedup_per_work": t["s_per_step"] / h["s_per_step"] / (t["work"] / h["work"]),
        "hybridrl_s_per_step": h["s_per_step"],
        "trl_s_per_step": t["s_per_step"],
        "order": order,
        "identical_prompt_ids": same,
        "prompt_ids_checked": len(raw["trl"]["prompt_ids"]),
        "first_prompt_ids": raw["trl"]["prompt_ids"][0],
        "hybridrl": h,
        "trl": t,
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help=f"{' and '.join(QUICK)}, 1 warm-up + 3 timed steps (about 5 min)",
    )
    ap.add_argument(
        "--workloads",
        default=None,
        help=f"comma-separated, of {', '.join(WORKLOADS)} (default: all; --quick: "
        f"{','.join(QUICK)})",
    )
    ap.add_argument(
        "--steps", type=int, default=None, help="timed steps per side (default 5, --quick 3)"
    )
    ap.add_argument(
        "--long-small-steps",
        type=int,
        default=3,
        help="timed steps of w1_long_small when --steps is not given",
    )
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first, per side")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of each side's process")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument(
        "--trl-micro-batch",
        type=int,
        default=None,
        help="samples per TRL forward (default: the token budget rule)",
    )
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--child", nargs=2, metavar=("SIDE", "SPEC"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(*args.child)
    try:
        import trl
    except ImportError:
        ap.error("TRL is not installed: pip install -e '.[bench]'")
    names = [
        n for n in (args.workloads or ",".join(QUICK if args.quick else WORKLOADS)).split(",") if n
    ]
    bad = [n for n in names if n not in WORKLOADS]
    if bad:
        ap.error(f"unknown workloads {bad}; choose from {list(WORKLOADS)}")
    import torch

    out: dict = {
        "quick": args.quick,
        "precision": args.precision,
        "threads": args.threads,
        "warmup_steps": args.warmup,
        "commit": commit()[0],
        "uncommitted": commit()[1],
        "machine": machine(),
        "torch": torch.__version__,
        "trl": trl.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="e2e_") as tmp:
        for i, name in enumerate(names):
            out[name] = workload(name, i, args, Path(tmp))
            print(
                f"# {name}: done at {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True
            )
            if args.out:
                Path(args.out).write_text(json.dumps(out, indent=1))
    out["seconds"] = time.perf_counter() - t0
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    print(
        f"\n{'workload':15} {'TRL s/step':>10} {'hybridrl s/step':>15} {'speed-up':>8} "
        f"{'(CPU time)':>10} {'work ratio':>10} {'per work':>8}  same prompt ids",
        file=sys.stderr,
    )
    for name in names:
        r = out[name]
        print(
            f"{name:15} {r['trl_s_per_step']:10.2f} {r['hybridrl_s_per_step']:15.2f} "
            f"{r['speedup_vs_trl']:7.2f}x "
            f"{r['speedup_vs_trl_cpu_time']:9.2f}x {r['work_ratio']:9.2f}x "
            f"{r['speedup_per_work']:7.2f}x  {r['identical_prompt_ids']}",
            file=sys.stderr,
        )
    return out


if __name__ == "__main__":
    main()
