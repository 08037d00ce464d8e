"""A learner rank's share of a run checkpoint: the policy and the critic, now or in the background.

The driver saves a run (``driver/checkpoint.py``) by calling ``Learner.save_checkpoint`` on every
rank. What a rank writes is decided here: nothing at all when a weight is NaN or inf (a checkpoint
must never hold a broken state), then the policy in whichever form it takes
(``learner/policy_io.py``) and the critic, either written now or snapshotted now and written on a
background thread (``trainer.async_save``, ``learner/state.py``: ``BackgroundWriter``) with one save
in flight at most. A background write that fails removes what the rank wrote before it reports: on
a full disk the space is back at once, for the rank's marker, the driver's files and the run's logs,
instead of when the driver next waits. It lives apart from the learner's passes because none of them
reads it.
"""

from __future__ import annotations

import shutil

from hybridrl.learner import policy_io
from hybridrl.learner.state import check_finite, save_trainable


def save(learner, path: str, critic_path: str | None, marker: str | None) -> str | None:
    """``Learner.save_checkpoint``: the policy under ``path``, the critic under ``critic_path``;
    with ``marker`` in the background, returning the path of the rank's marker file."""
    critic = learner.critic.model if learner.critic is not None else None
    check_finite({"policy": learner.model, "critic": critic})
    writer = None
    if marker is not None:
        learner.wait_checkpoint()  # one save in flight at most
        writer = learner.writer
    policy_io.save(learner, path, writer)
    if learner.critic is not None and critic_path is not None:
        c = learner.critic
        save_trainable(critic_path, c.model, c.optimizer, c.shuffle, background=writer)
    if writer is None:
        return None
    removing_on_failure(writer, [path, critic_path])
    writer.start(f"{marker}-rank{learner.rank}")
    return f"{marker}-rank{learner.rank}"


def removing_on_failure(writer, paths: list[str | None]) -> None:
    """The writes queued on ``writer``, as one write that removes ``paths`` (this save's output
    directories) when any of them fails, then fails the same way."""
    jobs, writer.jobs = writer.jobs, []

    def run() -> None:
        try:
            for job in jobs:
                job()
        except BaseException:
            for path in paths:
                if path is not None:
                    shutil.rmtree(path, ignore_errors=True)
            raise

    writer.add(run)


def load(learner, path: str, critic_path: str | None) -> None:
    """``Learner.load_state``: the policy from ``path``, the critic from ``critic_path``."""
    policy_io.load(learner, path)
    if learner.critic is not None and critic_path is not None:
        learner.critic.load(critic_path)
