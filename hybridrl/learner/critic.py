"""The learner's critic (PPO with GAE): a value head on the causal-LM trunk, with its own optimizer.

The trunk starts from the same checkpoint as the policy; the head (one
linear output per position) starts at zero, so the first values are 0. A
checkpoint that holds a head (a saved critic) keeps it: a resumed critic is
the saved one.
The value of response token t is read at position P + t - 1, the state
before the token is generated (the same alignment as the log-probs).
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForTokenClassification

from hybridrl.algorithms import LOSS_AGG, AggTotals, masked_mean, value_loss
from hybridrl.config import Config
from hybridrl.learner.logprob import batch_map, response_outputs
from hybridrl.learner.lr_schedule import add_lr_schedule, planned_steps
from hybridrl.learner.optim import make_adamw
from hybridrl.learner.state import load_trainable, save_trainable
from hybridrl.learner.update import MicroBatches, SkipCounter, run_updates
from hybridrl.models.factory import model_size_config
from hybridrl.models.loading import load_tokenizer
from hybridrl.parallel.fsdp import fsdp_config_of, prepare_model
from hybridrl.parallel.mesh import ParallelDims
from hybridrl.protocol import Batch


def build_value_model(cfg: Config, model_path: str | None):
    """The value model: trunk from ``model_path`` (or the built-in size); the head from
    ``model_path`` when it holds one (a critic checkpoint), else zero (a policy checkpoint has no
    head to load)."""
    if model_path is None:
        config = model_size_config(cfg.model.name, load_tokenizer(cfg, None))
        config.num_labels, config.classifier_dropout = 1, 0.0
        torch.manual_seed(cfg.model.seed)
        model, missing = (
            AutoModelForTokenClassification.from_config(config),
            {"score.weight", "score.bias"},
        )
    else:
        config = AutoConfig.from_pretrained(model_path, local_files_only=True)
        config.num_labels, config.classifier_dropout = 1, 0.0
        model, info = AutoModelForTokenClassification.from_pretrained(
            model_path,
            config=config,
            local_files_only=True,
            dtype=torch.float32,
            output_loading_info=True,
        )
        missing = set(info["missing_keys"])
    with torch.no_grad():
        for name in ("weight", "bias"):
            param = getattr(model.score, name)
            if param is not None and f"score.{name}" in missing:
                param.zero_()
    return model


def response_values(model, mb: Batch) -> torch.Tensor:
    # the policy's forward (packed when the micro-batch is); the values and the loss are fp32
    return response_outputs(model, mb)[..., 0].float() * mb["response_mask"]


class Critic:
    """The value model of one learner rank and its own optimizer (part of the learner)."""

    def __init__(self, cfg: Config, model_path: str | None, dist, dims: ParallelDims | None = None):
        self.cfg = cfg
        # an MoE trunk splits its experts over ranks like the policy's (moe.ep_size)
        model = build_value_model(cfg, model_path)
        self.model = prepare_model(
            model,
            fsdp_config_of(cfg),
            dist,
            mesh=(dims or ParallelDims.of(dist, ep=cfg.moe.ep_size)).unpipelined,
        )
        # AdamW's default weight decay (0.01), fused where it applies (learner/optim.py)
        self.optimizer = make_adamw(self.model.parameters(), cfg.critic.lr, 0.01, "critic")
        add_lr_schedule(self.optimizer, cfg.critic, planned_steps(cfg, cfg.critic))
        self.aggregate = LOSS_AGG.get(cfg.algorithm.loss_agg)
        self.shuffle = torch.Generator().manual_seed(cfg.trainer.seed + 2)
        self.skips = SkipCounter(cfg.alerts.max_nonfinite_in_a_row, "critic")

    def values(self, batch: Batch) -> Batch:
        tokens = self.cfg.critic.micro_batch_tokens
        packing = self.cfg.actor.packing  # the learner's passes pack alike
        return Batch({"values": batch_map(self.model, batch, tokens, response_values, packing)})

    def loss(self, mb: Batch, totals: AggTotals) -> tuple[torch.Tensor, dict[str, float]]:
        mask = mb["response_mask"]
        values = response_values(self.model, mb)
        per_token, metrics = value_loss(
            values, mb["values"], mb["returns"], mask, self.cfg.critic.value_clip
        )
        loss = self.aggregate(per_token, mask, totals)
        return loss, metrics | {"critic/vf_loss": masked_mean(per_token.detach(), mask).item()}

    def update(self, batch: Batch) -> dict[str, float]:
        passes = MicroBatches(self.model, self.loss, self.cfg.critic, self.cfg.actor.packing)
        return run_updates(
            passes,
            self.optimizer,
            batch,
            self.cfg.critic,
            generator=self.shuffle,
            norm_len=self.cfg.loss_norm_len,
            prefix="critic",
            skips=self.skips,
        )

    def save(self, path: str) -> None:
        save_trainable(path, self.model, self.optimizer, self.shuffle)

    def load(self, path: str) -> None:
        load_trainable(path, self.model, self.optimizer, self.shuffle)
