"""Expert parallelism on ``tiny_moe``: EP 2 against one process, and the update step's time at
EP 1 (plain FSDP2) and EP 2 on the same 2 gloo ranks.

    python bench/moe_ep.py [--rows 64] [--steps 5] [--threads 1]

One process builds the learner (fp32), a fixed batch of ``--rows`` ragged rows (prompts up to 8
tokens, responses up to 24) and runs the log-probs and one update on it. Two rank processes then
build an EP 2 learner and an EP 1 learner from the same seed, run the same log-probs and update
on their halves of the batch (the EP 2 results against the single process: ``max_abs_diff``,
the largest difference of log-probs and updated weights), then alternate further updates of the
two learners on the same halves, ``--steps`` each; a step's time is the slower rank's
``update_actor`` (a forward and backward per micro-batch and one optimizer step), and
``step_seconds`` holds the median per EP size (EP 1 is the baseline of the same run).
``traffic_rows`` are the (token, expert) rows each rank sent and received through the EP 2
exchanges of the timed steps.

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from hybridrl.config import Config  # noqa: E402
from hybridrl.controller import WorkerContext  # noqa: E402
from hybridrl.protocol import Batch  # noqa: E402

WORLD = 2


def make_cfg(ep_size: int, rows: int) -> Config:
    cfg = Config()
    cfg.model.name = "tiny_moe"
    cfg.actor.ppo_minibatch_size = rows  # one optimizer step per update
    cfg.fsdp.mixed_precision = "fp32"
    cfg.moe.ep_size = ep_size
    return cfg


def make_batch(vocab: int, rows: int, seed: int = 0) -> Batch:
    """Left-padded prompts (2..8 tokens) ++ right-padded responses (1..24 tokens), random ids,
    random advantages."""
    g = torch.Generator().manual_seed(seed)
    p, r = 8, 24
    p_len = torch.randint(2, p + 1, (rows,), generator=g)
    r_len = torch.randint(1, r + 1, (rows,), generator=g)
    pmask = (torch.arange(p) >= p - p_len[:, None]).long()
    rmask = (torch.arange(r) < r_len[:, None]).long()
    prompts = torch.randint(3, vocab, (rows, p), generator=g) * pmask
    responses = torch.randint(3, vocab, (rows, r), generator=g) * rmask
    adv = torch.randn(rows, 1, generator=g).expand(rows, r) * rmask
    return Batch(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": torch.cat([pmask, rmask], 1),
            "response_mask": rmask.float(),
            "advantages": adv.contiguous(),
        }
    )


def with_old(learner, batch: Batch) -> Batch:
    """``batch`` with the learner's current log-probs as old / rollout log-probs."""
    old = learner.compute_log_prob(batch)["old_log_probs"]
    return batch | Batch({"old_log_probs": old, "rollout_log_probs": old, "ref_log_probs": old})


def weights(learner) -> dict[str, torch.Tensor]:
    return {n: t.clone() for bucket in learner.weight_buckets(1 << 20) for n, t in bucket}


# --- the ranks ------------------------------------------------------------------------------------
def rank_main(rank: int, port: int, workdir: str) -> None:
    from hybridrl.learner import Learner
    from hybridrl.moe.ep import pop_traffic
    from hybridrl.parallel import distributed

    work = Path(workdir)
    args = json.loads((work / "args.json").read_text())
    torch.set_num_threads(args["threads"])
    batch = Batch(torch.load(work / "batch.pt", weights_only=True))
    part = batch.chunk(WORLD)[rank]
    ctx = WorkerContext(
        rank=rank, world_size=WORLD, role="learner", pool="p", master_port=port, num_threads=1
    )
    learners = {ep: Learner(ctx, make_cfg(ep, args["rows"]), None) for ep in (2, 1)}
    first = with_old(learners[2], part)
    out = {"logp": first["old_log_probs"]}
    for ep, learner in learners.items():  # the first update (not timed: it also warms up)
        learner.update_actor(with_old(learner, part))
        if ep == 2:
            out["weights"] = weights(learner)
    pop_traffic(learners[2].model)
    times: dict[int, list[float]] = {1: [], 2: []}
    for _ in range(args["steps"]):
        for ep, learner in learners.items():
            mb = with_old(learner, part)
            distributed.barrier()
            t0 = time.perf_counter()
            learner.update_actor(mb)
            dt = time.perf_counter() - t0
            times[ep].append(float(distributed.all_reduce([dt], op="max")[0]))
    out["times"] = times
    out["traffic"] = distributed.all_gather_object(pop_traffic(learners[2].model))
    for learner in learners.values():
        learner.close()
    if rank == 0:
        torch.save(out, work / "ranks.pt")


