"""A dead rollout rank of a ``ray`` run, replaced without stopping the learner.

With a pool of its own the rollout's processes are its alone, so the learner's actors outlive it.
When the death watch (``controller/health.py``) finds a rollout rank dead, or a call into it finds
it dead, the trajectory buffer is paused
(:meth:`~hybridrl.rollout.buffer.TrajectoryBuffer.interrupt`): every generating prompt is handed out
again and a learner waiting for a batch stops with ``REPLACING``. The driver then, between learner
steps (:meth:`RolloutReplacer.replace`): kills the old rollout group, builds a new one on the same
pool, syncs the learner's current weights to it, and starts its stream again (on its thread, or for
the next fill), which admits the pending prompts first; the step, or the synchronous step's fill, is
tried again. A prompt's samples are seeded by the run's seed and its uid, so in synchronous training
the new rollout generates the batch the dead one would have, and the run ends as if it had not died.
Nothing is restored from a checkpoint: ``fault/restarts`` and ``fault/rollout_replacements`` count
it (within ``trainer.max_restarts``), ``fault/lost_steps`` stays. A rollout beside another role
(colocated, or with a reward model) is not replaced: the buffer is closed and the run restarts as
before (``driver/restarts.py``), as it does when a replacement fails.
"""

from __future__ import annotations

import logging

from hybridrl.controller import WorkerGroup
from hybridrl.controller.worker import WorkerDiedError, WorkerError
from hybridrl.parallel import weight_sync
from hybridrl.protocol import REPLACING
from hybridrl.rollout.worker import RolloutWorker

log = logging.getLogger(__name__)


class RolloutReplacementError(RuntimeError):
    """A dead rollout could not be replaced (the run restarts from its checkpoint)."""


def rollout_group(cfg, old: WorkerGroup, policy_path: str | None) -> WorkerGroup:
    """A new rollout group on ``old``'s pool, built as ``build_roles`` builds it, with its call
    bounds."""
    c = cfg.controller
    group = WorkerGroup(
        RolloutWorker,
        old.pool,
        role="rollout",
        args=(cfg, policy_path),
        backend=c.backend,
        num_threads=c.pools[c.pool_of("rollout")].num_threads or c.num_threads,
        seed=cfg.trainer.seed,
        env={"HYBRIDRL_PG_TIMEOUT_S": str(c.pg_timeout_s)},
    )
    group._timeouts = dict(old._timeouts)
    return group


class RolloutReplacer:
    """The driver's learner and rollout calls, with a dead rollout replaced."""

    def __init__(self, s, buffer, version: int):
        self.s, self.buffer, self.version = s, buffer, version
        self.threaded = s.cfg.trainer.mode == "async"  # how the new rollout's stream runs
        r = s.roles
        self.able = (
            isinstance(r.rollout, WorkerGroup)
            and r.rollout.backend_name == "ray"
            and r.reward_model is None
        )
        self.death: WorkerError | None = None
        self.watch = s.watch_rollout(buffer.interrupt if self.able else buffer.close)

    def stop(self) -> None:
        self.watch.stop()

    def train_step(self, step: int) -> dict:
        """The learner's step ``step``, tried again after a replacement."""
        while True:
            try:
                return self.s.roles.learner.train_step(step, self.buffer)
            except WorkerError as exc:
                if not self.able or REPLACING not in str(exc):
                    raise
            self.replace()

    def fill(self) -> None:
        """Synchronous training: the step's batch generated into the buffer (by a new rollout, if
        it died)."""
        while True:
            if not self.buffer.interrupted():
                try:
                    return self.s.roles.rollout.fill_stream()
                except WorkerDiedError as exc:
                    self._died(exc)
            self.replace()

    def sync(self, version: int) -> None:
        """The learner's weights ``version`` to the rollout (a new one, if it died)."""
        self.version = version
        if not self.buffer.interrupted():
            try:
                return self.s.roles.sync_weights(version)
            except WorkerDiedError as exc:
                self._died(exc)
        self.replace()

    def stats(self) -> dict:
        try:
            return self.s.roles.rollout.stats()
        except WorkerDiedError as exc:
            self._died(exc)
            self.replace()
            return {}

    def _died(self, exc: WorkerDiedError) -> None:
        if not self.able or exc.role != "rollout":
            raise exc
        self.death = exc
        self.buffer.interrupt(str(exc).splitlines()[0])

    def replace(self) -> None:
        """Kill the rollout group, build a new one on its pool, give it the current weights, and
        restart the stream on the buffer's pending prompts first."""
        s, roles = self.s, self.s.roles
        reason = self.buffer.interrupted() or "a rollout rank died"
        self.watch.stop()
        death = self.death or self.watch.error
        old = roles.rollout
        log.warning("replacing the rollout at version %d after: %s", self.version, reason)
        try:
            if s.faults.used >= s.faults.max_restarts:  # counted as restarts: bounded as they are
                raise RuntimeError(
                    f"no restart left (trainer.max_restarts={s.faults.max_restarts})"
                )
            try:
                old.shutdown()
            except Exception as exc:  # noqa: BLE001 - its actors are dead or killed either way
                log.warning("shutting down the dead rollout: %s", exc)
            new = rollout_group(s.cfg, old, s.warm)
            roles.groups[:] = [new if g is old else g for g in roles.groups]
            if s.watchdog is not None:
                s.watchdog.groups[:] = [new if g is old else g for g in s.watchdog.groups]
            roles.rollout = s.evaluate.rollout = new
            roles.transport = weight_sync.choose_transport(roles.learner, new)
            roles.sync_weights(self.version)
            self.buffer.unpause()
            new.start_stream(self.buffer, s.params, s.cfg.trainer.seed, self.threaded)
        except Exception as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise RolloutReplacementError(f"replacing the dead rollout failed: {first}") from (
                death or exc
            )
        s.faults.used += 1
        s.faults.restarts += 1
        s.faults.rollout_replacements += 1
        self.death = None
        self.watch = s.watch_rollout(self.buffer.interrupt)
