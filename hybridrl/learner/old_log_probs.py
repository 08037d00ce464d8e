"""The old log-probs an on-policy update notes from its own first forward.

On-policy (one epoch over one mini-batch) the update's first forward runs the proximal weights on
the same micro-batches as the separate old-log-prob pass would, so the learner takes the old
log-probs from it (π_old := sg[π_θ], ratio exactly 1) instead of running the pass. That needs
bookkeeping the update loop knows nothing about: each row carries its index (:data:`ROW`) so that a
micro-batch's log-probs land at its rows, and the noted tensor outlives the update until the step
reads it back for the train-rollout gap metrics. It lives here, apart from the learner's passes, so
that the whole life of the noted tensor (started, filled, taken once) reads in one place.
"""

from __future__ import annotations

import torch

from hybridrl.learner.update import is_single_pass
from hybridrl.protocol import Batch

# a batch column: each row's index, so the update's forward can note its old log-probs
ROW = "update_row"


def check_single_pass(actor, total: int) -> None:
    """Raise unless the update over ``total`` rows (the global batch: every rank's, each pipeline
    replica counted once) is one epoch over one mini-batch, the only update whose first forward is
    the old policy's."""
    if not is_single_pass(actor, total):
        raise ValueError(
            "update_actor: a batch without old_log_probs needs one epoch over one "
            f"mini-batch, got ppo_epochs={actor.ppo_epochs}, "
            f"ppo_minibatch_size={actor.ppo_minibatch_size} for {total} rows; "
            "run compute_log_prob first"
        )


class NotedOldLogProbs:
    """The old log-probs of the running or last update: noted by its forward (:meth:`expect`, then
    :meth:`keep` per micro-batch) or given by a separate pass (:attr:`taken` set directly), and
    handed out once (:meth:`take`)."""

    def __init__(self):
        self.taken: torch.Tensor | None = None

    def expect(self, batch: Batch) -> Batch:
        """Start noting for ``batch``: ``batch`` with each row's index, for :meth:`keep`."""
        self.taken = torch.zeros(tuple(batch["responses"].shape), dtype=torch.float32)
        return batch | Batch({ROW: torch.arange(len(batch))})

    def keep(self, mb: Batch, logp: torch.Tensor) -> Batch:
        """A micro-batch of a noting update (it has :data:`ROW`): this forward's log-probs are the
        old policy's; note them at the micro-batch's rows (valid tokens only: a dummy micro-batch
        repeats a row with an empty mask) and return ``mb`` with them detached as
        ``old_log_probs``. Any other micro-batch: ``mb`` as it is."""
        if ROW not in mb:
            return mb
        old = logp.detach().float()
        rows, width, mask = mb[ROW], old.shape[1], mb["response_mask"].bool()
        kept = self.taken[rows.cpu(), :width]
        self.taken[rows.cpu(), :width] = torch.where(mask.cpu(), old.cpu(), kept)
        return mb | Batch({"old_log_probs": old})

    def take(self, batch: Batch) -> Batch:
        """The noted old log-probs for this rank's rows of ``batch`` (the batch the update trained
        on); afterwards none are held."""
        old, self.taken = self.taken, None
        if old is None or len(old) != len(batch):
            raise RuntimeError(
                "old_log_probs_of_last_update: the last update_actor was not given a batch "
                "without old_log_probs"
            )
        return Batch({"old_log_probs": old})
