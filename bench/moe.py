"""Mixture of experts on W1 with tiny_moe: routing replay's effect on the rollout-vs-training
log-prob mismatch, and the native engine's speed against transformers. Prints one JSON object.

``replay`` (GRPO with ``moe.routing_replay=r3``, the configuration of
``examples/arith_grpo_moe.yaml`` and its cached warm start): before every step the policy's fp32
weights are synced to the rollouts, each generates the step's prompts, and on each rollout's
samples, with the weights that generated them, the fp32 trainer computes

* ``mismatch_none``: mean |log p_train - log p_rollout| over response tokens, routing afresh (the
  baseline of the same run);
* ``mismatch_r3``: the same with the rollout's recorded routing replayed. The routing is then the
  rollout's, so what remains is arithmetic: the **precision part** of the gap;
* ``routing_part``: ``mismatch_none - mismatch_r3``, what replay removes;
* ``routing_effect``: mean |log p_train(fresh routing) - log p_train(replayed)|, both in the
  trainer, the log-prob change that the routing differences alone cause;
* ``routing_diff_none``: the fraction of (token, layer) pairs whose fresh top-k set differs from the
  recorded one; ``max_none`` / ``max_r3``: the largest |Δ log p| of the step;
* ``outside_clip_none`` / ``outside_clip_r3``: the fraction of response tokens whose ratio
  p_train / p_rollout alone leaves the clip range [1 - clip_ratio_low, 1 + clip_ratio_high]: the
  outliers that clipping and importance ratios see before the policy has moved at all.

Rollouts (all the native engine, which records routing per KV slot): ``bf16`` (weights and KV cache
in bf16: a GPU rollout against fp32 training; its samples are the ones GRPO trains on) and ``fp32``
(the same arithmetic precision as the trainer, different kernels). ``--bias-noise EPS`` adds a
third, labelled *artificial*: the fp32 engine with a fixed random expert bias, N(0, EPS) per expert
and layer, that shifts the *selection* only (the dispatch weights stay the router's, as with
``moe.bias_update_rate``): a rollout that differs from the trainer in routing and in nothing else,
so its ``mismatch_none`` is all routing part.

``--trainer-precision bf16`` runs the trainer's forwards under bf16 autocast over its fp32 weights
(``fsdp.mixed_precision=bf16``, what mixed-precision trainers do), so that both sides round the
same weights to bf16 and differ in kernels and in where activations are rounded.

``--policy DIR`` starts from a given transformers checkpoint (e.g. ``hybridrl export`` of the MoE
example's final step) instead of the example's warm start.

``--experts E --top-k K`` measures replay on a *fine-grained* variant of tiny_moe instead, the shape
of real MoE models (Qwen3-MoE-30B-A3B: 128 experts, top-8; OLMoE: 64, top-8): same hidden size,
layers and attention, E experts of width 512 / K (``--moe-intermediate``), so the active MLP width
stays tiny_moe's. With many experts and k = 8 the k-th and (k+1)-th router scores lie closer, so
bf16 rounding may flip the selection more often. Its random init is saved in ``--workdir`` and its
warm start is the example's SFT run on that checkpoint (same target, cached the same way).

``engine`` (``bench/moe_engine.py``): the native engine against the ``hf`` backend on tiny_moe in
fp32 (mixed lengths, ``engine.speedup_vs_hf``; ``fixed`` 32 x 8 x 128; dense ``tiny`` beside).
``ep`` (``--ep``): expert parallelism, from ``bench/moe_ep.py``'s ``run_ep()`` when that file exists
(otherwise the key says it was skipped).

    .venv/bin/python bench/moe.py --threads 1                  # replay, 60 steps, and engine
    .venv/bin/python bench/moe.py --skip-engine --steps 60     # replay only
    .venv/bin/python bench/moe.py --skip-engine --experts 64 --top-k 8   # fine-grained variant
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import Qwen3MoeForCausalLM  # noqa: E402

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

from hybridrl.config import Config, load_config  # noqa: E402
from hybridrl.controller import WorkerContext  # noqa: E402
from hybridrl.driver.sft import ensure_warm_start, run_sft  # noqa: E402
from hybridrl.learner import Learner  # noqa: E402
from hybridrl.learner.logprob import batch_log_probs  # noqa: E402
from hybridrl.learner.moe import REPLAY, ROUTING  # noqa: E402
from hybridrl.models.factory import model_size_config  # noqa: E402
from hybridrl.models.loading import make_task  # noqa: E402
from hybridrl.moe.routing import record, same_sets  # noqa: E402
from hybridrl.parallel.precision import autocast  # noqa: E402
from hybridrl.protocol import Batch, prompt_sample, samples_to_batch  # noqa: E402
from hybridrl.rollout.backends.native import NativeRollout  # noqa: E402
from hybridrl.sampling import SamplingParams  # noqa: E402
from hybridrl.tasks import REWARDS, TASKS  # noqa: E402

EXAMPLE = BENCH.parent / "examples" / "arith_grpo_moe.yaml"
KEYS = (
    "mismatch_none",
    "mismatch_r3",
    "routing_part",
    "routing_effect",
    "routing_diff_none",
    "max_none",
    "max_r3",
    "outside_clip_none",
    "outside_clip_r3",
)


def warm_start(cfg: Config, sft_steps: int | None, workdir: str) -> str:
    """The example's warm start (cached, shared with ``hybridrl train``), or a fixed-step one."""
    if sft_steps is None:
        return ensure_warm_start(cfg, progress=False)
    variant = f"{Path(cfg.model.path).name}-" if cfg.model.path else ""
    out = Path(workdir) / f"warmstart-{variant}{sft_steps}"
    done = out / "sft.json"
    if done.exists() and json.loads(done.read_text()).get("steps") == sft_steps:
        return str(out)
    cfg.sft.steps = sft_steps
    return str(run_sft(cfg, str(out), progress=False))


