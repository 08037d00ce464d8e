"""Supervised warm start: next-token loss on correct examples (answer and ``<eos>`` only).

A random model earns no reward, so RL starts from here. The warm start stops on a held-out target,
not after a fixed number of steps: the loss falls steeply once the model starts to learn the task,
and where a fixed step count lands on that slope depends on the low bits of the CPU's matmul kernels
(the same 300 steps gave 41% sampled accuracy on one machine and 3% on another). So every
``sft.eval_every`` steps it measures sampled (T = 1) accuracy on held-out prompts and stops at the
first check that reaches ``sft.target_accuracy``, which is set below 1 so that RL has room to gain;
``sft.max_steps`` caps it (with a warning). ``sft.steps`` instead trains a fixed number of steps
without any check.

With ``actor.packing`` the examples of a step are packed into rows (``parallel/packing.py``) instead
of grouped by length: the same loss and gradients with less padding.

The result is a transformers checkpoint cached under a path derived from the settings, so a second
``make train`` starts RL at once; its ``sft.json`` records the steps taken and the accuracy reached.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from hybridrl.config import Config, to_dict
from hybridrl.config.sections.common import ALL_LINEAR
from hybridrl.data.files import as_paths
from hybridrl.data.fingerprint import path_sha256
from hybridrl.data.sft_examples import read_sft_examples
from hybridrl.data.source import seeded_rng
from hybridrl.learner.logprob import length_buckets
from hybridrl.learner.lora import ADAPTER_DIR, LoraSettings, apply_lora
from hybridrl.models import save_model_dir
from hybridrl.models.loading import load_model, make_task
from hybridrl.parallel.packing import attention_key_cost, pack_micro_batches, packed_forward
from hybridrl.protocol import pad_2d
from hybridrl.rollout import SamplingParams

log = logging.getLogger(__name__)

# the check's sampling seed is trainer.seed + this (RL's evaluation uses + 10_000)
CHECK_SEED_OFFSET = 20_000


def warm_start_path(cfg: Config) -> Path:
    if cfg.sft.checkpoint:
        return Path(cfg.sft.checkpoint)
    digest = hashlib.sha256(json.dumps(cache_key(cfg), sort_keys=True).encode()).hexdigest()[:10]
    files = cfg.sft.train_files
    source = Path(files if isinstance(files, str) else files[0]).stem if files else cfg.task.name
    model = cfg.model.name if not cfg.model.path else Path(cfg.model.path).name or "custom"
    return Path("checkpoints") / "warmstart" / f"{source}-{model}-{digest}"


def cache_key(cfg: Config) -> dict:
    """Everything the warm start's weights depend on: the model, the task and its SFT stream
    (``trainer.seed``), the ``sft`` settings and, when it stops on accuracy, what the check
    generates and scores."""
    key = {
        "model": to_dict(cfg.model),
        "task": cfg.task.name,
        "seed": cfg.trainer.seed,
        "sft": {k: v for k, v in to_dict(cfg.sft).items() if k not in ("checkpoint", "enabled")},
    }
    if cfg.sft.train_files:  # the data's bytes, and how its prompts are rendered
        files = {"sft.train_files": cfg.sft.train_files, "sft.val_files": cfg.sft.val_files}
        key["data"] = {k: [path_sha256(p) for p in as_paths(f, k)] for k, f in files.items() if f}
        key["render"] = [cfg.data.apply_chat_template, cfg.data.system_prompt]
    elif cfg.sft.steps is None:
        key["check"] = {
            "reward_fn": to_dict(cfg.task.reward_fns()),  # a callable by its module:name
            "heldout_size": cfg.task.heldout_size,
            "max_new_tokens": cfg.rollout.max_new_tokens,
        }
    return key


def sft_batch(
    task, tokenizer, start: int, size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[str]]:
    """(input_ids, attention_mask, labels, prompt texts) with labels -100 except on the completion
    and ``<eos>``. A task with ``sft_segments(i)`` (prompt, [(text, trained on), ...]) gives its
    completion in parts, each tokenised on its own as a multi-turn rollout does: an environment's
    observation is in the input but not in the loss."""
    rows, labels, texts = [], [], []
    segmented = getattr(task, "sft_segments", None)
    for i in range(start, start + size):
        if segmented:
            prompt, parts = segmented(i)
        else:
            prompt, completion = task.sft_example(i)
            parts = [(completion, True)]
        p, c, lab = tokenizer(prompt)["input_ids"], [], []
        for text, trained in parts:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            c, lab = c + ids, lab + (ids if trained else [-100] * len(ids))
        rows.append(p + c + [tokenizer.eos_token_id])
        labels.append([-100] * len(p) + lab + [tokenizer.eos_token_id])
        texts.append(prompt)
    ids = pad_2d(rows, tokenizer.pad_token_id, torch.long)
    return (
        ids,
        pad_2d([[1] * len(r) for r in rows], 0, torch.long),
        pad_2d(labels, -100, torch.long),
        texts,
    )


def lr_factor(step: int, total: int, warmup: int = 20, decay_frac: float = 0.2) -> float:
    """Warmup, constant, then a linear decay to 10% over the last ``decay_frac`` of the steps.

    With an accuracy target, ``total`` is the cap ``sft.max_steps``: a run that stops on the target
    stops in the constant phase (the stop point is unknown in advance), and only a run heading for
    the cap decays.
    """
    decay_start = int(total * (1 - decay_frac))
    if step < warmup:
        return (step + 1) / warmup
    if step < decay_start:
        return 1.0
    return 1.0 - 0.9 * (step - decay_start) / max(1, total - decay_start)


class HeldoutCheck:
    """Sampled (T = 1) accuracy of the live model on the task's held-out prompts, using only those
    that no SFT batch so far contained (so it measures the task, not recall), the first
    ``sft.eval_size`` of them in the held-out order. Every check samples with the same seed, so two
    checks differ by the weights alone. With an environment (``env.name``) each prompt is a whole
    episode with the environment, scored as the RL rollout scores it (``env_rewards``)."""

    def __init__(self, cfg: Config, task, tokenizer):
        from hybridrl.rollout.env_rewards import env_rewards
        from hybridrl.rollout.scoring import Scorer

        self.cfg, self.pool, self.size = cfg, task.heldout(), cfg.sft.eval_size
        self.tokenizer = tokenizer
        self.pool_texts = {p.text for p in self.pool}
        self.seen: set[str] = set()  # held-out prompt texts that appeared in an SFT batch
        self.scorer = env_rewards(cfg, Scorer(cfg, tokenizer))
        self.params = SamplingParams(
            temperature=1.0,
            max_new_tokens=cfg.rollout.max_new_tokens,
            n=1,
            seed=cfg.trainer.seed + CHECK_SEED_OFFSET,
        )
        self.seconds = 0.0

    def trained_on(self, texts: list[str]) -> None:
        self.seen.update(t for t in texts if t in self.pool_texts)

    def __call__(self, model) -> tuple[float, int]:
        """(accuracy, number of prompts it was measured on)."""
        from hybridrl.driver.evaluate import model_accuracy

        prompts = [p for p in self.pool if p.text not in self.seen][: self.size]
        if not prompts:
            raise RuntimeError(
                f"warm start: every one of the task's {len(self.pool)} held-out prompts appeared "
                "in an SFT batch, so none is left to check accuracy on; "
                "raise task.heldout_size or set sft.steps"
            )
        t0 = time.perf_counter()
        acc = model_accuracy(model, self.tokenizer, prompts, self.scorer, self.params, self.cfg)
        self.seconds += time.perf_counter() - t0
        return acc, len(prompts)


def length_grouped(model, ids, attn, labels, micro_batch_tokens: int):
    """(logits, targets) per micro-batch: similar lengths together, cut to the longest."""
    lengths = attn.sum(-1)
    for rows in length_buckets(lengths, micro_batch_tokens):
        w = int(lengths[rows].max())
        logits = model(input_ids=ids[rows, :w], attention_mask=attn[rows, :w], use_cache=False)
        yield logits.logits[:, :-1], labels[rows, 1:w]


def packed(model, ids, attn, labels, micro_batch_tokens: int):
    """(logits, targets) per micro-batch of packed rows: each position's target is the next token
    of its own example (-100 at an example's last token and on padding)."""
    following = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)
    key_cost = attention_key_cost(model)
    for plan in pack_micro_batches(attn.sum(-1).tolist(), micro_batch_tokens, key_cost=key_cost):
        docs = torch.tensor(plan.docs)
        a = attn[docs]
        rows, offsets = torch.tensor(plan.rows), torch.tensor(plan.offsets)
        logits, layout = packed_forward(model, ids[docs], a, rows, offsets, pad_id=0)
        yield logits, layout.scatter(following[docs], a, -100).view(logits.shape[:2])


