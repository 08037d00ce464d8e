"""Weight-sync transports (``parallel/weight_sync.py``): each one carries a built-in model's weights
into a rollout engine bit for bit, carries a later change, and releases what it holds; the
shared-memory transport re-homes a single-process source's parameters into its staging file, where
they keep training."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from controller_workers import ray_cluster  # noqa: F401  (the fixture)

from hybridrl.config import RolloutConfig
from hybridrl.controller.colocated import RoleView
from hybridrl.models.factory import build_model
from hybridrl.parallel import distributed, shm_staging, weight_sync
from hybridrl.parallel.fsdp import iter_weight_buckets
from hybridrl.parallel.shm_staging import StagingFile
from hybridrl.parallel.weight_sync import (
    TRANSPORTS,
    FusedTransport,
    MemoryTransport,
    ShmTransport,
    StoreTransport,
    choose_transport,
    make_transport,
)
from hybridrl.rollout import ROLLOUT_BACKENDS

torch.set_num_threads(1)

SMALL_BUCKETS = 64 << 10  # several buckets for the tiny model
needs_shm = pytest.mark.skipif(weight_sync.SHM_DIR is None, reason="no /dev/shm")


class Tok:
    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2

    def __len__(self) -> int:
        return 96


class Source:
    """The trained side as the transports see it: one rank, no LoRA, the built-in tiny model."""

    world_size, weights_are_parameters = 1, True

    def __init__(self, seed: int = 0):
        self.model = build_model("tiny", Tok(), seed)
        self.weight_bucket_calls = 0

    def weight_buckets(self, bucket_bytes: int):
        """Every rank gathers; rank 0 returns the buckets, the others []
        (as the actor worker does)."""
        self.weight_bucket_calls += 1
        buckets = list(iter_weight_buckets(self.model, bucket_bytes))
        return buckets if distributed.rank() == 0 else []


class RehomingSource(Source):
    """A source that moves its own parameters into a staging file when the transport asks."""

    def rehome_parameters(self, stage):
        return shm_staging.rehome(self.model, stage)

    def unhome_parameters(self, stage):
        shm_staging.unhome(self.model, stage)


def engine(backend: str = "native", seed: int = 7):
    native = {"kv_cache_bytes": 4 << 20, "block_size": 4} if backend == "native" else {}
    cfg = RolloutConfig(backend=backend, backend_options={**native, "dtype": "fp32"})
    return ROLLOUT_BACKENDS.get(backend)(build_model("tiny", Tok(), seed), Tok(), cfg)


def params(source) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in source.model.named_parameters()}


def assert_loaded(eng, want: dict[str, torch.Tensor]) -> None:
    """The engine's live weights equal ``want`` bit for bit (a tied head is the embedding)."""
    live = eng._weight_tensors()
    assert set(want) - set(live) <= {"lm_head.weight"}
    for name, t in want.items():
        if name in live:
            got = live[name].reshape(t.shape)
            assert got.dtype == t.dtype and torch.equal(got, t), name


def perturb(source, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in source.model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.01)


def differs(eng, want: dict[str, torch.Tensor]) -> bool:
    live = eng._weight_tensors()
    return any(not torch.equal(live[n].reshape(t.shape), t) for n, t in want.items() if n in live)


def sync_twice(writer, reader, source, eng) -> list:
    """Publish + load, change the source, publish + load again; each load must be exact."""
    handles = []
    for version, seed in ((1, None), (2, 11)):
        if seed is not None:
            perturb(source, seed)
        want = params(source)
        assert differs(eng, want)  # the load below is what makes them equal
        handle = writer.publish(source, version)
        assert handle is not None
        assert reader.load(eng, handle, version) > 0
        assert eng.version == version
        assert_loaded(eng, want)
        handles.append(handle)
    return handles


def test_registry_names_every_transport():
    assert TRANSPORTS.names() == ["fused", "memory", "shm", "store"]
    t = make_transport("memory", bucket_bytes=123)
    assert isinstance(t, MemoryTransport) and t.bucket_bytes == 123


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_memory_hands_the_buckets_over(backend):
    source, eng = Source(), engine(backend)
    t = MemoryTransport(SMALL_BUCKETS)
    first, _ = sync_twice(t, t, source, eng)
    assert len(first) > 1  # bucketed
    ptrs = {p.data_ptr() for p in source.model.parameters()}
    assert all(x.data_ptr() in ptrs for b in first for _, x in b)  # the tensors themselves


def test_fused_single_rank_loads_in_memory():
    source, eng = Source(), engine()
    with FusedTransport(SMALL_BUCKETS) as t:
        sync_twice(t, t, source, eng)


def _fused_rank(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        source = Source(seed=0 if rank == 0 else 3)  # only rank 0's weights travel
        want = params(Source(seed=0))
        eng = engine(seed=7 + rank)
        t = FusedTransport(SMALL_BUCKETS)
        handle = t.publish(source, 1)
        assert (handle is not None) == (rank == 0)
        assert t.load(eng, handle, 1) > 0
        assert_loaded(eng, want)
    finally:
        dist.destroy_process_group()


def test_fused_broadcasts_rank0_buckets_to_the_other_ranks():
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_fused_rank, args=(2, port), nprocs=2, join=True, start_method="fork")


