"""Routing replay on W1 with tiny_moe: how far the trainer's log-probs are from the rollout's, with
and without replaying the rollout's routing. Prints one JSON object.

Setup: a short SFT warm start of ``tiny_moe`` (``--sft-steps``, fixed: not the target-based one),
then ``--steps`` GRPO steps (``moe.routing_replay=r3``) with the learner of the framework. The
rollout is the ``hf`` backend on a **bf16 copy** of the policy (weights synced from the fp32 learner
before every step), the training forwards run in fp32: the precision gap that makes routing differ
between rollout and trainer in real deployments (a GPU rollout in bf16, fp32 or mixed training).

Per step, on the step's samples and the weights that generated them (before the update):

* ``mismatch_none``: mean |log p_train - log p_rollout| over response tokens, the trainer routing
  afresh (the baseline, measured in the same run);
* ``mismatch_r3``: the same with the rollout's routing replayed (what R3 trains with);
* ``routing_diff_none``: the fraction of (token, layer) pairs whose fresh top-k set differs from the
  one the rollout recorded.

Reported: the means over the steps (and over the last 10), accuracy of the samples, wall time.

    .venv/bin/python bench/moe.py --steps 60
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from hybridrl.config import Config, load_config  # noqa: E402
from hybridrl.controller import WorkerContext  # noqa: E402
from hybridrl.learner import Learner  # noqa: E402
from hybridrl.learner.logprob import batch_log_probs  # noqa: E402
from hybridrl.learner.moe import REPLAY, ROUTING  # noqa: E402
from hybridrl.moe.routing import record, same_sets  # noqa: E402
from hybridrl.protocol import Batch, prompt_sample, samples_to_batch  # noqa: E402
from hybridrl.rollout.backends.hf import HFRollout  # noqa: E402
from hybridrl.rollout.base import SamplingParams  # noqa: E402
from hybridrl.tasks import REWARDS, TASKS  # noqa: E402


def warm_start(cfg: Config, steps: int, out: str) -> str:
    """A fixed-step SFT warm start in ``out`` (one already there with the same steps is reused)."""
    from hybridrl.driver.sft import run_sft

    done = Path(out) / "sft.json"
    if done.exists() and json.loads(done.read_text()).get("steps") == steps:
        return out
    cfg.sft.steps = steps
    return str(run_sft(cfg, out, progress=False))


def fresh_routing_diff(model, batch: Batch) -> float:
    """The fraction of (real token, layer) pairs whose fresh top-k set differs from the recorded."""
    attn = batch["attention_mask"]
    with record(model) as rec, torch.no_grad():
        model(
            input_ids=batch["input_ids"],
            attention_mask=attn,
            position_ids=(attn.cumsum(-1) - 1).clamp(min=0),
            use_cache=False,
        )
    fresh = rec.forwards()[0].view(*attn.shape, *rec.forwards()[0].shape[1:]).long()
    recorded = batch[ROUTING].long()
    valid = (recorded >= 0).all(-1) & attn.bool()[..., None]
    return float((~same_sets(fresh[valid], recorded[valid])).float().mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--sft-steps", type=int, default=300)
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step")
    ap.add_argument("--samples", type=int, default=4, help="samples per prompt")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workdir", default="runs/bench_moe")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    n = args.prompts * args.samples
    cfg = load_config(
        Config,
        None,
        [
            "model.name=tiny_moe",
            "rollout.backend=hf",
            "moe.routing_replay=r3",
            f"trainer.prompts_per_step={args.prompts}",
            f"trainer.samples_per_prompt={args.samples}",
            f"actor.ppo_minibatch_size={n}",
            "actor.lr=1e-4",
            "algorithm.kl_coef=0.001",
        ],
    )
    path = warm_start(cfg, args.sft_steps, os.path.join(args.workdir, "warmstart"))
    sft_s = time.perf_counter() - t0
    ctx = WorkerContext(rank=0, world_size=1, role="learner", pool="p", num_threads=args.threads)
    learner = Learner(ctx, cfg, path)
    task = TASKS.get("arith")(seed=0)
    reward = REWARDS.get("exact_match")
    tok = learner.tokenizer
    # the rollout's own bf16 copy of the policy
    rollout = HFRollout(
        type(learner.model)(learner.model.config).to(torch.bfloat16), tok, cfg.rollout
    )
    rows = []
    for step in range(args.steps):
        rollout.update_weights(list(learner.model.named_parameters()), version=step)
        prompts = [
            prompt_sample(task.prompt(step * args.prompts + i), tok) for i in range(args.prompts)
        ]
        params = SamplingParams.of(cfg.rollout, n=args.samples, seed=step)
        samples = rollout.generate(prompts, params)
        for s in samples:
            text = tok.decode(s.response_ids, skip_special_tokens=True)  # as the scorer does
            finished = s.status == "finished"
            s.reward = float(reward(s.metadata["prompt"], text, finished=finished))
            s.reward_extras = {"reward_errors": 0.0}  # what the rollout scorer adds
        batch = samples_to_batch(samples, tok.pad_token_id)
        mask = batch["response_mask"].bool()
        budget = cfg.actor.micro_batch_tokens
        gap = {}
        for mode, flag in (("none", 0), ("r3", 1)):
            marked = batch | Batch({REPLAY: torch.full((len(batch),), flag)})
            logp = batch_log_probs(learner.model, marked, budget, learner.sampling)
            gap[mode] = float((logp - batch["rollout_log_probs"])[mask].abs().mean())
        diff = fresh_routing_diff(learner.model, batch)
        learner.train_step(step, samples)
        rows.append(
            {
                "mismatch_none": gap["none"],
                "mismatch_r3": gap["r3"],
                "routing_diff_none": diff,
                "reward": float(batch["rewards"].mean()),
            }
        )

    def mean(key, part):
        return sum(r[key] for r in part) / max(len(part), 1)

    last = rows[-10:]
    keys = ("mismatch_none", "mismatch_r3", "routing_diff_none")
    print(
        json.dumps(
            {
                "bench": "moe_routing_replay",
                "model": "tiny_moe (Qwen3-MoE, 8 experts, top-2), fp32 training, bf16 hf rollout",
                "steps": args.steps,
                "sft_steps": args.sft_steps,
                "samples_per_step": n,
                "replay": {k: mean(k, rows) for k in keys},
                "replay_last10": {k: mean(k, last) for k in keys},
                "reward_first10": mean("reward", rows[:10]),
                "reward_last10": mean("reward", last),
                "per_step": rows,
                "sft_seconds": sft_s,
                "wall_seconds": time.perf_counter() - t0,
                "threads": args.threads,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