# how a step's examples are cut into micro-batches, by actor.packing
MICRO_BATCHES = {False: length_grouped, True: packed}


def _train_step(
    model,
    opt,
    sched,
    ids,
    attn,
    labels,
    micro_batch_tokens: int,
    packing: bool = False,
    grad_clip: float = 0.0,
) -> float:
    n_labels, loss = (labels[:, 1:] != -100).sum(), 0.0
    opt.zero_grad(set_to_none=True)
    for logits, targets in MICRO_BATCHES[packing](model, ids, attn, labels, micro_batch_tokens):
        part = (
            F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]),
                targets.reshape(-1),
                ignore_index=-100,
                reduction="sum",
            )
            / n_labels
        )
        part.backward()
        loss += part.item()
    if grad_clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    opt.step()
    sched.step()
    return loss


class DataBatches:
    """The steps' batches of the user's SFT data (``sft.train_files``, read and checked at once):
    ``sft.batch_size`` examples each, through the rows in a new seeded order (``trainer.seed``)
    every epoch."""

    def __init__(self, cfg: Config, tokenizer):
        self.examples = read_sft_examples(cfg, tokenizer, "sft.train_files")
        self.size, self.seed = cfg.sft.batch_size, cfg.trainer.seed
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self._orders: dict[int, list[int]] = {}

    def steps(self, epochs: float) -> int:
        return max(1, math.ceil(epochs * len(self.examples) / self.size))

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[str]]:
        n = len(self.examples)
        rows = [self._order(i // n)[i % n] for i in range(step * self.size, (step + 1) * self.size)]
        return _padded(self.examples, rows, self.pad) + ([],)

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.examples)))
            seeded_rng("sft", self.seed, epoch).shuffle(order)
            self._orders = {epoch: order}
        return self._orders[epoch]


