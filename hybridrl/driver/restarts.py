"""Runs that come back: after a worker died or a rollout call timed out, the run restarts by itself
from its newest complete checkpoint, up to ``trainer.max_restarts`` times.

:func:`run_with_restarts` wraps the driver (``driver/loop.py``). A step
that fails for one of these reasons

* a worker process died (:class:`~hybridrl.controller.WorkerDiedError`: SIGKILL, out of memory,
  a lost node; a dead rollout rank in an asynchronous run is found by a
  :class:`~hybridrl.controller.health.DeathWatch`),
* a rollout ``generate`` call ran past ``rollout.timeout_s`` (its workers were killed,
  :class:`~hybridrl.controller.health.CallTimeoutError`),
* an asynchronous learner got no batch within ``asynchronous.batch_timeout_s`` (``ray`` backend),

leaves the driver as usual (every role shut down, every placement group released, the metrics
flushed); then one warning names what failed and why, and the driver runs again with the exact
resume of ``--resume`` (``driver/session.py``): new actors in new placement groups, the learner
restored from the newest checkpoint that verifies (weights, optimizer, RNG, prompt cursor; the
asynchronous buffer's pending prompts), the rollout given the restored weights. With no checkpoint
yet it starts again from step 0 in the same run directory (the warm start is cached, the held-out
evaluation before training is kept). The steps done after that checkpoint are done again: at most
``trainer.save_every``. Nothing else is retried: a configuration error, a hung step
(``StepTimeoutError``: its stacks are dumped and the run stops), a checkpoint that cannot be written
(``CheckpointError``), an exception raised by user code, an interrupt.

Counters: ``fault/restarts`` and ``fault/lost_steps`` (steps computed again, cumulative) are logged
on every step once a run has restarted, kept in ``trainer.json`` (a later ``--resume`` counts on),
and ``summary.json`` holds ``restarts`` and ``lost_steps``; each restart also appends a row
``worker_restart`` to ``alerts.jsonl``. A dead rollout on a pool of its own (``ray``) is replaced in
place instead, the learner going on (``driver/replace.py``, ``fault/rollout_replacements``). Past
``trainer.max_restarts`` restarts in one invocation the run stops with
:class:`RestartsExhaustedError`, whose one line is the last failure's.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hybridrl.config import Config, ConfigError
from hybridrl.controller.health import CallTimeoutError
from hybridrl.controller.worker import WorkerDiedError, WorkerError

log = logging.getLogger(__name__)

# the learner's TimeoutError when the trajectory buffer held no batch in time (rollout/buffer.py)
BATCH_TIMEOUT_KEY = "asynchronous.batch_timeout_s"
# what a worker reports when an actor it calls died (a rollout rank calling the reward model)
ACTOR_DIED = ("ActorDiedError", "RayActorError", "ActorUnavailableError")


class RestartsExhaustedError(RuntimeError):
    """A run failed for a reason that restarts it, once more than ``trainer.max_restarts`` allows;
    one line: the failure's own first line and the count."""


