"""Precision benchmark: fp32 against bf16 on this CPU, every ratio measured in the same run.

Prints one JSON object and a small table. Parts (``--only``):

- ``probe``: the CPU's bf16 flag, an n x n matmul in bf16 against fp32, and what ``auto`` picks for
  the built-in sizes (``parallel/precision.py``: one measured decoder layer, forward + backward for
  training, forward only for the rollout), with the measured gains.
- ``step``: W1 tiny and small, one actor ``update_actor`` (forward + backward + AdamW; 32 prompts x
  8 samples, 10 prompt + 16 response tokens, 4 mini-batches of 64) and one ``compute_log_prob``
  pass, fp32 against bf16 autocast. Variants alternate, ``--reps`` rounds, medians.
- ``engine``: the native engine's throughput, fp32 against bf16 weights and KV
  (``rollout.backend_options.dtype``): 32 prompts x 8 samples, 16 new tokens (W1) and 128 new tokens
  (decode-heavy), eos ignored; decode tokens/s (decode-only steps) and tokens/s of the whole
  generation. Alternating, medians.
- ``runs``: the default job (``examples/arith_grpo.yaml``) for ``--steps`` RL steps from the same
  cached warm start, with training / rollout precision fp32/fp32, bf16/bf16, bf16/fp32 and
  fp32/bf16: held-out accuracy after (sampled and greedy), wall time, and the train-rollout log-prob
  gap (``rollout_corr/logp_gap_mean``, ``rollout_corr/kl_k3``, mean over steps). Subprocesses
  (``--run-threads`` torch threads each), one after another or, with ``--parallel``, at once;
  evaluation before and after only; logs under ``--workdir``.

The machine may be shared: every timing alternates its variants so that a change in load hits both
alike.

Usage: ``python bench/precision.py [--only probe,step,engine,runs] [--threads 1] [--reps 3] [--steps
60] [--parallel] [--out FILE] [key=value ...]`` (the overrides go to the default-job runs).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybridrl.config import Config, RolloutConfig  # noqa: E402
from hybridrl.controller import WorkerContext  # noqa: E402
from hybridrl.models.factory import build_model  # noqa: E402
from hybridrl.parallel import precision as training_precision  # noqa: E402
from hybridrl.protocol import Batch, Sample  # noqa: E402
from hybridrl.rollout import SamplingParams  # noqa: E402
from hybridrl.rollout.backends.native import NativeRollout  # noqa: E402
from hybridrl.tasks.tokenizer import build_char_tokenizer  # noqa: E402

TOK = build_char_tokenizer()
SIZES = ("tiny", "small")
VARIANTS = {
    "fp32": ("fp32", "fp32"),
    "bf16": ("bf16", "bf16"),
    "train_bf16_rollout_fp32": ("bf16", "fp32"),
    "train_fp32_rollout_bf16": ("fp32", "bf16"),
}


def alternate(fns: dict, reps: int) -> dict[str, float]:
    """Median seconds of each function over ``reps`` alternating rounds (after one warm-up each)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


# --- probe ----------------------------------------------------------------------------------------
def probe() -> dict:
    out = {
        "cpu_bf16": training_precision.cpu_bf16_support(),
        "matmul_512_speedup": training_precision.matmul_speedup(),
    }
    for size in SIZES:
        m = build_model(size, TOK, 0)
        for train in (True, False):
            gain = training_precision.model_speedup(m, train)
            picked = training_precision.decide(
                "auto", support=training_precision.cpu_bf16_support, speedup=lambda g=gain: g
            )
            role = "train" if train else "rollout"
            out[f"{size}_{role}_layer_speedup"] = gain
            out[f"{size}_{role}_auto"] = "bf16" if picked.bf16 else "fp32"
    return out


# --- training step --------------------------------------------------------------------------------
def w1_batch(vocab: int, rows: int = 256, p_len: int = 10, r_len: int = 16, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, vocab, (rows, p_len), generator=g)
    responses = torch.randint(3, vocab, (rows, r_len), generator=g)
    lengths = torch.randint(4, r_len + 1, (rows,), generator=g)
    rmask = (torch.arange(r_len) < lengths[:, None]).long()
    responses = responses * rmask
    logp = -torch.rand(rows, r_len, generator=g) * rmask
    return Batch(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": torch.cat([torch.ones_like(prompts), rmask], 1),
            "response_mask": rmask.float(),
            "old_log_probs": logp,
            "ref_log_probs": logp,
            "rollout_log_probs": logp,
            "advantages": torch.randn(rows, 1, generator=g).expand(rows, r_len) * rmask,
        }
    )


