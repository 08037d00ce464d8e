"""The reward role: decodes responses and scores them with the configured reward function.

A reward function that raises is logged, the sample scores 0, and the
``reward_errors`` column counts it; the run goes on.
"""

from __future__ import annotations

import logging

import torch

from hybridrl.config import Config
from hybridrl.controller import Dispatch, Worker, WorkerContext, register
from hybridrl.protocol import Batch
from hybridrl.tasks import REWARDS, compute_reward
from hybridrl.workers.common import load_tokenizer

log = logging.getLogger(__name__)


class Scorer:
    """Decodes each response and scores it with the reward function (used by the reward role, and by a
    rollout rank scoring its own groups in asynchronous training)."""

    def __init__(self, cfg: Config, tokenizer):
        self.tokenizer = tokenizer
        self.fn = REWARDS.get(cfg.task.reward_fn)
        self.fn_name = cfg.task.reward_fn
        self._logged = 0

    def __call__(self, batch: Batch) -> Batch:
        eos = self.tokenizer.eos_token_id
        scores, errors = [], []
        for row, prompt in enumerate(batch["prompt"]):
            ids = batch["responses"][row][batch["response_mask"][row].bool()].tolist()
            finished = batch["status"][row] == "finished"
            if finished and ids and ids[-1] == eos:
                ids = ids[:-1]
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            try:
                score, _ = compute_reward(self.fn, prompt, text, finished=finished)
                errors.append(0.0)
            except Exception as e:  # a user's reward function must not kill the run
                score = 0.0
                errors.append(1.0)
                if self._logged < 5:
                    log.warning(
                        "reward function %s raised on prompt %s: %r (sample scored 0)",
                        self.fn_name,
                        prompt.uid,
                        e,
                    )
                    self._logged += 1
            scores.append(score)
        return Batch({"rewards": torch.tensor(scores), "reward_errors": torch.tensor(errors)})


class RewardWorker(Worker):
    def __init__(self, ctx: WorkerContext, cfg: Config, model_path: str | None):
        super().__init__(ctx)
        self.scorer = Scorer(cfg, load_tokenizer(cfg, model_path))

    @register(Dispatch.DP_COMPUTE)
    def score(self, batch: Batch) -> Batch:
        return self.scorer(batch)
