"""Multi-turn rollouts: a rollout backend wrapped so that each trajectory alternates model turns and
environment steps (``env.name`` set; docs/agentic.md).

:class:`MultiTurnRollout` implements the rollout interface (``rollout/base.py``) around an inner
backend, so synchronous training (``generate``) and the asynchronous stream (``add`` / ``step`` /
``done`` / ``take``, ``rollout/stream.py``) work unchanged. Each prompt sample becomes ``n``
trajectories, each with its own environment instance. A model turn is one request (``n`` = 1) to
the inner backend whose prompt is the trajectory so far (prompt, earlier turns, observations), so
the native engine's prefix cache serves the shared part again. A turn ends at eos, at one of
``env.turn_stop`` (kept in the response) or at its token limit; then the environment's ``step``
runs on :class:`~hybridrl.rollout.turns.EnvCalls`, off the engine's thread, and while it waits the
inner engine serves the other trajectories. The observation's tokens join the response with loss
mask 0, log-prob 0 and the weight version of the moment; then the next turn is queued.

Every token keeps the version that produced it: a weight update lands in the inner engine between
two of its steps (in-flight turns continue under the new weights, as the engine does for single-turn
requests), and an aborted prompt's turn in flight is aborted in the inner engine and its trajectory
comes back ``aborted`` with the tokens it has. Limits: ``env.max_turns`` and
``env.max_total_tokens`` (observations included) end a trajectory as ``truncated``. An environment
that raises or runs past ``env.step_timeout_s`` ends its trajectory with reward 0, counted in
``env/errors`` / ``env/timeouts``; the run goes on.

Rewards (:class:`EnvRewards`): with ``task.reward_fn`` null the reward is the sum of the
environment's per-turn rewards; with reward functions given, they score the decoded response
(observations included) as in single-turn training, and the environment's sum is logged as
``reward/env``. A trajectory whose environment failed scores 0 either way.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict, deque
from dataclasses import replace
from typing import Any

from hybridrl.envs.base import ENVIRONMENTS, Env, StepResult
from hybridrl.protocol import Sample
from hybridrl.rollout.base import RolloutEngine, SamplingParams
from hybridrl.rollout.scoring import FAILURE_COUNTS
from hybridrl.rollout.turns import (
    ChatObservations,
    EnvCalls,
    Group,
    PlainObservations,
    Trajectory,
    overrides,
)

log = logging.getLogger(__name__)
IDLE_WAIT_S = 0.005  # nothing in the engine: how long a step waits for an environment to answer
# a batch-synchronous inner backend (one generate per step: hf, vllm, sglang): how long a step
# waits for the environment calls in flight, so that their next turns share one generate call
BATCH_WAIT_S = 0.05
LOGGED_ERRORS = 5  # environment failures logged in full; later ones only counted


class MultiTurnRollout(RolloutEngine):
    """The rollout interface over ``inner``, with an environment per trajectory (module
    docstring). ``env_cfg``: the run's ``env`` section; ``env_cls``: the environment class
    (default: ``env_cfg.name`` looked up in the registry)."""

    def __init__(self, inner: RolloutEngine, tokenizer, env_cfg, env_cls=None):
        self.inner = inner
        super().__init__()
        self.tokenizer, self.cfg = tokenizer, env_cfg
        self.env_cls = env_cls if env_cls is not None else ENVIRONMENTS.get(env_cfg.name)
        self.calls = EnvCalls(env_cfg.step_timeout_s, env_cfg.max_concurrent_steps)
        self.plain = PlainObservations(tokenizer)
        template = getattr(tokenizer, "chat_template", None)
        self.chat = ChatObservations(tokenizer, env_cfg.observation_role) if template else None
        self.groups: dict[str, Group] = {}
        self.in_engine: dict[str, Trajectory] = {}  # turn request uid -> its trajectory
        self.arrived: deque = deque()  # (trajectory, kind, future) of finished environment calls
        self.wake = threading.Condition()
        self.lock = threading.RLock()  # one step at a time (generate may run beside the stream)
        self.counts: dict[str, float] = defaultdict(float)
        self.info: dict[str, list[float]] = defaultdict(list)
        self.calls_out = 0  # environment calls submitted and not yet handled
        self.batched = type(inner).step is RolloutEngine.step  # no continuous batching

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

    # --- the rollout interface --------------------------------------------------------------------
    def generate(self, prompts: list[Sample], params: SamplingParams) -> list[Sample]:
        """``params.n`` trajectories per prompt, in prompt order (more where one was split)."""
        n = max(1, params.n)
        pending = self.add(prompts, params)
        while pending:
            self.step()
            pending = [p for p in pending if not self.done(p, n)]
        return [s for p in prompts for s in self.take(p, n)]

    def add(self, prompts: list[Sample], params: SamplingParams) -> list[Sample]:
        self.inner.check_servable()
        added = [p for p in prompts if p.uid not in self._aborted]
        with self.lock:
            for p in added:
                if p.uid in self.groups:
                    raise ValueError(f"prompt {p.uid!r} is already generating")
                group = self.groups[p.uid] = Group(p, params)
                for i in range(max(1, params.n)):
                    group.trajs.append(Trajectory(group, i, list(p.prompt_ids)))
                    self._begin(group.trajs[-1])
        return added

    def step(self) -> int:
        """One step of the inner engine over the turns in it (when none is, a short wait for an
        environment), with the environments' answers that arrived handled before and after."""
        with self.lock:
            if self.batched and self.calls_out:
                with self.wake:
                    self.wake.wait_for(lambda: len(self.arrived) >= self.calls_out, BATCH_WAIT_S)
            self._handle_arrivals()
            tokens = 0
            if self.in_engine:
                tokens = self.inner.step()
                self._collect_turns()
            else:
                with self.wake:
                    if not self.arrived:
                        self.wake.wait(IDLE_WAIT_S)
            self._handle_arrivals()
            return tokens

    def done(self, prompt: Sample, n: int) -> bool:
        group = self.groups.get(prompt.uid)
        if group is None:
            return prompt.uid in self._aborted
        return all(t.status for t in group.trajs)

    def take(self, prompt: Sample, n: int) -> list[Sample]:
        with self.lock:
            group = self.groups.pop(prompt.uid, None)
        if group is None:
            return [prompt.aborted() for _ in range(n)]
        return [s for t in group.trajs for s in self._samples(t)]

    # --- controls: the inner engine's -------------------------------------------------------------
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

    def abort(self, request_ids) -> None:
        """Abort prompts: a turn in the inner engine is aborted there (its trajectory comes back
        ``aborted`` with its tokens so far), a trajectory waiting for its environment ends at once
        (the answer, when it comes, is dropped)."""
        ids = list(request_ids)
        super().abort(ids)
        with self.lock:
            for uid in ids:
                group = self.groups.get(uid)
                for t in group.trajs if group else ():
                    if t.status:
                        continue
                    t.aborted = True
                    if t.request is not None:
                        self.inner.abort([t.request.uid])
                    else:
                        self._finish(t, "aborted")

    def stats(self) -> dict[str, float]:
        """The inner engine's statistics, with the environments' since the last call: ``env/errors``
        and ``env/timeouts`` (counts), ``env/trajectories``, ``env/turns_mean``,
        ``env/truncated_frac``, ``env/<method>_s_mean`` / ``_max`` (the calls' durations),
        ``env/<key>`` (means of the numbers of the steps' ``info``) and
        ``tito/extension_violations``."""
        with self.lock:
            c, info = self.counts, self.info
            self.counts, self.info = defaultdict(float), defaultdict(list)
        trajs = c["trajectories"]
        out = {
            "env/errors": c["errors"],
            "env/timeouts": c["timeouts"],
            "env/trajectories": trajs,
            "env/turns_mean": c["turns"] / trajs if trajs else 0.0,
            "env/truncated_frac": c["truncated"] / trajs if trajs else 0.0,
            "tito/extension_violations": c["extension_violations"],
        }
        for name, seconds in self.calls.take_seconds().items():
            out[f"env/{name}_s_mean"] = sum(seconds) / len(seconds)
            out[f"env/{name}_s_max"] = max(seconds)
        out |= {f"env/{k}": sum(v) / len(v) for k, v in info.items() if v}
        return self.inner.stats() | out

    def close(self) -> None:
        self.calls.close()

    # --- a trajectory's life ----------------------------------------------------------------------
    def _begin(self, t: Trajectory) -> None:
        prompt = t.group.prompt.metadata.get("prompt")
        chat = self.chat is not None and isinstance(getattr(prompt, "raw", None), list)
        t.obs = self.chat if chat else self.plain
        try:
            t.env = self.env_cls(**self.cfg.kwargs)
            t.obs.start(t, prompt)
        except Exception as e:  # a broken environment must not stop the run
            self._fail(t, "errors", e)
            return
        if hasattr(t.env, "reset") and overrides(t.env, "reset", Env):
            self._call(t, "reset", t.env.reset, prompt)
        else:
            self._next_turn(t)

    def _call(self, t: Trajectory, kind: str, fn, arg) -> None:
        self.calls_out += 1
        future = self.calls.submit(fn, arg)
        future.add_done_callback(lambda f: self._arrive(t, kind, f))

    def _arrive(self, t: Trajectory, kind: str, future) -> None:  # on the event-loop thread
        with self.wake:
            self.arrived.append((t, kind, future))
            self.wake.notify_all()

    def _handle_arrivals(self) -> None:
        while True:
            with self.wake:
                if not self.arrived:
                    return
                t, kind, future = self.arrived.popleft()
            self.calls_out -= 1
            if t.status:  # aborted meanwhile
                continue
            try:
                result = future.result()
            except TimeoutError as e:
                self._fail(t, "timeouts", e)
                continue
            except Exception as e:
                self._fail(t, "errors", e)
                continue
            try:
                if kind == "reset":
                    if result is not None:
                        t.prompt_ids = t.obs.reset(t, str(result))
                    self._next_turn(t)
                else:
                    self._stepped(t, result)
            except Exception as e:  # e.g. an observation the tokenizer cannot encode
                self._fail(t, "errors", e)

    def _next_turn(self, t: Trajectory) -> None:
        left = self.cfg.max_total_tokens - t.total
        if left <= 0:
            self._finish(t, "truncated")
            return
        p = t.group.params
        stop = tuple(p.stop) + tuple(s for s in self.cfg.turn_stop if s not in p.stop)
        params = replace(p, n=1, max_new_tokens=min(p.max_new_tokens, left), stop=stop)
        req = Sample(
            prompt_ids=t.prompt_ids + t.response_ids,
            uid=f"{t.uid}/{t.turns}",
            task_id=t.group.prompt.task_id,
            metadata={"prompt": t.group.prompt.metadata.get("prompt")},
        )
        try:
            added = self.inner.add([req], params)
        except ValueError as e:  # the context no longer fits the model's positions or KV pool
            log.debug("trajectory %s ends: %s", t.uid, e)
            self._finish(t, "truncated")
            return
        if not added:
            self._finish(t, "aborted")
            return
        t.request = req
        self.in_engine[req.uid] = t

    def _collect_turns(self) -> None:
        for uid, t in list(self.in_engine.items()):
            if not self.inner.done(t.request, 1):
                continue
            (s,) = self.inner.take(t.request, 1)[:1]
            del self.in_engine[uid]
            t.request = None
            self._turn_done(t, s)

    def _turn_done(self, t: Trajectory, s: Sample) -> None:
        ids = list(s.response_ids)
        t.response_ids += ids
        t.log_probs += s.log_probs
        t.versions += s.versions
        t.loss_mask += [1] * len(ids)
        t.total += len(ids)
        t.turns += 1
        t.last_turn = ids
        if s.status == "aborted" or t.aborted:
            self._finish(t, "aborted")
        elif t.total >= self.cfg.max_total_tokens and s.status != "finished":
            self._finish(t, "truncated")
        else:
            self._call(t, "step", t.env.step, self.tokenizer.decode(ids, skip_special_tokens=True))

    def _stepped(self, t: Trajectory, result: Any) -> None:
        if not isinstance(result, StepResult):
            raise TypeError(f"step returned {type(result).__name__}, not a StepResult")
        t.reward += float(result.reward)
        for key, value in result.info.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.info[key].append(float(value))
        if result.done:
            self._finish(t, "finished")
            return
        if t.turns >= self.cfg.max_turns:
            self._finish(t, "truncated")
            return
        if result.observation is not None:
            ids, rendered = t.obs.step(t, t.last_turn, str(result.observation))
            if rendered is not None:  # the template rewrote the conversation: a new part
                self.counts["extension_violations"] += 1
                t.parts.append(self._part(t, "finished"))
                t.prompt_ids, t.response_ids, t.log_probs, t.versions, t.loss_mask = (
                    list(rendered),
                    [],
                    [],
                    [],
                    [],
                )
                t.total += len(ids)
            else:
                left = self.cfg.max_total_tokens - t.total
                kept = ids[:left]
                t.response_ids += kept
                t.log_probs += [0.0] * len(kept)
                t.versions += [self.inner.version] * len(kept)
                t.loss_mask += [0] * len(kept)
                t.total += len(kept)
                if len(kept) < len(ids):
                    self._finish(t, "truncated")
                    return
        self._next_turn(t)

    def _fail(self, t: Trajectory, kind: str, error: BaseException) -> None:
        self.counts[kind] += 1
        if self.counts[kind] <= LOGGED_ERRORS:
            what = "ran past env.step_timeout_s" if kind == "timeouts" else f"raised {error!r}"
            log.warning("environment of trajectory %s %s: it ends with reward 0", t.uid, what)
        t.error, t.reward = kind, 0.0
        self._finish(t, "truncated")

    def _finish(self, t: Trajectory, status: str) -> None:
        t.status = status
        self.counts["trajectories"] += 1
        self.counts["turns"] += t.turns
        self.counts["truncated"] += status == "truncated"
        if t.env is not None and hasattr(t.env, "close") and overrides(t.env, "close", Env):
            self.calls.submit(t.env.close)  # not waited for; its errors are of no consequence

    def _part(self, t: Trajectory, status: str) -> Sample:
        s = t.group.prompt.with_response(t.response_ids, t.log_probs, t.versions, status)
        s.prompt_ids, s.loss_mask = list(t.prompt_ids), list(t.loss_mask)
        return s

    def _samples(self, t: Trajectory) -> list[Sample]:
        """The trajectory as samples (one per part), each carrying its outcome in metadata."""
        out = t.parts + [self._part(t, t.status)]
        for i, s in enumerate(out):
            s.metadata = s.metadata | {
                "env_reward": t.reward,
                "env_turns": t.turns,
                "env_error": t.error,
                "env_part": i,
            }
        return out


