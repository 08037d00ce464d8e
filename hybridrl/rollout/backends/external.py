"""What the adapters to external inference engines (``vllm``, ``sglang``) share.

An adapter imports its package only when it is constructed, so importing
hybridrl never imports vLLM or SGLang; a missing package raises an
``ImportError`` that says what to install and which backends work here.

The engines load a checkpoint *directory*, not our in-memory model: the
adapter uses the ``engine_model_path`` option when it is set, else it saves the
model and tokenizer it is given (``save_pretrained``) to a temporary
directory that lives as long as the adapter.

Their options (``rollout.backend_options``) are :class:`ExternalOptions` (vllm adds the KV cache
size it takes on a CPU): the engine's checkpoint, its share of GPU memory, tensor parallelism,
prefix caching and extra engine arguments.

Weight sync: ``update_weights`` passes the stream through ``merge_adapters``
(LoRA), groups it into buckets of about ``bucket_bytes`` and hands each bucket
to the engine in one call, then resets the engine's prefix cache once and sets
the version. The in-memory model is kept as a host mirror of the live weights
(updated on every sync): the LoRA merge reads its base copies from it, because
the engines do not expose their weights by transformers name.

Generation is one blocking engine call per ``generate``: every token of a call
carries the version the engine had when the call began; ``pause`` takes
effect between calls (a paused adapter refuses ``generate``), ``abort`` drops
prompts that have not been submitted yet (they come back as ``aborted``
samples). Streaming is the interface's default (one ``generate`` per ``step``). Updating weights
while ``generate`` runs in another thread is not supported.
"""

from __future__ import annotations

import importlib
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from hybridrl.config import RolloutConfig
from hybridrl.parallel.buckets import bucketed
from hybridrl.protocol import Sample
from hybridrl.registry import option
from hybridrl.rollout.backends import usable_backends
from hybridrl.rollout.base import RolloutEngine, SamplingParams
from hybridrl.rollout.sequence import request_seed

# engine finish reason -> Sample.status (None: the engine gave none: the request did not finish)
STATUS = {"stop": "finished", "length": "truncated", "abort": "aborted", None: "aborted"}

# (token ids, behaviour log-probs, finish reason) of one sample
Output = tuple[list[int], list[float], "str | None"]


def import_engine(package: str, install: str):
    """``import package``, or an ImportError naming what to install and the backends usable without
    it."""
    try:
        return importlib.import_module(package)
    except ImportError as e:
        raise ImportError(
            f"rollout.backend={package!r} needs the {package!r} package, which cannot be "
            f"imported here ({e}). Install it with `{install}`, or choose a backend usable here: "
            f"{', '.join(usable_backends())}"
        ) from e


@dataclass
class ExternalOptions:
    """The options of an external engine (``rollout.backend_options`` with ``rollout.backend``
    vllm or sglang)."""

    engine_model_path: str | None = option(
        None,
        "checkpoint directory the engine loads (null: the in-memory model and tokenizer are saved "
        "to a temporary directory)",
    )
    gpu_memory_utilization: float = option(
        0.5,
        "share of GPU memory the engine takes for weights and KV cache (sglang: "
        "mem_fraction_static)",
        gt=0,
        le=1,
    )
    tensor_parallel_size: int = option(1, "GPUs the engine shards the model over", ge=1)
    enable_prefix_caching: bool = option(True, "share KV blocks of identical prompt prefixes")
    engine_kwargs: dict = option(
        {},
        "extra keyword arguments passed as they are to vllm.LLM / sglang.Engine (e.g. {dtype: "
        "bfloat16})",
    )


