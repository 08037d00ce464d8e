"""Supervised warm start: next-token loss on correct examples (answer and ``<eos>`` only).

A random model earns no reward, so RL starts from here. The result is a
transformers checkpoint cached under a path derived from the settings, so a
second ``make train`` starts RL at once.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from hybridrl.config import Config, to_dict
from hybridrl.protocol import pad_2d
from hybridrl.training.logprob import length_buckets
from hybridrl.workers.common import load_model, make_task


def warm_start_path(cfg: Config) -> Path:
    if cfg.sft.checkpoint:
        return Path(cfg.sft.checkpoint)
    key = {"model": to_dict(cfg.model), "task": cfg.task.name, "sft": {k: v for k, v in to_dict(cfg.sft).items() if k not in ("checkpoint", "enabled")}}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
    return Path("checkpoints") / "warmstart" / f"{cfg.task.name}-{cfg.model.name if not cfg.model.path else 'custom'}-{digest}"


def sft_batch(task, tokenizer, start: int, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, labels) with labels -100 except on the completion and ``<eos>``."""
    rows, labels = [], []
    for i in range(start, start + size):
        prompt, completion = task.sft_example(i)
        p = tokenizer(prompt)["input_ids"]
        c = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(p + c)
        labels.append([-100] * len(p) + c)
    ids = pad_2d(rows, tokenizer.pad_token_id, torch.long)
    return ids, pad_2d([[1] * len(r) for r in rows], 0, torch.long), pad_2d(labels, -100, torch.long)


def lr_factor(step: int, total: int, warmup: int = 20, decay_frac: float = 0.2) -> float:
    """Warmup, constant, then a linear decay to 10% over the last ``decay_frac`` of the steps."""
    decay_start = int(total * (1 - decay_frac))
    if step < warmup:
        return (step + 1) / warmup
    if step < decay_start:
        return 1.0
    return 1.0 - 0.9 * (step - decay_start) / max(1, total - decay_start)


def run_sft(cfg: Config, out_dir: str | Path | None = None, progress: bool = True) -> Path:
    """Train, then write the checkpoint atomically (temporary directory renamed when complete)."""
    out = Path(out_dir) if out_dir else warm_start_path(cfg)
    task = make_task(cfg)
    model, tokenizer = load_model(cfg, cfg.model.path)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft.lr, betas=(0.9, 0.98), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg.sft.steps))
    model.train()
    t0, losses = time.perf_counter(), []
    bar = tqdm(range(cfg.sft.steps), desc="warm start (SFT)", disable=not progress, dynamic_ncols=True)
    for step in bar:
        ids, attn, labels = sft_batch(task, tokenizer, step * cfg.sft.batch_size, cfg.sft.batch_size)
        n_labels, lengths, loss = (labels[:, 1:] != -100).sum(), attn.sum(-1), 0.0
        opt.zero_grad(set_to_none=True)
        for rows in length_buckets(lengths, cfg.actor.micro_batch_tokens):  # similar lengths together, cut to the longest
            w = int(lengths[rows].max())
            logits = model(input_ids=ids[rows, :w], attention_mask=attn[rows, :w], use_cache=False).logits[:, :-1]
            part = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[rows, 1:w].reshape(-1), ignore_index=-100,
                                   reduction="sum") / n_labels
            part.backward()
            loss += part.item()
        opt.step()
        sched.step()
        losses.append(loss)
        bar.set_postfix(loss=f"{loss:.3f}")
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "sft.json").write_text(json.dumps({"steps": cfg.sft.steps, "final_loss": losses[-1] if losses else None,
                                               "seconds": time.perf_counter() - t0}, indent=1))
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def ensure_warm_start(cfg: Config, progress: bool = True) -> str | None:
    """The checkpoint RL starts from: the cached warm start (trained on first use), or ``model.path``."""
    if not cfg.sft.enabled:
        return cfg.model.path
    path = warm_start_path(cfg)
    if not (path / "config.json").is_file():
        run_sft(cfg, path, progress)
    return str(path)
