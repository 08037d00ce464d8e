"""Where a bf16 forward flips an MoE router's top-k, and how much those flips weigh. Prints one JSON
object.

For tiny_moe (8 experts, top-2) and its fine-grained variants (``--experts 64 128``, top-k
``--top-k``; ``bench/moe.py``'s ``fine_grained``), each from its cached warm start (trained on first
use, as ``bench/moe.py`` does): one forward of the same held-out SFT examples in fp32 and in a bf16
copy, the router's scores taken at every (real token, layer). Per model:

* ``rerouted_share``: the (token, layer) pairs whose bf16 top-k set differs from the fp32 one;
* ``swapped_weight``: on those pairs, the fp32 dispatch weight (after ``norm_topk_prob``) of the
  experts that bf16 dropped, averaged: how much of the token's MLP output a flip replaces;
* ``median_relative_gap``: (p_k - p_k+1) / p_k of the fp32 router, the margin that bf16 rounding has
  to cross to flip the k-th choice; ``gap_below_1pct``: the share of pairs with a margin under 1 %.

This is why R3 removes little of the bf16 gap on the fine-grained variant although bf16 flips
more pairs there: the expert it swaps is the k-th, which carries a small weight when k is 8.

    .venv/bin/python bench/moe_flips.py --experts 0 64 128
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

from moe import EXAMPLE, fine_grained  # noqa: E402

from hybridrl.config import Config, load_config  # noqa: E402
from hybridrl.driver.sft import ensure_warm_start, sft_batch  # noqa: E402
from hybridrl.models.loading import make_task  # noqa: E402

HELD_OUT = 10**6  # SFT example index far past any warm start's stream


def router_scores(model, ids: torch.Tensor, attn: torch.Tensor) -> list[torch.Tensor]:
    """Every MoE layer's router logits (fp32) of one forward, real tokens only."""
    rec: list[torch.Tensor] = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda mod, inp, out: rec.append(out[0].float()))
        for layer in model.model.layers
    ]
    with torch.no_grad():
        model(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0))
    for h in hooks:
        h.remove()
    valid = attn.bool().reshape(-1)
    return [r[valid] for r in rec]


def flips(path: str, ids: torch.Tensor, attn: torch.Tensor) -> dict:
    fp32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    k = fp32.config.num_experts_per_tok
    pairs, swapped, margins = 0, [], []
    for a, b in zip(router_scores(fp32, ids, attn), router_scores(bf16, ids, attn)):
        top = a.softmax(-1).topk(k + 1, -1)
        weight = top.values[:, :k] / top.values[:, :k].sum(-1, keepdim=True)
        chosen, rounded = top.indices[:, :k], b.softmax(-1).topk(k, -1).indices
        dropped = ~(chosen[:, :, None] == rounded[:, None, :]).any(-1)  # (pairs, k)
        differ = dropped.any(-1)
        swapped.append((weight * dropped)[differ].sum(-1))
        margins.append((top.values[:, k - 1] - top.values[:, k]) / top.values[:, k - 1])
        pairs += len(a)
    swapped_w, margin = torch.cat(swapped), torch.cat(margins)
    return {
        "experts": fp32.config.num_experts,
        "top_k": k,
        "pairs": pairs,
        "rerouted_share": len(swapped_w) / pairs,
        "swapped_weight": float(swapped_w.mean()) if len(swapped_w) else 0.0,
        "uniform_weight": 1 / k,
        "median_relative_gap": float(margin.median()),
        "gap_below_1pct": float((margin < 0.01).float().mean()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, nargs="+", default=[0, 64], help="0: tiny_moe itself")
    ap.add_argument("--top-k", type=int, default=8, help="the variants' experts per token")
    ap.add_argument("--examples", type=int, default=64, help="held-out SFT examples")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--workdir", default="runs/bench_moe")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    out: dict = {"bench": "moe_flips", "threads": args.threads, "models": {}}
    for experts in args.experts:
        cfg = load_config(Config, str(EXAMPLE), [])
        variant = argparse.Namespace(
            experts=experts, top_k=args.top_k, moe_intermediate=0, workdir=args.workdir
        )
        fine_grained(cfg, variant)
        path = ensure_warm_start(cfg, progress=False)
        task = make_task(cfg)
        ids, attn, _, _ = sft_batch(task, task.tokenizer(), HELD_OUT, args.examples)
        figures = flips(path, ids, attn)
        out["models"][f"{figures['experts']} experts, top-{figures['top_k']}"] = figures | {
            "warm_start": path
        }
    out["seconds"] = time.perf_counter() - t0
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