class ExternalRollout(RolloutEngine):
    """Base of the vllm / sglang adapters. Subclasses set ``package``/``install`` and implement
    ``_start``, ``_generate``, ``_load_bucket``, ``_reset_prefix_cache``, ``release_memory``,
    ``wake_up``."""

    package = ""  # the third-party module the adapter drives
    extra = ""  # the hybridrl extra that installs it: pip install 'hybridrl[extra]'
    install = ""  # how to get it
    bucket_bytes = 256 << 20  # weight-sync bucket size handed to the engine per call
    options = ExternalOptions

    def __init__(self, model, tokenizer, cfg: RolloutConfig | None = None):
        super().__init__()
        self.engine_options = self.read_options(cfg or RolloutConfig())
        self.lib = import_engine(self.package, self.install)
        self.model = model  # host mirror of the live weights (LoRA base copies); None: no LoRA sync
        self.tokenizer = tokenizer
        self._params = dict(model.named_parameters()) if model is not None else {}
        self.dtype = (
            str(next(model.parameters()).dtype).removeprefix("torch.")
            if model is not None
            else "auto"
        )
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._engine_lock = threading.Lock()  # one call into the engine at a time
        self.model_path = self.engine_options.engine_model_path or self._save(model, tokenizer)
        self._tokens, self._seconds, self._sync_seconds = 0, 0.0, 0.0
        self.engine = self._start(self.model_path)

    def _save(self, model, tokenizer) -> str:
        if model is None:
            raise ValueError(
                f"{self.package}: no model to save; "
                "set rollout.backend_options.engine_model_path to a checkpoint directory"
            )
        self._tmp = tempfile.TemporaryDirectory(prefix=f"hybridrl-{self.package}-")
        model.save_pretrained(self._tmp.name)
        if tokenizer is not None:
            tokenizer.save_pretrained(self._tmp.name)
        return self._tmp.name

    # --- to implement -----------------------------------------------------------------------------
    def _start(self, path: str):
        raise NotImplementedError

    def _generate(
        self, prompts: list[Sample], seeds: list[int | None], params: SamplingParams
    ) -> list[list[Output]]:
        """``params.n`` outputs per prompt in prompt order (``seeds``: per-prompt request seeds)."""
        raise NotImplementedError

    def _load_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        raise NotImplementedError

    def _begin_load(self) -> None:  # noqa: B027 (optional)
        """Before a sync's first bucket (an engine that loads a sync as one session)."""

    def _end_load(self) -> None:  # noqa: B027 (optional)
        """After a sync's last bucket, also after a sync that failed half-way."""

    def _reset_prefix_cache(self) -> None:
        raise NotImplementedError

    # --- generation -------------------------------------------------------------------------------
    def generate(self, prompts: list[Sample], params: SamplingParams) -> list[Sample]:
        if self.paused:
            raise RuntimeError("generate() called on a paused engine; call resume() first")
        self.check_servable()
        if params.return_raw_log_probs:
            raise NotImplementedError(
                f"{self.package} backend: return_raw_log_probs is not supported "
                "(use rollout.backend=native)"
            )
        live = [(i, p) for i, p in enumerate(prompts) if p.uid not in self._aborted]
        seeds = [None if params.seed is None else request_seed(params.seed, p.uid) for _, p in live]
        with self._engine_lock:
            version, t0 = self.version, time.perf_counter()
            outputs = self._generate([p for _, p in live], seeds, params) if live else []
            self._seconds += time.perf_counter() - t0
        by_index = {i: outs for (i, _), outs in zip(live, outputs)}
        samples = []
        for i, p in enumerate(prompts):
            for ids, logps, reason in by_index.get(i, [([], [], "abort")] * max(1, params.n)):
                if len(ids) != len(logps):
                    raise RuntimeError(
                        f"{self.package} returned {len(logps)} log-probs for {len(ids)} tokens "
                        f"(prompt {p.uid!r})"
                    )
                samples.append(
                    p.with_response(
                        ids,
                        [float(x) for x in logps],
                        [version] * len(ids),
                        STATUS.get(reason, "truncated"),
                    )
                )
                self._tokens += len(ids)
        return samples

    # --- weights ----------------------------------------------------------------------------------
    def _weight_tensors(self) -> dict[str, torch.Tensor]:
        if self.model is None:
            raise NotImplementedError(
                f"{self.package} backend: LoRA sync needs the in-memory model as a mirror"
            )
        return self._params

    @torch.no_grad()
    def _mirror(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Copy each tensor into the host mirror before the next is read (merge_adapters reads the
        mirror once the stream is exhausted, so every full weight must be in it by then)."""
        for name, t in named_tensors:
            if self.model is not None:
                if name in self._params:
                    self._params[name].copy_(t)
                elif not (
                    name == "lm_head.weight"
                    and getattr(self.model.config, "tie_word_embeddings", False)
                ):
                    raise KeyError(f"update_weights: the rollout model has no parameter {name!r}")
            yield name, t

    def _load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> int:
        with self._engine_lock:
            t0, count = time.perf_counter(), 0
            self._begin_load()
            try:
                for bucket in bucketed(self._mirror(named_tensors), self.bucket_bytes):
                    self._load_bucket(bucket)
                    count += len(bucket)
            finally:
                self._end_load()
                # KV computed under the old weights must not be served (also after a sync that
                # failed half-way)
                self._reset_prefix_cache()
        self._sync_seconds += time.perf_counter() - t0
        return count

    # --- statistics -------------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        out = {
            "engine/tokens_per_s": self._tokens / self._seconds if self._seconds else 0.0,
            "engine/weight_sync_s": self._sync_seconds,
        }
        self._tokens, self._seconds, self._sync_seconds = 0, 0.0, 0.0
        return out

    def close(self) -> None:
        """Shut the engine down and remove the temporary checkpoint."""
        self.engine = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
