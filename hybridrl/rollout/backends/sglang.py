"""The ``sglang`` rollout backend: SGLang's offline ``sglang.Engine`` behind the rollout interface.

Needs the ``sglang`` package (CUDA); it is imported when the backend is
constructed, never when hybridrl is imported. The engine loads
the ``engine_model_path`` option, or the in-memory model and tokenizer saved to a
temporary directory (see ``external.py``). Engine arguments, from its options
(``rollout.backend_options``, ``ExternalOptions``): ``model_path``, ``dtype`` (the in-memory
model's), ``mem_fraction_static`` (= ``gpu_memory_utilization``), ``tp_size``,
``disable_radix_cache`` (= not ``enable_prefix_caching``), ``enable_memory_saver=True`` (for
``release_memory``); ``engine_kwargs`` overrides any of them.

Mapping: each request is sent ``params.n`` times with its own sampling dict
(``max_new_tokens, temperature, top_p, top_k (0 -> -1), min_p, stop,
stop_token_ids, ignore_eos`` and ``sampling_seed`` when seeded; SGLang honours
the seed only in its deterministic-inference mode) through
``Engine.generate(input_ids=..., sampling_params=[...], return_logprob=True)``;
``meta_info["output_token_logprobs"]`` (``(logprob, token_id, text)`` tuples)
and ``meta_info["finish_reason"]["type"]`` ("stop", "length", "abort") ->
``Sample``. SGLang's log-probs are taken after temperature but before top-k /
top-p renormalisation (raw with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``): they
equal ours when top_p = 1 and top_k = 0. Weight sync:
``Engine.update_weights_from_tensor(bucket, flush_cache=False)`` per bucket,
then ``Engine.flush_cache()``. ``release_memory`` / ``wake_up`` are
``release_memory_occupation()`` / ``resume_memory_occupation()``.
"""

from __future__ import annotations

import torch

from hybridrl.protocol import Sample
from hybridrl.rollout.backends.external import ExternalRollout, Output
from hybridrl.rollout.base import ROLLOUT_BACKENDS, SamplingParams
from hybridrl.rollout.sequence import derive_seed


@ROLLOUT_BACKENDS.register("sglang")
class SGLangRollout(ExternalRollout):
    package = "sglang"
    extra = "sglang"
    install = "pip install 'hybridrl[sglang]'  (after torch; needs a CUDA GPU)"

    def _start(self, path: str):
        opts = self.engine_options
        kwargs = dict(
            model_path=path,
            dtype=self.dtype,
            mem_fraction_static=opts.gpu_memory_utilization,
            tp_size=opts.tensor_parallel_size,
            disable_radix_cache=not opts.enable_prefix_caching,
            enable_memory_saver=True,
            skip_tokenizer_init=self.tokenizer is None
            and not opts.engine_model_path,  # no tokenizer was saved
        )
        kwargs.update(opts.engine_kwargs)
        return self.lib.Engine(**kwargs)

    @staticmethod
    def sampling_params(params: SamplingParams, seed: int | None) -> dict:
        """Our SamplingParams as SGLang's sampling dict for one sample."""
        out = dict(
            max_new_tokens=params.max_new_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k or -1,
            min_p=params.min_p,
            ignore_eos=params.ignore_eos,
            stop=list(params.stop) or None,
            stop_token_ids=list(params.stop_token_ids) or None,
        )
        if seed is not None:
            out["sampling_seed"] = seed
        return out

    def _generate(
        self, prompts: list[Sample], seeds: list[int | None], params: SamplingParams
    ) -> list[list[Output]]:
        n = max(1, params.n)
        input_ids, sampling = [], []
        for r, seed in zip(prompts, seeds):
            for j in range(n):  # one engine request per sample: order and seeds stay ours
                input_ids.append(list(r.prompt_ids))
                sampling.append(
                    self.sampling_params(params, None if seed is None else derive_seed(seed, j))
                )
        outs = self.engine.generate(
            input_ids=input_ids, sampling_params=sampling, return_logprob=True
        )
        if isinstance(outs, dict):
            outs = [outs]
        parsed = [_output(o) for o in outs]
        return [parsed[k * n : (k + 1) * n] for k in range(len(prompts))]

    def _load_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        self.engine.update_weights_from_tensor(bucket, flush_cache=False)

    def _reset_prefix_cache(self) -> None:
        self.engine.flush_cache()

    def release_memory(self) -> None:
        with self._engine_lock:
            self.engine.release_memory_occupation()

    def wake_up(self) -> None:
        with self._engine_lock:
            self.engine.resume_memory_occupation()

    def close(self) -> None:
        if self.engine is not None:
            with self._engine_lock:
                self.engine.shutdown()
        super().close()


def _output(o: dict) -> Output:
    """(token ids, log-probs, finish reason) of an SGLang generate result (return_logprob=True)."""
    meta = o["meta_info"]
    rows = meta.get("output_token_logprobs")
    if rows is None:
        raise RuntimeError("sglang returned no output_token_logprobs (return_logprob must be True)")
    reason = meta.get("finish_reason")
    reason = reason.get("type") if isinstance(reason, dict) else reason
    return [int(row[1]) for row in rows], [float(row[0]) for row in rows], reason
