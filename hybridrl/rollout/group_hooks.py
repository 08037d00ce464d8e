"""What happens to a prompt's group of samples around its generation, the same in synchronous and
asynchronous training: a greedy baseline beside the samples, and whether the group is kept.

* **A greedy baseline** (an advantage estimator with ``needs_greedy_baseline = True``, ReMax): one
  greedy (temperature 0) response per prompt, generated beside the samples with the same weights
  and scored like them, never trained on. Its reward, plus the soft overlong penalty the samples
  get (so that ``r_i - baseline`` compares like with like), reaches every sample of the group as
  ``reward_extras["baseline_rewards"]``. The synchronous step generates the greedy responses of its
  prompts in one call (``driver/collect.py``); the asynchronous stream queues each prompt's greedy
  request beside its samples (uid + :data:`GREEDY_SUFFIX`) and completes the group when both are
  done (``rollout/stream.py``).
* **Dynamic sampling** (``algorithm.filter_groups``, DAPO): a group whose rewards are all equal has
  zero advantage, so it is dropped and more prompts are sampled. The synchronous step samples rounds
  of ``prompts_per_step`` prompts, at most ``max_sampling_rounds``, and fills a step that is still
  short with uniform groups. The asynchronous stream drops a uniform group only while it has
  credit (:class:`DynamicSampling`): the same bound, at most ``max_sampling_rounds - 1`` prompts
  dropped per group kept, so a run whose every group is uniform still trains instead of waiting
  forever.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from hybridrl.protocol import Sample

GREEDY_SUFFIX = "#greedy"  # the uid of a prompt's greedy baseline request (asynchronous stream)


def differs(group: list[Sample]) -> bool:
    """Whether the group's rewards are not all equal (equal rewards: zero group advantage)."""
    return len({s.reward for s in group}) > 1


def needs_greedy_baseline(cfg) -> bool:
    from hybridrl.algorithms import ADVANTAGES

    return getattr(ADVANTAGES.get(cfg.algorithm.advantage), "needs_greedy_baseline", False)


def greedy_request(prompt: Sample) -> Sample:
    """The prompt sample of ``prompt``'s greedy baseline: the same prompt under a uid of its own."""
    return replace(prompt, uid=prompt.uid + GREEDY_SUFFIX, metadata=dict(prompt.metadata))


def set_baselines(samples: list[Sample], greedy: list[Sample], cfg) -> None:
    """Each sample's ``reward_extras["baseline_rewards"]``: the scored greedy response to its prompt
    (matched by uid) plus the soft overlong penalty (module doc)."""
    from hybridrl.algorithms import overlong_penalty

    alg = cfg.algorithm
    lengths = torch.tensor([len(s.response_ids) for s in greedy])
    penalty = overlong_penalty(
        lengths, cfg.rollout.max_new_tokens, alg.overlong_buffer, alg.overlong_penalty
    )
    by_uid = {
        s.uid.removesuffix(GREEDY_SUFFIX): s.reward + p for s, p in zip(greedy, penalty.tolist())
    }
    for s in samples:
        s.reward_extras["baseline_rewards"] = by_uid[s.uid]


class DynamicSampling:
    """The asynchronous stream's rule for a uniform group (module doc): dropped while credit lasts.
    The credit starts at ``(max_sampling_rounds - 1) * prompts_per_step`` (a synchronous step's
    most), each kept group adds ``max_sampling_rounds - 1``, up to that start."""

    def __init__(self, cfg):
        self.per_kept = cfg.algorithm.max_sampling_rounds - 1
        self.cap = self.credit = self.per_kept * cfg.trainer.prompts_per_step
        self.dropped = self.kept = self.uniform_kept = 0

    def keep(self, group: list[Sample]) -> bool:
        if differs(group):
            self.kept += 1
            self.credit = min(self.cap, self.credit + self.per_kept)
            return True
        if self.credit >= 1:
            self.credit -= 1
            self.dropped += 1
            return False
        self.uniform_kept += 1  # out of credit: trained on, with zero advantage
        return True

    def stats(self) -> dict[str, float]:
        """Since the last call: groups dropped, and the informative share of those kept."""
        kept = self.kept + self.uniform_kept
        out = {
            "async/dropped_groups": float(self.dropped),
            "rollout/informative_frac": self.kept / kept if kept else 1.0,
        }
        self.dropped = self.kept = self.uniform_kept = 0
        return out
