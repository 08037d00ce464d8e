"""The actor role: the policy being trained (log-probs, policy-gradient updates, weights for sync, checkpoints).

The policy loss (``algorithm.policy_loss``) and the loss aggregation
(``algorithm.loss_agg``) come from registries; the KL-to-reference loss term
and the entropy bonus are aggregated the same way.
"""
from __future__ import annotations

import torch

from hybridrl.algorithms import LOSS_AGG, POLICY_LOSSES, AggTotals, kl_penalty, masked_mean
from hybridrl.config import Config
from hybridrl.controller import Dispatch, Worker, WorkerContext, register
from hybridrl.protocol import Batch
from hybridrl.training.logprob import batch_log_probs, response_log_probs
from hybridrl.training.state import load_trainable, save_trainable
from hybridrl.training.update import run_updates
from hybridrl.workers.common import load_model


class ActorWorker(Worker):
    def __init__(self, ctx: WorkerContext, cfg: Config, model_path: str | None):
        super().__init__(ctx)
        if ctx.world_size > 1:
            raise NotImplementedError("a data-parallel actor (world size > 1) needs the FSDP2 engine (issue 4); use one actor worker")
        self.cfg = cfg
        self.model, self.tokenizer = load_model(cfg, model_path)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.actor.lr, weight_decay=cfg.actor.weight_decay)
        self.policy_loss = POLICY_LOSSES.get(cfg.algorithm.policy_loss)
        self.aggregate = LOSS_AGG.get(cfg.algorithm.loss_agg)
        self.shuffle = torch.Generator().manual_seed(cfg.trainer.seed + 1)
        self.temperature = cfg.rollout.temperature or 1.0

    @register(Dispatch.DP_COMPUTE)
    def compute_log_prob(self, batch: Batch) -> Batch:
        return Batch({"old_log_probs": batch_log_probs(self.model, batch, self.cfg.actor.micro_batch_tokens, self.temperature)})

    def _loss(self, mb: Batch, totals: AggTotals) -> tuple[torch.Tensor, dict[str, float]]:
        alg, mask = self.cfg.algorithm, mb["response_mask"]
        logp, entropy = response_log_probs(self.model, mb, self.temperature, with_entropy=True)
        pg, metrics = self.policy_loss(logp, mb, alg)
        kl = kl_penalty(alg.kl_estimator, logp, mb["ref_log_probs"]) * mask
        loss = self.aggregate(pg, mask, totals) + alg.kl_coef * self.aggregate(kl, mask, totals)
        if alg.entropy_coef:
            loss = loss - alg.entropy_coef * self.aggregate(entropy, mask, totals)
        metrics |= {"actor/pg_loss": masked_mean(pg, mask).item(), "actor/kl_ref": masked_mean(kl, mask).item(),
                    "actor/entropy": masked_mean(entropy, mask).item()}
        return loss, metrics

    @register(Dispatch.DP_COMPUTE)
    def update_policy(self, batch: Batch) -> dict[str, float]:
        a = self.cfg.actor
        return run_updates(self.model, self.optimizer, batch, self._loss, minibatch_size=a.ppo_minibatch_size,
                           epochs=a.ppo_epochs, micro_batch_tokens=a.micro_batch_tokens, grad_clip=a.grad_clip,
                           generator=self.shuffle, norm_len=self.cfg.algorithm.loss_agg_norm_len or self.cfg.rollout.max_new_tokens,
                           prefix="actor")

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
        """The policy in transformers format with its tokenizer, plus optimizer and shuffle RNG."""
        save_trainable(path, self.model, self.optimizer, self.shuffle, self.tokenizer)

    @register(Dispatch.ONE_TO_ALL)
    def load_state(self, path: str) -> None:
        load_trainable(path, self.optimizer, self.shuffle)
