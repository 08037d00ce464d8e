"""Paged KV-cache bookkeeping: fixed-size blocks, reference counts, prefix caching.

Pure Python (no tensors): the model runner owns the KV pool, this class only
decides which block holds which tokens.

Prefix caching: a *full* block whose KV has been written is registered under a
chained digest ``blake2b(digest of the previous block + its token ids as
bytes)``, so one digest names the whole prefix up to the block's end. The
digest is cryptographic (256 bits) because a lookup can only compare the
block's own tokens: a collision of the chain (the same digest for two prefixes
that differ in an earlier block) would serve another prefix's KV, and an
unkeyed 64-bit hash such as Python's tuple hash makes such collisions
constructible. Serving wrong KV thus needs a blake2b collision. A block whose
reference count drops to zero goes to the back of the free list but keeps its
hash: it can be revived by a later hit until it is handed out again (LRU
eviction from the front). A block is registered only after its KV is written
(:meth:`register_computed`), so a hit never reads KV that is still pending.
Any weight change calls :meth:`invalidate`: all hashes are dropped, and
sequences whose KV was computed under older weights stop registering blocks.

Speculative decoding keeps a second KV pool (the draft model's) in the same
blocks. The draft skips steps where speculation does not pay, so a block whose
target KV is cached may hold no draft KV: each block records whether its draft
KV is written too (``draft``), and a prefix hit counts as draft-computed only
up to the first block without it; the draft prefills the rest itself.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from hybridrl.rollout.sequence import Sequence

# the parent digest of a sequence's first block, and the digest of an unregistered block
NO_HASH = b""


def block_hash(prev_hash: bytes, tokens: list[int]) -> bytes:
    """Digest of a block given its parent's digest: names the whole prefix up to the block's end."""
    h = hashlib.blake2b(prev_hash, digest_size=32)
    h.update(array("q", tokens).tobytes())
    return h.digest()


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "draft")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = NO_HASH
        self.token_ids: tuple[int, ...] = ()
        self.draft = False  # the draft model's KV of this (registered) block is written too


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need at least one block of at least one token (got {num_blocks} x {block_size})"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # LRU order
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.epoch = 0

    # --- state ----------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    # --- allocation -------------------------------------------------------------
    def _take_free(self) -> int:
        bid, _ = self.free.popitem(last=False)
        block = self.blocks[bid]
        if block.hash != NO_HASH:  # evict: its KV is about to be overwritten
            if self.hash_to_block.get(block.hash) == bid:
                del self.hash_to_block[block.hash]
            block.hash, block.token_ids = NO_HASH, ()
        block.draft = False
        block.ref_count = 1
        return bid

    def _ref(self, bid: int) -> None:
        block = self.blocks[bid]
        if block.ref_count == 0:
            del self.free[bid]
        block.ref_count += 1

    def match_prefix(self, seq: Sequence) -> tuple[list[int], bytes]:
        """Cached leading blocks of ``seq`` (at least its last token stays uncached) and the last
        digest."""
        hits: list[int] = []
        h = NO_HASH
        if not self.enable_prefix_caching:
            return hits, h
        bs = self.block_size
        for i in range((len(seq) - 1) // bs):  # full blocks that end before the last token
            tokens = seq.token_ids[i * bs : (i + 1) * bs]
            h = block_hash(h, tokens)
            bid = self.hash_to_block.get(h)
            if bid is None or self.blocks[bid].token_ids != tuple(tokens):
                break
            hits.append(bid)
        return hits, (self.blocks[hits[-1]].hash if hits else NO_HASH)

    def num_new_blocks(self, seq: Sequence) -> int:
        """Free blocks that allocating ``seq`` would consume."""
        hits, _ = self.match_prefix(seq)
        revived = sum(1 for bid in hits if self.blocks[bid].ref_count == 0)
        return self.blocks_for(len(seq)) - len(hits) + revived

    def can_allocate(self, seq: Sequence, reserve: int = 0) -> bool:
        return self.num_new_blocks(seq) + reserve <= self.num_free

    def allocate(self, seq: Sequence) -> None:
        """Give a waiting sequence blocks for all its tokens, reusing cached prefix blocks."""
        assert not seq.block_table, f"{seq} already holds blocks"
        hits, h = self.match_prefix(seq)
        if self.num_new_blocks(seq) > self.num_free:
            raise RuntimeError("allocate() without enough free blocks; call can_allocate() first")
        for bid in hits:
            self._ref(bid)
        seq.block_table = hits + [
            self._take_free() for _ in range(self.blocks_for(len(seq)) - len(hits))
        ]
        seq.num_computed = len(hits) * self.block_size
        draft = next((i for i, bid in enumerate(hits) if not self.blocks[bid].draft), len(hits))
        # the draft prefills the hits it has no KV for
        seq.num_draft_computed = draft * self.block_size
        seq.num_hashed_blocks = len(hits)
        seq.num_draft_blocks = draft
        seq.last_hash = h
        seq.hash_epoch = self.epoch

    def deallocate(self, seq: Sequence) -> None:
        for bid in reversed(seq.block_table):  # tail first, so prefix blocks stay cached longest
            block = self.blocks[bid]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[bid] = None
        seq.block_table = []
        seq.num_computed = 0
        seq.num_draft_computed = 0
        seq.num_hashed_blocks = 0
        seq.num_draft_blocks = 0
        seq.last_hash = NO_HASH

    def can_append(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether ``seq`` can grow to hold ``num_tokens`` tokens in total."""
        return self.blocks_for(num_tokens) - len(seq.block_table) <= self.num_free

    def append_slots(self, seq: Sequence, num_tokens: int) -> None:
        need = self.blocks_for(num_tokens) - len(seq.block_table)
        if need > self.num_free:
            raise RuntimeError("append_slots() without enough free blocks; call can_append() first")
        for _ in range(need):
            seq.block_table.append(self._take_free())

    def fork(self, parent: Sequence, child: Sequence) -> list[tuple[int, int]]:
        """Share the parent's computed full blocks with ``child``; copy its partial block.

        Returns the ``(src, dst)`` block copies the KV pool must perform. Needs one
        free block when the computed tokens end inside a block.
        """
        bs = self.block_size
        full, rest = divmod(parent.num_computed, bs)
        table = parent.block_table[:full]
        for bid in table:
            self._ref(bid)
        copies = []
        if rest:
            dst = self._take_free()
            copies.append((parent.block_table[full], dst))
            table = table + [dst]
        child.block_table = table
        return copies

    # --- prefix cache -----------------------------------------------------------
    def register_computed(self, seq: Sequence) -> None:
        """Register the full blocks of ``seq`` whose KV has now been written, and mark those whose
        draft KV is written too (``seq.num_draft_computed``; without a draft model it never passes
        the prefix hits)."""
        if not self.enable_prefix_caching or seq.hash_epoch != self.epoch:
            return
        bs = self.block_size
        done = min(seq.num_computed, len(seq)) // bs
        for i in range(seq.num_hashed_blocks, done):
            bid = seq.block_table[i]
            block = self.blocks[bid]
            tokens = seq.token_ids[i * bs : (i + 1) * bs]
            h = block_hash(seq.last_hash, tokens)
            if block.hash == NO_HASH:
                block.hash, block.token_ids = h, tuple(tokens)
                self.hash_to_block.setdefault(h, bid)
            seq.last_hash = h
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, done)
        drafted = min(seq.num_draft_computed // bs, seq.num_hashed_blocks)
        for i in range(seq.num_draft_blocks, drafted):
            self.blocks[seq.block_table[i]].draft = True
        seq.num_draft_blocks = max(seq.num_draft_blocks, drafted)

    def invalidate(self) -> None:
        """Forget every cached prefix (the weights changed)."""
        for block in self.blocks:
            block.hash, block.token_ids, block.draft = NO_HASH, (), False
        self.hash_to_block.clear()
        self.epoch += 1

    def reset(self) -> None:
        """Drop every allocation (the KV pool was released); sequences must be re-allocated."""
        epoch = self.epoch
        self.__init__(self.num_blocks, self.block_size, self.enable_prefix_caching)
        self.epoch = epoch + 1
