"""Health of ``ray`` worker groups: heartbeats, call timeouts and a watcher for dead ranks.

* **Heartbeat.** Every actor answers ``heartbeat()`` on a thread of its own (the Ray concurrency
  group :data:`HEALTH_GROUP`), so it answers while the rank is busy in a call. It returns the
  worker's own ``heartbeat()`` when the worker has one (a rollout rank: engine steps taken and
  seconds since the last one, ``rollout/worker.py``), else ``{}``. Nothing is sent unless the driver
  asks.
* **Call timeout.** :meth:`WorkerGroup.set_call_timeout` bounds a method's calls (the rollout's
  ``generate`` by ``rollout.timeout_s``): a call past it has its ranks' heartbeats read, the
  group's actors killed (``ray.kill``), and raises :class:`CallTimeoutError` naming the rank, the
  timeout and the heartbeat, e.g. ``worker role 'rollout' rank 0 failed in generate(): exceeded
  rollout.timeout_s=600 s (no engine step for 412 s, 37 taken, 600 s into the call); its workers
  were killed``. Under the ``local`` backend a call runs in the driver's thread and cannot be
  stopped: no call timeout applies there.
* **Watcher.** :class:`DeathWatch` asks a group's ranks for their heartbeat every few seconds from a
  daemon thread, and calls back once when a rank is found dead: the asynchronous driver closes the
  trajectory buffer then, so the learner stops waiting for batches that will never come.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from typing import Any

from hybridrl.controller.worker import WorkerDiedError, WorkerError

log = logging.getLogger(__name__)

# Ray concurrency group of the heartbeat: one thread of its own in every actor
HEALTH_GROUP = "health"
# seconds to wait for the heartbeats of a timed-out call's ranks before killing them
HEARTBEAT_WAIT_S = 5.0
# seconds between two heartbeat rounds of a DeathWatch
WATCH_EVERY_S = 2.0


class Progress:
    """A worker's progress for its heartbeat, cheap enough for every engine step: the steps counted
    by :meth:`counting`, when the last one ended, and how long the call in :meth:`busy` has run."""

    def __init__(self):
        self.steps = 0
        self.last = time.monotonic()
        self.busy_since: float | None = None

    def counting(self, step):
        """``step`` wrapped to count each call that returns."""

        @functools.wraps(step)
        def counted(*args, **kwargs):
            out = step(*args, **kwargs)
            self.steps, self.last = self.steps + 1, time.monotonic()
            return out

        return counted

    @contextlib.contextmanager
    def busy(self):
        """Marks a call; a call that has taken no step yet is as old as the call."""
        self.busy_since = time.monotonic()
        try:
            yield
        finally:
            self.busy_since, self.last = None, time.monotonic()

    def beat(self) -> dict:
        """``steps``, ``step_age_s`` (seconds since the last step, or since the call began when that
        is later) and ``busy_s`` (seconds in the current call; 0 when idle)."""
        now, since = time.monotonic(), self.busy_since
        return {
            "steps": self.steps,
            "step_age_s": now - max(self.last, since or self.last),
            "busy_s": 0.0 if since is None else now - since,
        }


class CallTimeoutError(WorkerError):
    """A call ran past the timeout set for its method; the group's actors were killed.

    ``rank``: the lowest rank still running when the timeout struck; ``detail``: the timeout and
    what the ranks' heartbeats said.
    """


def describe_heartbeat(beat: dict | None) -> str:
    """A rank's heartbeat in words: ``no engine step for 412 s, 37 taken, 415 s into the call`` (a
    worker that reports engine steps), ``busy for 30 s`` (one that reports only its call), ``no
    heartbeat``."""
    if not beat:
        return "no heartbeat" if beat is None else "it reports no progress"
    busy = beat.get("busy_s") or 0.0
    call = f", {_secs(busy)} s into the call" if busy else ""
    if "step_age_s" in beat:
        age, steps = _secs(beat["step_age_s"]), beat.get("steps", 0)
        return f"no engine step for {age} s, {steps} taken{call}"
    if busy:
        return f"busy for {_secs(busy)} s"
    return ", ".join(f"{k}={v}" for k, v in beat.items())


def _secs(x: float) -> str:
    return f"{x:.1f}" if x < 10 else f"{x:.0f}"


def heartbeats(ray, actors: dict[int, Any], wait_s: float = HEARTBEAT_WAIT_S) -> dict:
    """``{rank: heartbeat dict, or None when it did not answer within wait_s}`` of ``actors``
    (``{rank: actor handle}``)."""
    refs = {rank: a.heartbeat.options(concurrency_group=HEALTH_GROUP).remote() for rank, a in
            actors.items()}  # fmt: skip
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=wait_s)
    out: dict[int, dict | None] = {}
    for rank, ref in refs.items():
        try:
            out[rank] = ray.get(ref) if ref in ready else None
        except Exception:  # noqa: BLE001 - a dead rank simply has no heartbeat
            out[rank] = None
    return out


def timed_out(backend, ranks: list[int], timeout_s: float, setting: str, what: str):
    """The :class:`CallTimeoutError` of call ``what`` (``role.method``), still running on
    ``ranks`` after ``timeout_s`` (``setting``: the config key that set it); reads their
    heartbeats, then kills every actor of the ``backend``'s group."""
    beats = heartbeats(backend._ray, {r: backend.actors[r] for r in ranks})
    for actor in backend.actors:
        try:
            backend._ray.kill(actor, no_restart=True)
        except Exception as exc:  # noqa: BLE001 - kill the others still
            log.warning("killing a timed-out actor failed: %s", exc)
    rank = min(ranks)
    others = "".join(f"; rank {r}: {describe_heartbeat(beats[r])}" for r in sorted(ranks)[1:])
    role, _, method = what.rpartition(".")
    return CallTimeoutError(
        role,
        rank,
        method,
        f"exceeded {setting}={timeout_s:g} s ({describe_heartbeat(beats[rank])}{others}); "
        "its workers were killed",
    )


