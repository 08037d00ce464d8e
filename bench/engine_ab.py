"""The native engine of this checkout against the one of a git revision, same run.

A refactor of the engine should not change its speed, and on a shared machine two separate runs of
``bench/rollout.py`` can differ by a factor of two from the load alone. This script checks the
revision out into a temporary git worktree and alternates child processes of the two trees (each
importing its own ``hybridrl``), each generating the same fixed workload (W1 prompts, eos ignored,
temperature 1) on ``--model`` with ``--threads`` torch threads, ``--repeats`` times after a warm-up.
A run counts by its process CPU time, which the load disturbs much less than the wall time; each
tree's best run per round gives tokens per CPU second, and ``cpu_ratio`` is the median over rounds
of new / baseline (1.0: the same speed; above: this checkout is faster).

Usage: ``python bench/engine_ab.py [--baseline REV] [--model tiny|tiny_moe] [--rounds N]
[--shape PxGxN]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(model_name: str, shape: str, repeats: int, threads: int) -> dict:
    """Run in a child process whose ``hybridrl`` is the tree under test (PYTHONPATH)."""
    import torch

    import hybridrl
    from hybridrl.config import RolloutConfig
    from hybridrl.models.factory import build_model
    from hybridrl.protocol import Sample
    from hybridrl.rollout import SamplingParams
    from hybridrl.rollout.backends.native import NativeRollout
    from hybridrl.tasks.tokenizer import build_char_tokenizer

    torch.set_num_threads(threads)
    tok = build_char_tokenizer()
    P, G, N = (int(v) for v in shape.split("x"))
    model = build_model(model_name, tok, 0).eval()
    rc = RolloutConfig(
        backend="native",
        backend_options={
            "kv_cache_bytes": 1 << 30,
            "max_batch_size": 512,
            "max_num_batched_tokens": 4096,
            "dtype": "fp32",
        },
    )
    eng = NativeRollout(model, tok, rc)
    p = SamplingParams(temperature=1.0, max_new_tokens=N, n=G, seed=0)
    p.ignore_eos = True
    prompts = [[tok.bos_token_id] + [3 + (i * 7 + j) % 13 for j in range(24)] for i in range(P)]
    reqs = [Sample(prompt_ids=pr, uid=f"u{i}") for i, pr in enumerate(prompts)]
    eng.generate(reqs[:2], p)  # warm-up: first-call costs
    runs = []
    for _ in range(repeats):
        eng.engine.bm.invalidate()  # every run computes its prompts
        t0, c0 = time.perf_counter(), time.process_time()
        out = eng.generate(reqs, p)
        runs.append((time.process_time() - c0, time.perf_counter() - t0))
        assert sum(len(s.response_ids) for s in out) == P * G * N
    cpu, wall = min(runs)
    return {
        "tree": str(Path(hybridrl.__file__).parents[1]),
        "cpu_s": cpu,
        "wall_s": wall,
        "tokens": P * G * N,
    }


def run_tree(tree: Path, args) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS=str(args.threads))
    cmd = [
        sys.executable,
        __file__,
        "--child",
        "--model",
        args.model,
        "--shape",
        args.shape,
        "--repeats",
        str(args.repeats),
        "--threads",
        str(args.threads),
    ]
    res = json.loads(
        subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
        .stdout.strip()
        .splitlines()[-1]
    )
    assert Path(res["tree"]).resolve() == tree.resolve(), (res["tree"], tree)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default="HEAD~1", help="git revision to compare against")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--shape", default="16x8x64", help="prompts x samples x new tokens")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3, help="runs per child (the best counts)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.model, args.shape, args.repeats, args.threads)))
        return
    rev = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", args.baseline],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], check=True, capture_output=True, text=True
    ).stdout.strip()
    out = {
        "baseline": rev,
        "head": head,
        "model": args.model,
        "shape": args.shape,
        "threads": args.threads,
        "load_avg_start": os.getloadavg()[0],
        "rounds": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "baseline"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), rev],
            check=True,
            capture_output=True,
        )
        try:
            for _ in range(args.rounds):
                old, new = run_tree(base, args), run_tree(ROOT, args)
                out["rounds"].append(
                    {
                        "baseline_cpu_s": old["cpu_s"],
                        "new_cpu_s": new["cpu_s"],
                        "baseline_wall_s": old["wall_s"],
                        "new_wall_s": new["wall_s"],
                    }
                )
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)],
                check=False,
                capture_output=True,
            )
    tokens = new["tokens"]
    r = out["rounds"]
    out["baseline_tokens_per_cpu_s"] = tokens / min(x["baseline_cpu_s"] for x in r)
    out["new_tokens_per_cpu_s"] = tokens / min(x["new_cpu_s"] for x in r)
    out["cpu_ratio"] = statistics.median(x["baseline_cpu_s"] / x["new_cpu_s"] for x in r)
    out["wall_ratio"] = statistics.median(x["baseline_wall_s"] / x["new_wall_s"] for x in r)
    out["load_avg_end"] = os.getloadavg()[0]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