@dataclass
class Faults:
    """A run's fault counters, and what a failed attempt hands to the next.

    ``restarts`` and ``lost_steps`` count over the whole run (``--resume`` reads them back);
    ``used``: the restarts of this invocation, which ``max_restarts`` bounds; ``reached``: the last
    step the current attempt logged; ``restarting``: the reason, while the next session is a
    restart; ``before``: the held-out evaluation before training, reused by a restart that finds no
    checkpoint.
    """

    max_restarts: int
    restarts: int = 0
    lost_steps: int = 0
    rollout_replacements: int = 0  # dead rollouts replaced in place (driver/replace.py)
    used: int = 0
    reached: int = 0
    restarting: str | None = None
    before: dict | None = None

    def metrics(self) -> dict[str, float]:
        """The step's ``fault/*`` metrics: none until the run has restarted."""
        if not self.restarts:
            return {}
        out = {"fault/restarts": float(self.restarts), "fault/lost_steps": float(self.lost_steps)}
        if self.rollout_replacements:  # only once a rollout was replaced (driver/replace.py)
            out["fault/rollout_replacements"] = float(self.rollout_replacements)
        return out

    def state(self) -> dict[str, int]:
        """What ``trainer.json`` keeps (key ``fault``)."""
        out = {"restarts": self.restarts, "lost_steps": self.lost_steps}
        if self.rollout_replacements:
            out["rollout_replacements"] = self.rollout_replacements
        return out

    def load(self, saved: dict | None) -> None:
        """The counters of a checkpoint's ``trainer.json`` (``--resume`` continues them)."""
        if saved:
            self.restarts, self.lost_steps = int(saved["restarts"]), int(saved["lost_steps"])
            self.rollout_replacements = int(saved.get("rollout_replacements", 0))

    def restarted(self, run_dir: Path, step: int) -> None:
        """Called by the session of a restart once it restored ``step``: counts the lost steps, and
        writes the warning and the ``alerts.jsonl`` row."""
        lost = max(self.reached - step, 0)
        self.lost_steps += lost
        message = (
            f"restart {self.used} of at most {self.max_restarts} (trainer.max_restarts) from "
            f"step {step}, {lost} step(s) to do again, after: {self.restarting}"
        )
        log.info("restored step %d: %d step(s) to do again", step, lost)
        row = {
            "step": step,
            "alert": "worker_restart",
            "value": self.restarts,
            "threshold": self.max_restarts,
            "message": message,
        }
        with open(run_dir / "alerts.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        self.restarting, self.reached = None, step


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and every exception it was raised from or while handling, each once."""
    out, todo = [], [exc]
    while todo:
        e = todo.pop()
        if e is None or any(e is seen for seen in out):
            continue
        out.append(e)
        todo += [e.__cause__, e.__context__]
    return out


def restart_reason(exc: BaseException, backend: str) -> str | None:
    """The one-line reason why ``exc`` restarts the run, or None when it must stop it: a dead
    worker (or, ``ray``, a worker that reports an actor it called as dead: the reward model), a
    rollout call past its timeout, or (``ray``) an asynchronous learner with no batch in time;
    never a hang (``StepTimeoutError``), a checkpoint that failed, a bad config, an
    interrupt, or an error of the user's code."""
    from hybridrl.driver.checkpoint import CheckpointError
    from hybridrl.telemetry.watchdog import StepTimeoutError

    chain = _chain(exc)
    stops = (StepTimeoutError, CheckpointError, ConfigError, KeyboardInterrupt, SystemExit)
    if any(isinstance(e, stops) for e in chain):
        return None
    # the earliest failure first: the later ones were raised while stopping because of it
    for e in reversed(chain):
        if isinstance(e, (WorkerDiedError, CallTimeoutError)):
            return str(e).splitlines()[0]
    for e in reversed(chain):
        if (
            backend == "ray"
            and isinstance(e, WorkerError)
            and (BATCH_TIMEOUT_KEY in e.detail or e.detail.startswith(ACTOR_DIED))
        ):
            return str(e).splitlines()[0]
    return None


def run_with_restarts(train: Callable[..., dict], cfg: Config, resume: bool) -> dict:
    """``train(cfg, resume=..., faults=...)``, run again (resuming) after each failure that
    :func:`restart_reason` accepts, up to ``trainer.max_restarts`` times."""
    faults = Faults(cfg.trainer.max_restarts)
    while True:
        try:
            return train(cfg, resume=resume, faults=faults)
        except BaseException as exc:
            reason = restart_reason(exc, cfg.controller.backend)
            if reason is None:
                raise
            if faults.used >= faults.max_restarts:
                log.error("the run stops: %s", exc)
                used = f"{faults.used} restart(s)" if faults.used else "no restart"
                raise RestartsExhaustedError(
                    f"{reason} [{used}: trainer.max_restarts={faults.max_restarts}]"
                ) from exc
            faults.used += 1
            faults.restarts += 1
            faults.restarting = reason
            log.warning(
                "worker failure, restarting from the last checkpoint (%d of %d): %s",
                faults.used,
                faults.max_restarts,
                reason,
            )
            resume = True
