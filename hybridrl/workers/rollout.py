"""The rollout role: a rollout engine (``rollout.backend``) behind the worker interface."""

from __future__ import annotations

from hybridrl.config import Config
from hybridrl.controller import Dispatch, Worker, WorkerContext, register
from hybridrl.protocol import Batch, Sample
from hybridrl.rollout import ROLLOUT_BACKENDS, GenerationRequest, SamplingParams
from hybridrl.workers.common import load_model, make_task
from hybridrl.workers.reward import Scorer
from hybridrl.workers.rollout_stream import RolloutStream


class RolloutWorker(Worker):
    def __init__(self, ctx: WorkerContext, cfg: Config, model_path: str | None):
        super().__init__(ctx)
        self.cfg = cfg
        model, self.tokenizer = load_model(cfg, model_path)
        self.engine = ROLLOUT_BACKENDS.get(cfg.rollout.backend)(model, self.tokenizer, cfg.rollout)
        self.stream: RolloutStream | None = None

    @register(Dispatch.DP_COMPUTE)
    def generate(self, prompts: Batch, params: SamplingParams) -> list[Sample]:
        """``prompts`` holds meta ``prompt`` (Prompt) and ``prompt_ids``; returns ``params.n`` samples per prompt."""
        requests = [
            GenerationRequest(
                request_id=p.uid, prompt_ids=ids, uid=p.uid, task_id=p.task_id, extra={"prompt": p}
            )
            for p, ids in zip(prompts["prompt"], prompts["prompt_ids"])
        ]
        return self.engine.generate(requests, params)

    @register(Dispatch.ONE_TO_ALL)
    def update_weights(self, buckets: list[list], version: int) -> int:
        return self.engine.update_weights((item for bucket in buckets for item in bucket), version)

    @register(Dispatch.ONE_TO_ALL)
    def pause(self) -> None:
        self.engine.pause()

    @register(Dispatch.ONE_TO_ALL)
    def resume(self) -> None:
        self.engine.resume()

    @register(Dispatch.ONE_TO_ALL)
    def start_stream(self, buffer, params: SamplingParams, seed: int) -> None:
        """Asynchronous training: generate continuously, taking prompts from and putting scored groups
        into ``buffer`` (a :class:`~hybridrl.trainers.buffer.BufferHandle`) until :meth:`stop_stream`. Every rank
        gets the same ``seed``: a prompt's samples are seeded from it, the prompt's index and its uid, so they
        do not depend on which rank admitted the prompt."""
        if self.stream is not None:
            raise RuntimeError("the rollout stream is already running")
        self.stream = RolloutStream(
            self.engine,
            buffer,
            make_task(self.cfg),
            self.tokenizer,
            Scorer(self.cfg, self.tokenizer),
            params,
            seed,
            self.cfg.asynchronous.max_concurrent_prompts,
        )
        self.stream.start()

    @register(Dispatch.ONE_TO_ALL)
    def stop_stream(self) -> None:
        stream, self.stream = self.stream, None
        if stream is not None:
            stream.stop()

    @register(Dispatch.RANK_ZERO)
    def stats(self) -> dict:
        if self.stream is None:
            return self.engine.stats()
        self.stream.check()
        return self.engine.stats() | self.stream.stats()