def fine_grained(cfg: Config, args) -> dict | None:
    """Point ``cfg.model.path`` at a fine-grained variant of tiny_moe (``--experts``, ``--top-k``),
    or leave it alone. Same hidden size, layers and attention; the expert width defaults to
    tiny_moe's active MLP width (2 x 256) divided by k, so active parameters stay the same while the
    router picks k of many experts, as Qwen3-MoE-30B-A3B (128, top-8) and OLMoE (64, top-8) do. The
    random init (``model.seed``) is saved in the workdir; the warm start is then the framework's
    own, cached under its path like any ``model.path``."""
    if not args.experts:
        return None
    base = model_size_config("tiny_moe", make_task(cfg).tokenizer())
    k = args.top_k
    width = args.moe_intermediate or base.num_experts_per_tok * base.moe_intermediate_size // k
    shape = {"num_experts": args.experts, "num_experts_per_tok": k, "moe_intermediate_size": width}
    out = Path(args.workdir).resolve() / f"tiny_moe-e{args.experts}-k{k}-i{width}-s{cfg.model.seed}"
    if not (out / "config.json").is_file():
        config = base  # a fresh object; setattr goes through the config's attribute map
        for key, value in shape.items():
            setattr(config, key, value)
        state = torch.random.get_rng_state()
        torch.manual_seed(cfg.model.seed)
        model = Qwen3MoeForCausalLM(config)
        torch.random.set_rng_state(state)
        model.save_pretrained(out)  # no tokenizer: the task's is used, as for tiny_moe
    cfg.model.path = str(out)
    return shape | {"norm_topk_prob": base.norm_topk_prob, "init": str(out)}


def warm_record(path: str) -> dict | None:
    """The warm start's ``sft.json`` (steps taken, accuracy reached), when it has one."""
    record = Path(path) / "sft.json"
    if not record.is_file():
        return None
    return {k: v for k, v in json.loads(record.read_text()).items() if k != "checks"}


def fresh_routing_diff(model, batch: Batch) -> float:
    """The fraction of (real token, layer) pairs whose fresh top-k set differs from the recorded."""
    attn = batch["attention_mask"]
    with record(model) as rec, torch.no_grad(), autocast(model):  # as the trainer's forwards
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


