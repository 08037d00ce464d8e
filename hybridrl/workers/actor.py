"""The actor role: the policy being trained (log-probs, PPO-style updates, weights for sync, checkpoints).

One mini-batch is ``actor.ppo_minibatch_size`` samples; it is split into
micro-batches under ``actor.micro_batch_tokens`` and the gradients are
accumulated so that the loss is exactly the mini-batch's token mean.
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch

from hybridrl.algorithms import POLICY_LOSSES, kl_penalty, masked_mean
from hybridrl.config import Config
from hybridrl.controller import Dispatch, Worker, WorkerContext, register
from hybridrl.protocol import Batch
from hybridrl.training.logprob import batch_log_probs, micro_batches, response_log_probs
from hybridrl.workers.common import load_model


class ActorWorker(Worker):
    def __init__(self, ctx: WorkerContext, cfg: Config, model_path: str | None):
        super().__init__(ctx)
        if ctx.world_size > 1:
            raise NotImplementedError("a data-parallel actor (world size > 1) needs the FSDP2 engine (issue 4); use one actor worker")
        self.cfg = cfg
        self.model, self.tokenizer = load_model(cfg, model_path)
        a = cfg.actor
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=a.lr, weight_decay=a.weight_decay)
        self.loss_fn = POLICY_LOSSES.get(cfg.algorithm.policy_loss)
        self.shuffle = torch.Generator().manual_seed(cfg.trainer.seed + 1)
        self.temperature = cfg.rollout.temperature or 1.0

    @register(Dispatch.DP_COMPUTE)
    def compute_log_prob(self, batch: Batch) -> Batch:
        return Batch({"old_log_probs": batch_log_probs(self.model, batch, self.cfg.actor.micro_batch_tokens, self.temperature)})

    @register(Dispatch.DP_COMPUTE)
    def update_policy(self, batch: Batch) -> dict[str, float]:
        a, alg = self.cfg.actor, self.cfg.algorithm
        self.model.train()
        sums: dict[str, float] = defaultdict(float)
        updates = 0
        for _ in range(a.ppo_epochs):
            for mini in batch.shuffle(self.shuffle).split(a.ppo_minibatch_size):
                self.optimizer.zero_grad(set_to_none=True)
                n_tokens = mini["response_mask"].sum().clamp(min=1)
                for mb in micro_batches(mini, a.micro_batch_tokens):
                    share = mb["response_mask"].sum() / n_tokens
                    logp, entropy = response_log_probs(self.model, mb, self.temperature, with_entropy=True)
                    mask = mb["response_mask"]
                    pg, m = self.loss_fn(logp, mb["old_log_probs"], mb["advantages"], mask, alg)
                    kl = kl_penalty(alg.kl_estimator, logp, mb["ref_log_probs"]) * mask
                    per_token = pg + alg.kl_coef * kl - alg.entropy_coef * entropy
                    (per_token.sum() / n_tokens).backward()
                    m |= {"actor/pg_loss": masked_mean(pg, mask).item(), "actor/kl_ref": masked_mean(kl, mask).item(),
                          "actor/entropy": masked_mean(entropy, mask).item()}
                    for k, v in m.items():
                        sums[k] += v * share.item()
                norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), a.grad_clip or float("inf"))
                sums["actor/grad_norm"] += norm.item()
                self.optimizer.step()
                updates += 1
        return {k: v / updates for k, v in sums.items()} | {"actor/updates": updates}

    @register(Dispatch.RANK_ZERO)
    def weight_buckets(self, bucket_bytes: int = 64 << 20) -> list[list[tuple[str, torch.Tensor]]]:
        """The full weights as buckets of (name, tensor), each at most ``bucket_bytes`` (or one tensor)."""
        buckets, current, size = [], [], 0
        for name, p in self.model.named_parameters():
            nbytes = p.numel() * p.element_size()
            if current and size + nbytes > bucket_bytes:
                buckets.append(current)
                current, size = [], 0
            current.append((name, p.detach()))
            size += nbytes
        return buckets + ([current] if current else [])

    @register(Dispatch.RANK_ZERO)
    def save_checkpoint(self, path: str) -> None:
        """The model in transformers format (``path/model``) plus optimizer and shuffle RNG (``path/actor_state.pt``)."""
        self.model.save_pretrained(Path(path) / "model")
        self.tokenizer.save_pretrained(Path(path) / "model")
        torch.save({"optimizer": self.optimizer.state_dict(), "shuffle_rng": self.shuffle.get_state()}, Path(path) / "actor_state.pt")

    @register(Dispatch.ONE_TO_ALL)
    def load_state(self, path: str) -> None:
        """Optimizer and RNG state of a checkpoint (the weights came in through ``model_path``)."""
        state = torch.load(Path(path) / "actor_state.pt", weights_only=True)
        self.optimizer.load_state_dict(state["optimizer"])
        self.shuffle.set_state(state["shuffle_rng"])
