"""The ``hf`` rollout backend: transformers ``generate`` behind the rollout interface.

Simple and always available. Sampled tokens: the native sampler's own filters (temperature, top-k,
top-p, min-p: ``sampling.py``, the code the trainer also recomputes log-probs with) shape
each row's distribution, then the row's token is drawn from it with the native engine's
counter-based randomness (a hash of the sample's seed and the token's position) instead of the
batch's shared RNG stream, so a sample's tokens do not depend on the other prompts of the call.
Seeds follow the native engine: sample ``j`` of a prompt uses
``derive_seed(request_seed(params.seed, prompt.uid), j)``. The behaviour log-prob of each token is
taken under the distribution it was drawn from. Stop strings end a sample at the token that
completes one (``rollout/stop.py``). Generation is batch-synchronous, so ``pause`` only takes effect
between ``generate`` calls; streaming is the interface's default (one ``generate`` per ``step``).

``device``: where the model generates (None: where it is). On CUDA the model is cast to the
``dtype`` option (``auto``: bf16 where the GPU has it natively, ``rollout/engine_dtype.py``); on
a CPU it keeps its own dtype. Weights synced later are cast on load (``copy_``).

Mixture-of-experts models: each sample's routing (the experts every MoE layer chose for each of its
prompt and response tokens, ``hybridrl/moe/routing.py``) is recorded during ``generate`` and lands
in ``Sample.routing``, a (prompt + response tokens, layers, k) int16 tensor; the response's last
token was never fed to the model and holds -1 (not routed). The learner replays it under
``moe.routing_replay=r3``. An expert bias sent by weight sync (``moe.bias_update_rate``) is attached
to the routers on first receipt and steers their selection here as in the trainer.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Literal

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)

from hybridrl.config import RolloutConfig
from hybridrl.moe.balance import BIAS_NAME, attach_bias
from hybridrl.moe.routing import NOT_ROUTED, is_moe, moe_gates, record
from hybridrl.protocol import Sample, pad_2d
from hybridrl.registry import option
from hybridrl.rollout.base import ROLLOUT_BACKENDS, RolloutEngine, SamplingParams
from hybridrl.rollout.engine_dtype import resolve_engine_dtype
from hybridrl.rollout.sequence import derive_seed, request_seed
from hybridrl.rollout.stop import as_tuple, eos_token_ids, stop_hit
from hybridrl.sampling import STREAM_SAMPLE, draw, filtered_log_softmax, uniform


class _SeededDraw(LogitsProcessor):
    """The only processor: filters the raw scores as the native sampler does, draws each row's token
    with the row's own random stream, records its log-prob, and leaves only that token for greedy
    decoding to take."""

    def __init__(
        self,
        params: SamplingParams,
        seeds: list[int],
        prompt_lens: list[int],
        width: int,
        device: torch.device,
    ):
        self.params = params
        self.seeds = torch.tensor(seeds, dtype=torch.long, device=device)
        # + width of input_ids
        self.positions = torch.tensor(prompt_lens, dtype=torch.long, device=device) - width
        self.log_probs: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        logp = filtered_log_softmax(scores, self.params)
        tokens = draw(
            logp.exp(), uniform(self.seeds, self.positions + input_ids.shape[1], STREAM_SAMPLE)
        )
        self.log_probs.append(logp.gather(1, tokens[:, None]).squeeze(1))
        return torch.full_like(scores, float("-inf")).scatter_(1, tokens[:, None], 0.0)


class _StopStrings(StoppingCriteria):
    """Ends a row at the token that completes a stop string and records its response length."""

    def __init__(self, tokenizer, stops: tuple[str, ...], width: int):
        self.tokenizer, self.stops, self.width = tokenizer, stops, width
        self.ends: dict[int, int] = {}

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for row in range(input_ids.shape[0]):
            if row not in self.ends and stop_hit(
                self.tokenizer, input_ids[row].tolist(), self.width, self.stops
            ):
                self.ends[row] = input_ids.shape[1] - self.width
            done[row] = row in self.ends
        return done


def sample_routing(forwards: list[torch.Tensor], rows: list[Sample], width: int):
    """Each row's routing (prompt + generated tokens, layers, k) from the recorded forwards of one
    ``generate``: the prefill of the (B, width) left-padded prompts, then one forward per step, of
    one token per row (the token generated the step before). The last generated token is never fed:
    its routing is :data:`NOT_ROUTED`."""
    n_rows = len(rows)
    if not forwards or forwards[0].shape[0] != n_rows * width:
        raise RuntimeError(
            "routing: the first forward of generate is not the prefill of the whole prompt batch "
            f"({forwards[0].shape[0] if forwards else 0} tokens for {n_rows} x {width})"
        )
    prefill = forwards[0].view(n_rows, width, *forwards[0].shape[1:])
    steps = [f.view(n_rows, 1, *f.shape[1:]) for f in forwards[1:]]
    last = torch.full((n_rows, 1, *prefill.shape[2:]), NOT_ROUTED, dtype=prefill.dtype)
    generated = torch.cat([*steps, last], 1)
    return [
        torch.cat([prefill[i, width - len(r.prompt_ids) :], generated[i]], 0)
        for i, r in enumerate(rows)
    ]


@dataclass
class HfOptions:
    """The hf backend's options (``rollout.backend_options`` with ``rollout.backend=hf``)."""

    max_batch_size: int = option(512, "sequences per generate call", ge=1)
    dtype: Literal["auto", "fp32", "bf16"] = option(
        "auto",
        "on CUDA, dtype of the weights generate runs with (log-probs stay fp32); auto: bf16 where "
        "the GPU has native bf16 (compute capability >= 8.0), else fp32; on a CPU the model's own",
    )


