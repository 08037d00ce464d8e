"""What happens to a prompt's group of samples around its generation, in synchronous and
asynchronous training alike: a greedy baseline beside the samples (the rollout stream,
``rollout/stream.py``), and whether the group is kept (the trajectory buffer, as the stream puts
it, ``rollout/buffer.py``).

* **A greedy baseline** (an advantage estimator with ``needs_greedy_baseline = True``, ReMax): one
  greedy (temperature 0) response per prompt, generated beside the samples with the same weights
  and scored like them, never trained on. Its reward, plus the soft overlong penalty the samples
  get (so that ``r_i - baseline`` compares like with like), reaches every sample of the group as
  ``reward_extras["baseline_rewards"]``. The stream queues each prompt's greedy request beside its
  samples (uid + :data:`GREEDY_SUFFIX`) and completes the group when both are done.
* **Dynamic sampling** (``algorithm.filter_groups``, DAPO): a group whose rewards are all equal has
  zero advantage, so it is dropped and another prompt is admitted in its place, while the trajectory
  buffer has credit (:class:`DynamicSampling`): at most ``max_sampling_rounds - 1`` prompts dropped
  per group kept, ``(max_sampling_rounds - 1) * prompts_per_step`` to start (DAPO's cap of
  ``max_sampling_rounds`` generate rounds per step). Out of credit a uniform group is trained on
  with zero advantage, so a run whose every group is uniform still trains instead of waiting
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
    """The rule for a uniform group (module doc): dropped while credit lasts. The credit starts at
    ``(max_sampling_rounds - 1) * prompts_per_step``, each kept group adds ``max_sampling_rounds -
    1``, up to that start. The trajectory buffer holds it, so the rollout ranks share one credit and
    a checkpoint keeps it (``credit``: the one saved)."""

    def __init__(self, max_sampling_rounds: int, prompts_per_step: int, credit: int | None = None):
        self.per_kept = max_sampling_rounds - 1
        self.cap = self.per_kept * prompts_per_step
        self.credit = self.cap if credit is None else credit
        self.dropped = 0

    @classmethod
    def of(cls, cfg, credit: int | None = None) -> DynamicSampling | None:
        """The run's rule, None when ``algorithm.filter_groups`` is off."""
        alg = cfg.algorithm
        if not alg.filter_groups:
            return None
        return cls(alg.max_sampling_rounds, cfg.trainer.prompts_per_step, credit)

    def keep(self, group: list[Sample]) -> bool:
        if differs(group):
            self.credit = min(self.cap, self.credit + self.per_kept)
            return True
        if self.credit >= 1:
            self.credit -= 1
            self.dropped += 1
            return False
        return True  # out of credit: trained on, with zero advantage

    def stats(self) -> dict[str, float]:
        """Since the last call: the groups dropped (the informative share of those trained is a
        batch metric, ``rollout/informative_frac``)."""
        out, self.dropped = {"rollout/dropped_groups": float(self.dropped)}, 0
        return out
