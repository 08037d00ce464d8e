"""The native engine's core loop: schedule, run the model, sample, update sequences.

One :meth:`LLMEngine.step` schedules a batch (continuous batching, see
``scheduler.py``), runs one forward pass over it (``model_runner.py``),
samples the sequences whose KV is now complete (``sampler.py``), forks the
``n`` samples of a freshly prefilled prompt, and retires finished sequences at
once. With a draft model, decode-only steps at small batch run speculatively
(``spec_decode.py``). Every step holds ``lock``, so weight updates, aborts and
memory release from other threads land between steps. How many KV blocks the pool gets, and
whether a request can ever fit it, is ``kv_capacity.py``.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from hybridrl.config.sections.common import _check_checkpoint_dir
from hybridrl.moe.routing import NOT_ROUTED
from hybridrl.registry import option
from hybridrl.rollout.block_manager import BlockManager
from hybridrl.rollout.engine_dtype import resolve_engine_dtype
from hybridrl.rollout.kv_capacity import check_fits, pool_blocks
from hybridrl.rollout.model_runner import ModelRunner
from hybridrl.rollout.scheduler import Scheduler
from hybridrl.rollout.sequence import Sequence, Status, derive_seed
from hybridrl.rollout.stop import as_tuple, stop_hit
from hybridrl.sampling import SamplingParams, SamplingTensors, sample


@dataclass
class NativeOptions:
    """The native engine's options (``rollout.backend_options`` with ``rollout.backend=native``)."""

    max_batch_size: int = option(512, "most sequences decoding at once", ge=1)
    kv_cache_bytes: int = option(256 << 20, "bytes of the paged KV-cache pool", ge=1)
    block_size: int = option(
        16,
        "tokens per KV-cache block (at most 1024: a block is the unit of sharing and of "
        "allocation, and the pool holds at least two)",
        ge=1,
        le=1024,
    )
    max_num_batched_tokens: int = option(
        4096, "token budget of one engine step (prefill + decode)", ge=1
    )
    enable_prefix_caching: bool = option(True, "share KV blocks of identical prompt prefixes")
    draft_model_path: str | None = option(
        None, "draft model checkpoint for speculative decoding (null: off)"
    )
    num_speculative_tokens: int = option(4, "tokens the draft proposes per step", ge=1)
    spec_max_batch: int = option(
        32, "speculate only while at most this many sequences decode", ge=1
    )
    dtype: Literal["auto", "fp32", "bf16"] = option(
        "auto",
        "dtype of the engine's weights and KV cache (log-probs stay fp32); auto: on CUDA bf16 "
        "where the GPU has native bf16 (compute capability >= 8.0), else fp32; on a CPU bf16 when "
        "it has native bf16 matmuls and a measurement on the model says they pay, else fp32",
    )
    kv_cache_memory_fraction: float | None = option(
        None,
        "on CUDA: KV pool = this share of free device memory (overrides kv_cache_bytes)",
        gt=0,
        le=1,
    )

    def __post_init__(self) -> None:
        if self.draft_model_path:
            _check_checkpoint_dir("draft_model_path", self.draft_model_path)


