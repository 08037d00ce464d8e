"""Continuous generation on a rollout rank for asynchronous training (``trainer.mode: async``).

A :class:`RolloutStream` thread keeps the engine busy: whenever fewer than ``max_groups`` prompts
are generating it asks the trajectory buffer for more (the buffer applies the staleness rule,
``rollout/buffer.py``), runs engine steps, and as soon as all ``G`` samples of a prompt are done it
scores them and puts the group (its samples, with the prompt's stream ``index`` and ``admitted``
version in their metadata) into the buffer: the data goes rollout -> buffer, not through the
driver. Weight updates arrive on another thread between engine steps (``update_weights`` takes the
engine lock); the engine then drops its stale KV and continues every in-flight sequence, and each
token keeps the version that produced it. The admitted prompts' samples come from a
:class:`~hybridrl.data.prefetch.PromptPrefetcher`: the ``prefetch`` prompts after the last one
admitted are prepared on a background thread (default ``max_groups``; 0: off). Given the run's
config, the stream applies the group hooks of ``group_hooks.py`` as the synchronous step does: each
prompt's greedy baseline request is queued beside its samples (ReMax), and a group whose rewards
are all equal is dropped while dynamic sampling has credit (DAPO; the buffer forgets its prompt).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace

from hybridrl.data.prefetch import PromptPrefetcher
from hybridrl.protocol import Sample
from hybridrl.rollout import SamplingParams
from hybridrl.rollout.base import InFlight
from hybridrl.rollout.group_hooks import (
    GREEDY_SUFFIX,
    DynamicSampling,
    greedy_request,
    needs_greedy_baseline,
    set_baselines,
)
from hybridrl.rollout.sequence import derive_seed

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
    ):
        self.backend, self.buffer, self.task, self.tokenizer = backend, buffer, task, tokenizer
        # the group hooks (group_hooks.py): a greedy baseline request beside each prompt's samples,
        # and dynamic sampling
        self.cfg = cfg
        self.greedy = cfg is not None and needs_greedy_baseline(cfg)
        self.filter = (
            DynamicSampling(cfg) if cfg is not None and cfg.algorithm.filter_groups else None
        )
        self.scorer, self.params, self.seed, self.max_groups = scorer, params, seed, max_groups
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
        step that hangs), so that the run's shutdown goes on instead of waiting forever."""
        self.stopping.set()
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
            self.flight.add([prompt], replace(self.params, seed=derive_seed(self.seed, index)))
            self.generating[prompt.uid] = {}
            if self.greedy:
                greedy = greedy_request(prompt)
                self.flight.add([greedy], replace(self.params, n=1, temperature=0.0))

    def _deliver(self, finished: list[tuple[Sample, list[Sample]]]) -> None:
        """Each prompt whose requests are all done, scored, through the group hooks, into the
        buffer."""
        for request, samples in finished:
            uid = request.uid.removesuffix(GREEDY_SUFFIX)
            done = self.generating[uid]
            done[request.uid] = samples
            if len(done) < (2 if self.greedy else 1):
                continue
            del self.generating[uid]
            group = self.scorer(done[uid])
            if self.greedy:
                set_baselines(group, self.scorer(done[uid + GREEDY_SUFFIX]), self.cfg)
            if self.filter is not None and not self.filter.keep(group):
                self.buffer.discard(group[0].metadata["index"])
            else:
                self.buffer.put(group)
                self.groups += 1

    def _run(self) -> None:
        try:
            while not self.stopping.is_set():
                t0 = time.perf_counter()
                self._admit()
                if not self.flight:  # the staleness bound holds us back: wait for the learner
                    time.sleep(IDLE_SLEEP_S)
                    self.idle_s += time.perf_counter() - t0
                    continue
                self._deliver(self.flight.step())
                self.busy_s += time.perf_counter() - t0
        except BaseException as e:  # noqa: BLE001 -- reported to the driver through check()/stats()
            log.exception("rollout stream failed")
            self.error = e
            # the learner stops waiting for data
            self.buffer.close(f"the rollout stream failed: {e!r}")
        finally:
            self.prompts.close()

    def stats(self) -> dict[str, float]:
        """Since the last call: the idle fraction (no prompt admitted) and the groups generated."""
        total = self.idle_s + self.busy_s
        out = {
            "async/rollout_idle_frac": self.idle_s / total if total else 0.0,
            "async/generated_groups": float(self.groups),
            "async/inflight_groups": float(len(self.generating)),
        }
        if self.filter is not None:
            out |= self.filter.stats()
        self.idle_s = self.busy_s = 0.0
        self.groups = 0
        return out
