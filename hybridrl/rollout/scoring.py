"""Scoring where the samples are generated: each rollout rank decodes its responses and scores them
with the configured reward function (``task.reward_fn``), in both training modes.

Numbers a reward function returns beside its score (``{"score": ..., "format": 1.0}``) become
``reward_extras["reward/<name>"]`` and are logged as means. A reward function that raises is logged,
the sample scores 0 and its ``reward_extras["reward_errors"]`` is 1; the run goes on.
"""

from __future__ import annotations

import logging

from hybridrl.config import Config
from hybridrl.protocol import Sample
from hybridrl.tasks import REWARDS, compute_reward

log = logging.getLogger(__name__)
LOGGED_ERRORS = 5  # reward-function failures logged in full per scorer; later ones are only counted


class Scorer:
    def __init__(self, cfg: Config, tokenizer):
        self.tokenizer = tokenizer
        self.fn = REWARDS.get(cfg.task.reward_fn)
        self.fn_name = cfg.task.reward_fn
        self._logged = 0

    def __call__(self, samples: list[Sample]) -> list[Sample]:
        """Sets ``reward`` and ``reward_extras["reward_errors"]`` of each sample (in place); returns
        them."""
        eos = self.tokenizer.eos_token_id
        for s in samples:
            finished = s.status == "finished"
            ids = (
                s.response_ids[:-1]
                if finished and s.response_ids and s.response_ids[-1] == eos
                else s.response_ids
            )
            prompt = s.metadata["prompt"]
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            try:
                s.reward, extras = compute_reward(self.fn, prompt, text, finished=finished)
                s.reward_extras["reward_errors"] = 0.0
                # numbers a reward function returns beside its score
                for (
                    key,
                    value,
                ) in extras.items():
                    if isinstance(value, (int, float)) and not isinstance(value, bool):
                        s.reward_extras[f"reward/{key}"] = float(value)
            except Exception as e:  # a user's reward function must not kill the run
                s.reward, s.reward_extras["reward_errors"] = 0.0, 1.0
                if self._logged < LOGGED_ERRORS:
                    log.warning(
                        "reward function %s raised on prompt %s: %r (sample scored 0)",
                        self.fn_name,
                        prompt.uid,
                        e,
                    )
                    self._logged += 1
        return samples
