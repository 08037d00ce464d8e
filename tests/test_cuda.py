"""GPU-only checks of the native engine and the actor; skipped where there is no CUDA GPU
(``bench/gpu_check.sh`` runs them on a lent GPU machine, with the ``cuda`` cases of the logits,
greedy, bf16 and speculative-sampling tests in test_rollout_engine.py / test_rollout_bf16.py /
test_rollout_spec.py). Here: seeded samples equal to the CPU's (the sampler's draws hash
(seed, position), never the device's RNG), weight updates, memory release, the KV pool sized from
free device memory, and an actor step whose weights the engine then serves. fp32 matmuls on CUDA run
without TF32 (torch's default), so fp32 results compare at 1e-4."""

import pytest
import torch
from test_rollout_engine import Tok, greedy, model, prompts, rcfg, reqs

from hybridrl.config import Config
from hybridrl.controller import WorkerContext
from hybridrl.rollout import SamplingParams
from hybridrl.rollout.backends.native import NativeRollout
from hybridrl.rollout.sequence import Sequence

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEV = torch.device("cuda")


def test_seeded_samples_on_the_gpu_equal_the_cpu_samples():
    m = model()
    p = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=12, n=4, seed=5)
    cpu = NativeRollout(m, Tok(), rcfg()).generate(reqs(prompts([4, 9, 6])), p)
    gpu = NativeRollout(model().to(DEV), Tok(), rcfg()).generate(reqs(prompts([4, 9, 6])), p)
    assert [s.response_ids for s in gpu] == [s.response_ids for s in cpu]
    for a, b in zip(gpu, cpu):
        assert torch.allclose(torch.tensor(a.log_probs), torch.tensor(b.log_probs), atol=1e-4)


def test_update_weights_release_and_wake_up_on_the_gpu():
    m, new = model(seed=0).to(DEV), model(seed=1).to(DEV)
    eng = NativeRollout(m, Tok(), rcfg(kv_cache_bytes=256 << 20))
    ps = prompts([5, 9])
    before = eng.generate(reqs(ps), greedy(8))
    eng.update_weights(iter(new.state_dict().items()), version=1)
    after = eng.generate(reqs(ps), greedy(8))
    for p, s in zip(ps, after):
        want = new.generate(
            torch.tensor([p], device=DEV), max_new_tokens=8, do_sample=False, pad_token_id=0
        )
        assert s.response_ids == want[0, len(p) :].tolist() and s.versions == [1] * 8
    assert [s.response_ids for s in after] != [s.response_ids for s in before]
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    eng.release_memory()
    assert held - torch.cuda.memory_allocated() >= 250 << 20  # the KV pool went back to the device
    eng.wake_up()
    assert [s.response_ids for s in eng.generate(reqs(ps), greedy(8))] == [
        s.response_ids for s in after
    ]


def test_kv_pool_sized_from_free_device_memory():
    m = model().to(DEV)
    free = torch.cuda.mem_get_info(DEV)[0]
    eng = NativeRollout(m, Tok(), rcfg(kv_cache_memory_fraction=0.05))
    pool = eng.engine.num_blocks * eng.engine.runner.bytes_per_block()
    assert 0.8 * 0.05 * free <= pool <= 0.05 * free
    assert len(eng.generate(reqs(prompts([4])), greedy(4))[0].response_ids) == 4


def test_actor_step_on_the_gpu_and_its_weights_served_by_the_engine():
    from test_lora import make_cfg, rl_batch

    from hybridrl.learner import Learner

    cfg: Config = make_cfg(rank=0, lr=1e-3)
    actor = Learner(WorkerContext(rank=0, world_size=1, role="learner", pool="p"), cfg, None)
    assert next(actor.model.parameters()).device.type == "cuda"
    batch = rl_batch(actor)
    metrics = actor.update_policy(batch)
    assert all(torch.isfinite(torch.tensor(float(v))) for v in metrics.values())
    eng = NativeRollout(actor.model, actor.tokenizer, rcfg())
    assert (
        eng.update_weights(
            ((n, t) for bucket in actor.weight_buckets() for n, t in bucket), version=1
        )
        > 0
    )
    ids = [3, 4, 5, 6, 7, 8]  # inside the char tokenizer's vocabulary
    with torch.no_grad():
        ref = actor.model(torch.tensor([ids], device=DEV)).logits[0, -1].float()
    runner, bm = eng.engine.runner, eng.engine.bm
    s = Sequence("x", ids, SamplingParams(), 0)
    bm.allocate(s)
    with torch.no_grad():
        got = runner.execute([s], [len(ids)])[0]
    bm.deallocate(s)
    assert (got - ref).abs().max() <= 1e-4
