"""The parts of the environment rollout (``rollout/multiturn.py``): a trajectory's state and its
token bookkeeping (appending turns and observations, splitting, the samples it becomes), running
environment calls off the engine's thread, and turning an observation into tokens.

:class:`EnvCalls` runs every ``reset`` / ``step`` on an event loop (the one the episodes run on,
or a thread of its own): an ``async def`` is awaited there, a plain function runs on a daemon thread
of its own and is awaited as a future. So a slow tool never holds up the engine, many calls wait at
once (at most ``max_concurrent``), and a call past its timeout is abandoned without blocking
anything (Python cannot stop a thread: a hung plain function keeps its daemon thread until it
returns, which never blocks the process's exit).

Observations and token-in-token-out: the trainer gets the engine's token ids as they were sampled,
with the observation's tokens appended, never a re-tokenisation of the conversation. How the
observation's tokens are made depends on the prompt:

* a prompt used as text (a built-in task, ``data.apply_chat_template=false``, a string prompt by
  default, or a tokenizer without a chat template): the observation text is tokenised on its own
  (no special tokens added) and appended (:class:`PlainObservations`);
* a prompt rendered through the chat template (chat messages, or a string with
  ``data.apply_chat_template=true``; :class:`ChatObservations`): the conversation continues from
  the messages the prompt was rendered from (``data.system_prompt`` included), the observation is
  rendered as a message (role ``env.observation_role``) through the template, and its tokens are
  what the template adds after the model's turn: the rest of the turn's closing (``<|im_end|>`` is
  sampled, the newline after it is not), the observation message and the next generation prompt.
  This is only sound when rendering the conversation so far gives a token prefix of rendering it
  with the new turn and observation (the *extension property*): templates that rewrite earlier
  turns (e.g. drop earlier reasoning) break it, and then the model would see at deployment a
  context it was never trained on. Each turn checks it; where it fails the trajectory is split,
  and its next part starts from the template's own rendering of the conversation as its prompt.
  Every part carries the trajectory's outcome and its id (metadata ``trajectory``): the trajectory
  counts once in its group's statistics and each part gets its advantage.

Observations are text, in both paths: a special token's string in them (a tool that prints
``<|im_end|>``) is encoded as the characters it is made of, never as the control token, so no tool
output can close a turn or open a new one (:class:`TextIds`). In the chat path the same holds for
every content the rollout adds to the conversation (the model's turns too); the template's own
markers stay control tokens.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from tokenizers import Tokenizer

from hybridrl.data.render import chat_messages
from hybridrl.moe.routing import NOT_ROUTED, ROUTING_DTYPE
from hybridrl.protocol import Sample
from hybridrl.sampling import SamplingParams


@dataclass
class Group:
    """The prompt a trajectory belongs to and its sampling parameters."""

    prompt: Sample
    params: SamplingParams


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
    error_message: str = ""  # the failure in words (a run whose every trajectory fails names it)
    parts: list[Sample] = field(default_factory=list)  # earlier parts of a split trajectory
    messages: list[dict] | None = None  # chat prompts: the conversation so far
    asked: int = 0  # chat prompts: how many of ``messages`` are the prompt's (the rest are text)
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
                "env_error_message": self.error_message,
                "env_part": i,
                # the parts of a split trajectory share it: it counts once in its group's
                # statistics (algorithms/advantages.py)
                "trajectory": self.uid,
            }
        return out


class EnvironmentExit(RuntimeError):
    """An environment call (or a reward function it runs) raised ``SystemExit`` or another
    exception that is not an ``Exception``: an error of that call, never the end of the run."""


async def _no_exit(call: Awaitable) -> Any:
    """``await call``, with ``SystemExit`` (``sys.exit()`` in an environment's coroutine, or in a
    reward function it awaits) turned into :class:`EnvironmentExit`: escaping a task step, it would
    stop the event loop that every environment call runs on."""
    try:
        return await call
    except (SystemExit, KeyboardInterrupt, GeneratorExit) as e:
        raise EnvironmentExit(f"raised {e!r}: an environment cannot end the run") from None


class EnvCalls:
    """Environment calls, each with a timeout (see the module docstring): on an event-loop thread
    of their own (``submit``), or, with ``thread=False``, awaited on the caller's loop (``call``:
    an episode's environment calls, on the loop the episode runs on)."""

    def __init__(self, timeout_s: float | None, max_concurrent: int, thread: bool = True):
        self.timeout_s = timeout_s
        self.limit = asyncio.Semaphore(max_concurrent)
        # durations of the calls finished since the last take, by method name (reset, step ...)
        self.seconds: dict[str, list[float]] = {}
        self._lock = threading.Lock()
        self.loop = asyncio.new_event_loop() if thread else None
        if self.loop is not None:
            self.thread = threading.Thread(
                target=self.loop.run_forever, name="env-calls", daemon=True
            )
            self.thread.start()

    def submit(self, fn: Callable, *args) -> concurrent.futures.Future:
        """``fn(*args)`` (sync or async) on the loop; the future holds its result, or
        ``TimeoutError`` past ``timeout_s``, or what it raised."""
        return asyncio.run_coroutine_threadsafe(self.call(fn, *args), self.loop)

    async def call(self, fn: Callable, *args) -> Any:
        """``fn(*args)`` (sync or async) on the running loop: its result, or ``TimeoutError`` past
        ``timeout_s``, or what it raised."""
        async with self.limit:
            t0 = time.perf_counter()
            try:
                # an async def, or an object whose __call__ is one (an episode class), is awaited
                # here; anything else runs on a thread
                is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
                    type(fn).__call__
                )
                call = _no_exit(fn(*args)) if is_async else self._threaded(fn, args)
                result = await asyncio.wait_for(call, self.timeout_s)
                if inspect.isawaitable(result):  # a plain function that returned a coroutine
                    left = None
                    if self.timeout_s is not None:
                        left = max(self.timeout_s - (time.perf_counter() - t0), 0.0)
                    result = await asyncio.wait_for(_no_exit(result), left)
                return result
            finally:
                name = getattr(fn, "__name__", "call")
                with self._lock:
                    self.seconds.setdefault(name, []).append(time.perf_counter() - t0)

    def _threaded(self, fn: Callable, args: tuple) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def settle(value, error) -> None:
            if not future.done():  # a timed-out call was cancelled meanwhile
                future.set_exception(error) if error is not None else future.set_result(value)

        def run() -> None:
            try:
                value, error = fn(*args), None
            except Exception as e:  # handed to the awaiting coroutine
                value, error = None, e
            except BaseException as e:  # sys.exit() would stop the loop: an error of this call
                value, error = (
                    None,
                    EnvironmentExit(f"raised {e!r}: an environment cannot end the run"),
                )
            loop.call_soon_threadsafe(settle, value, error)

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

        if self.loop is not None and self.loop.is_running():
            asyncio.run_coroutine_threadsafe(shutdown(), self.loop)
            self.thread.join(5.0)


