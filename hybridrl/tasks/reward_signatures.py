"""The three forms a reward function may take, told apart by its parameter names, each adapted to
the interface the rollout's scorer (``rollout/scoring.py``) calls. Every place a reward function is
given resolves it here, so each takes all three forms: ``task.reward_fn`` (the scorer) and an
environment's own (``env.kwargs.reward_fn`` of ``tools``, which scores one answer at a time:
:func:`reward_function` and :func:`score_alone`).

The rule, first match wins:

1. a parameter named ``completions``: **TRL-style**, batched,
   ``fn(prompts, completions, completion_ids, **kwargs) -> list[float | None]``, one call per
   scored batch; every column of the rows comes as a keyword list (one value per sample), and a
   function without ``**kwargs`` gets only the arguments it names;
2. a parameter named ``solution_str``: **veRL-style**,
   ``compute_score(data_source, solution_str, ground_truth, extra_info=None)``, one call per sample;
3. callable as ``fn(prompt, response)``: **per-sample**, ``fn(prompt, response, *, finished=True)``
   (``finished`` passed only when accepted), one call per sample.

Anything else is a config-time error (:class:`RewardConfigError`). Any form may be a coroutine
function (``async def``). A batched scorer from outside the config (a reward model) plugs in as
:class:`BatchedScorer`: ``fn(prompts: list[Prompt], completions: list[str]) -> list[float]``.

A per-sample result is a number or a dict with ``"score"`` (its other numbers are logged); a
batched result is a list with one number (or ``None``: not scored by this function) per sample.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from hybridrl.tasks.base import REWARDS, TASKS, Prompt, normalise_reward, reward_kwargs
from hybridrl.tasks.mix import MixedTask

ACCEPTED = (
    "per-sample fn(prompt, response, *, finished=True), TRL-style fn(prompts, completions, "
    "completion_ids, **kwargs), veRL-style compute_score(data_source, solution_str, ground_truth, "
    "extra_info=None)"
)
# reward/<name> metrics the step computes itself: a function is not named like them
RESERVED_NAMES = frozenset({"mean", "std", "errors", "nonfinite", "timeouts"})
TRL_ARGS = ("prompts", "completions", "completion_ids")
VERL_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")

# one sample's outcome from one function: (score or None when it does not score it, extras), or
# the exception its call raised
Result = tuple[float | None, dict] | BaseException


class RewardTimeout(TimeoutError):
    """A reward call took longer than its timeout (a thread's call is abandoned, a coroutine
    cancelled)."""


class RewardConfigError(ValueError):
    """A configured reward function cannot be used (unknown, unrecognised signature, missing
    package); ``key`` is the config key, e.g. ``task.reward_fn[1]``."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key, self.message = key, message


@dataclass(frozen=True)
class RewardInputs:
    """What a scored batch gives reward functions: per sample, its prompt, decoded response,
    response token ids (a trailing eos removed) and whether it ended with an eos."""

    prompts: Sequence[Prompt]
    responses: Sequence[str]
    response_ids: Sequence[Sequence[int]]
    finished: Sequence[bool]

    def __len__(self) -> int:
        return len(self.prompts)


