"""Block manager and prefix hashing: pure Python, no model."""

import pytest

import hybridrl.rollout.block_manager as bmod
from hybridrl.rollout.block_manager import BlockManager
from hybridrl.rollout.sequence import Sequence
from hybridrl.sampling import SamplingParams

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
    b = seq(
        range(8)
    )  # exactly the two cached blocks: the second must be recomputed for the last logits
    bm.allocate(b)
    assert (
        b.num_computed == 4
        and b.block_table[0] == a.block_table[0]
        and b.block_table[1] != a.block_table[1]
    )


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
    # fill the pool with other tokens: LRU hands out the least recently freed
    # blocks first, then the cached ones
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


def test_same_last_block_after_different_prefixes_is_never_shared():
    bm = BlockManager(16, 4)
    a = seq([1, 2, 3, 4, 9, 9, 9, 9, 0])
    bm.allocate(a)
    computed(bm, a)
    b = seq([5, 6, 7, 8, 9, 9, 9, 9, 0])  # the same second block behind another first block
    bm.allocate(b)
    assert b.num_computed == 0 and not set(b.block_table) & set(a.block_table)


_M64 = (1 << 64) - 1
_P1, _P2, _P5 = (
    11400714785074694791,
    14029467366897019727,
    2870177450012600261,
)  # CPython's tuple hash (xxHash)


def _tuple_lanes(items):
    acc = _P5
    for item in items:
        acc = (acc + (hash(item) & _M64) * _P2) & _M64
        acc = (((acc << 31) | (acc >> 33)) & _M64) * _P1 & _M64
    return acc


def _colliding_block(block):
    """Another 4-token block with the same Python tuple hash as ``block``: CPython's tuple hash is
    unkeyed and invertible, so the last token that completes a collision can be solved for."""
    want = (_tuple_lanes(block) * pow(_P1, -1, 1 << 64)) & _M64
    want = ((want >> 31) | (want << 33)) & _M64  # undo the rotation
    for third in range(1000):
        last = ((want - _tuple_lanes((5, 6, third))) * pow(_P2, -1, 1 << 64)) & _M64
        if last < (1 << 61) - 1:  # a non-negative int hashes to itself below the Mersenne modulus
            return [5, 6, third, last]
    raise AssertionError("no collision found")


def test_a_collision_of_python_tuple_hashes_cannot_serve_another_prefix():
    a0 = [1, 2, 3, 4]
    b0 = _colliding_block(a0)
    assert b0 != a0 and hash((-1, tuple(b0))) == hash(
        (-1, tuple(a0))
    )  # the former chain key collides
    bm = BlockManager(16, 4)
    c = seq(b0 + [0])  # registers b0 first, under the first-block key
    bm.allocate(c)
    computed(bm, c)
    a = seq(
        a0 + [7, 7, 7, 7, 0]
    )  # a0's block is not the one found under that key; its second block is registered
    bm.allocate(a)
    computed(bm, a)
    b = seq(
        b0 + [7, 7, 7, 7, 0]
    )  # b0 hits c's block; its second block must not come from a (KV of prefix a0)
    bm.allocate(b)
    assert b.block_table[0] == c.block_table[0] and b.num_computed == 4
    assert b.block_table[1] != a.block_table[1]


def test_prefix_hits_count_as_draft_computed_only_where_the_draft_wrote_kv():
    bm = BlockManager(16, 4)
    a = seq(range(13))
    bm.allocate(a)
    a.num_draft_computed = 4  # the draft followed the first block only
    computed(bm, a)
    b = seq(list(range(12)) + [99])
    bm.allocate(b)
    assert b.num_computed == 12 and b.num_draft_computed == 4
    b.num_computed = b.num_draft_computed = (
        12  # now the draft caught up on b: its blocks are marked
    )
    bm.register_computed(b)
    c = seq(list(range(12)) + [98])
    bm.allocate(c)
    assert c.num_computed == c.num_draft_computed == 12
