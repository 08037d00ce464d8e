"""Scoring that overlaps generation: each prompt's group is scored as soon as its last sample
finishes, while the engine keeps stepping the others.

Why: in a continuous batch the groups finish at different engine steps (a short answer leaves
early, the longest response sets the end), so scoring the whole batch after the last step leaves
the reward functions' time, a slow tool or a remote judge, on the step's critical path. Here the
rollout worker drives the backend's streaming interface itself (``add`` / ``step`` / ``done`` /
``take``, through :class:`~hybridrl.rollout.base.InFlight` like every caller) and hands
the finished groups to a scoring thread: while it scores one call, the groups that finish wait,
and when it is free they all go in its next call. Only what is left of the last groups' scoring
remains after generation.

What stays the same as scoring after generation:

- the samples: the same backend calls in the same order (the engine is stepped only from the
  calling thread, and a prompt's tokens depend on its own seed, never on when it was taken);
- the batch order: samples come back in prompt order, each group's as ``take`` returned it;
- the rewards: a per-sample reward function sees the same inputs. A batched function (TRL-style,
  a reward model added with ``Scorer.add_scorer``) is called once per scorer call, on the whole
  groups that call holds, instead of once on the batch (asynchronous training scores group by
  group too);
- async reward functions stay concurrent: one scorer call awaits all its samples' calls together,
  as before, and the groups that finish while a call runs are scored together in the next one;
- a reward function that hangs past its budget still stops the run: a failed call's error is
  raised at the next engine step.

Which backends: those whose ``step`` is their own (the native engine's continuous batch, an
episode). A backend whose ``step`` is the base class's default (one ``generate`` over
everything queued: hf, the external servers) finishes every group at once, so it keeps the plain
path (generate, then score).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor

from hybridrl.protocol import Sample
from hybridrl.rollout.base import InFlight, RolloutEngine, SamplingParams


def steps_itself(backend) -> bool:
    """Whether ``backend`` steps a continuous batch of its own (its groups can finish at
    different steps), i.e. its ``step`` is not :class:`RolloutEngine`'s one-``generate`` default."""
    step = getattr(type(backend), "step", None)
    return isinstance(backend, RolloutEngine) and step is not RolloutEngine.step


class Scoring:
    """One scoring thread fed between engine steps: while it scores, finished groups wait; when it
    is free, every group waiting goes in one scorer call (so the calls and thread hand-offs stay
    few, and an async function's calls for all those groups are awaited together). The rollout
    stream scores through it too. Groups are known by a key of the caller's."""

    def __init__(self, score: Callable[[list[Sample]], list[Sample]]):
        self.score = score
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="score")
        self.waiting: list[tuple[Hashable, list[Sample]]] = []  # (key, its samples)
        self.flight: tuple[Future, list[tuple[Hashable, int]]] | None = None  # (call, (key, size))
        self.scored: dict[Hashable, list[Sample]] = {}

    def add(self, key: Hashable, group: list[Sample]) -> None:
        self.waiting.append((key, group))

    @property
    def busy(self) -> bool:
        """Whether a group is waiting, being scored, or scored and not yet taken."""
        return bool(self.waiting or self.scored) or self.flight is not None

    def take(self) -> dict[Hashable, list[Sample]]:
        """The groups scored so far and not yet taken, by key."""
        out, self.scored = self.scored, {}
        return out

    def pump(self) -> None:
        """Collect the call in flight if it is done (raising its error), then start the next."""
        if self.flight is not None and self.flight[0].done():
            self._collect()
        if self.flight is None and self.waiting:
            samples = [s for _, group in self.waiting for s in group]
            sizes = [(i, len(group)) for i, group in self.waiting]
            self.flight, self.waiting = (self.pool.submit(self.score, samples), sizes), []

    def finish(self) -> dict[int, list[Sample]]:
        """Wait for the call in flight, score what still waits; every group's scored samples not
        yet taken."""
        if self.flight is not None:
            self._collect()
        self.pump()
        if self.flight is not None:
            self._collect()
        return self.take()

    def _collect(self) -> None:
        future, sizes = self.flight
        self.flight = None
        out, at = future.result(), 0
        for i, n in sizes:
            self.scored[i], at = out[at : at + n], at + n

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def generate_scored(
    backend: RolloutEngine,
    score: Callable[[list[Sample]], list[Sample]],
    prompts: list[Sample],
    params: SamplingParams,
) -> list[Sample]:
    """``score(backend.generate(prompts, params))`` with the groups scored on a helper thread as
    they finish (see the module docstring): ``params.n`` scored samples per prompt, in prompt
    order. A prompt the backend did not queue (aborted) comes back as its aborted samples, scored
    like the others."""
    flight, index = InFlight(backend), {id(p): i for i, p in enumerate(prompts)}
    flight.add(prompts, params)
    scoring = Scoring(score)
    try:
        while flight:
            for p, samples in flight.step():
                scoring.add(index[id(p)], samples)
            scoring.pump()
        scored = scoring.finish()
    finally:
        scoring.close()
    return [s for i in range(len(prompts)) for s in scored[i]]
