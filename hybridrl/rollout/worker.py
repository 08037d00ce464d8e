"""The rollout role: a rollout backend (``rollout.backend``) behind the worker interface. It
generates and scores: every sample leaves a rollout rank with its reward (``rollout/scoring.py``),
in both training modes. A backend with a continuous batch of its own has each group scored as soon
as it finishes, while the others still generate (``rollout/worker_scoring.py``)."""

from __future__ import annotations

import copy

from hybridrl.config import Config
from hybridrl.controller import Dispatch, Worker, WorkerContext, register
from hybridrl.controller.health import Progress
from hybridrl.models.loading import load_model, make_task
from hybridrl.parallel import weight_sync
from hybridrl.parallel.distributed import compute_device
from hybridrl.protocol import Sample
from hybridrl.rollout import SamplingParams
from hybridrl.rollout.backends import make_backend
from hybridrl.rollout.env_rewards import env_rewards
from hybridrl.rollout.episode import with_episode
from hybridrl.rollout.scoring import Scorer
from hybridrl.rollout.stop import eos_token_ids
from hybridrl.rollout.stream import RolloutStream
from hybridrl.rollout.worker_scoring import generate_scored, steps_itself
from hybridrl.telemetry.flops import rollout_perf
from hybridrl.telemetry.samples import RecentSamples
from hybridrl.telemetry.timeline import SpanLog, SpannedEngine


class RolloutWorker(Worker):
    def __init__(self, ctx: WorkerContext, cfg: Config, model_path: str | None):
        super().__init__(ctx)
        self.cfg = cfg
        model, self.tokenizer = load_model(cfg, model_path)
        # cross-policy sampling: a frozen copy of the starting weights (taken before any backend
        # owns them), never synced
        start = copy.deepcopy(model) if cfg.env.cross_policy_frac > 0 else None
        # native / hf run on this process's GPU when it has one (the learner's rule); with an
        # episode (rollout.episode, or env.name's environment rollout) it makes each group
        device = compute_device()
        backend = make_backend(cfg.rollout, model, self.tokenizer, device)
        frozen = None if start is None else make_backend(cfg.rollout, start, self.tokenizer, device)
        self.backend = with_episode(cfg, backend, self.tokenizer, frozen)
        # engine steps for the heartbeat (controller/health.py): generate and the stream step here
        self.progress = Progress()
        self.backend.step = self.progress.counting(self.backend.step)
        scorer = Scorer(cfg, self.tokenizer, eos_token_ids(model, self.tokenizer))
        # with an environment, its reward (rollout/env_rewards.py)
        self.scorer = env_rewards(cfg, scorer)
        self.stream: RolloutStream | None = None
        # the latest scored groups of the stream, for the sample tables (telemetry/samples.py)
        self.recent = RecentSamples(cfg.trainer.log_samples)
        # weight sync, by name, built on first use
        self.transports: dict[str, weight_sync.WeightTransport] = {}
        self.spans = SpanLog(ctx.role)  # the timeline's spans (telemetry/timeline.py)

    @register(Dispatch.DP_COMPUTE)
    def generate(self, prompts: list[Sample], params: SamplingParams) -> list[Sample]:
        """``params.n`` scored samples per prompt sample
        (:func:`~hybridrl.protocol.prompt_sample`)."""
        if steps_itself(self.backend):  # each group scored once done, while the rest generate
            score = self.spans.wrap("rollout/score", self.scorer)
            with self.spans.span("rollout/generate"), self.progress.busy():
                return generate_scored(self.backend, score, prompts, params)
        with self.spans.span("rollout/generate"), self.progress.busy():
            out = self.backend.generate(prompts, params)
        with self.spans.span("rollout/score"):
            return self.scorer(out)

    @register(Dispatch.ONE_TO_ALL)
    def load_weights(self, transport: str, handle, version: int) -> int:
        """Load weights ``version`` from ``handle`` (what the learner's ``publish_weights``
        returned) through this worker's ``transport``; the number of tensors loaded."""
        if transport not in self.transports:
            self.transports[transport] = weight_sync.make_transport(transport)
        with self.spans.span("weight_sync/load"):
            return self.transports[transport].load(self.backend, handle, version)

    @register(Dispatch.ONE_TO_ALL)
    def close(self) -> None:
        """Release the weight-sync transports (mapped staging files) and shut the backend down (an
        external engine's processes)."""
        for transport in self.transports.values():
            transport.close()
        self.backend.close()

    @register(Dispatch.ONE_TO_ALL)
    def start_stream(self, buffer, params: SamplingParams, seed: int, threaded=True) -> None:
        """Generate into ``buffer`` (a :class:`~hybridrl.rollout.buffer.BufferHandle`), taking its
        prompts from it: continuously on a thread of its own until :meth:`stop_stream`
        (asynchronous training), or, ``threaded=False``, each time :meth:`fill_stream` is called
        (synchronous training; then at most this rank's share of a step's prompts generate at
        once, so every rank gets some). Every rank gets the same ``seed``: a prompt's samples are
        seeded from it and the prompt's uid, so they do not depend on which rank admitted it."""
        if self.stream is not None:
            raise RuntimeError("the rollout stream is already running")
        t = self.cfg.trainer
        self.stream = RolloutStream(
            SpannedEngine(self.backend, self.spans),  # engine steps as rollout/generate spans
            buffer,
            make_task(self.cfg),
            self.tokenizer,
            self.spans.wrap("rollout/score", self.scorer),
            params,
            seed,
            self.cfg.asynchronous.max_concurrent_prompts
            if threaded
            else -(-t.prompts_per_step // self.world_size),
            prefetch=t.prefetch_steps * t.prompts_per_step,
            cfg=self.cfg,
            on_group=self.recent.keep,
        )
        if threaded:
            self.stream.start()

    @register(Dispatch.ONE_TO_ALL)
    def fill_stream(self) -> None:
        """Synchronous training: the batch of the weights just loaded, generated and scored into
        the buffer (:meth:`RolloutStream.fill`)."""
        with self.progress.busy():
            self.stream.fill()

    @register(Dispatch.ONE_TO_ALL)
    def stop_stream(self) -> None:
        stream, self.stream = self.stream, None
        if stream is not None:
            stream.stop()

    @register(Dispatch.RANK_ZERO)
    def recent_samples(self) -> list[Sample]:
        """Asynchronous training: the samples of this rank's latest ``trainer.log_samples``
        scored groups (a sample table's rows are chosen from them)."""
        return self.recent.take()

    @register(Dispatch.RANK_ZERO)
    def stats(self) -> dict:
        """The backend's statistics since the last call (with the stream's, when streaming), and
        ``perf/mfu_rollout`` where the backend reports token counts (``telemetry/flops.py``)."""
        if self.stream is not None:
            self.stream.check()
        out = self.backend.stats()
        out |= rollout_perf(out, self.backend)
        out["engine/heartbeat_age_s"] = self.progress.beat()["step_age_s"]
        return out if self.stream is None else out | self.stream.stats()

    def heartbeat(self) -> dict:
        """Engine steps taken, seconds since the last one, seconds in the current ``generate``
        (read from another thread while a call runs; the ``hf`` backend takes no engine steps
        inside ``generate``)."""
        return self.progress.beat()

    def sleep(self) -> None:
        """Colocation: free the KV cache while the learner has the device."""
        self.backend.release_memory()

    def wake(self) -> None:
        self.backend.wake_up()