def launch(work: Path) -> list[subprocess.Popen]:
    from hybridrl.controller.worker import find_free_port

    port = str(find_free_port("127.0.0.1"))
    env = os.environ | {
        "OMP_NUM_THREADS": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port,
        "WORLD_SIZE": str(WORLD),
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    return [
        subprocess.Popen(
            [sys.executable, __file__, "rank", str(r), port, str(work)],
            env=env | {"RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(WORLD)
    ]


def run_ep(rows: int = 64, steps: int = 5, threads: int = 1) -> dict:
    """EP 2 against one process on the same batch (``max_abs_diff``), and the median update-step
    seconds at EP 1 and EP 2 on 2 ranks (``step_seconds``); see the module docstring."""
    from hybridrl.learner import Learner

    torch.set_num_threads(threads)
    single = Learner(
        WorkerContext(rank=0, world_size=1, role="learner", pool="p", num_threads=threads),
        make_cfg(1, rows),
        None,
    )
    batch = make_batch(single.model.config.vocab_size, rows)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        torch.save(batch.tensors, work / "batch.pt")
        (work / "args.json").write_text(json.dumps({"rows": rows, "steps": steps, "threads": 1}))
        procs = launch(work)
        first = with_old(single, batch)
        t0 = time.perf_counter()
        single.update_actor(first)
        single_s = time.perf_counter() - t0
        ref = weights(single)
        logs = [p.communicate(timeout=1800)[0] for p in procs]
        if any(p.returncode for p in procs):
            raise RuntimeError("a rank failed:\n" + "\n".join(log[-3000:] for log in logs))
        got = torch.load(work / "ranks.pt", weights_only=False)
    n0 = len(batch.chunk(WORLD)[0])
    logp_diff = (got["logp"] - first["old_log_probs"][:n0]).abs().max().item()
    weight_diff = max((ref[k] - got["weights"][k]).abs().max().item() for k in ref)
    median = {str(ep): round(statistics.median(t), 4) for ep, t in got["times"].items()}
    return {
        "max_abs_diff": max(logp_diff, weight_diff),
        "logp_max_abs_diff": logp_diff,
        "weights_max_abs_diff": weight_diff,
        "step_seconds": median,
        "ep2_over_ep1": round(median["2"] / median["1"], 3),
        "step_seconds_all": {str(ep): [round(x, 4) for x in t] for ep, t in got["times"].items()},
        "single_process_first_step_seconds": round(single_s, 4),
        "traffic_rows": {
            "sent": [t[0] for t in got["traffic"]],
            "received": [t[1] for t in got["traffic"]],
        },
        "rows": rows,
        "tokens": int(batch["attention_mask"].sum()),
        "steps": steps,
        "threads": threads,
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    out = run_ep(a.rows, a.steps, a.threads)
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "rank":
        try:
            rank_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
        except BaseException:
            import traceback

            traceback.print_exc()
            sys.stdout.flush()
            os._exit(1)
        sys.stdout.flush()
        os._exit(0)  # FSDP2's reference cycles keep gloo threads alive (parallel/distributed.py)
    main()