def measure(learner: Learner, batch: Batch, budget: int, clip: tuple[float, float]) -> dict:
    """The mismatch figures of one rollout's samples (module docstring); ``clip``: the ratio range
    in log space."""
    mask = batch["response_mask"].bool()
    logp = {}
    for mode, flag in (("none", 0), ("r3", 1)):
        marked = batch | Batch({REPLAY: torch.full((len(batch),), flag)})
        logp[mode] = batch_log_probs(learner.model, marked, budget, learner.actor.sampling)[mask]
    rollout = batch["rollout_log_probs"][mask]
    gap = {mode: (lp - rollout).abs() for mode, lp in logp.items()}
    outside = {
        mode: ((lp - rollout < clip[0]) | (lp - rollout > clip[1])) for mode, lp in logp.items()
    }
    return {
        "mismatch_none": float(gap["none"].mean()),
        "mismatch_r3": float(gap["r3"].mean()),
        "routing_part": float(gap["none"].mean() - gap["r3"].mean()),
        "routing_effect": float((logp["none"] - logp["r3"]).abs().mean()),
        "routing_diff_none": fresh_routing_diff(learner.model, batch),
        "max_none": float(gap["none"].max()),
        "max_r3": float(gap["r3"].max()),
        "outside_clip_none": float(outside["none"].float().mean()),
        "outside_clip_r3": float(outside["r3"].float().mean()),
    }


def expert_biases(named: list, eps: float) -> list:
    """A fixed random expert bias N(0, eps) for every router (the artificial rollout): sent by
    weight sync like the trainer's balancing bias, it moves the selection only."""
    gen = torch.Generator().manual_seed(0)
    return [
        (n.removesuffix("weight") + "expert_bias", eps * torch.randn(p.shape[0], generator=gen))
        for n, p in named
        if n.endswith("mlp.gate.weight")
    ]


def summary(rows: list[dict]) -> dict:
    def mean(part: list[dict], key: str) -> float:
        return sum(r[key] for r in part) / max(len(part), 1)

    out = {}
    for name, part in (("all", rows), ("first10", rows[:10]), ("last10", rows[-10:])):
        m = {k: mean(part, k) for k in KEYS}
        m["max_none"] = max(r["max_none"] for r in part)
        m["max_r3"] = max(r["max_r3"] for r in part)
        m["outside_clip_cut"] = m["outside_clip_none"] / max(m["outside_clip_r3"], 1e-12)
        m["cut"] = m["mismatch_none"] / max(m["mismatch_r3"], 1e-12)  # none / r3
        m["precision_share"] = m["mismatch_r3"] / max(m["mismatch_none"], 1e-12)
        out[name] = m
    return out


def replay(args) -> dict:
    t0 = time.perf_counter()
    overrides = [
        f"trainer.prompts_per_step={args.prompts}",
        f"trainer.samples_per_prompt={args.samples}",
        f"fsdp.mixed_precision={args.trainer_precision}",
    ]
    cfg = load_config(Config, str(EXAMPLE), overrides)
    variant = None if args.policy else fine_grained(cfg, args)
    path = args.policy or warm_start(cfg, args.sft_steps, args.workdir)
    sft_s = time.perf_counter() - t0
    ctx = WorkerContext(rank=0, world_size=1, role="learner", pool="p", num_threads=args.threads)
    learner = Learner(ctx, cfg, path)
    task = TASKS.get(cfg.task.name)(seed=0)
    reward = REWARDS.get(cfg.task.reward_fn)
    tok = learner.tokenizer
    rollouts = {
        name: NativeRollout(
            learner.model, tok, dataclasses.replace(cfg.rollout, backend_options={"dtype": dtype})
        )
        for name, dtype in (("bf16", "bf16"), ("fp32", "fp32"))
    }
    if args.bias_noise > 0:
        rollouts["fp32_bias_noise"] = NativeRollout(
            learner.model, tok, dataclasses.replace(cfg.rollout, backend_options={"dtype": "fp32"})
        )
    model = (
        "tiny_moe (Qwen3-MoE, 8 experts, top-2)"
        if variant is None
        else f"tiny_moe's fine-grained variant (Qwen3-MoE, {variant['num_experts']} experts, "
        f"top-{variant['num_experts_per_tok']}, width {variant['moe_intermediate_size']})"
    )
    a = cfg.algorithm
    clip = (math.log(1 - a.clip_ratio_low), math.log(1 + a.clip_ratio_high))
    rows: dict[str, list[dict]] = {name: [] for name in rollouts}
    rewards = []
    for step in range(args.steps):
        named = [(n, p.detach()) for n, p in learner.model.named_parameters()]
        biased = named + expert_biases(named, args.bias_noise)
        prompts = [
            prompt_sample(task.prompt(step * args.prompts + i), tok) for i in range(args.prompts)
        ]
        params = SamplingParams.of(cfg, n=args.samples, seed=step)
        trained = None
        for name, rollout in rollouts.items():
            rollout.update_weights(biased if name == "fp32_bias_noise" else named, step)
            samples = rollout.generate(prompts, params)
            for s in samples:
                text = tok.decode(s.response_ids, skip_special_tokens=True)  # as the scorer does
                finished = s.status == "finished"
                s.reward = float(reward(s.metadata["prompt"], text, finished=finished))
                s.reward_extras = {"reward_errors": 0.0}  # what the rollout scorer adds
            batch = samples_to_batch(samples, tok.pad_token_id)
            rows[name].append(measure(learner, batch, cfg.actor.micro_batch_tokens, clip))
            if name == "bf16":
                trained = samples
                rewards.append(float(batch["rewards"].mean()))
        learner.train_step(step, trained)  # GRPO with R3 on the bf16 rollout's samples
        bf16 = rows["bf16"][-1]
        print(  # progress on stderr; the JSON on stdout
            f"step {step + 1}/{args.steps} {time.perf_counter() - t0:.0f}s bf16 mismatch "
            f"{bf16['mismatch_none']:.5f} -> {bf16['mismatch_r3']:.5f}",
            file=sys.stderr,
            flush=True,
        )
    return {
        "setup": (
            f"W1 (examples/arith_grpo_moe.yaml), {model}, GRPO + R3, "
            f"{args.trainer_precision} training forwards; native-engine rollouts; trained on the "
            "bf16 rollout's samples"
        ),
        "steps": args.steps,
        "fine_grained": variant,
        "warm_start": path,
        "warm_start_record": warm_record(path),
        "samples_per_step": args.prompts * args.samples,
        "bias_noise": args.bias_noise,
        "rollouts": {name: summary(r) for name, r in rows.items()},
        "reward_first10": sum(rewards[:10]) / max(len(rewards[:10]), 1),
        "reward_last10": sum(rewards[-10:]) / max(len(rewards[-10:]), 1),
        "per_step": {name: r for name, r in rows.items()},
        "sft_seconds": sft_s,
        "seconds": time.perf_counter() - t0,
    }


