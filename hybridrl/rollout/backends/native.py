"""The ``native`` rollout backend: our paged-KV engine behind the rollout interface.

``generate`` runs engine steps until every request of the call is done. It
may run in one thread while another calls ``pause`` / ``update_weights`` /
``resume`` / ``abort``: a paused engine stops between steps and keeps its
sequences; after ``resume`` they continue, and each token records the weight
version that produced it. Extra sampling options are read from the params
object when present: ``min_p``, ``stop`` (strings), ``ignore_eos``,
``return_raw_log_probs`` (raw log-probs land in ``Sample.extra["raw_log_probs"]``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

import torch

from hybridrl.config import RolloutConfig
from hybridrl.protocol import Sample
from hybridrl.rollout.base import ROLLOUT_BACKENDS, GenerationRequest, RolloutEngine, SamplingParams
from hybridrl.rollout.engine import LLMEngine
from hybridrl.rollout.sequence import Sequence, request_seed


def _load_draft(path: str, like):
    from transformers import AutoModelForCausalLM

    p = next(like.parameters())
    return (
        AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=p.dtype)
        .to(p.device)
        .eval()
    )


@ROLLOUT_BACKENDS.register("native")
class NativeRollout(RolloutEngine):
    def __init__(
        self, model, tokenizer, cfg: RolloutConfig | None = None, *, draft_model=None, **engine_kw
    ):
        super().__init__()
        cfg = cfg or RolloutConfig()
        if draft_model is None and cfg.draft_model_path:
            draft_model = _load_draft(cfg.draft_model_path, model)
        eos = (
            [] if tokenizer is None or tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
        )
        self.engine = LLMEngine(
            model, cfg, eos_token_ids=eos, tokenizer=tokenizer, draft_model=draft_model, **engine_kw
        )
        self.tokenizer = tokenizer
        self._unpaused = threading.Event()
        self._unpaused.set()

    # --- generation ---------------------------------------------------------------------
    def generate(self, requests: list[GenerationRequest], params: SamplingParams) -> list[Sample]:
        n = max(1, params.n)
        pending = self.add(requests, params)
        while pending:
            self.step()
            pending = [r for r in pending if not self.done(r, n)]
        return [s for r in requests for s in self.take(r, n)]

    # the same, one piece at a time (asynchronous training streams requests through these)
    def add(
        self, requests: list[GenerationRequest], params: SamplingParams
    ) -> list[GenerationRequest]:
        """Queue the requests (not those aborted already); each is seeded from ``params.seed`` and its request id
        (:func:`request_seed`), so its tokens do not depend on the other requests of the call."""
        self.check_servable()
        added = []
        for r in requests:
            if r.request_id in self._aborted:
                continue
            seed = None if params.seed is None else request_seed(params.seed, r.request_id)
            self.engine.add_request(r.request_id, r.prompt_ids, params, seed=seed, tag=r)
            added.append(r)
        return added

    def step(self) -> int:
        """One engine step (waits while paused); returns the number of tokens generated."""
        self._unpaused.wait()
        t0 = time.perf_counter()
        tokens = self.engine.step()
        self.engine.stats_acc["seconds"] += time.perf_counter() - t0
        return tokens

    def done(self, r: GenerationRequest, n: int) -> bool:
        return len(self.engine.finished.get(r.request_id, ())) >= n or self._gone(r.request_id)

    def take(self, r: GenerationRequest, n: int) -> list[Sample]:
        """The ``n`` samples of a request that is :meth:`done` (aborted ones padded as empty ``aborted`` samples)."""
        seqs = sorted(self.engine.finished.pop(r.request_id, []), key=lambda s: s.sample_index)
        return [self._to_sample(r, s) for s in seqs] + [
            self._aborted_sample(r) for _ in range(n - len(seqs))
        ]

    def _gone(self, rid: str) -> bool:
        """All sequences of an aborted request have left the engine."""
        if rid not in self._aborted:
            return False
        sch = self.engine.scheduler
        return not any(s.request_id == rid for s in list(sch.waiting) + sch.running)

    def _to_sample(self, r: GenerationRequest, s: Sequence) -> Sample:
        extra = dict(r.extra)
        if s.raw_log_probs:
            extra["raw_log_probs"] = list(s.raw_log_probs)
        return Sample(
            prompt_ids=list(r.prompt_ids),
            response_ids=s.completion_ids,
            log_probs=list(s.log_probs),
            versions=list(s.versions),
            status=s.status.value,
            uid=r.uid,
            task_id=r.task_id,
            extra=extra,
        )

    @staticmethod
    def _aborted_sample(r: GenerationRequest) -> Sample:
        return Sample(
            list(r.prompt_ids),
            [],
            [],
            [],
            status="aborted",
            uid=r.uid,
            task_id=r.task_id,
            extra=dict(r.extra),
        )

    # --- RL controls --------------------------------------------------------------------------
    def _load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        raise NotImplementedError  # update_weights is overridden (it needs the version under the engine lock)

    def _weight_tensors(self) -> dict[str, torch.Tensor]:
        return dict(
            self.engine.runner._targets
        )  # live views by transformers name (LoRA merge reads them)

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> int:
        count = self.checked_sync(
            named_tensors, lambda stream: self.engine.update_weights(stream, version)
        )
        self.version = version
        return count

    def pause(self) -> None:
        self.paused = True
        self._unpaused.clear()
        with self.engine.lock:  # returns once the step in flight (if any) has finished
            pass

    def resume(self) -> None:
        self.paused = False
        self._unpaused.set()

    def abort(self, request_ids: Iterable[str]) -> None:
        ids = list(request_ids)
        super().abort(ids)
        self.engine.abort(ids)

    def release_memory(self) -> None:
        self.engine.release_memory()

    def wake_up(self) -> None:
        self.engine.wake_up()

    def stats(self) -> dict[str, float]:
        return self.engine.stats()
