"""The parts of a multi-turn rollout (``rollout/multiturn.py``): a trajectory's state and its
token bookkeeping (appending turns and observations, splitting, the samples it becomes), running
environment calls off the engine's thread, and turning an observation into tokens.

:class:`EnvCalls` runs every ``reset`` / ``step`` on one event-loop thread: an ``async def`` is
awaited there, a plain function runs on a daemon thread of its own and is awaited as a future. So a
slow tool never holds up the engine, many calls wait at once (at most ``max_concurrent``), and a
call past its timeout is abandoned without blocking anything (Python cannot stop a thread: a hung
plain function keeps its daemon thread until it returns, which never blocks the process's exit).

Observations and token-in-token-out: the trainer gets the engine's token ids as they were sampled,
with the observation's tokens appended, never a re-tokenisation of the conversation. How the
observation's tokens are made depends on the prompt:

* plain text (a built-in task, or a tokenizer without a chat template): the observation text is
  tokenised on its own (no special tokens) and appended (:class:`PlainObservations`);
* chat prompts with a chat template (:class:`ChatObservations`): the observation is rendered as a
  message (role ``env.observation_role``) through the template, and its tokens are what the
  template adds after the model's turn: the rest of the turn's closing (``<|im_end|>`` is sampled,
  the newline after it is not), the observation message and the next generation prompt. This is
  only sound when rendering the conversation so far gives a token prefix of rendering it with the
  new turn and observation (the *extension property*): templates that rewrite earlier turns (e.g.
  drop earlier reasoning) break it, and then the model would see at deployment a context it was
  never trained on. Each turn checks it; where it fails the trajectory is split, and its next part
  starts from the template's own rendering of the conversation as its prompt.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridrl.moe.routing import NOT_ROUTED, ROUTING_DTYPE
from hybridrl.protocol import Sample
from hybridrl.rollout.base import SamplingParams


@dataclass
class Group:
    """A prompt's trajectories (one per sample) and its sampling parameters."""

    prompt: Sample
    params: SamplingParams
    trajs: list[Trajectory] = field(default_factory=list)


@dataclass
class Trajectory:
    """One trajectory's state while it runs: its tokens so far (the model's, with their log-probs
    and versions, and the observations'), its environment, turn and token counts, and outcome."""

    group: Group
    index: int
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    env: Any = None
    obs: Any = None  # PlainObservations or ChatObservations
    total: int = 0  # response tokens over all parts (observations included)
    turns: int = 0
    last_turn: list[int] = field(default_factory=list)
    reward: float = 0.0
    status: str = ""  # "" while running, then finished | truncated | aborted
    error: str = ""  # "" or the failure counted: errors | timeouts
    aborted: bool = False
    request: Sample | None = None  # the turn in the inner engine
    cross: bool = False  # the turn in flight is the other policy's (cross-policy sampling)
    parts: list[Sample] = field(default_factory=list)  # earlier parts of a split trajectory
    messages: list[dict] | None = None  # chat prompts: the conversation so far
    rendered: list[int] | None = None  # chat prompts: the template's tokens of it
    # a mixture-of-experts engine's recorded routing of the part's first tokens (tokens, layers,
    # k); None: nothing recorded (a dense model)
    routing: torch.Tensor | None = None

    @property
    def uid(self) -> str:
        return f"{self.group.prompt.uid}#{self.index}"

    def extend(
        self, ids: list[int], log_probs: list[float], versions: list[int], loss_mask: list[int]
    ) -> None:
        """Tokens appended to the response (a model turn's, or an observation's), each with its
        log-prob, weight version and loss mask; they count towards ``total``."""
        self.response_ids += ids
        self.log_probs += log_probs
        self.versions += versions
        self.loss_mask += loss_mask
        self.total += len(ids)

    def add_routing(self, turn: torch.Tensor | None) -> None:
        """A turn's recorded routing (its request's tokens, the trajectory so far, then its new
        tokens): each token keeps the routing of the forward that first computed it (the prompt and
        earlier turns as their own requests recorded them, observations and a turn's last token as
        the next request's prefill did). Between weight updates that is the routing the engine's
        KV holds (prefix-cache hits keep it); across an update, which clears the prefix cache, an
        earlier token keeps the routing of the version that sampled after it."""
        if turn is None:
            return
        if self.routing is None:
            self.routing = turn.clone()
            return
        merged, old = turn.clone(), self.routing
        n = min(len(old), len(merged))
        kept = (old[:n] != NOT_ROUTED).all(-1)
        merged[:n][kept] = old[:n][kept]
        self.routing = merged if len(merged) >= len(old) else torch.cat([merged, old[n:]])

    def split(self, rendered: list[int]) -> None:
        """The template rewrote the conversation: the tokens so far become a finished part, and the
        next part starts from the template's rendering ``rendered`` as its prompt."""
        self.parts.append(self.part("finished"))
        self.prompt_ids = list(rendered)
        self.response_ids, self.log_probs, self.versions, self.loss_mask = [], [], [], []
        self.routing = None  # the next part's prompt is prefilled afresh

    def part(self, status: str) -> Sample:
        """The current part as a sample of the prompt with ``status``."""
        s = self.group.prompt.with_response(
            self.response_ids, self.log_probs, self.versions, status
        )
        s.prompt_ids, s.loss_mask = list(self.prompt_ids), list(self.loss_mask)
        if self.routing is not None:  # tokens never fed (observations after the last turn): -1
            n = len(s.prompt_ids) + len(s.response_ids)
            s.routing = torch.full((n, *self.routing.shape[1:]), NOT_ROUTED, dtype=ROUTING_DTYPE)
            s.routing[: len(self.routing)] = self.routing[:n]
        return s

    def samples(self) -> list[Sample]:
        """The trajectory as samples (one per part), each carrying its outcome in metadata."""
        out = self.parts + [self.part(self.status)]
        for i, s in enumerate(out):
            s.metadata = s.metadata | {
                "env_reward": self.reward,
                "env_turns": self.turns,
                "env_error": self.error,
                "env_part": i,
            }
        return out


