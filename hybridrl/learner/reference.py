"""The reference policy: a frozen copy of the initial policy, giving log-probs for the KL terms.
Part of the learner (``learner/learner.py``), sharded with FSDP2 like the policy when there is more
than one rank (and its experts split over ranks like the policy's with ``moe.ep_size``)."""

from __future__ import annotations

from hybridrl.config import Config
from hybridrl.learner.compile import maybe_compile
from hybridrl.learner.logprob import batch_log_probs, model_device, sampling_of
from hybridrl.models.loading import load_model
from hybridrl.parallel.fsdp import fsdp_config_of, prepare_model
from hybridrl.protocol import Batch


class Reference:
    def __init__(self, cfg: Config, model_path: str | None, dist):
        self.cfg = cfg
        model, _ = load_model(cfg, model_path)
        model.requires_grad_(False).eval()
        self.model = prepare_model(
            model, fsdp_config_of(cfg), dist, trainable=False, ep_size=cfg.moe.ep_size
        )
        # actor.compile: the same choice as the policy's (learner/compile.py)
        self.model = maybe_compile(
            cfg.actor.compile, self.model, model_device(self.model), "reference"
        )
        # the same filtered distribution as the policy's: KL to the reference is 0 at equal weights
        self.sampling = sampling_of(cfg.rollout)

    def log_probs(self, batch: Batch) -> Batch:
        tokens = self.cfg.actor.micro_batch_tokens
        logp = batch_log_probs(self.model, batch, tokens, self.sampling, self.cfg.actor.packing)
        return Batch({"ref_log_probs": logp})