class LLMEngine:
    def __init__(
        self,
        model,
        options: NativeOptions,
        *,
        eos_token_ids: Iterable[int] = (),
        tokenizer=None,
        draft_model=None,
        num_blocks: int | None = None,
        spec_max_batch: int | None = None,
        device: torch.device | str | None = None,
    ):
        # the engine's weights, KV pool and sampling live on `device` (None: the model's device),
        # copied from the model wherever it is; the dtype option: they may be bf16 while the model
        # it copies is fp32 (rollout/engine_dtype.py)
        self.device = (
            torch.device(device) if device is not None else next(model.parameters()).device
        )
        self.dtype = resolve_engine_dtype(options.dtype, model, self.device)
        self.options = options
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.runner = ModelRunner(
            model.config,
            device=self.device,
            dtype=self.dtype,
            block_size=options.block_size,
            hf_model=model,
        )
        self.speculative = None
        per_block = self.runner.bytes_per_block()
        if draft_model is not None:
            from hybridrl.rollout.spec_decode import SpecDecoder

            draft_runner = ModelRunner(
                draft_model.config,
                device=self.device,
                dtype=self.dtype,
                block_size=options.block_size,
                hf_model=draft_model,
            )
            if spec_max_batch is None:
                spec_max_batch = options.spec_max_batch
            self.speculative = SpecDecoder(
                self, draft_runner, options.num_speculative_tokens, spec_max_batch
            )
            per_block += draft_runner.bytes_per_block()
        self.num_blocks = pool_blocks(options, self.device, per_block, num_blocks)
        self.bm = BlockManager(self.num_blocks, options.block_size, options.enable_prefix_caching)
        self.scheduler = Scheduler(self.bm, options.max_batch_size, options.max_num_batched_tokens)
        self._allocate()
        self.version = 0
        self.lock = threading.RLock()
        self.finished: dict[str, list[Sequence]] = defaultdict(list)
        self.aborted: set[str] = set()
        self.stats_acc: dict[str, float] = defaultdict(float)
        self.released = False

    # --- memory -----------------------------------------------------------------------
    def _allocate(self) -> None:
        self.runner.allocate_kv(self.num_blocks)
        if self.speculative is not None:
            self.speculative.draft.allocate_kv(self.num_blocks)

    def release_memory(self) -> None:
        """Free the KV pool; running sequences go back to waiting and are recomputed after
        :meth:`wake_up`."""
        with self.lock:
            self.scheduler.preempt_all(count=False)  # not memory pressure: do not count
            self.bm.reset()
            self.runner.free_kv()
            if self.speculative is not None:
                self.speculative.draft.free_kv()
            self.released = True

    def wake_up(self) -> None:
        with self.lock:
            if self.released:
                self._allocate()
                self.released = False

    # --- requests ---------------------------------------------------------------------
    def check_fits(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> int:
        """Raise ``ValueError`` if the request can never run in this engine's KV pool
        (``rollout/kv_capacity.py``); returns its token limit."""
        return check_fits(
            request_id,
            prompt_ids,
            params,
            bm=self.bm,
            max_positions=self.runner.spec.max_positions,
            max_seqs=self.scheduler.max_num_seqs,
            # a speculative step reserves k more slots for each decoding sequence
            lookahead=self.speculative.max_k if self.speculative is not None else 0,
        )

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        seed: int | None = None,
        tag: Any = None,
    ) -> None:
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        n = max(1, params.n)
        stops = (frozenset() if params.ignore_eos else self.eos_token_ids) | frozenset(
            params.stop_token_ids
        )
        max_tokens = self.check_fits(request_id, prompt_ids, params)
        # a group enters as one sequence that forks its samples after the prompt; a group larger
        # than the seats (the max_batch_size option) enters in parts of at most that many samples,
        # each part forking its own (the later parts find the prompt's full blocks in the prefix
        # cache), so sample i's seed stays derive_seed(seed, i)
        cap = self.scheduler.max_num_seqs
        parts = [
            Sequence(
                request_id,
                prompt_ids,
                params,
                derive_seed(seed, start),
                sample_index=start,
                num_forks=min(cap, n - start) - 1,
                max_tokens=max_tokens,
                tag=tag,
                base_seed=seed,
                stop_ids=stops,
            )
            for start in range(0, n, cap)
        ]
        self.stats_acc["prompt_tokens"] += n * len(prompt_ids)
        with self.lock:
            for seq in parts:
                self.scheduler.add(seq)

    def abort(self, request_ids: Iterable[str]) -> None:
        with self.lock:
            self.aborted.update(request_ids)

    def _drop_aborted(self) -> None:
        if not self.aborted:
            return
        sch = self.scheduler
        for seq in [s for s in sch.unfinished() if s.request_id in self.aborted]:
            sch.finish(seq, Status.ABORTED)
            self.finished[seq.request_id].append(seq)
        # handled: a request id aborted before it arrives is the caller's to skip
        self.aborted.clear()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def has_request(self, request_id: str) -> bool:
        """Whether a sequence of the request is still waiting or running."""
        with self.lock:
            return any(s.request_id == request_id for s in self.scheduler.unfinished())

    def num_finished(self, request_id: str) -> int:
        """Sequences of the request that have finished (or were aborted) and not been popped yet."""
        return len(self.finished.get(request_id, ()))

    def pop_finished(self, request_id: str) -> list[Sequence]:
        """The request's finished sequences in sample order, removed from the engine."""
        with self.lock:
            seqs = self.finished.pop(request_id, [])
        return sorted(seqs, key=lambda s: s.sample_index)

    def named_weights(self) -> dict[str, torch.Tensor]:
        """The live weights by transformers name (views into the fused tensors)."""
        return self.runner.named_weights()

    def wait_for_step(self) -> None:
        """Return once the step in flight (if any) has finished."""
        with self.lock:
            pass

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> int:
        """Load new weights in place between steps and invalidate the prefix cache. In-flight
        sequences (interrupted generation, asynchronous training) drop their KV, now stale, and
        continue from their tokens so far: their prompt and the tokens already generated are
        recomputed under the new weights, and each token keeps the version that produced it. If the
        stream raises, the tensors loaded so far stay loaded: the KV is dropped all the same and the
        version is not bumped."""
        with self.lock:
            try:
                count = self.runner.load_weights(named_tensors)
            finally:
                sch = self.scheduler
                self.stats_acc["interrupted"] += len(sch.running)
                sch.preempt_all(count=False)  # a weight change, not memory pressure: do not count
                self.bm.invalidate()
            self.version = version
            return count

    # --- one step ---------------------------------------------------------------------
    def step(self) -> int:
        """Run one engine step; returns the number of tokens it generated."""
        with self.lock:
            t0 = time.perf_counter()
            try:
                return self._step()
            finally:
                self.stats_acc["seconds"] += time.perf_counter() - t0

    def _step(self) -> int:
        """One step; the caller holds ``lock``."""
        if self.released:
            self.wake_up()
        self._drop_aborted()
        if not self.scheduler.has_work():
            return 0
        spec = self.speculative is not None and self.speculative.wants_step(self.scheduler)
        batch = self.scheduler.schedule(lookahead=self.speculative.k if spec else 0)
        if not batch.seqs:
            if self.scheduler.running or not self.scheduler.waiting:
                return 0
            raise RuntimeError(
                f"a sequence of {len(self.scheduler.waiting[0])} tokens does not fit the KV pool "
                f"({self.num_blocks} blocks of {self.bm.block_size}); raise "
                "rollout.backend_options.kv_cache_bytes"
            )
        acc = self.stats_acc
        acc["steps"] += 1
        acc["kv_usage_sum"] += self.bm.usage()
        acc["kv_usage_peak"] = max(acc["kv_usage_peak"], self.bm.usage())
        decode = batch.is_decode_only
        t0 = time.perf_counter()
        n = self.speculative.step(batch) if spec else None
        if n is None:  # no speculation, or nothing in the batch to speculate for
            n = self._plain_step(batch)
        if decode:  # decode speed, apart from prefill: tokens per second of decode-only steps
            dt = time.perf_counter() - t0
            acc["decode_seconds"] += dt
            acc["decode_tokens"] += n
            if self.speculative is not None and not spec:
                self.speculative.note_plain(len(batch.seqs), dt)
        return n

    def _plain_step(self, batch) -> int:
        seqs, qs = batch.seqs, batch.num_tokens
        self.count_prompt_tokens(seqs, qs)
        logits = self.runner.execute(seqs, qs)
        if self.speculative is not None:
            self.speculative.follow(seqs, qs)
        return self.complete(seqs, qs, logits)

    def count_prompt_tokens(self, seqs: list[Sequence], qs: list[int]) -> None:
        self.stats_acc["prompt_tokens_computed"] += sum(
            max(0, min(s.num_computed + q, s.num_prompt_tokens) - s.num_computed)
            for s, q in zip(seqs, qs)
        )

    def complete(self, seqs: list[Sequence], qs: list[int], logits: torch.Tensor) -> int:
        """After a forward over ``qs[i]`` new tokens of each sequence (``logits``: each one's last
        token): advance their KV, sample one token for each whose KV is now complete, fork the
        samples of a fresh prompt."""
        rows, row_seqs = [], []
        for i, (seq, q) in enumerate(zip(seqs, qs)):
            seq.num_computed += q
            self.bm.register_computed(seq)
            if seq.num_computed == len(seq):
                rows.append(i)
                row_seqs.append(seq)
                if seq.num_forks:
                    for j in range(seq.sample_index + 1, seq.sample_index + seq.num_forks + 1):
                        rows.append(i)
                        row_seqs.append(self._fork(seq, j))
                    seq.num_forks = 0
        if not rows:
            return 0
        if len(rows) != logits.shape[0] or rows != list(range(len(rows))):
            logits = logits[torch.tensor(rows, device=logits.device)]
        st = SamplingTensors.build(
            [s.params for s in row_seqs],
            [s.seed for s in row_seqs],
            [len(s) for s in row_seqs],
            self.device,
        )
        tokens, lps, raws = sample(logits, st)
        self.append_tokens(
            row_seqs,
            [[t] for t in tokens.tolist()],
            [[x] for x in lps.tolist()],
            None if raws is None else [[x] for x in raws.tolist()],
        )
        return len(row_seqs)

    def _fork(self, parent: Sequence, index: int) -> Sequence:
        child = parent.fork(index, derive_seed(parent.base_seed, index))
        partial = parent.num_computed % self.bm.block_size != 0
        if self.bm.num_free >= int(partial):
            self.runner.copy_blocks(copies := self.bm.fork(parent, child))
            if self.speculative is not None:
                self.speculative.draft.copy_blocks(copies)
            self.scheduler.add_running(child)
        else:
            # no block for the copy: recompute the prompt later (prefix caching serves its full
            # blocks)
            child.num_computed = child.num_draft_computed = 0
            child.num_cached_prompt_tokens = 0
            self.scheduler.add(child)
            # it may finish before it runs (one new token): keep the prompt's routing meanwhile
            if self.runner.records_routing:
                child.routing = self.runner.read_routing(parent.block_table, parent.num_computed)
        return child

    def _record_routing(self, seq: Sequence) -> None:
        """A finishing sequence's routing (tokens, MoE layers, k), read from its KV slots before
        its blocks are freed; its last token was never fed to the model: not routed."""
        n = len(seq) - 1
        if seq.num_computed >= n and len(seq.block_table) * self.bm.block_size >= n:
            fed = self.runner.read_routing(seq.block_table, n)
        else:  # a fork that finished before running: the prompt's routing from its parent
            fed = seq.routing[:n]
        last = torch.full((1, *fed.shape[1:]), NOT_ROUTED, dtype=fed.dtype)
        seq.routing = torch.cat([fed, last])

    def append_tokens(
        self,
        seqs: list[Sequence],
        tokens: list[list[int]],
        lps: list[list[float]],
        raws: list[list[float]] | None,
    ) -> None:
        """Append each sequence's new tokens, stopping at a stop token/string or the token limit."""
        version = self.version
        done, statuses = [], []
        for i, seq in enumerate(seqs):
            p, stops = seq.params, seq.stop_ids
            status = None
            for j, t in enumerate(tokens[i]):
                seq.append(t, lps[i][j], version, None if raws is None else raws[i][j])
                self.stats_acc["tokens"] += 1
                if t in stops or (p.stop and self._hit_stop_string(seq, p.stop)):
                    status = Status.FINISHED
                elif seq.num_completion_tokens >= seq.max_tokens:
                    status = Status.TRUNCATED
                if status is not None:
                    break
            if status is not None:
                done.append(seq)
                statuses.append(status)
        if done and self.runner.records_routing:
            for s in done:
                self._record_routing(s)
        if done:
            waiting = [s for s, st in zip(done, statuses) if s.status is Status.WAITING]
            for s in waiting:
                self.scheduler.finish(s, statuses[done.index(s)])
            run = [(s, st) for s, st in zip(done, statuses) if s.status is Status.RUNNING]
            self.scheduler.finish_many([s for s, _ in run], [st for _, st in run])
            for s in done:
                self.finished[s.request_id].append(s)

    def _hit_stop_string(self, seq: Sequence, stop) -> bool:
        """A stop string ends inside the newest token (``rollout/stop.py``: that token is kept, the
        response ends)."""
        return stop_hit(self.tokenizer, seq.token_ids, seq.num_prompt_tokens, as_tuple(stop))

    # --- statistics ----------------------------------------------------------------------
    def stats(self, reset: bool = True) -> dict[str, float]:
        a = self.stats_acc
        out = {
            "engine/tokens_per_s": a["tokens"] / a["seconds"] if a["seconds"] else 0.0,
            "engine/generated_tokens": a["tokens"],
            "engine/steps": a["steps"],
            "engine/decode_tokens_per_s": a["decode_tokens"] / a["decode_seconds"]
            if a["decode_seconds"]
            else 0.0,
            "engine/kv_usage_mean": a["kv_usage_sum"] / a["steps"] if a["steps"] else 0.0,
            "engine/kv_usage_peak": a["kv_usage_peak"],
            "engine/prompt_tokens": a["prompt_tokens"],
            "engine/prompt_tokens_computed": a["prompt_tokens_computed"],
            "engine/prefix_hit_rate": 1.0 - a["prompt_tokens_computed"] / a["prompt_tokens"]
            if a["prompt_tokens"]
            else 0.0,
            "engine/preemptions": float(self.scheduler.num_preemptions) - a["preemptions_base"],
            "engine/interrupted": a["interrupted"],
        }
        if self.speculative is not None:
            out["engine/spec_acceptance"] = (
                a["spec_accepted"] / a["spec_proposed"] if a["spec_proposed"] else 0.0
            )
            out["engine/spec_steps"] = a["spec_steps"]
        if reset:
            base = float(self.scheduler.num_preemptions)
            self.stats_acc = defaultdict(float, preemptions_base=base)
        return out
