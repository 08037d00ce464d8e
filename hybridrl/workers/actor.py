"""The actor role: the policy being trained (log-probs, policy-gradient updates, weights for sync, checkpoints).

The policy loss (``algorithm.policy_loss``) and the loss aggregation
(``algorithm.loss_agg``) come from registries; the KL-to-reference loss term
and the entropy bonus are aggregated the same way.

World size > 1 (one process per rank, e.g. the ``ray`` backend): the ranks share
a torch.distributed group and the model is sharded with FSDP2
(``training/fsdp.py``); ``compute_log_prob`` and ``update_policy`` take each
rank's chunk of the batch (DP_COMPUTE) and the update equals the
single-process update on the whole batch (``training/update.py``).

Old log-probs: ``compute_log_prob`` runs them on the micro-batches of the update's first epoch, so they
are bit for bit what that epoch's first forward computes. A batch given to ``update_policy`` without
them (an on-policy step, decided in ``trainers/learn.py``: one epoch over one mini-batch) takes them
from the update's own forward instead (π_old := sg[π_θ], ratio exactly 1), with no separate pass;
``old_log_probs_of_last_update`` then hands them back for the metrics that read them.

LoRA (``actor.lora_rank`` > 0, ``training/lora.py``): the policy is wrapped with PEFT adapters before
sharding, the optimizer holds only the adapters, ``weight_buckets`` sends only the adapters (the first
call after the actor is built or loaded also sends the base weights) and checkpoints hold the merged
model, the PEFT adapter and the adapter + optimizer state.
"""

from __future__ import annotations

import torch

from hybridrl.algorithms import LOSS_AGG, POLICY_LOSSES, AggTotals, kl_penalty, masked_mean
from hybridrl.algorithms.rollout_correction import weighted_policy_loss
from hybridrl.config import Config
from hybridrl.controller import Dispatch, Worker, WorkerContext, register
from hybridrl.protocol import Batch
from hybridrl.training import distributed as D
from hybridrl.training import lora as L
from hybridrl.training.distributed import init_distributed, teardown_distributed
from hybridrl.training.fsdp import fsdp_config_of, iter_weight_buckets, prepare_model
from hybridrl.training.logprob import response_log_probs, sampling_of
from hybridrl.training.state import load_trainable, save_trainable
from hybridrl.training.update import first_epoch_map, is_single_pass, run_updates
from hybridrl.workers.common import load_model

ROW = "update_row"  # a batch column: each row's index, so the update's forward can note its old log-probs


def dropout_in_training(model) -> bool:
    """Whether a training-mode forward is random (a dropout layer, or attention dropout in the config)."""
    config = getattr(model, "config", None)
    return (
        any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())
        or float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0
    )


