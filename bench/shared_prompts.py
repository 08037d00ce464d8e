"""The learner's passes with and without shared prompts, on one W1 batch, in one run.

    python bench/shared_prompts.py [--size tiny] [--max-new 128] [--reps 6] [--budgets 8192]

Generates one step's batch (32 W1 prompts x 8 samples, temperature 1) with the native engine from
the random-init built-in model (as ``bench/e2e.py``'s workloads), then times what the learner does
with it per step: the policy's forward and backward (log-probs and entropy) and the reference's
forward, over packed micro-batches of ``--budgets`` tokens, with each group's samples sharing one
copy of their prompt (``learner/prefix_share.py``) and without (the plain packed layout),
alternating. Prints one JSON object: CPU seconds (median and min over ``--reps``), tokens fed and
real tokens per pass, the speed-up, and the largest log-prob difference between the two layouts.
Run it with one torch thread (``OMP_NUM_THREADS=1``): CPU time is then steady on a busy machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS, G = 32, 8


def make_batch(size: str, max_new: int):
    """(model, batch): one step's scored samples collated as the learner gets them."""
    import torch

    from hybridrl.config import Config
    from hybridrl.models.factory import build_model
    from hybridrl.protocol import prompt_sample, samples_to_batch
    from hybridrl.rollout import SamplingParams
    from hybridrl.rollout.backends import make_backend
    from hybridrl.tasks.arithmetic import ArithmeticTask
    from hybridrl.tasks.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    model = build_model(size, tok, 0)
    engine = make_backend(Config().rollout, model, tok)
    task = ArithmeticTask(seed=0)
    prompts = [prompt_sample(task.prompt(i), tok) for i in range(PROMPTS)]
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new, n=G, seed=0)
    with torch.no_grad():
        samples = engine.generate(prompts, params)
    return model, samples_to_batch(samples, pad_id=tok.pad_token_id or 0)


def one_pass(model, batch, budget: int, share: bool):
    """The policy's forward + backward and a no-grad forward over the micro-batches; the
    log-probs of the latter in the batch's row order."""
    import torch

    from hybridrl.learner.logprob import micro_batches, response_log_probs
    from hybridrl.parallel.packing import attention_key_cost

    mbs, order = micro_batches(batch, budget, True, attention_key_cost(model), share)
    model.train()
    for mb in mbs:
        lp, ent = response_log_probs(model, mb, 1.0, with_entropy=True)
        (lp.sum() + ent.sum()).backward()
    model.zero_grad(set_to_none=True)
    model.eval()
    out = torch.zeros(batch["responses"].shape)
    row = 0
    with torch.no_grad():
        for mb in mbs:
            lp = response_log_probs(model, mb, 1.0)[0]
            out[order[row : row + lp.shape[0]], : lp.shape[1]] = lp
            row += lp.shape[0]
    return mbs, out


def measure(model, batch, budget: int, reps: int) -> dict:
    from hybridrl.learner.logprob import token_counts

    cpu: dict[bool, list[float]] = {False: [], True: []}
    outs, tokens = {}, {}
    for _ in range(reps):
        for share in (False, True):
            t0 = time.process_time()
            mbs, outs[share] = one_pass(model, batch, budget, share)
            cpu[share].append(time.process_time() - t0)
            counts = [token_counts(mb) for mb in mbs]
            tokens[share] = (sum(f for f, _ in counts), sum(r for _, r in counts))
    mask = batch["response_mask"].bool()
    plain, shared = statistics.median(cpu[False]), statistics.median(cpu[True])
    return {
        "plain_cpu_s": plain,
        "shared_cpu_s": shared,
        "plain_cpu_s_min": min(cpu[False]),
        "shared_cpu_s_min": min(cpu[True]),
        "speedup": plain / shared,
        "plain_tokens_fed": tokens[False][0],
        "shared_tokens_fed": tokens[True][0],
        "plain_real_tokens": tokens[False][1],
        "shared_real_tokens": tokens[True][1],
        "max_log_prob_diff": float((outs[True] - outs[False])[mask].abs().max()),
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="tiny", help="built-in model size")
    ap.add_argument("--max-new", type=int, default=128, help="new tokens at most (W1-long: 128)")
    ap.add_argument("--reps", type=int, default=6, help="timed passes per layout")
    ap.add_argument("--budgets", default="8192", help="comma-separated micro-batch token budgets")
    args = ap.parse_args(argv)
    import torch

    torch.manual_seed(0)
    model, batch = make_batch(args.size, args.max_new)
    lengths = batch["response_mask"].sum(-1).float()
    out = {
        "size": args.size,
        "max_new_tokens": args.max_new,
        "samples": len(batch),
        "mean_response_length": float(lengths.mean()),
        "torch_threads": torch.get_num_threads(),
        "load_average": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    for budget in (int(b) for b in args.budgets.split(",")):
        out[f"budget_{budget}"] = measure(model, batch, budget, args.reps)
    out["load_average_after"] = os.getloadavg()
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