class EnvCalls:
    """Environment calls on an event-loop thread, each with a timeout (see the module docstring)."""

    def __init__(self, timeout_s: float, max_concurrent: int):
        self.timeout_s = timeout_s
        self.loop = asyncio.new_event_loop()
        self.limit = asyncio.Semaphore(max_concurrent)
        # durations of the calls finished since the last take, by method name (reset, step ...)
        self.seconds: dict[str, list[float]] = {}
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self.loop.run_forever, name="env-calls", daemon=True)
        self.thread.start()

    def submit(self, fn: Callable, *args) -> concurrent.futures.Future:
        """``fn(*args)`` (sync or async) on the loop; the future holds its result, or
        ``TimeoutError`` past ``timeout_s``, or what it raised."""
        return asyncio.run_coroutine_threadsafe(self._call(fn, args), self.loop)

    async def _call(self, fn: Callable, args: tuple) -> Any:
        async with self.limit:
            t0 = time.perf_counter()
            try:
                call = fn(*args) if inspect.iscoroutinefunction(fn) else self._threaded(fn, args)
                result = await asyncio.wait_for(call, self.timeout_s)
                if inspect.isawaitable(result):  # a plain function that returned a coroutine
                    left = self.timeout_s - (time.perf_counter() - t0)
                    result = await asyncio.wait_for(result, max(left, 0.0))
                return result
            finally:
                name = getattr(fn, "__name__", "call")
                with self._lock:
                    self.seconds.setdefault(name, []).append(time.perf_counter() - t0)

    def _threaded(self, fn: Callable, args: tuple) -> asyncio.Future:
        future = self.loop.create_future()

        def settle(value, error) -> None:
            if not future.done():  # a timed-out call was cancelled meanwhile
                future.set_exception(error) if error is not None else future.set_result(value)

        def run() -> None:
            try:
                value, error = fn(*args), None
            except BaseException as e:  # handed to the awaiting coroutine
                value, error = None, e
            self.loop.call_soon_threadsafe(settle, value, error)

        threading.Thread(target=run, name="env-call", daemon=True).start()
        return future

    def take_seconds(self) -> dict[str, list[float]]:
        with self._lock:
            out, self.seconds = self.seconds, {}
        return out

    def close(self) -> None:
        """Cancel the calls still waiting and stop the loop (its thread exits)."""

        async def shutdown() -> None:
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in rest:
                task.cancel()
            await asyncio.gather(*rest, return_exceptions=True)
            self.loop.stop()

        if self.loop.is_running():
            asyncio.run_coroutine_threadsafe(shutdown(), self.loop)
            self.thread.join(5.0)


