"""Rollout benchmark: the native engine against transformers ``generate`` in the same run.

Prints one JSON object (nested; ``fixed.speedup_vs_hf`` is ``out["fixed"]["speedup_vs_hf"]``) and a
short table. Scenarios (workloads defined in docs/workloads.md):

- ``fixed`` / ``fixed_tiny``: W1 small / tiny model, 32 prompts x 8 samples x 128 new tokens, eos
  ignored, fp32 for both (``fixed.bf16_*``: the same in bf16). Each engine runs twice (the prefix
  cache cleared in between) and the faster run counts, as for a long-lived rollout engine;
  ``first_run_speedup_vs_hf`` compares the first runs.
- ``mixed``: 256 requests, prompt lengths uniform in 8..64, output lengths uniform in 16..256 (eos
  ignored, a max-tokens limit per request); transformers runs them as one padded batch, so only
  useful tokens count.
- ``prefix``: prompt tokens requested / prompt tokens computed with G = 8 samples per prompt.
- ``spec``: the warm-started tiny model drafting for the warm-started small model (``WARM_STARTS``);
  W1 rollout shape (temperature 1, eos honoured, at most 16 new tokens), ``b`` requests in flight
  (continuous batching); the draft is distilled towards the target first (``DRAFT_DISTILL``). With
  and without speculation at b = 1, 8 and 256: ``decode_speedup``, the ratio of tokens/s in
  decode-only steps (the decode speed; prefill is the same work either way), and
  ``generation_speedup``, the ratio for the whole generation, prefill included. ``spec.speedup`` is
  the b = 8 decode figure with the engine's automatic on/off (``forced_*`` and ``acceptance``:
  speculation forced on every eligible step; ``acceptance_sft_draft``: the draft before
  distillation).
- ``roofline``: this machine's matmul FLOP/s and copy bandwidth, and the fixed run's fraction of the
  bound max(FLOPs / peak, bytes / bandwidth); ``speedup_at_roofline``: transformers' time over that
  bound, the speed-up an engine running exactly at the bound would show.

``--device cuda`` runs every scenario on the GPU (warm starts and distillation still train on the
CPU, then move); ``bench/gpu_check.sh`` is the prepared script for a lent GPU machine.

Usage: ``python bench/rollout.py [--quick] [--threads N] [--device cpu|cuda] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybridrl.config import Config, RolloutConfig  # noqa: E402
from hybridrl.models.factory import build_model  # noqa: E402
from hybridrl.protocol import Sample, pad_2d  # noqa: E402
from hybridrl.rollout import SamplingParams  # noqa: E402
from hybridrl.rollout.backends.native import NativeRollout  # noqa: E402
from hybridrl.tasks.tokenizer import build_char_tokenizer  # noqa: E402

TOK = build_char_tokenizer()


# --- machine limits ---------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    """Wait for the device's queued work (timings on a GPU end here)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rate(fn, device: torch.device, seconds: float) -> float:
    """Calls of ``fn`` per second over about ``seconds`` (after one warm-up call)."""
    fn()
    sync(device)
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        reps += 1
        sync(device)
    return reps / (time.perf_counter() - t0)


def roofline(quick: bool, device: torch.device) -> dict:
    out, secs = {}, 0.5 if quick else 1.5
    n = (512 if quick else 1024) if device.type == "cpu" else 8192
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a, b = (
            torch.randn(n, n, dtype=dt, device=device),
            torch.randn(n, n, dtype=dt, device=device),
        )
        out[f"matmul_{name}_gflops"] = (
            2 * n**3 * rate(lambda a=a, b=b: torch.mm(a, b), device, secs) / 1e9
        )
    numel = (32 << 20) if device.type == "cpu" else (256 << 20)  # 128 MB / 1 GB each
    src, dst = torch.randn(numel, device=device), torch.empty(numel, device=device)
    out["copy_gbps"] = (
        2 * numel * 4 * rate(lambda: dst.copy_(src), device, secs) / 1e9
    )  # read + write
    return out