def overrides(env, method: str, base: type) -> bool:
    """Whether ``env`` defines ``method`` itself (not only as ``base``'s default)."""
    return getattr(type(env), method, None) is not getattr(base, method, None)


class TextIds:
    """Text as token ids with no special token parsed: the string of a special token
    (``<|im_end|>``) in it becomes the tokens of its characters. A fast tokenizer gets a private
    copy of its backend for this: the switch is state of the backend, and the tokenizer itself is
    used meanwhile on other threads (the prompt prefetch) with special tokens parsed."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.backend = None if backend is None else Tokenizer.from_str(backend.to_str())
        if self.backend is not None:
            self.backend.encode_special_tokens = True
            # a saved tokenizer may carry a truncation or padding setting (transformers resets it
            # on each call, this copy is called directly): an observation is encoded whole
            self.backend.no_truncation()
            self.backend.no_padding()
        # the strings a tokenizer would parse as control tokens
        self.specials = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]

    def __call__(self, text: str) -> list[int]:
        if self.backend is not None:
            return list(self.backend.encode(text, add_special_tokens=False).ids)
        out = self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)
        return list(out["input_ids"])

    def parsed_as_control(self, text: str) -> bool:
        """Whether encoding ``text`` with special tokens parsed would give a control token."""
        return any(s in text for s in self.specials)


def observations(prompt, data, plain: PlainObservations, chat: ChatObservations | None):
    """(the observation path of ``prompt``, the chat messages its conversation continues, or None
    for the plain path): the chat path where the prompt was rendered through the chat template
    (module docstring). ``data``: the run's ``data`` section."""
    messages = chat_messages(getattr(prompt, "raw", None), data) if chat is not None else None
    return (plain, None) if messages is None else (chat, messages)


