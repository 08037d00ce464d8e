"""Scoring where the samples are generated: each rollout rank decodes its responses and scores them
with the configured reward function (``task.reward_fn``), in both training modes.

Numbers a reward function returns beside its score (``{"score": ..., "format": 1.0}``) become
``reward_extras["reward/<name>"]`` and are logged as means.

A failed reward call does not stop the run: the sample scores 0, its
``reward_extras["reward_errors"]`` is 1 (0 for a sample scored normally), and the first
:data:`LOGGED_ERRORS` failures of each kind are logged. The failures are:

- the reward function raised;
- its score is not a finite float32 (NaN, inf, or beyond float32's range such as ``1e300``: the
  batch stores rewards as float32, and one infinite reward turns every advantage, and then every
  weight, into NaN); such a sample also has ``reward_extras["reward_nonfinite"]`` = 1;
- the call took longer than ``task.reward_timeout_s``; such a sample also has
  ``reward_extras["reward_timeouts"]`` = 1.

Every scored sample carries the three counts (0 or 1), so they become batch columns and the step's
metrics sum them: ``reward/errors``, ``reward/nonfinite`` and ``reward/timeouts``.

Timeouts: Python cannot stop a thread, so each reward call runs on a helper daemon thread
(:class:`TimedCalls`) and the scorer waits for it at most ``task.reward_timeout_s``. A thread whose
call times out is abandoned (it exits if the call ever returns) and a fresh thread takes the next
call, so one hung call costs one timeout and does not block later samples. An abandoned thread keeps
whatever it holds (CPU, memory, a connection) until its call returns, so once
:data:`MAX_HUNG_CALLS` abandoned calls are still running the scorer raises
:class:`RewardFunctionHung` and the run stops with an error naming the reward function, rather than
piling up threads. The trade-off of running reward functions off the calling thread: a reward
function cannot use ``signal`` (e.g. ``signal.alarm`` for its own timeout), which works only on the
main thread, and thread-local state it sets is not seen by the next call, which may run on another
thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

from hybridrl.config import Config
from hybridrl.protocol import Sample
from hybridrl.tasks import REWARDS, compute_reward
from hybridrl.tasks.base import NonFiniteReward

log = logging.getLogger(__name__)
LOGGED_ERRORS = 5  # reward-call failures of each kind logged in full per scorer; later only counted
MAX_HUNG_CALLS = 8  # timed-out reward calls still running when the scorer gives up on the run


# what a scored sample's reward_extras count (every failure is also a reward error)
FAILURE_COUNTS = {"reward_errors": 0.0, "reward_nonfinite": 0.0, "reward_timeouts": 0.0}


class RewardTimeout(TimeoutError):
    """A reward call took longer than its timeout (its thread is abandoned)."""


class RewardFunctionHung(RuntimeError):
    """Too many timed-out reward calls are still running: the run stops."""


class _Call:
    __slots__ = ("fn", "args", "kwargs", "done", "result", "error")

    def __init__(self, fn: Callable, args: tuple, kwargs: dict):
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None


def _serve(calls: queue.SimpleQueue) -> None:
    """A helper thread's loop: run calls until ``None`` (no reference to its pool, so an unused
    pool can be collected)."""
    while (call := calls.get()) is not None:
        try:
            call.result = call.fn(*call.args, **call.kwargs)
        except BaseException as e:  # handed to the waiting caller
            call.error = e
        finally:
            call.done.set()
        del call


class _Helper:
    def __init__(self, name: str):
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=_serve, args=(self.calls,), name=name, daemon=True)
        self.thread.start()


def _stop(idle: list[_Helper]) -> None:
    for helper in idle:
        helper.calls.put(None)
    idle.clear()


class TimedCalls:
    """Runs calls on reusable daemon helper threads, waiting at most ``timeout_s`` for each.

    Thread-safe: concurrent callers each get an idle helper (a new one when none is idle). A call
    that times out raises :class:`RewardTimeout` and its helper is abandoned; when ``max_hung``
    abandoned calls are still running, :class:`RewardFunctionHung` is raised instead. Idle helpers
    exit on :meth:`close` or when the pool is garbage-collected.
    """

    def __init__(self, timeout_s: float, name: str, max_hung: int = MAX_HUNG_CALLS):
        self.timeout_s, self.name, self.max_hung = timeout_s, name, max_hung
        self._idle: list[_Helper] = []
        self._hung: list[_Helper] = []  # abandoned helpers (pruned once their call returned)
        self._lock = threading.Lock()
        self._created = 0
        self._finalizer = weakref.finalize(self, _stop, self._idle)

    def __call__(self, fn: Callable, *args, **kwargs):
        with self._lock:
            if self._idle:
                helper = self._idle.pop()
            else:
                self._created += 1
                helper = _Helper(f"{self.name}-{self._created}")
        call = _Call(fn, args, kwargs)
        helper.calls.put(call)
        try:
            finished = call.done.wait(self.timeout_s)
        except BaseException:  # interrupted while waiting: the helper exits once its call returns
            helper.calls.put(None)
            raise
        if finished:
            with self._lock:
                self._idle.append(helper)
            if call.error is not None:
                error, call.error = call.error, None
                raise error
            return call.result
        helper.calls.put(None)  # the helper exits if the call ever returns
        with self._lock:
            self._hung = [h for h in self._hung if h.thread.is_alive()] + [helper]
            hung = len(self._hung)
        if hung >= self.max_hung:
            raise RewardFunctionHung(
                f"{self.name}: {hung} calls ran past the {self.timeout_s:g} s timeout and are "
                "still running; stopping the run (fix the function, or raise the timeout)"
            )
        raise RewardTimeout(f"took longer than {self.timeout_s:g} s")

    @property
    def hung(self) -> int:
        """Abandoned calls still running."""
        with self._lock:
            self._hung = [h for h in self._hung if h.thread.is_alive()]
            return len(self._hung)

    def close(self) -> None:
        """Let the idle helpers exit (a later call starts new ones)."""
        with self._lock:
            _stop(self._idle)


class Scorer:
    def __init__(self, cfg: Config, tokenizer):
        self.tokenizer = tokenizer
        from hybridrl.tasks import TASKS

        name = (cfg.task.reward_fns() or [TASKS.get(cfg.task.name).default_reward])[0]
        self.fn = REWARDS.get(name) if isinstance(name, str) else name
        self.fn_name = name if isinstance(name, str) else getattr(name, "__qualname__", repr(name))
        self.timeout_s = cfg.task.reward_timeout_s
        self.calls = TimedCalls(self.timeout_s, f"reward function {self.fn_name}")
        self._logged: dict[str, int] = {}  # failures logged, by kind

    def __call__(self, samples: list[Sample]) -> list[Sample]:
        """Sets ``reward`` and ``reward_extras["reward_errors"]`` of each sample (in place), and
        ``reward_extras["reward_nonfinite"]`` / ``["reward_timeouts"]`` (1) of a sample that failed
        that way (absent: 0); returns them. Raises :class:`RewardFunctionHung` when too many reward
        calls hang."""
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
            s.reward_extras.update(FAILURE_COUNTS)  # all 0: a failure below sets its own to 1
            try:
                s.reward, extras = self.calls(
                    compute_reward, self.fn, prompt, text, finished=finished
                )
            except RewardFunctionHung:
                raise
            except RewardTimeout:
                self._failed(s, "reward_timeouts", f"took longer than {self.timeout_s:g} s on")
            except NonFiniteReward as e:
                self._failed(s, "reward_nonfinite", f"returned score {e.score!r} (not finite) on")
            except Exception as e:  # a user's reward function must not kill the run
                self._failed(s, "reward_errors", f"raised {e!r} on")
            else:  # numbers a reward function returns beside its score
                for key, value in extras.items():
                    if isinstance(value, (int, float)) and not isinstance(value, bool):
                        s.reward_extras[f"reward/{key}"] = float(value)
        return samples

    def _failed(self, s: Sample, kind: str, what: str) -> None:
        s.reward = 0.0
        s.reward_extras["reward_errors"] = 1.0
        s.reward_extras[kind] = 1.0
        logged = self._logged.get(kind, 0)
        if logged < LOGGED_ERRORS:
            self._logged[kind] = logged + 1
            last = " (later ones are only counted)" if logged + 1 == LOGGED_ERRORS else ""
            log.warning(
                "reward function %s %s prompt %s: sample scored 0, counted in %s%s",
                self.fn_name,
                what,
                s.metadata["prompt"].uid,
                kind,
                last,
            )