# --- workloads ------------------------------------------------------------------------------------
def w1_prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [TOK(f"{rng.randint(0, 999)}+{rng.randint(0, 999)}=")["input_ids"] for _ in range(count)]


def params(n_new: int, n: int = 1, seed: int = 0) -> SamplingParams:
    p = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=n_new, n=n, seed=seed)
    p.ignore_eos = True
    return p


def engine(model, kv_gb: float = 2.0, **kw) -> NativeRollout:
    dtype = (
        "bf16" if next(model.parameters()).dtype == torch.bfloat16 else "fp32"
    )  # the model's, not rollout.backend_options.dtype=auto's
    rc = RolloutConfig(
        backend="native",
        backend_options={
            "kv_cache_bytes": int(kv_gb * (1 << 30)),
            "max_batch_size": 512,
            "max_num_batched_tokens": 4096,
            "dtype": dtype,
        },
    )
    eng = NativeRollout(model, TOK, rc, **kw)
    eng.generate(
        [Sample(prompt_ids=[1, 3, 4], uid="warm")], params(4, n=2)
    )  # first-call costs out of the timing
    eng.stats()
    return eng


def hf_generate(model, prompts: list[list[int]], n: int, max_new: int) -> float:
    """Seconds for one batched sampling ``generate`` call, eos ignored."""
    dev = next(model.parameters()).device
    ids = pad_2d(prompts, TOK.pad_token_id, torch.long, left=True).to(dev)
    attn = pad_2d([[1] * len(p) for p in prompts], 0, torch.long, left=True).to(dev)
    gc = copy.deepcopy(model.generation_config)
    gc.pad_token_id = TOK.pad_token_id
    kw = dict(
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        num_return_sequences=n,
        generation_config=gc,
    )
    model.generate(input_ids=ids[:1], attention_mask=attn[:1], max_new_tokens=2, **kw)  # warm up
    t0, c0 = time.perf_counter(), time.process_time()
    with (
        torch.no_grad()
    ):  # min_new_tokens: eos is masked, so every row runs to max_new (eos ignored)
        out = model.generate(
            input_ids=ids, attention_mask=attn, max_new_tokens=max_new, min_new_tokens=max_new, **kw
        )
    sync(dev)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert out.shape[1] == ids.shape[1] + max_new, "eos was not ignored"
    return dt, cpu


def always_speculate(eng: NativeRollout) -> None:
    """Bypass the speculation cost model: every eligible step speculates with the longest
    proposal."""
    spec = eng.engine.speculative
    spec.choose_k = lambda batch_size: spec.max_k


def native_generate(eng: NativeRollout, prompts, p) -> tuple[float, dict, int, float]:
    reqs = [Sample(prompt_ids=ids, uid=f"r{i}") for i, ids in enumerate(prompts)]
    t0, c0 = time.perf_counter(), time.process_time()
    out = eng.generate(reqs, p)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    return dt, eng.stats(), sum(len(s.response_ids) for s in out), cpu


def flops_bytes(model, stats: dict, tokens: int, prompts, n: int, new: int) -> tuple[float, float]:
    """Matmul + attention FLOPs and the bytes a decode step must read (weights + KV), summed over
    the run."""
    c = model.config
    params_mm = sum(
        p.numel()
        for name, p in model.named_parameters()
        if "norm" not in name and "embed" not in name
    )
    params_mm += c.vocab_size * c.hidden_size  # lm_head (tied)
    head_dim = c.hidden_size // c.num_attention_heads
    elt = next(model.parameters()).element_size()
    flops, kv_bytes, steps = 0.0, 0.0, new
    for p in prompts:
        for t in range(new):
            ctx = len(p) + t
            flops += n * 4 * c.num_hidden_layers * c.num_attention_heads * head_dim * ctx
            kv_bytes += n * 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * ctx * elt
    flops += 2 * params_mm * (tokens + stats["engine/prompt_tokens_computed"])
    return flops, kv_bytes + steps * sum(p.numel() * p.element_size() for p in model.parameters())


