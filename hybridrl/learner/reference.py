"""The reference policy: a frozen copy of the initial policy, giving log-probs for the KL terms.
Part of the learner (``learner/learner.py``), sharded with FSDP2 like the policy when there is more
than one rank (and its experts split over ranks like the policy's with ``moe.ep_size``), on every
learner rank even when the policy is pipelined."""

from __future__ import annotations

import torch

from hybridrl.config import Config
from hybridrl.learner.compile import maybe_compile
from hybridrl.learner.logprob import model_device, response_log_probs, sampling_of
from hybridrl.learner.update import first_epoch_map
from hybridrl.models.loading import load_model
from hybridrl.parallel.fsdp import fsdp_config_of, prepare_model
from hybridrl.parallel.mesh import ParallelDims
from hybridrl.protocol import Batch


class Reference:
    def __init__(self, cfg: Config, model_path: str | None, dist, dims: ParallelDims | None = None):
        self.cfg = cfg
        model, _ = load_model(cfg, model_path)
        model.requires_grad_(False).eval()
        self.model = prepare_model(
            model,
            fsdp_config_of(cfg),
            dist,
            trainable=False,
            mesh=(dims or ParallelDims.of(dist, ep=cfg.moe.ep_size)).unpipelined,
        )
        # actor.compile: the same choice as the policy's (learner/compile.py)
        self.model = maybe_compile(
            cfg.actor.compile, self.model, model_device(self.model), "reference"
        )
        # the same filtered distribution as the policy's: KL to the reference is 0 at equal weights
        self.sampling = sampling_of(cfg.rollout)

    def log_probs(self, batch: Batch, shuffle: torch.Generator) -> Batch:
        """The reference's log-prob of every response token, with rows grouped into micro-batches
        as the policy's next update groups them in its first epoch (``shuffle`` is the policy's
        mini-batch generator, only peeked at). Under bf16 (or any kernel whose rounding depends on
        the matmul's shape) the low bits of a row depend on the rows it shares a forward with; the
        same grouping as the policy's forward makes the two equal bit for bit at equal weights, so
        the KL starts at exactly 0 on every CPU (for a policy that is not pipelined: a pipeline
        groups its rows by replica rounds, ``learner/pipeline_update.py``)."""

        def fn(model, mb):
            return response_log_probs(model, mb, self.sampling)[0]

        return Batch(
            {"ref_log_probs": first_epoch_map(self.model, batch, shuffle, self.cfg.actor, fn)}
        )
