"""Fit a speculative-decoding draft to its target: forward KL on the target's own samples.

Rejection-sampling speculation (Leviathan et al. 2211.17192, Chen et al. 2302.01318) accepts a
proposal with probability sum_x min(p(x), q(x)) = 1 - TV(p, q) per token, where p is the target's
and q the draft's distribution at that position. A draft warm-started on the task alone
agrees with the target only where both got the task right; distilling it on the
positions speculation will meet (prompts of the task, responses the target
samples) raises that agreement directly. The loss is KL(p || q) over the
response positions, both distributions under the sampling temperature, with
the target's full distribution as the soft label (DistillSpec-style; the output
distribution of speculative sampling stays exactly the target's whatever the
draft, only the speed changes).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from hybridrl.config import RolloutConfig
from hybridrl.driver.sft import lr_factor
from hybridrl.protocol import Sample, pad_2d
from hybridrl.rollout import SamplingParams


def agreement(lp: torch.Tensor, lq: torch.Tensor) -> torch.Tensor:
    """Per-position probability that speculative sampling accepts a proposal: sum_x min(p(x), q(x)),
    from log-probabilities over the last dimension."""
    return torch.minimum(lp, lq).exp().sum(-1)


def sample_responses(
    target, tokenizer, prompts: list[list[int]], temperature: float, max_new_tokens: int, seed: int
) -> list[tuple[list[int], list[int]]]:
    """(prompt, response) pairs sampled from ``target`` with the native engine (eos honoured)."""
    from hybridrl.rollout.backends.native import NativeRollout

    eng = NativeRollout(
        target, tokenizer, RolloutConfig(backend="native", backend_options={"max_batch_size": 256})
    )
    params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)
    out = eng.generate([Sample(prompt_ids=p, uid=f"d{i}") for i, p in enumerate(prompts)], params)
    eng.release_memory()
    return [(s.prompt_ids, s.response_ids) for s in out]


def _batch(pairs, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, mask) where mask[:, t] marks positions t whose next token is a
    response token."""
    rows = [p + r for p, r in pairs]
    mask = [[0.0] * (len(p) - 1) + [1.0] * len(r) for p, r in pairs]
    return (
        pad_2d(rows, pad_id, torch.long),
        pad_2d([[1] * len(x) for x in rows], 0, torch.long),
        pad_2d(mask, 0.0, torch.float),
    )


def _log_probs(model, ids, attn, temperature: float) -> torch.Tensor:
    return F.log_softmax(
        model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1].float()
        / temperature,
        -1,
    )


def distill_draft(
    target,
    draft,
    tokenizer,
    prompts: list[list[int]],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    temperature: float = 1.0,
    max_new_tokens: int = 16,
    seed: int = 0,
    progress: bool = False,
) -> dict:
    """Train ``draft`` in place towards ``target`` for ``steps`` optimizer steps of ``batch_size``
    sampled sequences each (``steps * batch_size`` prompts are needed). Returns the loss and the
    agreement (mean per-token acceptance probability) on the first and on the last batch, each
    measured before the update on that batch, and the seconds spent. Temperature is modelled;
    top-k / top-p truncation is not."""
    if not temperature > 0:
        raise ValueError(
            f"distill_draft: temperature must be > 0, got {temperature} "
            "(a draft for greedy rollouts is checked by exact argmax match; "
            "distil it at temperature 1)"
        )
    if steps < 1 or batch_size < 1:
        raise ValueError(
            f"distill_draft: steps and batch_size must be >= 1, got {steps} and {batch_size}"
        )
    if len(prompts) < steps * batch_size:
        raise ValueError(
            f"distill_draft: {steps} steps x {batch_size} sequences need "
            f"{steps * batch_size} prompts, got {len(prompts)}"
        )
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"distill_draft: the draft's vocabulary ({draft.config.vocab_size}) differs from the "
            f"target's ({target.config.vocab_size})"
        )
    t0 = time.perf_counter()
    pairs = sample_responses(
        target, tokenizer, prompts[: steps * batch_size], temperature, max_new_tokens, seed
    )
    target.eval()
    draft.train()
    opt = torch.optim.AdamW(draft.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, steps, warmup=min(20, max(1, steps // 10)))
    )
    history = []
    for step in tqdm(
        range(steps), desc="draft distillation", disable=not progress, dynamic_ncols=True
    ):
        ids, attn, mask = _batch(
            pairs[step * batch_size : (step + 1) * batch_size], tokenizer.pad_token_id
        )
        with torch.no_grad():
            lp = _log_probs(target, ids, attn, temperature)
        lq = _log_probs(draft, ids, attn, temperature)
        n = mask.sum().clamp(min=1)
        # 0 where the target gives p = 0
        kl = torch.where(lp.isfinite(), lp.exp() * (lp - lq), 0.0).sum(-1)
        loss = (kl * mask).sum() / n
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        history.append((loss.item(), float((agreement(lp, lq.detach()) * mask).sum() / n)))
    draft.eval()
    return {
        "kl_first": history[0][0],
        "kl_last": history[-1][0],
        "agreement_first": history[0][1],
        "agreement_last": history[-1][1],
        "samples": len(pairs),
        "seconds": time.perf_counter() - t0,
    }
