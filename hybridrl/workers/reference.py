"""The reference role: a frozen copy of the initial policy, giving log-probs for the KL term."""
from __future__ import annotations

from hybridrl.config import Config
from hybridrl.controller import Dispatch, Worker, WorkerContext, register
from hybridrl.protocol import Batch
from hybridrl.training.logprob import batch_log_probs
from hybridrl.workers.common import load_model


class ReferenceWorker(Worker):
    def __init__(self, ctx: WorkerContext, cfg: Config, model_path: str | None):
        super().__init__(ctx)
        self.cfg = cfg
        self.model, _ = load_model(cfg, model_path)
        self.model.requires_grad_(False).eval()

    @register(Dispatch.DP_COMPUTE)
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        temperature = self.cfg.rollout.temperature or 1.0
        return Batch({"ref_log_probs": batch_log_probs(self.model, batch, self.cfg.actor.micro_batch_tokens, temperature)})