def overrides(env, method: str, base: type) -> bool:
    """Whether ``env`` defines ``method`` itself (not only as ``base``'s default)."""
    return getattr(type(env), method, None) is not getattr(base, method, None)


class PlainObservations:
    """Observation text tokenised on its own and appended: concatenation always extends."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def start(self, traj, prompt) -> None:
        pass

    def ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def reset(self, traj, text: str) -> list[int]:
        """The prompt with a reset observation: its tokens appended."""
        return list(traj.prompt_ids) + self.ids(text)

    def step(self, traj, turn_ids: list[int], text: str) -> tuple[list[int], list[int] | None]:
        """(the observation's tokens, None: the trajectory goes on as one sample)."""
        return self.ids(text), None


class ChatObservations:
    """Observations as chat messages through the tokenizer's template, with the extension check
    (module docstring). A trajectory's ``messages`` and ``rendered`` (the template's tokens of the
    conversation the model saw last) live on the trajectory."""

    def __init__(self, tokenizer, role: str):
        self.tokenizer, self.role = tokenizer, role
        self.eos = tokenizer.eos_token_id

    def render(self, messages: list[dict], generation: bool) -> list[int]:
        out = self.tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=generation
        )
        ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
        return list(ids)

    def start(self, traj, prompt) -> None:
        traj.messages = [dict(m) for m in prompt.raw]
        traj.rendered = list(traj.prompt_ids)

    def reset(self, traj, text: str) -> list[int]:
        """The prompt with a reset observation: the template's rendering of the prompt's messages
        and the observation as a message of its own (a prompt is never trained on)."""
        traj.messages = traj.messages + [{"role": self.role, "content": text}]
        traj.rendered = self.render(traj.messages, True)
        return list(traj.rendered)

    def step(self, traj, turn_ids: list[int], text: str) -> tuple[list[int], list[int] | None]:
        """(observation tokens, None) while the extension property holds; (observation tokens,
        the template's rendering of the whole conversation) where it fails: the caller splits."""
        said = self.tokenizer.decode(turn_ids, skip_special_tokens=True)
        before = traj.rendered
        closed_msgs = traj.messages + [{"role": "assistant", "content": said}]
        messages = closed_msgs + [{"role": self.role, "content": text}]
        closed, after = self.render(closed_msgs, False), self.render(messages, True)
        traj.messages, traj.rendered = messages, after
        tail = self._closing(turn_ids, closed[len(before) :] if _starts(closed, before) else [])
        obs = after[len(closed) :] if _starts(after, closed) else self._detached(text)
        return tail + obs, (None if _starts(after, before) else after)

    def _closing(self, turn_ids: list[int], rendered_turn: list[int]) -> list[int]:
        """What the template puts after the model's turn that the model did not sample: the rest
        of ``rendered_turn`` after the turn's tokens, or (the turn is not reproduced exactly) the
        template's closing from its end-of-turn token on."""
        if rendered_turn[: len(turn_ids)] == turn_ids:
            return rendered_turn[len(turn_ids) :]
        if self.eos is None or self.eos not in rendered_turn:
            return []
        last = len(rendered_turn) - 1 - rendered_turn[::-1].index(self.eos)
        sampled_eos = bool(turn_ids) and turn_ids[-1] == self.eos
        return rendered_turn[last + 1 :] if sampled_eos else rendered_turn[last:]

    def _detached(self, text: str) -> list[int]:
        """The observation message's tokens as the template adds them after a short exchange (the
        conversation's own rendering did not extend)."""
        base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
        closed = self.render(base, False)
        after = self.render(base + [{"role": self.role, "content": text}], True)
        return after[_common(closed, after) :]


def _starts(seq: list[int], prefix: list[int]) -> bool:
    return seq[: len(prefix)] == prefix


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