class RewardFunction:
    """A reward function adapted to the scorer. ``batched`` ones get the whole batch in one
    :meth:`call` and turn the result into one :data:`Result` per sample (:meth:`results`); the
    others get one :meth:`call` per sample and normalise it with :meth:`result`."""

    form: ClassVar[str] = ""
    batched: ClassVar[bool] = False

    def __init__(self, fn: Callable, name: str, weight: float = 1.0):
        self.fn, self.name, self.weight = fn, name, float(weight)
        self.is_async = is_async(fn)
        params = _parameters(fn)
        self.var_keyword = params is None or any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in params
        )
        self.named = {p.name for p in params or () if p.kind in _BY_NAME}

    @classmethod
    def accepts(cls, sig: inspect.Signature) -> bool:
        raise NotImplementedError

    def takes(self, name: str) -> bool:
        return self.var_keyword or name in self.named

    def call(self, inputs: RewardInputs, i: int | None = None) -> Any:
        raise NotImplementedError

    def result(self, raw: Any, inputs: RewardInputs, i: int) -> tuple[float | None, dict]:
        return normalise_reward(self.name, raw, inputs.prompts[i].uid)

    def results(self, raw: Any, inputs: RewardInputs) -> list[Result]:
        """A batched result: a sequence of one score (number, ``None`` or a dict with
        ``"score"``) per sample; a malformed element fails its own sample only."""
        if isinstance(raw, (str, bytes, Mapping)) or not hasattr(raw, "__len__"):
            raise TypeError(
                f"{self.form} reward function {self.name} returned {type(raw).__name__}, not a "
                "list with one score per sample"
            )
        values = list(raw)
        if len(values) != len(inputs):
            raise ValueError(
                f"{self.form} reward function {self.name} returned {len(values)} scores for "
                f"{len(inputs)} samples"
            )
        out: list[Result] = []
        for prompt, value in zip(inputs.prompts, values):
            try:
                out.append(normalise_reward(self.name, value, prompt.uid, allow_none=True))
            except Exception as e:  # this sample fails, the others keep their scores
                out.append(e)
        return out


_BY_NAME = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


class TrlStyle(RewardFunction):
    form, batched = "TRL-style", True

    @classmethod
    def accepts(cls, sig: inspect.Signature) -> bool:
        return any(p.name == "completions" and p.kind in _BY_NAME for p in sig.parameters.values())

    def call(self, inputs: RewardInputs, i: int | None = None) -> Any:
        prompts = inputs.prompts
        args: dict[str, Any] = {
            "prompts": [p.text if p.raw is None else p.raw for p in prompts],
            "completions": [
                [{"role": "assistant", "content": r}] if isinstance(p.raw, list) else r
                for p, r in zip(prompts, inputs.responses)
            ],
            "completion_ids": [list(ids) for ids in inputs.response_ids],
        }
        columns = dict.fromkeys(k for p in prompts for k in p.columns if k not in TRL_ARGS)
        for key in columns:
            args[key] = [p.columns.get(key) for p in prompts]
        problem = self.missing_columns(list(columns))
        if problem:
            raise TypeError(problem)
        return self.fn(**{k: v for k, v in args.items() if self.takes(k)})

    def missing_columns(self, columns: Sequence[str]) -> str | None:
        """What is wrong when the rows have only ``columns``: the function's required arguments
        that are neither TRL's nor a column (None: nothing). Known before a run starts, from the
        data's first row, so such a function is refused then, not failed on every sample."""
        missing = [
            p.name
            for p in _parameters(self.fn) or ()
            if p.kind in _BY_NAME
            and p.default is p.empty
            and p.name not in TRL_ARGS
            and p.name not in columns
        ]
        if not missing:
            return None
        return (
            f"TRL-style reward function {self.name} needs argument(s) {missing} that are not "
            f"columns of the rows (columns: {sorted(c for c in columns if c not in TRL_ARGS)}); "
            "give them a default or name columns the data has"
        )


class VerlStyle(RewardFunction):
    form = "veRL-style"

    def __init__(self, fn: Callable, name: str, weight: float = 1.0, answer_key: str | None = None):
        super().__init__(fn, name, weight)
        self.answer_key = answer_key

    @classmethod
    def accepts(cls, sig: inspect.Signature) -> bool:
        return any(p.name == "solution_str" and p.kind in _BY_NAME for p in sig.parameters.values())

    def call(self, inputs: RewardInputs, i: int | None = None) -> Any:
        prompt = inputs.prompts[i]
        columns = prompt.columns
        args = {
            "data_source": prompt.task_id,
            "solution_str": inputs.responses[i],
            "ground_truth": self.ground_truth(prompt),
            "extra_info": columns["extra_info"] if "extra_info" in columns else dict(columns),
        }
        return self.fn(**{k: v for k, v in args.items() if self.takes(k)})

    def ground_truth(self, prompt: Prompt) -> Any:
        """The answer as the row holds it (``data.answer_key``, dotted into a dict column; a list
        stays a list), else ``prompt.answer``."""
        key, value = self.answer_key, prompt.columns
        if not key:
            return prompt.answer
        for part in [key] if key in value else key.split("."):
            if not isinstance(value, Mapping) or part not in value:
                return prompt.answer
            value = value[part]
        return prompt.answer if value is None else value


