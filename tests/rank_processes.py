"""Launching a test file's own ranks as processes (one torch.distributed rank each, gloo)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hybridrl.controller.worker import find_free_port

ROOT = str(Path(__file__).resolve().parents[1])


def rank_env(**extra: str) -> dict:
    """A rank process's environment: one thread, the repository importable, local rendezvous."""
    return os.environ | {
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "MASTER_ADDR": "127.0.0.1",
        "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        **extra,
    }


def launch_ranks(script: str, world: int, workdir) -> list[subprocess.Popen]:
    """``python script rank <r> <port> <workdir>`` for every rank r, rendezvous on a free port."""
    port = str(find_free_port("127.0.0.1"))
    return [
        subprocess.Popen(
            [sys.executable, script, "rank", str(r), port, str(workdir)],
            env=rank_env(RANK=str(r), WORLD_SIZE=str(world), MASTER_PORT=port),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]


def wait_ranks(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    """Every rank's output; fails with the ends of their logs unless all exited with 0."""
    logs = [p.communicate(timeout=timeout)[0] for p in procs]
    if not all(p.returncode == 0 for p in procs):
        raise AssertionError("\n".join(log[-3000:] for log in logs))
    return logs
