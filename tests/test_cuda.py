"""GPU-only checks of the native engine, the rollout worker and the actor; skipped where there is
no CUDA GPU (``bench/gpu_check.sh`` runs them on a lent GPU machine, with the ``cuda`` cases of the
logits, greedy, bf16 and speculative-sampling tests in test_rollout_engine.py /
test_rollout_bf16.py / test_rollout_spec.py). Here: seeded samples equal to the CPU's (the
sampler's draws hash (seed, position), never the device's RNG), weight updates, memory release, the
KV pool sized from free device memory, an actor step whose weights the engine then serves, the
rollout worker's engine on its GPU in bf16, and one-GPU training under bf16 autocast over fp32
master weights. fp32 matmuls on CUDA run without TF32 (torch's default), so fp32 results compare at
1e-4."""

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
    metrics = actor.update_actor(batch)
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


def test_the_rollout_worker_runs_its_engine_on_the_gpu_in_bf16(monkeypatch):
    """A rollout worker in a process with a GPU builds its engine there (weights, KV cache,
    sampling) from the model loaded on the CPU; rollout.backend_options.dtype=auto is bf16 on a GPU
    with native bf16 (compute capability >= 8.0), and it generates."""
    from hybridrl.config import load_config
    from hybridrl.rollout.worker import RolloutWorker

    monkeypatch.delenv("HYBRIDRL_AUTO_PRECISION", raising=False)
    cfg = load_config(Config, None, ["controller.num_threads=1", "rollout.max_new_tokens=4"])
    w = RolloutWorker(WorkerContext(role="rollout", rank=0, world_size=1, pool="p"), cfg, None)
    eng = w.backend.engine
    want = torch.bfloat16 if torch.cuda.get_device_capability()[0] >= 8 else torch.float32
    assert eng.device.type == "cuda" and eng.dtype == want
    assert eng.runner.k_cache.device.type == "cuda" and eng.runner.embed.dtype == want
    ps = [[3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]  # inside the task tokenizer's vocabulary
    out = w.backend.generate(reqs(ps), SamplingParams(max_new_tokens=4, n=2, seed=1))
    assert len(out) == 4 and all(len(s.response_ids) == len(s.log_probs) for s in out)


def test_one_gpu_trains_under_bf16_autocast_with_fp32_master_weights(monkeypatch):
    from test_lora import make_cfg, rl_batch

    from hybridrl.learner import Learner
    from hybridrl.parallel.precision import autocast_device, autocast_dtype

    if torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("no native bf16 on this GPU")
    monkeypatch.delenv("HYBRIDRL_AUTO_PRECISION", raising=False)
    cfg: Config = make_cfg(rank=0, lr=1e-3)
    cfg.fsdp.strategy = "none"
    actor = Learner(WorkerContext(rank=0, world_size=1, role="learner", pool="p"), cfg, None)
    assert (autocast_device(actor.model), autocast_dtype(actor.model)) == ("cuda", torch.bfloat16)
    metrics = actor.update_actor(rl_batch(actor))
    assert all(torch.isfinite(torch.tensor(float(v))) for v in metrics.values())
    params = list(actor.model.parameters())
    assert {(p.device.type, p.dtype) for p in params} == {("cuda", torch.float32)}
    state = [v for s in actor.optimizer.state.values() for k, v in s.items() if k != "step"]
    assert state and {t.dtype for t in state} == {torch.float32}