@needs_shm
def test_shm_copies_through_a_staging_file_and_close_removes_it():
    source, eng = Source(), engine()  # no rehome_parameters: the copy path
    writer, reader = ShmTransport(SMALL_BUCKETS), ShmTransport()
    first, second = sync_twice(writer, reader, source, eng)
    assert first.path == second.path == writer.path  # the file is reused
    assert os.path.exists(first.path) and first.path.startswith(weight_sync.SHM_DIR)
    assert source.weight_bucket_calls == 2
    with torch.no_grad():  # the file holds copies: the source's memory is its own
        next(source.model.parameters()).add_(1.0)
    with StagingFile.open(first.path) as staged:
        name, dtype, shape, offset, _ = first.layout[0]
        assert not torch.equal(staged.tensor(dtype, shape, offset), next(source.model.parameters()))
    reader.close()
    writer.close()
    assert not os.path.exists(first.path) and writer.path is None
    # a closed transport starts afresh
    perturb(source, 5)
    want = params(source)
    handle = writer.publish(source, 3)
    assert handle.path != first.path and reader.load(eng, handle, 3) > 0
    assert_loaded(eng, want)
    writer.close()
    reader.close()
    assert not os.path.exists(handle.path)


@needs_shm
def test_shm_grows_the_staging_file_when_the_weights_grow():
    small, big = Source(), Source()
    with torch.no_grad():
        big.model.model.norm.weight = torch.nn.Parameter(torch.ones(4096))
    with ShmTransport(rehome=False) as writer:
        first = writer.publish(small, 1)
        size = os.path.getsize(first.path)
        assert writer.publish(small, 2).path == first.path
        second = writer.publish(big, 3)
        assert second.path != first.path and not os.path.exists(first.path)
        assert os.path.getsize(second.path) > size


@needs_shm
def test_shm_rehomes_a_single_rank_source_which_keeps_training():
    source, eng = RehomingSource(), engine()
    writer, reader = ShmTransport(SMALL_BUCKETS), ShmTransport()
    before = params(source)
    first = writer.publish(source, 1)
    assert writer.rehomed and source.weight_bucket_calls == 0  # nothing gathered
    assert_same(source, before)  # values unchanged by the move
    staged = StagingFile.open(first.path)
    try:

        def in_file() -> bool:
            return all(
                torch.equal(
                    staged.tensor(dtype, shape, offset), dict(source.model.named_parameters())[n]
                )
                for n, dtype, shape, offset, _ in first.layout
            )

        assert in_file()
        assert reader.load(eng, first, 1) > 0
        assert_loaded(eng, before)
        # an optimizer step updates the parameters in place, inside the file
        ptrs = [p.data_ptr() for p in source.model.parameters()]
        opt = torch.optim.AdamW(source.model.parameters(), lr=1e-2)
        ids = torch.tensor([[3, 5, 7, 9, 11]])
        source.model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        trained = params(source)
        assert all(not torch.equal(trained[n], before[n]) for n in trained)
        assert [p.data_ptr() for p in source.model.parameters()] == ptrs
        assert in_file()  # the step's result is in the file without a publish
        second = writer.publish(source, 2)
        assert second == first and source.weight_bucket_calls == 0
        assert reader.load(eng, second, 2) > 0
        assert_loaded(eng, trained)
        # a parameter replaced from outside the file (a checkpoint load, say) is
        # re-homed at the next publish
        with torch.no_grad():
            norm = source.model.model.norm.weight
            norm.data = norm.data.clone() + 1.0
        want = params(source)
        third = writer.publish(source, 3)
        assert reader.load(eng, third, 3) > 0
        assert_loaded(eng, want)
    finally:
        staged.close()
    # close: the parameters leave the file (values kept), then it is removed; they still train
    kept = params(source)
    homes = {p.data_ptr() for p in source.model.parameters()}
    writer.close()
    reader.close()
    assert not os.path.exists(third.path) and not writer.rehomed
    assert_same(source, kept)
    assert not homes & {p.data_ptr() for p in source.model.parameters()}  # they moved out
    opt = torch.optim.SGD(source.model.parameters(), lr=1e-2)
    ids = torch.tensor([[3, 5, 7, 9, 11]])
    source.model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    assert all(not torch.equal(p, kept[n]) for n, p in source.model.named_parameters())


def assert_same(source, want: dict[str, torch.Tensor]) -> None:
    for n, p in source.model.named_parameters():
        assert torch.equal(p, want[n]), n


@needs_shm
def test_shm_does_not_rehome_when_turned_off_or_sharded():
    source = RehomingSource()
    for writer in (ShmTransport(rehome=False), ShmTransport()):
        if writer.rehome:
            source.world_size = 2
        with writer:
            handle = writer.publish(source, 1)
            staged = StagingFile.open(handle.path)
            try:
                assert not any(staged.contains(p) for p in source.model.parameters())
            finally:
                staged.close()
    assert source.weight_bucket_calls == 2


def test_store_puts_buckets_in_the_object_store(ray_cluster):  # noqa: F811
    import ray

    source, eng = Source(), engine()
    with StoreTransport(SMALL_BUCKETS) as t:
        first, _ = sync_twice(t, t, source, eng)
    assert len(first) > 1 and all(isinstance(r, ray.ObjectRef) for r in first)


class FakeGroup:
    def __init__(self, backend: str, nodes: list[tuple[str, bool]] | None = None):
        self.backend_name, self.nodes = backend, nodes

    def apply_all(self, fn):
        assert fn is weight_sync.where
        return self.nodes


def test_choose_transport_follows_where_the_roles_live():
    fused = FakeGroup("ray")
    assert (
        choose_transport(RoleView(fused, "actor", object), RoleView(fused, "rollout", object))
        == "fused"
    )
    assert choose_transport(FakeGroup("local"), FakeGroup("local")) == "memory"
    actor = FakeGroup("ray", [("n1", True), ("n2", True)])
    assert choose_transport(actor, FakeGroup("ray", [("n1", True), ("n1", True)])) == "shm"
    assert choose_transport(actor, FakeGroup("ray", [("n1", True), ("n2", True)])) == "store"
    no_shm = FakeGroup("ray", [("n1", False)])
    assert choose_transport(no_shm, FakeGroup("ray", [("n1", False)])) == "store"