class ActorWorker(Worker):
    def __init__(self, ctx: WorkerContext, cfg: Config, model_path: str | None):
        super().__init__(ctx)
        self.cfg = cfg
        self.dist = init_distributed(ctx)
        model, self.tokenizer = load_model(cfg, model_path)
        self.lora = L.lora_settings(cfg)
        self.base_source = (
            model_path  # where the (LoRA base) weights came from; None: built-in from model.seed
        )
        self._base_synced = (
            False  # LoRA: the rollout has our base weights (first weight_buckets sends them)
        )
        if self.lora is not None:
            model = L.apply_lora(model, self.lora, seed=cfg.model.seed)
        self.model = prepare_model(model, fsdp_config_of(cfg), self.dist)
        params = (
            L.trainable_parameters(self.model) if self.lora is not None else self.model.parameters()
        )
        self.optimizer = torch.optim.AdamW(
            params, lr=cfg.actor.lr, weight_decay=cfg.actor.weight_decay
        )
        self.policy_loss = POLICY_LOSSES.get(cfg.algorithm.policy_loss)
        self.aggregate = LOSS_AGG.get(cfg.algorithm.loss_agg)
        self.shuffle = torch.Generator().manual_seed(cfg.trainer.seed + 1)
        self.sampling = sampling_of(
            cfg.rollout
        )  # log-probs under the rollout's filtered distribution
        self._taken: torch.Tensor | None = (
            None  # old log-probs of the running / last update given none
        )

    @register(Dispatch.DP_COMPUTE)
    def compute_log_prob(self, batch: Batch) -> Batch:
        """π_old of every row, grouped as the next update's first epoch groups them (``first_epoch_map``)."""
        fn = lambda model, mb: response_log_probs(model, mb, self.sampling)[0]  # noqa: E731
        return Batch(
            {"old_log_probs": first_epoch_map(self.model, batch, self.shuffle, self.cfg.actor, fn)}
        )

    def _keep_old(self, mb: Batch, logp: torch.Tensor) -> torch.Tensor:
        """On-policy step: this forward's log-probs are the old policy's; note them at the micro-batch's rows
        (valid tokens only: a dummy micro-batch repeats a row with an empty mask) and return them detached."""
        old = logp.detach().float()
        rows, width, mask = mb[ROW], old.shape[1], mb["response_mask"].bool()
        kept = self._taken[rows.cpu(), :width]
        self._taken[rows.cpu(), :width] = torch.where(mask.cpu(), old.cpu(), kept)
        return old

    def _loss(self, mb: Batch, totals: AggTotals) -> tuple[torch.Tensor, dict[str, float]]:
        alg, mask = self.cfg.algorithm, mb["response_mask"]
        logp, entropy = response_log_probs(self.model, mb, self.sampling, with_entropy=True)
        if ROW in mb:
            mb = mb | Batch({"old_log_probs": self._keep_old(mb, logp)})
        pg, metrics = self.policy_loss(logp, mb, alg)
        pg = weighted_policy_loss(pg, mb)  # rollout correction (algorithm.rollout_is), when on
        kl = kl_penalty(alg.kl_estimator, logp, mb["ref_log_probs"]) * mask
        loss = self.aggregate(pg, mask, totals) + alg.kl_coef * self.aggregate(kl, mask, totals)
        if alg.entropy_coef:
            loss = loss - alg.entropy_coef * self.aggregate(entropy, mask, totals)
        metrics |= {
            "actor/pg_loss": masked_mean(pg, mask).item(),
            "actor/kl_ref": masked_mean(kl, mask).item(),
            "actor/entropy": masked_mean(entropy, mask).item(),
        }
        return loss, metrics

    @register(Dispatch.DP_COMPUTE)
    def update_policy(self, batch: Batch) -> dict[str, float]:
        """Train on ``batch``. Without ``old_log_probs`` the old policy is the update's own first forward, which
        needs one epoch over one mini-batch (checked over the global batch). A model with dropout in training
        mode computes them with the separate pass instead (its training forward is not the old policy's).
        Either way :meth:`old_log_probs_of_last_update` returns them afterwards; ``actor/old_log_prob_reused`` is 1
        when no separate pass ran."""
        reuse = False
        if "old_log_probs" not in batch:
            self._check_single_pass(batch)
            reuse = not dropout_in_training(self.model)
            if reuse:
                self._taken = torch.zeros(tuple(batch["responses"].shape), dtype=torch.float32)
                batch = batch | Batch({ROW: torch.arange(len(batch))})
            else:
                batch = batch | self.compute_log_prob(batch)
                self._taken = batch["old_log_probs"]
        metrics = run_updates(
            self.model,
            self.optimizer,
            batch,
            self._loss,
            self.cfg.actor,
            generator=self.shuffle,
            norm_len=self.cfg.loss_norm_len,
            prefix="actor",
        )
        return metrics | {"actor/old_log_prob_reused": float(reuse)}

    def _check_single_pass(self, batch: Batch) -> None:
        total = sum(D.all_gather_ints(len(batch)))
        if not is_single_pass(self.cfg.actor, total):
            raise ValueError(
                f"update_policy: a batch without old_log_probs needs one epoch over one mini-batch, got "
                f"ppo_epochs={self.cfg.actor.ppo_epochs}, ppo_minibatch_size={self.cfg.actor.ppo_minibatch_size} "
                f"for {total} rows; run compute_log_prob first"
            )

    @register(Dispatch.DP_COMPUTE)
    def old_log_probs_of_last_update(self, batch: Batch) -> Batch:
        """The old log-probs of the last ``update_policy`` given a batch without them, for this rank's rows of
        ``batch`` (the batch it trained on)."""
        old, self._taken = self._taken, None
        if old is None or len(old) != len(batch):
            raise RuntimeError(
                "old_log_probs_of_last_update: the last update_policy was not given a batch without old_log_probs"
            )
        return Batch({"old_log_probs": old})

    @register(Dispatch.ONE_TO_ALL)
    def weight_buckets(
        self, bucket_bytes: int = 64 << 20, mode: str = "auto"
    ) -> list[list[tuple[str, torch.Tensor]]]:
        """The weights as buckets of (name, tensor) of at most ``bucket_bytes`` (or one tensor). Every rank
        takes part in gathering the shards; rank 0 returns the buckets, the others ``[]``: the driver reads ``[0]``.

        Without LoRA: the full weights. With LoRA, ``mode``: ``adapter`` the adapters only (``training/lora.py``);
        ``base`` the base weights, then the adapters; ``auto`` (default): ``base`` on the first call after the
        actor was built or loaded, ``adapter`` afterwards; ``merged`` the full merged weights (plain names)."""
        if self.lora is None:
            buckets = list(iter_weight_buckets(self.model, bucket_bytes))
        elif mode == "merged":
            merged = L.merged_weights(self.model)
            buckets = list(L.bucketed(merged.items(), bucket_bytes, keep=True))
        else:
            if mode not in ("auto", "adapter", "base"):
                raise ValueError(
                    f"weight_buckets: mode must be auto, adapter, base or merged, got {mode!r}"
                )
            with_base = mode == "base" or (mode == "auto" and not self._base_synced)
            buckets = list(L.lora_weight_buckets(self.model, bucket_bytes, with_base=with_base))
            self._base_synced |= with_base
        return buckets if self.rank == 0 else []

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        """Every rank: the policy in transformers format with its tokenizer (rank 0), and the sharded
        model + optimizer + shuffle RNG under ``path/dcp`` (LoRA: the layout of ``training/lora.py``)."""
        if self.lora is not None:
            L.save_lora_checkpoint(
                path,
                self.model,
                self.optimizer,
                self.shuffle,
                self.tokenizer,
                base_source=self.base_source,
            )
        else:
            save_trainable(path, self.model, self.optimizer, self.shuffle, self.tokenizer)

    @register(Dispatch.ONE_TO_ALL)
    def load_state(self, path: str) -> None:
        if self.lora is not None and L.is_lora_checkpoint(path):
            self.base_source = L.base_source_of(path)
            base, _ = load_model(self.cfg, self.base_source)
            L.load_lora_state(path, self.model, self.optimizer, self.shuffle, base)
            self._base_synced = False
        else:
            load_trainable(path, self.model, self.optimizer, self.shuffle)

    @register(Dispatch.ONE_TO_ALL)
    def close(self) -> None:
        """Leave the process group (barrier first); the worker is unusable afterwards."""
        teardown_distributed()
