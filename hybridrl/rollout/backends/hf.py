"""The ``hf`` rollout backend: transformers ``generate`` behind the rollout interface.

Simple and always available; the behaviour log-probs are read from the
processed scores (after temperature / top-k / top-p), i.e. the distribution
each token was actually sampled from. Generation is batch-synchronous, so
``pause`` only takes effect between ``generate`` calls.
"""
from __future__ import annotations

import time
from typing import Iterable

import torch

from hybridrl.config import RolloutConfig
from hybridrl.protocol import Sample, pad_2d
from hybridrl.rollout.base import ROLLOUT_BACKENDS, GenerationRequest, RolloutEngine, SamplingParams


@ROLLOUT_BACKENDS.register("hf")
class HFRollout(RolloutEngine):
    def __init__(self, model, tokenizer, cfg: RolloutConfig | None = None):
        super().__init__()
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_batch_size = (cfg or RolloutConfig()).max_batch_size
        self._tokens = 0
        self._seconds = 0.0

    @torch.no_grad()
    def _load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        params = dict(self.model.named_parameters())
        count = 0
        for name, tensor in named_tensors:
            if name not in params:
                if name == "lm_head.weight" and self.model.config.tie_word_embeddings:
                    continue  # tied to the embedding, already loaded
                raise KeyError(f"update_weights: the rollout model has no parameter {name!r}")
            params[name].copy_(tensor)
            count += 1
        return count

    def generate(self, requests: list[GenerationRequest], params: SamplingParams) -> list[Sample]:
        if self.paused:
            raise RuntimeError("generate() called on a paused engine; call resume() first")
        live = [r for r in requests if r.request_id not in self._aborted]
        out: list[Sample] = [self._aborted_sample(r) for r in requests if r.request_id in self._aborted for _ in range(params.n)]
        per_call = max(1, self.max_batch_size // params.n)
        for start in range(0, len(live), per_call):
            out.extend(self._generate_chunk(live[start : start + per_call], params, start))
        return out

    def _generate_chunk(self, reqs: list[GenerationRequest], params: SamplingParams, offset: int) -> list[Sample]:
        t0 = time.perf_counter()
        tok = self.tokenizer
        ids = pad_2d([r.prompt_ids for r in reqs], tok.pad_token_id, torch.long, left=True)
        attn = pad_2d([[1] * len(r.prompt_ids) for r in reqs], 0, torch.long, left=True)
        with torch.random.fork_rng(devices=[]):  # a seeded call leaves the caller's RNG stream alone
            if params.seed is not None:
                torch.manual_seed(params.seed + offset)
            res = self._hf_generate(ids, attn, params)
        return self._to_samples(reqs, ids.shape[1], res, params, t0)

    def _hf_generate(self, ids: torch.Tensor, attn: torch.Tensor, params: SamplingParams):
        tok = self.tokenizer
        gen_kwargs = dict(do_sample=not params.greedy, num_return_sequences=params.n)
        if not params.greedy:
            gen_kwargs.update(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)  # top_k=0: off
        return self.model.generate(
            input_ids=ids, attention_mask=attn, max_new_tokens=params.max_new_tokens, eos_token_id=self._eos(params),
            pad_token_id=tok.pad_token_id, output_scores=True, return_dict_in_generate=True, **gen_kwargs,
        )

    def _eos(self, params: SamplingParams) -> list[int]:
        return [self.tokenizer.eos_token_id, *params.stop_token_ids]

    def _to_samples(self, reqs: list[GenerationRequest], prompt_width: int, res, params: SamplingParams, t0: float) -> list[Sample]:
        eos = self._eos(params)
        responses = res.sequences[:, prompt_width:]
        scores = torch.stack(res.scores, 1).float()  # (B*n, R, V) processed logits
        logps = torch.log_softmax(scores, -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
        samples = []
        for row in range(responses.shape[0]):
            req = reqs[row // params.n]
            resp = responses[row].tolist()
            end = next((i + 1 for i, t in enumerate(resp) if t in eos), None)
            status = "finished" if end is not None else "truncated"
            end = end or len(resp)
            samples.append(Sample(
                prompt_ids=list(req.prompt_ids), response_ids=resp[:end], log_probs=logps[row, :end].tolist(),
                versions=[self.version] * end, status=status, uid=req.uid, task_id=req.task_id, extra=dict(req.extra),
            ))
            self._tokens += end
        self._seconds += time.perf_counter() - t0
        return samples

    def _aborted_sample(self, r: GenerationRequest) -> Sample:
        return Sample(list(r.prompt_ids), [], [], [], status="aborted", uid=r.uid, task_id=r.task_id, extra=dict(r.extra))

    def stats(self) -> dict[str, float]:
        tps = self._tokens / self._seconds if self._seconds else 0.0
        self._tokens, self._seconds = 0, 0.0
        return {"engine/tokens_per_s": tps}
