"""Generation on a rollout rank into the trajectory buffer, the one rollout loop of training.

A :class:`RolloutStream` keeps the engine busy: whenever fewer than ``max_groups`` prompts are
generating it asks the trajectory buffer for more (the buffer applies the staleness rule,
``rollout/buffer.py``), runs engine steps, and as soon as all ``G`` samples of a prompt are done it
scores them and puts the group (its samples, with the prompt's stream ``index`` and ``admitted``
version in their metadata) into the buffer: the data goes rollout -> buffer, not through the
driver. Asynchronous training runs it on a thread of its own (:meth:`start`); weight updates arrive
on another thread between engine steps (``update_weights`` takes the engine lock), the engine then
drops its stale KV and continues every in-flight sequence, and each token keeps the version that
produced it. Synchronous training runs it in the rollout's call, between learner steps
(:meth:`fill`): with staleness 0 the buffer admits one step's prompts, so the call ends with the
step's batch in the buffer. The admitted prompts' samples come from a
:class:`~hybridrl.data.prefetch.PromptPrefetcher`: the ``prefetch`` prompts after the last one
admitted are prepared on a background thread (default ``max_groups``; 0: off). Given the run's
config, each prompt's greedy baseline request is queued beside its samples (ReMax,
``group_hooks.py``); dynamic sampling (DAPO) is the buffer's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from hybridrl.data.prefetch import PromptPrefetcher
from hybridrl.protocol import Sample
from hybridrl.rollout import SamplingParams
from hybridrl.rollout.base import InFlight
from hybridrl.rollout.group_hooks import (
    GREEDY_SUFFIX,
    greedy_request,
    needs_greedy_baseline,
    set_baselines,
)
from hybridrl.rollout.worker_scoring import Scoring

log = logging.getLogger(__name__)
IDLE_SLEEP_S = 0.002
STOP_TIMEOUT_S = 60.0  # how long stopping waits for the engine step in flight


class RolloutStream:
    def __init__(
        self,
        backend,
        buffer,
        task,
        tokenizer,
        scorer,
        params: SamplingParams,
        seed: int,
        max_groups: int,
        prefetch: int | None = None,
        cfg=None,
        on_group: Callable[[list[Sample]], object] = lambda group: None,
    ):
        self.backend, self.buffer, self.task, self.tokenizer = backend, buffer, task, tokenizer
        # a greedy baseline request beside each prompt's samples (group_hooks.py)
        self.cfg = cfg
        self.greedy = cfg is not None and needs_greedy_baseline(cfg)
        # one seed for every request (each request's own comes from it and the prompt's uid), so
        # a backend whose step is one generate call batches the prompts queued
        self.params = replace(params, seed=seed)
        # the prompts' groups are scored on a thread of their own while the engine steps on
        # (worker_scoring.py), then each goes to on_group (the sample tables) and into the buffer
        self.scoring, self.on_group, self.max_groups = Scoring(scorer), on_group, max_groups
        ahead = max_groups if prefetch is None else prefetch
        self.prompts = PromptPrefetcher(task, tokenizer, ahead)
        self.flight = InFlight(backend)  # the requests generating: samples, greedy baselines
        # a prompt generating (metadata: index, admitted version) -> its requests done so far, by
        # uid: its samples and (ReMax) its greedy baseline
        self.generating: dict[str, dict[str, list[Sample]]] = {}
        self.stopping = threading.Event()
        self.error: BaseException | None = None
        self.idle_s = self.busy_s = 0.0
        self.groups = 0
        self.thread = threading.Thread(target=self._run, name="rollout-stream", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Stop generating; raises when the thread does not stop within ``timeout_s`` (an engine
        step that hangs), so that the run's shutdown goes on instead of waiting forever. A stream
        that was only filled (no thread) closes its prompt prefetcher."""
        self.stopping.set()
        if self.thread.ident is None:
            self.prompts.close()
            self.scoring.close()
            return
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            raise RuntimeError(
                f"the rollout stream did not stop within {timeout_s:g} s: an engine step hangs "
                "(the worker is shut down with the run)"
            )
        self.check()

    def check(self) -> None:
        """Re-raise an error of the stream thread in the caller."""
        if self.error is not None:
            raise RuntimeError(f"the rollout stream failed: {self.error!r}") from self.error

    def _admit(self) -> None:
        free = self.max_groups - len(self.generating)
        if free <= 0:
            return
        version = self.backend.version
        for index in self.buffer.admit(free, version):
            prompt = self.prompts.get(index)
            prompt.metadata |= {"index": index, "admitted": version}
            self.flight.add([prompt], self.params)  # its seed: the run's and its uid
            self.generating[prompt.uid] = {}
            if self.greedy:
                greedy = greedy_request(prompt)
                self.flight.add([greedy], replace(self.params, n=1, temperature=0.0))

    def _deliver(self, finished: list[tuple[Sample, list[Sample]]]) -> None:
        """Each prompt whose requests are all done to the scoring thread (its samples, then its
        greedy baseline)."""
        for request, samples in finished:
            uid = request.uid.removesuffix(GREEDY_SUFFIX)
            done = self.generating[uid]
            done[request.uid] = samples
            if len(done) < (2 if self.greedy else 1):
                continue
            del self.generating[uid]
            self.scoring.add(uid, done[uid] + done.get(uid + GREEDY_SUFFIX, []))
        self.scoring.pump()

    def _put(self, scored: dict[str, list[Sample]]) -> None:
        for out in scored.values():
            group = out[:-1] if self.greedy else out
            if self.greedy:
                set_baselines(group, out[-1:], self.cfg)
            self.on_group(group)
            self.buffer.put(group)  # dynamic sampling may drop it there
            self.groups += 1

    def advance(self, eager: bool = True) -> bool:
        """Admit what the buffer allows, take one engine step and put the scored groups into the
        buffer; False when nothing is generating or scoring (the staleness bound holds the stream
        back). ``eager``: each group goes in as soon as it is scored; else only once the engine has
        nothing left to step, all together, in the order they finished, so that what the buffer
        holds and admits next (dynamic sampling's drops) does not depend on the scoring thread's
        timing."""
        self._admit()
        if self.flight:
            self._deliver(self.flight.step())
            if eager:
                self._put(self.scoring.take())
            return True
        if self.scoring.busy:  # the last groups' scoring: a dropped one may admit another
            self._put(self.scoring.finish())
            return True
        return False

    def fill(self) -> None:
        """Synchronous training (no thread): generate until the buffer admits nothing more and
        every admitted group is in it, i.e. the batch of the version the backend holds; the same
        batch on every run (``advance`` not ``eager``)."""
        while self.advance(eager=False):
            pass

    def _run(self) -> None:
        try:
            while not self.stopping.is_set():
                t0 = time.perf_counter()
                if not self.advance():  # wait for the learner
                    time.sleep(IDLE_SLEEP_S)
                    self.idle_s += time.perf_counter() - t0
                    continue
                self.busy_s += time.perf_counter() - t0
        except BaseException as e:  # noqa: BLE001 -- reported to the driver through check()/stats()
            log.exception("rollout stream failed")
            self.error = e
            # the learner stops waiting for data
            self.buffer.close(f"the rollout stream failed: {e!r}")
        finally:
            self.prompts.close()
            self.scoring.close()

    def stats(self) -> dict[str, float]:
        """Since the last call, on a thread of its own (nothing when filled): the idle fraction (no
        prompt admitted) and the groups generated."""
        total = self.idle_s + self.busy_s
        out = {}
        if self.thread.ident is not None:
            out = {
                "async/rollout_idle_frac": self.idle_s / total if total else 0.0,
                "async/generated_groups": float(self.groups),
                "async/inflight_groups": float(len(self.generating)),
            }
        self.idle_s = self.busy_s = 0.0
        self.groups = 0
        return out