def fixed(
    size: str, n_prompts: int, g: int, new: int, device: torch.device, dtype=torch.float32, rl=None
) -> dict:
    model = build_model(size, TOK, 0).to(device, dtype).eval()
    prompts = w1_prompts(n_prompts)
    eng = engine(model)
    native_runs, hf_runs = [], []
    for _ in range(
        2
    ):  # each engine twice, the faster run counts (an RL rollout engine is long-lived)
        eng.engine.bm.invalidate()  # the second run computes its prompts again, as the first did
        native_runs.append(native_generate(eng, prompts, params(new, n=g)))
        hf_runs.append(hf_generate(model, prompts, g, new))
    dt, st, tokens, cpu = min(native_runs, key=lambda r: r[0])
    hf_dt, hf_cpu = min(hf_runs, key=lambda r: r[0])
    res = {
        "native_tokens_per_s": tokens / dt,
        "hf_tokens_per_s": n_prompts * g * new / hf_dt,
        "first_run_speedup_vs_hf": hf_runs[0][0] / native_runs[0][0],
        "native_s": dt,
        "hf_s": hf_dt,
        "speedup_vs_hf_cpu_time": hf_cpu / cpu,
        "kv_usage_peak": st["engine/kv_usage_peak"],
        "preemptions": st["engine/preemptions"],
        "prompt_tokens": st["engine/prompt_tokens"],
        "prompt_tokens_computed": st["engine/prompt_tokens_computed"],
    }
    res["speedup_vs_hf"] = res["native_tokens_per_s"] / res["hf_tokens_per_s"]
    if rl is not None:
        f, b = flops_bytes(model, st, tokens, prompts, g, new)
        peak = rl["matmul_fp32_gflops" if dtype == torch.float32 else "matmul_bf16_gflops"] * 1e9
        bound = max(f / peak, b / (rl["copy_gbps"] * 1e9))
        res.update(
            achieved_gflops=f / dt / 1e9,
            roofline_fraction=bound / dt,
            speedup_at_roofline=hf_dt / bound,
            bound="compute" if f / peak >= b / (rl["copy_gbps"] * 1e9) else "memory",
        )
    return res


def mixed(n_req: int, out_hi: int, device: torch.device) -> dict:
    model = build_model("small", TOK, 0).to(device).eval()
    rng = random.Random(1)
    prompts = [
        [TOK.bos_token_id] + [rng.randint(3, 16) for _ in range(rng.randint(8, 64) - 1)]
        for _ in range(n_req)
    ]
    outs = [rng.randint(16, out_hi) for _ in range(n_req)]
    eng = engine(model)
    ps = []
    for o in outs:
        p = params(o)
        ps.append(p)
    t0, c0 = time.perf_counter(), time.process_time()
    for i, (pr, p) in enumerate(zip(prompts, ps)):
        eng.engine.add_request(f"m{i}", pr, p, seed=i)
    while eng.engine.has_unfinished():
        eng.engine.step()
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = sum(len(s.completion_ids) for v in eng.engine.finished.values() for s in v)
    assert tokens == sum(outs)
    st = eng.stats()
    hf_dt, hf_cpu = hf_generate(model, prompts, 1, max(outs))
    res = {
        "native_tokens_per_s": tokens / dt,
        "hf_tokens_per_s": sum(outs) / hf_dt,
        "native_s": dt,
        "hf_s": hf_dt,
        "speedup_vs_hf_cpu_time": hf_cpu / cpu,
        "requests": n_req,
        "useful_tokens": sum(outs),
        "kv_usage_peak": st["engine/kv_usage_peak"],
    }
    res["speedup_vs_hf"] = res["native_tokens_per_s"] / res["hf_tokens_per_s"]
    return res


