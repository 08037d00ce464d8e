"""Measured pipeline bubble: one real pipelined training step per schedule, timed per rank.

``measure(schedule, pp, n_microbatches)`` launches ``pp`` gloo ranks (one process and one torch
thread each) that cut an 8-layer, hidden-512 Qwen2 (vocabulary 2048, tied embeddings) into the
schedule's stages and run training steps of the RL loss (PPO clip, token-mean) over
``n_microbatches`` micro-batches of one 256-token row each: the schedule step, the tied-gradient
sum, the global norm clip and an AdamW step. Each stage's forward, backward and weight-gradient
actions and the loss are timed (``parallel/pipeline.py``: ``ComputeClock``, wrapped around the
stage's compute methods), so a rank's idle fraction is the share of the schedule step's wall time
it spends outside them: waiting for a peer, or in the schedule's own bookkeeping. One step warms
up; the next ``steps`` are measured.

Returns ``bubble_measured`` (mean over ranks), ``stage_idle`` (per rank), ``step_seconds`` (mean
wall time of a measured schedule step, slowest rank) and the settings. ``python
bench/pipeline_run.py`` prints one JSON object: 1F1B (the baseline) and DualPipeV at pp = 2 with 8
micro-batches, run alternately three times each in the same run (medians and every run).

On a machine with fewer cores than ranks the ranks also wait for a core, which is counted as
compute: the figures are then an upper bound of the compute share, and the schedules' ranking is
what to read.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEQ, PROMPT, HIDDEN, LAYERS, VOCAB = 256, 32, 512, 8, 2048


def _model():
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=1408,
        num_hidden_layers=LAYERS,
        num_attention_heads=8,
        num_key_value_heads=4,
        tie_word_embeddings=True,
        max_position_embeddings=SEQ,
    )
    return Qwen2ForCausalLM(cfg).float()


def _batch(rows: int):
    import torch

    from hybridrl.protocol import Batch

    g = torch.Generator().manual_seed(0)
    resp = SEQ - PROMPT
    prompts = torch.randint(3, VOCAB, (rows, PROMPT), generator=g)
    responses = torch.randint(3, VOCAB, (rows, resp), generator=g)
    ones = torch.ones(rows, resp)
    return Batch(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": torch.ones(rows, SEQ, dtype=torch.long),
            "response_mask": ones,
            "old_log_probs": -7.6 * ones,
            "advantages": torch.randn(rows, 1, generator=g).expand(rows, resp).contiguous(),
        }
    )


def _rank(rank: int, port: int, workdir: str, schedule: str, pp: int, n: int, steps: int):
    import torch

    from hybridrl.algorithms import LOSS_AGG, POLICY_LOSSES, agg_totals
    from hybridrl.config import AlgorithmConfig
    from hybridrl.controller import WorkerContext
    from hybridrl.learner.pipeline_update import logits_log_probs
    from hybridrl.parallel import distributed
    from hybridrl.parallel.pipeline import PipeLayout, Pipeline

    torch.set_num_threads(1)
    ctx = WorkerContext(rank=rank, world_size=pp, role="learner", pool="p", master_port=port)
    distributed.init_distributed(ctx)
    layout = PipeLayout(pp=pp, dp=1, rank=rank, schedule=schedule, microbatches=n)
    pl = Pipeline(_model(), layout)
    opt = torch.optim.AdamW(pl.parameters(), lr=1e-5)
    alg = AlgorithmConfig(policy_loss="ppo_clip")
    policy, agg = POLICY_LOSSES.get("ppo_clip"), LOSS_AGG.get("token-mean")
    batch = _batch(n)
    totals = agg_totals(batch["response_mask"])

    def loss_fn(logits, idx):
        mb = batch.index(idx)
        logp, _ = logits_log_probs(logits, mb, 1.0)
        return agg(policy(logp, mb, alg)[0], mb["response_mask"], totals)

    idle, walls = [], []
    for step in range(steps + 1):
        opt.zero_grad(set_to_none=True)
        pl.run_round(batch, loss_fn)
        pl.sync_tied_grads()
        pl.clip_grad_norm(1.0)
        opt.step()
        busy, wall = pl.clock.pop()
        if step:  # the first step warms up (allocations, first-touch pages)
            idle.append(1.0 - busy / wall)
            walls.append(wall)
    result = {"idle": sum(idle) / len(idle), "wall": sum(walls) / len(walls)}
    Path(workdir, f"rank{rank}.json").write_text(json.dumps(result))
    distributed.barrier()
    os._exit(0)


def measure(schedule: str, pp: int, n_microbatches: int, steps: int = 2) -> dict:
    """One measured pipeline run (see the module docstring)."""
    sys.path.insert(0, str(ROOT))
    from hybridrl.controller.worker import find_free_port

    port = str(find_free_port("127.0.0.1"))
    with tempfile.TemporaryDirectory() as work:
        env = os.environ | {
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "WORLD_SIZE": str(pp),
            "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        }
        args = [schedule, str(pp), str(n_microbatches), str(steps)]
        t0 = time.perf_counter()
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "rank", str(r), port, work, *args],
                env=env | {"RANK": str(r)},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for r in range(pp)
        ]
        logs = [p.communicate(timeout=3600)[0] for p in procs]
        if any(p.returncode for p in procs):
            raise RuntimeError("\n".join(log[-3000:] for log in logs))
        ranks = [json.loads(Path(work, f"rank{r}.json").read_text()) for r in range(pp)]
    stage_idle = [round(r["idle"], 4) for r in ranks]
    return {
        "schedule": schedule,
        "pp": pp,
        "n_microbatches": n_microbatches,
        "bubble_measured": round(sum(stage_idle) / pp, 4),
        "stage_idle": stage_idle,
        "step_seconds": round(max(r["wall"] for r in ranks), 3),
        "run_seconds": round(time.perf_counter() - t0, 1),
        "model": f"Qwen2 {LAYERS} layers, hidden {HIDDEN}, vocab {VOCAB}, tied",
        "tokens_per_microbatch": SEQ,
        "cpu_cores": os.cpu_count(),
    }


def main(repeats: int = 3) -> None:
    """1F1B (the baseline) and DualPipeV at pp = 2 with 8 micro-batches, run alternately
    ``repeats`` times each so that both see the same background load; the median of each."""
    runs: dict[str, list[dict]] = {"1f1b": [], "dualpipev": []}
    for _ in range(repeats):
        for schedule in runs:
            runs[schedule].append(measure(schedule, 2, 8))

    def median(values: list[float]) -> float:
        return sorted(values)[len(values) // 2]

    summary = {
        s: {
            "bubble_measured": median([r["bubble_measured"] for r in rs]),
            "step_seconds": median([r["step_seconds"] for r in rs]),
            "bubble_each_run": [r["bubble_measured"] for r in rs],
            "stage_idle_each_run": [r["stage_idle"] for r in rs],
        }
        for s, rs in runs.items()
    }
    out = {
        "baseline": "1f1b",
        "pp": 2,
        "n_microbatches": 8,
        "model": runs["1f1b"][0]["model"],
        "tokens_per_microbatch": SEQ,
        "cpu_cores": os.cpu_count(),
        "load_average_1min": os.getloadavg()[0],
        "schedules": summary,
        "dualpipev_below_1f1b": summary["dualpipev"]["bubble_measured"]
        < summary["1f1b"]["bubble_measured"],
    }
    print(json.dumps(out))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "rank":
        r, port, work, schedule, pp, n, steps = sys.argv[2:9]
        _rank(int(r), int(port), work, schedule, int(pp), int(n), int(steps))
    else:
        main()
