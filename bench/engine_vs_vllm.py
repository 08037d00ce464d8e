"""The native engine against vLLM's CPU build on the same CPU, side by side in one run.

    .venv-vllm/bin/python bench/engine_vs_vllm.py [--threads 2] [--prompts 256] [--dtype fp32]
                                                  [--repeats 2] [--quick] [--out FILE]

The same model weights (a built-in size, random initialisation from seed 0), the same W1 prompts
(3-digit additions, the character tokenizer), the same sampling (temperature 1, end of sequence
ignored, so every request generates exactly its new tokens) and the same torch thread count for
both engines, through hybridrl's own backends (``native`` and ``vllm``; vLLM eager, or with its
default compiled graphs with ``--vllm-compiled``), as RL uses them:
every sample's tokens and their log-probs. Shapes: the ``tiny`` and ``small`` models × 16 and 128
new tokens. The sides alternate (native, vLLM, native, vLLM, ...) and the faster of ``--repeats``
runs counts for each, after one warm-up call each (vLLM's first call compiles and allocates).

Reported per shape: generated tokens per second of wall time for each side and their ratio
(``speedup`` = native / vLLM), and the ratio of CPU time (``cpu_speedup``: vLLM's CPU time over
native's, for the same tokens; vLLM's engine core is a process of its own, so its time counts the
whole process tree). ``--dtype bf16`` runs both sides in bfloat16 (where the CPU has native bf16).
Prints one JSON object; a table goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = [("tiny", 16), ("tiny", 128), ("small", 16), ("small", 128)]


def cpu_seconds() -> float:
    """CPU time (user + system) of this process and all its children, alive or reaped."""
    import psutil

    proc = psutil.Process()
    total = sum(proc.cpu_times()[:4])  # user, system, children_user, children_system
    for child in proc.children(recursive=True):
        try:
            t = child.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def engines(model_name: str, dtype: str, max_batch: int, eager: bool = True):
    import torch

    from hybridrl.config import RolloutConfig
    from hybridrl.models.factory import build_model
    from hybridrl.rollout import ROLLOUT_BACKENDS
    from hybridrl.tasks.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    model = build_model(model_name, tok, seed=0).eval()
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    kv = 1 << 30  # room for every request at once on both sides
    native = ROLLOUT_BACKENDS.get("native")(
        model,
        tok,
        RolloutConfig(
            backend="native",
            backend_options={"kv_cache_bytes": kv, "max_batch_size": max_batch, "dtype": dtype},
        ),
    )
    vllm = ROLLOUT_BACKENDS.get("vllm")(
        model,
        tok,
        RolloutConfig(
            backend="vllm",
            backend_options={
                "kv_cache_bytes": kv,
                "engine_kwargs": {"enforce_eager": eager, "max_num_seqs": max_batch},
            },
        ),
    )
    return tok, {"native": native, "vllm": vllm}


def prompts_of(tok, n: int):
    from hybridrl.protocol import prompt_sample
    from hybridrl.tasks.arithmetic import ArithmeticTask

    task = ArithmeticTask(seed=0)
    return [prompt_sample(task.prompt(i), tok) for i in range(n)]


def timed(engine, prompts, params) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds, generated tokens) of one generate call."""
    c0, t0 = cpu_seconds(), time.perf_counter()
    out = engine.generate(prompts, params)
    wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    return wall, cpu, sum(len(s.response_ids) for s in out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="32 prompts, 1 repeat (a smoke test)")
    p.add_argument("--only", default=None, help="one shape, e.g. small_16")
    p.add_argument(
        "--vllm-compiled",
        action="store_true",
        help="vLLM with its default torch.compile graphs instead of eager (compiles at start)",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.quick:
        args.prompts, args.repeats = 32, 1
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from hybridrl.rollout import SamplingParams

    torch.set_num_threads(args.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    result = {
        "threads": args.threads,
        "prompts": args.prompts,
        "dtype": args.dtype,
        "repeats": args.repeats,
        "vllm_mode": "compiled" if args.vllm_compiled else "eager",
        "torch": torch.__version__,
    }
    shapes = [s for s in SHAPES if args.only in (None, f"{s[0]}_{s[1]}")]
    for model_name in dict.fromkeys(m for m, _ in shapes):
        tok, sides = engines(model_name, args.dtype, args.prompts, not args.vllm_compiled)
        try:
            import vllm

            result["vllm"] = vllm.__version__
            prompts = prompts_of(tok, args.prompts)
            for name, new in ((m, n) for m, n in shapes if m == model_name):
                params = SamplingParams(
                    temperature=1.0, max_new_tokens=new, seed=0, ignore_eos=True
                )
                best = {}
                for engine in sides.values():  # warm-up: compile, allocate
                    timed(engine, prompts[:8], params)
                for _ in range(args.repeats):
                    for side, engine in sides.items():
                        wall, cpu, tokens = timed(engine, prompts, params)
                        if side not in best or wall < best[side][0]:
                            best[side] = (wall, cpu, tokens)
                row = {}
                for side, (wall, cpu, tokens) in best.items():
                    row[f"{side}_tok_s"] = tokens / wall
                    row[f"{side}_cpu_s"] = cpu
                    row[f"{side}_tokens"] = tokens
                row["speedup"] = row["native_tok_s"] / row["vllm_tok_s"]
                row["cpu_speedup"] = row["vllm_cpu_s"] / row["native_cpu_s"]
                result[f"{name}_{new}"] = row
                print(
                    f"{name:>5} {new:>4} new tokens: native {row['native_tok_s']:8.0f} tok/s, "
                    f"vLLM {row['vllm_tok_s']:8.0f} tok/s, wall {row['speedup']:.2f}x, "
                    f"CPU {row['cpu_speedup']:.2f}x",
                    file=sys.stderr,
                )
        finally:
            for engine in sides.values():
                engine.close()
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
