"""Weight sync actor -> rollout across processes under Ray, against this machine's memcpy bandwidth.

    python bench/weight_sync.py [--model small] [--repeats 5] [--bucket-mb 64] [--actor-ranks 1]

The learner holding the actor (``--actor-ranks`` FSDP2 ranks) and the rollout (hf backend) are
separate Ray actors on a local cluster. One sync is what the trainer does (``Roles.sync_weights``
with a transport of ``parallel/weight_sync.py``, one instance per process): every actor rank runs
``publish`` (the ranks gather the weights in buckets) and rank 0 returns a handle; every rollout
rank runs ``load`` with it. Transports: ``shm`` (the same-node path: rank 0 copies the buckets into
a reused shared-memory staging file, the handle is its path and layout) and ``store`` (the
cross-node path, reported as ``store_*``: rank 0 puts each bucket into the object store as numpy
arrays, the handle is the references); the rollout reads the buckets itself and copies them into its
live weights. The time is the driver's wall time of the whole sync (both remote calls); bytes are
the tensor bytes synced. memcpy: copying a buffer of the same size into an existing buffer in this
process (``torch.Tensor.copy_``, 1 thread, best of 3), measured right before each sync;
``fraction_of_memcpy`` is memcpy time / sync time of the best pair (``_median``: the median pair),
``memcpy_bytes_per_s`` the best memcpy seen.

A sync makes two copies (into the staging memory, then into the rollout's weights), so one memcpy is
a hard ceiling and 0.5 the best a two-copy design can do. ``rehomed``: whether the ``shm`` transport
re-homed the actor's parameters into its staging file (a single-rank actor without LoRA that offers
``rehome_parameters``); then the actor side copies nothing and one copy is left.

``lora_bytes_ratio``: bytes of one LoRA sync (rank 8 on q,k,v,o,gate,up,down: the adapters and their
scales, what ``Learner.weight_buckets`` sends after the first sync) over the full sync's bytes.

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from hybridrl.parallel.buckets import BUCKET_BYTES

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def transport_of(worker, name: str, bucket_bytes: int = 0):
    """This process's transport ``name``, kept on the worker between syncs (a staging file is
    reused)."""
    from hybridrl.parallel.weight_sync import make_transport

    held = worker.__dict__.setdefault("bench_transports", {})
    if name not in held:
        held[name] = make_transport(name, bucket_bytes or BUCKET_BYTES)
    return held[name]


def publish(worker, name: str, bucket_bytes: int, version: int):
    """On every actor rank: rank 0 returns the handle."""
    return transport_of(worker, name, bucket_bytes).publish(worker, version)


def load(worker, name: str, handle, version: int) -> int:
    """On every rollout rank."""
    return transport_of(worker, name).load(worker.backend, handle, version)


def is_rehomed(worker) -> bool:
    shm = worker.__dict__.get("bench_transports", {}).get("shm")
    return shm is not None and shm.rehomed


def close_transports(worker) -> None:
    for t in worker.__dict__.pop("bench_transports", {}).values():
        t.close()


def lora_ratio(cfg, full_bytes: int) -> tuple[float, str]:
    """Bytes of an adapter-only sync / bytes of a full sync, from a real LoRA actor when
    available."""
    from hybridrl.config import Config, load_config
    from hybridrl.controller import WorkerContext
    from hybridrl.learner import Learner

    try:
        from hybridrl.learner import lora

        lcfg = load_config(
            Config,
            None,
            [f"model.name={cfg.model.name}", "actor.lora_rank=8", "controller.num_threads=1"],
        )
        actor = Learner(WorkerContext(rank=0, world_size=1, role="learner", pool="p"), lcfg, None)
        actor.weight_buckets()  # the first sync also sends the base weights
        return lora.sync_bytes(
            actor.weight_buckets()
        ) / full_bytes, "measured: Learner(lora_rank=8).weight_buckets() after the first sync"
    except Exception as exc:  # LoRA not available: count rank-8 adapter parameters on the targets
        from hybridrl.models.loading import load_model

        model, _ = load_model(cfg, None)
        targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
        params = sum(
            8 * (m.in_features + m.out_features)
            for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and n.split(".")[-1] in targets
        )
        return (
            params * 4 / full_bytes,
            f"computed: rank-8 adapter parameter count ({type(exc).__name__})",
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--actor-ranks", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(1)

    import ray

    from hybridrl.config import Config, load_config
    from hybridrl.controller import ResourcePool, WorkerGroup, init_ray
    from hybridrl.learner import Learner
    from hybridrl.rollout.worker import RolloutWorker

    cfg = load_config(Config, None, [f"model.name={args.model}", "controller.num_threads=1"])
    init_ray(num_cpus=max(2, args.actor_ranks + 1))
    actor = WorkerGroup(
        Learner,
        ResourcePool("train", workers_per_node=args.actor_ranks, cpus_per_worker=1),
        role="learner",
        backend="ray",
        args=(cfg, None),
    )
    rollout = WorkerGroup(
        RolloutWorker,
        ResourcePool("gen", cpus_per_worker=1),
        role="rollout",
        backend="ray",
        args=(cfg, None),
    )
    bucket_bytes = args.bucket_mb << 20

    transports = ("shm", "store")

    def one_sync(version: int, transport: str) -> float:
        t0 = time.perf_counter()
        handle = actor.apply_all(publish, transport, bucket_bytes, version)[0]
        rollout.apply_all(load, transport, handle, version)
        dt = time.perf_counter() - t0
        del handle
        return dt

    sizes = actor.apply_all(
        lambda w: sum(p.numel() * p.element_size() for p in w.model.parameters())
    )
    full_bytes = int(sizes[0])  # a DTensor counts its global size
    # this machine is shared and its load changes by the second: each sync is paired with a
    # memcpy measured just before it (same size, this process, 1 thread), and the fraction is
    # taken per pair
    src = torch.ones(full_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in

    def memcpy_s() -> float:
        t0 = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - t0

    times, fractions, memcpys = {}, {}, []
    for transport in transports:
        one_sync(0, transport)  # warm-up: connections, first touch of the staging pages
        times[transport], fractions[transport] = [], []
        for v in range(1, args.repeats + 1):
            m = min(memcpy_s() for _ in range(3))
            t = one_sync(v, transport)
            memcpys.append(m)
            times[transport].append(t)
            fractions[transport].append(m / t)
    rehomed = any(actor.apply_all(is_rehomed))
    for wg in (actor, rollout):
        wg.apply_all(close_transports)
    for wg in (actor, rollout):
        if wg.world_size > 1:
            wg.close()
        wg.shutdown()
    ray.shutdown()
    memcpy = full_bytes / min(memcpys)
    ratio, source = lora_ratio(cfg, full_bytes)
    out = {
        "model": args.model,
        "actor_ranks": args.actor_ranks,
        "sync_bytes": full_bytes,
        "bucket_bytes": bucket_bytes,
        "memcpy_bytes_per_s": round(memcpy),
    }
    for (
        transport,
        ts,
    ) in times.items():  # headline: shm, what Roles.sync_weights uses when the roles share a node
        best, median = min(ts), statistics.median(ts)
        key = "" if transport == "shm" else "store_"
        out |= {
            f"{key}sync_seconds_best": round(best, 4),
            f"{key}sync_seconds_median": round(median, 4),
            f"{key}sync_bytes_per_s": round(full_bytes / best),
            f"{key}fraction_of_memcpy": round(max(fractions[transport]), 3),  # best pair
            f"{key}fraction_of_memcpy_median": round(statistics.median(fractions[transport]), 3),
        }
    out |= {
        "transport": "shm (same node; store_*: object store, the cross-node path)",
        "rehomed": rehomed,
        "lora_bytes_ratio": round(ratio, 5),
        "lora_bytes_ratio_source": source,
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