def prefix(fixed_res: dict, n_prompts: int, device: torch.device) -> dict:
    """G = 8 groups (from the fixed run) and repeated long prompts (full blocks served from the hash
    cache)."""
    model = build_model("tiny", TOK, 0).to(device).eval()
    eng = engine(model, kv_gb=0.25)
    rng = random.Random(2)
    longp = [[TOK.bos_token_id] + [rng.randint(3, 16) for _ in range(63)] for _ in range(n_prompts)]
    native_generate(eng, longp, params(8, n=8))
    _, st, _, _ = native_generate(
        eng, longp, params(8, n=8)
    )  # the same prompts again: served from the cache
    return {
        "prefill_reduction": fixed_res["prompt_tokens"]
        / max(1, fixed_res["prompt_tokens_computed"]),
        "repeat_hit_rate": st["engine/prefix_hit_rate"],
        "repeat_prefill_reduction": st["engine/prompt_tokens"]
        / max(1, st["engine/prompt_tokens_computed"]),
    }


# Warm starts of the speculative pair: supervised training on correct sums
# (hybridrl.driver.sft.run_sft), in stages (each continues from the previous one with a fresh
# warm-up/decay schedule), cached under checkpoints/bench/. They train fixed step counts
# (sft.steps), not to the RL warm start's accuracy target: the pair is measured for speed and
# acceptance, which needs no room left for RL, and the stage names in the cache spell out those
# counts. The first full run trains them (small: about 55 minutes on one core, tiny: 3 minutes);
# later runs load them in seconds. --quick uses them when they are cached and otherwise trains the
# short QUICK_WARM_STARTS (about 30 s together). The draft is then distilled towards the target on
# the target's own samples (DRAFT_DISTILL, hybridrl.driver.distill): a draft that learnt the task
# alone agrees with a target that has not learnt it yet only where both are right.
WARM_STARTS = {
    "small": [dict(steps=200, batch_size=256, lr=1.5e-3), dict(steps=200, batch_size=256, lr=1e-3)],
    "tiny": [dict(steps=150, batch_size=256, lr=3e-3)],
}
QUICK_WARM_STARTS = {
    "small": [dict(steps=25, batch_size=32, lr=3e-3)],
    "tiny": [dict(steps=25, batch_size=32, lr=3e-3)],
}
DRAFT_DISTILL, QUICK_DRAFT_DISTILL = (
    dict(steps=150, batch_size=128, lr=1e-3),
    dict(steps=20, batch_size=64, lr=1e-3),
)


def warm_stages(size: str, quick: bool) -> tuple[list[dict], bool]:
    """The stages to load or train, and whether they are the full ones (always unless --quick finds
    no cache)."""
    full = WARM_STARTS[size]
    if (
        not quick
        or (ROOT / "checkpoints" / "bench" / stage_names(size, full)[-1] / "config.json").is_file()
    ):
        return full, True
    return QUICK_WARM_STARTS[size], False


def stage_names(size: str, stages: list[dict]) -> list[str]:
    names, name = [], f"arith-{size}"
    for s in stages:
        name += f"-sft{s['steps']}x{s['batch_size']}-lr{s['lr']:g}"
        names.append(name)
    return names


def warm(size: str, stages: list[dict]) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from hybridrl.driver.sft import run_sft

    path = None
    for s, name in zip(stages, stage_names(size, stages)):
        prev, path = path, ROOT / "checkpoints" / "bench" / name
        if not (path / "config.json").is_file():
            cfg = Config()
            cfg.model.name, cfg.model.path = size, None if prev is None else str(prev)
            cfg.sft.steps, cfg.sft.batch_size, cfg.sft.lr = s["steps"], s["batch_size"], s["lr"]
            run_sft(cfg, path, progress=sys.stderr.isatty())
    return AutoModelForCausalLM.from_pretrained(
        path, local_files_only=True, dtype=torch.float32
    ).eval(), path.name