class ValLoss:
    """The loss (mean over the labelled tokens) of ``sft.val_files``, without gradients."""

    def __init__(self, cfg: Config, tokenizer):
        self.examples = read_sft_examples(cfg, tokenizer, "sft.val_files")
        self.cfg, self.pad = cfg, tokenizer.pad_token_id or 0

    @torch.no_grad()
    def __call__(self, model) -> float:
        total, count, a = 0.0, 0, self.cfg.actor
        model.eval()
        for start in range(0, len(self.examples), self.cfg.sft.batch_size):
            rows = range(start, min(start + self.cfg.sft.batch_size, len(self.examples)))
            ids, attn, labels = _padded(self.examples, rows, self.pad)
            for logits, targets in MICRO_BATCHES[a.packing](
                model, ids, attn, labels, a.micro_batch_tokens
            ):
                total += F.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]),
                    targets.reshape(-1),
                    ignore_index=-100,
                    reduction="sum",
                ).item()
                count += int((targets != -100).sum())
        model.train()
        return total / max(count, 1)


def _padded(examples, rows, pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = [examples.ids[r] for r in rows]
    return (
        pad_2d(ids, pad, torch.long),
        pad_2d([[1] * len(r) for r in ids], 0, torch.long),
        pad_2d([examples.labels[r] for r in rows], -100, torch.long),
    )


def run_sft(cfg: Config, out_dir: str | Path | None = None, progress: bool = True) -> Path:
    """Train (until the target, the cap, ``sft.steps`` or ``sft.epochs`` over ``sft.train_files``),
    then write the checkpoint atomically (temporary directory renamed when complete) with
    ``sft.json``."""
    s = cfg.sft
    out = Path(out_dir) if out_dir else warm_start_path(cfg)
    model, tokenizer = load_model(cfg, cfg.model.path)
    check = val = None
    if s.train_files:
        batch = DataBatches(cfg, tokenizer)
        total = s.steps if s.steps is not None else batch.steps(s.epochs)
        val = ValLoss(cfg, tokenizer) if s.val_files else None
        warmup = min(20, max(1, total // 10))
        desc = f"SFT on {len(batch.examples)} rows of sft.train_files"
    else:
        task = make_task(cfg)

        def batch(step):
            return sft_batch(task, tokenizer, step * s.batch_size, s.batch_size)

        total = s.steps if s.steps is not None else s.max_steps
        check = HeldoutCheck(cfg, task, tokenizer) if s.steps is None else None
        warmup = 20
        desc = (
            "warm start (SFT)"
            if check is None
            else f"warm start (SFT, to {s.target_accuracy:.0%} sampled accuracy)"
        )
    if s.lora_rank:
        model = apply_lora(model, LoraSettings(s.lora_rank, s.lora_alpha, targets=(ALL_LINEAR,)))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=s.lr, betas=(0.9, 0.98), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: lr_factor(i, total, warmup))
    model.train()
    t0, losses, checks, met = time.perf_counter(), [], [], False
    if val is not None:  # the loss before training, for comparison
        checks.append({"step": 0, "loss": None, "val_loss": val(model)})
    bar = tqdm(range(total), desc=desc, disable=not progress, dynamic_ncols=True)
    for step in bar:
        ids, attn, labels, texts = batch(step)
        losses.append(
            _train_step(
                model,
                opt,
                sched,
                ids,
                attn,
                labels,
                cfg.actor.micro_batch_tokens,
                cfg.actor.packing,
                s.grad_clip,
            )
        )
        done = step + 1
        if val is not None and (done % s.eval_every == 0 or done == total):
            checks.append({"step": done, "loss": losses[-1], "val_loss": val(model)})
            bar.set_postfix(loss=f"{losses[-1]:.3f}", val_loss=f"{checks[-1]['val_loss']:.3f}")
            log.info(
                "SFT step %d/%d: loss %.4f, val_loss %.4f",
                done,
                total,
                losses[-1],
                checks[-1]["val_loss"],
            )
            continue
        if check is None:
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
            continue
        check.trained_on(texts)
        if done % s.eval_every == 0 or done == total:
            acc, n = check(model)
            checks.append({"step": done, "accuracy": acc, "loss": losses[-1], "prompts": n})
            bar.set_postfix(loss=f"{losses[-1]:.3f}", acc=f"{acc:.3f}")
            if acc >= s.target_accuracy:
                met = True
                break
    bar.close()
    seconds = time.perf_counter() - t0
    record = {
        "steps": len(losses),
        "final_loss": losses[-1] if losses else None,
        "seconds": seconds,
    }
    if s.train_files:
        record |= {
            "rows": len(batch.examples),
            "dropped_rows": dict(batch.examples.dropped),
            "trained_tokens_per_epoch": batch.examples.trained_tokens,
            "val_loss": checks[-1]["val_loss"] if checks else None,
            "checks": checks,
        }
    if check is not None:
        last = checks[-1] if checks else {"accuracy": None, "prompts": 0}
        record |= {
            "target_accuracy": s.target_accuracy,
            "accuracy": last["accuracy"],
            "target_met": met,
            "max_steps": s.max_steps,
            "check_prompts": last["prompts"],
            "check_seconds": check.seconds,
            "checks": checks,
        }
        if met:
            log.info(
                "warm start: sampled held-out accuracy %.3f >= sft.target_accuracy %.3f "
                "after %d steps (%.0f s)",
                last["accuracy"],
                s.target_accuracy,
                len(losses),
                seconds,
            )
        else:
            log.warning(_cap_message(cfg, last["accuracy"]))
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    if s.lora_rank:  # the adapter as PEFT loads it, then the merged model the RL starts from
        model.peft_config["default"].base_model_name_or_path = cfg.model.path
        model.save_pretrained(tmp / ADAPTER_DIR)
        model = model.merge_and_unload()
    save_model_dir(tmp, model, tokenizer)
    (tmp / "sft.json").write_text(json.dumps(record, indent=1))
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def _cap_message(cfg: Config, accuracy: float | None) -> str:
    s = cfg.sft
    reached = "no check ran" if accuracy is None else f"sampled held-out accuracy is {accuracy:.3f}"
    return (
        f"warm start: reached the cap sft.max_steps={s.max_steps} "
        f"before sft.target_accuracy={s.target_accuracy:g} ({reached}); "
        "RL starts from this weaker model. "
        "Raise sft.max_steps or sft.lr, or lower sft.target_accuracy."
    )


def ensure_warm_start(cfg: Config, progress: bool = True) -> str | None:
    """The checkpoint RL starts from: the cached warm start (trained on first use), or
    ``model.path``."""
    if not cfg.sft.enabled:
        return cfg.model.path
    path = warm_start_path(cfg)
    if not (path / "config.json").is_file():
        run_sft(cfg, path, progress)
    elif cfg.sft.steps is None and (path / "sft.json").is_file():
        record = json.loads((path / "sft.json").read_text())
        # a cached warm start that missed its target: say so on every run
        if record.get("target_met") is False:
            log.warning(_cap_message(cfg, record.get("accuracy")))
    return str(path)