def step(reps: int) -> dict:
    from hybridrl.learner import Learner

    out = {}
    ctx = WorkerContext(
        rank=0, world_size=1, role="learner", pool="p", num_threads=torch.get_num_threads()
    )
    for size in SIZES:
        actors = {}
        for prec in ("fp32", "bf16"):
            cfg = Config()
            cfg.model.name, cfg.fsdp.mixed_precision = size, prec
            actors[prec] = Learner(ctx, cfg, None)
        batch = w1_batch(actors["fp32"].model.config.vocab_size)
        upd = alternate(
            {p: functools.partial(a.update_actor, batch) for p, a in actors.items()}, reps
        )
        lp = alternate(
            {p: functools.partial(a.compute_log_prob, batch) for p, a in actors.items()}, reps
        )
        out[size] = {
            "update_s_fp32": upd["fp32"],
            "update_s_bf16": upd["bf16"],
            "update_speedup": upd["fp32"] / upd["bf16"],
            "log_prob_s_fp32": lp["fp32"],
            "log_prob_s_bf16": lp["bf16"],
            "log_prob_speedup": lp["fp32"] / lp["bf16"],
        }
    return out


def _generate_and_record(engine, reqs: list, params: SamplingParams, stats: list[dict]) -> None:
    engine.generate(reqs, params)
    stats.append(engine.stats())


# --- engine ---------------------------------------------------------------------------------------
def engine(reps: int) -> dict:
    rng = random.Random(0)
    prompts = [TOK(f"{rng.randint(0, 999)}+{rng.randint(0, 999)}=")["input_ids"] for _ in range(32)]
    reqs = [Sample(prompt_ids=p, uid=f"r{i}") for i, p in enumerate(prompts)]
    out = {}
    for size in SIZES:
        model = build_model(size, TOK, 0)
        engines = {
            d: NativeRollout(
                model, TOK, RolloutConfig(backend_options={"dtype": d, "kv_cache_bytes": 1 << 30})
            )
            for d in ("fp32", "bf16")
        }
        for new in (16, 128):
            params = SamplingParams(temperature=1.0, max_new_tokens=new, n=8, seed=0)
            params.ignore_eos = True
            stats: dict[str, list[dict]] = {d: [] for d in engines}
            alternate(
                {
                    d: functools.partial(_generate_and_record, e, reqs, params, stats[d])
                    for d, e in engines.items()
                },
                reps,
            )
            med = {
                d: {
                    k: statistics.median(s[k] for s in stats[d][1:])
                    for k in ("engine/decode_tokens_per_s", "engine/tokens_per_s")
                }
                for d in engines
            }
            out[f"{size}_{new}"] = {
                "decode_tok_s_fp32": med["fp32"]["engine/decode_tokens_per_s"],
                "decode_tok_s_bf16": med["bf16"]["engine/decode_tokens_per_s"],
                "decode_speedup": med["bf16"]["engine/decode_tokens_per_s"]
                / med["fp32"]["engine/decode_tokens_per_s"],
                "tok_s_fp32": med["fp32"]["engine/tokens_per_s"],
                "tok_s_bf16": med["bf16"]["engine/tokens_per_s"],
                "speedup": med["bf16"]["engine/tokens_per_s"] / med["fp32"]["engine/tokens_per_s"],
            }
    return out


def _mean_of(records: list[dict], key: str) -> float | None:
    """Mean of ``key`` over the records holding it (None when none does)."""
    vals = [x[key] for x in records if key in x]
    return statistics.fmean(vals) if vals else None


def _train_command(
    name: str, steps: int, threads: int, workdir: Path, extra: list[str]
) -> list[str]:
    """The ``hybridrl train`` command line of one variant's W1 run."""
    train, roll = VARIANTS[name]
    return [
        sys.executable,
        "-m",
        "hybridrl.cli",
        "train",
        "examples/arith_grpo.yaml",
        f"trainer.total_steps={steps}",
        f"fsdp.mixed_precision={train}",
        f"rollout.backend_options.dtype={roll}",
        f"controller.num_threads={threads}",
        f"trainer.name=prec_{name}",
        f"trainer.runs_dir={workdir}",
        "trainer.progress=false",
        "trainer.loggers=[jsonl]",
        "trainer.save_every=0",
        "trainer.eval_every=0",
        *extra,
    ]


