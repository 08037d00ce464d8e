"""Episodes: the rollout of one prompt as an ``async def`` (``rollout.episode``).

    async def episode(gen, prompt, params):
        hint = gen.tokenizer.encode("\\nCheck your answer.\\n", add_special_tokens=False)

        async def attempt():
            draft = await gen.generate(prompt.prompt_ids)
            final = await gen.generate(draft.prompt_ids + draft.response_ids + hint)
            return gen.join(draft, hint, final)

        return await asyncio.gather(*(attempt() for _ in range(params.n)))

AReaL lite's ``arun_episode`` is the model: the smallest surface a user implements, for what the
built-in rollouts do not cover: self-refinement, several agents, a judge, tools awaited in Python.
The environment rollout (``env.name``) is itself an episode, :class:`~hybridrl.rollout.multiturn.
EnvEpisode`, written on this interface alone: a user who needs another loop copies and changes it.
``episode(gen, prompt, params)`` gets the prompt sample (``prompt.metadata["prompt"]`` is the task's
prompt, with its answer) and the run's sampling parameters (``params.n`` =
``trainer.samples_per_prompt``), and returns the prompt's group: ``params.n`` trajectories, each a
sample to train on or, where one trajectory became several samples (a chat template that rewrote
the conversation), a list of them; every sample is scored like any other.

* ``await gen.generate(prompt_ids, name=None, frozen=False, **sampling)``: one completion of
  ``prompt_ids`` by the configured backend, as a :class:`~hybridrl.protocol.Sample` (response
  tokens, behaviour log-probs, weight versions, status), under ``params`` with ``n`` = 1 and any
  field replaced by keyword (``max_new_tokens``, ``stop``, ``temperature`` ...). Calls may run at
  once (``asyncio.gather``): they join the engine's batch. Each call is a request of its own whose
  seed, and so whose tokens, come from the run seed and its uid. An unnamed call's uid is made
  from the prompt's, the tokens it continues and how many calls of the episode continued the same
  tokens before it (:func:`request_uid`): its tokens never depend on the order in which the engine
  finishes the episode's calls or on what else it runs. Where the order in which calls are *asked*
  can vary (trajectories that await a tool before they generate), name each call: ``name``, unique
  within the episode, makes the uid ``<prompt uid>/<name>``. ``frozen=True`` generates with the
  frozen copy of the starting policy that no weight sync reaches (made only with
  ``env.cross_policy_frac`` > 0). A call whose context can never fit the model raises
  ``ValueError`` in the episode.
* ``gen.join(first, *parts)``: one sample from a completion and what followed it, token in token
  out: a list of token ids (an observation, a hint) joins the response with loss mask 0 and
  log-prob 0; a later completion must have been generated from exactly the tokens so far, and joins
  with its own log-probs, versions and loss mask 1.
* ``gen.tokenizer``: the run's tokenizer; ``gen.version``: the policy's weight version now.

Each episode runs on one event-loop thread beside the engine (:class:`~hybridrl.rollout.turns.
EnvCalls`); the engine's thread steps the inner backend over the completions asked for, and hands
each back as it finishes. Over a batch-synchronous backend (one ``generate`` per step: ``hf``,
``vllm``, ``sglang``) a step first waits, up to ``BATCH_WAIT_S``, until every running episode waits
for a completion, so that the calls made after a tool's answer join one engine call. An episode that
raises, runs past ``rollout.episode_timeout_s``, or returns anything but ``params.n`` well-formed
trajectories comes back as its prompt's ``params.n`` aborted samples (empty responses), counted in
``episode/errors`` with its first failures logged in full; the run goes on. An aborted prompt's
episode runs on: its completions in the engine come back ``aborted`` with the tokens they have, its
later calls come back aborted at once (empty), and it returns what it has; one still running
``ABORT_WAIT_S`` after the abort is cancelled and its group comes back as empty aborted samples.
Completions an episode left running when it ended are aborted in the engine.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from hybridrl.moe.routing import NOT_ROUTED
from hybridrl.protocol import Sample
from hybridrl.rollout.base import RolloutEngine, SamplingParams
from hybridrl.rollout.turns import EnvCalls

log = logging.getLogger(__name__)
IDLE_WAIT_S = 0.005  # no completion in the engine: how long a step waits for an episode to ask
BATCH_WAIT_S = 0.05  # a batch-synchronous inner backend: the longest a step lets calls gather
ABORT_WAIT_S = 1.0  # how long an aborted prompt's episode may take to return what it has
MAX_EPISODES = 1 << 16  # episodes running at once on a rollout rank (the queue bounds them)
LOGGED_ERRORS = 5  # failed episodes logged in full; later ones only counted


@dataclass
class Group:
    """One prompt's episode: its future (the trajectories it returns), its calls so far, whether
    and when it was aborted."""

    prompt: Sample
    params: SamplingParams
    future: Any = None
    calls: int = 0
    continued: dict[tuple, int] = field(default_factory=dict)  # context -> its last call's index
    names: set[str] = field(default_factory=set)  # the names its calls were given
    waiting: int = 0  # its calls asked for and not yet answered
    aborted_at: float | None = None  # time.monotonic() of its abort


class Generator:
    """What an episode is given to generate with (module docstring)."""

    def __init__(self, rollout: EpisodeRollout, group: Group):
        self.rollout, self.group = rollout, group
        self.tokenizer = rollout.tokenizer

    @property
    def version(self) -> int:
        return self.rollout.version

    async def generate(
        self, prompt_ids: list[int], name: str | None = None, frozen: bool = False, **sampling
    ) -> Sample:
        g = self.group
        ids = [int(t) for t in prompt_ids]
        if name is None:
            i = g.continued[tuple(ids)] = g.continued.get(tuple(ids), -1) + 1
            uid = request_uid(g.prompt.uid, ids, i)
        elif name in g.names:
            raise RuntimeError(f"gen.generate: the name {name!r} was given to an earlier call")
        else:
            g.names.add(name)
            uid = f"{g.prompt.uid}/{name}"
        if frozen and self.rollout.frozen is None:
            raise RuntimeError(
                "gen.generate(frozen=True): this run has no frozen policy (it is made only with "
                "env.cross_policy_frac > 0)"
            )
        request = Sample(
            prompt_ids=ids,
            uid=uid,
            task_id=g.prompt.task_id,
            metadata={"prompt": g.prompt.metadata.get("prompt")},
        )
        g.calls += 1
        if g.aborted_at is not None:
            await asyncio.sleep(0)  # an episode that asks on and on still lets the loop run
            return request.aborted()
        future = asyncio.get_running_loop().create_future()
        self.rollout.ask(g, request, replace(g.params, n=1, **sampling), frozen, future)
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


class EpisodeRollout(RolloutEngine):
    """The rollout interface over another backend, ``inner``, each prompt's samples made by
    ``episode`` (module docstring). The engine's state and controls are the inner backend's: its
    weight version, weight syncs, pause, memory; any other attribute (``engine``, ``model`` ...)
    is read from it. ``frozen``: the frozen policy's backend that ``gen.generate(frozen=True)``
    uses, or None. An episode object may have ``stats()`` (added to the rollout's statistics) and
    ``busy()`` (its own calls running, which a batch-synchronous step waits for)."""

    def __init__(
        self,
        inner: RolloutEngine,
        episode,
        tokenizer,
        timeout_s: float | None = None,
        frozen: RolloutEngine | None = None,
    ):
        self.inner = inner
        super().__init__()
        self.batched = type(inner).step is RolloutEngine.step  # no continuous batching
        self.groups: dict[str, Group] = {}  # prompt uid -> its episode
        self.lock = threading.RLock()  # one step at a time (generate may run beside the stream)
        self.episode, self.tokenizer, self.frozen = episode, tokenizer, frozen
        self.calls = EnvCalls(timeout_s, MAX_EPISODES)
        # completions asked for, (episode, request, params, frozen, future): not yet in an engine
        self.asked: list[tuple[Group, Sample, SamplingParams, bool, asyncio.Future]] = []
        # in an engine, by request uid: (episode, request, its engine, future)
        self.running: dict[str, tuple[Group, Sample, RolloutEngine, asyncio.Future]] = {}
        self.wake = threading.Condition()  # an episode asked or finished
        self.counts: dict[str, float] = defaultdict(float)

    # --- the engine's state and controls: the inner backend's -------------------------------------
    # the inner engine holds the weight version (RolloutEngine.__init__ assigns 0: ignored)
    @property
    def version(self) -> int:
        return self.inner.version

    @version.setter
    def version(self, value: int) -> None:
        pass

    def __getattr__(self, name: str):  # engine, model ...: the inner backend's
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def update_weights(self, named_tensors, version: int) -> int:
        return self.inner.update_weights(named_tensors, version)

    def _load_weights(self, named_tensors, version: int) -> int:
        return self.inner._load_weights(named_tensors, version)

    def check_servable(self) -> None:
        self.inner.check_servable()

    def pause(self) -> None:
        self.inner.pause()

    def resume(self) -> None:
        self.inner.resume()

    def release_memory(self) -> None:
        self.inner.release_memory()

    def wake_up(self) -> None:
        self.inner.wake_up()

    # --- the rollout interface --------------------------------------------------------------------
    def generate(self, prompts: list[Sample], params: SamplingParams) -> list[Sample]:
        return self.generate_streamed(prompts, params)

    def add(self, prompts: list[Sample], params: SamplingParams) -> list[Sample]:
        """Start making each prompt's samples (:meth:`begin`), but an aborted prompt's; a prompt
        already generating is refused."""
        self.inner.check_servable()
        added = [p for p in prompts if p.uid not in self._aborted]
        with self.lock:
            for p in added:
                if p.uid in self.groups:
                    raise ValueError(f"prompt {p.uid!r} is already generating")
                self.groups[p.uid] = self.begin(p, params)
        return added

    def begin(self, prompt: Sample, params: SamplingParams) -> Group:
        """``prompt``'s episode started on the episodes' loop (under the lock)."""
        g = Group(prompt, params)
        g.future = self.calls.submit(self.episode, Generator(self, g), prompt, params)
        g.future.add_done_callback(lambda _: self._notify())
        return g

    def step(self) -> int:
        """The completions asked for added to their engine, one step of each engine that runs
        any, and each finished completion handed back to its episode; over a batch-synchronous
        backend, first a wait for every running episode to ask (at most ``BATCH_WAIT_S``); with
        nothing in an engine, a short wait for a call."""
        with self.lock:
            with self.wake:
                if self.batched:
                    self.wake.wait_for(self._all_waiting, BATCH_WAIT_S)
                elif not self.running and not self.asked:
                    self.wake.wait(IDLE_WAIT_S)
            self._add_asked()
            engines = {id(e): e for _, _, e, _ in self.running.values()}
            tokens = sum(e.step() for e in engines.values())
            for uid, (g, request, engine, future) in list(self.running.items()):
                if engine.done(request, 1):
                    del self.running[uid]
                    self._answer(g, future, engine.take(request, 1)[0])
            return tokens

    def done(self, prompt: Sample, n: int) -> bool:
        g = self.groups.get(prompt.uid)
        if g is None:
            return prompt.uid in self._aborted
        late = g.aborted_at is not None and time.monotonic() - g.aborted_at > ABORT_WAIT_S
        return late or g.future.done()

    def take(self, prompt: Sample, n: int) -> list[Sample]:
        with self.lock:
            g = self.groups.pop(prompt.uid, None)
            if g is not None:
                self._drop(g)
            if g is None or not g.future.done():  # never added, or aborted and still running
                if g is not None:
                    g.future.cancel()
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
        """Abort prompts: their completions in an engine are aborted there (they come back to
        their episode with the tokens they have), their later calls come back aborted at once, and
        each group is done when its episode returns, or ``ABORT_WAIT_S`` from now."""
        ids = set(request_ids)
        super().abort(ids)
        with self.lock:
            for uid in ids & self.groups.keys():
                self.groups[uid].aborted_at = time.monotonic()
                self._drop(self.groups[uid])
            with self.wake:  # an aborted episode's calls not yet in an engine: answered aborted
                asked = [a for a in self.asked if a[0].aborted_at is not None]
                self.asked = [a for a in self.asked if a[0].aborted_at is None]
            for g, request, _, _, future in asked:
                self._answer(g, future, request.aborted())

    def stats(self) -> dict[str, float]:
        """The inner engine's statistics and the episode object's (where it has ``stats()``), with
        the episodes' since the last call: ``episode/count``, ``episode/errors``,
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
        own = self.episode.stats() if hasattr(self.episode, "stats") else {}
        return self.inner.stats() | own | out

    def close(self) -> None:
        self.calls.close()
        for engine in (self.inner, self.frozen):
            if engine is not None:
                engine.close()

    # --- the engine's side of a generate call -----------------------------------------------------
    def ask(self, g: Group, request: Sample, params: SamplingParams, frozen: bool, future) -> None:
        """On the episodes' loop: queue a completion for the next step."""
        with self.wake:
            g.waiting += 1
            self.asked.append((g, request, params, frozen, future))
            self.wake.notify_all()

    def _all_waiting(self) -> bool:
        """Whether every running episode waits for a completion, and the episode object (where it
        has ``busy()``) has no call of its own running (a tool)."""
        if hasattr(self.episode, "busy") and self.episode.busy():
            return False
        return all(
            g.waiting or g.aborted_at is not None or g.future.done() for g in self.groups.values()
        )

    def _notify(self) -> None:
        with self.wake:
            self.wake.notify_all()

    def _add_asked(self) -> None:
        with self.wake:
            asked, self.asked = self.asked, []
        for g, request, params, frozen, future in asked:
            engine = self.frozen if frozen else self.inner
            try:
                added = g.aborted_at is None and engine.add([request], params)
            except ValueError as e:  # e.g. a context that can never fit the model
                self._answer(g, future, error=e)
                continue
            if added:
                self.running[request.uid] = (g, request, engine, future)
            else:
                self._answer(g, future, request.aborted())

    def _drop(self, g: Group) -> None:
        """Abort in its engine each completion of ``g``'s episode that is still running (taken as
        it finishes: handed back to a running episode, dropped after it ended)."""
        for uid, (owner, _, engine, _) in self.running.items():
            if owner is g:
                engine.abort([uid])

    def _answer(self, g: Group, future, sample: Sample | None = None, error=None) -> None:
        with self.wake:
            g.waiting -= 1

        def settle() -> None:
            if not future.done():  # the episode was cancelled meanwhile
                future.set_exception(error) if error is not None else future.set_result(sample)

        self.calls.loop.call_soon_threadsafe(settle)


def request_uid(prompt_uid: str, context: list[int], i: int) -> str:
    """The uid of an episode's ``i``-th unnamed call (from 0) that continues ``context``."""
    digest = hashlib.sha1(repr([int(t) for t in context]).encode()).hexdigest()[:12]
    return f"{prompt_uid}/e{digest}.{i}"


def checked(trajectories: Any, n: int) -> list[Sample]:
    """The samples of ``trajectories`` when it is a list of ``n`` trajectories, each a sample or a
    non-empty list of samples, whose tokens, log-probs, versions and loss mask line up; a
    ValueError naming the first fault otherwise."""
    if not isinstance(trajectories, (list, tuple)) or len(trajectories) != n:
        raise ValueError(
            f"an episode returns its prompt's group, a list of params.n = {n} Samples (or lists "
            f"of Samples: one trajectory's parts); got {trajectories!r:.80}"
        )
    samples = []
    for i, t in enumerate(trajectories):
        parts = list(t) if isinstance(t, (list, tuple)) and t else [t]
        for s in parts:
            if not isinstance(s, Sample):
                raise ValueError(
                    f"an episode returned {type(s).__name__} at [{i}], not a Sample or a "
                    "non-empty list of Samples"
                )
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
            samples.append(s)
    return samples


def with_episode(cfg, backend: RolloutEngine, tokenizer, frozen=None) -> RolloutEngine:
    """``backend`` as it is (``rollout.episode`` and ``env.name`` null), or each prompt's samples
    made by the configured episode, or by the environment's (:class:`~hybridrl.rollout.multiturn.
    EnvEpisode`, or the subclass ``rollout.episode`` names); ``frozen``: the frozen policy's
    backend of cross-policy sampling (None: off)."""
    from hybridrl.registry import load_dotted

    if cfg.env.name is not None:
        from hybridrl.rollout.multiturn import EnvEpisode

        loop = EnvEpisode if cfg.rollout.episode is None else load_dotted(cfg.rollout.episode)
        episode = loop(tokenizer, cfg.env, data=cfg.data)
    elif cfg.rollout.episode is not None:
        episode = load_dotted(cfg.rollout.episode)
    else:
        return backend
    return EpisodeRollout(backend, episode, tokenizer, cfg.rollout.episode_timeout_s, frozen)