class PerSample(RewardFunction):
    form = "per-sample"

    @classmethod
    def accepts(cls, sig: inspect.Signature) -> bool:
        takes_finished = any(
            p.kind is inspect.Parameter.VAR_KEYWORD or (p.name == "finished" and p.kind in _BY_NAME)
            for p in sig.parameters.values()
        )
        try:
            sig.bind(None, None, **({"finished": True} if takes_finished else {}))
        except TypeError:
            return False
        return True

    def call(self, inputs: RewardInputs, i: int | None = None) -> Any:
        return self.fn(
            inputs.prompts[i], inputs.responses[i], **reward_kwargs(self.fn, inputs.finished[i])
        )


class BatchedScorer(RewardFunction):
    """A scorer plugged in from outside the config (e.g. a reward model):
    ``fn(prompts: list[Prompt], completions: list[str]) -> list[float | None]``."""

    form, batched = "batched", True

    def call(self, inputs: RewardInputs, i: int | None = None) -> Any:
        return self.fn(list(inputs.prompts), list(inputs.responses))


FORMS: tuple[type[RewardFunction], ...] = (TrlStyle, VerlStyle, PerSample)  # in rule order


# --- resolving the config -------------------------------------------------------------------------
def default_reward(cfg) -> str:
    """The reward when ``task.reward_fn`` is null: exact_match for a dataset, else the task's."""
    if cfg.data.train_files is not None:
        return "exact_match"
    if cfg.task.mix:
        return MixedTask.default_reward
    return TASKS.get(cfg.task.name).default_reward


def resolve_reward_fns(cfg) -> list[RewardFunction]:
    """``task.reward_fn`` (or the default), each loaded, checked and adapted, with its weight and a
    unique name. Raises :class:`RewardConfigError` naming the config key."""
    specs = cfg.task.reward_fns()
    keys = [f"task.reward_fn[{i}]" for i in range(len(specs))] if specs else ["task.name"]
    specs = specs or [default_reward(cfg)]
    weights = cfg.task.reward_weights or [1.0] * len(specs)
    out: list[RewardFunction] = []
    for key, spec, weight in zip(keys, specs, weights):
        fn, name = load_reward_fn(spec, key)
        out.append(adapt(fn, unique_name(name, {f.name for f in out}), weight, key, cfg))
    return out


def reward_function(spec: Any, key: str, cfg=None) -> RewardFunction:
    """One reward function given by name, dotted path or callable, loaded and adapted to its form;
    raises :class:`RewardConfigError` naming ``key``."""
    fn, name = load_reward_fn(spec, key)
    return adapt(fn, name, 1.0, key, cfg)


def load_reward_fn(spec: Any, key: str) -> tuple[Callable, str]:
    """(function, base name) of a registered name, a dotted path or a callable."""
    if isinstance(spec, str):
        try:
            fn = REWARDS.get(spec)
        except KeyError as e:
            raise RewardConfigError(key, e.args[0]) from None
        if not callable(fn):
            raise RewardConfigError(key, f"{spec!r} is a {type(fn).__name__}, not a function")
        name = spec if ":" not in spec else _base_name(fn)
    else:
        fn, name = spec, _base_name(spec)
    module, extra = getattr(fn, "requires_module", (None, None))
    if module is not None and importlib.util.find_spec(module) is None:
        raise RewardConfigError(
            key,
            f"reward function {name} needs the {module} package: pip install 'hybridrl[{extra}]'",
        )
    return fn, name


