"""Scoring that overlaps generation: each prompt's group is scored as soon as its last sample
finishes, while the engine keeps stepping the others.

Why: in a continuous batch the groups finish at different engine steps (a short answer leaves
early, the longest response sets the end), so scoring the whole batch after the last step leaves
the reward functions' time, a slow tool or a remote judge, on the step's critical path. Here the
rollout worker drives the backend's streaming interface itself (``add`` / ``step`` / ``done`` /
``take``, the loop of :meth:`~hybridrl.rollout.base.RolloutEngine.generate_streamed`) and hands
every finished group to a scoring thread. Only what is left of the last groups' scoring remains
after generation.

What stays the same as scoring after generation:

- the samples: the same backend calls in the same order (the engine is stepped only from the
  calling thread, and a prompt's tokens depend on its own seed, never on when it was taken);
- the batch order: samples come back in prompt order, each group's as ``take`` returned it;
- the rewards: a per-sample reward function sees the same inputs. A batched function (TRL-style,
  a reward model added with ``Scorer.add_scorer``) is called once per group instead of once per
  batch, as in asynchronous training, which also scores group by group;
- async reward functions stay concurrent: groups that finish together are scored on different
  threads, each group's calls awaited concurrently as before (the scorer's helper pools are
  thread-safe);
- a reward function that hangs past its budget still stops the run: the first failed group's
  error is raised as soon as it is seen.

Which backends: those whose ``step`` is their own (the native engine's continuous batch, the
multi-turn rollout). A backend whose ``step`` is the base class's default (one ``generate`` over
everything queued: hf, the external servers) finishes every group at once, so it keeps the plain
path (generate, then score).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from hybridrl.protocol import Sample
from hybridrl.rollout.base import RolloutEngine, SamplingParams

# scoring threads per generate call at most (a thread is only started when a group waits for one)
MAX_SCORING_THREADS = 32


def steps_itself(backend) -> bool:
    """Whether ``backend`` steps a continuous batch of its own (its groups can finish at
    different steps), i.e. its ``step`` is not :class:`RolloutEngine`'s one-``generate`` default."""
    step = getattr(type(backend), "step", None)
    return isinstance(backend, RolloutEngine) and step is not RolloutEngine.step


def generate_scored(
    backend: RolloutEngine,
    score: Callable[[list[Sample]], list[Sample]],
    prompts: list[Sample],
    params: SamplingParams,
    threads: int = MAX_SCORING_THREADS,
) -> list[Sample]:
    """``score(backend.generate(prompts, params))`` with each prompt's group scored on a helper
    thread as soon as it is done (see the module docstring): ``params.n`` scored samples per prompt,
    in prompt order. A prompt the backend did not queue (aborted) comes back as its aborted
    samples, scored after generation as the plain path scores them."""
    n = max(1, params.n)
    queued = {id(p) for p in backend.add(prompts, params)}
    pending = [i for i, p in enumerate(prompts) if id(p) in queued]
    scored: dict[int, Future] = {}
    with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="score") as pool:
        try:
            while pending:
                backend.step()
                waiting = []
                for i in pending:
                    if backend.done(prompts[i], n):
                        scored[i] = pool.submit(score, backend.take(prompts[i], n))
                    else:
                        waiting.append(i)
                pending = waiting
                _raise_failed(scored)
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        out: list[Sample] = []
        for i, p in enumerate(prompts):
            out += scored[i].result() if i in scored else score(backend.take(p, n))
    return out


def _raise_failed(scored: dict[int, Future]) -> None:
    """Re-raise the first error of a finished scoring call (a hung reward function stops the run
    now, not after generation)."""
    for future in scored.values():
        if future.done() and future.exception() is not None:
            raise future.exception()