def distill_path(target_name: str, draft_name: str, stage: dict) -> Path:
    run = f"distil{stage['steps']}x{stage['batch_size']}-lr{stage['lr']:g}"
    return ROOT / "checkpoints" / "bench" / f"{draft_name}-{run}-of-{target_name}"


def distilled(target, target_name: str, draft, draft_name: str, stage: dict) -> torch.nn.Module:
    """``draft`` distilled towards ``target`` (cached like the warm starts)."""
    from transformers import AutoModelForCausalLM

    from hybridrl.driver.distill import distill_draft

    path = distill_path(target_name, draft_name, stage)
    if not (path / "config.json").is_file():
        draft = copy.deepcopy(draft)
        res = distill_draft(
            target,
            draft,
            TOK,
            w1_prompts(stage["steps"] * stage["batch_size"], seed=1000),
            max_new_tokens=16,
            steps=stage["steps"],
            batch_size=stage["batch_size"],
            lr=stage["lr"],
            progress=sys.stderr.isatty(),
        )
        print(f"# draft distillation: {json.dumps(res)}", file=sys.stderr)
        tmp = path.with_name(path.name + ".tmp")
        draft.save_pretrained(tmp)
        TOK.save_pretrained(tmp)
        tmp.replace(path)
    return AutoModelForCausalLM.from_pretrained(
        path, local_files_only=True, dtype=torch.float32
    ).eval()


