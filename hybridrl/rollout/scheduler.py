"""Continuous batching under a token budget, with preemption by recompute.

Every step each running sequence asks for the tokens whose KV is still missing:
one for a decoding sequence, the (rest of the) prompt for a prefilling one, so
prefill and decode share a step and a long prompt is prefilled in chunks.
Decodes are served first (oldest first), then unfinished prefills, then new
sequences are admitted from the waiting queue while the token budget, the
sequence limit and the free blocks allow. When a running sequence needs a block
and none is free, the newest running sequence is preempted: its blocks are
freed and it goes back to the front of the waiting queue with all its tokens,
to be recomputed later (prefix caching often makes that cheap). A finished
sequence leaves at once (:meth:`finish`), so a waiting one takes its place in
the next step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from hybridrl.rollout.block_manager import BlockManager
from hybridrl.rollout.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    # query tokens of each sequence in this step
    num_tokens: list[int] = field(default_factory=list)
    lookahead: int = 0  # extra slots reserved for decoding sequences (speculative tokens)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.num_tokens)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        watermark: float = 0.01,
    ):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.watermark_blocks = int(watermark * block_manager.num_blocks)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def unfinished(self) -> list[Sequence]:
        """Every sequence still waiting or running."""
        return list(self.waiting) + self.running

    # --- one step -----------------------------------------------------------------
    def schedule(self, lookahead: int = 0) -> ScheduledBatch:
        batch = ScheduledBatch(lookahead=lookahead)
        budget = self.max_num_batched_tokens
        preempted = False
        decoding, prefilling = [], []
        for s in self.running:
            (decoding if len(s) - s.num_computed == 1 else prefilling).append(s)
        bs = self.bm.block_size
        for seq in decoding + prefilling:
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:  # preempted by an earlier sequence of this loop
                continue
            q = min(len(seq) - seq.num_computed, budget)
            need = seq.num_computed + q + (lookahead if q == 1 else 0)
            # needs a new block (a decode step usually does not)
            if need > len(seq.block_table) * bs:
                while not self.bm.can_append(seq, need):
                    victim = self.running[-1]
                    self.preempt(victim)
                    preempted = True
                    if victim in batch.seqs:  # scheduled earlier in this loop: take it back out
                        i = batch.seqs.index(victim)
                        budget += batch.num_tokens.pop(i)
                        batch.seqs.pop(i)
                    if victim is seq:
                        break
                if seq.status is not Status.RUNNING:
                    continue
                self.bm.append_slots(seq, need)
            batch.seqs.append(seq)
            batch.num_tokens.append(q)
            budget -= q
        if not preempted:
            self._admit(batch, budget)
        return batch

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if len(self.running) + 1 + seq.num_forks > self.max_num_seqs:
                break
            reserve = seq.num_forks + (self.watermark_blocks if self.running else 0)
            if not self.bm.can_allocate(seq, reserve):
                break
            self.waiting.popleft()
            self.bm.allocate(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            q = min(len(seq) - seq.num_computed, budget)
            batch.seqs.append(seq)
            batch.num_tokens.append(q)
            budget -= q

    # --- state changes ---------------------------------------------------------------
    def preempt(self, seq: Sequence, count: bool = True) -> None:
        """Free ``seq``'s blocks and put it back at the front of the queue (recomputed later).
        ``count``: whether it counts in ``num_preemptions`` (preemption for memory pressure)."""
        self.running.remove(seq)
        self.bm.deallocate(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += int(count)

    def preempt_all(self, count: bool = True) -> None:
        """Preempt every running sequence (``count`` as in :meth:`preempt`: False when the cause is
        not memory pressure, e.g. a weight update or a memory release)."""
        for seq in reversed(list(self.running)):
            self.preempt(seq, count)

    def add_running(self, seq: Sequence) -> None:
        """Insert a forked child (already holding blocks) into the running set."""
        seq.status = Status.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence, status: Status) -> None:
        """Remove a sequence (running or waiting) for good and free its blocks."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        self.bm.deallocate(seq)
        seq.status = status

    def finish_many(self, seqs: list[Sequence], statuses: list[Status]) -> None:
        """Batch version of :meth:`finish` for running sequences (one pass over ``running``)."""
        if not seqs:
            return
        gone = {s.seq_id for s in seqs}
        self.running = [s for s in self.running if s.seq_id not in gone]
        for seq, status in zip(seqs, statuses):
            self.bm.deallocate(seq)
            seq.status = status
