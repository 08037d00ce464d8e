"""Block manager and prefix hashing: pure Python, no model."""
import pytest

import hybridrl.rollout.block_manager as bmod
from hybridrl.rollout.base import SamplingParams
from hybridrl.rollout.block_manager import BlockManager
from hybridrl.rollout.sequence import Sequence

P = SamplingParams()


def seq(tokens, **kw):
    return Sequence("r", list(tokens), P, 0, **kw)


def computed(bm, s):
    """Pretend the model wrote KV for all of ``s`` but its last token."""
    s.num_computed = len(s) - 1
    bm.register_computed(s)


def test_allocate_and_free_counts():
    bm = BlockManager(8, 4)
    a = seq(range(10))  # 3 blocks
    assert bm.can_allocate(a)
    bm.allocate(a)
    assert len(a.block_table) == 3 and bm.num_free == 5 and a.num_computed == 0
    bm.deallocate(a)
    assert bm.num_free == 8 and a.block_table == []


def test_prefix_hit_shares_blocks_and_ref_counts():
    bm = BlockManager(16, 4)
    a = seq(range(13))  # blocks [0..3] [4..7] [8..11] [12]
    bm.allocate(a)
    computed(bm, a)  # 12 tokens computed -> 3 full blocks registered
    b = seq(list(range(12)) + [99, 98])
    bm.allocate(b)
    assert b.block_table[:3] == a.block_table[:3] and b.block_table[3] != a.block_table[3]
    assert b.num_computed == 12
    assert [bm.blocks[i].ref_count for i in a.block_table[:3]] == [2, 2, 2]
    bm.deallocate(a)
    assert [bm.blocks[i].ref_count for i in b.block_table[:3]] == [1, 1, 1]


def test_last_token_is_never_served_from_cache():
    bm = BlockManager(16, 4)
    a = seq(range(9))
    bm.allocate(a)
    computed(bm, a)  # 8 computed: 2 full blocks
    b = seq(range(8))  # exactly the two cached blocks: the second must be recomputed for the last logits
    bm.allocate(b)
    assert b.num_computed == 4 and b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]


def test_hash_collision_is_caught_by_token_check(monkeypatch):
    monkeypatch.setattr(bmod, "block_hash", lambda prev, tokens: 42)  # every block collides
    bm = BlockManager(16, 4)
    a = seq([1, 2, 3, 4, 5])
    bm.allocate(a)
    computed(bm, a)
    b = seq([9, 9, 9, 9, 5])
    bm.allocate(b)
    assert b.num_computed == 0 and b.block_table[0] != a.block_table[0]
    c = seq([1, 2, 3, 4, 7])
    bm.allocate(c)
    assert c.num_computed == 4


def test_freed_blocks_stay_cached_until_overwritten():
    bm = BlockManager(4, 4)
    a = seq(range(9))
    bm.allocate(a)
    computed(bm, a)
    first = a.block_table[:2]
    bm.deallocate(a)
    assert bm.num_free == 4
    b = seq(list(range(8)) + [50, 51])
    assert bm.num_new_blocks(b) == 3  # the two revived blocks come out of the free list too
    bm.allocate(b)
    assert b.block_table[:2] == first and b.num_computed == 8
    bm.deallocate(b)
    # fill the pool with other tokens: LRU hands out the least recently freed blocks first, then the cached ones
    c = seq([77] * 16)
    bm.allocate(c)
    bm.deallocate(c)
    d = seq(list(range(8)) + [1])
    bm.allocate(d)
    assert d.num_computed == 0  # the old blocks were overwritten: no stale hit


def test_register_only_after_kv_written():
    bm = BlockManager(8, 4)
    a = seq(range(8))
    bm.allocate(a)
    assert bm.hash_to_block == {}
    a.num_computed = 3
    bm.register_computed(a)
    assert bm.hash_to_block == {}
    a.num_computed = 4
    bm.register_computed(a)
    assert len(bm.hash_to_block) == 1


def test_invalidate_drops_cache_and_stops_stale_sequences():
    bm = BlockManager(16, 4)
    a = seq(range(9))
    bm.allocate(a)
    a.num_computed = 4
    bm.register_computed(a)
    bm.invalidate()
    a.num_computed = 8
    bm.register_computed(a)  # KV from the old weights: must not be registered
    assert bm.hash_to_block == {}
    b = seq(range(9))
    bm.allocate(b)
    assert b.num_computed == 0


def test_append_slots_and_can_append():
    bm = BlockManager(3, 4)
    a = seq(range(4))
    bm.allocate(a)
    assert bm.can_append(a, 12) and not bm.can_append(a, 13)
    bm.append_slots(a, 9)
    assert len(a.block_table) == 3 and bm.num_free == 0
    with pytest.raises(RuntimeError):
        bm.append_slots(a, 13)


def test_fork_shares_full_blocks_and_copies_partial():
    bm = BlockManager(8, 4)
    p = seq(range(6))
    bm.allocate(p)
    p.num_computed = 6
    c = p.fork(1, 5)
    copies = bm.fork(p, c)
    assert c.block_table[0] == p.block_table[0] and bm.blocks[p.block_table[0]].ref_count == 2
    assert copies == [(p.block_table[1], c.block_table[1])] and c.block_table[1] != p.block_table[1]
    q = seq(range(8))
    bm.allocate(q)
    q.num_computed = 8
    d = q.fork(1, 5)
    assert bm.fork(q, d) == [] and d.block_table == q.block_table


def test_usage_and_reset():
    bm = BlockManager(10, 2)
    a = seq(range(5))
    bm.allocate(a)
    assert bm.usage() == pytest.approx(0.3)
    bm.reset()
    assert bm.num_free == 10 and bm.epoch == 1
