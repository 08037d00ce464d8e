"""The reference role: a frozen copy of the initial policy, giving log-probs for the KL term (sharded with
FSDP2 like the actor when its world size is > 1; no optimizer)."""

from __future__ import annotations

from hybridrl.config import Config
from hybridrl.controller import Dispatch, Worker, WorkerContext, register
from hybridrl.protocol import Batch
from hybridrl.training.distributed import init_distributed, teardown_distributed
from hybridrl.training.fsdp import fsdp_config_of, prepare_model
from hybridrl.training.logprob import batch_log_probs, sampling_of
from hybridrl.workers.common import load_model


class ReferenceWorker(Worker):
    def __init__(self, ctx: WorkerContext, cfg: Config, model_path: str | None):
        super().__init__(ctx)
        self.cfg = cfg
        self.dist = init_distributed(ctx)
        model, _ = load_model(cfg, model_path)
        model.requires_grad_(False).eval()
        self.model = prepare_model(model, fsdp_config_of(cfg), self.dist, trainable=False)

    @register(Dispatch.DP_COMPUTE)
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        # the same filtered distribution as the actor's: the KL to the reference is 0 at equal weights
        sampling = sampling_of(self.cfg.rollout)
        return Batch(
            {
                "ref_log_probs": batch_log_probs(
                    self.model, batch, self.cfg.actor.micro_batch_tokens, sampling
                )
            }
        )

    @register(Dispatch.ONE_TO_ALL)
    def close(self) -> None:
        teardown_distributed()