def spec(batches: list[int], quick: bool, device: torch.device) -> dict:
    """W1 rollout shape (eos honoured, at most 16 new tokens, temperature 1) with ``b`` requests in
    flight."""
    (small, full_s), (tiny, full_t) = warm_stages("small", quick), warm_stages("tiny", quick)
    (target, t_name), (sft_draft, d_name) = warm("small", small), warm("tiny", tiny)
    # --quick: only when cached (the first full distillation takes about 5 minutes)
    stage = DRAFT_DISTILL
    if quick and not (
        full_s and full_t and (distill_path(t_name, d_name, stage) / "config.json").is_file()
    ):
        stage = QUICK_DRAFT_DISTILL
    draft = distilled(target, t_name, sft_draft, d_name, stage).to(device)
    target, sft_draft = (
        target.to(device),
        sft_draft.to(device),
    )  # trained on the CPU, measured on the device
    plain = engine(target)
    fast = engine(target, draft_model=draft)
    forced = engine(target, draft_model=draft)
    always_speculate(forced)  # speculate on every eligible step: acceptance and raw speed-up
    res = {}
    for b in batches:
        n_req = max(4 * b, 16 if quick else 128)
        prompts = w1_prompts(n_req, seed=3)
        p = SamplingParams(temperature=1.0, max_new_tokens=16, seed=1)
        for e in (plain, fast, forced):
            e.engine.scheduler.max_num_seqs = b
        runs = {e: [] for e in (plain, fast, forced)}
        for _ in range(2):  # best of two, interleaved: this machine is shared
            for e in runs:
                runs[e].append(native_generate(e, prompts, p))
        (dt0, st0, tok0, _), (dt1, st1, tok1, _), (dt2, st2, tok2, _) = (
            min(r, key=lambda r: r[0]) for r in runs.values()
        )
        dec = "engine/decode_tokens_per_s"
        res[f"b{b}"] = {
            "plain_tokens_per_s": tok0 / dt0,
            "spec_tokens_per_s": tok1 / dt1,
            "generation_speedup": (tok1 / dt1) / (tok0 / dt0),
            "decode_speedup": st1[dec] / st0[dec],
            "spec_steps": st1.get("engine/spec_steps", 0.0),
            "forced_generation_speedup": (tok2 / dt2) / (tok0 / dt0),
            "forced_decode_speedup": st2[dec] / st0[dec],
            "acceptance": st2.get("engine/spec_acceptance", 0.0),
            "forced_spec_steps": st2.get("engine/spec_steps", 0.0),
            "requests": n_req,
            "tokens": tok1,
        }
    mid = res[f"b{batches[1]}"]
    ref = engine(target, draft_model=sft_draft)  # the draft before distillation, for comparison
    always_speculate(ref)
    ref.engine.scheduler.max_num_seqs = batches[1]
    mid["acceptance_sft_draft"] = native_generate(ref, w1_prompts(mid["requests"], seed=3), p)[1][
        "engine/spec_acceptance"
    ]
    ref.release_memory()
    res.update(
        full_warm_starts=full_s and full_t,
        full_distillation=stage is DRAFT_DISTILL,
        acceptance_sft_draft=mid["acceptance_sft_draft"],
        acceptance=mid["acceptance"],
        speedup=mid["decode_speedup"],
        generation_speedup=mid["generation_speedup"],
        k=fast.engine.speculative.max_k,
        auto_off_batch=fast.engine.speculative.max_batch,
    )
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes (under 3 minutes)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=str, default=None, help="also write the JSON here")
    ap.add_argument("--only", type=str, default="", help="comma-separated scenarios (default: all)")
    ap.add_argument("--device", type=str, default="cpu", help="cpu (default) or cuda[:N]")
    args = ap.parse_args()
    dev = torch.device(args.device)
    if dev.type not in ("cpu", "cuda") or (dev.type == "cuda" and not torch.cuda.is_available()):
        ap.error(
            f"--device {args.device!r}: use cpu, or cuda where a GPU is visible "
            f"(cuda available: {torch.cuda.is_available()})"
        )
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()

    def save() -> None:  # after every scenario, so a long run that dies keeps what it measured
        if args.out:
            Path(args.out).write_text(json.dumps(out, indent=1, default=float))

    q = args.quick
    only = set(filter(None, args.only.split(",")))
    want = lambda name: not only or name in only  # noqa: E731
    P, G, N = (8, 8, 32) if q else (32, 8, 128)
    t0 = time.perf_counter()
    out: dict = {
        "quick": q,
        "threads": args.threads,
        "torch": torch.__version__,
        "device": str(dev),
    }
    if dev.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(dev)
    out["roofline"] = rl = roofline(q, dev)
    if want("fixed"):
        out["fixed"] = fixed("small", P, G, N, dev, rl=rl)
        bf = fixed("small", P, G, N, dev, torch.bfloat16, rl=rl)
        out["fixed"].update(
            {
                f"bf16_{k}": v
                for k, v in bf.items()
                if k
                in (
                    "speedup_vs_hf",
                    "speedup_vs_hf_cpu_time",
                    "native_tokens_per_s",
                    "hf_tokens_per_s",
                    "roofline_fraction",
                )
            }
        )
        save()
    if want("fixed_tiny"):
        out["fixed_tiny"] = fixed("tiny", P, G, N, dev, rl=rl)
        save()
    if want("mixed"):
        out["mixed"] = mixed(64 if q else 256, 64 if q else 256, dev)
        save()
    if want("prefix"):
        base = out.get("fixed") or fixed("tiny", P, G, 4, dev)
        out["prefix"] = prefix(base, 8 if q else 32, dev)
        save()
    if want("spec"):
        out["spec"] = spec([1, 8, 64 if q else 256], q, dev)
        save()
    out["seconds"] = time.perf_counter() - t0
    text = json.dumps(out, indent=1, default=float)
    print(text)
    for key in ("fixed", "fixed_tiny", "mixed"):
        if key in out:
            r = out[key]
            print(
                f"# {key:10s} native {r['native_tokens_per_s']:9.0f} tok/s  "
                f"hf {r['hf_tokens_per_s']:9.0f} tok/s  "
                f"x{r['speedup_vs_hf']:.2f} (cpu time x{r['speedup_vs_hf_cpu_time']:.2f})",
                file=sys.stderr,
            )
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
