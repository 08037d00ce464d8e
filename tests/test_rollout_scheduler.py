"""Scheduler: continuous batching, token budget, chunked prefill, preemption. No model."""

from hybridrl.rollout.block_manager import BlockManager
from hybridrl.rollout.scheduler import Scheduler
from hybridrl.rollout.sequence import Sequence, Status
from hybridrl.sampling import SamplingParams


def make(num_blocks=64, block_size=4, max_seqs=8, budget=64):
    bm = BlockManager(num_blocks, block_size)
    return bm, Scheduler(bm, max_seqs, budget, watermark=0.0)


def seq(n, max_tokens=4, rid="r"):
    return Sequence(rid, list(range(1, n + 1)), SamplingParams(max_new_tokens=max_tokens), 0)


def run_step(sch, next_token=7):
    """What the engine does after the forward pass: advance KV, sample
    where complete, retire finished."""
    batch = sch.schedule()
    done = []
    for s, q in zip(batch.seqs, batch.num_tokens):
        s.num_computed += q
        sch.bm.register_computed(s)
        if s.num_computed == len(s):
            s.append(next_token, 0.0, 0)
            if s.num_completion_tokens >= s.max_tokens:
                done.append(s)
    sch.finish_many(done, [Status.TRUNCATED] * len(done))
    return batch, done


def test_prefill_and_decode_share_a_step():
    bm, sch = make()
    a = seq(5)
    sch.add(a)
    b1, _ = run_step(sch)
    assert b1.num_tokens == [5]
    sch.add(seq(3))
    b2, _ = run_step(sch)
    assert b2.num_tokens == [1, 3]  # a decodes while the newcomer prefills


def test_token_budget_chunks_long_prompts():
    bm, sch = make(budget=8)
    a = seq(20)
    sch.add(a)
    sizes = []
    while a.num_completion_tokens == 0:
        b, _ = run_step(sch)
        sizes.append(b.num_tokens)
    assert sizes == [[8], [8], [4]]


def test_continuous_batching_refills_at_once():
    bm, sch = make(max_seqs=2)
    short, long_, waiting = seq(2, max_tokens=1), seq(2, max_tokens=5), seq(2, max_tokens=1)
    for s in (short, long_, waiting):
        sch.add(s)
    b1, done = run_step(sch)
    assert b1.seqs == [short, long_] and done == [short]
    b2, _ = run_step(sch)
    assert waiting in b2.seqs and long_ in b2.seqs  # the freed place is taken in the very next step


def test_max_num_seqs_respected():
    bm, sch = make(max_seqs=3)
    for i in range(10):
        sch.add(seq(2, rid=str(i)))
    b, _ = run_step(sch)
    assert len(b.seqs) == 3 and len(sch.waiting) == 7


def test_preempts_newest_and_recomputes():
    bm, sch = make(num_blocks=4, block_size=2, max_seqs=4)
    old, new = seq(3, max_tokens=6, rid="old"), seq(3, max_tokens=6, rid="new")
    sch.add(old)
    sch.add(new)
    finished = []
    for _ in range(100):
        if not sch.has_work():
            break
        _, done = run_step(sch)
        finished += done
    assert sch.num_preemptions >= 1
    assert [s.request_id for s in finished][0] == "old"  # the oldest kept running
    for s in finished:
        assert s.completion_ids == [7] * 6 and s.num_prompt_tokens == 3
    assert bm.num_free == 4


def test_preempted_sequence_keeps_its_tokens():
    bm, sch = make(num_blocks=3, block_size=2)
    a, b = seq(2, max_tokens=10, rid="a"), seq(2, max_tokens=10, rid="b")
    sch.add(a)
    sch.add(b)
    for _ in range(3):
        run_step(sch)
    tokens_b = list(b.token_ids)
    while b.status is not Status.WAITING and sch.has_work():
        run_step(sch)
    assert b.token_ids[: len(tokens_b)] == tokens_b and b.block_table == [] and b.num_computed == 0
    assert sch.waiting[0] is b


def test_lookahead_reserves_slots():
    bm, sch = make(num_blocks=16, block_size=4)
    a = seq(4)
    sch.add(a)
    run_step(sch)
    sch.schedule(lookahead=5)  # pending token + 5 speculative slots -> 10 tokens -> 3 blocks
    assert len(a.block_table) == 3


def test_admission_waits_for_blocks():
    bm, sch = make(num_blocks=2, block_size=4, max_seqs=4)
    sch.add(seq(8, max_tokens=1, rid="big"))
    sch.add(seq(2, max_tokens=1, rid="small"))
    b, _ = run_step(sch)
    assert [s.request_id for s in b.seqs] == ["big"]
    b, _ = run_step(sch)
    assert [s.request_id for s in b.seqs] == ["small"]
