"""Sequence packing and data-parallel balancing: padding, rank imbalance, the policy update's time.

    python bench/packing.py [--steps 3] [--reps 5] [--ranks 2] [--minibatch-rows 64] [--out FILE]

For each workload, W1 (3-digit addition, responses of 2-5 tokens) and W3 (reversing digits,
long-tailed: 90% of prompts have 1-16 digits, 10% 48-96), ``--steps`` steps of 32 prompts x 8
samples with the workload's real prompts (the task's own stream and tokenizer) and realistic
responses: a warm-started policy's, mostly the right answer then ``<eos>``, a third of them wrong
(cut short or running on by a few tokens). The learner is the real one (tiny Qwen2, fp32, the
workload's config: ppo_clip, 4 mini-batches of 64, ``actor.micro_batch_tokens`` 8192).

- ``padding_fraction``: padded / all token positions fed to the model in the update
  (``perf/padding_fraction``), packed, today's length-grouped trimmed micro-batches, and naive
  padding (every row of a mini-batch at the batch's full width).
- ``dp_imbalance``: max / mean - 1 of the tokens per rank with ``--ranks`` data-parallel ranks
  (``perf/dp_token_imbalance``), the samples in the order the rollout returns them, balanced
  (``trainer.balance_batch``), balanced without the swaps that even the greedy fill of unequal
  shares (the baseline), and not, over each rank's part of the step
  (``dp_imbalance_<ranks>_ranks``) and over each rank's share of each mini-batch of
  ``--minibatch-rows`` that the update draws from the step's 256 rows, where the ranks meet
  (``..._per_minibatch``: ``perf/dp_token_imbalance_minibatch``); the mean over the steps.
- ``update``: the policy update (``Learner.update_actor``) on the same batch from the same
  weights and optimizer state, the settings alternating (packed, grouped, naive, naive, grouped,
  packed, ...) ``--reps`` times; the median seconds of each, ``update_speedup_vs_unpacked`` =
  grouped / packed and ``update_speedup_vs_naive`` = naive / packed, and the largest weight
  difference after the update between packed and each of the others (the same result).

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybridrl.config import Config, load_config  # noqa: E402
from hybridrl.controller import WorkerContext  # noqa: E402
from hybridrl.learner import Learner  # noqa: E402
from hybridrl.learner.update import (  # noqa: E402
    first_epoch_minibatches,
    global_totals,
    minibatch_rows,
)
from hybridrl.models.loading import make_task  # noqa: E402
from hybridrl.parallel import batch_balance  # noqa: E402
from hybridrl.parallel.batch_balance import balance_for_ranks  # noqa: E402
from hybridrl.parallel.fsdp import clip_grad_norm  # noqa: E402
from hybridrl.protocol import Batch, Sample, samples_to_batch  # noqa: E402

WORKLOADS = {
    "w1": ["task.name=arith", "rollout.max_new_tokens=16"],
    "w3": ["task.name=reverse", "rollout.max_new_tokens=100"],
}
COMMON = ["algorithm.policy_loss=ppo_clip", "model.name=tiny"]
SETTINGS = ("packed", "grouped", "naive")
PROMPTS, G = 32, 8


def response_of(answer: list[int], eos: int, max_new: int, rng: random.Random) -> list[int]:
    """A warm-started policy's response: mostly the answer then ``<eos>``; a third wrong, cut
    short or running on by 1-4 digits (never past ``max_new`` tokens)."""
    out, roll = list(answer), rng.random()
    if roll < 1 / 6 and len(out) > 1:
        out = out[: rng.randint(1, len(out) - 1)]
    elif roll < 1 / 3:
        out += [rng.choice(answer) for _ in range(rng.randint(1, 4))]
    return (out + [eos])[:max_new]


def step_samples(cfg: Config, task, tokenizer, step: int) -> list[Sample]:
    """One step's samples, in the order a rollout returns them (a prompt's G samples together),
    rewarded 1 for the exact answer."""
    rng = random.Random(1000 + step)
    samples = []
    for p in range(PROMPTS):
        prompt = task.prompt(step * PROMPTS + p)
        ids = tokenizer(prompt.text)["input_ids"]
        answer = tokenizer(prompt.answer, add_special_tokens=False)["input_ids"]
        for _ in range(G):
            resp = response_of(answer, tokenizer.eos_token_id, cfg.rollout.max_new_tokens, rng)
            reward = float(resp == answer + [tokenizer.eos_token_id])
            samples.append(
                Sample(ids, resp, [0.0] * len(resp), [0] * len(resp), None, "finished",
                       prompt.uid, reward=reward)
            )  # fmt: skip
    return samples


def update_inputs(lrn: Learner, samples: list[Sample], pad_id: int) -> Batch:
    """The update's batch: old log-probs from the (unpacked) pass, a reference near them, GRPO
    advantages (group-normalised rewards on every response token)."""
    batch = samples_to_batch(samples, pad_id)
    old = lrn.compute_log_prob(batch)["old_log_probs"]
    rewards = batch["rewards"].view(-1, G)
    adv = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)
    adv = adv.reshape(-1, 1) * batch["response_mask"]
    return batch | Batch({"old_log_probs": old, "ref_log_probs": old, "advantages": adv})


def naive_update(lrn: Learner, batch: Batch) -> dict[str, float]:
    """The update with every row of a mini-batch at the batch's full width (no grouping, no
    trimming), micro-batches of as many rows as the token budget holds; otherwise as
    ``run_updates`` at world size 1."""
    a = lrn.cfg.actor
    lrn.model.train()
    fed = real = 0
    per_mb = max(1, a.micro_batch_tokens // batch["input_ids"].shape[1])
    for rows in minibatch_rows(len(batch), lrn.actor.shuffle, a.ppo_minibatch_size):
        mini = batch.index(rows)
        lrn.optimizer.zero_grad(set_to_none=True)
        totals = global_totals(mini, lrn.cfg.loss_norm_len)
        for mb in mini.split(per_mb):
            loss, _ = lrn.policy_loss(mb, totals)
            loss.backward()
            fed += mb["input_ids"].numel()
            real += int(mb["attention_mask"].sum())
        clip_grad_norm(lrn.model, a.grad_clip)
        lrn.optimizer.step()
    return {"perf/padding_fraction": 1 - real / fed}


def timed_update(lrn: Learner, batch: Batch, setting: str, start: dict) -> tuple[float, dict]:
    """(seconds, metrics) of one update from the weights and optimizer state in ``start``."""
    lrn.model.load_state_dict(start["model"])
    lrn.optimizer.load_state_dict(start["optimizer"])
    lrn.actor.shuffle.set_state(start["shuffle"])
    lrn.cfg.actor.packing = setting == "packed"
    t0 = time.perf_counter()
    metrics = naive_update(lrn, batch) if setting == "naive" else lrn.update_actor(batch)
    return time.perf_counter() - t0, metrics


def run_workload(name: str, steps: int, reps: int, ranks: int = 2, rows: int = 64) -> dict:
    overrides = [*COMMON, *WORKLOADS[name], f"actor.ppo_minibatch_size={rows}"]
    cfg = load_config(Config, None, overrides)
    ctx = WorkerContext(rank=0, world_size=1, role="learner", pool="bench", num_threads=1)
    lrn = Learner(ctx, cfg, None)
    task, tokenizer = make_task(cfg), lrn.tokenizer
    # every update starts from these weights and a fresh AdamW state (it has taken no step yet)
    start = {"model": {k: v.clone() for k, v in lrn.model.state_dict().items()}}
    start |= {"optimizer": lrn.optimizer.state_dict(), "shuffle": lrn.actor.shuffle.get_state()}
    pad: dict[str, list[float]] = {s: [] for s in SETTINGS}
    kinds = ("balanced", "balanced_without_swaps", "unbalanced")
    imb: dict[str, list[float]] = {k: [] for k in kinds}
    per_mini: dict[str, list[float]] = {k: [] for k in kinds}
    secs: dict[str, list[float]] = {s: [] for s in SETTINGS}
    diffs: dict[str, float] = {s: 0.0 for s in SETTINGS[1:]}
    lengths = []
    for step in range(steps):
        samples = step_samples(cfg, task, tokenizer, step)
        lengths += [len(s.prompt_ids) + len(s.response_ids) for s in samples]
        batch = update_inputs(lrn, samples, tokenizer.pad_token_id)
        minis = first_epoch_minibatches(len(batch), lrn.actor.shuffle, cfg.actor.ppo_minibatch_size)
        for key in kinds:
            # the baseline without the swaps that even a greedy fill (batch_balance.evened)
            evened = batch_balance.evened
            if key == "balanced_without_swaps":
                batch_balance.evened = lambda sets, lengths: sets
            try:
                metrics = balance_for_ranks(batch, ranks, key != "unbalanced", minis)[1]
            finally:
                batch_balance.evened = evened
            imb[key].append(metrics["perf/dp_token_imbalance"])
            per_mini[key].append(metrics["perf/dp_token_imbalance_minibatch"])
        after: dict[str, dict] = {}
        plan = [s for k in range(reps) for s in (SETTINGS if k % 2 == 0 else SETTINGS[::-1])]
        for setting in plan:
            seconds, metrics = timed_update(lrn, batch, setting, start)
            secs[setting].append(seconds)
            if setting not in after:
                pad[setting].append(metrics["perf/padding_fraction"])
                after[setting] = {k: v.clone() for k, v in lrn.model.state_dict().items()}
        for other in SETTINGS[1:]:
            d = max((after["packed"][k] - after[other][k]).abs().max().item() for k in after[other])
            diffs[other] = max(diffs[other], d)
    median = {s: statistics.median(v) for s, v in secs.items()}
    return {
        "sequence_length": {
            "mean": round(statistics.fmean(lengths), 1),
            "p50": sorted(lengths)[len(lengths) // 2],
            "max": max(lengths),
        },
        "padding_fraction": {s: round(statistics.fmean(v), 4) for s, v in pad.items()},
        f"dp_imbalance_{ranks}_ranks": {k: round(statistics.fmean(v), 4) for k, v in imb.items()},
        f"dp_imbalance_{ranks}_ranks_per_minibatch": {
            k: round(statistics.fmean(v), 4) for k, v in per_mini.items()
        },
        "update_median_s": {s: round(v, 4) for s, v in median.items()},
        "update_speedup_vs_unpacked": round(median["grouped"] / median["packed"], 3),
        "update_speedup_vs_naive": round(median["naive"] / median["packed"], 3),
        "max_abs_weight_diff_vs_packed": {k: float(f"{v:.3g}") for k, v in diffs.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=3, help="batches per workload")
    ap.add_argument("--reps", type=int, default=5, help="timed updates per setting and batch")
    ap.add_argument("--workloads", nargs="*", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--ranks", type=int, default=2, help="data-parallel ranks to balance over")
    ap.add_argument("--minibatch-rows", type=int, default=64, help="actor.ppo_minibatch_size")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = {
        "steps": args.steps,
        "reps": args.reps,
        "ranks": args.ranks,
        "minibatch_rows": args.minibatch_rows,
        "threads": 1,
        "commit": subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
    }
    for name in args.workloads:
        out[name] = run_workload(name, args.steps, args.reps, args.ranks, args.minibatch_rows)
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