def refusal(broken: WorkerError, method: str) -> WorkerError:
    """The error of a call into a group that a death or a timeout broke: the first error again,
    with the refused call named."""
    note = f"  the group takes no more calls (this one: {method}()); shut it down"
    if isinstance(broken, WorkerDiedError):
        b = broken
        return WorkerDiedError(b.role, b.rank, b.method, b.detail, b.where, note)
    return type(broken)(broken.role, broken.rank, broken.method, f"{broken.detail}\n{note}")


class DeathWatch:
    """Every ``every_s`` seconds, the heartbeats of ``group``'s ranks (a ``ray`` WorkerGroup); when
    one rank's actor is dead, ``on_death(message)`` once (the message: the group's
    :class:`WorkerDiedError`'s first line) and the watch ends. :meth:`stop` ends it first."""

    def __init__(self, group, on_death, every_s: float = WATCH_EVERY_S):
        self.group, self.on_death, self.every_s = group, on_death, every_s
        self.error: WorkerDiedError | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hybridrl-death-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        backend = self.group._backend
        ray = backend._ray
        while not self._stop.wait(self.every_s):
            refs = {
                rank: actor.heartbeat.options(concurrency_group=HEALTH_GROUP).remote()
                for rank, actor in enumerate(list(backend.actors))
            }
            for rank, ref in refs.items():
                try:
                    ray.get(ref, timeout=60)
                except ray.exceptions.RayActorError as err:
                    if self._stop.is_set():
                        return
                    self.error = backend._died(rank, "heartbeat", err, {}, [])
                    message = str(self.error).splitlines()[0]
                    log.warning("%s", message)
                    try:
                        self.on_death(message)
                    except Exception as exc:  # noqa: BLE001 - the watch must end quietly
                        log.warning("after a dead rank was found: %s", exc)
                    return
                except Exception:  # noqa: BLE001 - slow or odd answers are not deaths
                    continue
