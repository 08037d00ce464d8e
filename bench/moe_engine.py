"""The native engine on a mixture-of-experts model against the hf rollout backend, same run.

Both engines serve ``tiny_moe`` (Qwen3-MoE, 8 experts, top-2) in fp32 and both record every sample's
routing (what ``moe.routing_replay=r3`` needs), so the comparison is between the two ways a run
can roll out an MoE policy. Scenarios, as in ``bench/rollout.py``:

- ``engine`` (mixed lengths): 256 requests, prompt lengths uniform in 8..64, output lengths uniform
  in 16..256, eos ignored. The native engine gets each request's own max-tokens limit (continuous
  batching); the hf backend runs them as one padded batch to the longest, and only the useful tokens
  count. ``engine.speedup_vs_hf`` is the ratio of useful tokens per second (each engine's fastest of
  ``--repeats`` interleaved runs); ``speedup_vs_hf_cpu_time`` the ratio of process CPU time, which
  other jobs on a shared machine disturb less.
- ``fixed``: 32 prompts x 8 samples x 128 new tokens (W1 prompts), eos ignored; the ratio of
  tokens per second (each engine's faster of two runs, the prefix cache cleared in between).

Both check the recorded routing's shape (prompt + response tokens, 4 layers, 2).
``engine_dense_tiny`` is the mixed scenario on the dense ``tiny`` model (the same attention, one
dense MLP as wide as tiny_moe's two active experts together): the reference for how much of the gap
to the dense figures comes from the experts.

Usage: ``python bench/moe_engine.py [--quick] [--threads N] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybridrl.config import RolloutConfig  # noqa: E402
from hybridrl.models.factory import build_model  # noqa: E402
from hybridrl.protocol import Sample  # noqa: E402
from hybridrl.rollout import SamplingParams  # noqa: E402
from hybridrl.rollout.backends.hf import HFRollout  # noqa: E402
from hybridrl.rollout.backends.native import NativeRollout  # noqa: E402
from hybridrl.tasks.tokenizer import build_char_tokenizer  # noqa: E402

TOK = build_char_tokenizer()


def params(n_new: int, n: int = 1, seed: int = 0) -> SamplingParams:
    p = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=n_new, n=n, seed=seed)
    p.ignore_eos = True
    return p


def native_engine(model) -> NativeRollout:
    rc = RolloutConfig(
        backend="native",
        backend_options={
            "kv_cache_bytes": 2 << 30,
            "max_batch_size": 512,
            "max_num_batched_tokens": 4096,
            "dtype": "fp32",
        },
    )
    eng = NativeRollout(model, TOK, rc)
    eng.generate([Sample(prompt_ids=[1, 3, 4], uid="warm")], params(4, n=2))  # first-call costs
    eng.stats()
    return eng


def hf_engine(model) -> HFRollout:
    eng = HFRollout(
        model,
        TOK,
        RolloutConfig(backend="hf", backend_options={"max_batch_size": 4096, "dtype": "fp32"}),
    )
    # eos ignored, as for the native engine: every row runs to its limit
    eng.eos_token_ids = []
    eng.generate([Sample(prompt_ids=[1, 3, 4], uid="warm")], params(4, n=2))
    return eng


def timed(eng, reqs: list[Sample], p: SamplingParams) -> tuple[float, list[Sample], float]:
    """Wall seconds, the samples, CPU seconds of the process."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = eng.generate(reqs, p)
    return time.perf_counter() - t0, out, time.process_time() - c0


def check_routing(samples: list[Sample], layers: int, k: int) -> None:
    for s in samples:
        shape = (len(s.prompt_ids) + len(s.response_ids), layers, k)
        assert s.routing is not None and tuple(s.routing.shape) == shape, (s.uid, shape)