@ROLLOUT_BACKENDS.register("hf")
class HFRollout(RolloutEngine):
    takes_device = True  # the worker passes its device (rollout/backends/__init__.py)
    records_routing = True  # MoE models: Sample.routing, for moe.routing_replay=r3
    options = HfOptions

    def __init__(
        self,
        model,
        tokenizer,
        cfg: RolloutConfig | None = None,
        *,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        options = self.read_options(cfg or RolloutConfig())
        if device is not None and torch.device(device).type == "cuda":
            model = model.to(device, resolve_engine_dtype(options.dtype, model, device))
        elif device is not None:
            model = model.to(device)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids(model, tokenizer)  # the tokenizer's and the model's
        self.max_batch_size = options.max_batch_size
        self.records_routing = is_moe(model)
        self._tokens = 0
        self._seconds = 0.0

    def _sync_aliases(self) -> set[str]:
        """Also each router's ``expert_bias``: the trainer's balancing state, which this model gets
        on its first sync (``_load_weights``)."""
        names = {n for n, m in self.model.named_modules() if m in set(moe_gates(self.model))}
        return super()._sync_aliases() | {f"{n}.{BIAS_NAME}" for n in names}

    @torch.no_grad()
    def _load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> int:
        params = dict(self.model.named_parameters())
        count = 0
        for name, tensor in named_tensors:
            if name not in params and name.endswith("." + BIAS_NAME):
                # the trainer's expert bias (moe.bias_update_rate): the router gets one to load
                params[name] = attach_bias(self.model.get_submodule(name.rsplit(".", 1)[0]))
            if name not in params:
                if name == "lm_head.weight" and self.model.config.tie_word_embeddings:
                    continue  # tied to the embedding, already loaded
                raise KeyError(f"update_weights: the rollout model has no parameter {name!r}")
            params[name].copy_(tensor)
            count += 1
        return count

    def generate(self, prompts: list[Sample], params: SamplingParams) -> list[Sample]:
        if self.paused:
            raise RuntimeError("generate() called on a paused engine; call resume() first")
        self.check_servable()
        n = max(1, params.n)
        out = [[p.aborted() for _ in range(n)] for p in prompts]  # per prompt; aborted unless run
        live = [i for i, p in enumerate(prompts) if p.uid not in self._aborted]
        per_call = max(1, self.max_batch_size // n)
        for start in range(0, len(live), per_call):
            chunk = live[start : start + per_call]
            samples = self._generate_chunk([prompts[i] for i in chunk], params)
            for j, i in enumerate(chunk):
                out[i] = samples[j * n : (j + 1) * n]
        return [s for group in out for s in group]

    def _generate_chunk(self, reqs: list[Sample], params: SamplingParams) -> list[Sample]:
        t0 = time.perf_counter()
        tok, n = self.tokenizer, max(1, params.n)
        rows = [r for r in reqs for _ in range(n)]  # sample j of request i is row i * n + j
        ids = pad_2d([r.prompt_ids for r in rows], tok.pad_token_id, torch.long, left=True).to(
            self.model.device
        )
        attn = pad_2d([[1] * len(r.prompt_ids) for r in rows], 0, torch.long, left=True).to(
            self.model.device
        )
        width = ids.shape[1]
        processors = LogitsProcessorList()
        sampler = None
        if not params.greedy:
            seeds = []
            for r in reqs:
                base = (
                    int(torch.randint(0, 2**62, (1,)).item())
                    if params.seed is None
                    else request_seed(params.seed, r.uid)
                )
                seeds += [derive_seed(base, j) for j in range(n)]
            sampler = _SeededDraw(
                params, seeds, [len(r.prompt_ids) for r in rows], width, ids.device
            )
            processors.append(sampler)
        stops = as_tuple(params.stop)
        criteria = StoppingCriteriaList([_StopStrings(tok, stops, width)] if stops else [])
        gen = GenerationConfig(
            max_new_tokens=params.max_new_tokens,
            eos_token_id=self._eos(params) or None,
            pad_token_id=tok.pad_token_id,
            do_sample=False,
            output_scores=sampler is None,
            return_dict_in_generate=True,
        )
        # the checkpoint's own generation defaults (repetition_penalty, suppress_tokens,
        # min_new_tokens, ...) would reshape the distribution before our draw, and the behaviour
        # log-probs would no longer be the ones the trainer recomputes; generate() fills unset
        # fields of a passed config from the model's, so swap it out
        own, self.model.generation_config = self.model.generation_config, gen
        recording = record(self.model) if self.records_routing else nullcontext()
        try:
            with recording as recorder:
                res = self.model.generate(
                    input_ids=ids,
                    attention_mask=attn,
                    generation_config=gen,
                    logits_processor=processors,
                    stopping_criteria=criteria,
                )
        finally:
            self.model.generation_config = own
        responses = res.sequences[:, width:]
        if sampler is None:  # greedy: the raw log-prob of the argmax
            scores = torch.stack(res.scores, 1).float()
            logps = torch.log_softmax(scores, -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
        else:
            logps = torch.stack(sampler.log_probs, 1)
        stop_ends = criteria[0].ends if stops else {}
        samples = self._to_samples(rows, responses, logps, stop_ends, params, t0)
        if recorder is not None:
            for sample, routing in zip(samples, sample_routing(recorder.forwards(), rows, width)):
                sample.routing = routing[: len(sample.prompt_ids) + len(sample.response_ids)]
        return samples

    def _eos(self, params: SamplingParams) -> list[int]:
        return [*self.eos_token_ids, *params.stop_token_ids]

    def _to_samples(
        self,
        rows: list[Sample],
        responses: torch.Tensor,
        logps: torch.Tensor,
        stop_ends: dict[int, int],
        params: SamplingParams,
        t0: float,
    ) -> list[Sample]:
        eos = self._eos(params)
        samples = []
        for row, req in enumerate(rows):
            resp = responses[row].tolist()
            ends = [
                e
                for e in (
                    next((i + 1 for i, t in enumerate(resp) if t in eos), None),
                    stop_ends.get(row),
                )
                if e
            ]
            end = min(ends) if ends else len(resp)
            samples.append(
                req.with_response(
                    resp[:end],
                    logps[row, :end].tolist(),
                    [self.version] * end,
                    "finished" if ends else "truncated",
                )
            )
            self._tokens += end
        self._seconds += time.perf_counter() - t0
        return samples

    def stats(self) -> dict[str, float]:
        tps = self._tokens / self._seconds if self._seconds else 0.0
        self._tokens, self._seconds = 0, 0.0
        return {"engine/tokens_per_s": tps}