class EnvRewards:
    """The scorer of a multi-turn rollout (module docstring): the environment's reward, or the
    configured reward functions when ``task.reward_fn`` names any."""

    def __init__(self, cfg, scorer):
        self.scorer, self.use_functions = scorer, bool(cfg.task.reward_fns())

    def __call__(self, samples: list[Sample]) -> list[Sample]:
        if self.use_functions:
            self.scorer(samples)
        for s in samples:
            env_reward = float(s.metadata.get("env_reward", 0.0))
            if self.use_functions:
                s.reward_extras["reward/env"] = env_reward
            else:
                s.reward_extras.update(FAILURE_COUNTS)
                s.reward = env_reward
            if s.metadata.get("env_error") or s.status == "aborted" and not s.response_ids:
                s.reward = 0.0
        return samples

    def __getattr__(self, name: str):
        if name == "scorer":
            raise AttributeError(name)
        return getattr(self.scorer, name)


def with_environment(cfg, backend: RolloutEngine, tokenizer) -> RolloutEngine:
    """``backend`` as it is (``env.name`` null), or wrapped for multi-turn rollouts."""
    if cfg.env.name is None:
        return backend
    return MultiTurnRollout(backend, tokenizer, cfg.env)


def env_rewards(cfg, scorer):
    """``scorer`` as it is (``env.name`` null), or :class:`EnvRewards` around it."""
    return scorer if cfg.env.name is None else EnvRewards(cfg, scorer)
