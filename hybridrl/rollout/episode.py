"""Episodes a user writes: the rollout of one prompt as an ``async def`` (``rollout.episode``).

    async def episode(gen, prompt, params):
        hint = gen.tokenizer.encode("\\nCheck your answer.\\n", add_special_tokens=False)

        async def attempt():
            draft = await gen.generate(prompt.prompt_ids)
            final = await gen.generate(draft.prompt_ids + draft.response_ids + hint)
            return gen.join(draft, hint, final)

        return await asyncio.gather(*(attempt() for _ in range(params.n)))

AReaL lite's ``arun_episode`` is the model: the smallest surface a user implements, for what the
built-in single-turn and environment (``env.name``) rollouts do not cover: self-refinement, several
agents, a judge, tools awaited in Python. ``episode(gen, prompt, params)`` gets the prompt sample
(``prompt.metadata["prompt"]`` is the task's prompt, with its answer) and the run's sampling
parameters (``params.n`` = ``trainer.samples_per_prompt``), and returns the prompt's group:
``params.n`` samples to train on, each scored by the task's reward function like any sample.

* ``await gen.generate(prompt_ids, **sampling)``: one completion of ``prompt_ids`` by the configured
  backend, as a :class:`~hybridrl.protocol.Sample` (response tokens, behaviour log-probs, weight
  versions, status), under ``params`` with ``n`` = 1 and any field replaced by keyword
  (``max_new_tokens``, ``stop``, ``temperature`` ...). Calls may run at once (``asyncio.gather``):
  they join the engine's batch. Each call is a request of its own, its uid made from the prompt's,
  the tokens it continues and how many calls of the episode continued the same tokens before it
  (:func:`request_uid`), so its seed, and so its tokens, depend on the run seed and on what it
  continues, never on the order in which the engine finishes the episode's calls or on what else
  it runs. A call whose context can never fit the model raises ``ValueError`` in the episode.
* ``gen.join(first, *parts)``: one sample from a completion and what followed it, token in token
  out: a list of token ids (an observation, a hint) joins the response with loss mask 0 and
  log-prob 0; a later completion must have been generated from exactly the tokens so far, and joins
  with its own log-probs, versions and loss mask 1.
* ``gen.tokenizer``: the run's tokenizer.

Each episode runs on one event-loop thread beside the engine (the environment calls' loop,
:class:`~hybridrl.rollout.turns.EnvCalls`); the engine's thread steps the inner backend over the
completions asked for, and hands each back as it finishes. An episode that raises, runs past
``rollout.episode_timeout_s``, or returns anything but ``params.n`` well-formed samples comes back
as its prompt's ``params.n`` aborted samples (empty responses), counted in ``episode/errors`` with
its first failures logged in full; the run goes on. An aborted prompt's episode is cancelled and its
group comes back aborted at once; completions an episode left running when it ended are aborted in
the engine.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from hybridrl.moe.routing import NOT_ROUTED
from hybridrl.protocol import Sample
from hybridrl.rollout.base import RolloutEngine, RolloutLayer, SamplingParams
from hybridrl.rollout.turns import EnvCalls

log = logging.getLogger(__name__)
IDLE_WAIT_S = 0.005  # no completion in the engine: how long a step waits for an episode to ask
BATCH_WAIT_S = 0.05  # a batch-synchronous inner backend: the longest a step lets calls gather
MAX_EPISODES = 1 << 16  # episodes running at once on a rollout rank (the queue bounds them)
LOGGED_ERRORS = 5  # failed episodes logged in full; later ones only counted


@dataclass
class Group:
    """One prompt's episode: its future (the samples it returns), its calls so far, whether it
    was aborted."""

    prompt: Sample
    params: SamplingParams
    future: Any = None
    calls: int = 0
    continued: dict[tuple, int] = field(default_factory=dict)  # context -> its last call's index
    aborted: bool = False


class Generator:
    """What an episode is given to generate with (module docstring)."""

    def __init__(self, rollout: EpisodeRollout, group: Group):
        self.rollout, self.group = rollout, group
        self.tokenizer = rollout.tokenizer

    async def generate(self, prompt_ids: list[int], **sampling) -> Sample:
        g = self.group
        ids = [int(t) for t in prompt_ids]
        i = g.continued[tuple(ids)] = g.continued.get(tuple(ids), -1) + 1
        request = Sample(
            prompt_ids=ids,
            uid=request_uid(g.prompt.uid, ids, i),
            task_id=g.prompt.task_id,
            metadata={"prompt": g.prompt.metadata.get("prompt")},
        )
        g.calls += 1
        if g.aborted:
            return request.aborted()
        future = asyncio.get_running_loop().create_future()
        self.rollout.ask(g, request, replace(g.params, n=1, **sampling), future)
        return await future

    @staticmethod
    def join(first: Sample, *parts: Sample | list[int]) -> Sample:
        ids, logps = list(first.response_ids), list(first.log_probs)
        versions = list(first.versions)
        mask = list(first.loss_mask) if first.loss_mask is not None else [1] * len(ids)
        status, routing = first.status, first.routing
        for part in parts:
            if isinstance(part, Sample):
                if part.prompt_ids != first.prompt_ids + ids:
                    raise ValueError(
                        "join: a completion was not generated from the tokens joined so far "
                        f"({len(part.prompt_ids)} prompt tokens, "
                        f"{len(first.prompt_ids) + len(ids)} joined): generate it from "
                        "sample.prompt_ids + sample.response_ids"
                    )
                ids += part.response_ids
                logps += part.log_probs
                versions += part.versions
                mask += part.loss_mask if part.loss_mask is not None else [1] * len(part.log_probs)
                status = part.status
                routing = part.routing  # an MoE model's: its prompt's routing is all joined so far
            else:
                tokens = [int(t) for t in part]
                ids += tokens
                logps += [0.0] * len(tokens)
                versions += [versions[-1] if versions else 0] * len(tokens)
                mask += [0] * len(tokens)
                if routing is not None:  # tokens no forward routed: NOT_ROUTED
                    pad = torch.full((len(tokens), *routing.shape[1:]), NOT_ROUTED)
                    routing = torch.cat([routing, pad.to(routing.dtype)])
        return replace(
            first,
            response_ids=ids,
            log_probs=logps,
            versions=versions,
            loss_mask=mask,
            status=status,
            routing=routing,
        )


class EpisodeRollout(RolloutLayer):
    """The rollout interface over ``inner``, each prompt's samples made by ``episode`` (module
    docstring)."""

    def __init__(self, inner: RolloutEngine, episode, tokenizer, timeout_s: float | None = None):
        super().__init__(inner)
        self.episode, self.tokenizer = episode, tokenizer
        self.calls = EnvCalls(timeout_s, MAX_EPISODES)
        # completions asked for, (episode, request, params, future): not yet in the engine; in it
        self.asked: list[tuple[Group, Sample, SamplingParams, asyncio.Future]] = []
        self.running: dict[str, tuple[Group, Sample, asyncio.Future]] = {}  # by request uid
        self.wake = threading.Condition()  # an episode asked or finished
        self.counts: dict[str, float] = defaultdict(float)

    # --- the rollout interface --------------------------------------------------------------------
    def begin(self, prompt: Sample, params: SamplingParams) -> Group:
        g = Group(prompt, params)
        g.future = self.calls.submit(self.episode, Generator(self, g), prompt, params)
        g.future.add_done_callback(lambda _: self._notify())
        return g

    def step(self) -> int:
        """The completions asked for added to the inner engine, one step of it, and each finished
        completion handed back to its episode; with none in the engine, a short wait for one."""
        with self.lock:
            with self.wake:
                if not self.running and not self.asked:
                    self.wake.wait(BATCH_WAIT_S if self.batched else IDLE_WAIT_S)
                if self.batched:  # one generate per step: let the calls made at once join it
                    asked = -1
                    while len(self.asked) != asked:
                        asked = len(self.asked)
                        self.wake.wait(IDLE_WAIT_S)
            self._add_asked()
            if not self.running:
                return 0
            tokens = self.inner.step()
            for uid, (_, request, future) in list(self.running.items()):
                if self.inner.done(request, 1):
                    del self.running[uid]
                    self._answer(future, self.inner.take(request, 1)[0])
            return tokens

    def done(self, prompt: Sample, n: int) -> bool:
        g = self.groups.get(prompt.uid)
        if g is None:
            return prompt.uid in self._aborted
        return g.aborted or g.future.done()

    def take(self, prompt: Sample, n: int) -> list[Sample]:
        with self.lock:
            g = self.groups.pop(prompt.uid, None)
            if g is not None:
                self._drop(g)
            if g is None or g.aborted:
                return [prompt.aborted() for _ in range(n)]
            try:
                samples = checked(g.future.result(), n)
            except Exception as e:  # a broken episode must not stop the run
                self.counts["errors"] += 1
                if self.counts["errors"] <= LOGGED_ERRORS:
                    log.error("episode of prompt %r failed: %r", prompt.uid, e, exc_info=e)
                return [prompt.aborted() for _ in range(n)]
            self.counts["episodes"] += 1
            self.counts["calls"] += g.calls
        return [
            replace(
                s,
                uid=prompt.uid,
                task_id=prompt.task_id,
                reward_extras=dict(s.reward_extras),  # each sample is scored on its own
                metadata=prompt.metadata | s.metadata,
            )
            for s in samples
        ]

    def abort(self, request_ids) -> None:
        """Abort prompts: their completions in the engine are aborted there, their later calls
        return aborted samples, and their groups come back aborted now."""
        ids = set(request_ids)
        super().abort(ids)
        with self.lock:
            for uid in ids & self.groups.keys():
                g = self.groups[uid]
                g.aborted = True
                g.future.cancel()
                self._drop(g)

    def stats(self) -> dict[str, float]:
        """The inner engine's statistics, with the episodes' since the last call:
        ``episode/count``, ``episode/errors``, ``episode/samples_mean`` and
        ``episode/generate_calls_mean`` (per episode), ``episode/seconds_mean`` / ``_max``."""
        with self.lock:
            c, self.counts = self.counts, defaultdict(float)
        n = c["episodes"]
        out = {
            "episode/count": n,
            "episode/errors": c["errors"],
            "episode/generate_calls_mean": c["calls"] / n if n else 0.0,
        }
        seconds = [s for v in self.calls.take_seconds().values() for s in v]
        if seconds:
            out["episode/seconds_mean"] = sum(seconds) / len(seconds)
            out["episode/seconds_max"] = max(seconds)
        return self.inner.stats() | out

    def close(self) -> None:
        self.calls.close()
        super().close()

    # --- the engine's side of a generate call -----------------------------------------------------
    def ask(self, g: Group, request: Sample, params: SamplingParams, future) -> None:
        """On the episodes' loop: queue a completion for the next step."""
        with self.wake:
            self.asked.append((g, request, params, future))
            self.wake.notify_all()

    def _notify(self) -> None:
        with self.wake:
            self.wake.notify_all()

    def _add_asked(self) -> None:
        with self.wake:
            asked, self.asked = self.asked, []
        for g, request, params, future in asked:
            try:
                added = not g.aborted and self.inner.add([request], params)
            except ValueError as e:  # e.g. a context that can never fit the model
                self._answer(future, error=e)
                continue
            if added:
                self.running[request.uid] = (g, request, future)
            else:
                self._answer(future, request.aborted())

    def _drop(self, g: Group) -> None:
        """Abort in the engine the completions ``g``'s episode left running (they are taken, and
        dropped, as they finish)."""
        mine = [uid for uid, (owner, _, _) in self.running.items() if owner is g]
        if mine:
            self.inner.abort(mine)

    def _answer(self, future: asyncio.Future, sample: Sample | None = None, error=None) -> None:
        def settle() -> None:
            if not future.done():  # the episode was cancelled meanwhile
                future.set_exception(error) if error is not None else future.set_result(sample)

        self.calls.loop.call_soon_threadsafe(settle)