# --- the default job ------------------------------------------------------------------------------
def runs(
    steps: int, threads: int, workdir: Path, variants: list[str], extra: list[str], parallel: bool
) -> dict:
    """One short W1 run per variant from the same warm start (cached, or ``sft.checkpoint=`` in
    ``extra``; a run trains it first when it is missing, so start with it cached). ``parallel``: all
    variants at once, so that a shared machine's load hits them alike."""
    out = {}
    workdir.mkdir(parents=True, exist_ok=True)
    env = os.environ | {"OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    env.pop(training_precision.ENV_OVERRIDE, None)
    procs = {}
    with contextlib.ExitStack() as logs:  # each run's log file, open while it runs
        for name in variants:
            log = logs.enter_context(open(workdir / f"{name}.log", "w"))
            procs[name] = subprocess.Popen(
                _train_command(name, steps, threads, workdir, extra),
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            if not parallel:
                procs[name].wait()
        codes = {name: proc.wait() for name, proc in procs.items()}
    for name, rc in codes.items():
        train, roll = VARIANTS[name]
        run_dir = workdir / f"prec_{name}"
        if rc != 0 or not (run_dir / "summary.json").is_file():
            out[name] = {"error": f"exit code {rc}, see {workdir / f'{name}.log'}"}
            continue
        summary = json.loads((run_dir / "summary.json").read_text())
        lines = [
            json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()
        ]
        mean = functools.partial(_mean_of, lines)

        out[name] = {
            "train": train,
            "rollout": roll,
            "accuracy_before": summary.get("accuracy_before"),
            "accuracy_after": summary.get("accuracy_after"),
            "greedy_accuracy_after": summary.get("greedy_accuracy_after"),
            "wall_s": summary.get("wall_seconds"),
            "logp_gap_mean": mean("rollout_corr/logp_gap_mean"),
            "kl_k3": mean("rollout_corr/kl_k3"),
            "update_s": mean("timing/update"),
            "rollout_s": mean("timing/rollout"),
            "log_prob_s": mean("timing/old_log_prob"),
        }
    return out


def table(out: dict) -> str:
    rows = []
    for size, r in out.get("step", {}).items():
        rows.append(
            f"step {size:5s}  update fp32 {r['update_s_fp32']:.3f}s bf16 {r['update_s_bf16']:.3f}s "
            f" x{r['update_speedup']:.2f}   "
            f"log-prob x{r['log_prob_speedup']:.2f}"
        )
    for k, r in out.get("engine", {}).items():
        rows.append(
            f"engine {k:10s} decode tok/s fp32 {r['decode_tok_s_fp32']:.0f} bf16 "
            f"{r['decode_tok_s_bf16']:.0f}  "
            f"x{r['decode_speedup']:.2f}   whole x{r['speedup']:.2f}"
        )
    for k, r in out.get("runs", {}).items():
        if "error" in r:
            rows.append(f"run {k}: {r['error']}")
            continue
        rows.append(
            f"run {k:24s} acc {r['accuracy_before']:.3f} -> {r['accuracy_after']:.3f} (greedy "
            f"{r['greedy_accuracy_after']:.3f})  "
            f"gap {r['logp_gap_mean']:.4f} kl_k3 {r['kl_k3']:.2e}  update {r['update_s']:.2f}s  "
            f"{r['wall_s']:.0f}s"
        )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="probe,step,engine,runs")
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads of the in-process timings"
    )
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60, help="RL steps of each default-job run")
    ap.add_argument(
        "--run-threads", type=int, default=1, help="torch threads of each default-job run"
    )
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--workdir", default="runs/bench_precision")
    ap.add_argument(
        "--parallel", action="store_true", help="run the default-job variants at the same time"
    )
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "overrides",
        nargs="*",
        help="extra key=value overrides of the default-job runs, e.g. sft.checkpoint=DIR",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.pop(training_precision.ENV_OVERRIDE, None)
    parts = args.only.split(",")
    out = {
        "threads": args.threads,
        "torch": torch.__version__,
        "cpu_bf16": training_precision.cpu_bf16_support(),
    }
    t0 = time.perf_counter()
    if "probe" in parts:
        out["probe"] = probe()
    if "step" in parts:
        out["step"] = step(args.reps)
    if "engine" in parts:
        out["engine"] = engine(args.reps)
    if "runs" in parts:
        out["runs"] = runs(
            args.steps,
            args.run_threads,
            ROOT / args.workdir,
            args.variants.split(","),
            args.overrides,
            args.parallel,
        )
    out["seconds"] = time.perf_counter() - t0
    text = json.dumps(out, indent=1, default=float)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    print(table(out), file=sys.stderr)


if __name__ == "__main__":
    main()