def engine(quick: bool, repeats: int) -> dict:
    from moe_engine import run_all

    return run_all(quick, repeats)


def expert_parallel() -> dict:
    """``bench/moe_ep.py``'s figures, or why there are none."""
    if importlib.util.find_spec("moe_ep") is None:
        return {"skipped": "bench/moe_ep.py is not in this checkout"}
    from moe_ep import run_ep

    return run_ep()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument(
        "--sft-steps",
        type=int,
        default=None,
        help="a fixed-step warm start (default: the example's)",
    )
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step")
    ap.add_argument("--samples", type=int, default=4, help="samples per prompt")
    ap.add_argument("--bias-noise", type=float, default=0.0, help="the artificial rollout's EPS")
    ap.add_argument("--policy", default="", help="start from this checkpoint (default: warm start)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--experts",
        type=int,
        default=0,
        help="replay on a fine-grained variant of tiny_moe with this many experts (0: tiny_moe)",
    )
    ap.add_argument("--top-k", type=int, default=8, help="the variant's experts per token")
    ap.add_argument(
        "--moe-intermediate",
        type=int,
        default=0,
        help="the variant's expert width (0: tiny_moe's active width 512 / k)",
    )
    ap.add_argument(
        "--trainer-precision",
        choices=("fp32", "bf16"),
        default="fp32",
        help="the trainer's forwards: fp32, or bf16 autocast (fsdp.mixed_precision)",
    )
    ap.add_argument("--workdir", default="runs/bench_moe")
    ap.add_argument("--quick", action="store_true", help="a smoke run of the engine scenarios")
    ap.add_argument("--repeats", type=int, default=2, help="engine runs per scenario (fastest)")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--skip-replay", action="store_true")
    ap.add_argument("--ep", action="store_true", help="also run bench/moe_ep.py (key 'ep')")
    ap.add_argument("--out", default="", help="also write the JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out: dict = {"bench": "moe", "threads": args.threads, "torch": torch.__version__}
    if not args.skip_replay:
        out["replay"] = replay(args)
    if not args.skip_engine:
        out |= engine(args.quick, args.repeats)
    if args.ep:
        out["ep"] = expert_parallel()
    text = json.dumps(out, indent=1, default=float)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