class PlainObservations:
    """Observation text tokenised on its own and appended: concatenation always extends. ``ids``:
    the tokenizer's :class:`TextIds`."""

    def __init__(self, ids: TextIds):
        self.ids = ids

    def start(self, traj, messages: None) -> None:
        pass

    def reset(self, traj, text: str) -> list[int]:
        """The prompt with a reset observation: its tokens appended."""
        return list(traj.prompt_ids) + self.ids(text)

    def step(self, traj, turn_ids: list[int], text: str) -> tuple[list[int], list[int] | None]:
        """(the observation's tokens, None: the trajectory goes on as one sample)."""
        return self.ids(text), None


# stands in for one content while its place in the rendered text is found (the template never
# writes it itself, and no whitespace trimming removes it)
_PROBE = "\x00"


class ChatObservations:
    """Observations as chat messages through the tokenizer's template, with the extension check
    (module docstring). A trajectory's ``messages``, ``asked`` and ``rendered`` (the template's
    tokens of the conversation the model saw last) live on the trajectory. ``text``: the
    tokenizer's :class:`TextIds`."""

    def __init__(self, tokenizer, role: str, text: TextIds):
        self.tokenizer, self.role, self.text = tokenizer, role, text
        self.eos = tokenizer.eos_token_id

    def render(self, messages: list[dict], generation: bool, asked: int) -> list[int]:
        """The template's tokens of ``messages``: its text encoded with special tokens parsed, but
        the contents of ``messages[asked:]`` (the model's turns, the observations) as text, where
        they hold a special token's string. Where such a content lies in the rendered text is
        found by rendering it once more with that content replaced by a probe: the two texts
        differ exactly there, whatever the template does around it."""
        text = self._template(messages, generation)
        spans = []
        for k in range(asked, len(messages)):
            content = messages[k].get("content")
            if isinstance(content, str) and self.text.parsed_as_control(content):
                probe = [*messages[:k], {**messages[k], "content": _PROBE}, *messages[k + 1 :]]
                spans.append(_differing(text, self._template(probe, generation)))
        ids, at = [], 0
        for start, end in sorted(spans):
            ids += self._encode(text[at:start]) + self.text(text[start:end])
            at = end
        return ids + self._encode(text[at:])

    def _template(self, messages: list[dict], generation: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation
        )

    def _encode(self, text: str) -> list[int]:
        """Template text as ``apply_chat_template(tokenize=True)`` encodes it."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def start(self, traj, messages: list[dict]) -> None:
        traj.messages = [dict(m) for m in messages]
        traj.asked = len(messages)
        traj.rendered = list(traj.prompt_ids)

    def reset(self, traj, text: str) -> list[int]:
        """The prompt with a reset observation: the template's rendering of the prompt's messages
        and the observation as a message of its own (a prompt is never trained on)."""
        traj.messages = traj.messages + [{"role": self.role, "content": text}]
        traj.rendered = self.render(traj.messages, True, traj.asked)
        return list(traj.rendered)

    def step(self, traj, turn_ids: list[int], text: str) -> tuple[list[int], list[int] | None]:
        """(observation tokens, None) while the extension property holds; (observation tokens,
        the template's rendering of the whole conversation) where it fails: the caller splits."""
        said = self.tokenizer.decode(turn_ids, skip_special_tokens=True)
        before = traj.rendered
        closed_msgs = traj.messages + [{"role": "assistant", "content": said}]
        messages = closed_msgs + [{"role": self.role, "content": text}]
        closed = self.render(closed_msgs, False, traj.asked)
        after = self.render(messages, True, traj.asked)
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
        closed = self.render(base, False, len(base))
        after = self.render(base + [{"role": self.role, "content": text}], True, len(base))
        return after[_common(closed, after) :]


def _differing(text: str, other: str) -> tuple[int, int]:
    """The span of ``text`` where it differs from ``other`` (their common prefix and suffix cut
    off)."""
    start = _common(text, other)
    most = min(len(text), len(other)) - start
    end = 0
    while end < most and text[-1 - end] == other[-1 - end]:
        end += 1
    return start, len(text) - end


def _starts(seq: list[int], prefix: list[int]) -> bool:
    return seq[: len(prefix)] == prefix


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
