"""The ``native`` rollout backend: our paged-KV engine behind the rollout interface.

``generate`` runs engine steps until every request of the call is done. It
may run in one thread while another calls ``pause`` / ``update_weights`` /
``resume`` / ``abort``: a paused engine stops between steps and keeps its
sequences; after ``resume`` they continue, and each token records the weight
version that produced it. Extra sampling options are read from the params
object when present: ``min_p``, ``stop`` (strings), ``ignore_eos``,
``return_raw_log_probs`` (raw log-probs land in ``Sample.metadata["raw_log_probs"]``).
Streaming (``add`` / ``step`` / ``done`` / ``take``) drives the engine's continuous batch directly.

``device``: where the engine's weights, KV pool and sampling live (None: the model's device). The
rollout worker passes its GPU (``parallel.distributed.compute_device``) with a model loaded on the
CPU: the engine copies the weights onto the GPU (cast to the ``dtype`` option) and keeps no
reference to the model, so no fp32 copy of it occupies device memory.

Its options (``rollout.backend_options``: the KV pool, batching, speculative decoding, dtype) are
:class:`~hybridrl.rollout.engine.NativeOptions`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from hybridrl.config import RolloutConfig
from hybridrl.protocol import Sample
from hybridrl.rollout.base import ROLLOUT_BACKENDS, RolloutEngine, SamplingParams
from hybridrl.rollout.engine import LLMEngine, NativeOptions
from hybridrl.rollout.sequence import Sequence, request_seed
from hybridrl.rollout.stop import eos_token_ids


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
    takes_device = True  # the worker passes its device (rollout/backends/__init__.py)
    records_routing = True  # MoE models: Sample.routing, for moe.routing_replay=r3
    options = NativeOptions

    def __init__(
        self,
        model,
        tokenizer,
        cfg: RolloutConfig | None = None,
        *,
        draft_model=None,
        device: torch.device | str | None = None,
        **engine_kw,
    ):
        super().__init__()
        options = self.read_options(cfg or RolloutConfig())
        if draft_model is None and options.draft_model_path:
            draft_model = _load_draft(options.draft_model_path, model)
        self.engine = LLMEngine(
            model,
            options,
            eos_token_ids=eos_token_ids(model, tokenizer),  # the tokenizer's and the model's
            tokenizer=tokenizer,
            draft_model=draft_model,
            device=device,
            **engine_kw,
        )
        self.tokenizer = tokenizer

    # --- generation ---------------------------------------------------------------------
    def generate(self, prompts: list[Sample], params: SamplingParams) -> list[Sample]:
        return self.generate_streamed(prompts, params)

    # streaming: the engine's continuous batch (prompts finish and enter between steps)
    def add(self, prompts: list[Sample], params: SamplingParams) -> list[Sample]:
        """Queue the prompts (not those aborted already); each is seeded from ``params.seed`` and
        its uid (:func:`request_seed`), so its tokens do not depend on the other prompts of the
        call."""
        self.check_servable()
        prompts = [p for p in prompts if p.uid not in self._aborted]
        for p in prompts:  # one that can never fit fails the call before any prompt is queued
            self.engine.check_fits(p.uid, p.prompt_ids, params)
        for p in prompts:
            seed = None if params.seed is None else request_seed(params.seed, p.uid)
            self.engine.add_request(p.uid, p.prompt_ids, params, seed=seed, tag=p)
        return prompts

    def step(self) -> int:
        """One engine step (waits while paused); returns the number of tokens generated."""
        self._unpaused.wait()
        return self.engine.step()

    def done(self, prompt: Sample, n: int) -> bool:
        uid = prompt.uid
        return self.engine.num_finished(uid) >= n or (
            uid in self._aborted and not self.engine.has_request(uid)
        )

    def take(self, prompt: Sample, n: int) -> list[Sample]:
        """The ``n`` samples of a prompt that is :meth:`done` (aborted ones padded as empty
        ``aborted`` samples)."""
        seqs = self.engine.pop_finished(prompt.uid)
        return [self._to_sample(prompt, s) for s in seqs] + [
            prompt.aborted() for _ in range(n - len(seqs))
        ]

    @staticmethod
    def _to_sample(prompt: Sample, s: Sequence) -> Sample:
        extra = {"raw_log_probs": list(s.raw_log_probs)} if s.raw_log_probs else {}
        out = prompt.with_response(
            s.completion_ids, s.log_probs, s.versions, s.status.value, **extra
        )
        out.routing = s.routing  # MoE models: (prompt + response tokens, MoE layers, k)
        return out

    # --- RL controls --------------------------------------------------------------------------
    def _load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> int:
        # between steps, under the engine lock: in-flight sequences continue under the new version
        return self.engine.update_weights(named_tensors, version)

    def _sync_aliases(self) -> set[str]:
        # the routers' balancing bias (moe.bias_update_rate): accepted, not required
        return super()._sync_aliases() | self.engine.runner.optional_weight_names()

    def _weight_tensors(self) -> dict[str, torch.Tensor]:
        # live views by transformers name (LoRA merge reads them)
        return self.engine.named_weights()

    def pause(self) -> None:
        super().pause()
        self.engine.wait_for_step()  # returns once the step in flight (if any) has finished

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
