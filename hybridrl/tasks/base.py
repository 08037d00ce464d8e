"""The task interface, the task and reward-function registries, and reward
normalisation.

A task supplies a deterministic stream of training prompts, a fixed held-out
set, correct supervised examples for the warm start, and its tokenizer.
Tasks are registered in :data:`TASKS` and built as ``cls(seed=..., **kwargs)``.

A reward function is a plain function ``fn(prompt, response, *, finished=True)``
returning a float, or a dict with key ``"score"`` plus extra values to log.
``response`` is the decoded response text before the first ``<eos>`` (special
tokens skipped); ``finished`` is False when the sample never emitted ``<eos>``
(truncated at the token limit, or aborted). Accepting ``finished`` is optional:
:func:`compute_reward` passes it only to functions whose signature takes it (a
parameter named ``finished`` or ``**kwargs``), so a two-argument plug-in works.
Reward functions are registered in :data:`REWARDS` or given by dotted path. This is the
per-sample form; TRL-style batched and veRL-style functions are recognised by their parameters
and adapted in ``hybridrl/tasks/reward_signatures.py`` (see ``docs/rewards.md``).
"""

from __future__ import annotations

import abc
import inspect
import math
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerFast

from hybridrl.registry import Registry


@dataclass(frozen=True)
class Prompt:
    uid: str  # unique id of this prompt in its stream, e.g. "arith-000123"
    text: str  # prompt text as the model sees it (rendered chat template included), no <bos>
    answer: str  # reference answer text, e.g. "357" ("" when the data has none)
    task_id: str  # task name, e.g. "arith", or a dataset row's data_source
    # the prompt's token ids when the source tokenized it (a rendered chat template: tokenizing
    # its text again could add a second <bos>); None: the tokenizer encodes ``text``
    token_ids: tuple[int, ...] | None = None
    # the prompt as the data holds it: a string, or a list of chat messages (what TRL-style reward
    # functions receive as ``prompts``); None: ``text``
    raw: Any = None
    # a dataset row's other columns, passed to reward functions by name (empty for built-in tasks)
    columns: Mapping[str, Any] = field(default_factory=dict)


class Task(abc.ABC):
    """Base class of built-in tasks (constructed as ``cls(seed=..., **kwargs)``)."""

    name: str = ""
    default_reward: str = ""  # name in REWARDS the task is scored with by default

    @abc.abstractmethod
    def prompt(self, index: int) -> Prompt:
        """The ``index``-th training prompt: a pure function of (seed, index),
        so a resumed run continues the stream exactly."""

    @abc.abstractmethod
    def heldout(self) -> list[Prompt]:
        """The fixed held-out evaluation set (same on every run, any seed)."""

    @abc.abstractmethod
    def sft_example(self, index: int) -> tuple[str, str]:
        """(prompt text, correct completion text without <eos>), deterministic in index."""

    @abc.abstractmethod
    def tokenizer(self) -> PreTrainedTokenizerFast:
        """The tokenizer the task's text is written for."""


RewardFn = Callable[..., float | Mapping[str, Any]]

TASKS: Registry[type[Task]] = Registry("task")
REWARDS: Registry[RewardFn] = Registry("reward function")


def _accepts_finished(fn: Callable) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # some builtins have no signature
        return False
    return any(
        p.kind is inspect.Parameter.VAR_KEYWORD
        or (p.name == "finished" and p.kind is not inspect.Parameter.POSITIONAL_ONLY)
        for p in params
    )


def reward_kwargs(fn: Callable, finished: bool) -> dict:
    """The keyword arguments a per-sample reward function gets beside ``(prompt, response)``."""
    return {"finished": finished} if _accepts_finished(fn) else {}


def compute_reward(
    fn: RewardFn, prompt: Prompt, response: str, *, finished: bool = True
) -> tuple[float, dict]:
    """Call a per-sample reward function and normalise its result to ``(score, extras)``.

    A float (or int / numpy / 0-d tensor) result gives ``(float(r), {})``; a
    mapping must hold ``"score"`` and its other items become ``extras``.
    ``finished`` is forwarded only if ``fn`` accepts it (see module docstring).
    Exceptions raised by ``fn`` propagate (the rollout's scorer handles them);
    a malformed result raises ``TypeError`` / ``ValueError``, and a score that
    is not a finite float32 (NaN, +-inf, or a finite float beyond float32's
    range such as ``1e300``, which a batch's float32 rewards would hold as inf)
    raises :class:`NonFiniteReward`.
    """
    result = fn(prompt, response, **reward_kwargs(fn, finished))
    score, extras = normalise_reward(_name(fn), result, prompt.uid)
    assert score is not None
    return score, extras


def normalise_reward(
    name: str, result: Any, uid: str, *, allow_none: bool = False
) -> tuple[float | None, dict]:
    """One sample's reward-function result as ``(score, extras)``: a number, or a mapping with
    ``"score"`` (its other items are the extras); ``None`` only where ``allow_none`` (the function
    does not score this sample). Raises as :func:`compute_reward` does; ``name`` names the
    function in the messages and ``uid`` the prompt."""
    if result is None and allow_none:
        return None, {}
    if isinstance(result, Mapping):
        if "score" not in result:
            raise ValueError(
                f"reward function {name} returned a dict without 'score': keys {sorted(result)}"
            )
        extras = {k: v for k, v in result.items() if k != "score"}
        raw = result["score"]
    else:
        extras, raw = {}, result
    if isinstance(raw, (str, bytes)) or not hasattr(raw, "__float__"):
        raise TypeError(
            f"reward function {name} returned score {raw!r} of type {type(raw).__name__}, not "
            "a number"
        )
    score = float(raw)
    if not finite_float32(score):
        raise NonFiniteReward(
            f"reward function {name} returned score {score!r} for prompt {uid!r}: not "
            "a finite float32 (NaN, inf, or beyond float32's range; rewards are stored as float32)",
            score,
        )
    return score, extras


class NonFiniteReward(ValueError):
    """A reward function's score (``score``) is NaN, infinite, or too large for float32."""

    def __init__(self, message: str, score: float):
        super().__init__(message)
        self.score = score

    def __reduce__(self):
        return type(self), (str(self), self.score)


def needs(module: str, extra: str) -> Callable[[Callable], Callable]:
    """Mark a reward function as needing an optional package: selecting it when ``module`` is not
    importable is a config-time error telling to ``pip install 'hybridrl[<extra>]'``."""

    def deco(fn: Callable) -> Callable:
        fn.requires_module = (module, extra)  # read by reward_signatures.load_reward_fn
        return fn

    return deco


def finite_float32(x: float) -> bool:
    """Whether ``x`` is finite and stays finite when rounded to float32."""
    if not math.isfinite(x):
        return False
    try:
        struct.pack("<f", x)  # raises when x rounds to float32 infinity
    except OverflowError:
        return False
    return True


def _name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)
