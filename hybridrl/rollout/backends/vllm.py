"""The ``vllm`` rollout backend: vLLM's offline ``LLM`` behind the rollout interface.

Needs the ``vllm`` package (CUDA); it is imported when the backend is
constructed, never when hybridrl is imported. The engine loads
``rollout.engine_model_path``, or the in-memory model and tokenizer saved to a
temporary directory (see ``external.py``). Engine arguments: ``dtype`` (the
in-memory model's, e.g. float32), ``gpu_memory_utilization``,
``tensor_parallel_size``, ``enable_prefix_caching``, ``enable_sleep_mode=True``
and ``logprobs_mode="processed_logprobs"`` (vLLM >= 0.10.2: the log-prob of
each token under the distribution it was sampled from, after temperature and
top-k / top-p); ``rollout.engine_kwargs`` overrides any of them.

Mapping: our ``SamplingParams`` -> ``vllm.SamplingParams(n, temperature,
top_p, top_k (0 -> -1), min_p, max_tokens, seed, stop, stop_token_ids,
ignore_eos, logprobs=0)``, one per request (its seed derived from
``params.seed`` and the prompt's uid, vLLM seeds sample i with seed + i);
``RequestOutput.outputs[i]``
``token_ids`` / ``logprobs[t][token].logprob`` / ``finish_reason`` ("stop",
"length", "abort") -> ``Sample``. Weight sync: each bucket goes to every
worker's ``model.load_weights`` through ``LLM.apply_model`` (older vLLM
without it: the in-process driver worker's model), then
``LLM.reset_prefix_cache()``. ``release_memory`` / ``wake_up`` are
``LLM.sleep(level=1)`` (weights to host memory, KV cache dropped) /
``LLM.wake_up()``.
"""

from __future__ import annotations

import functools
import os

import torch

from hybridrl.protocol import Sample
from hybridrl.rollout.backends.external import ExternalRollout, Output
from hybridrl.rollout.base import ROLLOUT_BACKENDS, SamplingParams


def _load_into(bucket: list[tuple[str, torch.Tensor]], model) -> None:
    """Runs inside each vLLM worker (shipped by ``LLM.apply_model``): vLLM's loader maps
    transformers names onto its fused and sharded parameters."""
    model.load_weights(iter(bucket))


@ROLLOUT_BACKENDS.register("vllm")
class VLLMRollout(ExternalRollout):
    package = "vllm"
    extra = "vllm"
    install = "pip install 'hybridrl[vllm]'  (after torch; needs a CUDA GPU)"

    def _start(self, path: str):
        cfg = self.cfg
        kwargs = dict(
            model=path,
            dtype=self.dtype,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            tensor_parallel_size=cfg.tensor_parallel_size,
            enable_prefix_caching=cfg.enable_prefix_caching,
            enable_sleep_mode=True,
            logprobs_mode="processed_logprobs",
            skip_tokenizer_init=self.tokenizer is None
            and not cfg.engine_model_path,  # no tokenizer was saved
        )
        kwargs.update(cfg.engine_kwargs)
        # apply_model ships a function to the engine's worker processes; vLLM V1 only unpickles
        # callables when this is set. The function (_load_into) comes from this process, not from a
        # client.
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        return self.lib.LLM(**kwargs)

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

    def _load_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        if hasattr(self.engine, "apply_model"):
            self.engine.apply_model(functools.partial(_load_into, bucket))
        else:  # vLLM < 0.8: the model lives in this process
            _load_into(
                bucket, self.engine.llm_engine.model_executor.driver_worker.model_runner.model
            )

    def _reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()

    def release_memory(self) -> None:
        self.engine.sleep(level=1)

    def wake_up(self) -> None:
        self.engine.wake_up()


def _output(c) -> Output:
    """(token ids, log-probs, finish reason) of a vLLM ``CompletionOutput`` asked for logprobs=0."""
    ids = list(c.token_ids)
    if c.logprobs is None:
        raise RuntimeError("vllm returned no log-probs (SamplingParams.logprobs must be 0)")
    return ids, [c.logprobs[t][tok].logprob for t, tok in enumerate(ids)], c.finish_reason
