"""The learner's reference forward and update forward+backward, eager against faster variants.

    OMP_NUM_THREADS=1 python bench/learner_speed.py [--size small] [--max-new 128] [--reps 3]
                                                     [--variants eager,compiled] [--profile NAME]
                                                     [--optimizer-reps 5]

Generates one W1-long step's batch (32 W1 prompts x 8 samples, temperature 1, at most
``--max-new`` new tokens) with the native engine from the random-init built-in model, as
``bench/e2e.py``'s hybridrl side does, and cuts it into the learner's own micro-batches (packed
rows, each group sharing one prompt copy: ``learner/logprob.py``: ``micro_batches``). Then, for
each variant (a fresh copy of the same weights), it times what the learner does per step:

- ``ref``: the reference pass, a no-grad forward over the micro-batches (``response_log_probs``);
- ``update``: the policy's forward and backward over them (log-probs and entropy, as the update).

The variants run alternately, ``--reps`` times each after one untimed warm-up pass whose wall time
is the variant's first-use cost (the compile, for ``compiled``); medians are reported in CPU
seconds (one torch thread: steady on a busy machine). Each variant's log-probs and gradients are
compared with ``eager``'s (largest relative difference). ``--profile NAME`` adds that variant's
update's top operators (torch.profiler). The ``optimizer`` block times one AdamW step over the
model's 23.6M parameters (for ``small``) per flavour, PyTorch's CPU default (the single-tensor
loop), ``foreach`` and ``fused``, alternately on the same gradients, and compares the weights
after the steps with the default's. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def _eager(model):
    return model


def _compiled(model):
    from hybridrl.learner.compile import compile_layers

    return compile_layers(model)


def _autotune(model):
    from hybridrl.learner.compile import compile_layers

    return compile_layers(model, mode="max-autotune-no-cudagraphs")


# name -> how a fresh copy of the model is prepared
VARIANTS = {"eager": _eager, "compiled": _compiled, "autotune": _autotune}


def update_pass(model, mbs):
    """Forward + backward of every micro-batch; (log-probs per micro-batch, gradients)."""
    from hybridrl.learner.logprob import response_log_probs

    model.train()
    outs = []
    for mb in mbs:
        lp, ent = response_log_probs(model, mb, 1.0, with_entropy=True)
        (lp.sum() + 0.01 * ent.sum()).backward()
        outs.append(lp.detach())
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return outs, grads


def ref_pass(model, mbs):
    """The no-grad forward of every micro-batch; log-probs per micro-batch."""
    import torch

    from hybridrl.learner.logprob import response_log_probs

    model.eval()
    with torch.no_grad():
        return [response_log_probs(model, mb, 1.0)[0] for mb in mbs]


def rel_diff(a, b) -> float:
    """Largest |a - b| over the largest |b| (per tensor), over a list of tensor pairs."""
    return max(float((x - y).abs().max() / y.abs().max().clamp(min=1e-30)) for x, y in zip(a, b))


def profile_top(model, mbs, rows: int = 12) -> list[dict]:
    """``model``'s update's operators with the most self CPU time, as shares."""
    from torch.profiler import profile

    with profile() as p:
        update_pass(model, mbs)
    events = sorted(p.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    return [
        {"op": e.key, "share": round(e.self_cpu_time_total / total, 4), "calls": e.count}
        for e in events[:rows]
    ]


# AdamW flavour -> its keyword arguments (the default: the single-tensor loop on a CPU)
ADAMW_FLAVOURS = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def optimizer_steps(base, grads, reps: int) -> dict:
    """CPU seconds of one AdamW step (and of the grad-norm clip before it) per flavour, the
    flavours alternating on fresh copies of ``base`` fed the same ``grads``; the weights after
    ``reps`` steps compared with the default flavour's."""
    import torch

    models = {n: copy.deepcopy(base) for n in ADAMW_FLAVOURS}
    opts = {
        n: torch.optim.AdamW(models[n].parameters(), lr=1e-4, weight_decay=0.0, **kw)
        for n, kw in ADAMW_FLAVOURS.items()
    }
    step_s: dict[str, list[float]] = {n: [] for n in ADAMW_FLAVOURS}
    clip_s: dict[str, list[float]] = {n: [] for n in ADAMW_FLAVOURS}
    for rep in range(reps + 1):  # the first step (state allocation) untimed
        for n, m in models.items():
            for p, g in zip(m.parameters(), grads):
                p.grad = g * (1.0 + rep)
            t0 = time.process_time()
            torch.nn.utils.clip_grad_norm_(list(m.parameters()), 1.0)
            t1 = time.process_time()
            opts[n].step()
            t2 = time.process_time()
            m.zero_grad(set_to_none=True)
            if rep:
                clip_s[n].append(t1 - t0)
                step_s[n].append(t2 - t1)
    ref = [p.detach() for p in models["default"].parameters()]
    out: dict = {"parameters": sum(p.numel() for p in base.parameters()), "steps": reps}
    for n, m in models.items():
        out[n] = {
            "step_cpu_s": statistics.median(step_s[n]),
            "clip_cpu_s": statistics.median(clip_s[n]),
            "weight_rel_diff": rel_diff([p.detach() for p in m.parameters()], ref),
        }
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="small", help="built-in model size")
    ap.add_argument("--max-new", type=int, default=128, help="new tokens at most (W1-long: 128)")
    ap.add_argument("--reps", type=int, default=3, help="timed passes per variant")
    ap.add_argument("--budget", type=int, default=8192, help="micro-batch token budget")
    ap.add_argument("--variants", default="eager,compiled", help=f"of {','.join(VARIANTS)}")
    ap.add_argument("--profile", default="", help="a variant whose update's top ops to list")
    ap.add_argument("--optimizer-reps", type=int, default=5, help="AdamW steps per flavour")
    args = ap.parse_args(argv)
    import torch
    from shared_prompts import make_batch

    from hybridrl.learner.logprob import micro_batches, token_counts
    from hybridrl.learner.prefix_share import can_share
    from hybridrl.parallel.packing import attention_key_cost

    torch.set_num_threads(1)
    torch.manual_seed(0)
    base, batch = make_batch(args.size, args.max_new)
    key_cost = attention_key_cost(base)
    mbs, _ = micro_batches(batch, args.budget, True, key_cost, can_share(base))
    names = ["eager"] + [v for v in args.variants.split(",") if v and v != "eager"]
    models = {n: VARIANTS[n](copy.deepcopy(base)) for n in names}
    first: dict[str, dict[str, float]] = {}
    ref_out, upd_out = {}, {}
    for n, m in models.items():  # warm-up: the first use (compile) timed apart
        t0 = time.perf_counter()
        upd_out[n] = update_pass(m, mbs)
        t1 = time.perf_counter()
        ref_out[n] = ref_pass(m, mbs)
        first[n] = {"update_s": t1 - t0, "ref_s": time.perf_counter() - t1}
    cpu: dict[str, dict[str, list[float]]] = {n: {"ref": [], "update": []} for n in names}
    for _ in range(args.reps):
        for n, m in models.items():
            t0 = time.process_time()
            ref_pass(m, mbs)
            t1 = time.process_time()
            update_pass(m, mbs)
            cpu[n]["ref"].append(t1 - t0)
            cpu[n]["update"].append(time.process_time() - t1)
    counts = [token_counts(mb) for mb in mbs]
    out = {
        "size": args.size,
        "max_new_tokens": args.max_new,
        "samples": len(batch),
        "mean_response_length": float(batch["response_mask"].sum(-1).float().mean()),
        "micro_batches": len(mbs),
        "tokens_fed": sum(f for f, _ in counts),
        "real_tokens": sum(r for _, r in counts),
        "torch_threads": torch.get_num_threads(),
        "reps": args.reps,
        "load_average": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    med = {n: {k: statistics.median(v) for k, v in cpu[n].items()} for n in names}
    for n in names:
        out[n] = {
            "ref_cpu_s": med[n]["ref"],
            "update_cpu_s": med[n]["update"],
            "learner_cpu_s": med[n]["ref"] + med[n]["update"],
            "first_use_wall_s": first[n],
            "ref_cpu_s_all": cpu[n]["ref"],
            "update_cpu_s_all": cpu[n]["update"],
        }
        if n != "eager":
            e = med["eager"]
            out[n] |= {
                "ref_speedup": e["ref"] / med[n]["ref"],
                "update_speedup": e["update"] / med[n]["update"],
                "learner_speedup": (e["ref"] + e["update"]) / (med[n]["ref"] + med[n]["update"]),
                "log_prob_rel_diff": rel_diff(upd_out[n][0], upd_out["eager"][0]),
                "ref_log_prob_rel_diff": rel_diff(ref_out[n], ref_out["eager"]),
                "grad_rel_diff": rel_diff(upd_out[n][1], upd_out["eager"][1]),
            }
    if args.profile:
        out[f"{args.profile}_update_profile"] = profile_top(models[args.profile], mbs, 25)
    if args.optimizer_reps:
        out["optimizer"] = optimizer_steps(base, upd_out["eager"][1], args.optimizer_reps)
    out["load_average_after"] = os.getloadavg()
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
