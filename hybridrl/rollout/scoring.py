"""Scoring where the samples are generated: each rollout rank decodes its responses and scores them
with the configured reward functions (``task.reward_fn``: one or several, in any of the forms
of ``hybridrl/tasks/reward_signatures.py``, weighted by ``task.reward_weights``), in both
training modes. ``docs/rewards.md`` is the user's guide.

A sample's reward is the weighted sum of the scores of the functions that scored it (a TRL-style
function returns None for a sample it does not score). With several functions (or a weight other
than 1) each function's own, unweighted score becomes ``reward_extras["reward/<name>"]``; numbers
a function returns beside its score (``{"score": ..., "format": 1.0}``) become
``reward_extras["reward/<key>"]``; both are logged as means.

A failed reward call does not stop the run: the sample scores 0, its
``reward_extras["reward_errors"]`` is 1 (0 for a sample scored normally), and the first
:data:`LOGGED_ERRORS` failures of each kind are logged. The failures, of any one of the functions:

- the reward function raised (or returned something that is not a score); a batched function that
  raises or returns a list of the wrong length fails every sample of the call;
- its score, or the weighted sum, is not a finite float32 (NaN, inf, or beyond float32's range such
  as ``1e300``: the batch stores rewards as float32, and one infinite reward turns every advantage,
  and then every weight, into NaN); such a sample also has ``reward_extras["reward_nonfinite"]`` =
  1;
- the call took longer than ``task.reward_timeout_s``; such a sample also has
  ``reward_extras["reward_timeouts"]`` = 1;
- every function returned None for it (nothing scored it): counted as a reward error.

Every scored sample carries the three counts (0 or 1), so they become batch columns and the step's
metrics sum them: ``reward/errors``, ``reward/nonfinite`` and ``reward/timeouts``.

Calls: a per-sample function is called once per sample, a batched one (TRL-style, or a scorer added
with :meth:`Scorer.add_scorer`) once per scorer call. Each call runs on a helper daemon thread
(:class:`TimedCalls`, one pool per function) and the scorer waits for it at most
``task.reward_timeout_s``. An async per-sample function has all the samples' calls awaited
concurrently in one event loop on a helper thread, each cancelled past the timeout (the loop's
thread is given :data:`ASYNC_GRACE_S` more before it is abandoned, in case a coroutine blocks it).

Timeouts: Python cannot stop a thread, so a thread whose call times out is abandoned (it exits if
the call ever returns) and a fresh thread takes the next call, so one hung call costs one timeout
and does not block later samples. An abandoned thread keeps whatever it holds (CPU, memory, a
connection) until its call returns, so once :data:`MAX_HUNG_CALLS` abandoned calls of one function
are still running the scorer raises :class:`RewardFunctionHung` and the run stops with an error
naming the reward function, rather than piling up threads. The trade-off of running reward
functions off the calling thread: a reward function cannot use ``signal`` (e.g. ``signal.alarm``
for its own timeout), which works only on the main thread, and thread-local state it sets is not
seen by the next call, which may run on another thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from hybridrl.config import Config
from hybridrl.protocol import Sample
from hybridrl.rollout.stop import eos_token_ids
from hybridrl.tasks.base import NonFiniteReward, finite_float32
from hybridrl.tasks.reward_signatures import (
    BatchedScorer,
    Result,
    RewardFunction,
    RewardInputs,
    RewardTimeout,
    resolve_reward_fns,
    score_concurrently,
    score_one,
    settle,
    unique_name,
)

log = logging.getLogger(__name__)
LOGGED_ERRORS = 5  # reward-call failures of each kind logged in full per scorer; later only counted
MAX_HUNG_CALLS = 8  # timed-out calls of one function still running when the scorer gives up
ASYNC_GRACE_S = 5.0  # an async function's event loop gets this long past the timeout to return


# what a scored sample's reward_extras count (every failure is also a reward error)
FAILURE_COUNTS = {"reward_errors": 0.0, "reward_nonfinite": 0.0, "reward_timeouts": 0.0}
# (exception type, the count it sets, how the log says it), first match wins
FAILURE_KINDS: tuple[tuple[type[BaseException], str, Callable[[Any], str]], ...] = (
    (RewardTimeout, "reward_timeouts", lambda e: f"{e} on"),
    (NonFiniteReward, "reward_nonfinite", lambda e: f"returned score {e.score!r} (not finite) on"),
    (BaseException, "reward_errors", lambda e: f"raised {e!r} on"),
)
__all__ = [
    "RewardTimeout",
    "RewardFunctionHung",
    "RewardFunctionExit",
    "RewardsFailedError",
    "TimedCalls",
    "Scorer",
]


class RewardFunctionHung(RuntimeError):
    """Too many timed-out reward calls are still running: the run stops."""


class RewardFunctionExit(RuntimeError):
    """A reward function raised ``SystemExit`` (``sys.exit()``, ``exit()``) or another exception
    that is not an ``Exception``: an error of that call, never the end of the run."""


class RewardsFailedError(RuntimeError):
    """Every sample's reward failed for ``task.max_failed_reward_steps`` steps in a row: the run
    stops (raised by the driver, ``driver/session.py``)."""


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
        except Exception as e:  # handed to the waiting caller
            call.error = e
        except BaseException as e:  # sys.exit() in a user's function would end the run, exit 0
            call.error = RewardFunctionExit(f"raised {e!r}: a reward function cannot end the run")
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
        return self.run(self.timeout_s, fn, *args, **kwargs)

    def run(self, timeout_s: float, fn: Callable, *args, **kwargs):
        """``fn(*args, **kwargs)`` waiting at most ``timeout_s`` (instead of the pool's)."""
        with self._lock:
            if self._idle:
                helper = self._idle.pop()
            else:
                self._created += 1
                helper = _Helper(f"{self.name}-{self._created}")
        call = _Call(fn, args, kwargs)
        helper.calls.put(call)
        try:
            finished = call.done.wait(timeout_s)
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
                f"{self.name}: {hung} calls ran past the {timeout_s:g} s timeout and are "
                "still running; stopping the run (fix the function, or raise the timeout)"
            )
        raise RewardTimeout(f"took longer than {timeout_s:g} s")

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
    """Scores samples in place with the configured reward functions (see the module docstring).

    ``eos_ids``: the token ids that end a response (one is stripped from a finished response's end
    before decoding, and from the ``completion_ids`` batched functions get); None: the tokenizer's
    eos (``rollout.stop.eos_token_ids(model, tokenizer)`` adds the model's generation_config ones).
    ``extra_scorers``: batched scorers from outside the config, as ``(name, fn, weight)`` (see
    :meth:`add_scorer`).
    """

    def __init__(
        self,
        cfg: Config,
        tokenizer,
        eos_ids: Iterable[int] | None = None,
        extra_scorers: Sequence[tuple[str, Callable, float]] = (),
    ):
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(eos_token_ids(None, tokenizer) if eos_ids is None else eos_ids)
        self.timeout_s = cfg.task.reward_timeout_s
        self.functions: list[RewardFunction] = []
        self.pools: dict[str, TimedCalls] = {}  # by function name: each has its own helpers
        self._logged: dict[str, int] = {}  # failures logged, by kind
        for f in resolve_reward_fns(cfg):
            self._add(f)
        for name, fn, weight in extra_scorers:
            self.add_scorer(name, fn, weight)

    def add_scorer(self, name: str, fn: Callable, weight: float = 1.0) -> str:
        """Add a batched scorer ``fn(prompts: list[Prompt], completions: list[str]) ->
        list[float | None]`` (sync or async; e.g. a reward model), called once per scorer call with
        every sample, its score weighted by ``weight`` into the reward and logged as
        ``reward/<name>``; failures are handled as a reward function's. Returns its name (made
        unique)."""
        f = BatchedScorer(fn, unique_name(name, {g.name for g in self.functions}), weight)
        self._add(f)
        return f.name

    def _add(self, f: RewardFunction) -> None:
        self.functions.append(f)
        self.pools[f.name] = TimedCalls(self.timeout_s, f"reward function {f.name}")

    def __call__(self, samples: list[Sample]) -> list[Sample]:
        """Sets ``reward`` and ``reward_extras`` (the failure counts, each function's score when
        several, their extras) of each sample, in place; returns them. Raises
        :class:`RewardFunctionHung` when too many reward calls hang."""
        if not samples:
            return samples
        inputs = self._inputs(samples)
        per_function = [self._run(f, inputs) for f in self.functions]
        each = len(self.functions) > 1 or any(f.weight != 1.0 for f in self.functions)
        for j, s in enumerate(samples):
            self._combine(
                s, [(f, results[j]) for f, results in zip(self.functions, per_function)], each
            )
        return samples

    def _inputs(self, samples: list[Sample]) -> RewardInputs:
        ids, finished = [], []
        for s in samples:
            done = s.status == "finished"
            strip = done and s.response_ids and s.response_ids[-1] in self.eos_ids
            ids.append(s.response_ids[:-1] if strip else s.response_ids)
            finished.append(done)
        return RewardInputs(
            prompts=[s.metadata["prompt"] for s in samples],
            responses=[self.tokenizer.decode(r, skip_special_tokens=True) for r in ids],
            response_ids=ids,
            finished=finished,
        )

    def _run(self, f: RewardFunction, inputs: RewardInputs) -> list[Result]:
        """Function ``f``'s outcome for every sample (a failure as the exception)."""
        pool, timeout_s = self.pools[f.name], self.timeout_s
        grace = ASYNC_GRACE_S if f.is_async else 0.0
        try:
            if f.batched:
                raw = pool.run(timeout_s + grace, settle, f.call, (inputs,), timeout_s)
                return f.results(raw, inputs)
            if f.is_async:
                return pool.run(timeout_s + grace, score_concurrently, f, inputs, timeout_s)
        except RewardFunctionHung:
            raise
        except Exception as e:  # the whole call failed: every sample of it
            return [e] * len(inputs)
        return [self._one(pool, f, inputs, i) for i in range(len(inputs))]

    def _one(self, pool: TimedCalls, f: RewardFunction, inputs: RewardInputs, i: int) -> Result:
        try:
            return pool(score_one, f, inputs, i, self.timeout_s)
        except RewardFunctionHung:
            raise
        except Exception as e:  # a user's reward function must not kill the run
            return e

    def _combine(self, s: Sample, outcomes: list[tuple[RewardFunction, Result]], each: bool):
        s.reward_extras.update(FAILURE_COUNTS)  # all 0: a failure below sets its own to 1
        reward, scored, failed, scores = 0.0, False, False, {}
        for f, outcome in outcomes:
            if isinstance(outcome, BaseException):
                failed = True
                scores[f.name] = 0.0
                self._failed(s, f.name, outcome)
                continue
            score, extras = outcome
            for key, value in extras.items():  # numbers a reward function returns beside its score
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    s.reward_extras[f"reward/{key}"] = float(value)
            if score is not None:
                reward, scored, scores[f.name] = reward + f.weight * score, True, score
        if each:
            s.reward_extras.update({f"reward/{name}": v for name, v in scores.items()})
        names = "+".join(f.name for f, _ in outcomes)
        if failed:
            s.reward = 0.0
        elif not scored:
            self._failed(s, names, ValueError("returned None (no function scored the sample)"))
        elif not finite_float32(reward):
            self._failed(s, names, NonFiniteReward(f"weighted sum {reward!r}", reward))
        else:
            s.reward = reward

    def _failed(self, s: Sample, fn_name: str, error: BaseException) -> None:
        kind, what = next((k, w(error)) for t, k, w in FAILURE_KINDS if isinstance(error, t))
        s.reward = 0.0
        s.reward_extras["reward_errors"] = 1.0
        s.reward_extras[kind] = 1.0
        # the sample's first failure, in words: a run whose every reward fails stops naming it
        s.metadata.setdefault(
            "reward_error", f"reward function {fn_name} {what} prompt {s.metadata['prompt'].uid}"
        )
        logged = self._logged.get(kind, 0)
        if logged < LOGGED_ERRORS:
            self._logged[kind] = logged + 1
            last = " (later ones are only counted)" if logged + 1 == LOGGED_ERRORS else ""
            log.warning(
                "reward function %s %s prompt %s: sample scored 0, counted in %s%s",
                fn_name,
                what,
                s.metadata["prompt"].uid,
                kind,
                last,
            )
