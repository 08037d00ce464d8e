"""End to end: hybridrl's synchronous GRPO against TRL's ``GRPOTrainer`` on the same work, in one
run.

    python bench/e2e.py [--quick] [--workloads w1_tiny,...] [--steps N] [--warmup N] [--threads N]
                        [--precision fp32|bf16] [--out FILE]

Prints one JSON object (``w1_tiny.speedup_vs_trl`` is ``out["w1_tiny"]["speedup_vs_trl"]``, TRL
s/step over hybridrl s/step) and a short table. Workloads (docs/workloads.md): ``w1_tiny`` /
``w1_small`` (W1, at most 16 new tokens) and ``w1_long_tiny`` / ``w1_long_small`` (W1-long, at most
128), each from a *random-init* built-in model (no warm start). ``--quick`` runs the two tiny ones
with few steps (about 5 minutes). The two sides' code, and the settings they share, are in
``bench/e2e_sides.py``.

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
  weights for the actor and the reference) and ``rollout.backend_options.dtype=bf16`` (the engine's
  weights and KV cache in bf16). The JSON records each side's precision as reported
  (``hybridrl.precision_notes``, ``trl.precision_note``).

s/step: the median over the timed steps (warm-up steps excluded) of each step's wall time:
hybridrl's ``timing/step`` from ``metrics.jsonl``; TRL's between ``on_step_begin`` and
``on_step_end`` of a ``TrainerCallback``. ``cpu_s_per_step`` / ``speedup_vs_trl_cpu_time``: the same
with the process's CPU seconds, steadier than wall time on a shared machine when each side has one
thread. ``speedup_vs_trl_per_token``: the ratio of seconds per generated token (s/step over the
mean response length), since each side samples its own tokens and one may answer longer.
``work_ratio``: TRL's work per step over hybridrl's (medians), where a step's work is the token
positions it pushed through the model in forward-pass equivalents (:func:`step_work`: generation and
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
sys.path.insert(0, str(ROOT / "bench"))

from e2e_sides import PASSES, POSITIONS, PROMPTS, SIDES, save_model  # noqa: E402

WORKLOADS = {
    "w1_tiny": ("tiny", 16),
    "w1_small": ("small", 16),
    "w1_long_tiny": ("tiny", 128),
    "w1_long_small": ("small", 128),
}
QUICK = ("w1_tiny", "w1_long_tiny")


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
        "work": median([step_work(r) for r in counted]),
        "timed_steps": len(timed),
    }


def step_work(row: dict) -> float:
    """The token positions one step pushed through the model, in forward-pass equivalents: each
    generated or prefilled position and each reference position once, each position of the update
    three times (its forward and backward). The two sides run the same model, so this is their
    matmul work up to a common factor (attention, a few percent at W1's lengths, left out)."""
    p = {k: row[POSITIONS + k] for k in PASSES}
    return p["generation"] + p["reference"] + 3 * p["update"]


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


def child(side: str, spec_path: str) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    spec = json.loads(Path(spec_path).read_text())
    res = SIDES[side](spec)
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