def mixed(model, n_req: int, out_hi: int, repeats: int = 2) -> dict:
    rng = random.Random(1)
    prompts = [
        [TOK.bos_token_id] + [rng.randint(3, 16) for _ in range(rng.randint(8, 64) - 1)]
        for _ in range(n_req)
    ]
    outs = [rng.randint(16, out_hi) for _ in range(n_req)]
    moe = hasattr(model.config, "num_experts_per_tok")
    reqs = [Sample(prompt_ids=p, uid=f"m{i}") for i, p in enumerate(prompts)]
    native, hf = native_engine(model), hf_engine(model)
    native_runs, hf_runs = [], []
    for _ in range(repeats):  # each engine in turn: the faster run counts (a shared machine)
        native.engine.bm.invalidate()
        native.engine.finished.clear()
        t0, c0 = time.perf_counter(), time.process_time()
        for i, (pr, o) in enumerate(zip(prompts, outs)):
            native.engine.add_request(f"m{i}", pr, params(o), seed=i)
        while native.engine.has_unfinished():
            native.engine.step()
        native_runs.append((time.perf_counter() - t0, time.process_time() - c0))
        seqs = [s for v in native.engine.finished.values() for s in v]
        assert sum(len(s.completion_ids) for s in seqs) == sum(outs)
        assert all((s.routing is not None and s.routing.shape[0] == len(s)) == moe for s in seqs)
        hf_dt, hf_out, hf_cpu = timed(hf, reqs, params(max(outs)))
        hf_runs.append((hf_dt, hf_cpu))
    if moe:
        check_routing(hf_out, model.config.num_hidden_layers, model.config.num_experts_per_tok)
    dt, hf_dt = min(r[0] for r in native_runs), min(r[0] for r in hf_runs)
    cpu, hf_cpu = min(r[1] for r in native_runs), min(r[1] for r in hf_runs)
    res = {
        "native_tokens_per_s": sum(outs) / dt,
        "hf_tokens_per_s": sum(outs) / hf_dt,
        "native_s": dt,
        "hf_s": hf_dt,
        "requests": n_req,
        "useful_tokens": sum(outs),
        "speedup_vs_hf_cpu_time": hf_cpu / cpu,  # less sensitive to other jobs on the machine
        "native_runs_s": [r[0] for r in native_runs],
        "hf_runs_s": [r[0] for r in hf_runs],
    }
    res["speedup_vs_hf"] = res["native_tokens_per_s"] / res["hf_tokens_per_s"]
    return res


def fixed(model, n_prompts: int, g: int, new: int, repeats: int = 2) -> dict:
    rng = random.Random(0)
    prompts = [
        TOK(f"{rng.randint(0, 999)}+{rng.randint(0, 999)}=")["input_ids"] for _ in range(n_prompts)
    ]
    reqs = [Sample(prompt_ids=p, uid=f"f{i}") for i, p in enumerate(prompts)]
    native, hf = native_engine(model), hf_engine(model)
    native_runs, hf_runs = [], []
    for _ in range(repeats):
        native.engine.bm.invalidate()  # a later run computes its prompts again
        native_runs.append(timed(native, reqs, params(new, n=g)))
        hf_runs.append(timed(hf, reqs, params(new, n=g)))
    layers, k = model.config.num_hidden_layers, model.config.num_experts_per_tok
    check_routing(native_runs[0][1], layers, k)
    check_routing(hf_runs[0][1], layers, k)
    tokens = n_prompts * g * new
    dt, hf_dt = min(r[0] for r in native_runs), min(r[0] for r in hf_runs)
    cpu, hf_cpu = min(r[2] for r in native_runs), min(r[2] for r in hf_runs)
    return {
        "shape": f"{n_prompts}x{g}x{new}",
        "native_tokens_per_s": tokens / dt,
        "hf_tokens_per_s": tokens / hf_dt,
        "native_s": dt,
        "hf_s": hf_dt,
        "speedup_vs_hf": hf_dt / dt,
        "speedup_vs_hf_cpu_time": hf_cpu / cpu,
    }


def run_all(q: bool, repeats: int = 2) -> dict:
    """The three scenarios (``engine``, ``fixed``, ``engine_dense_tiny``) and their wall time."""
    torch.manual_seed(0)
    model = build_model("tiny_moe", TOK, 0).eval()
    t0 = time.perf_counter()
    out = {"engine": mixed(model, 64 if q else 256, 64 if q else 256, repeats)}
    out["fixed"] = fixed(model, *((8, 8, 32) if q else (32, 8, 128)), repeats)
    dense = build_model("tiny", TOK, 0).eval()
    out["engine_dense_tiny"] = mixed(dense, 64 if q else 256, 64 if q else 256, repeats)
    out["engine_seconds"] = time.perf_counter() - t0
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller scenarios (a smoke run)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per engine (the fastest counts)")
    ap.add_argument("--out", default="", help="also write the JSON here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    out = {"quick": args.quick, "threads": torch.get_num_threads(), "torch": torch.__version__}
    out |= run_all(args.quick, args.repeats)
    text = json.dumps(out, indent=1, default=float)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