def request_uid(prompt_uid: str, context: list[int], i: int) -> str:
    """The uid of an episode's ``i``-th call (from 0) that continues ``context``."""
    digest = hashlib.sha1(repr([int(t) for t in context]).encode()).hexdigest()[:12]
    return f"{prompt_uid}/e{digest}.{i}"


def checked(samples: Any, n: int) -> list[Sample]:
    """``samples`` when it is a list of ``n`` samples whose tokens, log-probs, versions and loss
    mask line up; a ValueError naming the first fault otherwise."""
    if not isinstance(samples, (list, tuple)) or len(samples) != n:
        raise ValueError(
            f"an episode returns its prompt's group, a list of params.n = {n} Samples; got "
            f"{samples!r:.80}"
        )
    for i, s in enumerate(samples):
        if not isinstance(s, Sample):
            raise ValueError(f"an episode returned {type(s).__name__} at [{i}], not a Sample")
        lengths = {len(s.response_ids), len(s.log_probs), len(s.versions)}
        if s.loss_mask is not None:
            lengths.add(len(s.loss_mask))
        if len(lengths) != 1 or not s.prompt_ids:
            raise ValueError(
                f"sample [{i}] of an episode: {len(s.prompt_ids)} prompt tokens, "
                f"{len(s.response_ids)} response tokens, {len(s.log_probs)} log-probs, "
                f"{len(s.versions)} versions, loss mask "
                f"{'none' if s.loss_mask is None else len(s.loss_mask)}: they must line up "
                "(build it with gen.generate and gen.join)"
            )
    return list(samples)


def with_episode(cfg, backend: RolloutEngine, tokenizer) -> RolloutEngine:
    """``backend`` as it is (``rollout.episode`` null), or each prompt's samples made by the
    configured episode."""
    if cfg.rollout.episode is None:
        return backend
    from hybridrl.registry import load_dotted

    episode = load_dotted(cfg.rollout.episode)
    return EpisodeRollout(backend, episode, tokenizer, cfg.rollout.episode_timeout_s)