def adapt(fn: Callable, name: str, weight: float, key: str, cfg=None) -> RewardFunction:
    """``fn`` in the form its parameters name (see the module docstring)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # no introspectable signature: taken as per-sample
        return PerSample(fn, name, weight)
    form = next((form for form in FORMS if form.accepts(sig)), None)
    if form is None:
        raise RewardConfigError(
            key, f"reward function {name}{sig} has an unrecognised signature; accepted: {ACCEPTED}"
        )
    if form is VerlStyle:
        return VerlStyle(fn, name, weight, cfg.data.answer_key if cfg is not None else None)
    return form(fn, name, weight)


def unique_name(name: str, taken: set[str]) -> str:
    """``name``, or ``name_2``, ``name_3`` ... when taken or reserved."""
    out, k = name, 1
    while out in taken or out in RESERVED_NAMES:
        k += 1
        out = f"{name}_{k}"
    return out


# --- calling (on the scorer's helper threads) -----------------------------------------------------
def settle(call: Callable, args: tuple, timeout_s: float) -> Any:
    """``call(*args)``; an awaitable result is run to completion, for at most ``timeout_s``."""
    result = call(*args)
    if inspect.isawaitable(result):
        return asyncio.run(within(result, timeout_s))
    return result


def score_one(f: RewardFunction, inputs: RewardInputs, i: int, timeout_s: float):
    """Sample ``i`` scored by a per-sample function ``f`` (sync)."""
    return f.result(settle(f.call, (inputs, i), timeout_s), inputs, i)


async def score_alone(
    f: RewardFunction, prompt: Prompt, response: str, finished: bool = True
) -> tuple[float, dict]:
    """One response scored by ``f`` of any form, awaited on the caller's event loop (an
    environment's step runs on one): ``(score, extras)``; a batched function gets a batch of one
    (``completion_ids`` empty: the caller has text only) and its ``None`` counts as 0. What the
    function raises, or a malformed result, propagates. A plain function runs on a worker thread:
    a slow one must not block the other environment calls on the loop."""
    inputs = RewardInputs([prompt], [response], [[]], [finished])
    raw = await f.call(inputs, 0) if f.is_async else await asyncio.to_thread(f.call, inputs, 0)
    if inspect.isawaitable(raw):
        raw = await raw
    result = f.results(raw, inputs)[0] if f.batched else f.result(raw, inputs, 0)
    if isinstance(result, BaseException):
        raise result
    score, extras = result
    return (0.0 if score is None else score), extras


def score_concurrently(f: RewardFunction, inputs: RewardInputs, timeout_s: float) -> list[Result]:
    """Every sample scored by an async per-sample function ``f``, concurrently (one event loop),
    each call for at most ``timeout_s``."""

    async def one(i: int):
        raw = f.call(inputs, i)
        if inspect.isawaitable(raw):
            raw = await within(raw, timeout_s)
        return f.result(raw, inputs, i)

    async def run_all():
        return await asyncio.gather(*(one(i) for i in range(len(inputs))), return_exceptions=True)

    return asyncio.run(run_all())


async def within(awaitable: Awaitable, timeout_s: float) -> Any:
    """``await awaitable`` for at most ``timeout_s``: past it, it is cancelled and
    :class:`RewardTimeout` raised (a TimeoutError of its own propagates as an error)."""
    task = asyncio.ensure_future(awaitable)
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if not done:
        task.cancel()
        raise RewardTimeout(f"took longer than {timeout_s:g} s")
    return task.result()


def is_async(fn: Callable) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 (a callable object's async __call__)
    )


def _parameters(fn: Callable) -> list[inspect.Parameter] | None:
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None


def _base_name(fn: Callable) -> str:
    for obj in (fn, getattr(fn, "func", None)):  # a functools.partial names its function
        name = getattr(obj, "__name__", None)
        if isinstance(name, str):
            return name
    return type(fn).__name__
